"""Test support: the serial-execution oracle (DESIGN §2) and helpers to check epochs against it.

:func:`serial_execute` runs transactions one at a time with plain nested calls, independently of the
engine: a synchronous call runs the callee to completion inline; asynchronous calls run after the
caller, in FIFO order. An exception anywhere discards the whole transaction's writes. Its results must
equal the engine's for the engine's reported serial order.
"""

from __future__ import annotations

import random as _random
from collections import deque
from typing import Any

from charon import serde
from charon.context import MAX_DEPTH, _item
from charon.epoch import EpochResult
from charon.errors import CallGraphLimitExceeded, CharonError
from charon.messages import Request
from charon.operator import Application, Function, Operator
from charon.partition import MAX_INVOCATIONS, too_many_invocations
from charon.routing import entity_prefix, store_key


class _Txn:
    def __init__(self, app: Application, state: dict[bytes, bytes], tid: int, ts: float, limit: int) -> None:
        self.app, self.state, self.tid, self.ts = app, state, tid, ts
        self.invocations, self.limit = 0, limit
        self.writes: dict[bytes, bytes | None] = {}
        self.sends: deque = deque()

    def read(self, k: bytes) -> bytes | None:
        if k in self.writes:
            return self.writes[k]
        return self.state.get(k)


class SerialContext:
    """The oracle's context: same API as :class:`charon.context.Context`, executed directly."""

    def __init__(self, txn: _Txn, op: str, key: str, inv: str, depth: int) -> None:
        txn.invocations += 1  # one context per invocation: the engine's per-transaction limit
        if txn.invocations > txn.limit:
            raise too_many_invocations(txn.limit)
        self._txn, self.operator, self.key, self._inv, self._depth = txn, op, key, inv, depth
        self.tid = txn.tid
        self._nchild = 0
        self._rng: _random.Random | None = None

    def get(self, default: Any = None) -> Any:
        raw = self._txn.read(store_key(self.operator, self.key))
        return default if raw is None else serde.decode(raw)

    def put(self, value: Any) -> None:
        self._txn.writes[store_key(self.operator, self.key)] = serde.encode(value)

    def delete(self) -> None:
        self._txn.writes[store_key(self.operator, self.key)] = None

    def get_item(self, name: str, default: Any = None) -> Any:
        raw = self._txn.read(store_key(self.operator, self.key, _item(name)))
        return default if raw is None else serde.decode(raw)

    def put_item(self, name: str, value: Any) -> None:
        self._txn.writes[store_key(self.operator, self.key, _item(name))] = serde.encode(value)

    def delete_item(self, name: str) -> None:
        self._txn.writes[store_key(self.operator, self.key, _item(name))] = None

    def scan_items(self, prefix: str = "", start: str | None = None, stop: str | None = None) -> list:
        p = store_key(self.operator, self.key, _item(prefix))
        plen = len(entity_prefix(self.operator, self.key)) + 1
        merged = {k: v for k, v in self._txn.state.items() if k.startswith(p)}
        merged.update({k: v for k, v in self._txn.writes.items() if k.startswith(p)})
        out = []
        for k in sorted(merged):
            v = merged[k]
            name = k[plen:].decode()
            if v is None or (start is not None and name < start) or (stop is not None and name >= stop):
                continue
            out.append((name, serde.decode(v)))
        return out

    def _target(self, operator: Operator | str, key: str, function: Function | str, args: tuple) -> Function:
        fn = self._txn.app.validate(operator, function, args, key=key)
        if self._depth >= MAX_DEPTH:
            raise CallGraphLimitExceeded(f"call depth exceeds {MAX_DEPTH}")
        serde.encode(list(args))
        self._nchild += 1
        return fn

    async def call(self, operator: Operator | str, key: str, function: Function | str, *args: Any) -> Any:
        fn = self._target(operator, key, function, args)
        ctx = SerialContext(self._txn, fn.operator.name, key, f"{self._inv}.{self._nchild}", self._depth + 1)
        value = await fn.body(ctx, *serde.decode(serde.encode(list(args))))
        return serde.decode(serde.encode(value))

    async def gather(self, *calls: Any) -> list:
        """The oracle runs gathered calls one after the other, in order."""
        out = []
        try:
            for c in calls:
                out.append(await c)
        finally:
            for c in calls[len(out) + 1:]:
                c.close()  # not started because an earlier one raised
        return out

    def send(self, operator: Operator | str, key: str, function: Function | str, *args: Any) -> None:
        fn = self._target(operator, key, function, args)
        self._txn.sends.append((fn, key, f"{self._inv}.{self._nchild}", self._depth + 1, serde.encode(list(args))))

    def random(self) -> float:
        if self._rng is None:
            self._rng = _random.Random(f"{self.tid}/{self._inv}")
        return self._rng.random()

    def now(self) -> float:
        return self._txn.ts


def _drive(coro: Any) -> Any:
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("oracle: a function awaited something other than ctx.call")


def serial_execute(
    app: Application, state: dict[bytes, bytes], tid: int, request: Request, *,
    max_invocations: int = MAX_INVOCATIONS,
) -> tuple[bool, bytes | tuple[str, str]]:
    """Run one transaction on ``state`` (updated in place if it commits); returns (ok, value | error).

    ``max_invocations`` must be the engine's (``EpochCoordinator.max_invocations``)."""
    try:
        fn = app.validate(request.operator, request.function, serde.decode(request.args), key=request.key)
    except CharonError as exc:
        return False, (type(exc).__name__, str(exc))
    txn = _Txn(app, state, tid, request.ts, max_invocations)
    try:
        root = SerialContext(txn, request.operator, request.key, "0", 0)
        value = serde.encode(_drive(fn.body(root, *serde.decode(request.args))))
        while txn.sends:
            f, key, inv, depth, args = txn.sends.popleft()
            _drive(f.body(SerialContext(txn, f.operator.name, key, inv, depth), *serde.decode(args)))
    except Exception as exc:  # noqa: BLE001 - the transaction aborts
        return False, (type(exc).__name__, str(exc))
    for k, v in txn.writes.items():
        if v is None:
            state.pop(k, None)
        else:
            state[k] = v
    return True, value


def check_epoch(
    app: Application, before: dict[bytes, bytes], after: dict[bytes, bytes], result: EpochResult, *,
    max_invocations: int = MAX_INVOCATIONS,
) -> None:
    """Assert the epoch equals a serial execution of its transactions in the reported order."""
    state = dict(before)
    for tid in result.order:
        ok, out = serial_execute(app, state, tid, result.requests[tid], max_invocations=max_invocations)
        rep = result.replies[tid]
        assert rep.ok == ok, f"tid {tid}: engine ok={rep.ok} ({rep.error_type}: {rep.error_message}), oracle {out}"
        if ok:
            assert rep.value == out, f"tid {tid}: engine {serde.decode(rep.value)!r} != oracle {serde.decode(out)!r}"
        else:
            # With concurrent branches (gather, send) several functions may raise; which error the client
            # sees is deterministic but not defined by the serial order, so only the abort is compared
            # strictly, with the error's type.
            assert rep.error_type == out[0], f"tid {tid}: {rep} vs oracle {out}"
    assert set(result.order) | set(result.deferred) == set(result.requests), "every transaction is accounted for"
    assert dict(sorted(state.items())) == after, "state after the epoch differs from the serial execution"
