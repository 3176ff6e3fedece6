"""Workflows (issue 34 item 4): a durable multi-step helper over continuations, promises, effects and timers.

A :class:`Workflow` is an operator (named ``charon.workflow.<name>``) whose entities are its running workflows,
one per workflow id. Its functions are internal (``/invoke`` and ``/batch`` refuse them): only the engine, the
workflow routes (``POST /workflows/{name}``) and other functions run them. A step is a plain ``async def
step(ctx, w, outcome)`` registered with ``@wf.step``; it runs as one transaction on the workflow's entity (it may
call any entity: serializable across them) and **returns what comes next**: ``w.effect(...)``, ``w.promise(...)``,
``w.sleep(...)`` (each naming the step that gets the outcome), ``w.done(value)``, ``w.fail(error)`` or
``w.compensate()``.

Nothing is added to the epoch protocol: a workflow is transactions and timers.

* ``start(input)`` (sent by :meth:`Workflow.start` inside a transaction, iff it commits; or a transaction of its
  own from ``POST /workflows/{name}``) creates the record and *delivers* the input to the first step.
* A delivery (``deliver(outcome, seq)``: the continuation of the effect or promise a step awaited, or the timer of
  ``w.sleep``) records the outcome and arms ``run(seq, attempt)`` timers: attempt 1 due at once, the retries after
  a backoff, and a ``give_up(seq)`` after the last. ``run`` executes the step; a ``run`` that commits cancels the
  remaining timers, so the step's transaction commits exactly once; a step that raises aborts its own transaction
  (Charon has no savepoints), the delivered outcome stays recorded and the next attempt runs; after the last one
  ``give_up`` marks the workflow ``failed``.
* Every await carries ``seq``, the record's current await number: a delivery or a ``run`` whose ``seq`` is past
  (a stale timer, a second outcome) does nothing but count itself in ``stale``.
* ``w.undo(op, key, fn, *args)`` pushes a compensating call, ``w.undo_effect(handler, *args)`` a compensating
  effect (kept only if the step commits); ``w.compensate()`` pops the undos newest first: calls run in the same
  transaction as the step that returns it, an effect is requested and awaited (the built-in step
  :data:`COMPENSATE_STEP` gets its outcome and goes on), and at the end the workflow is ``compensated``.

Version pinning: ``start`` records the code version its transaction runs (``ctx.code_version()``, from the engine's
recorded code history); ``run`` executes the steps of that version (:meth:`Workflow.pinned`: the same-named workflow
of ``ctx.code_of(version)``), so a workflow in flight keeps its code across a deploy; ``migrate(from_version)``, an
operator's move, sets it to the deployed version (only if still on ``from_version``, in flight, at a step the
deployed code has; :class:`~charon.errors.NotMigratable` otherwise). A migration the new code declares,
``@wf.migrates(from_version, steps={old: new})`` on a pure function ``state -> state``, also rewrites the step and
the state, for a workflow waiting (not mid-step) at a mapped step (:meth:`Workflow.migration` decides, for the
transaction and the dry run alike).

Bounds: at most :data:`MAX_UNDO` undos, :data:`MAX_HISTORY` history entries kept (older ones counted), at most
``max_steps`` steps per workflow (:class:`~charon.errors.WorkflowTooLong`), a start's input at most
``CHARON_MAX_PROMISE_VALUE_BYTES``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from charon import serde
from charon.core.context import MAX_VALUE_BYTES, Context
from charon.core.promises import MAX_ERROR_CHARS, MAX_PROMISE_VALUE_BYTES, MAX_TIMEOUT_S, PROMISE_OPERATOR, withdraw
from charon.errors import (
    BadArguments,
    NotMigratable,
    SerializationError,
    UnknownWorkflowAborted,
    ValueTooLarge,
    VersionUnavailable,
    WorkflowExists,
    WorkflowTooLong,
)
from charon.operator import Function, Operator

__all__ = ["COMPENSATE_STEP", "MAX_AWAITS", "MAX_HISTORY", "MAX_UNDO", "STATUSES", "WORKFLOW_PREFIX", "Await",
           "Finish", "Migration", "Workflow", "WorkflowHandle", "check_workflow_name", "workflow_operator"]

WORKFLOW_PREFIX = "charon.workflow."
MINTED_PREFIX = "__charon.wf."  # the ids start() mints: no client may start a workflow under one (gateway: 400)
MAX_HISTORY = 1000
MAX_UNDO = 100
MAX_AWAITS = 64  # what one step may await at once (w.all / w.any)
#: the built-in step that runs the undos (``w.compensate()``), awaiting each undo effect in its turn
COMPENSATE_STEP = "charon.compensate"
STATUSES = ("running", "waiting", "done", "failed", "compensated", "cancelled")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,60}")
Step = Callable[..., Awaitable[Any]]
S = TypeVar("S", bound=Step)
StateMap = Callable[[dict[str, object]], dict[str, object]]
M = TypeVar("M", bound=StateMap)


def check_workflow_name(name: object) -> str:
    """``name`` if it is a valid workflow name (1-60 of A-Z a-z 0-9 _ -); BadArguments otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadArguments(f"a workflow name is 1-60 characters of A-Z a-z 0-9 _ -, got {name!r}")
    return name


