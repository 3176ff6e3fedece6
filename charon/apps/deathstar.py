"""DeathStarBench workloads (after Beldi / Styx §8.1): travel reservation and movie review.

Travel (hotel + flight):

- ``hotel`` ``"h007"`` / ``flight`` ``"f007"``: ``{name, lat, lon, rate, price, capacity, reservations: [user,...]}``
- ``geo`` ``"sf"`` (one region): a grid index in per-entity items named ``"CCCC:RRRR:h007"`` (grid column and
  row of 0.01 degree cells, then the hotel) -> ``[lat, lon]``; ``search`` range-scans the cells around the
  point row by row (``scan_items(start=..., stop=...)``) and asks the nearest hotels for their profile;
  ``recommend`` ranks by distance (grid squares widening until the 5 nearest are certain, the same answer as
  sorting the whole index), rate or price.
- ``user`` ``"u007"``: ``{password, logins, reservations}``; ``login`` checks the password;
  ``reserve(hotel, flight)`` books one room and one seat in one transaction: a sold-out flight raises
  :class:`SoldOut` and the room is released with it.

Movie review (DeathStarBench media service): ``compose_review`` (root, keyed by the review id) fans out to
7 functions: ``movie_user.get_user_id``, ``movie_title.get_movie_id``, ``review_text.upload_text``,
``movie_rating.upload_rating`` (synchronous calls), then ``review_storage.store_review``,
``user_review.add_review``, ``movie_review.add_review`` (asynchronous sends). The per-user and per-movie
review indexes are lists in the entity's value so :func:`check` can read them with ``read_state``.

Mix (``next_request``): 60% search, 39% recommend, 0.5% login, 0.5% reserve.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

from charon import Application, Context, Operator

Request = tuple[str, str, str, list]
Record = tuple[str, str, Any, "dict[str, Any] | None"]

hotel = Operator("hotel")
flight = Operator("flight")
geo = Operator("geo")
user = Operator("user")

compose_review = Operator("compose_review")
movie_user = Operator("movie_user")
movie_title = Operator("movie_title")
review_text = Operator("review_text")
movie_rating = Operator("movie_rating")
review_storage = Operator("review_storage")
user_review = Operator("user_review")
movie_review = Operator("movie_review")

REGION = "sf"
LAT0, LON0 = 37.70, -122.52
SPAN = 0.12  # degrees: hotels are spread over a SPAN x SPAN box
CELL = 0.01  # grid cell size in degrees


class SoldOut(Exception):
    """No room or seat left."""


class NotFound(Exception):
    """Unknown hotel, flight, user, movie or review."""


class InvalidLogin(Exception):
    """Wrong password."""


class DuplicateReview(Exception):
    """A review with this id is already stored."""


def cell(lat: float, lon: float) -> tuple[int, int]:
    """Grid cell (column, row) of a point; offset by 1000 so names sort as fixed-width positive numbers."""
    return 1000 + math.floor((lat - LAT0) / CELL), 1000 + math.floor((lon - LON0) / CELL)


def _dist2(lat: float, lon: float, p: list) -> float:
    return (p[0] - lat) ** 2 + (p[1] - lon) ** 2


# ---------------------------------------------------------------------------------------------- travel


def _book(ctx: Context, who: str) -> int:
    v = ctx.get()
    if v is None:
        raise NotFound(f"{ctx.operator} {ctx.key}")
    if len(v["reservations"]) >= v["capacity"]:
        raise SoldOut(f"{ctx.operator} {ctx.key} is full ({v['capacity']})")
    v["reservations"].append(who)
    ctx.put(v)
    return v["capacity"] - len(v["reservations"])


@hotel.function
async def reserve_room(ctx: Context, who: str) -> int:
    """Book one room for ``who``; returns the rooms left. Raises SoldOut at capacity."""
    return _book(ctx, who)


@flight.function
async def reserve_seat(ctx: Context, who: str) -> int:
    """Book one seat for ``who``; returns the seats left. Raises SoldOut at capacity."""
    return _book(ctx, who)


@hotel.function
async def get_profile(ctx: Context) -> dict:
    """Name, rate, price and rooms left."""
    v = ctx.get()
    if v is None:
        raise NotFound(f"hotel {ctx.key}")
    return {"id": ctx.key, "name": v["name"], "rate": v["rate"], "price": v["price"],
            "available": v["capacity"] - len(v["reservations"])}


def _nearby(ctx: Context, lat: float, lon: float, radius: int) -> list[tuple[str, list]]:
    cx, cy = cell(lat, lon)
    rows: list[tuple[str, list]] = []
    for x in range(cx - radius, cx + radius + 1):
        rows.extend(ctx.scan_items(start=f"{x:04d}:{cy - radius:04d}:", stop=f"{x:04d}:{cy + radius + 1:04d}:"))
    return rows


def _nearest(ctx: Context, lat: float, lon: float, n: int) -> list[tuple[str, list]]:
    """The ``n`` nearest index rows by (distance, name), as a sort of the whole index gives: grid squares
    widening from the point until the ``n``-th nearest is closer than any cell outside the square (a point
    outside lies more than ``radius`` cells away; half a cell of margin covers rounding), else the whole index."""
    radius = 3
    while radius <= int(SPAN / CELL) + 2:
        rows = _nearby(ctx, lat, lon, radius)
        rows.sort(key=lambda r: (_dist2(lat, lon, r[1]), r[0]))
        if len(rows) >= n and _dist2(lat, lon, rows[n - 1][1]) < ((radius - 0.5) * CELL) ** 2:
            return rows[:n]
        radius *= 2
    rows = ctx.scan_items()
    rows.sort(key=lambda r: (_dist2(lat, lon, r[1]), r[0]))
    return rows[:n]


@geo.function(public=True)
async def search(ctx: Context, lat: float, lon: float, k: int) -> list:
    """The ``k`` nearest hotels with rooms left among the ``2k`` nearest, nearest first: grid range scans widening
    from the point; the ``k`` nearest are asked for their profile, the next ``k`` only if some are sold out."""
    radius = 1
    rows = _nearby(ctx, lat, lon, radius)
    while len(rows) < k and radius < int(SPAN / CELL) + 2:
        radius *= 2
        rows = _nearby(ctx, lat, lon, radius)
    rows.sort(key=lambda r: (_dist2(lat, lon, r[1]), r[0]))
    names = [name.rsplit(":", 1)[1] for name, _ in rows[: 2 * k]]
    # the k nearest first; only if some are sold out, the next k (the answer is the same as asking all 2k)
    profs = await ctx.gather(*(ctx.call(hotel, h, get_profile) for h in names[:k]))
    found = [p for p in profs if p["available"] > 0]
    if len(found) < k and len(names) > k:
        more = await ctx.gather(*(ctx.call(hotel, h, get_profile) for h in names[k:]))
        found += [p for p in more if p["available"] > 0]
    return found[:k]


@geo.function(public=True)
async def recommend(ctx: Context, lat: float, lon: float, require: str) -> list:
    """Recommend up to 5 hotels around the point by ``require``: ``"dis"``, ``"rate"`` or ``"price"``."""
    if require == "dis":
        return [name.rsplit(":", 1)[1] for name, _ in _nearest(ctx, lat, lon, 5)]
    rows = _nearby(ctx, lat, lon, 2)
    profs = await ctx.gather(*(ctx.call(hotel, name.rsplit(":", 1)[1], get_profile) for name, _ in rows))
    if require == "rate":
        profs.sort(key=lambda p: (-p["rate"], p["id"]))
    else:
        profs.sort(key=lambda p: (p["price"], p["id"]))
    return [p["id"] for p in profs[:5]]


@user.function(public=True)
async def login(ctx: Context, password: str) -> bool:
    """Check the password (raises InvalidLogin) and count the login."""
    u = ctx.get()
    if u is None:
        raise NotFound(f"user {ctx.key}")
    if u["password"] != password:
        raise InvalidLogin(ctx.key)
    u["logins"] += 1
    ctx.put(u)
    return True


@user.function(public=True)
async def reserve(ctx: Context, hotel_id: str, flight_id: str) -> dict:
    """Book a room and a seat together: both or neither."""
    u = ctx.get()
    if u is None:
        raise NotFound(f"user {ctx.key}")
    rooms, seats = await ctx.gather(
        ctx.call(hotel, hotel_id, reserve_room, ctx.key), ctx.call(flight, flight_id, reserve_seat, ctx.key)
    )
    u["reservations"] += 1
    ctx.put(u)
    return {"rooms_left": rooms, "seats_left": seats}


# ---------------------------------------------------------------------------------------------- movies


@movie_user.function
async def get_user_id(ctx: Context) -> str:
    """User id of a username."""
    v = ctx.get()
    if v is None:
        raise NotFound(f"user {ctx.key}")
    return v["user_id"]


@movie_title.function
async def get_movie_id(ctx: Context) -> str:
    """Movie id of a title."""
    v = ctx.get()
    if v is None:
        raise NotFound(f"movie {ctx.key}")
    return v["movie_id"]


@review_text.function
async def upload_text(ctx: Context, text: str) -> str:
    """Store the review text (URLs shortened, as the text service does) and return it."""
    words = [("http://short/" + str(abs(hash_str(w)) % 100000)) if w.startswith("http") else w
             for w in text.split()]
    out = " ".join(words)
    ctx.put(out)
    return out


def hash_str(s: str) -> int:
    """A stable string hash (Python's hash() is salted per process)."""
    h = 0
    for ch in s:
        h = (h * 131 + ord(ch)) & 0xFFFFFFFF
    return h


@movie_rating.function
async def upload_rating(ctx: Context, rating: int) -> float:
    """Add a rating to the movie's running sum; returns the new average."""
    v = ctx.get(default={"sum": 0, "count": 0})
    v["sum"] += rating
    v["count"] += 1
    ctx.put(v)
    return v["sum"] / v["count"]


@review_storage.function
async def store_review(ctx: Context, review: dict) -> None:
    """Store the review record; a second store of the same id raises DuplicateReview."""
    if ctx.get() is not None:
        raise DuplicateReview(ctx.key)
    ctx.put(review)


@user_review.function
async def add_user_review(ctx: Context, review_id: str) -> None:
    """Append to the user's review list."""
    v = ctx.get(default=[])
    v.append(review_id)
    ctx.put(v)


@movie_review.function
async def add_movie_review(ctx: Context, review_id: str) -> None:
    """Append to the movie's review list."""
    v = ctx.get(default=[])
    v.append(review_id)
    ctx.put(v)


@compose_review.function(public=True)
async def compose(ctx: Context, username: str, title: str, rating: int, text: str) -> dict:
    """Compose a review (this entity's key is the review id) across the 7 review services."""
    if ctx.get() is not None:
        raise DuplicateReview(ctx.key)
    user_id, movie_id, stored_text = await ctx.gather(
        ctx.call(movie_user, username, get_user_id),
        ctx.call(movie_title, title, get_movie_id),
        ctx.call(review_text, ctx.key, upload_text, text),
    )
    avg = await ctx.call(movie_rating, movie_id, upload_rating, rating)
    ctx.send(review_storage, ctx.key, store_review,
             {"user_id": user_id, "movie_id": movie_id, "rating": rating, "text": stored_text,
              "ts": ctx.now()})
    ctx.send(user_review, user_id, add_user_review, ctx.key)
    ctx.send(movie_review, movie_id, add_movie_review, ctx.key)
    ctx.put(1)
    return {"review_id": ctx.key, "avg_rating": avg}


app = Application(
    "deathstar",
    [hotel, flight, geo, user, compose_review, movie_user, movie_title, review_text, movie_rating,
     review_storage, user_review, movie_review],
)

# ---------------------------------------------------------------------------------------------- population


def populate(hotels: int = 100, flights: int = 100, users: int = 500, capacity: int = 10,
             movies: int = 1000, movie_users: int = 1000, seed: int = 0) -> Iterator[Record]:
    """Yield the initial state as ``(operator, key, value, items)``."""
    rng = random.Random(seed)
    index: dict[str, list] = {}
    for h in range(hotels):
        lat, lon = LAT0 + rng.random() * SPAN, LON0 + rng.random() * SPAN
        key = f"h{h:03d}"
        yield "hotel", key, {"name": f"Hotel {h}", "lat": lat, "lon": lon, "rate": round(rng.uniform(1, 5), 1),
                             "price": rng.randint(50, 400), "capacity": capacity, "reservations": []}, None
        cx, cy = cell(lat, lon)
        index[f"{cx:04d}:{cy:04d}:{key}"] = [lat, lon]
    yield "geo", REGION, None, index
    for f in range(flights):
        yield "flight", f"f{f:03d}", {"name": f"Flight {f}", "lat": 0.0, "lon": 0.0, "rate": 0.0,
                                      "price": rng.randint(80, 900), "capacity": capacity,
                                      "reservations": []}, None
    for u in range(users):
        yield "user", f"u{u:03d}", {"password": f"pw{u}", "logins": 0, "reservations": 0}, None
    for u in range(movie_users):
        yield "movie_user", f"user{u}", {"user_id": f"mu{u}"}, None
    for m in range(movies):
        yield "movie_title", f"title{m}", {"movie_id": f"m{m}"}, None


# ---------------------------------------------------------------------------------------------- requests


def _point(rng: random.Random) -> tuple[float, float]:
    return LAT0 + rng.random() * SPAN, LON0 + rng.random() * SPAN


def reserve_request(rng: random.Random, hotels: int = 100, flights: int = 100, users: int = 500) -> Request:
    """A reservation of a random hotel and flight by a random user."""
    return "user", f"u{rng.randrange(users):03d}", "reserve", [f"h{rng.randrange(hotels):03d}",
                                                               f"f{rng.randrange(flights):03d}"]


def next_request(rng: random.Random, hotels: int = 100, flights: int = 100, users: int = 500) -> Request:
    """The travel mix: 60% search, 39% recommend, 0.5% login, 0.5% reserve."""
    x = rng.random()
    if x < 0.60:
        lat, lon = _point(rng)
        return "geo", REGION, "search", [lat, lon, 5]
    if x < 0.99:
        lat, lon = _point(rng)
        return "geo", REGION, "recommend", [lat, lon, rng.choice(["dis", "rate", "price"])]
    if x < 0.995:
        u = rng.randrange(users)
        return "user", f"u{u:03d}", "login", [f"pw{u}"]
    return reserve_request(rng, hotels, flights, users)


def next_movie_request(rng: random.Random, movies: int = 1000, movie_users: int = 1000) -> Request:
    """A compose_review with a fresh random review id."""
    words = rng.choices(["great", "plot", "boring", "actor", "http://example.com/x", "twist", "score"], k=8)
    return ("compose_review", f"r{rng.getrandbits(64):016x}", "compose",
            [f"user{rng.randrange(movie_users)}", f"title{rng.randrange(movies)}", rng.randint(0, 10),
             " ".join(words)])


# ---------------------------------------------------------------------------------------------- checks


def check(read_state: Callable[[str, str], Any], hotels: int = 100, flights: int = 100, users: int = 500,
          movies: int = 1000, movie_users: int = 1000, review_ids: list[str] | None = None) -> list[str]:
    """Violations of: capacity never exceeded; room and seat booked together (sum of hotel bookings =
    sum of flight bookings = sum of users' reservations); every review stored once in every index
    (storage, the user's list, the movie's list, text, rating count); ``review_ids``, if given, are the
    reviews whose compose committed: each must be there, and nothing else may be."""
    errors: list[str] = []
    booked = {"hotel": 0, "flight": 0}
    for op, n, prefix in (("hotel", hotels, "h"), ("flight", flights, "f")):
        for i in range(n):
            v = read_state(op, f"{prefix}{i:03d}")
            if v is None:
                errors.append(f"{op} {prefix}{i:03d} missing")
                continue
            if len(v["reservations"]) > v["capacity"]:
                errors.append(f"{op} {prefix}{i:03d}: {len(v['reservations'])} booked > capacity {v['capacity']}")
            booked[op] += len(v["reservations"])
    user_res = sum((read_state("user", f"u{u:03d}") or {"reservations": 0})["reservations"] for u in range(users))
    if not booked["hotel"] == booked["flight"] == user_res:
        errors.append(f"reservations not atomic: rooms {booked['hotel']}, seats {booked['flight']}, "
                      f"users {user_res}")

    by_user: dict[str, list[str]] = {}
    by_movie: dict[str, list[str]] = {}
    for u in range(movie_users):
        by_user[f"mu{u}"] = read_state("user_review", f"mu{u}") or []
    for m in range(movies):
        by_movie[f"m{m}"] = read_state("movie_review", f"m{m}") or []
    seen: set[str] = set()
    for label, index in (("user", by_user), ("movie", by_movie)):
        for owner, ids in index.items():
            if len(ids) != len(set(ids)):
                errors.append(f"{label} {owner} lists a review twice: {sorted(ids)}")
            for rid in ids:
                seen.add(rid)
                r = read_state("review_storage", rid)
                if r is None:
                    errors.append(f"review {rid} in {label} index {owner} but not stored")
                elif r[f"{label}_id"] != owner:
                    errors.append(f"review {rid} in {label} index {owner} but belongs to {r[f'{label}_id']}")
    if review_ids is not None:
        want = set(review_ids)
        for rid in sorted(want - seen):
            errors.append(f"committed review {rid} is in no index")
        for rid in sorted(seen - want):
            errors.append(f"review {rid} is indexed but was not committed")
    ratings = 0
    for m in range(movies):
        r = read_state("movie_rating", f"m{m}")
        ratings += r["count"] if r else 0
    for rid in seen:
        r = read_state("review_storage", rid)
        if r is None:
            continue
        if by_user.get(r["user_id"], []).count(rid) != 1:
            errors.append(f"review {rid} not exactly once in user index {r['user_id']}")
        if by_movie.get(r["movie_id"], []).count(rid) != 1:
            errors.append(f"review {rid} not exactly once in movie index {r['movie_id']}")
        if read_state("review_text", rid) is None:
            errors.append(f"review {rid} has no text")
    if ratings != len(seen):
        errors.append(f"{ratings} ratings recorded for {len(seen)} reviews")
    return errors
