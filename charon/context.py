"""The context a function receives: its entity's state, calls to other entities, deterministic randomness.

Suspension and replay (why functions may run more than once)
-----------------------------------------------------------
A synchronous ``await ctx.call(...)`` cannot keep a coroutine alive across rounds: on Spark every round is
a separate task, possibly in another process. So a function that calls synchronously *suspends*: the
engine stores a small journal (the replies it has received and the state values it has read) and drops
the coroutine. When the reply arrives, the function is run again from the start in *replay* mode: reads
are served from the journal, writes and calls already made are skipped, and ``ctx.call`` returns the
journaled replies, until the function passes the newest reply and continues live. Functions are
deterministic (randomness and time come from the context), so the replay reaches the same point.
"""

from __future__ import annotations

import random as _random
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from charon import serde
from charon.errors import CallGraphLimitExceeded, NonDeterministicFunction
from charon.operator import Function, Operator
from charon.routing import check_item

if TYPE_CHECKING:  # pragma: no cover
    from charon.partition import Frame, PartitionUnit

MAX_DEPTH = 200


class _Call:
    """Awaitable returned by ``ctx.call``: ready at once when the reply is journaled, else suspends."""

    __slots__ = ("ctx", "ready", "value", "target", "child")

    def __init__(self, ctx: Context, ready: bool, value: Any, target: tuple | None, child: int) -> None:
        self.ctx = ctx
        self.ready = ready
        self.value = value
        self.target = target
        self.child = child

    def __await__(self) -> Generator[Any, None, Any]:
        if self.ready:
            return self.value
        self.ctx._pending = [(self.child, self.target)]
        self.ctx._gathered = False
        # The engine either resumes the coroutine here with the reply, or drops it and replays the function.
        return (yield self)


class _Gather:
    """Awaitable returned by ``ctx.gather``: several synchronous calls in flight at once."""

    __slots__ = ("ctx", "calls")

    def __init__(self, ctx: Context, calls: tuple[_Call, ...]) -> None:
        self.ctx = ctx
        self.calls = calls

    def __await__(self) -> Generator[Any, None, list]:
        if all(c.ready for c in self.calls):
            return [c.value for c in self.calls]
        if any(c.ready for c in self.calls):  # pragma: no cover - replies of a gather are journaled together
            raise NonDeterministicFunction("a gather was replayed with part of its replies")
        self.ctx._pending = [(c.child, c.target) for c in self.calls]
        self.ctx._gathered = True
        return (yield self)


