"""The serial-execution oracle (DESIGN §2) and helpers to check epochs against it.

:func:`serial_execute` runs transactions one at a time with plain nested calls, independently of the
engine: a synchronous call runs the callee to completion inline when it is first awaited (a call never
awaited never runs); asynchronous calls run after the caller, in FIFO order. Its results must equal the
engine's for the engine's reported serial order.

The abort rule is the engine's: the first exception raised by any function of the call graph aborts the
transaction with that error, *even if a caller catches it* (in the engine the caller is never resumed).
The oracle lets the caller's handler run (to see it) but still aborts, and warns with
:class:`CaughtCalleeError`, since such a handler never runs in the engine.

:func:`replay_in_process` runs a Spark runtime's recorded epochs through the in-process runtime (the Spark
tests' differential oracle).
"""

from __future__ import annotations

import random as _random
import warnings
from collections import deque
from collections.abc import Awaitable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from charon import serde
from charon.core import awaits, determinism
from charon.core import timers as _timers
from charon.core.context import (
    EFFECT_STREAM,
    MAX_DEPTH,
    MAX_EMITS,
    Call,
    Context,
    child_inv,
    effect_request,
    item_key,
    name_implementations,
    raised_in,
    unawaited_message,
)
from charon.core.epoch import EpochResult, Verdict
from charon.core.partition import MAX_INVOCATIONS, too_many_invocations
from charon.core.promises import DEFAULT_TIMEOUT_S, PROMISE_OPERATOR, promise_request
from charon.core.routing import check_item, check_stream, entity_prefix, partition_of, split_store_key, store_key
from charon.core.sequencer import Sequencer
from charon.errors import CallGraphLimitExceeded, CharonError, IllegalAwait, UnawaitedCall
from charon.messages import Request
from charon.operator import Application, Function, Operator

if TYPE_CHECKING:
    from charon.runtime.node.inprocess import InProcessRuntime
    from charon.runtime.spark.runtime import SparkRuntime


class CaughtCalleeError(UserWarning):
    """Application code caught (or replaced) an exception raised by a function it called.

    In Charon a callee's exception aborts the whole transaction and the caller is never resumed, so the
    handler never runs in the engine; the oracle aborts the transaction too, and warns with this.
    """


#: The determinism check's record of one run: the effects in the order they happened, as (invocation id, effect),
#: and each invocation's (operator, function, key).
_Log = tuple[list[tuple[str, tuple]], dict[str, tuple[str, str, str]]]
#: A serial execution's outcome: (True, the encoded return value) or (False, (error type, message)).
_Outcome = tuple[bool, bytes | tuple[str, str]]


class _Txn:
    def __init__(self, app: Application, state: dict[bytes, bytes], tid: int, ts: float, limit: int) -> None:
        self.app, self.state, self.tid, self.ts = app, state, tid, ts
        self.invocations, self.limit = 0, limit
        self.writes: dict[bytes, bytes | None] = {}
        self.sends: deque = deque()
        self.abort: tuple[str, str] | None = None  # the first error raised: (type, message)
        self.caught: list[str] = []  # diagnostics: callers that went on after a callee raised
        self.events: list[tuple[tuple[int, ...], int, str, bytes]] = []  # (inv, n, stream, value)
        # the determinism check (None: off): the effects in the order they happened, as (invocation id, effect),
        # and each invocation's (operator, function, key)
        self.log: _Log | None = None

    def read(self, k: bytes) -> bytes | None:
        if k in self.writes:
            return self.writes[k]
        return self.state.get(k)


