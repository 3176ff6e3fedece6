"""The resident mode's direct sequencer (charon.runtime.spark.sequencer) over a real SQLite input log, with the
epoch path replaced by a recorder: bounds durable before an epoch runs and gone once it is recorded, epochs that
start as soon as a request is there and grow with the backlog (bounded), the restart ramp, resumption from the
bounds and from a micro-batch checkpoint, and the StreamingQuery face the supervisor uses."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from charon import serde
from charon.config import SparkConfig
from charon.log.sqlite import InputLog
from charon.messages import Request
from charon.runtime.spark.layout import bound_path
from charon.runtime.spark.sequencer import DirectSequencer, read_bound, sequenced_directly
from charon.state.records import EpochRecord


def _req(i: int) -> Request:
    return Request(f"r{i}", "account", f"k{i}", "deposit", serde.encode([1]), time.time())


class Recorder:
    """Stands for the runtime's epoch path: reads the epoch's bound, takes ``delay`` s, writes its record."""

    def __init__(self, ckpt: str, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.ckpt = ckpt
        self.delay = delay
        self.fail_at = fail_at
        self.records: dict[int, EpochRecord] = {}
        self.ran: list[tuple[int, list[int], list[int], float]] = []
        self.bound_before_run: list[bool] = []
        self.lock = threading.Lock()
        self.seq: DirectSequencer

    def run(self, epoch: int) -> None:
        t = time.monotonic()
        starts, ends = self.seq.fixed(epoch)
        self.seq.wait_durable(epoch)  # as the runtime does before a reply or the finalize
        self.bound_before_run.append(read_bound(self.ckpt, epoch) == (starts, ends))
        self.ran.append((epoch, starts, ends, t))
        if epoch == self.fail_at:
            raise RuntimeError(f"injected failure in epoch {epoch}")
        time.sleep(self.delay)
        with self.lock:
            self.records[epoch] = EpochRecord(epoch, [], [], starts, ends)

    def last(self) -> int:
        with self.lock:
            return max(self.records, default=-1)


def _sequencer(tmp: Path, log: InputLog, rec: Recorder, migrate=lambda e: None, **cfg) -> DirectSequencer:  # noqa: ANN001
    config = SparkConfig(data_dir=str(tmp), **cfg)
    rec.seq = DirectSequencer(rec.ckpt, log, log.path, config, run_epoch=rec.run, last_recorded=rec.last,
                              read_record=rec.records.get, exchange=lambda: None, stopping=lambda: False,
                              migrate=migrate)
    return rec.seq.start()


def _until(cond, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.fixture
def log(tmp_path: Path):  # noqa: ANN201
    with InputLog(tmp_path / "input.sqlite", 2) as lg:
        yield lg


def test_an_epoch_starts_as_soon_as_a_request_is_there_and_its_bound_comes_first(tmp_path, log) -> None:
    ckpt = str(tmp_path / "ckpt")
    rec = Recorder(ckpt)
    seq = _sequencer(tmp_path, log, rec)
    try:
        lat = []
        for i in range(20):
            time.sleep(0.01)
            log.append(_req(i))
            t0 = time.monotonic()
            _until(lambda i=i: len(rec.ran) > i)
            lat.append(rec.ran[i][3] - t0)
        _until(lambda: rec.last() == 19)
    finally:
        seq.stop()
    assert not seq.isActive and seq.awaitTermination(0) is True
    assert [e for e, *_ in rec.ran] == list(range(20)), "one epoch per request, in order"
    assert all(rec.bound_before_run), "every bound is durable before anything depends on it"
    assert all(sum(e) - sum(s) == 1 for _, s, e, _ in rec.ran)
    assert sorted(lat)[10] < 0.05, f"an idle sequencer starts the epoch at once (median {sorted(lat)[10]:.4f} s)"
    assert not any(os.path.exists(bound_path(ckpt, e)) for e in range(19)), "recorded epochs' bounds are removed"
    assert sequenced_directly(ckpt)


def test_epochs_grow_with_the_backlog_bounded_by_max_batch_after_the_ramp(tmp_path, log) -> None:
    rec = Recorder(str(tmp_path / "ckpt"), delay=0.2)
    log.append_many([_req(i) for i in range(3000)])
    seq = _sequencer(tmp_path, log, rec, max_batch=1000, restart_batch=100)
    try:
        _until(lambda: rec.last() >= 2)
        log.append_many([_req(i) for i in range(3000, 3050)])
        _until(lambda: sum(sum(e) for _, _, e, _ in rec.ran[-1:]) == 3050, 60)
    finally:
        seq.stop()
    sizes = [sum(e) - sum(s) for _, s, e, _ in rec.ran]
    assert sizes[:3] == [100, 400, 1000], f"the ramp after a start: {sizes}"
    assert max(sizes) == 1000 and sum(sizes) == 3050, sizes
    ends = [e for _, _, e, _ in rec.ran]
    assert all(rec.ran[i + 1][1] == ends[i] for i in range(len(ends) - 1)), "epochs tile the log"


def test_resumes_from_its_bounds_and_from_a_micro_batch_checkpoint(tmp_path, log) -> None:
    ckpt = str(tmp_path / "ckpt")
    log.append_many([_req(i) for i in range(10)])
    rec = Recorder(ckpt, fail_at=1)
    seq = _sequencer(tmp_path, log, rec, restart_batch=4)
    with pytest.raises(RuntimeError, match="injected failure in epoch 1"):
        seq.awaitTermination(30)
    assert not seq.isActive and rec.last() == 0
    first = rec.ran[1][1:3]
    # a restart runs epoch 1 again with the same offsets, then goes on
    rec.fail_at, rec.ran = None, []
    seq = _sequencer(tmp_path, log, rec, restart_batch=4)
    try:
        _until(lambda: rec.records.get(rec.last()) is not None and sum(rec.records[rec.last()].ends) == 10)
    finally:
        seq.stop()
    assert rec.ran[0][0] == 1 and tuple(rec.ran[0][1:3]) == tuple(first), "the unrecorded epoch's own offsets"
    # a checkpoint the micro-batch mode left with a planned batch: its offsets are taken over
    other = Recorder(str(tmp_path / "ckpt2"))
    planned = {0: ([0, 0], [2, 1])}
    log.append(_req(99))
    seq = _sequencer(tmp_path, log, other, migrate=planned.get)
    try:
        _until(lambda: other.records.get(other.last()) is not None
               and sum(other.records[other.last()].ends) == sum(log.end_offsets()))
    finally:
        seq.stop()
    assert other.ran[0][:3] == (0, [0, 0], [2, 1])


def test_a_finalize_thread_that_raises_is_told_only_after_every_write_ended() -> None:
    """A resident task's finalize threads (resident._each): when one partition's write raises, the error reaches
    the task (which tells the driver its round failed) only once every other partition's write has ended, so no
    write of the round goes on after the driver replaced the gang."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from charon.runtime.spark.resident import _each

    ended: list[int] = []
    lock = threading.Lock()

    def write(pid: int) -> int:
        if pid == 0:
            raise OSError("p0: disk full")
        time.sleep(0.2)
        with lock:
            ended.append(pid)
        return pid

    with ThreadPoolExecutor(4) as pool:
        with pytest.raises(OSError, match="p0"):
            _each(pool, write, [0, 1, 2, 3])
        assert sorted(ended) == [1, 2, 3], "the error was raised before the other writes ended"
        assert _each(pool, lambda p: p * 2, [3, 1, 2]) == [6, 2, 4], "results in the order of the partitions"
