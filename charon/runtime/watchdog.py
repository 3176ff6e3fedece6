"""The watchdog: no function may hold the engine past its time budget.

Design (Python cannot stop ``while True: pass`` in a coroutine from the thread running it):

* The engine runs epochs in a thread of its own (never on the gateway's event loop, see
  :class:`charon.runtime.inprocess.InProcessRuntime`). Each :class:`~charon.core.partition.PartitionUnit` says
  which invocation's code runs now (``unit.current``: two attribute stores per invocation step, the only cost
  on the hot path).
* This thread samples every ``interval`` seconds. An invocation step (a function running from one ``await`` to
  the next) seen running for longer than its budget (``@op.function(timeout=...)``, else the runtime's
  ``function_timeout``) is interrupted: :class:`~charon.core.partition.Interrupt` (a ``BaseException``, so
  ``except Exception`` in application code does not swallow it) is raised in the engine thread with
  ``PyThreadState_SetAsyncExc``, in the same GIL hold as the check that the step still runs, so it lands inside
  the unit's ``_run`` and nowhere else (the engine thread is paused at an eval-breaker point of that step, where
  it raises a pending asynchronous exception as soon as it resumes). It is repeated every interval while the
  step still runs (code catching it).
* Pure-Python code (loops, recursion, computation between awaits) stops at its next bytecode. The unit then
  calls :meth:`Watchdog.timed_out` *in the engine thread*: the verdict, ``InvocationTimeout`` naming the function
  and key, is recorded in the :class:`~charon.runtime.verdicts.VerdictBook` (fsynced in durable mode) before the
  transaction fails with it, so the verdict exists exactly when the transaction failed by it. The coordinator
  applies it (:meth:`charon.core.epoch.EpochCoordinator._judge`): the transaction reserves nothing and is never
  rerun, so every other transaction of the epoch commits or aborts exactly as at a replay or rerun, where the
  verdict refuses it up front (or takes it out of its chunk's fallback when it was stopped there).
* Code blocked in C (``time.sleep``, a C extension's loop) cannot be interrupted from another thread: it is
  reported from its budget on (``health()["stuck"]``; ``/health`` answers 503), the interrupt fires when the call
  returns, and a durable node run by ``charon run`` (``exit_after``) gives it that many more seconds, then
  records the transaction as ``Quarantined`` (no reply is released after that decision: ``freeze``) and exits
  with one line so that its supervisor restarts it; the restart replays the epoch with the verdict, so the
  transaction is never run again and the node is healthy.

The watchdog's clock starts when it first sees a step, so a step is stopped between ``budget`` and
``budget + interval`` seconds after it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from charon.core.epoch import EpochCoordinator, Verdict
from charon.core.partition import Interrupt, PartitionUnit, timeout_message
from charon.errors import InvocationTimeout
from charon.runtime.verdicts import VerdictBook, letter

_events = logging.getLogger("charon.engine")  # the server log

DEFAULT_TIMEOUT = 5.0  # seconds a function may run without awaiting a call
DEFAULT_INTERVAL = 0.1

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.py_object]
_set_async_exc.restype = ctypes.c_int


class Watchdog:
    """Samples ``units()`` of a runtime whose epochs run in the thread ``engine_thread()`` (0: none now)."""

    def __init__(
        self,
        units: Callable[[], list[PartitionUnit]],
        coordinator: Callable[[], EpochCoordinator],
        engine_thread: Callable[[], int],
        book: VerdictBook,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        interval: float = DEFAULT_INTERVAL,
        exit_after: float | None = None,
        freeze: Callable[[], None] | None = None,
    ) -> None:
        if not timeout > 0 or not interval > 0:
            raise ValueError("function_timeout and watchdog_interval must be positive")
        self.units = units
        self.coordinator = coordinator
        self.engine_thread = engine_thread
        self.book = book
        self.timeout = timeout
        self.interval = interval
        self.exit_after = exit_after
        self.freeze = freeze
        self._stuck: tuple[Any, dict[str, Any]] | None = None  # (frame, report) while a step overruns its budget
        self.timeouts = 0  # InvocationTimeout verdicts taken (metrics: charon_invocation_timeouts_total)
        #: False while a recovery replays logged epochs: only an epoch's first run takes new verdicts (a replayed
        #: one may have replied already); a replayed step past its budget is reported, and given up on (exit_after)
        self.interrupting = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
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
        return _budget_of(unit, frame, self.timeout)

    def _run(self) -> None:
        seen: tuple[Any, int, float] | None = None  # the step being timed: (frame, nsusp, first seen at)
        while not self._stop.wait(self.interval):
            try:
                seen = self._sample(seen)
            except Exception as exc:  # noqa: BLE001 - the watchdog never dies; it says why instead
                _events.error("watchdog error: %s: %s", type(exc).__name__, exc, exc_info=exc,
                              extra={"event": "watchdog_error", "error_type": type(exc).__name__})

    def _sample(self, seen: tuple[Any, int, float] | None) -> tuple[Any, int, float] | None:
        """One look at the units: returns the step now being timed (None: no user code runs)."""
        unit = frame = None
        for u in self.units():
            f = u.current
            if f is not None:
                unit, frame = u, f
                break
        if unit is None or frame is None:
            self._stuck = None
            return None
        now = time.monotonic()
        if seen is None or seen[0] is not frame or seen[1] != frame.nsusp:
            self._stuck = None
            return (frame, frame.nsusp, now)
        ran = now - seen[2]
        budget = self.budget(unit, frame)
        if ran < budget:
            return seen
        cur = self.coordinator().current
        req = cur.requests.get(frame.tid) if cur is not None else None
        self._stuck = (frame, {"operator": frame.op, "function": frame.fn, "key": frame.key, "tid": frame.tid,
                               "request_id": req.request_id if req is not None else None,
                               "seconds": round(ran, 3), "budget_s": budget})
        ident = self.engine_thread()
        # The check and the interrupt in one GIL hold (no Python call between them): see the module docstring.
        if ident and self.interrupting and unit.current is frame:
            _set_async_exc(ident, Interrupt)
        if self.exit_after is not None and ran > budget + self.exit_after:
            self._give_up(frame, ran)
        return seen

    def timed_out(self, frame: Any) -> BaseException:
        """Called by a unit, in the engine thread, when an Interrupt stopped ``frame``: record the verdict on its
        transaction, then return the error it fails with (a verdict recorded earlier is kept as it was)."""
        coord = self.coordinator()
        result = coord.current
        req = result.requests.get(frame.tid) if result is not None else None
        msg = timeout_message(frame)
        if req is None or result is None:  # pragma: no cover - every running frame belongs to the current epoch
            return InvocationTimeout(msg)
        verdict = coord.verdicts.get(req.request_id)
        if verdict is None:
            verdict = Verdict("InvocationTimeout", msg, coord.phase == 1)
            self.book.record(letter(req.request_id, frame.op, frame.fn, frame.key, verdict, result.epoch,
                                    f"{req.operator}.{req.function}"))
            self.timeouts += 1
        return InvocationTimeout(verdict.message)

    def _give_up(self, frame: Any, ran: float) -> None:
        """The step is blocked where it cannot be interrupted: no reply is released any more, the transaction is
        recorded as Quarantined, and the process exits for its supervisor (the replay refuses it)."""
        if self.freeze is not None:
            self.freeze()
        coord = self.coordinator()
        result = coord.current
        req = result.requests.get(frame.tid) if result is not None else None
        if req is not None and result is not None and req.request_id not in coord.verdicts:
            msg = (f"{frame.op}.{frame.fn} on key {frame.key!r} held the engine past its time budget where it "
                   "could not be interrupted (blocked in C code); the engine restarted and set the transaction "
                   "aside")
            self.book.record(letter(req.request_id, frame.op, frame.fn, frame.key,
                                    Verdict("Quarantined", msg, coord.phase == 1), result.epoch,
                                    f"{req.operator}.{req.function}"))
        _events.critical("FATAL: %s.%s on key %r has held the engine for %.0f s where it cannot be interrupted; its "
                         "transaction is quarantined; exiting so that the supervisor restarts the node", frame.op,
                         frame.fn, frame.key, ran, extra={"event": "fatal", "operator": frame.op,
                                                          "function": frame.fn, "key": frame.key})
        for handler in logging.getLogger("charon").handlers:
            handler.flush()  # a log written by a thread of its own (charon run's) has the line out before the exit
        os._exit(75)



def _task_timed_out(frame: Any) -> BaseException:
    return InvocationTimeout(timeout_message(frame))


def _budget_of(unit: PartitionUnit, frame: Any, default: float) -> float:
    try:
        fn = unit.app_for(frame.tid).resolve(frame.op, frame.fn)
    except Exception:  # noqa: BLE001 - a function of a replaced application: the default
        return default
    return fn.timeout if fn.timeout is not None else default


@contextlib.contextmanager
def task_budget(units: list[PartitionUnit], timeout: float | None, interval: float = DEFAULT_INTERVAL,
                ) -> Iterator[None]:
    """Within a Spark task: stop any function of ``units`` that runs past its budget.

    A PySpark worker runs its task in its main thread, so the sampler is a ``SIGALRM`` handler running *in* that
    thread between bytecodes: it raises :class:`Interrupt` only while a step runs (``unit.current``), so it lands
    in the unit's ``_run``, and it also stops ``time.sleep`` (a signal interrupts the sleep, PEP 475). The unit
    fails the transaction with ``InvocationTimeout``; the round's output carries the failure to the driver, which
    records the verdict before anything depends on it (:meth:`charon.core.epoch.EpochCoordinator._verdict`).
    Elsewhere than the main thread (the simulator's workers) nothing is armed."""
    if timeout is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    for u in units:
        u.interrupt = _task_timed_out
    seen: list[Any] = [None, 0, 0.0]

    def on_alarm(signum: int, _frame: Any) -> None:
        for u in units:
            f = u.current
            if f is not None:
                break
        else:
            seen[0] = None
            return
        now = time.monotonic()
        if seen[0] is not f or seen[1] != f.nsusp:
            seen[0], seen[1], seen[2] = f, f.nsusp, now
            return
        if now - seen[2] >= _budget_of(u, f, timeout):
            raise Interrupt

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
