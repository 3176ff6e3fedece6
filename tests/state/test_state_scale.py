"""State at scale: the bulk import path (``SparkRuntime.load_rows``, no Spark session) and the Arrow merge
that snapshots and restores use (``DurableState.load_table``) against the Python merge."""

from __future__ import annotations

import random

import pytest

from charon import serde
from charon.config import SparkConfig
from charon.core.routing import partition_of, store_key
from charon.runtime.spark.runtime import SparkRuntime
from charon.state.durable import DurableState


def test_load_rows_writes_each_partition_its_entities(tmp_path):
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=3)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    rows = [("account", f"a{i}", "", serde.encode(i)) for i in range(500)]
    rows += [("account", "a7", "pad", serde.encode(b"x" * 100))]
    assert rt.load_rows(iter(rows)) == 501
    assert rt._spark is None  # no session was started
    d = DurableState(str(tmp_path / "checkpoint" / "state"))
    seen = {}
    for pid in range(3):
        state, epoch = d.load(pid)
        assert epoch == -1
        for k, v in state.items():
            op, key, _ = k.decode().split("\0", 2)
            assert partition_of(op, key, 3) == pid
            seen[k] = v
    assert seen == {store_key(o, k, i): v for o, k, i, v in rows}


@pytest.mark.parametrize("seed", range(5))
def test_load_table_equals_the_python_merge(tmp_path, seed):
    rng = random.Random(seed)
    d = DurableState(str(tmp_path), fsync=False)
    keys = [b"k%04d" % i for i in range(300)]
    d.write_base(0, -1, sorted((k, b"base") for k in rng.sample(keys, 150)))
    for e in range(8):
        d.write_delta(0, e, {rng.choice(keys): (None if rng.random() < 0.3 else b"%d" % e) for _ in range(40)})
        if e == 4:
            assert d.compact(0, 3)  # a base newer than -1 under later deltas
    for upto in range(3, 8):
        table, reached = d.load_table(0, upto)
        got = table.column("key").to_pylist()
        assert got == sorted(set(got))  # sorted, one row per key
        assert dict(zip(got, table.column("value").to_pylist(), strict=True)) == d.load(0, upto)[0]
        assert reached == upto
    empty = DurableState(str(tmp_path / "empty"))
    assert empty.load_table(0)[0].num_rows == 0


class _FlakyRestart(SparkRuntime):
    """A runtime whose first query restart fails (as when the source's planning needs a Python worker Spark
    is still replacing after a worker loss)."""

    starts = 0

    def _start_query(self) -> None:
        self.starts += 1
        if self.starts == 2:
            raise RuntimeError("injected: the source cannot be planned yet")
        super()._start_query()


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_failed_restart_is_retried_and_bulk_loaded_state_serves(tmp_path):
    """A query that terminates is restarted; a restart that fails is retried after the back-off (it used to
    re-await the dead query, count its failure again and give up). The state comes from ``load_rows``."""
    import time

    from charon.messages import Request

    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, compact_every=0,
                      restart_backoff_s=0.1, epoch_max_failures=3)
    rt = _FlakyRestart("charon.apps.ycsb:app", cfg)
    rt.load_rows(("account", f"a{i}", "", serde.encode(100)) for i in range(1000))

    def call(rid: str, args: list) -> object:
        rt.input_log.append(Request(rid, "account", "a1", "transfer", serde.encode(args)))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            rep = rt.get_reply(rid)
            if rep is not None:
                return serde.decode(rep.value) if rep.ok else rep
            time.sleep(0.05)
        raise TimeoutError(rt.health())

    try:
        rt.start()
        assert call("r1", ["a2", 10]) == 90  # the loaded balance, read on an executor
        rt._query.stop()  # the query terminates under the supervisor
        assert call("r2", ["a3", 5]) == 85
        h = rt.health()
        assert h["fatal"] is None and h["restarts"] == 2 and rt.starts == 3, h
    finally:
        rt.close()
