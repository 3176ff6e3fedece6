"""Deathstar travel and movie review on the in-process runtime: capacity, atomic pairs, review indexes."""

from __future__ import annotations

import asyncio
import random

from charon import serde
from charon.apps import deathstar as ds
from charon.runtime.node.inprocess import InProcessRuntime

SIZES = {"hotels": 3, "flights": 3, "users": 40, "movies": 15, "movie_users": 15}


def fresh() -> InProcessRuntime:
    rt = InProcessRuntime(ds.app, partitions=4)
    for op, key, value, items in ds.populate(capacity=5, **SIZES):
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)
    return rt


async def test_capacity_never_exceeded_under_concurrent_reservations() -> None:
    rt = fresh()
    rng = random.Random(2)
    reqs = [ds.reserve_request(rng, 3, 3, 40) for _ in range(60)]
    async with rt:
        replies = await asyncio.gather(*(rt.submit(op, k, f, a) for op, k, f, a in reqs))
    ok = [r for r in replies if r.ok]
    assert {r.error_type for r in replies if not r.ok} == {"SoldOut"}
    assert 0 < len(ok) <= 15  # 3 hotels x 5 rooms
    booked = sum(len(rt.read_state("hotel", f"h{i:03d}")["reservations"]) for i in range(3))
    seats = sum(len(rt.read_state("flight", f"f{i:03d}")["reservations"]) for i in range(3))
    assert booked == seats == len(ok)
    assert ds.check(rt.read_state, **SIZES) == []
    # the check notices an overbooked hotel
    h = rt.read_state("hotel", "h000")
    rt.load("hotel", {"h000": {**h, "reservations": ["x"] * 6}})
    assert any("capacity" in e for e in ds.check(rt.read_state, **SIZES))


async def test_reviews_stored_once_per_index() -> None:
    rt = fresh()
    rng = random.Random(4)
    reqs = [ds.next_movie_request(rng, 15, 15) for _ in range(30)]
    dup = (reqs[0][0], reqs[0][1], reqs[0][2], ["user1", "title2", 5, "again"])  # same review id
    bad = ("compose_review", "r-bad", "compose", ["nobody", "title1", 3, "x"])  # unknown user
    async with rt:
        replies = await asyncio.gather(*(rt.submit(op, k, f, a) for op, k, f, a in reqs))
        rep_dup = await rt.submit(*dup[:3], dup[3])
        rep_bad = await rt.submit(*bad[:3], bad[3])
    assert all(r.ok for r in replies)
    assert not rep_dup.ok and rep_dup.error_type == "DuplicateReview"
    assert not rep_bad.ok and rep_bad.error_type == "NotFound"
    assert rt.read_state("review_text", "r-bad") is None
    ids = [q[1] for q in reqs]
    assert ds.check(rt.read_state, review_ids=ids, **SIZES) == []
    assert sum(len(rt.read_state("user_review", f"mu{u}") or []) for u in range(15)) == 30
    # an index entry pointing nowhere is reported
    rt.load("movie_review", {"m0": (rt.read_state("movie_review", "m0") or []) + ["ghost"]})
    assert any("ghost" in e for e in ds.check(rt.read_state, review_ids=ids, **SIZES))


async def test_search_returns_the_nearest_hotels() -> None:
    rt = fresh()
    hotels = {f"h{i:03d}": rt.read_state("hotel", f"h{i:03d}") for i in range(3)}
    lat, lon = ds.LAT0 + 0.05, ds.LON0 + 0.05
    async with rt:
        rep = await rt.submit("geo", ds.REGION, "search", [lat, lon, 2])
        rec = await rt.submit("geo", ds.REGION, "recommend", [lat, lon, "dis"])
        log = await rt.submit("user", "u001", "login", ["wrong"])
    assert rep.ok and rec.ok
    want = sorted(hotels, key=lambda h: (hotels[h]["lat"] - lat) ** 2 + (hotels[h]["lon"] - lon) ** 2)
    assert [p["id"] for p in serde.decode(rep.value)] == want[:2]
    assert serde.decode(rec.value) == want
    assert not log.ok and log.error_type == "InvalidLogin"