def workflow_operator(name: str) -> str:
    """The operator name of workflow ``name``."""
    return WORKFLOW_PREFIX + name


@dataclass
class Await:
    """What a step awaits (returned by ``w.effect``, ``w.promise``, ``w.sleep``): ``id`` is the effect's, the
    promise's or the timer's id, created by the step's transaction (it exists iff the step commits); ``w.all`` and
    ``w.any`` return one of kind ``all`` / ``any`` over ``parts``."""

    kind: str
    id: str
    then: str
    deadline: float | None = None
    parts: list[Await] = field(default_factory=list)


@dataclass(frozen=True)
class Migration:
    """A declared migration (:meth:`Workflow.migrates`): from code version ``source``, an old step maps to a step of
    this code (``steps``), and ``state`` is the pure function rewriting the old state."""

    source: str
    steps: dict[str, str]
    state: StateMap


@dataclass
class Finish:
    """How a step ends the workflow (``w.done``, ``w.fail``, ``w.compensate``)."""

    status: str
    result: Any = None
    error: str | None = None


@dataclass
class WorkflowHandle:
    """The handle ``w`` a step gets: the workflow's ``id``, ``version``, current ``step``, ``seq`` and ``attempt``
    (1, then 2... when a run of the step aborted), its ``state`` (a dict the step may change; kept iff the step
    commits), and what the step may return."""

    ctx: Context
    workflow: Workflow
    id: str
    version: str
    step: str
    seq: int
    state: dict[str, Any]
    attempt: int = 1
    undos: list[dict[str, Any]] = field(default_factory=list)
    awaits: list[Await] = field(default_factory=list)

    def _then(self, then: Step | str | None) -> str:
        if then is None:
            return ""  # one part of a w.all / w.any (which names the step)
        name = then if isinstance(then, str) else getattr(then, "__name__", "")
        if name not in self.workflow.steps and name != COMPENSATE_STEP:
            raise BadArguments(f"workflow {self.workflow.workflow!r} has no step {name!r} "
                               f"(have: {', '.join(sorted(self.workflow.steps))})")
        return name

    def _index(self) -> int:
        """The index the next await is delivered with (its place among this step's awaits)."""
        if len(self.awaits) >= MAX_AWAITS:
            raise BadArguments(f"a step awaits at most {MAX_AWAITS} things (w.all / w.any)")
        return len(self.awaits)

    def _await(self, a: Await) -> Await:
        self.awaits.append(a)
        return a

    def effect(self, handler: str, *args: object, then: Step | str | None = None, timeout: float = 30.0,
               attempts: int = 5) -> Await:
        """Run the effect handler once this step commits (``ctx.effect``); its result goes to step ``then`` (no
        ``then``: a part of ``w.all`` / ``w.any``)."""
        name, i = self._then(then), self._index()
        eid = self.ctx.effect(handler, *args, then=self.workflow.deliver_fn, carry=[self.seq + 1, i],
                              timeout=timeout, attempts=attempts)
        return self._await(Await("effect", eid, name))

    def promise(self, *, then: Step | str | None = None, timeout: float = 86_400.0) -> Await:
        """Create a durable promise (``ctx.promise``; its id in the returned ``Await.id`` and in the record's
        ``awaiting``); its outcome (``{"ok": ..., "value" | "error_type", "error"}``) goes to step ``then``."""
        name, i = self._then(then), self._index()
        pid = self.ctx.promise(then=self.workflow.deliver_fn, carry=[self.seq + 1, i], timeout=timeout)
        return self._await(Await("promise", pid, name, self.ctx.now() + timeout))

    def sleep(self, seconds: float, *, then: Step | str | None = None) -> Await:
        """Wait ``seconds`` (a timer), then run step ``then`` with ``{"ok": True, "value": None}``."""
        name, i = self._then(then), self._index()
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= MAX_TIMEOUT_S:
            raise BadArguments(f"sleep needs seconds in [0, {MAX_TIMEOUT_S:g}], got {seconds!r}")
        tid = self.ctx.send_after(seconds, self.workflow.name, self.id, self.workflow.deliver_fn,
                                  {"ok": True, "value": None}, self.seq + 1, i)
        return self._await(Await("timer", tid, name, self.ctx.now() + seconds))

    def _group(self, kind: str, awaits: list[Await], then: Step | str) -> Await:
        name = self._then(then)
        if not name:
            raise BadArguments(f"w.{kind} needs then=step")
        if not awaits or [id(a) for a in awaits] != [id(a) for a in self.awaits]:
            raise BadArguments(f"w.{kind} takes every w.effect/w.promise/w.sleep this step made, in the order made")
        if any(a.then for a in awaits):
            raise BadArguments(f"the parts of w.{kind} name no step (then= goes on w.{kind})")
        deadlines = [a.deadline for a in awaits if a.deadline is not None]
        return Await(kind, "", name, max(deadlines) if deadlines else None, list(awaits))

    def all(self, awaits: list[Await], *, then: Step | str) -> Await:
        """Await every one of ``awaits`` (made by this step, without ``then``): step ``then`` gets ``{"ok": every
        one ok, "value": [their values], "outcomes": [their outcomes]}`` in the order made, once the last
        arrives."""
        return self._group("all", awaits, then)

    def any(self, awaits: list[Await], *, then: Step | str) -> Await:
        """Await the first of ``awaits`` to arrive: step ``then`` gets its outcome with ``"index"`` (its place in
        ``awaits``); the others' timers are cancelled, their later outcomes ignored (counted in ``stale``)."""
        return self._group("any", awaits, then)

    def done(self, value: Any = None) -> Finish:
        """End the workflow ``done`` with ``value`` as its result."""
        return Finish("done", result=value)

    def fail(self, error: object) -> Finish:
        """End the workflow ``failed`` (``error``: an exception or a message); the undos do not run."""
        msg = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
        return Finish("failed", error=msg[:MAX_ERROR_CHARS])

    def compensate(self) -> Finish:
        """Run the recorded undos, newest first (in this step's transaction), then end ``compensated``."""
        return Finish("compensated")

    def undo(self, operator: Operator | str, key: str, function: Function[..., object] | str, *args: object) -> None:
        """Record a compensating call ``ctx.call(operator, key, function, *args)`` (run by ``w.compensate()``)."""
        op = operator.name if isinstance(operator, Operator) else operator
        fn = function if isinstance(function, str) else function.name
        self._push({"call": [op, key, fn, list(args)]})

    def undo_effect(self, handler: str, *args: object, timeout: float = 30.0, attempts: int = 5) -> None:
        """Record a compensating effect (``ctx.effect(handler, *args)``), requested and awaited by
        ``w.compensate()`` in its turn; a failed one ends the workflow ``failed`` (``CompensationFailed``)."""
        if not isinstance(handler, str):
            raise BadArguments("an effect handler is named by a string")
        self._push({"effect": [handler, list(args), float(timeout), int(attempts)]})

    def _push(self, undo: dict[str, Any]) -> None:
        if len(self.undos) >= MAX_UNDO:
            raise BadArguments(f"a workflow records at most {MAX_UNDO} undos")
        self.undos.append(undo)


