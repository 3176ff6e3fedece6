"""The Spark driver's reply writer (charon.runtime.replies): in order, errors raised on the epoch's thread,
a failed batch written again once the log is back, nothing queued survives a crash (abandon)."""

from __future__ import annotations

import os
import threading

import pytest

from charon.log.sqlite import OutputLog
from charon.messages import Reply
from charon.runtime.replies import ReplyWriter


def _replies(epoch: int, n: int) -> list[Reply]:
    return [Reply(f"e{epoch}-{i}", epoch * 1000 + i, epoch, True, b"\x01", "", "", epoch * 1000 + i)
            for i in range(n)]


def test_batches_reach_the_log_in_order_before_flush_returns(tmp_path) -> None:
    log = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    w = ReplyWriter(log.put_many)
    for e in range(20):
        w.put(_replies(e, 50))
    w.flush()
    assert w.pending() == 0
    got = [r.request_id for _, r in log.read_since(0, 10_000)]
    assert got == [r.request_id for e in range(20) for r in _replies(e, 50)]
    w.close()


def test_a_failed_write_is_raised_then_written_again_once_the_log_is_back(tmp_path) -> None:
    log = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    down = threading.Event()
    down.set()

    def write(batch: list[Reply]) -> int:
        if down.is_set():
            raise OSError("log unreachable")
        return log.put_many(batch)

    w = ReplyWriter(write)
    w.put(_replies(1, 3))
    with pytest.raises(OSError, match="unreachable"):
        w.flush()
    with pytest.raises(OSError, match="unreachable"):  # still failed: put does not hide it either
        w.put(_replies(2, 3))
    assert log.read_since(0) == []
    down.clear()
    w.flush()  # the kept batch is written now, nothing lost
    assert [r.request_id for _, r in log.read_since(0)] == [r.request_id for r in _replies(1, 3)]
    w.put(_replies(2, 3))
    w.close()
    assert len(log.read_since(0)) == 6


def test_abandon_drops_what_a_crash_would_lose(tmp_path) -> None:
    log = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    gate = threading.Event()

    def slow(batch: list[Reply]) -> int:
        gate.wait(10)
        return log.put_many(batch)

    w = ReplyWriter(slow)
    w.put(_replies(1, 2))
    w.put(_replies(2, 2))
    threading.Timer(0.2, gate.set).start()
    w.abandon()  # waits for the batch being written (it may land); the queued one never does
    ids = {r.request_id for _, r in log.read_since(0)}
    assert not ids & {r.request_id for r in _replies(2, 2)}
