"""The opt-in determinism check: every invocation step runs twice and the two runs' effects must agree.

Functions must be deterministic (randomness and time come from ``ctx.random()``/``ctx.now()``): a replay, a
recovery, a rerun on another worker all count on it. With the check on (``InProcessRuntime(...,
determinism_check=True)``, ``SparkConfig(determinism_check=True)``, ``charon run --check-determinism``), a
:class:`~charon.core.partition.PartitionUnit` runs each invocation step (a function from its start or an
``await`` to its next suspending ``await``, its return, or its exception) twice on the same inputs:

* first a *twin*: a fresh :class:`~charon.core.context.Context` over a copy of the frame's journal, replaying it
  from the start (the committed state reads it made before, the replies its awaited calls received, the same
  ``ctx.random()`` seed and ``ctx.now()``), then running live on a :class:`_Twin` unit: it reads the same state
  as the real run (the unit's committed overlay and store, and a copy of the transaction's own write buffer),
  and its writes, events and messages stay in the twin;
* then the real step, as without the check.

The effects compared: the outcome (returned, awaited a call, or raised: the exception's type), the calls and
sends made (their targets and arguments, in order), the return value (to a caller or the client), the state
written (values, items, timers) and the events emitted. On any difference the transaction aborts with
:class:`~charon.errors.NonDeterministicFunction` naming ``operator.function``, the key and what differed; nothing
of the real step is kept. The check costs nothing when off (one attribute test per round, none per invocation)
and about twice the functions' time when on. A function stopped past its time budget in either run fails with
``InvocationTimeout`` as without the check (each run has the whole budget).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from charon.core import timers as _timers
from charon.core.awaits import checking, install_audit_hook
from charon.core.partition import ASYNC, SYNC, Frame, Invoke, LiveTable, Outgoing, PartitionUnit, Reply, RoundOutput
from charon.core.shares import Share
from charon.errors import NonDeterministicFunction


class _Twin(PartitionUnit[Any]):
    """The unit the second run of a step runs on: the real unit's committed state, a copy of the transaction's
    own buffers, its own outputs; ``current`` is the real unit's (the watchdog and the Spark task's sampler stop
    a twin past its budget like the real run)."""

    __slots__ = ("real",)
    real: PartitionUnit[Any]

    @property
    def current(self) -> Frame | None:
        return self.real.current

    @current.setter
    def current(self, frame: Frame | None) -> None:
        self.real.current = frame

    @property
    def doomed(self) -> Frame | None:
        return self.real.doomed

    @doomed.setter
    def doomed(self, frame: Frame | None) -> None:
        self.real.doomed = frame

    def _live_table(self) -> dict[int, LiveTable]:
        return self._ltab  # never the process's table of live coroutines (the real unit's)


class _Hook:
    """The unit's interrupt hook, noting that a run was stopped past its budget."""

    __slots__ = ("hook", "fired")

    def __init__(self, hook: Callable[[Frame], BaseException] | None) -> None:
        self.hook = hook
        self.fired = False

    def __call__(self, frame: Frame) -> BaseException:
        self.fired = True
        if self.hook is not None:
            return self.hook(frame)
        from charon.errors import InvocationTimeout

        return InvocationTimeout(f"{frame.op}.{frame.fn} was interrupted")


def _twin_of(unit: PartitionUnit[Any], tid: int, hook: _Hook) -> _Twin:
    t = _Twin.__new__(_Twin)
    t.real = unit
    t.pid, t.partitions, t.app, t.previous, t.store = unit.pid, unit.partitions, unit.app, unit.previous, unit.store
    t.code = unit.code
    t.max_invocations = unit.max_invocations
    t.report_cache = t.sole_writer = t._recording = t._fresh = False
    t._due = None
    t._ltab = {}
    t.epoch = unit.epoch
    b = unit.buffers.get(tid)
    t.buffers = {} if b is None else {tid: {e: dict(items) for e, items in b.items()}}
    touched = unit.touched.get(tid)
    t.touched = {} if touched is None else {tid: dict(touched)}
    ev = unit.emits.get(tid)
    t.emits = {} if ev is None else {tid: list(ev)}
    t.frames, t.cache, t._clog, t.dead, t.emitted = {}, {}, {}, set(), []
    t.overlay, t.fast_layer = unit.overlay, unit.fast_layer
    t._out = RoundOutput()
    t._stat_reads = t._stat_runs = 0
    t.interrupt = hook
    t.twice = None  # the twin's own steps run once
    return t


def _copy_frame(f: Frame) -> Frame:
    c = Invoke(f.tid, f.inv, f.op, f.key, f.fn, f.args, f.share, f.kind, f.caller, f.ts, f.depth)
    c.replies, c.reads, c.nsusp, c.pending = dict(f.replies), list(f.reads), f.nsusp, None
    c.token, c.kg = f.token, f.kg
    return c