def test_recommend_by_distance_equals_a_sort_of_every_hotel() -> None:
    """The widening grid search gives what sorting the whole index gives, inside the region, on cell
    boundaries, and far outside it (where it falls back to the whole index)."""
    from charon.messages import Request

    rt = InProcessRuntime(ds.app, partitions=4)
    index: dict[str, list] = {}
    for op, key, value, items in ds.populate():
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)
            index.update(items)
    rng = random.Random(3)
    points = [(ds.LAT0 + rng.random() * ds.SPAN, ds.LON0 + rng.random() * ds.SPAN) for _ in range(300)]
    points += [(ds.LAT0 + i * ds.CELL, ds.LON0 + j * ds.CELL) for i in range(0, 13, 3) for j in range(0, 13, 4)]
    points += [(ds.LAT0 - 1.0, ds.LON0), (ds.LAT0 + 0.5, ds.LON0 + 0.5), (ds.LAT0 + ds.SPAN / 2, ds.LON0 - 0.3)]
    reqs = [Request(f"r{i}", "geo", ds.REGION, "recommend", serde.encode([lat, lon, "dis"]))
            for i, (lat, lon) in enumerate(points)]
    result = rt.run_epoch(reqs)
    for r, (lat, lon) in zip(reqs, points, strict=True):
        want = sorted(index, key=lambda n: ((index[n][0] - lat) ** 2 + (index[n][1] - lon) ** 2, n))[:5]
        rep = next(x for x in result.replies.values() if x.request_id == r.request_id)
        assert rep.ok and serde.decode(rep.value) == [n.rsplit(":", 1)[1] for n in want], (lat, lon)


def test_nearest_rows_are_exact_for_any_count() -> None:
    """``_nearest`` over the populated index (its range scans answered from a sorted dict) equals a sort of
    the whole index for every count, so no hotel outside the scanned square is ever nearer."""
    index: dict[str, list] = {}
    for _, _, _, items in ds.populate():
        index.update(items or {})

    class Items:
        def scan_items(self, prefix: str = "", start: str | None = None, stop: str | None = None) -> list:
            return [(k, index[k]) for k in sorted(index)
                    if k.startswith(prefix) and (start is None or k >= start) and (stop is None or k < stop)]

    rng = random.Random(11)
    for _ in range(200):
        lat, lon = ds.LAT0 + rng.uniform(-0.02, ds.SPAN + 0.02), ds.LON0 + rng.uniform(-0.02, ds.SPAN + 0.02)
        for n in (1, 5, 20, 60, 100, 150):
            want = sorted(index, key=lambda k: ((index[k][0] - lat) ** 2 + (index[k][1] - lon) ** 2, k))[:n]
            assert [k for k, _ in ds._nearest(Items(), lat, lon, n)] == want, (lat, lon, n)


def test_search_asks_the_next_hotels_only_when_some_are_sold_out() -> None:
    """``search`` asks the ``k`` nearest hotels first and the next ``k`` only if some are sold out: its answer
    is the nearest ``k`` with rooms left among the ``2k`` nearest of the widening square, as when all ``2k``
    are asked at once (every third hotel sold out here, so both paths run)."""
    from charon.messages import Request

    rt = InProcessRuntime(ds.app, partitions=4)
    index: dict[str, list] = {}
    hotels: dict[str, dict] = {}
    for op, key, value, items in ds.populate():
        if op == "hotel" and int(key[1:]) % 3 == 0:
            value = {**value, "reservations": ["x"] * value["capacity"]}
        if op == "hotel":
            hotels[key] = value
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)
            index.update(items)

    def square(lat: float, lon: float, radius: int) -> list[str]:
        cx, cy = ds.cell(lat, lon)
        return [n for n in index if abs(int(n[:4]) - cx) <= radius and abs(int(n[5:9]) - cy) <= radius]

    def want(lat: float, lon: float, k: int) -> tuple[list[str], bool]:
        """The answer, and whether a sold-out hotel is among the k nearest (the second ask runs)."""
        radius = 1
        names = square(lat, lon, radius)
        while len(names) < k and radius < int(ds.SPAN / ds.CELL) + 2:
            radius *= 2
            names = square(lat, lon, radius)
        names.sort(key=lambda n: (ds._dist2(lat, lon, index[n]), n))
        near = [n.rsplit(":", 1)[1] for n in names[: 2 * k]]
        free = [h for h in near if len(hotels[h]["reservations"]) < hotels[h]["capacity"]]
        return free[:k], len(free[:k]) < len(near[:k]) or free[:k] != near[:k]

    rng = random.Random(5)
    asks = [(ds.LAT0 + rng.random() * ds.SPAN, ds.LON0 + rng.random() * ds.SPAN, rng.choice([1, 3, 5]))
            for _ in range(300)]
    reqs = [Request(f"s{i}", "geo", ds.REGION, "search", serde.encode(list(a))) for i, a in enumerate(asks)]
    by_id = {r.request_id: r for r in rt.run_epoch(reqs).replies.values()}
    second = 0
    for r, (lat, lon, k) in zip(reqs, asks, strict=True):
        rep = by_id[r.request_id]
        assert rep.ok, rep
        answer, asked_twice = want(lat, lon, k)
        assert [p["id"] for p in serde.decode(rep.value)] == answer, (lat, lon, k)
        assert all(p["available"] > 0 for p in serde.decode(rep.value))
        second += asked_twice
    assert second > 0, "some searches met a sold-out hotel among the k nearest (the second ask ran)"
