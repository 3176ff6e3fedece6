"""Disk retention in a long run (issue 9): request ids and replies older than the dedup window are forgotten
together (only once the request left the input log), runtime records are forgotten once truncated, and the
Spark runtime's epoch records are bounded. Real SQLite files; the Spark runtime is built without a session."""

from __future__ import annotations

import os
from pathlib import Path

from charon import serde
from charon.config import SparkConfig
from charon.log.sqlite import InputLog, OutputLog
from charon.messages import Reply, Request
from charon.runtime.spark.runtime import TICK, SparkRuntime
from charon.state.records import EpochRecord


def _req(rid: str, key: str = "k") -> Request:
    return Request(rid, "account", key, "deposit", serde.encode([1]))


def _rep(rid: str, epoch: int) -> Reply:
    return Reply(rid, tid=1, epoch=epoch, ok=True, value=serde.encode(None), position=0)


def test_forget_only_truncated_ids_and_prune_their_replies(tmp_path: Path) -> None:
    log = InputLog(tmp_path / "in.sqlite", 1)
    out = OutputLog(tmp_path / "out.sqlite")
    for i in range(6):
        log.append(_req(f"r{i}"))
    log.append(Request(f"{TICK}3", TICK, "", "", serde.encode([])))
    for e in range(6):
        out.put_many([_rep(f"r{e}", e)])
        out.mark_epoch(e)  # boundary of epoch e: seq e + 1
    log.truncate([4])  # r0..r3 left the log; r4, r5 and the tick are still in it
    forgotten = log.forget(out.request_ids_through(out.last_seq()), truncated_prefix=TICK)
    assert forgotten == ["r0", "r1", "r2", "r3"]
    assert not log.contains("r0") and log.contains("r4") and log.contains(f"{TICK}3")  # tick not truncated yet
    assert out.prune(forgotten) == 4
    assert out.get("r3") is None and out.get("r4") is not None and out.count() == 2
    assert out.epoch_boundaries(0) == [4, 5, 6]  # epoch 3's boundary, below the oldest reply (seq 5), stays
    # a forgotten id is new again: the retry is appended (and would run) again
    assert log.append(_req("r0")) == (0, 7)
    log.truncate([8])
    assert log.forget([], truncated_prefix=TICK) == [] and not log.contains(f"{TICK}3")


def test_spark_runtime_retention_bounds_replies_ids_and_epoch_records(tmp_path: Path) -> None:
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=1, dedup_window_s=0.0, keep_epoch_records=3)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    for e in range(10):
        rt.input_log.append(_req(f"q{e}"))
        rt.output_log.put_many([_rep(f"q{e}", e)])
        rt.output_log.mark_epoch(e)
        rt._write_record(EpochRecord(e, [e + 1], [], [e], [e + 1]))
    rt.input_log.truncate([8])
    rt._retain(8)
    assert [rt.input_log.contains(f"q{e}") for e in range(10)] == [False] * 8 + [True] * 2
    assert rt.output_log.count() == 2 and rt.get_reply("q9") is not None
    names = sorted(os.listdir(tmp_path / "checkpoint" / "epochs"))
    assert names == [f"{e:012d}.msgpack" for e in range(5, 10)]
    assert rt.last_recorded_epoch() == 9
    # a long window keeps everything
    rt2 = SparkRuntime("charon.apps.ycsb:app", SparkConfig(data_dir=str(tmp_path / "b"), partitions=1))
    rt2.input_log.append(_req("x"))
    rt2.output_log.put_many([_rep("x", 0)])
    rt2._write_record(EpochRecord(0, [1], [], [0], [1]))
    rt2.input_log.truncate([1])
    rt2._retain(0)
    assert rt2.input_log.contains("x") and rt2.get_reply("x") is not None


async def test_durable_inprocess_engine_forgets_after_the_window(tmp_path: Path, monkeypatch) -> None:
    from charon.apps.ycsb import app
    from charon.runtime.node.inprocess import InProcessRuntime

    monkeypatch.setenv("CHARON_DEDUP_WINDOW_S", "0")
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path), checkpoint_s=0.0, compact_every=1,
                          reply_retention=1)  # the in-memory reply cache would answer the retry itself
    await rt.start()
    try:
        for i in range(30):
            await rt.submit("account", f"a{i % 3}", "deposit", [1], request_id=f"r{i}")
        rt.node.flush()
        await rt.submit("account", "b", "deposit", [1], request_id="last")  # one more checkpoint + compaction
        rt.node.flush()
        log, out = rt.node.input_log, rt.node.output_log
        assert not log.contains("r0") and out.get("r0") is None  # forgotten together
        assert out.count() < 31
        before = rt.read_state("account", "a0")
        await rt.submit("account", "a0", "deposit", [1], request_id="r0")  # after the window: runs again
        assert rt.read_state("account", "a0") == before + 1
    finally:
        await rt.stop()
        rt.close()


def test_last_seq_survives_pruning_everything(tmp_path: Path) -> None:
    out = OutputLog(tmp_path / "out.sqlite")
    out.put_many([_rep("a", 0), _rep("b", 0)])
    assert out.prune(["a", "b"]) == 2 and out.count() == 0
    assert out.last_seq() == 2  # readers positioned at 2 are not sent back to 0
    out.put(_rep("c", 1))
    assert out.read_since(2) and out.read_since(2)[0][0] == 3


def test_connections_of_finished_threads_are_closed(tmp_path: Path) -> None:
    """The Spark runtime compacts in a new thread each time: its log connections must not pile up (each holds
    a file descriptor and a page cache; a long run leaked ~6 a minute before)."""
    import threading

    log = InputLog(tmp_path / "in.sqlite", 1)
    log.append(_req("x"))

    def fds() -> int:
        target = str(tmp_path / "in.sqlite")
        return sum(os.path.realpath(f"/proc/self/fd/{fd}") == target for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    for _ in range(40):
        t = threading.Thread(target=log.contains, args=("x",))
        t.start()
        t.join()
    assert fds() <= 3, fds()  # this thread's, the last finished thread's (closed by the next new one)
    log.close()