class _Run:
    """What one run of a step did (see :func:`run_twice`)."""

    __slots__ = ("error", "suspended", "messages", "value", "writes", "events")

    def __init__(self, unit: PartitionUnit[Any], frame: Frame, msgs: Outgoing, done: list[tuple[int, bytes, Share]],
                 failed: list[tuple[int, str, str]]) -> None:
        tid = frame.tid
        self.error = failed[0][1] if failed else None  # the exception's type name
        self.suspended = frame.pending is not None
        self.messages = [m for m in msgs if type(m) is Invoke]
        value = [m.value for m in msgs if type(m) is Reply and m.child == frame.inv]
        value += [v for t, v, _ in done if t == tid]
        self.value = value[0] if value and frame.kind != ASYNC else None
        self.writes = unit.buffers.get(tid) or {}
        self.events = unit.emits.get(tid) or []


def run_twice(unit: PartitionUnit[Any], frame: Frame) -> Outgoing:
    """``unit._run(frame)`` under the determinism check (see the module docstring): the messages to route."""
    tid = frame.tid
    install_audit_hook()  # once per process: blocking I/O in the function's code (see charon.core.awaits)
    hook = _Hook(unit.interrupt)
    twin = _twin_of(unit, tid, hook)
    shadow = _copy_frame(frame)
    try:
        with checking():
            msgs = twin._run(shadow)
    finally:
        for t in twin._ltab.values():  # the twin's suspended coroutine: closed (nothing of it runs again)
            for coro, ctx, _ in t.values():
                ctx._drop(coro)
    tout = twin._out
    if hook.fired:  # stopped past its budget (the verdict is recorded): fails as without the check
        unit._fail(tid, _error_of(tout.failed[0]))
        return ()
    first = _Run(twin, shadow, msgs, tout.done, tout.failed)
    out = unit._out
    nd, na, nf = len(out.done), len(out.acks), len(out.failed)
    saved = unit.interrupt
    unit.interrupt = hook
    try:
        with checking():
            msgs = unit._run(frame)
    finally:
        unit.interrupt = saved
    if hook.fired:  # the real run was stopped past its budget: its InvocationTimeout stands
        return msgs
    second = _Run(unit, frame, msgs, out.done[nd:], out.failed[nf:])
    what = _difference(first, second)
    if what is None:
        return msgs
    del out.done[nd:], out.acks[na:], out.failed[nf:]  # nothing of the real step is kept
    unit._fail(tid, NonDeterministicFunction(message(frame.op, frame.fn, frame.key, what)))
    return ()


def message(op: str, fn: str, key: str, what: str) -> str:
    """The error of a function whose two runs differed in ``what`` (the engine's and the oracle's)."""
    return (f"{op}.{fn} on key {key!r} is not deterministic: run twice on the same inputs (the determinism "
            f"check), it gave different {what}; take randomness and time from ctx.random() and ctx.now()")


def _error_of(failed: tuple[int, str, str]) -> BaseException:
    from charon import errors

    cls = getattr(errors, failed[1], None)
    exc = cls(failed[2]) if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError(failed[2])
    return exc


def _outcome(r: _Run) -> str:
    if r.error is not None:
        return f"raised {r.error}"
    return "awaited a call" if r.suspended else "returned"


def _difference(a: _Run, b: _Run) -> str | None:
    """What differs between two runs of a step (None: nothing)."""
    if a.error is not None or b.error is not None:
        if a.error == b.error:
            return None  # the same exception: the transaction aborts with it either way
        return f"outcomes (it {_outcome(a)} in one run and {_outcome(b)} in the other)"
    if a.suspended != b.suspended:
        return f"outcomes (it {_outcome(a)} in one run and {_outcome(b)} in the other)"
    for ma, mb in zip(a.messages, b.messages):  # noqa: B905 - the counts are compared after
        if ma.inv != mb.inv or ma.kind != mb.kind:
            return "calls and sends"
        n = int(ma.inv.rsplit(".", 1)[1])
        what = "call" if ma.kind == SYNC else "send"
        if (ma.op, ma.key, ma.fn) != (mb.op, mb.key, mb.fn):
            return (f"targets of its {ordinal(n)} {what} (ctx.{what}({ma.op}, {ma.key!r}, {ma.fn}) and "
                    f"ctx.{what}({mb.op}, {mb.key!r}, {mb.fn}))")
        if ma.args != mb.args:
            return f"arguments of its {ordinal(n)} {what} (ctx.{what}({ma.op}, {ma.key!r}, {ma.fn}, ...))"
    if len(a.messages) != len(b.messages):
        return f"numbers of calls and sends ({len(a.messages)} and {len(b.messages)})"
    if a.value != b.value:
        return "return values"
    if a.writes != b.writes:
        for e in sorted(set(a.writes) | set(b.writes)):
            ia, ib = a.writes.get(e) or {}, b.writes.get(e) or {}
            for item in sorted(set(ia) | set(ib)):
                if item not in ia or item not in ib or ia[item] != ib[item]:
                    return f"state writes ({_describe(e, item)})"
        return "state writes"  # pragma: no cover - some entity's items differ
    if a.events != b.events:
        return "events emitted"
    return None


def _describe(entity: tuple[str, str], item: str) -> str:
    op, key = entity
    if item.startswith(_timers.ITEM_PREFIX):
        return f"the timers of {op} {key!r}"
    if item == "":
        return f"the value of {op} {key!r}"
    return f"item {item[1:]!r} of {op} {key!r}"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"