class SerialContext(Context):
    """The oracle's :class:`charon.Context` (its typed methods are declared there), executed directly."""

    def __init__(self, txn: _Txn, op: str, key: str, inv: str, depth: int) -> None:
        txn.invocations += 1  # one context per invocation: the engine's per-transaction limit
        if txn.invocations > txn.limit:
            raise too_many_invocations(txn.limit)
        self._txn, self._op, self._key, self._inv, self._depth = txn, op, key, inv, depth
        self.operator, self.key = op, key  # what user code sees (it may reassign them; state access uses _op/_key)
        self.tid = txn.tid
        self._nchild = 0
        self._ntimer = 0
        self._rng: _random.Random | None = None
        self._received: BaseException | None = None  # the first exception a callee raised into this function
        self._fn = ""
        self._nemit = 0
        self._nask = 0  # effects of this invocation (numbered like the engine's)
        self._made: list[_SerialCall] = []  # the calls ctx.call created (each must be awaited)

    def _note(self, *effect: Any) -> None:
        log = self._txn.log
        if log is not None:
            log[0].append((self._inv, effect))

    def get(self, default: Any = None) -> Any:
        raw = self._txn.read(store_key(self._op, self._key))
        return default if raw is None else serde.decode(raw)

    def put(self, value: object) -> None:
        self._write(store_key(self._op, self._key), serde.encode_value(value))

    def delete(self) -> None:
        self._write(store_key(self._op, self._key), None)

    def _write(self, k: bytes, v: bytes | None) -> None:
        self._txn.writes[k] = v
        if self._txn.log is not None:
            self._note("write", k, v)

    def get_item(self, name: str, default: Any = None) -> Any:
        raw = self._txn.read(store_key(self._op, self._key, item_key(name)))
        return default if raw is None else serde.decode(raw)

    def put_item(self, name: str, value: object) -> None:
        self._write(store_key(self._op, self._key, item_key(name)), serde.encode_value(value))

    def delete_item(self, name: str) -> None:
        self._write(store_key(self._op, self._key, item_key(name)), None)

    def scan_items(self, prefix: str = "", start: str | None = None, stop: str | None = None,
                   ) -> list[tuple[str, Any]]:
        p = store_key(self._op, self._key, item_key(prefix))
        plen = len(entity_prefix(self._op, self._key)) + 1
        merged: dict[bytes, bytes | None] = {k: v for k, v in self._txn.state.items() if k.startswith(p)}
        merged.update({k: v for k, v in self._txn.writes.items() if k.startswith(p)})
        out = []
        for k in sorted(merged):
            v = merged[k]
            name = k[plen:].decode()
            if v is None or (start is not None and name < start) or (stop is not None and name >= stop):
                continue
            out.append((name, serde.decode(v)))
        return out

    def _target(self, operator: Operator | str, key: str, function: Function[..., object] | str,
                args: tuple[object, ...]) -> Function[..., object]:
        fn = self._txn.app.validate(operator, function, args, key=key)
        if self._depth >= MAX_DEPTH:
            raise CallGraphLimitExceeded(f"call depth exceeds {MAX_DEPTH}")
        serde.encode_value(args)
        self._nchild += 1
        return fn

    def _call(self, operator: Operator | str, key: str, function: Function[..., object] | str, /, *args: object,
              **kwargs: object) -> _SerialCall:
        """Validated and numbered now; the callee runs inline when the call is first awaited."""
        if kwargs:
            args = self._txn.app.resolve(operator, function).by_position(args, kwargs)
        fn = self._target(operator, key, function, args)
        c = _SerialCall(self, fn, key, child_inv(self._inv, self._nchild), serde.encode(list(args)))
        self._made.append(c)
        if self._txn.log is not None:
            self._note("call", self._nchild, fn.operator.name, key, fn.name, c.args)
        return c

    def _gather(self, *calls: _SerialCall) -> Awaitable[list[object]]:
        """The oracle runs gathered calls one after the other, in order."""
        for c in calls:
            if not isinstance(c, _SerialCall) or c.parent is not self:
                raise TypeError("ctx.gather takes the results of this context's ctx.call(...)")
        return self._run_all(calls)

    async def _run_all(self, calls: tuple[_SerialCall, ...]) -> list[object]:
        return [await c for c in calls]

    def _send(self, operator: Operator | str, key: str, function: Function[..., object] | str, /, *args: object,
              **kwargs: object) -> None:
        if kwargs:
            args = self._txn.app.resolve(operator, function).by_position(args, kwargs)
        fn = self._target(operator, key, function, args)
        inv = child_inv(self._inv, self._nchild)
        self._txn.sends.append((fn, key, inv, self._depth + 1, serde.encode(list(args))))
        if self._txn.log is not None:
            self._note("send", self._nchild, fn.operator.name, key, fn.name, self._txn.sends[-1][4])

    def emit(self, stream: str, value: object) -> None:
        check_stream(stream)
        if self._nemit >= MAX_EMITS:
            raise CallGraphLimitExceeded(f"more than {MAX_EMITS} events emitted by one invocation")
        self._nemit += 1
        inv = tuple(int(x) for x in self._inv.split("."))
        self._txn.events.append((inv, self._nemit, stream, serde.encode_value(value)))
        if self._txn.log is not None:
            self._note("emit", stream, self._txn.events[-1][3])

    def _effect(self, handler: str, /, *args: object, then: Function[..., object] | str, carry: Sequence[object] = (),
                timeout: float = 30.0, attempts: int = 5) -> str:
        """As the engine's ``ctx.effect``: the same checks, id and event on the reserved stream (not run here)."""
        self._nask += 1
        eid, doc = effect_request(self._txn.app, self._op, self._key, self._txn.tid, self._inv, self._nask, handler,
                                  args, then, carry, timeout, attempts)
        self.emit(EFFECT_STREAM, doc)
        return eid

    def _promise(self, *, then: Function[..., object] | str, carry: Sequence[object] = (),
                 timeout: float = DEFAULT_TIMEOUT_S) -> str:
        """As the engine's ``ctx.promise``: the same id, and ``create`` sent to the promise's entity."""
        self._nask += 1
        pid, spec = promise_request(self._txn.app, self._op, self._key, self._txn.tid, self._inv, self._nask, then,
                                    carry, timeout)
        self._send(PROMISE_OPERATOR, pid, "create", spec)
        return pid

    # timers: the same items (ids, records) as the engine's; firing is modelled by check_epoch
    def _send_at(self, t: float, operator: Operator | str, key: str, function: Function[..., object] | str, /,
                 *args: object, **kwargs: object) -> str:
        due = _timers.check_due(t)
        if kwargs:
            args = self._txn.app.resolve(operator, function).by_position(args, kwargs)
        fn = self._txn.app.validate(operator, function, args, key=key)
        if self._depth >= MAX_DEPTH:
            raise CallGraphLimitExceeded(f"call depth exceeds {MAX_DEPTH}")
        self._ntimer += 1
        tid = _timers.make_id(self.tid, self._inv, self._ntimer)
        timer = _timers.Timer(tid, due, self._op, self._key, fn.operator.name, key, fn.name,
                              serde.encode(list(args)))
        self._write(_timers.item_key(self._op, self._key, tid), _timers.encode(timer))
        return tid

    def _send_after(self, seconds: float, operator: Operator | str, key: str,
                    function: Function[..., object] | str, /, *args: object, **kwargs: object) -> str:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
            raise ValueError(f"send_after needs a number of seconds >= 0, got {seconds!r}")
        return self._send_at(self.now() + seconds, operator, key, function, *args, **kwargs)

    if not TYPE_CHECKING:  # the implementations of Context's typed declarations (no ask: the oracle has no portals)
        call, gather, send, send_at, send_after, effect = _call, _gather, _send, _send_at, _send_after, _effect
        promise = _promise

    def cancel_timer(self, timer_id: str) -> bool:
        if type(timer_id) is not str or not timer_id:
            raise ValueError("a timer id is a non-empty string")
        k = store_key(self._op, self._key, _timers.ITEM_PREFIX + check_item(timer_id))
        if self._txn.read(k) is None:
            return False
        self._write(k, None)
        return True

    def timers(self) -> list[_timers.Timer]:
        p = _timers.owner_prefix(self._op, self._key)
        merged: dict[bytes, bytes | None] = {k: v for k, v in self._txn.state.items() if k.startswith(p)}
        merged.update({k: v for k, v in self._txn.writes.items() if k.startswith(p)})
        return [_timers.decode(v) for k in sorted(merged) if (v := merged[k]) is not None]

    def random(self) -> float:
        if self._rng is None:
            self._rng = _random.Random(f"{self.tid}/{self._inv}")
        return self._rng.random()

    def now(self) -> float:
        return self._txn.ts


