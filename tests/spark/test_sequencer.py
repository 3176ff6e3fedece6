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


def test_a_write_beside_the_bound_is_durable_with_it_and_its_failure_fails_the_epoch(tmp_path, log) -> None:
    """``write_beside`` (the recovery file of an epoch's first start): written on the bounds' writer after the bound,
    ``wait_durable`` waits for both (the file is on disk once it returned) and raises the write's failure, so no reply
    or finalize goes out without it and the loop ends with the error (the supervisor restarts); it is refused for an
    epoch that is not the one being fixed."""
    from charon.runtime.guard.quarantine import RecoveryAttempts

    ckpt = str(tmp_path / "ckpt")
    rec = Recorder(ckpt)
    attempts = RecoveryAttempts(ckpt)
    on_disk: list[tuple[int, int | None]] = []
    failures: list[str] = []

    def fail() -> None:
        raise OSError("disk full")

    def run(epoch: int) -> None:
        seq = rec.seq
        assert not seq.write_beside(epoch + 1, lambda: None), "only the epoch being fixed"
        if epoch == 1:
            assert seq.write_beside(epoch, fail)
            try:
                seq.wait_durable(epoch)
            except OSError as e:
                failures.append(str(e))
                raise
        attempts.starting(epoch, 7, later=lambda write: seq.write_beside(epoch, write))
        seq.wait_durable(epoch)
        disk = RecoveryAttempts(ckpt)
        on_disk.append((disk.epoch, disk.reply_mark(epoch)))
        Recorder.run(rec, epoch)

    rec.run = run  # type: ignore[method-assign]
    seq = _sequencer(tmp_path, log, rec)
    try:
        log.append(_req(0))
        _until(lambda: rec.last() == 0)
        log.append(_req(1))
        _until(lambda: not seq.isActive)
    finally:
        seq.stop()
    assert on_disk == [(0, 7)], "the recovery file named the epoch before anything depended on it"
    assert failures == ["disk full"], "a failed write beside the bound fails the wait for it"
    with pytest.raises(OSError, match="disk full"):
        seq.awaitTermination(0)
    assert rec.last() == 0, "the epoch whose write failed is not recorded"


def test_a_finalize_sent_ahead_takes_no_answer_and_its_failure_is_told_by_the_next_round(tmp_path) -> None:
    """``ResidentExchange.prefinalize``'s frame in a gang task (``GangTask``): it takes no answer; a finalize that
    raised (here its code cannot be loaded) is told by the task's next round, which answers with the error and ends
    the task, so the driver's round fails as for a round that raised."""
    import pickle

    from charon.core.partition import Control, Prior
    from charon.runtime.spark.resident import NO_REPLY, GangTask

    task = GangTask(1, str(tmp_path / "local"), str(tmp_path / "state"), False)
    ahead = pickle.dumps(("prior", Prior(3, [], []), [0], "no_such_module_xyz:app", None, ()))
    assert task.handle(ahead) == NO_REPLY and not task.failed
    rnd = pickle.dumps(("round", Control(4, Control.DRY, prior=Prior(3, [], [])), {0: []}, "no_such_module_xyz:app",
                        None, None, None, ()))
    results, stats = pickle.loads(task.handle(rnd))
    assert results is None and "written ahead failed" in stats["error"] and "no_such_module_xyz" in stats["error"]
    assert task.failed, "the task ends after telling the driver"


@pytest.mark.parametrize(("master", "cpus", "want"), [
    ("local[2]", 8, 1), ("local[4]", 8, 3), ("local[1]", 8, 1), ("local", 8, 1), ("local[*]", 2, 1),
    ("local[*]", 8, 7), ("local[3,2]", 8, 2), ("spark://h:7077", 8, 4), ("yarn", 8, 4),
])
def test_a_new_deployment_gets_one_partition_per_gang_task_in_local_mode(monkeypatch, master, cpus, want) -> None:
    """``SparkConfig.default_partitions``: in local mode the resident gang's size (cores but one, at least one),
    on a cluster the configured count."""
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert SparkConfig(master=master).default_partitions() == want
