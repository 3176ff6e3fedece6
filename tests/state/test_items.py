"""Per-entity ordered items (prefix/range scans) in the state layer, on both runtimes."""

from __future__ import annotations

import random

import pytest

from charon import InProcessRuntime, Request, serde
from charon.apps import catalog
from charon.config import SparkConfig
from charon.testing import check_epoch


def _req(i: int, key: str, fn: str, args: list) -> Request:
    return Request(f"c{i}", "shelf", key, fn, serde.encode(args))


def _workload(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    skus = [f"{a}{b}" for a in "abc" for b in "0123"]
    out = []
    for i in range(count):
        key = f"s{rng.randrange(3)}"
        x = rng.random()
        if x < 0.5:
            out.append(_req(i, key, "stock", [rng.choice(skus), rng.randint(-3, 5)]))
        elif x < 0.7:
            out.append(_req(i, key, "restock_and_list", [rng.sample(skus, 2), rng.choice("abc")]))
        elif x < 0.85:
            lo = rng.choice(skus)
            out.append(_req(i, key, "between", [lo, chr(ord(lo[0]) + 1)]))
        else:
            out.append(_req(i, key, "move", [rng.choice(skus), f"s{rng.randrange(3)}", rng.randint(1, 4)]))
    return out


def test_scans_see_committed_and_own_items_in_order():
    rt = InProcessRuntime(catalog.app, partitions=2)
    rt.load_items("shelf", "s0", {"a1": 2, "b2": 5, "a0": 1, "c3": 9})
    r = rt.run_epoch([_req(0, "s0", "restock_and_list", [["a2", "a0"], "a"])])
    assert serde.decode(r.replies[1].value) == [["a0", 2], ["a1", 2], ["a2", 1]]
    r = rt.run_epoch([_req(1, "s0", "between", ["a1", "c"]), _req(2, "s0", "stock", ["b2", -5])])
    assert serde.decode(r.replies[min(r.replies)].value) == [["a1", 2], ["a2", 1], ["b2", 5]]
    assert "b2" not in rt.read_items("shelf", "s0"), "a deleted item disappears"
    r = rt.run_epoch([_req(3, "s0", "move", ["a2", "s1", 5])])
    assert not r.replies[min(r.replies)].ok and rt.read_items("shelf", "s1") == {}, "an abort moves nothing"


def test_item_workload_matches_the_serial_oracle():
    rt = InProcessRuntime(catalog.app, partitions=3)
    reqs = _workload(1, 400)
    for e in range(0, 400, 50):
        before = rt.snapshot()
        result = rt.run_epoch(reqs[e : e + 50])
        check_epoch(catalog.app, before, rt.snapshot(), result)
    totals = {k: v for k, v in rt.entities("shelf").items()}
    for key, total in totals.items():
        assert sum(rt.read_items("shelf", key).values()) >= 0 and isinstance(total, int)


@pytest.mark.spark
def test_items_on_spark_equal_in_process(tmp_path):
    from charon.runtime.spark.runtime import SparkRuntime
    from charon.testing import replay_in_process

    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=3, max_batch=60, truncate_log=False)
    rt = SparkRuntime("charon.apps.catalog:app", cfg)
    try:
        reqs = _workload(2, 300)
        rt.input_log.append_many(reqs)
        rt.start()
        rt.wait_idle(600)
        rt.stop()
        state = rt.snapshot()
        ip, results = replay_in_process(catalog.app, rt, {})
        assert ip.snapshot() == state
        replies = {r.request_id: r for r in rt.replies()}
        assert len(replies) == len(reqs)
        assert all(replies[r.request_id] == r for res in results for r in res.replies.values())
        scans = [r for r in replies.values() if r.ok and isinstance(serde.decode(r.value), list)]
        assert scans and any(serde.decode(r.value) for r in scans), "range scans returned items"
    finally:
        rt.close()
