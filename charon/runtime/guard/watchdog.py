"""The watchdog: no function may hold the engine past its time budget, and no verdict contradicts a reply.

Design (Python cannot stop ``while True: pass`` in a coroutine from the thread running it):

* The engine runs epochs in a thread of its own (never on the gateway's event loop, see
  :class:`charon.runtime.node.inprocess.InProcessRuntime`), attached to a
  :class:`~charon.runtime.guard.interrupts.ThreadHandle`.
  Each :class:`~charon.core.partition.PartitionUnit` says which invocation step runs now (``unit.current``: two
  attribute stores per step, the only cost on the hot path besides one ``doomed`` check).
* This thread samples every ``interval`` seconds. A step (a function running from one ``await`` to the next) seen
  running for longer than its budget (``@op.function(timeout=...)``, else ``function_timeout``), or a transaction
  whose steps together ran longer than ``transaction_timeout`` (default: twice ``function_timeout``; at least
  the step's own budget), is **judged**: ``unit.doomed = frame``, set only while the step is ``unit.current``
  (one indivisible look). From then on the transaction's outcome is the verdict, whatever the step does next:
  the unit, in the engine thread, records the verdict (:meth:`Watchdog.timed_out`, fsynced in durable mode)
  *before* the step's outcome counts, and fails the transaction with it (:meth:`PartitionUnit._judged`), also
  when the function caught the interrupt and returned normally.
* The interrupt (:class:`~charon.core.partition.Interrupt`, a ``BaseException``) only ends the step early. It is
  raised only where it lands in user code (:func:`charon.runtime.guard.interrupts.deliver`: the engine thread's frames,
  from the top one down to the engine's step driver, are all the application's), never in the engine or a library
  (a lock held by ``logging`` stays balanced); elsewhere it is deferred to the next sample. An interrupt still
  pending when the step ended is dropped (:func:`charon.runtime.guard.interrupts.clear_pending`). An interrupt that
  escapes anyway is a fatal error of the epoch (the runtime halts and calls ``on_fatal``), never a dead loop.
* Code blocked in C (``time.sleep``, a C extension's loop) cannot be interrupted: it is reported from its budget
  on (``health()["stuck"]``; ``/health`` answers 503), and a durable node run by ``charon run`` (``exit_after``)
  gives it that many more seconds, then stops releasing replies (``freeze``), records the transaction as
  ``Quarantined`` and exits 75 for its supervisor; the restart replays the epoch with the verdict.
* **A replay takes no new verdict.** While recovery replays logged epochs (``interrupting = False``), their
  replies may have left already (the durable node replies while an epoch still runs): only the verdicts recorded
  when they first ran apply. A replayed step past its budget is reported stuck, never interrupted; past
  ``exit_after`` more the process exits 75 with a FATAL line naming the function, recording nothing (the operator
  raises the budget or fixes the function; the transaction's reply, which may have been given, stands).

The watchdog's clock starts when it first sees a step, so a step is stopped between ``budget`` and
``budget + interval`` seconds after it started; a transaction's total is the sum of the samples that saw it run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from charon.core import partition as _partition
from charon.core.context import raised_in
from charon.core.epoch import EpochCoordinator, Verdict
from charon.core.partition import ROOT, Interrupt, PartitionUnit, timeout_message
from charon.errors import InvocationTimeout, Quarantined
from charon.operator import Application
from charon.runtime.guard.interrupts import (
    DEFERRED,
    DELIVERED,
    ThreadHandle,
    UserCode,
    app_roots,
    clear_pending,
    deliver,
    doom,
    user_frame_chain,
)
from charon.runtime.guard.verdicts import VerdictBook, letter

_events = logging.getLogger("charon.engine")  # the server log

DEFAULT_TIMEOUT = 5.0  # seconds a function may run without awaiting a call
DEFAULT_INTERVAL = 0.1
RETRY_SWITCH_S = 0.00005  # the GIL switch interval while an interrupt waits for the engine thread to be in user code
#: the engine's frames that run a step's user code: an interrupt lands only in user frames above one of them
DRIVERS = frozenset({PartitionUnit._run.__code__, PartitionUnit._replay_cached.__code__,
                     PartitionUnit._user_str.__code__})
_partition.on_disarm(clear_pending)


def _verdict(etype: str, msg: str, coord: EpochCoordinator) -> Verdict:
    """A verdict on a step running now: in the dry run, or in the fallback's current round (Verdict.in_round; read
    once the step is judged, so never a round before the one it ends in)."""
    fb = coord.phase == 1
    cur = coord.current
    return Verdict(etype, msg, fb, coord.fallback_round if fb else None, cur.epoch if cur is not None else None)


def total_message(frame: Any, budget: float) -> str:
    """The error of a transaction whose steps together ran past its total budget (recorded as a verdict)."""
    msg = (f"{frame.op}.{frame.fn} on key {frame.key!r}: its transaction ran past its total time budget "
           f"({budget:g} s of function code in one epoch)")
    return raised_in(msg, frame.op, frame.key, frame.fn) if frame.kind != ROOT else msg


class Watchdog:
    """Samples ``units()`` of a runtime whose epochs run in the thread attached to ``engine``."""

    def __init__(
        self,
        units: Callable[[], list[PartitionUnit]],
        coordinator: Callable[[], EpochCoordinator],
        engine: ThreadHandle,
        book: VerdictBook,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        interval: float = DEFAULT_INTERVAL,
        transaction_timeout: float | None = None,
        exit_after: float | None = None,
        freeze: Callable[[], None] | None = None,
    ) -> None:
        if not timeout > 0 or not interval > 0 or (transaction_timeout is not None and not transaction_timeout > 0):
            raise ValueError("function_timeout, transaction_timeout and watchdog_interval must be positive")
        self.units = units
        self.coordinator = coordinator
        self.engine = engine
        self.book = book
        self.timeout = timeout
        self.transaction_timeout = transaction_timeout if transaction_timeout is not None else 2 * timeout
        self.interval = interval
        self.exit_after = exit_after
        self.freeze = freeze
        self._stuck: tuple[Any, dict[str, Any]] | None = None  # (frame, report) while a step overruns its budget
        self.timeouts = 0  # InvocationTimeout verdicts taken (metrics: charon_invocation_timeouts_total)
        #: interrupts raised, and deferred because the engine thread was not in user code (tests, metrics)
        self.delivered = 0
        self.deferred = 0
        #: False while a recovery replays logged epochs: only an epoch's first run takes new verdicts (a replayed
        #: one may have replied already); a replayed step past its budget is reported, and exited on (exit_after)
        self.interrupting = True
        self._user = UserCode()
        self._app: Application | None = None
        self._reasons: dict[int, str] = {}  # tid -> the verdict's message, for the step judged (timed_out)
        self._totals: dict[int, float] = {}  # tid -> seconds its steps were seen running, in the current epoch
        self._epoch: int | None = None
        self._last = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            for u in self.units()[:1]:
                self._learn_app(u)  # classifying code costs a few ms once: not at the first overrun
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="charon-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._stuck = None

    @property
    def stuck(self) -> dict[str, Any] | None:
        """The step holding the engine past its budget (function, key, tid, seconds, budget_s), while it does."""
        st = self._stuck
        if st is None or not any(u.current is st[0] for u in self.units()):
            return None
        return st[1]

    def budget(self, unit: PartitionUnit, frame: Any) -> float:
        return budget_of(unit, frame, self.timeout)

    def _run(self) -> None:
        seen: tuple[Any, int, float] | None = None  # the step being timed: (frame, nsusp, first seen at)
        while not self._stop.wait(self.interval):
            try:
                seen = self._sample(seen)
            except Exception as exc:  # noqa: BLE001 - the watchdog never dies; it says why instead
                _events.error("watchdog error: %s: %s", type(exc).__name__, exc, exc_info=exc,
                              extra={"event": "watchdog_error", "error_type": type(exc).__name__})

    def _learn_app(self, unit: PartitionUnit) -> None:
        app = unit.app
        if app is not self._app:
            self._app = app
            fns = [f.body for op in app.operators.values() for f in op.functions.values()]
            self._user = UserCode(app_roots(fns))

    def _sample(self, seen: tuple[Any, int, float] | None) -> tuple[Any, int, float] | None:
        """One look at the units: returns the step now being timed (None: no user code runs)."""
        unit = frame = None
        for u in self.units():
            f = u.current
            if f is not None:
                unit, frame = u, f
                break
        now = time.monotonic()
        last, self._last = self._last, now
        if unit is None or frame is None:
            self._stuck = None
            return None
        cur = self.coordinator().current
        epoch = cur.epoch if cur is not None else None
        if epoch != self._epoch:
            self._epoch = epoch
            self._totals.clear()
            self._reasons.clear()  # a reason timed_out did not take (the step ended first): bounded to one epoch
        tid = frame.tid
        ran_before = seen is not None and seen[0].tid == tid  # its transaction ran at the last sample too
        total = self._totals[tid] = self._totals.get(tid, 0.0) + (min(now - last, 2 * self.interval)
                                                                   if ran_before and last else 0.0)
        if seen is None or seen[0] is not frame or seen[1] != frame.nsusp:
            seen = (frame, frame.nsusp, now)
            self._stuck = None
        ran = now - seen[2]
        budget = self.budget(unit, frame)
        tbudget = max(self.transaction_timeout, budget)
        if ran < budget and total < tbudget:
            return seen
        req = cur.requests.get(tid) if cur is not None else None
        self._stuck = (frame, {"operator": frame.op, "function": frame.fn, "key": frame.key, "tid": tid,
                               "request_id": req.request_id if req is not None else None,
                               "seconds": round(ran, 3), "budget_s": budget,
                               "transaction_seconds": round(total, 3), "transaction_budget_s": tbudget,
                               "replaying": not self.interrupting})
        marked = doom(unit, frame) if self.interrupting else 0
        if marked:
            # judged (a step of the cached fallback's fast path too): the verdict is durable before the interrupt
            # is raised (the engine makes it effective, with the round it ends in: see Watchdog.timed_out)
            msg = self._reasons.get(tid)
            if msg is None:
                msg = self._reasons[tid] = timeout_message(frame) if ran >= budget else total_message(frame, tbudget)
            if req is not None and cur is not None:
                self.book.reserve(letter(req.request_id, frame.op, frame.fn, frame.key,
                                         _verdict("InvocationTimeout", msg, self.coordinator()), cur.epoch,
                                         f"{req.operator}.{req.function}"))
            self._learn_app(unit)
            self._interrupt(unit, frame)
        if self.exit_after is not None and ran > budget + self.exit_after:
            self._give_up(frame, ran)
        return seen

    def _interrupt(self, unit: PartitionUnit, frame: Any) -> None:
        """Deliver the interrupt to the judged step; while the engine thread is in library code, look again at
        once, for up to one interval, with a short GIL switch interval (each look lands wherever the engine thread
        next yields the GIL: user code comes up within a few dozen looks)."""
        got = deliver(self.engine, self._user, DRIVERS, unit, frame, Interrupt)
        if got != DEFERRED:
            self.delivered += got == DELIVERED
            return
        self.deferred += 1
        end = time.monotonic() + self.interval
        _short_switch(True)
        try:
            while time.monotonic() < end and not self._stop.is_set():
                time.sleep(RETRY_SWITCH_S)
                got = deliver(self.engine, self._user, DRIVERS, unit, frame, Interrupt)
                if got != DEFERRED:
                    self.delivered += got == DELIVERED
                    return
                self.deferred += 1
        finally:
            _short_switch(False)

    def timed_out(self, frame: Any) -> BaseException:
        """Called by a unit, in the engine thread, when a judged step ended (interrupted or not): record the
        verdict on its transaction (before anything depends on it), then return the error it fails with (a
        verdict recorded earlier is kept as it was)."""
        clear_pending()
        coord = self.coordinator()
        result = coord.current
        req = result.requests.get(frame.tid) if result is not None else None
        msg = self._reasons.pop(frame.tid, "") or timeout_message(frame)
        if req is None or result is None:  # pragma: no cover - every running frame belongs to the current epoch
            return InvocationTimeout(msg)
        had = coord.verdicts.get(req.request_id)
        verdict = self.book.settle(letter(req.request_id, frame.op, frame.fn, frame.key,
                                          _verdict("InvocationTimeout", msg, coord), result.epoch,
                                          f"{req.operator}.{req.function}"))
        if had is None:
            self.timeouts += 1
        if verdict.error_type == "Quarantined":
            return Quarantined(verdict.message)
        return InvocationTimeout(verdict.message)

    def _give_up(self, frame: Any, ran: float) -> None:
        """The step is blocked where it cannot be interrupted (or is being replayed): no reply is released any
        more and the process exits for its supervisor. A first run records the transaction as Quarantined (the
        replay refuses it); a replay records nothing (its reply may have been given: see the module docstring)."""
        if self.freeze is not None:
            self.freeze()
        coord = self.coordinator()
        result = coord.current
        req = result.requests.get(frame.tid) if result is not None else None
        judging = self.interrupting
        # a reserved InvocationTimeout (not effective: nothing saw it, and nothing is released any more) is
        # superseded: the last record of a request id is the one a recovery applies
        if judging and req is not None and result is not None and req.request_id not in coord.verdicts:
            msg = (f"{frame.op}.{frame.fn} on key {frame.key!r} held the engine past its time budget where it "
                   "could not be interrupted (blocked in C code); the engine restarted and set the transaction "
                   "aside")
            self.book.record(letter(req.request_id, frame.op, frame.fn, frame.key,
                                    _verdict("Quarantined", msg, coord), result.epoch,
                                    f"{req.operator}.{req.function}"))
        where = f"{frame.op}.{frame.fn} on key {frame.key!r}"
        if judging:
            line = (f"FATAL: {where} has held the engine for {ran:.0f} s where it cannot be interrupted; its "
                    "transaction is quarantined; exiting so that the supervisor restarts the node")
        else:
            epoch = result.epoch if result is not None else "?"
            line = (f"FATAL: replaying epoch {epoch}, {where} ran {ran:.0f} s past its budget; the epoch may have "
                    "replied, so no verdict can be taken now: raise the function's budget (--function-timeout, "
                    "@op.function(timeout=...)) or fix it; exiting for the supervisor")
        fatal_exit(line, {"event": "fatal", "operator": frame.op, "function": frame.fn, "key": frame.key,
                          "replaying": not judging})


_switch_lock = threading.Lock()
_switch_users = [0, 0.0]  # watchdogs looking again now, and the switch interval before the first of them


def _short_switch(on: bool) -> None:
    """Lower the GIL switch interval while any watchdog looks again (see :meth:`Watchdog._interrupt`); the last one
    to finish restores what the first one found (several runtimes' watchdogs never leave it lowered)."""
    with _switch_lock:
        if on:
            if _switch_users[0] == 0:
                _switch_users[1] = sys.getswitchinterval()
                sys.setswitchinterval(min(_switch_users[1], RETRY_SWITCH_S))
            _switch_users[0] += 1
        else:
            _switch_users[0] -= 1
            if _switch_users[0] == 0:
                sys.setswitchinterval(_switch_users[1])


def fatal_exit(line: str, extra: dict[str, Any], code: int = 75) -> NoReturn:
    """Log ``line`` (critical) and exit the process at once with ``code`` for its supervisor: the ``charon``
    handlers are flushed first (``charon run`` writes its log from a thread of its own); with none configured (an
    embedded runtime: a NullHandler), the line goes to stderr, so that an exit is never silent."""
    _events.critical("%s", line, extra=extra)
    handlers = [h for h in logging.getLogger("charon").handlers if not isinstance(h, logging.NullHandler)]
    for handler in handlers:
        handler.flush()
    if not handlers and not logging.getLogger().handlers:
        print(line, file=sys.stderr, flush=True)
    os._exit(code)


def budget_of(unit: PartitionUnit, frame: Any, default: float) -> float:
    try:
        fn = unit.app_for(frame.tid).resolve(frame.op, frame.fn)
    except Exception:  # noqa: BLE001 - a function of a replaced application: the default
        return default
    return fn.timeout if fn.timeout is not None else default


@contextlib.contextmanager
def task_budget(units: list[PartitionUnit], timeout: float | None, interval: float = DEFAULT_INTERVAL,
                transaction_timeout: float | None = None) -> Iterator[None]:
    """Within a Spark task: stop any function of ``units`` that runs past its budget.

    A PySpark worker runs its task in its main thread, so the sampler is a ``SIGALRM`` handler running *in* that
    thread between bytecodes (it also stops ``time.sleep``: a signal interrupts the sleep, PEP 475). A step past
    its budget (or a transaction past its total) is judged (``unit.doomed``: it fails with ``InvocationTimeout``
    whatever it does next) and :class:`Interrupt` is raised only when the interrupted frames, down to the step's
    driver, are all user code (:func:`charon.runtime.guard.interrupts.user_frame_chain`); else a later alarm tries
    again.
    The round's output carries the failure to the driver, which records the verdict before anything depends on
    it (:meth:`charon.core.epoch.EpochCoordinator._verdict`). Elsewhere than the main thread (the simulator's
    workers) nothing is armed."""
    if timeout is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    reasons: dict[int, str] = {}
    totals: dict[int, float] = {}
    tlimit = transaction_timeout if transaction_timeout is not None else 2 * timeout

    def timed_out(frame: Any) -> BaseException:
        return InvocationTimeout(reasons.pop(frame.tid, "") or timeout_message(frame))

    for u in units:
        u.interrupt = timed_out
    seen: list[Any] = [None, 0, 0.0, 0.0]  # frame, nsusp, first seen, last alarm
    fns = [f.body for u in units[:1] for op in u.app.operators.values() for f in op.functions.values()]
    user = UserCode(app_roots(fns))

    def on_alarm(signum: int, top: Any) -> None:
        for u in units:
            f = u.current
            if f is not None:
                break
        else:
            seen[0] = None
            return
        now = time.monotonic()
        ran_before = seen[0] is not None and seen[0].tid == f.tid
        total = totals[f.tid] = totals.get(f.tid, 0.0) + (min(now - seen[3], 2 * interval)
                                                          if ran_before and seen[3] else 0.0)
        seen[3] = now
        if seen[0] is not f or seen[1] != f.nsusp:
            seen[0], seen[1], seen[2] = f, f.nsusp, now
            return
        budget = budget_of(u, f, timeout)
        tbudget = max(tlimit, budget)
        ran = now - seen[2]
        if ran < budget and total < tbudget:
            return
        if f.tid not in reasons:
            reasons[f.tid] = timeout_message(f) if ran >= budget else total_message(f, tbudget)
        u.doomed = f  # in this thread, while it is u.current: the step is judged whatever it does next
        if user_frame_chain(top, user, DRIVERS):
            raise Interrupt

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