class Context:
    """What a function sees: ``key``, its entity's state, ``call``/``send``, ``random``/``now``."""

    __slots__ = (
        "_unit", "_frame", "_replaying", "_ncall", "_nread", "_nchild", "_pending", "_sends", "_calls",
        "_fast", "_rng", "_gathered", "key", "operator", "tid",
    )

    def __init__(self, unit: PartitionUnit, frame: Frame, fast: bool = False) -> None:
        self._unit = unit
        self._frame = frame
        self._fast = fast
        self._replaying = bool(frame.replies) and not fast
        self._ncall = 0
        self._nread = 0
        self._nchild = 0
        self._pending: list[tuple[int, tuple]] | None = None
        self._gathered = False
        self._sends: list[tuple] = []
        self._calls: list[tuple] = []
        self._rng: _random.Random | None = None
        self.key: str = frame.key
        self.operator: str = frame.op
        self.tid: int = frame.tid

    def _resume(self, unit: PartitionUnit, frame: Frame) -> None:
        """Continue a live coroutine in a new round (possibly with a new unit object for the partition)."""
        self._unit = unit
        self._frame = frame
        self._replaying = False
        self._pending = None
        self._sends = []

    # -- state of this entity ---------------------------------------------------------------------
    def _read(self, item: str) -> bytes | None:
        if self._replaying:
            reads = self._frame.reads
            if self._nread >= len(reads):
                raise NonDeterministicFunction(f"{self.operator}/{self.key}: replay read past its journal")
            raw = reads[self._nread]
            self._nread += 1
            return raw
        raw = self._unit.read(self._frame.tid, self._frame.op, self._frame.key, item)
        if not self._fast:
            self._frame.reads.append(raw)
        return raw

    def get(self, default: Any = None) -> Any:
        """The entity's value, or ``default`` if it has none."""
        raw = self._read("")
        return default if raw is None else serde.decode(raw)

    def put(self, value: Any) -> None:
        """Set the entity's value (buffered in the transaction until it commits)."""
        if not self._replaying:
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, "", serde.encode(value))

    def delete(self) -> None:
        """Remove the entity's value."""
        if not self._replaying:
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, "", None)

    def get_item(self, name: str, default: Any = None) -> Any:
        """One named item of the entity's ordered item map."""
        raw = self._read(_item(name))
        return default if raw is None else serde.decode(raw)

    def put_item(self, name: str, value: Any) -> None:
        """Set one named item of the entity's ordered item map."""
        if not self._replaying:
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, _item(name), serde.encode(value))

    def delete_item(self, name: str) -> None:
        """Remove one named item."""
        if not self._replaying:
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, _item(name), None)

    def scan_items(self, prefix: str = "", start: str | None = None, stop: str | None = None) -> list:
        """Items whose name starts with ``prefix`` and lies in [start, stop), sorted by name."""
        if self._replaying:
            reads = self._frame.reads
            if self._nread >= len(reads):
                raise NonDeterministicFunction(f"{self.operator}/{self.key}: replay read past its journal")
            raw_items = reads[self._nread]
            self._nread += 1
        else:
            raw_items = self._unit.scan(self._frame.tid, self._frame.op, self._frame.key, _item(prefix))
            if not self._fast:
                self._frame.reads.append(raw_items)
        out = []
        for name, raw in raw_items:
            name = name[1:]
            if (start is not None and name < start) or (stop is not None and name >= stop):
                continue
            out.append((name, serde.decode(raw)))
        return out

    # -- calls ------------------------------------------------------------------------------------
    def _target(self, operator: Operator | str, key: str, function: Function | str, args: tuple) -> tuple:
        fn = self._unit.app.validate(operator, function, args, key=key)  # key: routing.check_key
        if self._frame.depth >= MAX_DEPTH:
            raise CallGraphLimitExceeded(f"call depth exceeds {MAX_DEPTH}")
        return (fn.operator.name, key, fn.name, serde.encode(list(args)))

    def call(self, operator: Operator | str, key: str, function: Function | str, *args: Any) -> _Call:
        """Call a function of another entity and wait for its return value (same transaction)."""
        replies = self._frame.replies
        if self._replaying and self._ncall < len(replies):  # validated when it was first made
            target = _replayed_target(operator, key, function, args)
        else:
            target = self._target(operator, key, function, args)
        self._nchild += 1
        self._calls.append((1,) + target)
        if self._ncall < len(replies):
            value = serde.decode(replies[self._ncall])
            self._ncall += 1
            if self._ncall == len(replies):
                self._replaying = False
            return _Call(self, True, value, None, self._nchild)
        self._ncall += 1
        return _Call(self, False, None, target, self._nchild)

    def gather(self, *calls: _Call) -> _Gather:
        """Wait for several ``ctx.call(...)`` at once: they run concurrently; returns their values in order.

        ``values = await ctx.gather(ctx.call(a, k1, f), ctx.call(b, k2, g, x))``. The gathered calls'
        call graphs run concurrently, so they should not touch the same entities.
        """
        for c in calls:
            if not isinstance(c, _Call) or c.ctx is not self:
                raise TypeError("ctx.gather takes the results of this context's ctx.call(...)")
        return _Gather(self, calls)

    def send(self, operator: Operator | str, key: str, function: Function | str, *args: Any) -> None:
        """Call a function of another entity without waiting (it still belongs to this transaction)."""
        target = self._target(operator, key, function, args)
        self._nchild += 1
        self._calls.append((0,) + target)
        if not self._replaying:
            self._sends.append((self._nchild,) + target)

    # -- determinism ------------------------------------------------------------------------------
    def random(self) -> float:
        """A pseudo-random float in [0, 1), the same on every replay of this transaction."""
        if self._rng is None:
            self._rng = _random.Random(f"{self._frame.tid}/{self._frame.inv}")
        return self._rng.random()

    def now(self) -> float:
        """The transaction's timestamp (its request's append time), the same on every replay."""
        return self._frame.ts


def _replayed_target(operator: Operator | str, key: str, function: Function | str, args: tuple) -> tuple:
    op = operator if type(operator) is str else operator.name
    fn = function if type(function) is str else function.name
    if isinstance(function, Function):
        op = function.operator.name if type(operator) is not str else op
    return (op, key, fn, serde.encode(list(args)))


def _item(name: str) -> str:
    """Store item of a user item name (``""`` is the entity's main value, so items are prefixed).

    Raises InvalidKey for a name :func:`charon.routing.check_item` rejects (inside a function: it aborts).
    """
    return "\x01" + check_item(name)