async def _give_up_awaits(ctx: Context, awaits: list[dict[str, str]], reason: str) -> None:
    """Awaits a workflow no longer waits for: their timers cancelled, their promises withdrawn (cancelled if still
    pending, in this transaction; their continuations arrive stale). An effect runs on: its outcome arrives stale."""
    for a in awaits:
        if a["kind"] == "timer":
            ctx.cancel_timer(a["id"])
        elif a["kind"] == "promise":
            await ctx.call(PROMISE_OPERATOR, a["id"], withdraw, reason)

class Workflow(Operator):
    """A workflow: ``wf = Workflow("checkout")``, steps with ``@wf.step`` (the first with ``first=True``), given
    to the application (``Application(..., workflows=[wf])``). Each record keeps the code version its start ran
    with (``w.version``: the engine's deployed label), and its later steps run that version's steps
    (:meth:`pinned`) until an operator migrates it; ``version`` is the label recorded where the engine lends its
    partition units no code book; ``attempts`` and ``backoff`` (seconds, doubled per attempt) are how often and
    when a step that aborts is run again; ``max_steps`` bounds a workflow's length."""

    def __init__(self, name: str, *, version: str = "1", attempts: int = 3, backoff: float = 1.0,
                 max_steps: int = 100_000) -> None:
        check_workflow_name(name)
        super().__init__(workflow_operator(name))
        if type(attempts) is not int or not 1 <= attempts <= 10:
            raise ValueError("attempts must be an integer in [1, 10]")
        if not 0 < backoff <= 3600:
            raise ValueError("backoff must be in (0, 3600] seconds")
        self.workflow = name
        self.version = str(version)
        self.attempts = attempts
        self.backoff = float(backoff)
        self.max_steps = int(max_steps)
        self.steps: dict[str, Step] = {}
        self.first: str | None = None
        #: the declared migrations (:meth:`migrates`), by the code version they move workflows from
        self.migrations: dict[str, Migration] = {}
        self._register()

    # -- declaring ---------------------------------------------------------------------------------------------
    @overload
    def step(self, body: S, /, *, first: bool = False) -> S: ...

    @overload
    def step(self, body: None = None, /, *, first: bool = False) -> Callable[[S], S]: ...

    def step(self, body: S | None = None, /, *, first: bool = False) -> S | Callable[[S], S]:
        """Decorator registering ``async def step(ctx, w, outcome)`` (``@wf.step`` or ``@wf.step(first=True)``)."""
        if body is None:
            return lambda b: self.step(b, first=first)
        as_object: object = body  # (iscoroutinefunction narrows what it checks)
        if not inspect.iscoroutinefunction(as_object):
            raise TypeError(f"{body.__qualname__} must be an `async def` function")
        if len(inspect.signature(body).parameters) != 3:
            raise TypeError(f"{body.__qualname__} must take (ctx, w, outcome)")
        if body.__name__ in self.steps:
            raise ValueError(f"step {body.__name__!r} of workflow {self.workflow!r} is defined twice")
        if first:
            if self.first is not None:
                raise ValueError(f"workflow {self.workflow!r} has two first steps")
            self.first = body.__name__
        self.steps[body.__name__] = body
        return body

    def migrates(self, from_version: str, *, steps: dict[str, str]) -> Callable[[M], M]:
        """Decorator declaring how a workflow on code version ``from_version`` moves to this code: ``steps`` maps
        each old step it may be waiting at to a step of this workflow, and the decorated pure function ``state ->
        state`` rewrites its state (``@wf.migrates("v1", steps={"charged": "charged", "approved": "approved_v2"})``).
        A second migration from the same version, or a bad mapping, is a ``ValueError`` here; a step it maps to
        that the workflow lacks, at :meth:`check_declared` (``Application`` construction)."""
        if not isinstance(from_version, str) or not 0 < len(from_version) <= 200:
            raise ValueError(f"from_version is a code version (a string of 1-200 characters), got {from_version!r}")
        if from_version in self.migrations:
            raise ValueError(f"workflow {self.workflow!r} declares two migrations from version {from_version!r}")
        if not isinstance(steps, dict) or not steps or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in steps.items()):
            raise ValueError("steps maps the old steps' names to this workflow's (a non-empty dict of str to str)")

        def declare(fn: M) -> M:
            as_object: object = fn
            if not callable(fn) or inspect.iscoroutinefunction(as_object):
                raise TypeError(f"a migration is a plain function state -> state, got {fn!r}")
            if from_version in self.migrations:
                raise ValueError(f"workflow {self.workflow!r} declares two migrations from version {from_version!r}")
            self.migrations[from_version] = Migration(from_version, dict(steps), fn)
            return fn

        return declare

    def check_declared(self) -> None:
        """Called by ``Application``: every declared migration maps to a step this workflow has (ValueError)."""
        for m in self.migrations.values():
            for old, new in sorted(m.steps.items()):
                if new != COMPENSATE_STEP and new not in self.steps:
                    raise ValueError(f"the migration of workflow {self.workflow!r} from {m.source!r} maps step "
                                     f"{old!r} to {new!r}, which it does not have (have: "
                                     f"{', '.join(sorted(self.steps))})")

    def migration(self, rec: Mapping[str, object], from_version: str, to: str) -> tuple[str, object]:
        """The step and state a workflow's record ``rec`` would have once moved from ``from_version`` to this code
        (version ``to``); :class:`~charon.errors.NotMigratable` with the reason when the move does not apply.
        Pure (its ``migrate`` transaction and the dry run decide alike): a declared migration (:meth:`migrates`)
        needs the workflow waiting (not mid-step) at a mapped step, and its function's result a JSON-able dict
        within the value bound; without one the step and state stay, at a step this code has."""
        if rec["version"] != from_version:
            raise NotMigratable(f"workflow {rec['id']!r} runs version {rec['version']!r}, not {from_version!r}")
        if rec["status"] not in ("running", "waiting"):
            raise NotMigratable(f"workflow {rec['id']!r} is {rec['status']}")
        if to == from_version:
            raise NotMigratable(f"workflow {rec['id']!r} runs the deployed version {to!r} already")
        step = str(rec["step"])
        m = self.migrations.get(from_version)
        if m is None:
            if step != COMPENSATE_STEP and step not in self.steps:
                raise NotMigratable(f"version {to!r} of workflow {self.workflow!r} has no step {rec['step']!r}")
            return step, rec["state"]
        if rec["status"] != "waiting":
            raise NotMigratable(f"workflow {rec['id']!r} is mid-step (its step {rec['step']!r} is due): try again")
        new_step = m.steps.get(step)
        if new_step is None or (new_step != COMPENSATE_STEP and new_step not in self.steps):
            raise NotMigratable(f"the migration of workflow {self.workflow!r} from {from_version!r} maps no step "
                                f"{rec['step']!r} (maps: {', '.join(sorted(m.steps))})")
        try:
            out = m.state(serde.decode(serde.encode(rec["state"])))  # a copy: the record is never touched
        except Exception as exc:  # noqa: BLE001 - whatever it raises, the move does not apply
            raise NotMigratable(f"the migration function of workflow {self.workflow!r} from {from_version!r} "
                                f"raised {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]) from None
        return new_step, _checked_state(out, {**rec, "step": new_step}, self.workflow)

    def start(self, ctx: Context, input: Any = None, *, id: str | None = None) -> str:  # noqa: A002 - the API's words
        """Start a workflow from a transaction, iff it commits; returns its id: ``id``, or one minted from the
        transaction (``__charon.wf.<tid>.<entity hash>``, :data:`MINTED_PREFIX`: reserved, so no client can take
        one before the transaction that mints it; a second start from the same entity in the same transaction needs
        its own ``id``). An id in use aborts the transaction with :class:`~charon.errors.WorkflowExists`."""
        if id is None:
            h = hashlib.blake2b(f"{ctx.operator}/{ctx.key}".encode(), digest_size=6).hexdigest()
            id = f"{MINTED_PREFIX}{ctx.tid}.{h}"  # noqa: A001
        ctx.send(self.name, id, "start", input)
        return id

    # -- the internal functions --------------------------------------------------------------------------------
    def _register(self) -> None:
        wf = self

        async def start(ctx: Context, input: Any = None) -> dict[str, Any]:  # noqa: A002
            """Create the workflow and deliver ``input`` to its first step."""
            if wf.first is None:
                raise BadArguments(f"workflow {wf.workflow!r} has no first step (@{wf.workflow}.step(first=True))")
            if ctx.get() is not None:
                raise WorkflowExists(f"workflow {wf.workflow!r} {ctx.key!r} exists already")
            n = len(serde.encode_value(input))
            if n > MAX_PROMISE_VALUE_BYTES:
                raise ValueTooLarge(f"a workflow's input of {n} bytes exceeds the maximum of "
                                    f"{MAX_PROMISE_VALUE_BYTES} (CHARON_MAX_PROMISE_VALUE_BYTES)")
            now = ctx.now()
            # pinned: the code version this start runs with (the engine's recorded label; the same on replay)
            version = ctx.code_version() or wf.version
            rec = {"id": ctx.key, "workflow": wf.workflow, "version": version, "status": "waiting",
                   "step": wf.first, "seq": 1, "awaiting": [], "attempt": 0, "state": {}, "undo": [],
                   "history": [], "dropped": 0, "steps": 0, "stale": 0, "created": now, "updated": now,
                   "result": None, "error": None, "outcome": None, "timers": []}
            wf._deliver(ctx, rec, {"ok": True, "value": input})
            return {"id": ctx.key, "workflow": wf.workflow, "status": rec["status"]}

        async def deliver(ctx: Context, outcome: dict[str, Any], seq: int, index: int = 0) -> dict[str, Any]:
            """An awaited outcome arrives (an effect's or a promise's continuation, a sleep's timer); ``index``: its
            place among the step's awaits (``w.all`` / ``w.any``)."""
            rec = ctx.get()
            if rec is None:
                return {"stale": True}
            mode = rec.get("mode", "one")
            outs = rec.get("outcomes") or []
            if rec["seq"] != seq or rec["status"] != "waiting" or (mode == "all" and (
                    not 0 <= index < len(outs) or outs[index] is not None)):
                rec["stale"] += 1
                ctx.put(rec)
                return {"stale": True}
            if mode == "all":
                outs[index] = outcome
                if any(o is None for o in outs):
                    rec.update(outcomes=outs, updated=ctx.now())
                    ctx.put(rec)
                    return {"id": ctx.key, "seq": seq, "waiting": sum(1 for o in outs if o is None)}
                outcome = {"ok": all(bool(o.get("ok")) for o in outs), "value": [o.get("value") for o in outs],
                           "outcomes": outs}
            elif mode == "any":  # the others are given up: their outcomes, if any still come, arrive stale
                await _give_up_awaits(ctx, [a for a in rec["awaiting"] if a.get("index") != index],
                                      f"workflow {ctx.key!r}: another await of its w.any arrived first")
                outcome = {**outcome, "index": index}
            wf._deliver(ctx, rec, outcome)
            return {"id": ctx.key, "seq": seq}

        async def run(ctx: Context, seq: int, attempt: int) -> dict[str, Any]:
            """Run the current step (attempt ``attempt``) with the delivered outcome."""
            rec = ctx.get()
            if rec is None or rec["seq"] != seq or rec["status"] != "running":
                if rec is not None:
                    rec["stale"] += 1
                    ctx.put(rec)
                return {"stale": True}
            return await wf._run(ctx, rec, attempt)

        async def give_up(ctx: Context, seq: int) -> dict[str, Any]:
            """After the last attempt: the step aborted every time, the workflow fails."""
            rec = ctx.get()
            if rec is None or rec["seq"] != seq or rec["status"] != "running":
                return {"stale": True}
            rec.update(status="failed", timers=[], updated=ctx.now(),
                       error=f"StepFailed: step {rec['step']!r} aborted {wf.attempts} times (its transactions' "
                             "replies and the inspector have the tracebacks)")
            ctx.put(rec)
            return {"id": ctx.key, "status": "failed"}

        async def cancel(ctx: Context, reason: str = "cancelled by an operator") -> dict[str, Any]:
            """Cancel a workflow that has not finished (its timers are cancelled; later deliveries are stale)."""
            rec = ctx.get()
            if rec is None:
                raise UnknownWorkflowAborted(f"no workflow {wf.workflow!r} {ctx.key!r}")
            if rec["status"] in ("running", "waiting"):
                for t in rec["timers"]:
                    ctx.cancel_timer(t)
                await _give_up_awaits(ctx, rec["awaiting"], f"workflow {ctx.key!r} cancelled: {reason}")
                rec.update(status="cancelled", timers=[], awaiting=[], error=str(reason)[:MAX_ERROR_CHARS],
                           updated=ctx.now())
                ctx.put(rec)
            return {"id": ctx.key, "status": rec["status"]}

        async def migrate(ctx: Context, from_version: str) -> dict[str, str]:
            """An operator's move of this workflow from code version ``from_version`` to the one this transaction
            runs with (the deployed one): decided here (:meth:`Workflow.migration`), so a replay decides the same.
            Its step and state are rewritten by a declared migration (:meth:`Workflow.migrates`); anything that does
            not apply is a typed abort (:class:`~charon.errors.NotMigratable`) that changes nothing. Its pending
            await is kept: a delivery names ``seq``, not the version."""
            rec = ctx.get()
            if rec is None:
                raise UnknownWorkflowAborted(f"no workflow {wf.workflow!r} {ctx.key!r}")
            to = str(ctx.code_version() or wf.version)
            step, state = wf.migration(rec, from_version, to)
            now = ctx.now()
            entry: dict[str, Any] = {"migrated": [from_version, to], "step": rec["step"], "seq": rec["seq"],
                                     "tid": ctx.tid, "time": now}
            if from_version in wf.migrations:
                entry["to_step"] = step
            rec["history"].append(entry)
            if len(rec["history"]) > MAX_HISTORY:
                rec["dropped"] += 1
                del rec["history"][0]
            rec.update(version=to, step=step, state=state, updated=now)
            ctx.put(rec)
            return {"id": str(ctx.key), "from": from_version, "to": to}

        async def get(ctx: Context) -> dict[str, Any] | None:
            """The workflow's record (None: no such workflow)."""
            rec = ctx.get()
            return None if rec is None else dict(rec)

        for body in (start, deliver, run, give_up, cancel, migrate, get):
            self.function(body)
        self.deliver_fn = self.functions["deliver"]

    def _deliver(self, ctx: Context, rec: dict[str, Any], outcome: dict[str, Any]) -> None:
        """Record ``outcome`` for the current step and arm its runs (attempt 1 now, retries after a backoff)."""
        now = ctx.now()
        timers = [ctx.send_at(now, self.name, ctx.key, "run", rec["seq"], 1)]
        due = now
        for a in range(2, self.attempts + 1):
            due += self.backoff * 2 ** (a - 2)
            timers.append(ctx.send_at(due, self.name, ctx.key, "run", rec["seq"], a))
        timers.append(ctx.send_at(due + self.backoff * 2 ** (self.attempts - 1), self.name, ctx.key, "give_up",
                                  rec["seq"]))
        rec.update(status="running", outcome=outcome, awaiting=[], timers=timers, attempt=0, updated=now, mode="one",
                   outcomes=None)
        ctx.put(rec)

    def pinned(self, ctx: Context, version: str) -> Workflow:
        """This workflow as code version ``version`` declares it (its steps run a pinned workflow's steps): this
        object when ``version`` is the one the transaction runs (or the engine keeps no code history), else the
        same-named workflow of that version's application, from the engine's recorded code history (the same on
        replay). :class:`~charon.errors.VersionUnavailable` (the step aborts, is retried, then fails) when the
        version is not recorded or its application has no such workflow."""
        current = ctx.code_version()
        if current is None or current == version:
            return self
        app = ctx.code_of(version)
        if app is None and version == self.version:  # a record that names the declared label (started before
            return self                                # pinning recorded code versions): the deployed steps
        if app is None:
            raise VersionUnavailable(f"workflow {self.workflow!r} is pinned to code version {version!r}, which the "
                                     f"engine has not recorded (running {current!r}): migrate it "
                                     f"(charon workflows migrate --from {version})")
        old = app.workflows.get(self.workflow)
        if not isinstance(old, Workflow):
            raise VersionUnavailable(f"code version {version!r} has no workflow {self.workflow!r}")
        return old

    async def _run(self, ctx: Context, rec: dict[str, Any], attempt: int) -> dict[str, Any]:
        code = self.pinned(ctx, rec["version"])  # the steps of the version the workflow started on (or moved to)
        step = code.steps.get(rec["step"]) if rec["step"] != COMPENSATE_STEP else _compensate
        if step is None:
            raise BadArguments(f"workflow {self.workflow!r} version {rec['version']!r} has no step {rec['step']!r}")
        if rec["steps"] >= code.max_steps:
            raise WorkflowTooLong(f"workflow {self.workflow!r} {ctx.key!r} ran {rec['steps']} steps "
                                  f"(max_steps={code.max_steps})")
        for t in rec["timers"]:
            ctx.cancel_timer(t)
        w = WorkflowHandle(ctx, code, str(ctx.key), rec["version"], rec["step"], rec["seq"], rec["state"],
                           attempt=attempt, undos=list(rec["undo"]))
        nxt = await step(ctx, w, rec["outcome"])
        now = ctx.now()
        entry: dict[str, Any] = {"step": rec["step"], "seq": rec["seq"], "attempt": attempt, "tid": ctx.tid,
                                 "time": now, "ok": bool((rec["outcome"] or {}).get("ok", True))}
        if isinstance(nxt, Await):
            if nxt.kind in ("all", "any"):
                parts = nxt.parts
                if [id(a) for a in parts] != [id(a) for a in w.awaits]:
                    raise BadArguments(f"a step returns the w.{nxt.kind} over every await it made")
                entry["awaits"] = {"kind": nxt.kind, "ids": [a.id for a in parts]}
                rec.update(status="waiting", step=nxt.then, seq=rec["seq"] + 1, mode=nxt.kind,
                           outcomes=[None] * len(parts) if nxt.kind == "all" else None,
                           awaiting=[{"kind": a.kind, "id": a.id, "deadline": a.deadline, "index": i}
                                     for i, a in enumerate(parts)])
            else:
                if len(w.awaits) != 1 or w.awaits[0] is not nxt:
                    raise BadArguments("a step returns the w.effect/w.promise/w.sleep it made (several: return "
                                       "w.all([...]) or w.any([...]))")
                if not nxt.then:
                    raise BadArguments(f"the {nxt.kind} a step returns names the next step (then=step)")
                entry["awaits"] = {"kind": nxt.kind, "id": nxt.id}
                rec.update(status="waiting", step=nxt.then, seq=rec["seq"] + 1, mode="one", outcomes=None,
                           awaiting=[{"kind": nxt.kind, "id": nxt.id, "deadline": nxt.deadline}])
        elif isinstance(nxt, Finish) and nxt.status == "compensated" and rec["step"] != COMPENSATE_STEP:
            nxt = await _compensate(ctx, w, None)  # the undos, newest first: calls now, then the first effect
            if isinstance(nxt, Await):
                entry["awaits"] = {"kind": nxt.kind, "id": nxt.id}
                rec.update(status="waiting", step=nxt.then, seq=rec["seq"] + 1,
                           awaiting=[{"kind": nxt.kind, "id": nxt.id, "deadline": nxt.deadline}])
            else:
                entry["finished"] = nxt.status
                rec.update(status=nxt.status, result=nxt.result, error=nxt.error, awaiting=[], seq=rec["seq"] + 1)
        elif isinstance(nxt, Finish):
            status = nxt.status
            entry["finished"] = status
            rec.update(status=status, result=nxt.result, error=nxt.error, awaiting=[], seq=rec["seq"] + 1)
        else:
            raise BadArguments(f"step {rec['step']!r} of workflow {self.workflow!r} returned "
                               f"{type(nxt).__name__}: a step returns w.effect(...), w.promise(...), w.sleep(...), "
                               "w.done(...), w.fail(...) or w.compensate()")
        history = rec["history"]
        history.append(entry)
        if len(history) > MAX_HISTORY:
            rec["dropped"] += len(history) - MAX_HISTORY
            del history[: len(history) - MAX_HISTORY]
        rec.update(state=w.state, undo=w.undos, timers=[], outcome=None, attempt=attempt, steps=rec["steps"] + 1,
                   updated=now)
        ctx.put(rec)
        return {"id": ctx.key, "step": entry["step"], "status": rec["status"], "seq": rec["seq"]}


def _checked_state(state: object, rec: Mapping[str, object], workflow: str) -> object:
    """``state`` (a migration function's result) as the record's new state, a copy: a JSON-able dict (str keys;
    None, bool, int, float, str, lists and dicts) with which the record stays within ``CHARON_MAX_VALUE_BYTES``;
    NotMigratable otherwise."""
    what = f"the migration function of workflow {workflow!r}"
    if type(state) is not dict:
        raise NotMigratable(f"{what} returned {type(state).__name__}, not a dict")
    try:
        copy = serde.decode(serde.encode_value(state))
        if json.loads(json.dumps(copy, allow_nan=False)) != copy:
            raise ValueError("its keys are not all strings")
    except (SerializationError, TypeError, ValueError, RecursionError) as exc:
        raise NotMigratable(f"{what} returned a state that is not JSON-able: {exc}"[:MAX_ERROR_CHARS]) from None
    n = len(serde.encode_value({**rec, "state": copy}))
    if n > MAX_VALUE_BYTES:
        raise NotMigratable(f"{what} returned a state that makes the record {n} bytes, above the maximum of "
                            f"{MAX_VALUE_BYTES} (CHARON_MAX_VALUE_BYTES)")
    return copy


async def _compensate(ctx: Context, w: WorkflowHandle, outcome: dict[str, Any] | None) -> Await | Finish:
    """The built-in step :data:`COMPENSATE_STEP`: pop the undos newest first, running calls in this transaction;
    an undo effect is requested and awaited (this step runs again with its outcome); then end ``compensated``
    (``failed`` with ``CompensationFailed`` if an undo effect failed)."""
    if outcome is not None and not outcome.get("ok", True):
        return Finish("failed", error=f"CompensationFailed: an undo effect failed: {outcome.get('error_type')}: "
                                      f"{outcome.get('error')}"[:MAX_ERROR_CHARS])
    while w.undos:
        undo = w.undos.pop()
        if "call" in undo:
            op, key, fn, args = undo["call"]
            await ctx.call(op, key, fn, *args)
        else:
            handler, args, timeout, attempts = undo["effect"]
            return w.effect(handler, *args, then=COMPENSATE_STEP, timeout=timeout, attempts=attempts)
    return Finish("compensated")

