"""The ``charon_log`` / ``charon_replies`` streaming sources on a real local[2] SparkSession."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from charon.log.sqlite import InputLog, OutputLog
from charon.messages import Reply, Request
from charon.runtime.spark.source import batch_offsets, cap_offsets, read_offset_log
from charon.serde import encode

PYTHON = sys.executable


@pytest.fixture(scope="module")
def spark(spark: Any) -> Iterator[Any]:
    """The suite's one session (tests/conftest.py) with the charon sources registered; a stopping query of this
    module's waits at most 30 s (the setting is restored for the modules after it)."""
    from charon.runtime.spark.source import register

    spark.conf.set("spark.sql.streaming.stopTimeout", "30s")
    register(spark)
    yield spark
    spark.conf.unset("spark.sql.streaming.stopTimeout")


def wait_until(cond: Callable[[], bool], timeout: float = 90.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def make_reqs(prefix: str, n: int) -> list[Request]:
    return [Request(f"{prefix}{i}", "account", f"{prefix}-key{i}", "deposit", encode([i])) for i in range(n)]


# -- pure functions ------------------------------------------------------------------------------


def test_cap_offsets_fair_and_bounded() -> None:
    assert cap_offsets([0, 0], [3, 5], 100) == [3, 5]  # under the cap: everything
    assert cap_offsets([0, 0, 0, 0], [10, 10, 10, 10], 8) == [2, 2, 2, 2]
    assert cap_offsets([0, 0, 0, 0], [1, 100, 0, 100], 9) == [1, 4, 0, 4]  # unused share redistributed
    got = cap_offsets([5, 0, 0], [100, 100, 100], 7)
    assert sum(g - s for g, s in zip(got, [5, 0, 0], strict=True)) == 7
    assert all(2 <= g - s <= 3 for g, s in zip(got, [5, 0, 0], strict=True))
    # fewer records than partitions: the remainder rotates with the start position (no starvation)
    a = cap_offsets([0, 0, 0, 0], [9, 9, 9, 9], 1)
    b = cap_offsets(a, [9, 9, 9, 9], 1)
    assert sum(a) == 1 and sum(b) == 2 and a != [x - y for x, y in zip(b, a, strict=True)]
    assert cap_offsets([3, 3], [3, 3], 10) == [3, 3]


def test_restart_ramp_sizes_new_batches_after_a_start(tmp_path: Path) -> None:
    """After a (re)start the reader plans short batches first (``startRecordsPerBatch``), doubling up to the cap;
    a new reader (a restarted query) starts short again. An idle call plans nothing and keeps the ramp."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from charon.runtime.spark.source import CharonLogStreamReader

    log_path = str(tmp_path / "in.db")
    log = InputLog(log_path, partitions=2)
    log.append_many(make_reqs("a", 5000))
    opts = {"path": log_path, "maxRecordsPerBatch": "2000", "startRecordsPerBatch": "300", "idleWaitMs": "0"}

    def sizes(reader: CharonLogStreamReader, start: dict, n: int) -> tuple[list[int], dict]:
        out = []
        for _ in range(n):
            end = reader.latestOffset(start, reader.getDefaultReadLimit())
            out.append(sum(end["offsets"]) - sum(start["offsets"]))
            start = {"offsets": end["offsets"]}
        return out, start

    first = CharonLogStreamReader(opts)
    got, at = sizes(first, first.initialOffset(), 6)
    assert got == [300, 1200, 2000, 1500, 0, 0]  # ramp (x4), capped at maxRecordsPerBatch, then the log's end
    assert at == {"offsets": log.end_offsets()}
    log.append_many(make_reqs("b", 5000))
    assert sizes(first, at, 1)[0] == [2000], "the ramp is only after a start: an idle reader stays at the cap"
    restarted = CharonLogStreamReader(opts)
    assert sizes(restarted, at, 3)[0] == [300, 1200, 2000]
    assert restarted.latestOffset(at, ReadAllAvailable())["offsets"] == log.end_offsets(), "only ReadMaxRows"
    assert CharonLogStreamReader({**opts, "startRecordsPerBatch": "99999"}).ramp == 2000
    assert sizes(CharonLogStreamReader({k: v for k, v in opts.items() if k != "startRecordsPerBatch"}), at, 1)[0] \
        == [2000], "no option: no ramp"
    with pytest.raises(ValueError, match="startRecordsPerBatch"):
        CharonLogStreamReader({**opts, "startRecordsPerBatch": "0"})


def test_reader_follows_a_log_that_grows_and_shrinks_while_the_query_runs(tmp_path: Path) -> None:
    """The reader lives as long as the query: it reads the physical count at every plan, pads the older start
    offsets with 0s, plans tasks only for non-empty ranges, and keeps reading retired partitions; the offset log
    entries it writes give ``batch_offsets`` equal-length lists."""
    import json

    from charon.runtime.spark.source import CharonLogStreamReader, LogRange

    log_path = str(tmp_path / "in.db")
    log = InputLog(log_path, partitions=2)
    log.append_many(make_reqs("a", 10))
    reader = CharonLogStreamReader({"path": log_path, "idleWaitMs": "0"})
    start = reader.initialOffset()
    first = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert len(first["offsets"]) == 2
    log.resize(4)
    log.append_many([(r, 3) for r in make_reqs("b", 5)])  # only the new partition 3 has data
    second = reader.latestOffset({"offsets": first["offsets"]}, reader.getDefaultReadLimit())
    assert second["start"] == first["offsets"] + [0, 0] and second["offsets"] == first["offsets"] + [0, 5]
    parts = reader.partitions({"offsets": first["offsets"]}, {"offsets": second["offsets"]})
    assert [(p.partition, p.start, p.end) for p in parts if isinstance(p, LogRange)] == [(3, 0, 5)]
    assert next(iter(reader.read(parts[0]))).column(2).to_pylist() == [r.request_id for r in log.read(3, 0, 5)]
    log.resize(3)  # route only: partition 3 is still read
    log.append(make_reqs("c", 1)[0], partition=3)
    third = reader.latestOffset({"offsets": second["offsets"]}, reader.getDefaultReadLimit())
    assert third["offsets"][3] == 6 and len(third["offsets"]) == 4
    ckpt = tmp_path / "q"
    (ckpt / "offsets").mkdir(parents=True)
    (ckpt / "offsets" / "0").write_text("v1\n{}\n" + json.dumps(first) + "\n")
    (ckpt / "offsets" / "1").write_text("v1\n{}\n" + json.dumps({"offsets": second["offsets"],
                                                                   "start": first["offsets"]}) + "\n")
    assert batch_offsets(str(ckpt), 1) == (first["offsets"] + [0, 0], second["offsets"])


# -- streaming over the input log ----------------------------------------------------------------


class Collector:
    """foreachBatch sink: records every attempt of every batch (rows sorted by partition, offset)."""

    def __init__(self, ckpt: str, fail_batches_with_data_after: int | None = None) -> None:
        self.ckpt = ckpt
        self.lock = threading.Lock()
        self.batches: dict[int, list[tuple[int, int, str]]] = {}
        self.ranges: dict[int, tuple[list[int], list[int]]] = {}
        self.failed: dict[int, list[tuple[int, int, str]]] = {}
        self.fail_after = fail_batches_with_data_after
        self.times: list[float] = []

    def __call__(self, df: Any, batch_id: int) -> None:
        t0 = time.perf_counter()
        rows = sorted((r.partition, r.offset, r.request_id) for r in df.collect())
        starts, ends = batch_offsets(self.ckpt, batch_id)
        with self.lock:
            if rows and self.fail_after is not None and len(self.batches_with_data()) >= self.fail_after:
                self.failed[batch_id] = rows
                self.ranges[batch_id] = (starts, ends)
                raise RuntimeError(f"injected failure in batch {batch_id}")
            self.batches[batch_id] = rows
            self.ranges[batch_id] = (starts, ends)
            self.times.append(time.perf_counter() - t0)

    def batches_with_data(self) -> list[int]:
        return [b for b, rows in self.batches.items() if rows]

    def count(self) -> int:
        with self.lock:
            return sum(len(r) for r in self.batches.values())


@pytest.mark.spark
def test_log_stream_exactly_once_replay_and_restart(spark: Any, tmp_path: Path) -> None:
    log_path = str(tmp_path / "in.db")
    ckpt = str(tmp_path / "ckpt")
    log = InputLog(log_path, partitions=4)
    cap = 4

    def start(sink: Collector) -> Any:
        return (
            spark.readStream.format("charon_log")
            .option("path", log_path)
            .option("partitions", "4")
            .option("maxRecordsPerBatch", str(cap))
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", ckpt)
            .start()
        )

    # 1. first run: 10 requests (>= 3 capped batches), 6 more while running, then an injected crash.
    log.append_many(make_reqs("a", 10))
    first = Collector(ckpt)
    q = start(first)
    wait_until(lambda: first.count() >= 10, what="first 10 requests")
    log.append_many(make_reqs("b", 6))
    wait_until(lambda: first.count() >= 16, what="16 requests")
    assert len(first.batches_with_data()) >= 3 + 2
    first.fail_after = 0  # the next batch with data fails after seeing its rows
    log.append_many(make_reqs("c", 5))
    wait_until(lambda: bool(first.failed), what="the injected failure")
    with pytest.raises(Exception, match="injected failure"):
        q.awaitTermination(60)
    (failed_id,) = first.failed
    assert max(first.batches) < failed_id
    assert read_offset_log(ckpt, failed_id) is not None  # offsets written before the batch ran
    assert not os.path.exists(os.path.join(ckpt, "commits", str(failed_id)))

    # 2. more data while the query is down; a restart must replay the failed batch identically.
    log.append_many(make_reqs("d", 7))
    second = Collector(ckpt)
    q = start(second)
    try:
        wait_until(lambda: second.count() + first.count() >= 28, what="all 28 requests")
    finally:
        q.stop()

    assert second.batches[failed_id] == first.failed[failed_id]  # same (partition, offset, id) rows
    assert second.ranges[failed_id] == first.ranges[failed_id]
    assert set(first.batches).isdisjoint(second.batches)

    committed = {**first.batches, **second.batches}
    ranges = {**first.ranges, **second.ranges}
    ends = log.end_offsets()
    assert sum(ends) == 28
    per_part: dict[int, list[int]] = {p: [] for p in range(4)}
    ids: list[str] = []
    for b in sorted(committed):
        rows = committed[b]
        assert len(rows) <= cap
        starts_b, ends_b = ranges[b]
        # the batch's rows are exactly the log's entries in [starts, ends), in (partition, offset) order
        assert [(p, o, r.request_id) for p, o, r in log.read_range(starts_b, ends_b)] == rows
        for p, o, rid in rows:
            per_part[p].append(o)
            ids.append(rid)
    for p in range(4):  # no gaps, no duplicates, in order, across batches and the restart
        assert per_part[p] == list(range(ends[p]))
    assert sorted(ids) == sorted(r.request_id for _, _, r in log.read_range([0] * 4, ends))
    assert len(ids) == len(set(ids)) == 28
    print(f"\nforeachBatch collect+offsets per batch (s): {sorted(second.times)}")


@pytest.mark.spark
def test_replies_stream_exactly_once(spark: Any, tmp_path: Path) -> None:
    out_path = str(tmp_path / "out.db")
    ckpt = str(tmp_path / "ckpt")
    out = OutputLog(out_path)
    seen: list[tuple[int, int, str]] = []  # (batch_id, seq, request_id)
    lock = threading.Lock()

    def sink(df: Any, batch_id: int) -> None:
        rows = sorted((r.seq, r.request_id, r.epoch, r.ok, r.position) for r in df.collect())
        with lock:
            if any(b == batch_id for b, _, _ in seen):
                # a batch stopped before Spark committed it is replayed with the same id and offsets:
                # an idempotent sink (keyed by batch id) sees it once
                assert [(s, rid) for b, s, rid in seen if b == batch_id] == [(s, rid) for s, rid, *_ in rows]
                return
            seen.extend((batch_id, s, rid) for s, rid, *_ in rows)
        for s, rid, epoch, ok, position in rows:
            assert out.get(rid) == Reply(rid, tid=s * 10, epoch=epoch, ok=ok, position=position)
            assert position == (None if epoch == 0 else 100 - s)  # carried as stored (epoch 0: no position)

    def put_epoch(epoch: int, n: int) -> None:
        base = out.last_seq()
        replies = [Reply(f"e{epoch}-{i}", tid=(base + i + 1) * 10, epoch=epoch, ok=True,
                         position=None if epoch == 0 else 100 - (base + i + 1)) for i in range(n)]
        assert out.put_many(replies) == n

    def start() -> Any:
        return (
            spark.readStream.format("charon_replies")
            .option("path", out_path)
            .option("maxRecordsPerBatch", "5")
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", ckpt)
            .start()
        )

    put_epoch(0, 3)
    q = start()
    wait_until(lambda: len(seen) >= 3, what="epoch 0 replies")
    put_epoch(1, 8)  # more than one batch's worth
    wait_until(lambda: len(seen) >= 11, what="epoch 1 replies")
    q.stop()
    put_epoch(2, 4)
    assert out.put_many([Reply("e1-0", 1, 1, False)]) == 0  # a replayed reply is not stored again
    q = start()
    try:
        wait_until(lambda: len(seen) >= 15, what="epoch 2 replies")
        time.sleep(1.0)  # let any (wrong) duplicate batch show up
    finally:
        q.stop()

    assert [s for _, s, _ in seen] == [s for s, _ in out.read_since(0)]  # each once, in seq order
    assert len(seen) == out.count() == 15
    per_batch: dict[int, int] = {}
    for b, _, _ in seen:
        per_batch[b] = per_batch.get(b, 0) + 1
    assert max(per_batch.values()) <= 5 and len(per_batch) >= 4