name_implementations(SerialContext)


class _SerialCall(Call[Any]):
    """The oracle's ``ctx.call``: runs the callee on the first await; later awaits return its value."""

    def __init__(self, parent: SerialContext, fn: Function[..., object], key: str, inv: str, args: bytes) -> None:
        self.parent, self.fn, self.key, self.inv, self.args = parent, fn, key, inv, args
        self.done = False
        self.value: Any = None

    def __await__(self) -> Generator[Any, None, Any]:
        if not self.done:
            parent = self.parent
            ctx = SerialContext(parent._txn, self.fn.operator.name, self.key, self.inv, parent._depth + 1)
            try:
                value = yield from _invoke(ctx, self.fn, self.args, False, check=True).__await__()
            except Exception as exc:
                if parent._received is None:
                    parent._received = exc
                raise
            self.value = serde.decode(serde.encode(value))
            self.done = True
        return self.value


async def _invoke(ctx: SerialContext, fn: Function[..., object], args: bytes, root: bool, check: bool = False) -> Any:
    """Run one function: record the transaction's first error, and callers that go on after a callee's."""
    ctx._fn = fn.name
    txn = ctx._txn
    if txn.log is not None:
        txn.log[1][ctx._inv] = (ctx._op, fn.name, ctx._key)
    try:
        value = await fn.body(ctx, *serde.decode(args))
        # as the engine: a call created and never awaited aborts the transaction
        for c in ctx._made if ctx._received is None else ():
            if not c.done:
                raise UnawaitedCall(unawaited_message(ctx._op, fn.name, ctx._key, int(c.inv.rsplit(".", 1)[1]),
                                                      c.fn.operator.name, c.key, c.fn.name))
        if check:  # a called function's return value is in the value model (as the engine checks it)
            serde.encode_value(value)
        if txn.log is not None and ctx._received is None:
            ctx._note("return", _encoded(value))
    except Exception as exc:
        if txn.log is not None:
            ctx._note("raise", type(exc).__name__)
        if txn.abort is None:
            msg = str(exc) if root else raised_in(str(exc), ctx.operator, ctx.key, fn.name)
            txn.abort = (type(exc).__name__, msg)
        if ctx._received is not None and exc is not ctx._received:
            _caught(ctx, f"raised {type(exc).__name__} instead")
        raise
    if ctx._received is not None:
        _caught(ctx, "returned normally")
    return value


