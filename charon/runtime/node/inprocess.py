"""The in-process runtime: the same deterministic core with an in-memory exchange.

It is the test harness application authors write their tests with (full transactional semantics) and a
low-latency single-node engine.

Epochs are adaptive (service mode): an epoch takes every waiting request (at most ``epoch_max_txns``, a
memory bound) as soon as the previous epoch is done, so the batch grows with the arrival rate times the
epoch's cost (high rates get big epochs, low rates short ones) and there is no fixed batch-size cliff. It
waits for more requests (at most ``epoch_max_ms``) only while the batch is too small to amortize the measured
fixed cost of an epoch, and limits a backlog's batch while too many of its transactions conflict
(:class:`EpochSizer`). Durable mode: the previous batch's log commit is the window.

A long-lived engine tunes Python's garbage collector at ``start()`` (``gc_tuning``, see :func:`tune_gc`): the
loaded state and code are frozen out of the collector and young collections run every ``gc_threshold``
allocations instead of 700; a short warm-up (``warmup_txns`` transfers of a built-in application on a scratch
runtime; no user code runs) takes the engine's hot path once before the first request.

Without ``data_dir`` it is *volatile*: state, replies and request ids live in memory only. With
``data_dir`` it is *durable* (:mod:`charon.runtime.node.storage`): every epoch's batch is in the SQLite input log
before the epoch runs, state and replies are checkpointed in the background, and a restart (clean or after SIGKILL)
recovers by replaying the log; a request id runs once across restarts and a retry gets the first reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from charon import serde
from charon.client_errors import raise_for_reply
from charon.config import DURABLE_REPLY_RETENTION, VOLATILE_REPLY_RETENTION
from charon.core import determinism
from charon.core import timers as _timers
from charon.core.context import EFFECT_STREAM
from charon.core.epoch import EpochCoordinator, EpochResult
from charon.core.partition import MAX_INVOCATIONS, Control, Invoke, PartitionUnit, RoundOutput
from charon.core.partition import Reply as ReplyMsg
from charon.core.routing import check_stream, entity_prefix, partition_of, store_key
from charon.core.timers import MAX_TIMERS_PER_EPOCH, Timer
from charon.errors import ReservedRequestId
from charon.log.streams import DEFAULT_RETAIN_EVENTS, StreamEvent, StreamLog
from charon.messages import Reply, Request, is_reserved_id
from charon.operator import Application, Operator, batch_request
from charon.runtime.contract import EngineStopped, Enqueue
from charon.runtime.control.controls import EngineBacked
from charon.runtime.control.gate import EpochGate
from charon.runtime.control.inspector import Inspector, InspectorSettings, LiveRequest
from charon.runtime.guard.interrupts import ThreadHandle, clear_pending
from charon.runtime.guard.quarantine import RecoveryAttempts, quarantine_killers
from charon.runtime.guard.verdicts import VerdictBook
from charon.runtime.guard.watchdog import DEFAULT_INTERVAL, DEFAULT_TIMEOUT, Watchdog
from charon.runtime.node.inprocess_engine import InProcessEngine
from charon.runtime.schedules import start_declaring
from charon.state.store import MemoryStore

if TYPE_CHECKING:
    from charon.log.contract import InputLogLike
    from charon.runtime.effects import EffectExecutor
    from charon.runtime.node.storage import NodeStorage


_log = logging.getLogger("charon.engine")

#: Young-generation threshold of :func:`tune_gc` (CPython's default is 700).
T = TypeVar("T")
GC_THRESHOLD = 50_000
_GC_TUNED = False


def tune_gc(threshold: int = GC_THRESHOLD) -> None:
    """Tune the collector for a long-lived engine: collect once, freeze what exists, collect young objects rarely.

    ``gc.freeze()`` moves every object alive now (modules, the application, loaded state) out of the
    collector's generations, so full collections no longer traverse them; it runs once per process. Objects
    still die by reference counting; only cycles among the frozen objects would never be collected.
    """
    global _GC_TUNED
    if not _GC_TUNED:
        gc.collect()
        gc.freeze()
        _GC_TUNED = True
    t0, t1, t2 = gc.get_threshold()
    if t0 < threshold:
        gc.set_threshold(threshold, max(t1, 20), max(t2, 100))


def _warmup_app() -> Application:
    """A built-in application exercising the engine like a transfer: read, write, a call, a reply, aborts."""
    op = Operator("__warmup")

    async def deposit(ctx: Any, amount: int) -> int:
        ctx.put(ctx.get(0) + amount)
        return amount

    async def hop(ctx: Any, to: str, amount: int) -> int:
        if amount == 0:
            raise ValueError("warm-up abort")
        ctx.put(ctx.get(0) - amount)
        return await ctx.call(op, to, "deposit", amount)

    op.function(deposit)
    op.function(hop)
    return Application("__warmup", [op])


class EpochSizer:
    """Adaptive epoch closing: how long to wait for more requests, from the arrival rate and measured costs.

    It fits the per-transaction cost ``c`` and the fixed per-epoch cost ``F`` to the recent epochs
    (``duration = F + c·size`` by least squares, each epoch's weight decaying by ``1 - 1/memory`` per epoch, so
    an application whose transactions are costly is not taken for one with a costly epoch), and keeps a
    moving average of the arrival rate (over the last ``rate_window_s``, weighted by time). While the recent
    epochs all had about the same size, the split keeps its last value (at first: ``c`` = 20 µs).
    An epoch of ``B`` requests spends ``F / (F + c·B)`` of its time on fixed cost; the target batch keeps
    that at most ``overhead`` (``B* = F·(1 - o) / (o·c)``).
    With fewer waiting, it waits for the expected time until ``B*`` have arrived, at most ``max_wait_s``;
    with at least ``B*`` waiting, it does not wait. Nor does it while the engine is mostly idle: when epochs of
    one request each would keep it busy less than ``idle_load`` of the time (``rate·(F + c) < idle_load``),
    waiting saves no CPU that anything needs and only adds latency, so an epoch starts at once (the latency
    floor at low rates is then one epoch, not the batching window).

    Under a backlog, bigger epochs mean more conflicts (each one costs a fallback re-run), so the batch is
    also limited (:meth:`limit`): the limit shrinks while more than ``conflicts_high`` of an epoch's
    transactions conflicted and grows back while fewer than half that did, between ``min_batch`` and
    ``max_batch``.
    """

    def __init__(self, max_wait_s: float, max_batch: int = 10_000, overhead: float = 0.1, alpha: float = 0.2,
                 conflicts_high: float = 0.15, min_batch: int = 100, idle_load: float = 0.9,
                 rate_window_s: float = 0.05, memory: int = 20) -> None:
        self.max_wait_s = max_wait_s
        self.idle_load = idle_load
        self.rate_window_s = rate_window_s
        self.overhead = overhead
        self.alpha = alpha  # no longer used (the costs are fitted, see _fit); kept for callers passing it
        self.max_batch = max_batch
        self.min_batch = min(min_batch, max_batch)
        self.conflicts_high = conflicts_high
        self._limit = float(max_batch)
        self.per_txn_s = 20e-6
        self.fixed_s = 200e-6
        self.rate = 0.0  # requests per second (moving average)
        self._last = time.perf_counter()
        self._decay = 1.0 - 1.0 / max(memory, 2)
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed sums of 1, size, duration, size², size·duration

    def limit(self) -> int:
        """The most requests the next epoch takes."""
        return int(self._limit)

    def observe(self, size: int, duration_s: float, arrived: int, conflicts: int = 0) -> None:
        """One epoch of ``size`` requests took ``duration_s`` (``conflicts`` of them went to the fallback);
        ``arrived`` requests came since the last call."""
        if size >= self.min_batch:
            share = conflicts / size
            if share > self.conflicts_high:
                self._limit = max(float(self.min_batch), min(self._limit, size) * 0.8)
            elif share < self.conflicts_high / 2:
                self._limit = min(float(self.max_batch), self._limit * 1.25)
        now = time.perf_counter()
        span = now - self._last
        self._last = now
        if span > 0:  # weighted by time (not per epoch: many short epochs would inflate it)
            self.rate += (1.0 - math.exp(-span / self.rate_window_s)) * (arrived / span - self.rate)
        if size > 0:
            self._fit(size, duration_s)

    def _fit(self, size: int, duration_s: float) -> None:
        """Refit ``duration = F + c·size`` with one more epoch (older ones weigh less)."""
        d, sums = self._decay, self._sums
        sw = sums[0] = sums[0] * d + 1.0
        sx = sums[1] = sums[1] * d + size
        sy = sums[2] = sums[2] * d + duration_s
        sxx = sums[3] = sums[3] * d + size * size
        sxy = sums[4] = sums[4] * d + size * duration_s
        mx, my = sx / sw, sy / sw
        var = sxx / sw - mx * mx
        if var >= 0.1:  # sizes spread enough to tell the two costs apart
            self.per_txn_s = max((sxy / sw - mx * my) / var, 1e-7)
        self.fixed_s = max(my - self.per_txn_s * mx, 0.0)

    def target(self) -> float:
        """The batch size at which the fixed cost is ``overhead`` of the epoch."""
        o = self.overhead
        return self.fixed_s * (1 - o) / (o * max(self.per_txn_s, 1e-7))

    def wait_s(self, waiting: int) -> float:
        """How long to wait before closing an epoch with ``waiting`` requests."""
        missing = self.target() - waiting
        if missing <= 0 or self.rate * (self.fixed_s + self.per_txn_s) < self.idle_load:
            return 0.0
        return min(self.max_wait_s, missing / self.rate)


class LocalExchange:
    """Delivers a round's inboxes to in-memory partition units, one after the other.

    A partition with an empty inbox in a plain dry-run round (no apply, reset, fast replay, timers, prior
    or finalize) is not stepped: such a step changes nothing (its scratch is the epoch's, cleared at the
    last finalize, or left as it is) and reports nothing, so the round returns no output for it (the
    coordinator merges the outputs it gets, in any number; an empty one would add nothing)."""

    def __init__(self, units: list[PartitionUnit]) -> None:
        self.units = units
        for u in units:  # kept between rounds: the call-graph cache stays in each unit
            u.report_cache = False
            u.sole_writer = True  # the runtime writes its stores only through the units (bulk loads aside)
        self.partitions = len(units)

    def round(self, control: Control, inboxes: list[list[Invoke | ReplyMsg]]) -> list[RoundOutput]:
        if _plain(control):
            return [u.step(control, box) for u, box in zip(self.units, inboxes, strict=True) if box]
        return [u.step(control, box) for u, box in zip(self.units, inboxes, strict=True)]


def _plain(control: Control) -> bool:
    """A dry-run round that only delivers messages (an empty inbox's step is a no-op in it)."""
    return (control.phase == Control.DRY and not control.finalize and control.prior is None
            and control.timers is None and not control.apply and not control.reset and not control.fast)


class InProcessRuntime(EngineBacked):
    """Run an :class:`~charon.operator.Application` in this process."""

    controller: InProcessEngine  # the engine contract's face, and the control state it owns

    def __init__(
        self,
        app: Application,
        partitions: int | None = None,
        epoch_max_txns: int = 10_000,
        epoch_max_ms: float = 1.0,
        max_invocations: int = MAX_INVOCATIONS,
        reply_retention: int | None = None,
        *,
        data_dir: str | None = None,
        fsync: bool = True,
        checkpoint_s: float = 0.5,
        compact_every: int = 20,
        stats_kept: int = 1000,
        log_url: str | None = None,
        storage_url: str | None = None,
        retain_events: int = DEFAULT_RETAIN_EVENTS,
        max_timers_per_epoch: int = MAX_TIMERS_PER_EPOCH,
        gc_tuning: bool = True,
        gc_threshold: int = GC_THRESHOLD,
        warmup_txns: int = 200,
        reply_retention_bytes: int = 128 << 20,
        function_timeout: float = DEFAULT_TIMEOUT,
        watchdog_interval: float = DEFAULT_INTERVAL,
        exit_when_stuck: float | None = None,
        transaction_timeout: float | None = None,
        determinism_check: bool = False,
        inspector: InspectorSettings | None = None,
        effects: bool | None = None,
    ) -> None:
        """``reply_retention``: replies kept in memory for retries (default 100,000; durable mode: 10,000, a
        cache in front of the output log, which keeps replies for ``CHARON_DEDUP_WINDOW_S``, default 7 days), and
        at most ``reply_retention_bytes`` of their values (default 128 MiB; the oldest go first).
        ``partitions``: engine partitions (default 4; a durable directory keeps the count it has unless another
        one is given, which rescales it). ``data_dir``: durable mode (see
        :mod:`charon.runtime.node.storage` for ``fsync``, ``checkpoint_s`` and ``compact_every``; ``log_url`` puts
        its logs on NATS, see :mod:`charon.log.nats`; ``storage_url`` also keeps its checkpoints on object storage, e.g.
        ``s3://bucket/prefix``, see :mod:`charon.storage`). ``stats_kept``: how many
        recent epochs ``epoch_stats`` keeps. ``retain_events``: events kept per output stream
        (:class:`charon.log.streams.StreamLog`; durable mode: ``data_dir/streams.sqlite``, volatile: a temporary
        file removed with the runtime). ``max_timers_per_epoch``: timers one partition fires per epoch (the
        rest fire in the following epochs; a durable directory must keep the same value for exact replay).
        ``gc_tuning``/``gc_threshold``: :func:`tune_gc` at ``start()``. ``warmup_txns``: transactions of a
        built-in application run on a scratch runtime at ``start()`` (0: none). ``function_timeout``: seconds a
        function may run without awaiting a call before it is stopped and its transaction aborts with
        ``InvocationTimeout`` (per function: ``@op.function(timeout=...)``), checked every ``watchdog_interval``
        seconds; ``exit_when_stuck`` (durable mode, ``charon run``): seconds past that budget after which a
        function blocked where it cannot be interrupted is quarantined and the process exits for its
        supervisor (None: it is reported, never exited); ``transaction_timeout``: seconds a transaction's function
        code may run in one epoch in all (default twice ``function_timeout``; at least the running step's own
        budget).
        See :mod:`charon.runtime.guard.watchdog`.
        ``determinism_check``: run every function step twice and abort its transaction with
        ``NonDeterministicFunction`` when the two runs' effects differ (:mod:`charon.core.determinism`).
        ``inspector``: the invocation inspector's settings (:mod:`charon.runtime.control.inspector`; default on).
        ``effects``: run the application's effect handlers (``ctx.effect``) in this process, from ``start()`` to
        ``stop()``, with an :class:`~charon.runtime.effects.EffectExecutor` (:attr:`effects_executor`; its
        continuations go straight to this runtime, under their reserved request ids). ``None`` (default): when
        the application has effect handlers and the runtime is volatile (tests, examples); a durable runtime
        runs them only with ``True`` (a deployment chooses ``charon run --effects`` or ``charon effects work``
        processes: never both). :meth:`settle_effects` waits until every effect requested so far is done."""
        self.app = app
        self.determinism_check = determinism_check
        self.partitions: int  # the directory's layout, else ``partitions`` (4 by default): set below
        self.epoch_max_txns = epoch_max_txns
        self.epoch_max_ms = epoch_max_ms
        self.sizer = EpochSizer(epoch_max_ms / 1000.0, max_batch=epoch_max_txns)
        self.gc_tuning = gc_tuning
        self.gc_threshold = gc_threshold
        self.warmup_txns = warmup_txns
        self._arrived = 0
        self.node: NodeStorage | None = None
        if data_dir is not None:
            from charon.runtime.control.owner import claim_data_dir
            from charon.runtime.node.storage import NodeStorage, RecordingStore

            claim_data_dir(data_dir, "inprocess")  # not a Spark deployment's directory (DataDirOwned)
            self.node = NodeStorage(data_dir, partitions or 4, fsync=fsync, checkpoint_s=checkpoint_s,
                                    compact_every=compact_every, log_url=log_url, storage_url=storage_url)
            self.partitions = self.node.partitions  # the directory's layout; rescaled after recovery
            self._stores: list[MemoryStore] = [RecordingStore() for _ in range(self.partitions)]
        else:
            partitions = self.partitions = 4 if partitions is None else partitions
            if partitions < 1:
                raise ValueError("partitions must be at least 1")
            self._stores = [MemoryStore() for _ in range(partitions)]
        # before recovery: a replay applies its verdicts; on object storage too before one takes effect
        ship = self.node.ship_verdicts if self.node is not None and self.node.remote is not None else None
        self.verdict_book = VerdictBook(data_dir, fsync=fsync, on_write=ship)
        self._engine_thread = ThreadHandle()  # the thread running an epoch now: where the watchdog interrupts
        self.fatal_callback: Callable[[str], None] | None = None  # an engine error that escaped an epoch (on_fatal)
        self._frozen = False  # set by the watchdog giving up on a stuck function: no reply is released any more
        self.watchdog = Watchdog(lambda: self.units, lambda: self.coordinator, self._engine_thread,
                                 self.verdict_book, timeout=function_timeout, interval=watchdog_interval,
                                 transaction_timeout=transaction_timeout,
                                 exit_after=exit_when_stuck if data_dir is not None else None, freeze=self._freeze)
        self._engine: ThreadPoolExecutor | None = None  # service mode: the thread epochs run in
        self._outbox: list[Reply] = []  # replies of the epoch running in the engine thread, for the loop
        self._loop_ident = 0
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.units = self._units(self._stores)
        self.coordinator = EpochCoordinator(
            app, LocalExchange(self.units), sequencers=1, max_invocations=max_invocations,
            on_replies=self._deliver, on_finalized=self._finalized
        )
        self.coordinator.verdicts = self.verdict_book.verdicts
        self.inspector = Inspector(inspector, live=self._unanswered)
        self.coordinator.observe = self.inspector.observe
        self._epoch_started: float | None = None  # when the running epoch started (the inspector's sequenced_at)
        self.coordinator.next_due = math.inf  # a fresh state has no timers (a recovered one: its record's)
        if max_timers_per_epoch < 1:
            raise ValueError("max_timers_per_epoch must be at least 1")
        self.coordinator.timer_limit = max_timers_per_epoch
        self.epoch = 0
        self.epoch_stats: list[dict[str, float]] = []
        self._stats_kept = stats_kept
        self._logged: tuple[float, float] | None = None  # the next epoch's log append: (wall start, ms)
        self._retain_events = retain_events
        self._streams: StreamLog | None = None
        self.run_effects = bool(app.effects) and data_dir is None if effects is None else effects
        self.effects_executor: EffectExecutor | None = None  # while started, when run_effects
        self.declaring: asyncio.Task[int] | None = None  # the start's upserts of the declared schedules
        self._log_end = 0
        self._base_dirty = False
        self.replayed_epochs = 0  # durable mode: epochs replayed from the input log at recovery
        self.failed: BaseException | None = None  # set when an epoch could not be logged or run
        self._queue: list[Request] = []
        # service mode (volatile): the last epoch, its replies delivered, with its finalize still to run (_finish,
        # or carried into the next epoch's first round); readers in other threads wait on the lock meanwhile
        self._unfinalized: EpochResult | None = None
        self._finish_lock = threading.RLock()  # held by an epoch from start to end, and by multi-key readers
        self._carried: EpochResult | None = None  # the pending epoch whose finalize the running epoch carries
        self._carry_thread = 0  # the thread running that epoch
        self._futures: dict[str, asyncio.Future[Reply]] = {}
        self._waiters: dict[str, list[asyncio.Future[Reply]]] = {}  # more callers of a request already waiting
        self._replies: OrderedDict[str, Reply] = OrderedDict()
        self._retention = reply_retention or (VOLATILE_REPLY_RETENTION if data_dir is None else DURABLE_REPLY_RETENTION)
        self._retention_bytes = reply_retention_bytes
        self._replies_bytes = 0  # values and error messages of the replies in _replies
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._rescales: list[tuple[int, asyncio.Future[float]]] = []
        self.rescale_pauses: list[dict[str, float]] = []  # one per rescale: from, to, epoch, pause_s, keys
        self.gate = EpochGate()  # pause/resume at an epoch boundary
        self.controller = InProcessEngine(self)  # the engine contract's face, and the control state it owns
        for u in self.units:  # its code versions: workflow version pinning (charon.core.context.CodeBook)
            u.code = self.controller
        # durable mode, paused: epochs logged (their requests durable) but not run yet, with their log ends and times
        self._parked: list[tuple[list[Request], int, float]] = []
        if self.node is not None:
            try:
                self.watchdog.start()  # a replayed epoch's function is stopped like a live one's
                try:
                    self._recover()
                finally:
                    self.watchdog.stop()
                if partitions is not None and partitions != self.partitions:  # None: keep the recorded layout
                    self._rescale_now(partitions)
            except BaseException:
                self.node.close()
                raise

    def _units(self, stores: list[MemoryStore]) -> list[PartitionUnit]:
        units = [PartitionUnit(p, len(stores), self.app, s) for p, s in enumerate(stores)]
        book = getattr(self, "controller", None)  # (none yet while the constructor builds the first units)
        for u in units:
            u.code = book
            u.interrupt = self.watchdog.timed_out
            u.twice = determinism.run_twice if self.determinism_check else None
        return units

    def _freeze(self) -> None:
        self._frozen = True

    def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Transactions the engine set aside (timed out, quarantined), newest first."""
        return self.verdict_book.dead_letters(limit)

    @property
    def input_log(self) -> InputLogLike | None:
        """Durable mode: the input log (the gateway checks reused request ids and pending requests in it)."""
        return self.node.input_log if self.node is not None else None

    @property
    def durable(self) -> bool:
        """Whether this runtime keeps its state, replies and request ids across restarts."""
        return self.node is not None

    def _recover(self) -> None:
        """Durable mode: state as of the last checkpoint, then the logged epochs after it, replayed."""
        assert self.node is not None
        states, rec, epochs = self.node.recover()
        for store, state in zip(self._stores, states, strict=True):
            store.data.update(state)
            store.epoch = rec.epoch if rec is not None else -1
        if rec is not None:
            self.epoch = rec.epoch + 1
            self._log_end = rec.log_end
            self.coordinator.sequencer.counters = list(rec.counters)
            self.coordinator.deferred = [(tid, serde.decode_request(b)) for tid, b in rec.deferred]
            self.coordinator.sequencer.time = rec.time
            self.coordinator.next_due = rec.next_due
            self.coordinator.admission.restore(rec.admission)
        self.controller.recover_code()  # the newest code version recorded (code updates)
        attempts = RecoveryAttempts(self.node.data_dir)
        self.watchdog.interrupting = False  # a replayed epoch may have replied: only its recorded verdicts apply
        self.inspector.replaying = True  # its aborts were logged when they first ran (recorded again, not logged)
        for epoch, requests, now in epochs:
            if epoch != self.epoch:
                raise RuntimeError(f"replay: epoch {epoch} logged where {self.epoch} was expected")
            if attempts.failed_before(epoch):  # it killed a recovery already: find who, set them aside first
                self._probe(epoch, requests, now)
            attempts.starting(epoch)
            self._log_end += len(requests) + 1
            self._run_logged(requests, now)
        attempts.done()
        self.watchdog.interrupting = True
        self.inspector.replaying = False
        self.replayed_epochs = len(epochs)
        self.controller.finish_migration()  # a code update's migration a crash interrupted

    def _probe(self, epoch: int, requests: list[Request], now: float) -> None:
        """Recovery of an epoch that killed the process before: see :mod:`charon.runtime.guard.quarantine`."""

        def _probe_run() -> None:  # in the forked child: nothing it does reaches a file
            self._streams = _NullStreams()  # type: ignore[assignment]
            self._run_logged(requests, now)

        deadline = 30.0 + 3 * self.watchdog.timeout
        quarantine_killers(epoch, _probe_run, lambda: self.coordinator, self.verdict_book, deadline,
                           default_budget=self.watchdog.timeout)  # each step's deadline: its function's budget

    def close(self) -> None:
        """Durable mode: checkpoint everything and release the data directory (volatile: nothing)."""
        if self.node is not None:
            self._write_base()
            self.node.close()
        if self._streams is not None:
            self._streams.close()

    # -- committed output: the one place every read passes (the deferred finalize runs first) ---------
    @property
    def stores(self) -> list[MemoryStore]:
        """The partitions' stores as of the last committed epoch.

        Every read of committed state goes through here (the accessors below, inspect, SQL, admin updates,
        rescaling, tests): it first runs the finalize the service loop deferred (:meth:`_finish`), so a reply's
        waiter reading at once sees its transaction's writes. Only the engine itself (the units, recovery, the
        durable epoch record) uses ``_stores``."""
        self._finish()
        return self._stores

    @property
    def streams(self) -> StreamLog:
        """The output streams ``ctx.emit`` appends to (one atom per epoch and stream; see charon.log.streams);
        like :attr:`stores`, it first runs a deferred finalize, so a reply's waiter finds its epoch's atom."""
        self._finish()
        return self._stream_log()

    def _stream_log(self) -> StreamLog:
        with _STREAMS_LOCK:  # created once, also when the gateway's read threads ask first
            return self._open_streams()

    def _open_streams(self) -> StreamLog:
        if self._streams is None:
            if self.node is not None:
                path = os.path.join(self.node.data_dir, "streams.sqlite")
                self._streams = StreamLog(path, durable=self.node.fsync, retain_events=self._retain_events)
            else:
                tmp = tempfile.mkdtemp(prefix="charon-streams-")
                self._streams = StreamLog(os.path.join(tmp, "streams.sqlite"), durable=False,
                                          retain_events=self._retain_events)
                weakref.finalize(self, _remove_volatile, self._streams, tmp)
        return self._streams

    async def subscribe(
        self, stream: str, from_offset: int = 0, *, max_events: int = 1000, poll_s: float = 0.005,
    ) -> AsyncIterator[StreamEvent]:
        """Events of ``stream`` from ``from_offset`` on, as they commit (whole atoms at a time; endless).

        Resume after a restart by passing the offset after the last event processed."""
        check_stream(stream)
        offset = from_offset
        log = self.streams
        while True:
            r = log.read(stream, offset, max_events)
            for ev in r.events:
                yield ev
            offset = r.next_offset
            if not r.events:
                await asyncio.sleep(poll_s)

    def _write_base(self) -> None:
        if self._base_dirty and self.node is not None:
            self.node.write_bases(self.stores)
            self._base_dirty = False

    # -- rescaling ----------------------------------------------------------------------------------
    def _rescale_now(self, partitions: int) -> float:
        """Move every key group to its partition under ``partitions`` (between epochs); returns the pause.

        Entities map to a fixed set of key groups (:data:`charon.core.routing.KEY_GROUPS`), groups to
        partitions (``group % partitions``); rescaling re-places the groups' items, timers with their owner.
        Results never depend on placement, so epochs before and after are unaffected. Durable mode: the new
        layout is committed as new bases at the last epoch (:meth:`NodeStorage.relayout`) before it is used.
        """
        if partitions < 1:
            raise ValueError("partitions must be at least 1")
        t0, c0 = time.perf_counter(), time.process_time()
        old = self.partitions
        parts: list[list[tuple[bytes, bytes]]] = [[] for _ in range(partitions)]
        n = 0
        for s in self.stores:
            for k, v in s.items():
                op, key = _timers.placed_by(k, v)
                parts[partition_of(op, key, partitions)].append((k, v))
                n += 1
        for p in parts:
            p.sort()
        if self.node is not None:
            from charon.runtime.node.storage import RecordingStore

            self.node.relayout(partitions, parts, self.epoch - 1)
            self._base_dirty = False
            stores: list[MemoryStore] = [RecordingStore() for _ in range(partitions)]
        else:
            stores = [MemoryStore() for _ in range(partitions)]
        for s, items in zip(stores, parts, strict=True):
            s.data.update(items)
            s.epoch = self.epoch - 1
        self._stores = stores
        self.partitions = partitions
        self.units = self._units(stores)
        for u in self.units:
            u.previous = self.coordinator.previous  # a compatible code update's old code, if still needed
        self.coordinator.exchange = LocalExchange(self.units)
        pause = time.perf_counter() - t0
        self.rescale_pauses.append({"from": old, "to": partitions, "epoch": self.epoch, "pause_s": pause, "keys": n,
                                    "cpu_s": time.process_time() - c0, "wait_s": 0.0})
        return pause

    async def rescale(self, partitions: int) -> float:
        """Change the number of partitions at the next epoch boundary (serving or not); returns the pause in
        seconds (requests keep queueing meanwhile and run in the next epoch). A durable directory keeps the
        new count (reopening it with another ``partitions`` rescales it again). ``rescale_pauses`` records
        ``from``, ``to``, ``epoch``, ``keys``, ``pause_s``, ``cpu_s`` and ``wait_s`` (until the epoch boundary)."""
        if self._task is None or self._task.done():
            return self._rescale_now(partitions)
        t0 = time.perf_counter()
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._rescales.append((partitions, fut))
        assert self._wake is not None
        self._wake.set()
        pause = await fut
        self.rescale_pauses[-1]["wait_s"] = max(0.0, time.perf_counter() - t0 - pause)
        return pause

    # -- state --------------------------------------------------------------------------------------
    def _store_of(self, operator: str, key: str) -> MemoryStore:
        return self.stores[partition_of(operator, key, self.partitions)]

    def load(self, operator: str | Operator, values: dict[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Bulk-load entity values (before or between epochs)."""
        op = operator.name if isinstance(operator, Operator) else operator
        self._check_loadable()
        items = values.items() if isinstance(values, dict) else values
        for key, value in items:
            self._store_of(op, key).data[store_key(op, key)] = serde.encode_value(value)

    def load_items(self, operator: str | Operator, key: str, items: dict[str, Any]) -> None:
        """Bulk-load named items of one entity."""
        op = operator.name if isinstance(operator, Operator) else operator
        self._check_loadable()
        data = self._store_of(op, key).data
        for name, value in items.items():
            data[store_key(op, key, "\x01" + name)] = serde.encode_value(value)

    def _check_loadable(self) -> None:
        for u in self.units:  # a bulk load writes the stores beside the units: no next due time is reused
            u._due = None
        if self.node is not None:
            if self.epoch > 0 or not self.node.is_fresh():
                raise RuntimeError("bulk load is only possible into a fresh data directory, before epoch 0")
            self._base_dirty = True

    def read_state(self, operator: str | Operator, key: str, default: Any = None) -> Any:
        """An entity's committed value (consistent: read between epochs)."""
        op = operator.name if isinstance(operator, Operator) else operator
        raw = self._store_of(op, key).get(store_key(op, key))
        return default if raw is None else serde.decode(raw)

    def read_items(self, operator: str | Operator, key: str) -> dict[str, Any]:
        """An entity's committed named items."""
        op = operator.name if isinstance(operator, Operator) else operator
        prefix = entity_prefix(op, key) + b"\x01"
        return {k[len(prefix):].decode(): serde.decode(v) for k, v in self._store_of(op, key).scan(prefix)}

    def timers(self, operator: str | Operator, key: str) -> list[Timer]:
        """The committed pending timers an entity registered (by id)."""
        op = operator.name if isinstance(operator, Operator) else operator
        return [_timers.decode(v) for _, v in self._store_of(op, key).scan(_timers.owner_prefix(op, key))]

    def pending_timers(self) -> list[Timer]:
        """Every committed pending timer, by due time (then id)."""
        out = self._consistent(lambda: [_timers.decode(v) for s in self.stores
                                        for _, v in s.scan(_timers.INDEX_PREFIX)])
        return sorted(out, key=lambda t: (t.due, t.id))

    def _consistent(self, read: Callable[[], T]) -> T:
        """Run a multi-key read as one cut: an epoch (with any finalize it runs or carries) holds the finalize lock
        from start to end (:meth:`_run_logged`), so a reader in another thread waits for it instead of seeing part
        of its writes (the lock is reentrant: reads from the loop thread, or from code inside an epoch, go on)."""
        with self._finish_lock:
            return read()

    def entities(self, operator: str | Operator) -> dict[str, Any]:
        """All committed main values of one operator (for checks in tests and benchmarks); one cut, also when
        called from another thread while the runtime serves."""
        return self._consistent(lambda: self._entities(operator))

    def _entities(self, operator: str | Operator) -> dict[str, Any]:
        op = operator.name if isinstance(operator, Operator) else operator
        out = {}
        for s in self.stores:
            for k, v in s.scan(f"{op}\0".encode()):
                o, key, item = k.decode().split("\0", 2)
                if item == "":
                    out[key] = serde.decode(v)
        return out

    def snapshot(self) -> dict[bytes, bytes]:
        """All committed state as store keys (sorted); one cut, also from another thread (see :meth:`entities`)."""

        def read() -> dict[bytes, bytes]:
            merged: dict[bytes, bytes] = {}
            for s in self.stores:
                merged.update(s.items())
            return dict(sorted(merged.items()))

        return self._consistent(read)

    def state_digest(self) -> str:
        """SHA-256 over all committed state: equal digests mean byte-identical state."""
        h = hashlib.sha256()
        for k, v in self.snapshot().items():
            h.update(len(k).to_bytes(4, "big") + k + len(v).to_bytes(4, "big") + v)
        return h.hexdigest()

    # -- synchronous batch mode (deterministic epoch boundaries) -----------------------------------
    def run_epoch(self, requests: list[Request], now: float | None = None) -> EpochResult:
        """Run the given requests as exactly one epoch (plus transactions deferred into it, and the timers
        due at the epoch's time ``now``, default the clock; durable mode logs it with the batch)."""
        self.run_parked()
        if self.node is not None:
            self._write_base()
            requests, self._log_end, now = self.node.log_epoch(self.epoch, requests, now)
        return self._run_logged(requests, time.time() if now is None else now)

    def _run_logged(self, requests: list[Request], now: float, defer: bool = False,
                    carry: bool = False) -> EpochResult:
        """Run one epoch (see :meth:`_run_epoch_locked`) holding the finalize lock from start to end: a multi-key
        reader in another thread (:meth:`_consistent`) never sees part of an epoch's writes."""
        with self._finish_lock:
            self._engine_thread.attach()
            try:
                return self._run_epoch_locked(requests, now, defer, carry)
            finally:
                self._engine_thread.detach()
                # no interrupt of a step that ended outlives the epoch (see charon.runtime.guard.interrupts)
                clear_pending()
                if self._outbox:  # its replies' waiters (on the event loop) run once the epoch is recorded
                    out, self._outbox = self._outbox, []
                    assert self._aloop is not None
                    self._aloop.call_soon_threadsafe(self._hand_out, out)

    def _run_epoch_locked(self, requests: list[Request], now: float, defer: bool, carry: bool) -> EpochResult:
        """Run one epoch whose batch (and time) is logged (durable mode) or needs no log (volatile).

        ``defer`` (volatile service mode): leave the epoch's finalize round for :meth:`_finish`, so the loop
        can hand the replies (already decided and delivered) to their waiters first. ``carry``: a pending
        finalize runs within this epoch's first round (the coordinator's ``prior``) instead of in a round of
        its own; readers in other threads wait on the finalize lock, which the epoch holds (:meth:`_run_logged`)."""
        prior = None
        self._epoch_started = time.time()
        if carry and self._unfinalized is not None:
            self._carry_thread = threading.get_ident()
            prior = self._carried = self._unfinalized
        else:
            self._finish()
        started = time.time()  # the epoch's wall-clock start, in its stats (traces place the epoch with it)
        try:
            result = self.coordinator.run_epoch(self.epoch, [(0, r) for r in requests], now, defer=defer,
                                                prior=prior)
        finally:
            self._carried = None  # ran (see _finalized), or the epoch failed first: still pending for _finish
        if result.finalize is not None:
            self._unfinalized = result
        elif result.events:  # idempotent by epoch: a replayed epoch appends nothing again
            self._stream_log().append_atom(self.epoch, [(s, v) for _, s, v in result.events])
        if self.node is not None:
            c = self.coordinator
            self.node.epoch_done(self.epoch, c.sequencer.counters, c.deferred, self._log_end,
                                 self._stores, c.sequencer.time, c.next_due,  # type: ignore[arg-type]
                                 c.admission.snapshot())
        self.epoch += 1
        if self.coordinator.previous is not None:  # a compatible code update's old code, while still needed
            self.retire_previous()
        stats = self.epoch_stats
        rec = {"epoch": result.epoch, "started_at": started, **result.stats}
        if self._logged is not None:  # the batch's append to the input log, just before (durable mode)
            rec["log_started_at"], rec["log_ms"] = self._logged
            self._logged = None
        stats.append(rec)
        if len(stats) > self._stats_kept:
            del stats[: len(stats) - self._stats_kept]
        return result

    def _finalized(self, result: EpochResult) -> None:
        """The coordinator ran a deferred finalize (alone, from :meth:`_finish`, or carried in the next epoch's
        first round): its atom goes to the streams, then the epoch is no longer pending."""
        if result.events:
            self._stream_log().append_atom(result.epoch, [(s, v) for _, s, v in result.events])
        if self._unfinalized is result:
            self._unfinalized = None
        if self._carried is result:
            self._carried = None
            for rec in reversed(self.epoch_stats):
                if rec.get("epoch") == result.epoch:
                    rec["finalize_carried"] = 1
                    break

    def _finish(self) -> None:
        """Run the finalize the last epoch deferred (if any): its writes reach the stores, its events the streams.

        Called only by :attr:`stores` and :attr:`streams` (every read of committed output passes there, also
        from a gateway thread, hence the lock) and by the engine before its next epoch; the pending epoch is
        cleared only once its writes and events are in (:meth:`_finalized`), so a reader in another thread never
        sees it half done."""
        if self._unfinalized is None:
            return
        if self._carried is not None and threading.get_ident() == self._carry_thread:
            return  # read from inside the epoch carrying it (user code holding the runtime): no deadlock
        with self._finish_lock:  # a reader in another thread waits for a finalize running
            result = self._unfinalized
            if result is None:
                return
            fin: dict[str, float] = {}
            t0 = time.perf_counter()
            try:
                self.coordinator.next_due = self.coordinator.finalize(result, fin)
            finally:
                self._unfinalized = None
            fin["finalize_ms"] = (time.perf_counter() - t0) * 1000.0
            last = self.epoch_stats[-1] if self.epoch_stats else None
            if last is not None and last.get("epoch") == result.epoch:  # the epoch's record includes its finalize
                for k, v in fin.items():
                    last[k] = last.get(k, 0) + v

    def run_parked(self) -> None:
        """Run the epochs logged while paused (durable mode), in log order."""
        while self._parked:
            batch, self._log_end, now = self._parked.pop(0)
            self._run_logged(batch, now)

    def drain(self) -> list[EpochResult]:
        """Run empty epochs until no deferred transaction is left."""
        out = []
        while self.coordinator.deferred:
            out.append(self.run_epoch([]))
        return out

    # -- asynchronous service mode -----------------------------------------------------------------
    async def start(self) -> None:
        """Start closing epochs in the background of the running event loop."""
        if self._task is None:
            self._aloop = asyncio.get_running_loop()
            self._loop_ident = threading.get_ident()
            if self._engine is None:
                self._engine = ThreadPoolExecutor(1, thread_name_prefix="charon-engine")
            self.watchdog.start()
            if self.warmup_txns > 0:
                await self.in_engine(self._warm_up)
            if self.gc_tuning:
                tune_gc(self.gc_threshold)
            if self.node is not None:
                self._write_base()
                self.node.start_writer()
            self._stopping = False
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
            self.declaring = start_declaring(self.engine())  # schedules declared in code (charon.core.schedules)
            if self.run_effects and self.effects_executor is None:
                from charon.runtime.effects import EffectExecutor, engine_resume

                self.effects_executor = EffectExecutor(lambda: self.app, lambda: self.streams,
                                                       engine_resume(self.submit), backoff_s=0.01, poll_s=0.01)
                await self.effects_executor.start()

    async def settle_effects(self, timeout: float = 60.0) -> None:
        """Wait until every effect requested so far ran and its continuation committed or aborted (or was parked);
        ``TimeoutError`` after ``timeout`` seconds. Needs ``effects`` on (see the constructor)."""
        if self.effects_executor is None:
            raise RuntimeError("this runtime runs no effects (InProcessRuntime(..., effects=True), then start())")
        deadline = time.monotonic() + timeout
        while True:  # a continuation may request further effects: settled when a round finds nothing new
            await self.effects_executor.settle(max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(0.02)
            if (self.streams.end_offset(EFFECT_STREAM) <= self.effects_executor.store.offset(
                    self.effects_executor.reader) and not self.effects_executor.inflight):
                return

    def _warm_up(self) -> None:
        """Run the engine's hot path on a scratch runtime of a built-in application (no user code runs, and
        no state, log or counter of this runtime is touched): validation, sequencing, rounds, calls, replies,
        conflicts and the fallback, so the first real requests do not pay for cold code paths."""
        quiet = dataclasses.replace(self.inspector.settings, log_aborts=False)  # its aborts are no one's
        scratch = InProcessRuntime(_warmup_app(), partitions=self.partitions, gc_tuning=False, warmup_txns=0,
                                   inspector=quiet)
        n = max(self.warmup_txns, 2)
        reqs = [Request(f"w{i}", "__warmup", f"k{i % (n // 2 + 1)}", "hop",
                        serde.encode([f"k{(i * 7 + 1) % (n // 2 + 1)}", i % 3]))
                for i in range(n)]
        scratch.run_epoch(reqs)

    def _fatal(self, reason: str) -> None:
        """Failed for good: log it and call the ``on_fatal`` callback (``charon run`` exits for its supervisor)."""
        _log.critical("FATAL: %s", reason, extra={"event": "fatal"})
        if self.fatal_callback is not None:
            self.fatal_callback(reason)

    def _halt(self, exc: BaseException) -> None:
        """An epoch could not be logged or run: fail every waiting request and accept no more.

        Durable mode: a request whose batch reached the log gets its real reply after a restart (replay)."""
        self.failed = exc
        if self.node is not None and self.node.error is None:
            self.node.error = exc
        self._queue.clear()
        self._parked.clear()  # logged: a restart replays them
        futures, self._futures = self._futures, {}
        waiters, self._waiters = self._waiters, {}
        for f in [*futures.values(), *(w for ws in waiters.values() for w in ws)]:
            if not f.done():
                f.set_exception(EngineStopped(f"the runtime stopped: {type(exc).__name__}: {exc}"))

    def health(self) -> dict[str, Any]:
        """What ``GET /health`` reports: ``ok`` only while epochs run (not before start, after stop, or once
        an epoch or the durable writer failed); ``status``, the current epoch and the last error."""
        error = self.failed or (self.node.error if self.node is not None else None)
        if error is not None:
            status = "failed"
        elif self._task is None:
            status = "stopped"
        elif self._task.done():
            status = "failed"
            if not self._task.cancelled() and self._task.exception() is not None:
                error = self._task.exception()
        else:
            status = "ok"
        stuck = self.watchdog.stuck
        if stuck is not None and status == "ok":
            # a function overran its budget and still holds the engine (see charon.runtime.guard.watchdog)
            status = "stuck"
        wait = self.node.log_wait if self.node is not None else None
        if wait is not None and status == "ok":  # a log outage: epochs (or checkpoints) wait for the log
            status = "waiting for log"
        out = {
            "status": status, "ok": status == "ok", "epoch": self.epoch - 1, "durable": self.durable,
            "last_error": f"{type(error).__name__}: {error}" if error is not None else None,
            "stuck": stuck, "timeouts": self.watchdog.timeouts,
        }
        if wait is not None:
            out["log_wait"] = {"what": wait[0], "waiting_s": round(time.monotonic() - wait[1], 1), "error": wait[2]}
        return out

    async def stop(self) -> None:
        """Finish waiting work and stop (a paused runtime is resumed: its queued requests run first)."""
        if self.declaring is not None:
            await asyncio.wait({self.declaring}, timeout=5.0)
            self.declaring.cancel()
            self.declaring = None
        if self.effects_executor is not None:  # before the engine: no continuation is submitted to a stopped one
            executor, self.effects_executor = self.effects_executor, None
            await executor.stop()
            executor.store.close()
        if self._task is not None:
            self.gate.resume()
            while (self._queue or self.coordinator.deferred or self._futures) and self.failed is None:
                await asyncio.sleep(0.001)
            self._stopping = True
            assert self._wake is not None
            self._wake.set()
            await self._task
            self._task = None
        self.watchdog.stop()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.shutdown)
        if self.node is not None and self.failed is None:
            await asyncio.to_thread(self.node.flush)

    async def __aenter__(self) -> InProcessRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _deliver(self, replies: list[Reply]) -> None:
        if self._frozen:  # the watchdog gave up on a stuck function and the process is exiting: nothing goes out
            threading.Event().wait()
        if self.node is not None:
            self.node.add_replies(replies)
        c = self.coordinator
        cur = c.current
        trace = c.trace
        taken = list(trace) if trace else []
        if taken:
            del trace[:]  # in place: a fallback running here appends to this same list
        self.inspector.replied(replies, cur.requests if cur is not None else {}, taken, self._epoch_started)
        kept = self._replies
        size = self._replies_bytes
        for r in replies:
            rid = r.request_id
            prev = kept.get(rid)
            if prev is not None:
                size -= len(prev.value) + len(prev.error_message)
            kept[rid] = r
            size += len(r.value) + len(r.error_message)
        while kept and (len(kept) > self._retention or size > self._retention_bytes):
            _, old = kept.popitem(last=False)
            size -= len(old.value) + len(old.error_message)
        self._replies_bytes = size
        if self._aloop is not None and threading.get_ident() != self._loop_ident:
            self._outbox.extend(replies)  # the engine thread: to the waiters once the epoch returned (_run_logged)
        else:
            self._hand_out(replies)

    def _hand_out(self, replies: list[Reply]) -> None:
        """Resolve the replies' futures (on the event loop; the replies are readable by then, see _deliver)."""
        waiters = self._waiters
        for r in replies:
            rid = r.request_id
            fut = self._futures.pop(rid, None)
            if fut is not None and not fut.done():  # done: cancelled by its caller
                fut.set_result(r)
            if waiters:
                for f in waiters.pop(rid, ()):
                    if not f.done():
                        f.set_result(r)

    def _unanswered(self) -> list[LiveRequest]:
        """The requests not answered yet, for the inspector (from another thread: copies, which may fail with a
        RuntimeError while the engine changes them; the inspector then shows none)."""
        out: dict[str, LiveRequest] = {r.request_id: (r, "pending", None) for r in list(self._queue)}
        for batch, _, _ in list(self._parked):
            out.update((r.request_id, (r, "pending", None)) for r in batch)
        c = self.coordinator
        cur = c.current
        if cur is not None:  # the running (or last) epoch's: those without a reply run now or were deferred
            done = cur.replies
            started = self._epoch_started
            out.update((r.request_id, (r, "pending", started)) for t, r in list(cur.requests.items()) if t not in done)
        out.update((r.request_id, (r, "deferred", None)) for _, r in list(c.deferred))
        return list(out.values())

    def get_reply(self, request_id: str) -> Reply | None:
        """The reply of a request, if it has been answered."""
        rep = self._replies.get(request_id)
        if rep is None and self.node is not None:
            known = self.node.known(request_id)
            if isinstance(known, Reply):
                return known
        return rep

    def enqueue(self, request: Request, fresh: bool = False) -> asyncio.Future[Reply]:
        """Queue a request; the future resolves with its reply. A known request_id is not run twice.
        ``fresh``: the caller found the id absent from the input log just now on this loop (see
        :class:`charon.runtime.contract.Enqueue`): the log is not asked again.

        Each call gets a future of its own (a request already waiting gets another waiter), so cancelling it
        concerns that caller only: the request still runs and the other waiters get the reply."""
        loop = asyncio.get_running_loop()
        rid = request.request_id
        if self.failed is not None:
            raise EngineStopped(f"the runtime stopped: {type(self.failed).__name__}: {self.failed}")
        if self._task is None:
            raise EngineStopped("the runtime is not started: use `async with runtime:` or `await runtime.start()`")
        done = self._replies.get(rid)
        fut = self._futures.get(rid)
        if fut is not None:  # waiting already: one more waiter
            extra = loop.create_future()
            self._waiters.setdefault(rid, []).append(extra)
            return extra
        if done is None and self.node is not None:
            self.node.raise_if_failed()
            if rid.startswith("\x00"):
                raise ValueError("request ids starting with NUL are reserved")
            known = self.node.known(rid, fresh)
            if isinstance(known, Reply):
                done = known
            elif known:  # logged before a restart and not answered yet (deferred): its reply will come
                fut = self._futures[rid] = loop.create_future()
                return fut
        if done is not None:
            fut = loop.create_future()
            fut.set_result(done)
            return fut
        fut = self._futures[rid] = loop.create_future()
        self._queue.append(request)
        self._arrived += 1
        if self._wake is not None:
            self._wake.set()
        return fut

    async def submit(
        self, operator: str, key: str, function: str, args: list | tuple = (), *, request_id: str | None = None
    ) -> Reply:
        """Invoke ``operator/key.function(*args)`` as one transaction and wait for its reply."""
        if self._task is None:
            raise EngineStopped("the runtime is not started: use `async with runtime:` or `await runtime.start()`")
        req = Request(request_id or uuid.uuid4().hex, operator, key, function, serde.encode_value(list(args)),
                      time.time())
        return await self.enqueue(req)  # this call's own future: no shield needed (see enqueue)

    async def submit_batch(self, calls: Iterable[Any], *, batch_id: str | None = None) -> Reply:
        """Run ``calls`` (``[operator, key, function, [args...]]`` each) as one client atomic batch: one
        transaction calling them in order, so all commit or none; the reply's value lists their values.
        ``batch_id`` is its request id (and entity key): a batch runs once per id."""
        op, fn, args = batch_request(calls)
        bid = batch_id or uuid.uuid4().hex
        return await self.submit(op, bid, fn, args, request_id=bid)

    async def invoke(self, operator: str | Operator, key: str, function: Any, *args: Any,
                     request_id: str | None = None) -> Any:
        """Like :meth:`submit` but returns the value (any function, internal ones included: code in the operator's
        own process is trusted; the gateway is where only public functions are let through); the same errors as
        the HTTP client's ``invoke``: a request
        naming nothing runnable (``UnknownOperator``, ``UnknownFunction``, ``InvalidKey``, ``BadArguments``,
        ``SerializationError``) is refused before it is queued, and any abort inside the call graph, whatever
        raised it (application code or the engine: ``InvocationTimeout``, ``ValueTooLarge``, ...), raises
        ``TransactionAborted(error_type=..., message=...)`` (for an engine error, its abort class: e.g.
        ``UnknownFunctionAborted``, both an ``UnknownFunction`` and a ``TransactionAborted``)."""
        op = operator.name if isinstance(operator, Operator) else operator
        fn = getattr(function, "name", function)
        arglist = list(args)
        self.app.validate(op, fn, arglist, key=key)
        serde.check_value(arglist)
        if request_id is not None and is_reserved_id(request_id):  # the engine's own (timers, continuations...)
            raise ReservedRequestId(f"request id {request_id!r} is reserved for the engine's own transactions")
        return raise_for_reply(await self.submit(op, key, fn, arglist, request_id=request_id))

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            while self._rescales:  # at an epoch boundary: nothing is running
                n, fut = self._rescales.pop(0)
                try:
                    pause = await self.in_engine(self._rescale_now, n)
                except Exception as exc:  # noqa: BLE001 - the caller gets it; epochs go on in the old layout
                    if not fut.done():
                        fut.set_exception(exc)
                else:
                    if not fut.done():
                        fut.set_result(pause)
            if not self._queue and not self._parked and (not self.coordinator.deferred
                                                         or self.coordinator.idle_until() > time.time()):
                if self._stopping and not self.coordinator.deferred:
                    return
                # an empty epoch fires a due timer, or admits a request held by a rate limit
                wait = self.coordinator.idle_until() - time.time()
                if wait > 0:
                    self._wake.clear()
                    if wait == math.inf:
                        await self._wake.wait()
                    else:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), wait + 0.001)
                    continue
            # durable mode: the previous batch's log commit is the batching window; no extra wait
            limit = self.sizer.limit()
            wait = 0.0
            if self.node is None and len(self._queue) < limit and self.epoch_max_ms > 0:
                wait = self.sizer.wait_s(len(self._queue))
                if wait > 0:
                    await asyncio.sleep(wait)
            if self.node is not None and self.gate.closed_for(self.epoch):
                # paused (durable mode): waiting requests go to the input log as the next epochs, run on resume
                self._wake.clear()
                if self._queue:
                    batch = self._queue[:limit]
                    del self._queue[: len(batch)]
                    try:
                        self._parked.append(await asyncio.to_thread(
                            self.node.log_epoch, self.epoch + len(self._parked), batch))
                    except Exception as exc:  # noqa: BLE001 - as below
                        self._halt(exc)
                        return
                else:
                    self.gate.wake_on_open(self.epoch, self._wake)
                    await self._wake.wait()
                continue
            await self.gate.enter_async(self.epoch)  # paused: no epoch starts, requests wait in the queue
            batch = self._queue[:limit]
            del self._queue[: len(batch)]
            t0 = time.perf_counter()
            yielded = False
            try:
                if self._parked:
                    self._queue[:0] = batch
                    await self.in_engine(self.run_parked)
                elif self.node is None:
                    # The finalize waits until the replies' waiters ran (one loop pass): it is off their latency.
                    # With more work waiting (and the gate open), the next epoch carries it in its first round
                    # (no round of its own); else it runs now, with the gate still held, so control operations
                    # see a finished boundary and the next due timer is exact while idle.
                    await self.in_engine(self._run_logged, batch, time.time(), self.coordinator.previous is None, True)
                    if self._unfinalized is not None:
                        t1 = time.perf_counter()
                        await asyncio.sleep(0)
                        yielded = True
                        t0 += time.perf_counter() - t1  # the sizer measures the epoch, not the waiters
                        if not ((self._queue or self.coordinator.deferred) and not self._rescales
                                and not self.gate.closed_for(self.epoch)):
                            await self.in_engine(self._finish)
                else:  # the batch is committed to the input log, then the epoch runs (in the engine thread)
                    await self.in_engine(self._log_and_run, batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the runtime stops loudly instead of hanging its clients
                self._halt(exc)
                return
            except BaseException as exc:  # noqa: BLE001 - an interrupt that escaped an epoch: fatal, never a dead loop
                self._halt(exc)
                self._fatal(f"an epoch failed in the engine itself ({type(exc).__name__}); the node must restart "
                            "(its logged epochs replay with their verdicts)")
                return
            finally:
                self.gate.leave()
            last = self.epoch_stats[-1] if self.epoch_stats else {}
            if last:
                last["wait_ms"] = wait * 1000.0  # the batching window this epoch waited (0: started at once)
            self.sizer.observe(len(batch), time.perf_counter() - t0, self._arrived, int(last.get("conflicts", 0)))
            self._arrived = 0
            if not yielded:
                await asyncio.sleep(0)

    def _log_and_run(self, batch: list[Request]) -> None:
        assert self.node is not None
        t0 = time.time()
        batch, self._log_end, now = self.node.log_epoch(self.epoch, batch)
        self._logged = (t0, (time.time() - t0) * 1000.0)
        self._run_logged(batch, now)

    async def in_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` where epochs run: the engine thread once started (never the event loop: application
        code and blocking work stay off it, so ``/health`` and the gateway answer while a function runs), else
        here."""
        engine = self._engine
        if engine is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(engine, fn, *args)

    # -- control: the engine contract (charon.runtime.node.inprocess_engine) ---------------------------------
    def engine(self) -> InProcessEngine:
        """This runtime under the engine contract (what the gateway, admin routes, metrics and CLI use)."""
        return self.controller

    def direct_enqueue(self) -> Enqueue | None:
        """:meth:`enqueue`, unless a subclass routes every request through its own ``submit``."""
        return self.enqueue if type(self).submit is InProcessRuntime.submit else None

    def backlog(self) -> tuple[int, int]:
        """``(requests queued, deferred or logged while paused; epochs logged while paused)``."""
        return (len(self._queue) + len(self.coordinator.deferred) + sum(len(p[0]) for p in self._parked),
                len(self._parked))

    @property
    def finish_lock(self) -> threading.RLock:
        """Held by a running epoch from start to end (and by multi-key readers): one boundary's state."""
        return self._finish_lock

    def switch_app(self, app: Application) -> None:
        """Run ``app`` from the next epoch on (a code update, at an epoch boundary)."""
        self.app = app
        self.coordinator.app = app
        for u in self.units:
            u.app = app

    def set_previous(self, previous: tuple[int, Any] | None) -> None:
        """A compatible code update: transactions below TID ``previous[0]`` keep the application ``previous[1]``."""
        self.coordinator.previous = previous
        for u in self.units:
            u.previous = previous

    def retire_previous(self) -> None:
        """After an epoch: drop the application a compatible update kept once no transaction started on it is
        deferred any more."""
        prev = self.coordinator.previous
        if prev is not None and not any(tid < prev[0] for tid, _ in self.coordinator.deferred):
            self.set_previous(None)

    code_update_modes = InProcessEngine.code_update_modes

    async def inspect(
        self, operator: str, keys: list[str] | None = None, epoch: int | None = None, limit: int = 10_000
    ) -> tuple[int, dict[bytes, bytes]]:
        """``(epoch, rows)``: ``operator``'s state rows as of one committed epoch."""
        out = await self.controller.inspect(operator, keys, epoch, limit)
        return out.epoch, out.rows

    async def sql(
        self, query: str, epoch: int | None = None, max_rows: int = 1000, timeout_s: float = 30.0,
        max_entities: int = 100_000, max_bytes: int = 4 << 20, max_memory: int = 512 << 20,
    ) -> dict[str, Any]:
        """One safe SELECT over the operators' state at one committed epoch, answered by SQLite in the SQL
        sandbox (:mod:`charon.runtime.control.sqlstate`): ``{"epoch", "columns", "rows", "truncated", "engine"}``."""
        out = await self.controller.sql(query, epoch, max_rows=max_rows, timeout_s=timeout_s,
                                        max_entities=max_entities, max_bytes=max_bytes, max_memory=max_memory)
        return out.doc()


_STREAMS_LOCK = threading.Lock()


class _NullStreams:
    """Streams of a probing child (:meth:`InProcessRuntime._probe`): appends go nowhere."""

    def append_atom(self, *args: Any) -> None:
        pass


def _remove_volatile(log: StreamLog, tmp: str) -> None:
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
