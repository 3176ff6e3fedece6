"""The resident mode's sequencer: a driver loop that fixes each epoch's offsets straight from the input log, with
no Structured Streaming micro-batch (issue 32, step 2).

:class:`DirectSequencer` replaces only what the micro-batch did: it chooses the next epoch's offsets, records them
durably (an :class:`EpochBound` under ``<checkpoint>/bounds``, fsynced) *before* the epoch runs, and calls the
runtime's epoch path (``SparkRuntime._on_batch``: the epoch records, early replies, verdicts, quarantine, timers
and the deferred finalize are the same code as in the micro-batch mode). A bound is removed once its epoch's
record is written: the records stay the source of truth for what a finished epoch contained, the bounds for what
an unfinished one contains (a rerun takes the same offsets, hence the same TIDs and replies).

**Pacing.** An epoch starts as soon as the log holds a request past the previous epoch's end (the log is watched
every :data:`POLL_S` after activity, backing off while idle); it takes everything there is, bounded by
``max_batch`` and ``max_batch_bytes`` (after a start, by ``restart_batch`` growing fourfold per epoch, as the
streaming source ramps). One epoch runs at a time; its finalize may ride in the next one's first round
(``pipeline_finalize``), so under load epochs grow with the arrivals during the previous one, and at low load an
epoch holds one request and starts at once. ``trigger_ms`` > 0 spaces epoch starts at least that far apart.

**Recovery.** On start it resumes after the newest record: unrecorded epochs with a bound run again (the last one
as the epoch in flight, the ones before it as epochs whose deferred finalize was lost, exactly as a restarted
query replays its batches), then new epochs follow. A checkpoint the micro-batch mode left with a planned batch
not recorded yet takes that batch's offsets from the query checkpoint (switching the default exchange keeps every
guarantee); once this sequencer ran, the checkpoint is marked so that the micro-batch mode, whose query checkpoint
no longer describes the epochs, refuses it.

To the runtime it looks like the part of a ``StreamingQuery`` it uses: :attr:`isActive`, :meth:`awaitTermination`
(raises what ended the loop), :meth:`stop`; the runtime's supervisor restarts it like a failed query.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import msgspec

from charon.config import SparkConfig
from charon.log.contract import InputLogLike
from charon.log.location import is_networked
from charon.log.offsets import pad_pair
from charon.log.sqlite import write_stamp
from charon.runtime.spark.layout import bound_path, bounds_dir
from charon.runtime.spark.resident import GangLost
from charon.state.records import EpochRecord
from charon.storage.files import write_file_atomic

__all__ = ["DIRECT", "EpochBound", "DirectSequencer", "read_bound", "sequenced_directly"]

POLL_S = (0.0005, 0.005)  # the log is looked at every 0.5 ms after activity, backing off to 5 ms while idle
NETWORK_POLL_S = (0.002, 0.02)  # a networked log (each look is a request to its server)
RESCAN_S = 0.05  # the log's end offsets are read at least this often even when its files look unchanged
GANG_CHECK_S = 0.5  # while idle, how often the gang is asked whether it is still there
RAMP_GROWTH = 4  # after a start, each epoch's cap grows by this factor up to max_batch (as the source's)
DIRECT = "direct"  # the marker's content


class EpochBound(msgspec.Struct, frozen=True):
    """The offsets ``[starts[p], ends[p])`` of every input-log partition ``p`` epoch ``epoch`` covers."""

    epoch: int
    starts: list[int]
    ends: list[int]


def _marker(checkpoint: str) -> str:
    return os.path.join(checkpoint, "sequencer")


def sequenced_directly(checkpoint: str) -> bool:
    """Whether this sequencer has run epochs of the checkpoint (the micro-batch mode then refuses it)."""
    return os.path.exists(_marker(checkpoint))


def read_bound(checkpoint: str, epoch: int) -> tuple[list[int], list[int]]:
    """``(starts, ends)`` of epoch ``epoch`` as its bound recorded them (``FileNotFoundError`` when it has none)."""
    with open(bound_path(checkpoint, epoch), "rb") as f:
        b = msgspec.json.decode(f.read(), type=EpochBound)
    if b.epoch != epoch:
        raise ValueError(f"bound file of epoch {epoch} names epoch {b.epoch}")
    return list(b.starts), list(b.ends)


def _bound_epochs(checkpoint: str) -> list[int]:
    try:
        names = os.listdir(bounds_dir(checkpoint))
    except FileNotFoundError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


class DirectSequencer:
    """The driver loop of the resident mode (see the module's docstring). ``run_epoch(epoch)`` runs one epoch whose
    bound is written (the runtime's epoch path); ``exchange()`` (the runtime's exchange now: a rescale or a code
    update replaces it) is warmed up (its gang launched) before the first epoch and asked while idle whether it
    failed (``failure()``); ``stopping()`` says that an error is the
    runtime's own stop, not a failure."""

    def __init__(self, checkpoint: str, input_log: InputLogLike, location: str, config: SparkConfig, *,
                 run_epoch: Callable[[int], None], last_recorded: Callable[[], int],
                 read_record: Callable[[int], EpochRecord | None], exchange: Callable[[], object],
                 stopping: Callable[[], bool], migrate: Callable[[int], tuple[list[int], list[int]] | None],
                 writer: Executor | None = None, write: Callable[[str, bytes], None] = write_file_atomic,
                 remove: Callable[[str], None] | None = None) -> None:
        """``writer`` (a seam for the seeded simulator): the executor that writes the bounds (default: one thread
        of its own); whatever it does, a bound is durable once :meth:`wait_durable` returned. ``write`` and
        ``remove``: how a bound (and the marker) is written and removed."""
        self.checkpoint = checkpoint
        # how a bound (and the marker) is written and removed: the checkpoint directory, and object storage with
        # it when the runtime has one (charon.runtime.spark.files.CheckpointFiles)
        self._write_file, self._remove_file = write, remove
        self.input_log = input_log
        self.location = location
        self.config = config
        self._run = run_epoch
        self._last_recorded = last_recorded
        self._read_record = read_record
        self._exchange = exchange
        self._stopping = stopping
        self._migrate = migrate  # an unrecorded epoch's offsets from the micro-batch mode's query checkpoint
        self._networked = is_networked(location)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ramp = max(1, min(config.restart_batch, config.max_batch))
        self._last_start = 0.0
        self.next_epoch = -1  # the epoch the loop fixes next (known once it resumed)
        self.epochs = 0  # epochs this loop started
        # the bound of the epoch running is written (fsynced) on this thread while the epoch's first rounds run;
        # the runtime waits for it before anything depends on it (wait_durable: a reply, the epoch's finalize)
        self._writer: Executor = writer or ThreadPoolExecutor(max_workers=1, thread_name_prefix="charon-bounds")
        self._fixed: tuple[int, list[int], list[int], Future[None]] | None = None
        self._beside: tuple[int, Future[None]] | None = None  # a write made durable with the bound (write_beside)
        self.warmed = threading.Event()  # resumed: the gang launched, the unrecorded epochs run again (or it ended)

    # -- the StreamingQuery face ----------------------------------------------------------------------------------
    def start(self) -> DirectSequencer:
        self._thread = threading.Thread(target=self._loop, name="charon-sequencer", daemon=True)
        self._thread.start()
        return self

    @property
    def isActive(self) -> bool:  # noqa: N802 - StreamingQuery's name
        return not self._done.is_set()

    def awaitTermination(self, timeout: float | None = None) -> bool:  # noqa: N802 - StreamingQuery's name
        """Wait for the loop to end; raise what ended it (nothing: it was stopped)."""
        ended = self._done.wait(timeout)
        if ended and self._error is not None:
            raise self._error
        return ended

    def stop(self, timeout: float = 60.0) -> None:
        """End the loop between epochs (an epoch running finishes first, at most ``timeout``)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # -- the loop -------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            prev_ends = self.resume()
            self.warmed.set()
            while not self._stop.is_set():
                avail = self._wait(prev_ends)
                if avail is None:
                    return
                prev_ends = self.run_next(prev_ends, avail)
        except BaseException as e:  # noqa: BLE001 - awaitTermination raises it to the supervisor
            if not (self._stop.is_set() or self._stopping()):
                self._error = e
        finally:
            self._writer.shutdown(wait=True)
            self.warmed.set()
            self._done.set()

    def run_next(self, prev_ends: list[int], avail: list[int]) -> list[int]:
        """One turn of the loop: cut the next epoch from ``prev_ends`` (the previous epoch's ends) up to ``avail``
        (the log's end offsets), write its bound (on the writer, durable before anything depends on it), run it;
        returns its end offsets. The loop calls it; the seeded simulator drives it directly."""
        epoch = self.next_epoch
        starts, ends = self._cut(prev_ends, avail)
        wrote = self._writer.submit(self._write_file, bound_path(self.checkpoint, epoch),
                                    msgspec.json.encode(EpochBound(epoch, starts, ends)))
        self._fixed = (epoch, starts, ends, wrote)
        self._last_start = time.monotonic()
        self.epochs += 1
        self._run(epoch)
        self.wait_durable(epoch)  # an epoch that neither replied nor finalized (all its work deferred)
        self._fixed = self._beside = None
        self.next_epoch = epoch + 1
        self._writer.submit(self._trim)
        return ends

    def fixed(self, epoch: int) -> tuple[list[int], list[int]]:
        """``(starts, ends)`` of epoch ``epoch``: the bound this loop just fixed (its file may still be being
        written: see :meth:`wait_durable`), else the bound file."""
        f = self._fixed
        if f is not None and f[0] == epoch:
            return list(f[1]), list(f[2])
        return read_bound(self.checkpoint, epoch)

    def write_beside(self, epoch: int, write: Callable[[], None]) -> bool:
        """Run ``write`` on the bounds' writer after epoch ``epoch``'s bound, made durable with it (:meth:`wait_durable`
        waits for both): the epoch's own files (the recovery attempts) off its path. False (nothing done) when the
        epoch's bound is not the one this loop is fixing now."""
        f = self._fixed
        if f is None or f[0] != epoch or self._beside is not None:
            return False
        self._beside = (epoch, self._writer.submit(write))
        return True

    def wait_durable(self, epoch: int) -> None:
        """Block until epoch ``epoch``'s bound is durable (raises if its write failed), and what was written beside
        it (:meth:`write_beside`): called before anything depends on the epoch's offsets (its first reply, its
        finalize). At once for a bound read from its file."""
        f = self._fixed
        if f is not None and f[0] == epoch:
            f[3].result()
            b = self._beside
            if b is not None and b[0] == epoch:
                b[1].result()

    def resume(self) -> list[int]:
        """Rerun the epochs bound but not recorded; the end offsets of the last epoch fixed so far (the loop's
        start; the seeded simulator calls it directly)."""
        os.makedirs(bounds_dir(self.checkpoint), exist_ok=True)
        if not sequenced_directly(self.checkpoint):
            self._write_file(_marker(self.checkpoint), DIRECT.encode())
        last = self._last_recorded()
        self._trim(last)
        e = last + 1
        while not os.path.exists(bound_path(self.checkpoint, e)):  # the micro-batch mode's planned batches
            got = self._migrate(e)
            if got is None:
                break
            self._write_file(bound_path(self.checkpoint, e), msgspec.json.encode(EpochBound(e, *got)))
            e += 1
        planned = [x for x in _bound_epochs(self.checkpoint) if x > last]
        if planned != list(range(last + 1, last + 1 + len(planned))):
            raise RuntimeError(f"epoch bounds {planned} do not follow the last recorded epoch {last}")
        warm = getattr(self._exchange(), "start", None)
        if warm is not None:
            warm()  # the gang is up before the first request waits for it
        if planned:
            ends = read_bound(self.checkpoint, planned[-1])[1]
            self.next_epoch = planned[-1]
            self._last_start = time.monotonic()
            self._run(planned[-1])  # the ones before it first, as recovered epochs (SparkRuntime._run_batch)
            self.next_epoch = planned[-1] + 1
            self._trim()
            return ends
        self.next_epoch = last + 1
        rec = self._read_record(last) if last >= 0 else None
        return list(rec.ends) if rec is not None else list(self.input_log.start_offsets())

    def _cut(self, prev_ends: list[int], avail: list[int]) -> tuple[list[int], list[int]]:
        """The next epoch's offsets: everything from ``prev_ends`` up to ``avail``, at most the ramp's cap of
        requests (``max_batch`` once ramped up) and ``max_batch_bytes`` of them (a SQLite log)."""
        from charon.log.sqlite import InputLog
        from charon.runtime.spark.source import cap_bytes, cap_offsets

        starts, ends = pad_pair(prev_ends, avail)  # the log grew: its new partitions from 0
        ends = cap_offsets(starts, [max(s, x) for s, x in zip(starts, ends, strict=True)],
                           min(self.config.max_batch, self._ramp))
        if self.config.max_batch_bytes and isinstance(self.input_log, InputLog):  # NATS does not tell sizes
            ends = cap_bytes(self.input_log, starts, ends, self.config.max_batch_bytes)
        self._ramp = min(self.config.max_batch, RAMP_GROWTH * self._ramp)
        return starts, ends

    def _stamp(self) -> tuple[tuple[int, int] | None, ...]:
        """Changes whenever the log is written (SQLite in WAL mode: its ``-wal`` file or the database file)."""
        return write_stamp(self.location)

    def _wait(self, prev_ends: list[int]) -> list[int] | None:
        """The log's end offsets once it holds a request past ``prev_ends`` (None: stopped). Raises
        :class:`~charon.runtime.spark.resident.GangLost` (an :class:`~charon.errors.EngineUnavailable`) when the
        exchange failed meanwhile (the supervisor restarts)."""
        pause, longest = NETWORK_POLL_S if self._networked else POLL_S
        trigger = self.config.trigger_ms / 1000.0
        if trigger > 0:
            wait = self._last_start + trigger - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return None
        stamp: tuple[tuple[int, int] | None, ...] | None = None
        looked = checked = time.monotonic()
        hot = 0.0  # the files changed: an append is being committed (visible once its sync is done), look again
        while not self._stop.is_set():
            now = time.monotonic()
            fresh = None if self._networked else self._stamp()
            if fresh != stamp and stamp is not None:
                hot, pause = now + RESCAN_S, POLL_S[0]
            if fresh is None or fresh != stamp or now < hot or now - looked >= RESCAN_S:
                stamp, looked = fresh, now
                ends = self.input_log.end_offsets()
                if any(e > s for s, e in zip(*pad_pair(prev_ends, ends), strict=True)):
                    return ends
            if now - checked >= GANG_CHECK_S:
                checked = now
                failure = getattr(self._exchange(), "failure", None)
                why = failure() if failure is not None else None
                if why:
                    raise GangLost(f"the resident gang failed while idle: {why}")
            self._stop.wait(pause)
            pause = min(longest, pause * 1.5)
        return None

    def _trim(self, upto: int | None = None) -> None:
        """Remove the bounds of recorded epochs (their records hold the same offsets): disk stays bounded."""
        last = self._last_recorded() if upto is None else upto
        for e in _bound_epochs(self.checkpoint):
            if e > last:
                break
            if self._remove_file is not None:
                self._remove_file(bound_path(self.checkpoint, e))
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(bound_path(self.checkpoint, e))

