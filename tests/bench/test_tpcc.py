"""TPC-C on the in-process runtime at a small scale: consistency conditions, rollback, index lookups."""

from __future__ import annotations

import asyncio
import random

from charon import serde
from charon.apps import tpcc
from charon.runtime.node.inprocess import InProcessRuntime

SCALE = tpcc.Scale(districts=2, customers=30, items=200)


def fresh() -> InProcessRuntime:
    rt = InProcessRuntime(tpcc.app, partitions=4, epoch_max_ms=1.0)
    tpcc.load(rt, tpcc.populate(1, SCALE, seed=7))
    return rt


def test_population_is_consistent_and_check_detects_violations() -> None:
    rt = fresh()
    assert tpcc.check(rt.read_state, rt.read_items) == []
    assert rt.read_state("district", "1:1")["next_o_id"] == SCALE.customers + 1
    # break condition 1 and condition 2: the check must say so
    rt.load("district_ytd", {"1:2": 1})
    rt.load("order", {f"1:1:{SCALE.customers + 1}": {"c_id": 1, "ol_cnt": 0, "all_local": True,
                                                      "entry_d": 0.0, "carrier_id": None}})
    errors = tpcc.check(rt.read_state, rt.read_items)
    assert any(e.startswith("C1") for e in errors)
    assert any(e.startswith("C2 district 1:1") for e in errors)


async def test_mixed_run_keeps_consistency_conditions() -> None:
    rt = fresh()
    rng = random.Random(3)
    reqs = [tpcc.next_request(rng, 1, SCALE) for _ in range(36)]
    reqs.append(tpcc.new_order_request(rng, 1, SCALE, rollback=True))
    reqs.append(tpcc.payment_request(random.Random(11), 1, SCALE))
    w_ytd0 = rt.read_state("warehouse", "1")["ytd"]
    async with rt:
        replies = await asyncio.gather(*(rt.submit(op, k, f, a) for op, k, f, a in reqs))
    assert tpcc.check(rt.read_state, rt.read_items) == []
    ok_new = [r for q, r in zip(reqs, replies, strict=True) if q[2] == "new_order" and r.ok]
    ok_pay = [(q, r) for q, r in zip(reqs, replies, strict=True) if q[2] == "payment" and r.ok]
    failed = [(q, r) for q, r in zip(reqs, replies, strict=True) if not r.ok]
    # exactly the forced rollback failed, with the application's error type
    assert [r.error_type for _, r in failed] == ["UnknownItem"] * len(failed)
    assert len(failed) >= 1 and all(q[3][1][-1][0] == SCALE.items + 1 for q, _ in failed)
    # every committed NewOrder got a distinct order id, and the districts advanced by that many
    o_ids = [(serde.decode(r.value)["o_id"]) for r in ok_new]
    advanced = sum(rt.read_state("district", f"1:{d}")["next_o_id"] - SCALE.customers - 1
                   for d in range(1, SCALE.districts + 1))
    assert advanced == len(ok_new) and len(o_ids) > 0
    # W_YTD grew by exactly the committed payments
    assert rt.read_state("warehouse", "1")["ytd"] - w_ytd0 == sum(q[3][4] for q, _ in ok_pay)
    assert len(ok_pay) > 0


async def test_rollback_leaves_no_trace() -> None:
    rt = fresh()
    before = rt.state_digest()
    op, key, fn, args = tpcc.new_order_request(random.Random(5), 1, SCALE, rollback=True)
    assert len(args[1]) >= 5
    async with rt:
        rep = await rt.submit(op, key, fn, args)
    assert not rep.ok and rep.error_type == "UnknownItem"
    assert rt.state_digest() == before
    o_id = SCALE.customers + 1
    assert rt.read_state("order", f"{key}:{o_id}") is None
    assert rt.read_state("new_order", f"{key}:{o_id}") is None


async def test_payment_by_last_name_takes_the_middle_customer() -> None:
    rt = fresh()
    # three customers of district 1:1 share one last name; first names decide the order
    for c, first in ((3, "CCC"), (7, "AAA"), (9, "BBB")):
        info = rt.read_items("customer", f"1:1:{c}")["info"]
        rt.load_items("customer", f"1:1:{c}", {"info": {**info, "last": "SAMENAME", "first": first}})
    rt.load_items("customer_index", "1:1", {"SAMENAME:CCC:000003": 3, "SAMENAME:AAA:000007": 7,
                                            "SAMENAME:BBB:000009": 9})
    bal = rt.read_state("customer", "1:1:9")["balance"]
    async with rt:
        rep = await rt.submit("district", "1:1", "payment", [1, 1, 0, "SAMENAME", 1234])
    assert rep.ok, rep
    assert serde.decode(rep.value)["c_id"] == 9  # AAA(7), BBB(9), CCC(3): the middle one
    assert rt.read_state("customer", "1:1:9")["balance"] == bal - 1234
    assert rt.read_state("history", "1:1:9") == 2
