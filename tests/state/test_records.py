"""The one epoch-record type (:mod:`charon.state.records`) both runtimes write: records in the formats of
the two former types (the node's ``NodeRecord``, Spark's ``EpochRecord``) decode to the same values, a
record round-trips, a node directory whose record is in the former format recovers, garbage is refused."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import msgspec
import pytest

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.runtime.node.storage import NodeStorage
from charon.runtime.spark.runtime import EpochRecord as SparkEpochRecord
from charon.state.records import EpochRecord, decode_record, encode_record, read_record


class FormerNodeRecord(msgspec.Struct):
    """The node's record format before the one type (field names and defaults)."""

    epoch: int
    counters: list[int]
    deferred: list[tuple[int, bytes]]
    log_end: int
    time: float = 0.0
    next_due: float = -math.inf


class FormerSparkRecord(msgspec.Struct):
    """Spark's record format before the one type."""

    epoch: int
    counters: list[int]
    deferred: list[tuple[int, bytes]]
    starts: list[int]
    ends: list[int]
    stats: dict[str, float] = {}
    time: float = 0.0
    next_due: float = -math.inf


def test_former_formats_decode() -> None:
    node = decode_record(msgspec.msgpack.encode(FormerNodeRecord(7, [3, 4], [(9, b"rq")], 120, 5.5, 6.0)))
    assert (node.epoch, node.counters, node.deferred, node.log_end, node.time, node.next_due) == \
        (7, [3, 4], [(9, b"rq")], 120, 5.5, 6.0)
    assert node.starts == [] and node.ends == [] and node.stats == {}
    old = decode_record(msgspec.msgpack.encode(FormerNodeRecord(0, [], [], 0)))
    assert old.time == 0.0 and old.next_due == -math.inf
    spark = decode_record(msgspec.msgpack.encode(
        FormerSparkRecord(3, [1], [], [0, 10], [10, 20], {"rounds": 2.0}, 1.5, math.inf)))
    assert (spark.starts, spark.ends, spark.stats, spark.time, spark.next_due, spark.log_end) == \
        ([0, 10], [10, 20], {"rounds": 2.0}, 1.5, math.inf, 0)
    assert SparkEpochRecord is EpochRecord  # the Spark runtime uses the one type


def test_round_trip_and_refusals(tmp_path: Path) -> None:
    rec = EpochRecord(4, [1, 2], [(5, b"x")], [0], [3], {"a": 1.0}, 2.0, 9.0, 17)
    assert decode_record(encode_record(rec)) == rec
    short = EpochRecord(1, [0], [], log_end=3)
    assert len(encode_record(short)) < len(msgspec.msgpack.encode(FormerSparkRecord(1, [0], [], [], [])))
    assert read_record(str(tmp_path / "missing.msgpack")) is None
    for bad in (b"\xc1", msgspec.msgpack.encode({"epoch": "x", "counters": [], "deferred": []}),
                msgspec.msgpack.encode([1, 2])):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode_record(bad)


def test_node_directory_with_a_former_record_recovers(tmp_path: Path) -> None:
    """Rewrite a durable node's newest record in the former format: the directory opens with the same state."""

    async def run() -> None:
        async with rt:
            for i in range(10):
                await rt.invoke("account", ycsb.key(i), "transfer", ycsb.key(i + 1), 1)

    rt = InProcessRuntime(ycsb.app, partitions=2, data_dir=str(tmp_path), checkpoint_s=0.01)
    rt.load("account", ycsb.initial_state(20, 100))
    asyncio.run(run())
    snap = rt.snapshot()
    rt.close()
    store = NodeStorage(str(tmp_path), 2)
    try:
        newest = store._newest_record_epoch()
        rec = store.read_record(newest)
        assert rec is not None and rec.log_end > 0
        path = store._record_path(newest)
    finally:
        store.close()
    former = FormerNodeRecord(rec.epoch, rec.counters, rec.deferred, rec.log_end, rec.time, rec.next_due)
    Path(path).write_bytes(msgspec.msgpack.encode(former))
    again = InProcessRuntime(ycsb.app, partitions=2, data_dir=str(tmp_path))
    try:
        assert again.snapshot() == snap and sum(again.entities("account").values()) == 20 * 100
    finally:
        again.close()