def _caught(ctx: SerialContext, how: str) -> None:
    etype, msg = ctx._txn.abort or ("?", "")
    ctx._txn.caught.append(
        f"{ctx.operator}.{ctx._fn} on key {ctx.key!r} caught a callee's exception and {how}; the engine never "
        f"resumes a caller after its callee raised, so this handler never runs there: the transaction aborts "
        f"with {etype}: {msg}"
    )


def _encoded(value: Any) -> bytes | str:
    try:
        return serde.encode(value)
    except Exception as exc:  # noqa: BLE001 - outside the value model: the transaction aborts with it anyway
        return type(exc).__name__


def _drive(coro: Any) -> Any:
    prev = awaits.enter()  # as the engine: the guard is the running loop while functions run
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return stop.value
    finally:
        awaits.leave(prev)
    coro.close()
    raise IllegalAwait(f"oracle: a function awaited something other than ctx.call ({awaits.described(yielded)}); "
                       f"{awaits.EFFECT_HINT}")


awaits.DRIVERS.add(_drive.__code__)


def serial_execute(
    app: Application, state: dict[bytes, bytes], tid: int, request: Request, *,
    max_invocations: int = MAX_INVOCATIONS, events: list[tuple[str, bytes]] | None = None,
    determinism_check: bool = False,
) -> tuple[bool, bytes | tuple[str, str]]:
    """Run one transaction on ``state`` (updated in place if it commits); returns (ok, value | error).

    ``max_invocations`` must be the engine's (``EpochCoordinator.max_invocations``). ``events``: a committed
    transaction's emitted (stream, value) pairs are appended to it, in the engine's atom order.
    ``determinism_check``: run the transaction twice on the same state and abort it with
    ``NonDeterministicFunction`` naming the first function whose effects differ (as the engine's check,
    :mod:`charon.core.determinism`)."""
    if not determinism_check:
        return _serial_execute(app, state, tid, request, max_invocations, events, None)
    runs: list[tuple[_Outcome, dict[bytes, bytes], list[tuple[str, bytes]], _Log]] = []
    logs: tuple[_Log, _Log] = (([], {}), ([], {}))
    awaits.install_audit_hook()
    for log in logs:
        copy: dict[bytes, bytes] = dict(state)
        evs: list[tuple[str, bytes]] = []
        with awaits.checking():
            outcome = _serial_execute(app, copy, tid, request, max_invocations, evs, log, warn=not runs)
        runs.append((outcome, copy, evs, log))
    first, second = runs[0][0], runs[1][0]
    same_abort = not first[0] and not second[0] and first[1][0] == second[1][0]
    diff = None if same_abort else _log_difference(runs[0][3], runs[1][3])
    if diff is not None:
        return False, ("NonDeterministicFunction", determinism.message(*diff))
    result, copy, evs, _ = runs[0]
    if result[0]:
        state.clear()
        state.update(copy)
        if events is not None:
            events.extend(evs)
    return result


