"""TPC-C NewOrder and Payment as Charon call graphs, with a population generator and the consistency checks.

Layout (entity keys are plain strings; money is integer cents so the checks are exact):

- ``warehouse`` ``"w"``: value ``{ytd}``; item ``"info"`` = ``{name, tax}``
- ``warehouse_tax`` ``"w"``: value W_TAX (a read-only copy of the static column, for NewOrder)
- ``district`` ``"w:d"``: value ``{tax, next_o_id}``. The root of both transactions (NewOrder serializes on
  ``next_o_id``; Payment's root does not touch it)
- ``district_ytd`` ``"w:d"``: value D_YTD (Payment)
- ``customer`` ``"w:d:c"``: value ``{balance, ytd_payment, payment_cnt, delivery_cnt, data}``; item
  ``"info"`` = ``{first, middle, last, credit, discount}``

The engine tracks conflicts per entity (operator, key), so the columns Payment writes (W_YTD, D_YTD) live in
entities apart from the ones NewOrder reads or writes (W_TAX, D_NEXT_O_ID): a NewOrder and a Payment of the
same warehouse or district do not conflict (TPC-C implementations split these rows vertically for the same
reason). A customer's name, credit and discount are an item of the entity Payment writes, so a NewOrder and
a Payment of the same customer in one epoch do conflict (rare).
- ``customer_index`` ``"w:d"``: no value; one per-entity item per customer named ``"LAST:FIRST:000042"`` whose
  value is the customer id. Payment by last name scans the prefix ``"LAST:"`` (rows sorted by first name)
  and takes the middle row, as the specification says.
- ``item`` ``"i"``: ``{name, price, data}`` (read only); an unknown item raises :class:`UnknownItem`, which
  rolls the whole NewOrder back (1% of NewOrders ask for one on purpose).
- ``stock`` ``"w:i"``: ``{quantity, ytd, order_cnt, remote_cnt, dist, data}``
- ``order`` ``"w:d:o"``: ``{c_id, ol_cnt, all_local, entry_d, carrier_id}``
- ``new_order`` ``"w:d:o"``: ``1``
- ``order_line`` ``"w:d:o:n"``: ``{i_id, supply_w_id, quantity, amount, dist_info, delivery_d}``
- ``history`` ``"w:d:c"`` (of the paying customer): value = number of rows, items ``"00000001"`` ... = rows

NewOrder = district -> warehouse, customer, then per line item + stock + order_line, then order and
new_order: 5 + 3 x (5..15) = 20-50 calls. Payment = district -> warehouse, customer_index (60%), customer,
history.

Orders and order lines are entities of their own (not items) so that :func:`check` can read everything
through a plain ``read_state(operator, key)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from charon import Application, Call, Context, Operator

warehouse = Operator("warehouse")
warehouse_tax = Operator("warehouse_tax")
district = Operator("district")
district_ytd = Operator("district_ytd")
customer = Operator("customer")
customer_index = Operator("customer_index")
item = Operator("item")
stock = Operator("stock")
order = Operator("order")
new_order_op = Operator("new_order")
order_line = Operator("order_line")
history = Operator("history")

Request = tuple[str, str, str, list]
Record = tuple[str, str, Any, "dict[str, Any] | None"]


class UnknownItem(Exception):
    """NewOrder named an item that does not exist (the specification's 1% rollback)."""


class UnknownCustomer(Exception):
    """No customer with that id or last name."""


class UnknownDistrict(Exception):
    """No such district (or warehouse)."""


# ---------------------------------------------------------------------------------------------- leaves


@warehouse_tax.function
async def get_tax(ctx: Context) -> float:
    """W_TAX, for NewOrder."""
    tax = ctx.get()
    if tax is None:
        raise UnknownDistrict(f"warehouse {ctx.key}")
    return tax


@warehouse.function
async def warehouse_pay(ctx: Context, amount: int) -> str:
    """Payment: W_YTD += amount; returns the warehouse name."""
    w = ctx.get()
    if w is None:
        raise UnknownDistrict(f"warehouse {ctx.key}")
    w["ytd"] += amount
    ctx.put(w)
    return ctx.get_item("info")["name"]


@district_ytd.function
async def district_pay(ctx: Context, amount: int) -> None:
    """Payment: D_YTD += amount."""
    ytd = ctx.get()
    if ytd is None:
        raise UnknownDistrict(f"district {ctx.key}")
    ctx.put(ytd + amount)


@customer.function
async def get_for_order(ctx: Context) -> dict:
    """NewOrder: C_DISCOUNT, C_LAST, C_CREDIT."""
    c = ctx.get_item("info")
    if c is None:
        raise UnknownCustomer(f"customer {ctx.key}")
    return {"discount": c["discount"], "last": c["last"], "credit": c["credit"]}


@customer.function
async def customer_pay(ctx: Context, amount: int, w_id: int, d_id: int) -> int:
    """Payment: debit the customer; bad-credit customers get the payment prepended to C_DATA."""
    c = ctx.get()
    if c is None:
        raise UnknownCustomer(f"customer {ctx.key}")
    c["balance"] -= amount
    c["ytd_payment"] += amount
    c["payment_cnt"] += 1
    if ctx.get_item("info")["credit"] == "BC":
        c_w, c_d, c_id = ctx.key.split(":")
        c["data"] = f"{c_id} {c_d} {c_w} {d_id} {w_id} {amount}|{c['data']}"[:500]
    ctx.put(c)
    return c["balance"]


@customer_index.function
async def lookup(ctx: Context, last: str) -> int:
    """Customer id by last name: the middle row (rounded up) of the matches sorted by first name."""
    rows = ctx.scan_items(prefix=f"{last}:")
    if not rows:
        raise UnknownCustomer(f"no customer named {last} in district {ctx.key}")
    return int(rows[(len(rows) + 1) // 2 - 1][1])


@item.function
async def get_price(ctx: Context) -> int:
    """I_PRICE in cents; raises UnknownItem (rolling back the NewOrder) for an unused item id."""
    i = ctx.get()
    if i is None:
        raise UnknownItem(f"item {ctx.key} not found")
    return i["price"]


@stock.function
async def take(ctx: Context, quantity: int, remote: bool) -> str:
    """NewOrder: decrement S_QUANTITY (refilling by 91 below 10), update counters; returns S_DIST_xx."""
    s = ctx.get()
    if s is None:
        raise UnknownItem(f"stock {ctx.key} not found")
    if s["quantity"] >= quantity + 10:
        s["quantity"] -= quantity
    else:
        s["quantity"] += 91 - quantity
    s["ytd"] += quantity
    s["order_cnt"] += 1
    if remote:
        s["remote_cnt"] += 1
    ctx.put(s)
    return s["dist"]


@order.function
async def put_order(ctx: Context, row: dict) -> None:
    """Insert the ORDER row."""
    ctx.put(row)


@new_order_op.function
async def put_new_order(ctx: Context) -> None:
    """Insert the NEW-ORDER row."""
    ctx.put(1)


@order_line.function
async def put_order_line(ctx: Context, row: dict) -> None:
    """Insert one ORDER-LINE row."""
    ctx.put(row)


@history.function
async def add_history(ctx: Context, row: dict) -> None:
    """Append a HISTORY row for this customer (value = row count, items = rows)."""
    n = ctx.get(default=0) + 1
    ctx.put(n)
    ctx.put_item(f"{n:08d}", row)


# ---------------------------------------------------------------------------------------------- roots


@district.function(public=True)
async def new_order(ctx: Context, c_id: int, lines: list) -> dict:
    """TPC-C NewOrder. ``lines`` = ``[[i_id, supply_w_id, quantity], ...]``; returns ``{o_id, total}``."""
    d = ctx.get()
    if d is None:
        raise UnknownDistrict(f"district {ctx.key}")
    w_s, d_s = ctx.key.split(":")
    w_id = int(w_s)
    o_id = d["next_o_id"]
    all_local = all(int(line[1]) == w_id for line in lines)
    # One concurrent fan-out: warehouse tax, customer, and every line's item price and stock update.
    calls: list[Call[Any]] = [ctx.call(warehouse_tax, w_s, get_tax),  # values of several types: Any
                              ctx.call(customer, f"{w_s}:{d_s}:{c_id}", get_for_order)]
    for i_id, supply_w, qty in lines:
        calls.append(ctx.call(item, str(i_id), get_price))
        calls.append(ctx.call(stock, f"{supply_w}:{i_id}", take, qty, int(supply_w) != w_id))
    w_tax, cust, *per_line = await ctx.gather(*calls)
    total = 0
    for n, (i_id, supply_w, qty) in enumerate(lines, start=1):
        price, dist_info = per_line[2 * (n - 1)], per_line[2 * (n - 1) + 1]
        amount = price * qty
        total += amount
        ctx.send(
            order_line,
            f"{w_s}:{d_s}:{o_id}:{n}",
            put_order_line,
            {"i_id": i_id, "supply_w_id": supply_w, "quantity": qty, "amount": amount,
             "dist_info": dist_info, "delivery_d": None},
        )
    d["next_o_id"] = o_id + 1
    ctx.put(d)
    ctx.send(
        order,
        f"{w_s}:{d_s}:{o_id}",
        put_order,
        {"c_id": c_id, "ol_cnt": len(lines), "all_local": all_local, "entry_d": ctx.now(), "carrier_id": None},
    )
    ctx.send(new_order_op, f"{w_s}:{d_s}:{o_id}", put_new_order)
    total_cents = round(total * (1 - cust["discount"]) * (1 + w_tax + d["tax"]))
    return {"o_id": o_id, "total": total_cents, "c_last": cust["last"], "c_credit": cust["credit"]}


@district.function(public=True)
async def payment(ctx: Context, c_w_id: int, c_d_id: int, c_id: int, c_last: str, amount: int) -> dict:
    """TPC-C Payment at this (home) district; the customer by id, or by last name when ``c_id`` is 0."""
    w_s, d_s = ctx.key.split(":")
    if c_id == 0:  # by last name: the index lookup runs concurrently with the warehouse and district updates
        w_name, _, c_id = await ctx.gather(
            ctx.call(warehouse, w_s, warehouse_pay, amount),
            ctx.call(district_ytd, ctx.key, district_pay, amount),
            ctx.call(customer_index, f"{c_w_id}:{c_d_id}", lookup, c_last),
        )
        balance = await ctx.call(customer, f"{c_w_id}:{c_d_id}:{c_id}", customer_pay, amount, int(w_s), int(d_s))
    else:
        w_name, _, balance = await ctx.gather(
            ctx.call(warehouse, w_s, warehouse_pay, amount),
            ctx.call(district_ytd, ctx.key, district_pay, amount),
            ctx.call(customer, f"{c_w_id}:{c_d_id}:{c_id}", customer_pay, amount, int(w_s), int(d_s)),
        )
    ctx.send(
        history,
        f"{c_w_id}:{c_d_id}:{c_id}",
        add_history,
        {"w_id": int(w_s), "d_id": int(d_s), "amount": amount, "date": ctx.now(), "data": f"{w_name}"},
    )
    return {"c_id": c_id, "balance": balance}


app = Application(
    "tpcc",
    [warehouse, warehouse_tax, district, district_ytd, customer, customer_index, item, stock, order,
     new_order_op, order_line, history],
)

# ---------------------------------------------------------------------------------------------- population

SYLLABLES = ["BAR", "OUGHT", "ABLE", "PRI", "PRES", "ESE", "ANTI", "CALLY", "ATION", "EING"]
_C_LAST = 157  # the run-time constant C for NURand(255, ...) (any value in 0..255)
_C_ID = 42
_C_ITEM = 4321


@dataclass(frozen=True)
class Scale:
    """Population size. The defaults are the specification's; tests and short runs shrink them."""

    districts: int = 10
    customers: int = 3000  # per district
    items: int = 100_000
    orders: int | None = None  # initial orders per district (default: one per customer)

    @property
    def initial_orders(self) -> int:
        return self.customers if self.orders is None else self.orders


SMALL = Scale(districts=2, customers=30, items=200)
BENCH = Scale(districts=10, customers=300, items=10_000)


def last_name(n: int) -> str:
    """The specification's C_LAST for a number 0..999 (three syllables)."""
    return SYLLABLES[n // 100] + SYLLABLES[(n // 10) % 10] + SYLLABLES[n % 10]


def nurand(rng: random.Random, a: int, x: int, y: int, c: int) -> int:
    """NURand(A, x, y) of the specification."""
    return (((rng.randint(0, a) | rng.randint(x, y)) + c) % (y - x + 1)) + x


def _astring(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(lo, hi)))


CHUNK = 2_500  # items (and stock rows) per unit: part of the population's definition (it seeds the units)
Unit = tuple  # ("item", lo, hi) | ("warehouse", w) | ("stock", w, lo, hi) | ("district", w, d)


def units(W: int, scale: Scale) -> list[Unit]:
    """The generation units of a population, in canonical order (the order :func:`populate` yields)."""
    out: list[Unit] = []
    chunks = [(lo, min(lo + CHUNK - 1, scale.items)) for lo in range(1, scale.items + 1, CHUNK)]
    out += [("item", lo, hi) for lo, hi in chunks]
    for w in range(1, W + 1):
        out.append(("warehouse", w))
        out += [("stock", w, lo, hi) for lo, hi in chunks]
        out += [("district", w, d) for d in range(1, scale.districts + 1)]
    return out


def unit_rng(seed: int, unit: Unit) -> random.Random:
    """The unit's own generator (string seeds are hashed with SHA-512: stable across processes)."""
    return random.Random("tpcc:" + ":".join(str(x) for x in (seed, *unit)))


def _items(rng: random.Random, lo: int, hi: int) -> Iterator[Record]:
    for i in range(lo, hi + 1):
        data = _astring(rng, 26, 50)
        if rng.random() < 0.1:
            data = data[:10] + "ORIGINAL" + data[18:]
        yield "item", str(i), {"name": _astring(rng, 14, 24), "price": rng.randint(100, 10000),
                               "data": data}, None


def _warehouse(rng: random.Random, w: int, scale: Scale) -> Iterator[Record]:
    tax = rng.randint(0, 2000) / 10000
    yield "warehouse", str(w), {"ytd": 3_000_000 * scale.districts}, {"info": {"name": f"W{w}", "tax": tax}}
    yield "warehouse_tax", str(w), tax, None


def _stock(rng: random.Random, w: int, lo: int, hi: int) -> Iterator[Record]:
    for i in range(lo, hi + 1):
        yield "stock", f"{w}:{i}", {
            "quantity": rng.randint(10, 100), "ytd": 0, "order_cnt": 0, "remote_cnt": 0,
            "dist": _astring(rng, 24, 24), "data": _astring(rng, 26, 50),
        }, None


def _district(rng: random.Random, w: int, d: int, scale: Scale) -> Iterator[Record]:
    """One district exactly as ``populate`` builds it (same rows, same order of draws)."""
    C, n_items, n_orders = scale.customers, scale.items, scale.initial_orders
    yield "district", f"{w}:{d}", {"tax": rng.randint(0, 2000) / 10000, "next_o_id": n_orders + 1}, None
    yield "district_ytd", f"{w}:{d}", 3_000_000, None
    index: dict[str, int] = {}
    for c in range(1, C + 1):
        last = last_name(c - 1 if c <= 1000 else nurand(rng, 255, 0, 999, _C_LAST))
        first = _astring(rng, 8, 16)
        index[f"{last}:{first}:{c:06d}"] = c
        yield "customer", f"{w}:{d}:{c}", {
            "balance": -1000, "ytd_payment": 1000, "payment_cnt": 1, "delivery_cnt": 0,
            "data": _astring(rng, 30, 60),
        }, {"info": {"first": first, "middle": "OE", "last": last,
                     "credit": "BC" if rng.random() < 0.1 else "GC",
                     "discount": rng.randint(0, 5000) / 10000}}
        yield "history", f"{w}:{d}:{c}", 1, {"00000001": {"w_id": w, "d_id": d, "amount": 1000,
                                                          "date": 0.0, "data": "initial"}}
    yield "customer_index", f"{w}:{d}", None, index
    perm = list(range(1, C + 1))
    rng.shuffle(perm)
    first_new = n_orders - (n_orders * 3) // 10 + 1  # 2101 of 3000
    for o in range(1, n_orders + 1):
        ol_cnt = rng.randint(5, 15)
        delivered = o < first_new
        yield "order", f"{w}:{d}:{o}", {"c_id": perm[(o - 1) % C], "ol_cnt": ol_cnt, "all_local": True,
                                        "entry_d": 0.0,
                                        "carrier_id": rng.randint(1, 10) if delivered else None}, None
        for n in range(1, ol_cnt + 1):
            yield "order_line", f"{w}:{d}:{o}:{n}", {
                "i_id": rng.randint(1, n_items), "supply_w_id": w, "quantity": 5,
                "amount": 0 if delivered else rng.randint(1, 999999),
                "dist_info": _astring(rng, 24, 24), "delivery_d": 0.0 if delivered else None,
            }, None
        if not delivered:
            yield "new_order", f"{w}:{d}:{o}", 1, None


def unit_records(unit: Unit, scale: Scale, seed: int = 0) -> Iterator[Record]:
    """The records ``(operator, key, value, items)`` of one unit (deterministic in ``unit, scale, seed``)."""
    rng = unit_rng(seed, unit)
    kind = unit[0]
    if kind == "item":
        return _items(rng, unit[1], unit[2])
    if kind == "warehouse":
        return _warehouse(rng, unit[1], scale)
    if kind == "stock":
        return _stock(rng, unit[1], unit[2], unit[3])
    if kind == "district":
        return _district(rng, unit[1], unit[2], scale)
    raise ValueError(f"unknown unit {unit!r}")


def populate(W: int = 1, scale: Scale = Scale(), seed: int = 0) -> Iterator[Record]:
    """Yield the initial database as ``(operator, key, value, items)``; ``items`` is None or a dict.

    Follows the specification's initial state (W_YTD = 300,000.00 = 10 x D_YTD, 30% of the initial
    orders undelivered with NEW-ORDER rows), scaled by ``scale``; string fields are shortened. The
    population is made of independent *units* (:func:`units`), each with its own seeded generator, so
    :mod:`charon.apps.tpcc_spark` can generate it in parallel with Spark and get the same records.
    """
    for u in units(W, scale):
        yield from unit_records(u, scale, seed)


def load(runtime: Any, records: Iterator[Record], batch: int = 10_000) -> int:
    """Load ``populate`` output into a runtime with ``load(operator, {key: value})`` and ``load_items``.

    Returns the number of records loaded.
    """
    pending: dict[str, dict[str, Any]] = {}
    n = 0
    size = 0
    for op, key, value, items in records:
        n += 1
        if value is not None:
            pending.setdefault(op, {})[key] = value
            size += 1
        if items:
            runtime.load_items(op, key, items)
        if size >= batch:
            for o, kv in pending.items():
                runtime.load(o, kv)
            pending.clear()
            size = 0
    for o, kv in pending.items():
        runtime.load(o, kv)
    return n


# ---------------------------------------------------------------------------------------------- requests


def new_order_request(rng: random.Random, W: int = 1, scale: Scale = Scale(), rollback: bool | None = None
                      ) -> Request:
    """A NewOrder: 5-15 lines, 1% of lines from a remote warehouse (if W > 1), 1% rolled back."""
    w = rng.randint(1, W)
    d = rng.randint(1, scale.districts)
    c_id = nurand(rng, 1023, 1, scale.customers, _C_ID)
    ol_cnt = rng.randint(5, 15)
    if rollback is None:
        rollback = rng.random() < 0.01
    lines = []
    for n in range(ol_cnt):
        i_id = nurand(rng, 8191, 1, scale.items, _C_ITEM)
        if rollback and n == ol_cnt - 1:
            i_id = scale.items + 1  # an unused item number
        supply = w
        if W > 1 and rng.random() < 0.01:
            supply = rng.choice([x for x in range(1, W + 1) if x != w])
        lines.append([i_id, supply, rng.randint(1, 10)])
    return "district", f"{w}:{d}", "new_order", [c_id, lines]


def payment_request(rng: random.Random, W: int = 1, scale: Scale = Scale()) -> Request:
    """A Payment: 15% through a remote warehouse's customer (if W > 1), 60% by last name."""
    w = rng.randint(1, W)
    d = rng.randint(1, scale.districts)
    c_w, c_d = w, d
    if W > 1 and rng.random() < 0.15:
        c_w = rng.choice([x for x in range(1, W + 1) if x != w])
        c_d = rng.randint(1, scale.districts)
    if rng.random() < 0.6:
        c_id, c_last = 0, last_name(nurand(rng, 255, 0, min(999, scale.customers - 1), _C_LAST))
    else:
        c_id, c_last = nurand(rng, 1023, 1, scale.customers, _C_ID), ""
    return "district", f"{w}:{d}", "payment", [c_w, c_d, c_id, c_last, rng.randint(100, 500_000)]


def next_request(rng: random.Random, W: int = 1, scale: Scale = Scale(), new_order_share: float = 0.5
                 ) -> Request:
    """The benchmark mix: ~50% NewOrder, ~50% Payment, as ``(operator, key, function, args)``."""
    if rng.random() < new_order_share:
        return new_order_request(rng, W, scale)
    return payment_request(rng, W, scale)


def generator(W: int = 1, scale: Scale = Scale()) -> Callable[[random.Random], Request]:
    """``next_request`` bound to a population size, for the harness."""
    return lambda rng: next_request(rng, W, scale)


# ---------------------------------------------------------------------------------------------- checks


def check(read_state: Callable[[str, str], Any], read_items: Callable[[str, str], dict[str, Any]],
          max_lines: int = 15, slack: int = 5) -> list[str]:
    """TPC-C consistency conditions 1-4 over the state; returns the violations (empty = consistent).

    1. W_YTD = sum(D_YTD); 2. D_NEXT_O_ID - 1 = max(O_ID) = max(NO_O_ID); 3. NEW-ORDER rows of a district
    are contiguous (max - min + 1 = count); 4. sum(O_OL_CNT) = number of ORDER-LINE rows.
    ``read_state(operator, key)`` gives an entity's value, ``read_items(operator, key)`` its items (unused
    since D_YTD became an entity of its own; kept for the callers).
    Warehouses and districts are discovered by probing ids 1, 2, ... Rows beyond ``next_o_id`` (up to
    ``slack``) and lines beyond ``ol_cnt`` are probed too, so stray rows are reported.
    """
    errors: list[str] = []
    w = 1
    while (wh := read_state("warehouse", str(w))) is not None:
        d_ytd = 0
        d = 1
        while (dist := read_state("district", f"{w}:{d}")) is not None:
            d_ytd += read_state("district_ytd", f"{w}:{d}") or 0
            nxt = dist["next_o_id"]
            max_o = 0
            no_ids: list[int] = []
            ol_cnt_sum = 0
            ol_rows = 0
            for o in range(1, nxt + slack):
                row = read_state("order", f"{w}:{d}:{o}")
                if read_state("new_order", f"{w}:{d}:{o}") is not None:
                    no_ids.append(o)
                if row is None:
                    continue
                max_o = o
                ol_cnt_sum += row["ol_cnt"]
                for n in range(1, max(max_lines, row["ol_cnt"]) + 2):
                    if read_state("order_line", f"{w}:{d}:{o}:{n}") is not None:
                        ol_rows += 1
            if nxt - 1 != max_o:
                errors.append(f"C2 district {w}:{d}: D_NEXT_O_ID-1={nxt - 1} but max(O_ID)={max_o}")
            if no_ids and max(no_ids) != nxt - 1:
                errors.append(f"C2 district {w}:{d}: D_NEXT_O_ID-1={nxt - 1} but max(NO_O_ID)={max(no_ids)}")
            if no_ids and max(no_ids) - min(no_ids) + 1 != len(no_ids):
                errors.append(f"C3 district {w}:{d}: NEW-ORDER rows not contiguous "
                              f"({min(no_ids)}..{max(no_ids)}, {len(no_ids)} rows)")
            if ol_cnt_sum != ol_rows:
                errors.append(f"C4 district {w}:{d}: sum(O_OL_CNT)={ol_cnt_sum} but {ol_rows} ORDER-LINE rows")
            d += 1
        if d == 1:
            errors.append(f"warehouse {w} has no districts")
        if wh["ytd"] != d_ytd:
            errors.append(f"C1 warehouse {w}: W_YTD={wh['ytd']} but sum(D_YTD)={d_ytd}")
        w += 1
    if w == 1:
        errors.append("no warehouses")
    return errors