def _log_difference(a: tuple, b: tuple) -> tuple[str, str, str, str] | None:
    """(operator, function, key, what differed) of the first effect that differs between two runs (None: none)."""
    ea, eb = a[0], b[0]
    if ea == eb:
        return None
    n = next((i for i, (x, y) in enumerate(zip(ea, eb, strict=False)) if x != y), min(len(ea), len(eb)))
    inv, x = ea[n] if n < len(ea) else eb[n]
    y = eb[n][1] if n < len(eb) and n < len(ea) and eb[n][0] == inv else None
    op, fn, key = (a if n < len(ea) else b)[1][inv]
    kinds = {x[0]} if y is None else {x[0], y[0]}
    if y is None or x[0] != y[0]:
        what = "outcomes" if kinds & {"return", "raise"} else "effects"
    elif x[0] == "return":
        what = "return values"
    elif x[0] == "raise":
        what = "outcomes"
    elif x[0] in ("call", "send"):
        what = f"targets of its {determinism.ordinal(x[1])} {x[0]}" if x[2:5] != y[2:5] else (
            f"arguments of its {determinism.ordinal(x[1])} {x[0]} (ctx.{x[0]}({x[2]}, {x[3]!r}, {x[4]}, ...))")
    else:
        what = "state writes" if x[0] == "write" else "events emitted"
    return op, fn, key, what


def _serial_execute(
    app: Application, state: dict[bytes, bytes], tid: int, request: Request, max_invocations: int,
    events: list[tuple[str, bytes]] | None, log: _Log | None, warn: bool = True,
) -> _Outcome:
    try:
        fn = app.validate(request.operator, request.function, serde.decode(request.args), key=request.key)
    except CharonError as exc:
        return False, (type(exc).__name__, str(exc))
    txn = _Txn(app, state, tid, request.ts, max_invocations)
    txn.log = log
    try:
        root = SerialContext(txn, request.operator, request.key, "0", 0)
        value = serde.encode_value(_drive(_invoke(root, fn, request.args, True)))
        while txn.sends and txn.abort is None:
            f, key, inv, depth, args = txn.sends.popleft()
            _drive(_invoke(SerialContext(txn, f.operator.name, key, inv, depth), f, args, False))
    except Exception as exc:  # noqa: BLE001 - the transaction aborts
        if txn.abort is None:
            txn.abort = (type(exc).__name__, str(exc))
    trip = awaits.tripped()  # a foreign await or blocking I/O (caught or not): its typed error, as the engine
    if trip is not None:
        txn.abort = (trip[0].__name__, f"oracle: a function did {trip[1]}; {awaits.EFFECT_HINT}")
    for note in txn.caught if warn else ():
        warnings.warn(CaughtCalleeError(note), stacklevel=3)
    if txn.abort is not None:
        return False, txn.abort
    for k, v in txn.writes.items():
        if v is None:
            state.pop(k, None)
        else:
            state[k] = v
    if events is not None:
        events.extend((stream, v) for _, _, stream, v in sorted(txn.events, key=lambda e: (e[0], e[1])))
    return True, value


def check_epoch(
    app: Application, before: dict[bytes, bytes], after: dict[bytes, bytes], result: EpochResult, *,
    max_invocations: int = MAX_INVOCATIONS, partitions: int | None = None,
    timer_limit: int = _timers.MAX_TIMERS_PER_EPOCH, verdicts: Mapping[str, Verdict] | None = None,
) -> None:
    """Assert the epoch equals a serial execution of its transactions in the reported order.

    ``verdicts`` (the runtime's, by request id: a function stopped past its budget, a quarantine): those
    transactions abort with the verdict's error and have no effect, as if they never ran.

    Timers: the ones the epoch fired leave the state before its transactions, and the index equals the one
    the timer items imply. With ``partitions`` (the engine's), the fired timers must be exactly those due
    at the epoch's time (at most ``timer_limit`` per partition), each firing as a transaction of its own."""
    state = dict(before)
    events: list[tuple[str, bytes]] = []
    if partitions is not None:
        want = _timers.due_in_state(before, result.time, timer_limit, lambda o, k: partition_of(o, k, partitions))
        assert [t.id for t in result.timers] == [t.id for t in want], (
            f"epoch {result.epoch} at time {result.time}: fired {[t.id for t in result.timers]}, "
            f"due {[t.id for t in want]}")
    fired_reqs = {_timers.REQUEST_PREFIX + t.id for t in result.timers}
    assert fired_reqs <= {r.request_id for r in result.requests.values()}, "every fired timer runs"
    for t in result.timers:
        assert state.pop(_timers.item_key(t.owner_operator, t.owner_key, t.id), None) is not None, (
            f"timer {t.id} fired but was not pending")
    for tid in result.order:
        rep = result.replies[tid]
        v = verdicts.get(result.requests[tid].request_id) if verdicts else None
        if v is not None:
            assert not rep.ok and rep.error_type == v.error_type, f"tid {tid}: {rep} despite its verdict {v}"
            continue
        ok, out = serial_execute(app, state, tid, result.requests[tid], max_invocations=max_invocations,
                                 events=events)
        assert rep.ok == ok, f"tid {tid}: engine ok={rep.ok} ({rep.error_type}: {rep.error_message}), oracle {out!r}"
        if ok:
            assert isinstance(out, bytes)  # a return value
            assert rep.value == out, f"tid {tid}: engine {serde.decode(rep.value)!r} != oracle {serde.decode(out)!r}"
        else:
            # With concurrent branches (gather, send) several functions may raise; which error the client
            # sees is deterministic but not defined by the serial order, so only the abort is compared
            # strictly, with the error's type.
            assert rep.error_type == out[0], f"tid {tid}: {rep} vs oracle {out!r}"
    assert set(result.order) | set(result.deferred) == set(result.requests), "every transaction is accounted for"
    assert _timers.reindex(state) == after, "state after the epoch differs from the serial execution"
    assert [(s, v) for _, s, v in result.events] == events, "the epoch's atom differs from the serial execution's"


def replay_in_process(
    app: Application, runtime: SparkRuntime, initial: dict[bytes, bytes]
) -> tuple[InProcessRuntime, list[EpochResult]]:
    """Run the Spark runtime's recorded epochs through the in-process runtime (same boundaries, same TIDs): the
    differential oracle of the Spark tests (their outcomes and state must equal the in-process run's)."""
    from charon.runtime.node.inprocess import InProcessRuntime

    rt = InProcessRuntime(app, partitions=runtime.config.partitions,
                          max_timers_per_epoch=runtime.config.max_timers_per_epoch)
    rt.coordinator.sequencer = Sequencer(1)
    for k, v in initial.items():
        op, key, _ = split_store_key(k)
        rt.stores[partition_of(op, key, rt.partitions)].data[k] = v
    results = []
    for e in range(runtime.last_recorded_epoch() + 1):
        rec = runtime.read_record(e)
        if rec is not None:  # the epoch read len(ends) log partitions: as many sequencers (grown like Spark's)
            rt.coordinator.sequencer.resize(len(rec.ends))
        results.append(rt.coordinator.run_epoch(e, runtime.epoch_requests(e), rec.time if rec else None))
    return rt, results
