"""A seeded fault harness for applications: run an app's workload through the engine under faults, check it.

:func:`run_app` takes an application, a workload (a list of :class:`Invocation`, a function of a seeded
``random.Random`` returning one, or :func:`from_hints`: drawn from the functions' type hints with hypothesis
strategies) and invariants (callables over a :class:`Snapshot` of the committed state and the replies). From
one seed it runs the workload through the real Spark runtime code with the simulated cluster of
:mod:`charon.testing.simulation`: tasks hop between workers, workers lose their local state or their Python process,
tasks run twice, the driver crashes at every fault point and recovers, clients retry (the same request id,
i.e. the same idempotency key), timers fire as time passes, the input log is rescaled between epochs, and the
engine partitions are rescaled at epoch boundaries (the state moves to other partitions, hence other workers).
Every simulated Python worker has its own copy of the application's module (its own module-level memory, new
after the worker restarts), as Spark's workers are separate processes.

The application's effect handlers (``ctx.effect``) run too, as an effect worker would run them outside the
engine: each effect request of a recorded epoch is taken once; its handler (the application's own, as imported:
point it at a test double) is attempted up to the request's ``attempts`` under seeded handler faults (an attempt
fails before the call, or its reply is lost or times out after the handler ran: at least once), a value above
the value limit is a ``ValueTooLarge`` failure, and the continuation ``then(result, *carry)`` is submitted under
its reserved request id in a later epoch, sometimes several times (a worker that crashed before recording it).
Every continuation must have exactly one outcome, however often it was delivered.

After every recorded epoch the invariants are checked on the committed state, then the epoch is compared with
a serial execution in (epoch, position) order (:func:`charon.testing.check_epoch`). A failure raises
:class:`HarnessFailure` whose message ends with one line that reproduces it; the same seed gives the same run.
"""

from __future__ import annotations

import collections.abc
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import random
import re
import shutil
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from unittest import mock

from charon import serde
from charon.core import timers
from charon.core.epoch import EpochResult
from charon.core.routing import partition_of, split_store_key, store_key
from charon.messages import Reply, Request
from charon.operator import Application
from charon.runtime.spark import tasks as spark_tasks
from charon.runtime.spark.runtime import TICK, SparkRuntime
from charon.state.durable import DurableState
from charon.testing.simulation import Faults, SimCrash, Simulation, Violation, Worker

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = ["EffectFaults", "Faults", "HarnessFailure", "HintsWorkload", "Invocation", "Report", "Snapshot",
           "app_ref_of", "from_hints", "invocations", "run_app"]

#: Default number of invocations a run takes from its workload.
STEPS = 50
#: How far past the last request the final tick moves time, so that timers registered by the workload fire.
TIMER_HORIZON_S = 3600.0


@dataclass(frozen=True)
class Invocation:
    """One client request: ``operator``/``key``/``function`` with positional ``args``."""

    operator: str
    key: str
    function: str
    args: tuple = ()

    @classmethod
    def of(cls, spec: Invocation | Sequence[object]) -> Invocation:
        """An invocation, or a tuple ``(operator, key, function, *args)``."""
        if isinstance(spec, Invocation):
            return spec
        op, key, fn, *args = spec
        return cls(str(getattr(op, "name", op)), str(key), str(getattr(fn, "name", fn)), tuple(args))


class HarnessFailure(AssertionError):
    """A seed broke an invariant or the serial oracle; ``reproduce`` is the one line that reruns it."""

    def __init__(self, seed: int, cause: str, reproduce: str) -> None:
        self.seed, self.cause, self.reproduce = seed, cause, reproduce
        super().__init__(f"seed {seed}: {cause}\nreproduce: {reproduce}")


@dataclass
class Snapshot:
    """The committed state after an epoch and the outcomes so far, as invariants see them."""

    epoch: int
    state: dict[bytes, bytes]
    #: request id -> the engine's reply, for every request that has an outcome by this epoch
    replies: dict[str, Reply]
    #: request id -> what the client sent
    invocations: dict[str, Invocation]

    def get(self, operator: str, key: str, default: Any = None) -> Any:
        raw = self.state.get(store_key(operator, key))
        return default if raw is None else serde.decode(raw)

    def entities(self, operator: str) -> dict[str, Any]:
        """Every entity of ``operator`` that has a value: key -> value."""
        out = {}
        for k, v in self.state.items():
            op, key, item = split_store_key(k)
            if op == operator and not item:
                out[key] = serde.decode(v)
        return out

    def items(self, operator: str, key: str) -> dict[str, Any]:
        """The entity's items (``ctx.put_item``): name -> value."""
        out = {}
        for k, v in self.state.items():
            op, kk, item = split_store_key(k)
            if op == operator and kk == key and item.startswith("\x01"):
                out[item[1:]] = serde.decode(v)
        return out

    def committed(self) -> Iterator[tuple[Invocation, object]]:
        """(invocation, returned value) of every request that committed, in the serial order (epoch, position)."""
        done = [(r.epoch, r.position or 0, rid, r) for rid, r in self.replies.items()
                if r.ok and rid in self.invocations]
        for _, _, rid, r in sorted(done, key=lambda d: d[:3]):
            yield self.invocations[rid], serde.decode(r.value)


@dataclass
class Report:
    """A passing run: what happened (``fingerprint`` is the same for the same seed, bit for bit)."""

    seed: int
    epochs: int
    requests: int
    retries: int
    crashes: int
    rounds: int
    timers_fired: int
    log_resizes: int
    rescales: int  # engine-partition rescales (the state moved between partitions at an epoch boundary)
    faults: str
    fingerprint: str
    isolated: bool  # each simulated worker had its own copy of the application's module
    effects: int = 0  # effect requests taken in (each continued exactly once)
    effect_attempts: int = 0  # handler attempts (the handler ran in all but the faults before the call)
    effect_failures: int = 0  # attempts that failed (injected, or the handler raised)
    continuation_duplicates: int = 0  # continuations delivered again under the same request id


Invariant = Callable[[Snapshot], object]


# -- workloads from type hints ---------------------------------------------------------------------------------
def invocations(app: Application, keys: Sequence[str], strategies: Mapping[str, SearchStrategy[object]] | None = None,
                functions: Iterable[str] | None = None) -> SearchStrategy[Invocation]:
    """A hypothesis strategy of :class:`Invocation` of ``app``'s functions, arguments drawn from the type hints:
    ``str`` parameters from ``keys`` (they usually name entities), ``int`` from 0..1000, others with
    ``st.from_type``; ``strategies`` (parameter name -> strategy) override. ``functions``: ``op.fn`` names to
    call (default: all)."""
    from hypothesis import strategies as st

    over = dict(strategies or {})
    allowed = set(functions) if functions is not None else None
    options = []
    for op in app.operators.values():
        for fn in op.functions.values():
            if allowed is not None and fn.qualname not in allowed:
                continue
            try:
                hints = typing.get_type_hints(fn.body)
            except Exception:  # noqa: BLE001 - unresolvable hints: Any
                hints = {}
            args = [over.get(p.name) or _hint_strategy(hints.get(p.name, Any), keys) for p in fn.params
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is inspect.Parameter.empty]
            options.append(st.tuples(st.just(op.name), st.sampled_from(list(keys)), st.just(fn.name), *args).map(
                lambda t: Invocation(t[0], t[1], t[2], tuple(t[3:]))))
    if allowed is not None:
        known = {fn.qualname for op in app.operators.values() for fn in op.functions.values()}
        if unknown := sorted(allowed - known):
            raise ValueError(f"no function {', '.join(unknown)} in application {app.name!r} (give operator.function; "
                             f"it has: {', '.join(sorted(known)) or 'none'})")
    if not options:
        raise ValueError("the application has no functions to call")
    return st.one_of(options)


#: the value model's integers (signed 64-bit: serde refuses the others)
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1


def _hint_strategy(hint: object, keys: Sequence[str], nested: bool = False) -> SearchStrategy[object]:
    """A parameter's strategy: ``str`` from ``keys``, ``int`` from 0..1000 (inside a container: the value model's
    64-bit range), ``float`` from 0..1000; lists, dicts, tuples, optionals and unions of those element by element
    (``st.from_type`` would draw unbounded ints, outside the value model); anything else ``st.from_type``."""
    from hypothesis import strategies as st

    if hint is str:
        return st.sampled_from(list(keys))
    if hint is int:
        return st.integers(INT_MIN, INT_MAX) if nested else st.integers(0, 1000)
    if hint is float:
        return st.floats(0, 1000, allow_nan=False)
    if hint is bool:
        return st.booleans()
    if hint is Any:
        return st.integers(0, 1000)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, collections.abc.Sequence, collections.abc.Iterable) and len(args) == 1:
        return st.lists(_hint_strategy(args[0], keys, True), max_size=5)
    if origin in (dict, collections.abc.Mapping) and len(args) == 2:
        return st.dictionaries(_hint_strategy(args[0], keys, True), _hint_strategy(args[1], keys, True),
                               max_size=5)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_hint_strategy(args[0], keys, True), max_size=5)
        return st.tuples(*(_hint_strategy(a, keys, True) for a in args)).map(list)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([st.none() if a is type(None) else _hint_strategy(a, keys, nested) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(list(args))
    return st.from_type(typing.cast("type[object]", hint))


class HintsWorkload:
    """A workload drawn from an application's type hints (see :func:`invocations`); the same for the same seed."""

    def __init__(self, app: Application, keys: Sequence[str], strategies: Mapping[str, SearchStrategy[object]] | None,
                 functions: Iterable[str] | None) -> None:
        self.app, self.keys, self.strategies = app, list(keys), dict(strategies or {})
        self.functions = None if functions is None else list(functions)

    def __call__(self, rng: random.Random, steps: int) -> list[Invocation]:
        from hypothesis import HealthCheck, Phase, find, settings
        from hypothesis import strategies as st

        seen = itertools.count(1)  # the first examples hypothesis tries are the simplest: take the third
        out: list[Invocation] = find(
            st.lists(invocations(self.app, self.keys, self.strategies, self.functions), min_size=steps,
                     max_size=steps),
            lambda _: next(seen) >= 3,
            settings=settings(database=None, phases=[Phase.generate], max_examples=10,
                              suppress_health_check=list(HealthCheck)),
            random=rng)
        return out


def from_hints(app: Application, keys: Sequence[str] = ("k0", "k1", "k2", "k3"),
               strategies: Mapping[str, SearchStrategy[object]] | None = None, functions: Iterable[str] | None = None,
               ) -> HintsWorkload:
    """A workload of ``app``'s functions with arguments drawn from their type hints (:func:`invocations`)."""
    return HintsWorkload(app, keys, strategies, functions)


#: A workload: invocations, a function of a seeded ``random.Random`` returning them, or :func:`from_hints`.
WorkloadSource = Sequence[Any] | Callable[[random.Random], Iterable[Any]] | HintsWorkload


def _workload_list(source: WorkloadSource, rng: random.Random, steps: int) -> list[Invocation]:
    if isinstance(source, HintsWorkload):
        produced: Iterable[Any] = source(rng, steps)
    elif callable(source):
        produced = source(rng)
    else:
        produced = source
    return [Invocation.of(x) for x in itertools.islice(produced, steps)]


def _ref(obj: object) -> str | None:
    """``module:name`` importing ``obj`` back (None: a lambda, a local function, a list...)."""
    mod, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not mod or not name or "<" in name or getattr(sys.modules.get(mod), name, None) is not obj:
        return None
    return f"{mod}:{name}"


def reproduction(ref: str, workload: WorkloadSource, invariants: Sequence[Invariant], seed: int, steps: int,
                 faults: Faults | None = None, partition_rescale: bool | None = None) -> str:
    """The ``charon test-app`` line rerunning this seed, or the ``run_app`` call when the workload, an invariant
    or the faults cannot be named on the command line."""
    line = f"charon test-app {ref} --seed {seed} --steps {steps}"
    call = f"charon.testing.run_app({ref!r}, <the workload>, <the invariants>, seed={seed}, steps={steps}"
    call += "" if faults is None else f", faults={faults!r}"
    call += "" if partition_rescale is None else f", partition_rescale={partition_rescale}"
    call += ")"
    if faults is not None and faults != Faults.stable():
        return call
    if isinstance(workload, HintsWorkload):
        if workload.strategies:  # strategies of its own: the command line cannot draw the same
            return call
        line += f" --keys {','.join(workload.keys)}" if workload.keys != ["k0", "k1", "k2", "k3"] else ""
        line += f" --functions {','.join(workload.functions)}" if workload.functions else ""
    elif (w := _ref(workload)) is None:
        return call
    else:
        line += f" --workload {w}"
    for inv in invariants:
        r = _ref(inv)
        if r is None:
            return call
        line += f" --invariant {r}"
    line += " --cluster stable" if faults is not None else ""
    line += "" if partition_rescale is None else " --rescales" if partition_rescale else " --no-rescales"
    return line


# -- the plan of one seed ------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """A seed's workload cut into epochs, with client retries, the clock and the final tick (the workload
    :class:`~charon.testing.simulation.Plan` the simulator reads)."""

    epochs: list[list[Request]]
    fresh: list[set[str]]
    invocations: dict[str, Invocation]
    partitions: int
    live: bool
    retries: int = 0
    initial: dict[tuple[str, str], object] = field(default_factory=dict)

    def requests(self, epoch: int, prefix: str = "") -> list[Request]:
        return self.epochs[epoch]


def _plan(invs: list[Invocation], rng: random.Random, initial: Mapping[tuple[str, str], object]) -> _Plan:
    reqs = [Request(f"r{i}", inv.operator, inv.key, inv.function, serde.encode(list(inv.args)))
            for i, inv in enumerate(invs)]
    retry = rng.choice([0.0, 0.1, 0.3])  # a client resends (same request id) after losing the reply
    epochs: list[list[Request]] = []
    fresh: list[set[str]] = []
    resend: dict[int, list[Request]] = {}
    t, i, retries = 1.0, 0, 0
    while i < len(reqs) or resend:
        n = rng.randint(1, 6)
        e = len(epochs)
        batch = reqs[i:i + n]
        i += n
        for r in batch:
            if rng.random() < retry:
                resend.setdefault(e + rng.randint(0, 3), []).append(r)
                retries += 1
        t += rng.choice([0.5, 1.0, 5.0, 30.0])
        again = resend.pop(e, [])
        out = [Request(r.request_id, r.operator, r.key, r.function, r.args, ts=t) for r in batch]
        out += [Request(r.request_id, r.operator, r.key, r.function, r.args, ts=t) for r in again]
        rng.shuffle(out)
        epochs.append(out or [Request(f"{TICK}h{e}", TICK, "", "", serde.encode([]), ts=t)])
        fresh.append({r.request_id for r in batch})
    # the final tick: time passes, the timers the workload registered fire
    epochs.append([Request(f"{TICK}end", TICK, "", "", serde.encode([]), ts=t + TIMER_HORIZON_S)])
    fresh.append(set())
    return _Plan(epochs, fresh, {r.request_id: inv for r, inv in zip(reqs, invs, strict=True)},
                 rng.choice([1, 2, 4]), rng.random() < 0.5, retries, dict(initial))


# -- effects: the handlers run as an effect worker would, under seeded faults ------------------------------------
@dataclass(frozen=True)
class EffectFaults:
    """Per-seed rates of effect handler faults (per attempt) and continuation deliveries."""

    fail: float  # the attempt fails before the handler is called (the service was not reached)
    lost: float  # the handler ran, its reply is lost (the worker retries: at least once)
    timeout: float  # the handler ran, too slowly: the attempt is a Timeout (retried)
    duplicate: float  # the continuation is delivered again (same request id) in a later epoch
    max_delay: int  # the continuation arrives up to this many epochs after the next one

    @classmethod
    def draw(cls, rng: random.Random) -> EffectFaults:
        if rng.random() < 0.2:
            return cls(0.0, 0.0, 0.0, 0.0, 0)
        p = lambda hi: rng.choice([0.0, hi / 3, hi])  # noqa: E731
        return cls(p(0.3), p(0.2), p(0.15), p(0.5), rng.randint(0, 3))


def _call_handler(handler: Callable[..., Any], eid: str, args: list[Any], timeout: float) -> Any:
    """The handler's value, called as the executor calls it (an async one on an event loop of its own, in a thread:
    the caller may be inside a running loop)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    def run() -> Any:
        value = handler(eid, *args)
        if inspect.isawaitable(value):
            async def bounded() -> Any:
                return await asyncio.wait_for(value, timeout)
            value = asyncio.run(bounded())
        return value

    with ThreadPoolExecutor(1, thread_name_prefix="charon-harness-effect") as pool:
        return pool.submit(run).result()


class _Effects:
    """The harness's effect worker: takes each recorded effect request once, runs its handler under
    :class:`EffectFaults`, and schedules its continuation (and duplicates) into later epochs of the plan."""

    def __init__(self, app: Application, plan: _Plan, seed: int) -> None:
        self.app, self.plan = app, plan
        self.rng = random.Random(f"charon-harness-effects-{seed}")  # apart from the plan's: old seeds unchanged
        self.faults = EffectFaults.draw(self.rng)
        self.appended = -1  # the last plan epoch appended to the input log
        self.taken: set[str] = set()
        self.attempts = self.failures = self.duplicates = 0

    def take(self, e: int, res: EpochResult, trace: Callable[[str], None]) -> None:
        from charon.core.context import CONTINUATION_SUFFIX, EFFECT_STREAM, MAX_VALUE_BYTES, too_large
        from charon.runtime.effects import well_formed

        for _, stream, value in res.events:
            if stream != EFFECT_STREAM:
                continue
            doc = serde.decode(value)
            if not well_formed(doc):
                raise Violation(f"epoch {e}: a malformed effect request {doc!r}")
            eid = doc["id"]
            if eid in self.taken:
                raise Violation(f"epoch {e}: effect {eid} requested twice (its id must be unique)")
            self.taken.add(eid)
            result = self.run(eid, doc, MAX_VALUE_BYTES, too_large)
            trace(f"effect {eid} ({doc['handler']}): {result['ok']} after {result.get('attempts', '?')} attempts")
            req = Request(eid + CONTINUATION_SUFFIX, doc["op"], doc["key"], doc["then"],
                          serde.encode([result, *doc["carry"]]))
            at = self.appended + 1 + self.rng.randint(0, self.faults.max_delay)
            self.deliver(req, at, fresh=True)
            while self.rng.random() < self.faults.duplicate:  # a worker resubmits after losing its record
                self.duplicates += 1
                self.deliver(req, at + self.rng.randint(0, 3), fresh=False)

    def run(self, eid: str, doc: dict[str, Any], limit: int, too_large: Callable[[str, int], Exception],
            ) -> dict[str, Any]:
        handler = self.app.effects.get(doc["handler"])
        f = self.faults
        kind, error = "LookupError", f"no effect handler {doc['handler']!r}"
        for attempt in range(1, doc["attempts"] + 1):
            self.attempts += 1
            draw = self.rng.random()
            try:
                if handler is None:
                    raise LookupError(error)
                if draw < f.fail:
                    raise ConnectionError("injected: the service was not reached")
                value = _call_handler(handler, eid, doc["args"], doc["timeout"])
                if draw < f.fail + f.lost:
                    raise ConnectionError("injected: the handler's reply was lost")
                if draw < f.fail + f.lost + f.timeout:
                    raise TimeoutError("injected: the attempt timed out")
                size = len(serde.encode_value(value))
            except Exception as exc:  # noqa: BLE001 - an attempt's failure, as the executor counts it
                self.failures += 1
                kind = "Timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
                error = str(exc) or kind
                continue
            if size > limit:
                return {"ok": False, "error_type": "ValueTooLarge", "attempts": attempt,
                        "error": str(too_large("the effect handler's value", size))}
            return {"ok": True, "value": value}
        return {"ok": False, "error_type": kind, "error": error, "attempts": doc["attempts"]}

    def deliver(self, req: Request, at: int, fresh: bool) -> None:
        """Put ``req`` into plan epoch ``at``, or, where the plan has no such epoch left, into one new epoch: before
        the final tick while it is not appended (continuations arrive before the timers' horizon), else at the end
        (every epoch of the plan holds requests: an empty one would end the run)."""
        epochs = self.plan.epochs
        final = len(epochs) - 1
        if self.appended < final and at >= final:
            epochs.insert(final, [])
            self.plan.fresh.insert(final, set())
            at = final
        elif at >= len(epochs):
            epochs.append([])
            self.plan.fresh.append(set())
            at = len(epochs) - 1
        ts = epochs[at][0].ts if epochs[at] else epochs[at - 1][0].ts + 0.5
        epochs[at].append(Request(req.request_id, req.operator, req.key, req.function, req.args, ts=ts))
        if fresh:
            self.plan.fresh[at].add(req.request_id)


# -- per-worker copies of the application module --------------------------------------------------------------
_copies = itertools.count()


def app_ref_of(app: Application) -> str | None:
    """``module:attribute`` naming ``app`` (None when no imported module holds it)."""
    for op in app.operators.values():
        for fn in op.functions.values():
            mod = sys.modules.get(fn.body.__module__)
            for name, value in vars(mod or object()).items():
                if value is app:
                    return f"{fn.body.__module__}:{name}"
    return None


def _fresh_copy(ref: str) -> tuple[Application, str] | None:
    """A new instance of ``ref``'s module (new module-level memory) and its application; None when the module
    has no source file to load again."""
    modname, _, attr = ref.partition(":")
    orig = importlib.import_module(modname)
    origin = getattr(getattr(orig, "__spec__", None), "origin", None)
    if not origin or not os.path.isfile(origin):
        return None
    parent, _, leaf = modname.rpartition(".")
    name = f"{parent + '.' if parent else ''}_charon_copy{next(_copies)}_{leaf}"
    spec = importlib.util.spec_from_file_location(name, origin)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    app = getattr(mod, attr or "app")
    if not isinstance(app, Application):
        raise TypeError(f"{ref} is not a charon.Application")
    return app, name


class _AppSimulation(Simulation):
    """The simulator running a user's application, its plan and invariants."""

    def __init__(self, seed: int, root: str, app_ref: str, plan: _Plan, invariants: Sequence[Invariant],
                 log_growth: bool, faults: Faults | None, engine_rescale: bool = False,
                 effects: _Effects | None = None) -> None:
        super().__init__(seed, root, workload=plan, faults=faults, log_growth=log_growth,
                         engine_rescale=engine_rescale)
        self.plan = plan
        self.effects = effects
        self.invariants = list(invariants)
        self.copies: list[str] = []
        self.app_ref = app_ref
        oracle = self.copy()  # the oracle's process: a copy of its own (one memory, serial)
        self.isolated = oracle is not None
        self.app = oracle if oracle is not None else spark_tasks.load_app(app_ref)
        self.incarnations: dict[int, tuple[dict, Application]] = {}
        self.outcomes: dict[str, Reply] = {}

    def copy(self) -> Application | None:
        got = _fresh_copy(self.app_ref)
        if got is None:
            return None
        self.copies.append(got[1])
        return got[0]

    def worker_app(self, w: Worker) -> Application:
        """The application as worker ``w``'s current Python process loaded it (new after it restarted)."""
        known = self.incarnations.get(w.wid)
        if known is None or known[0] is not w.live:
            app = self.copy() if self.isolated else self.app
            assert app is not None
            known = self.incarnations[w.wid] = (w.live, app)
        return known[1]

    def run_task(self, w: Worker, task: list[tuple[int, bytes]], upto: int | None = None) -> list[tuple[int, bytes]]:
        app, ref, load = self.worker_app(w), self.app_ref, spark_tasks.load_app

        def worker_load(r: str) -> Application:
            return app if r == ref else load(r)

        with mock.patch.object(spark_tasks, "load_app", worker_load):  # this worker's copy while its task runs
            return super().run_task(w, task, upto)

    def load_initial(self) -> None:
        state = {store_key(op, key): serde.encode(value) for (op, key), value in self.plan.initial.items()}
        durable = DurableState(self.durable_root)
        for pid in range(self.config.partitions):
            rows = sorted((k, v) for k, v in state.items()
                          if partition_of(*split_store_key(k)[:2], self.config.partitions) == pid)
            durable.write_base(pid, -1, rows)
        self.expected[-1] = dict(sorted(state.items()))

    def read_keys(self, want: dict[bytes, bytes]) -> list[bytes]:
        """A few of the application's committed entities (their main value and items)."""
        entities = sorted(k for k in want if split_store_key(k)[0] and split_store_key(k)[2][:1] in ("", "\x01"))
        return self.rng.sample(entities, min(3, len(entities)))

    def append_epoch(self, rt: SparkRuntime, index: int) -> tuple[SparkRuntime, list[str]]:
        epoch = self.plan.epochs[index]
        if not any(r.request_id in self.plan.fresh[index] for r in epoch) and not any(
                r.operator == TICK for r in epoch):  # only resends, which the input log already holds: a tick,
            # else the log would not grow, no batch would run and the run would end before the plan does
            epoch.append(Request(f"{TICK}r{index}", TICK, "", "", serde.encode([]), ts=epoch[0].ts))
        rt, ids = super().append_epoch(rt, index)
        if self.effects is not None:
            self.effects.appended = index
        return rt, [i for i in dict.fromkeys(ids) if i in self.plan.fresh[index]]  # a resend is no new request

    def committed(self, e: int, after: dict[bytes, bytes], res: EpochResult) -> None:
        for tid in res.order:
            req = res.requests[tid]
            if not req.request_id.startswith(timers.REQUEST_PREFIX):
                self.outcomes[req.request_id] = res.replies[tid]
        snap = Snapshot(e, after, dict(self.outcomes), self.plan.invocations)
        for inv in self.invariants:
            name = getattr(inv, "__name__", repr(inv))
            try:
                ok = inv(snap)
            except AssertionError as exc:  # its message's first line (pytest may append its introspection)
                why = str(exc).split("\n", 1)[0]
                raise Violation(f"epoch {e}: invariant {name} broken" + (f": {why}" if why else "")) from None
            if ok is False:
                raise Violation(f"epoch {e}: invariant {name} broken")
        if self.effects is not None:  # the epoch's effect requests: run, their continuations scheduled
            self.effects.take(e, res, self.trace)

    def verify_recorded(self) -> None:
        """As the simulator's, naming the request behind a transaction the oracle disagrees with."""
        try:
            super().verify_recorded()
        except Violation as exc:
            m = re.match(r"epoch (\d+): tid (\d+): engine", str(exc))
            res = self.results.get(int(m.group(1))) if m else None
            req = res.requests.get(int(m.group(2))) if res is not None and m else None
            if req is None:
                raise
            inv = self.plan.invocations.get(req.request_id)
            kind = "an effect's continuation" if req.request_id.startswith("fx.") else "a timer"
            what = (f"{inv.operator}.{inv.function} on {inv.key!r} with {list(inv.args)!r}" if inv is not None
                    else f"{req.operator}.{req.function} on {req.key!r} ({kind})")
            raise Violation(f"{exc} -- request {req.request_id}: {what}; the engine's outcome differs from a serial "
                            "execution: does a function read the clock, random numbers, process memory or I/O "
                            "(use ctx.now(), ctx.random(), the entity's state)?") from None

    def close(self) -> None:
        for name in self.copies:
            sys.modules.pop(name, None)


def run_app(app: Application | str, workload: WorkloadSource | None = None, invariants: Sequence[Invariant] = (),
            *, seed: int, steps: int = STEPS, keys: Sequence[str] = ("k0", "k1", "k2", "k3"),
            initial: Mapping[tuple[str, str], object] | None = None, reproduce: str | None = None,
            faults: Faults | None = None, rescale: bool | None = None, partition_rescale: bool | None = None,
            trace: bool = False) -> Report:
    """Run ``workload`` (default: :func:`from_hints` over ``keys``) on ``app`` under the faults seed ``seed`` draws;
    check ``invariants`` and the serial oracle after every epoch. Raises :class:`HarnessFailure` (its last line
    is ``reproduce``, default a ``charon test-app`` command) or returns a :class:`Report`.

    ``app``: the application or its ``module:attribute``. ``initial``: {(operator, key): value} before the run.
    ``steps``: at most this many invocations are taken from the workload. ``faults`` (default: drawn from the
    seed), ``rescale`` (the input log resized between epochs; default: drawn) and ``partition_rescale`` (the
    engine partitions rescaled at epoch boundaries; default: drawn) fix the faults instead."""
    __tracebackhide__ = True  # pytest shows the failure, not the harness's frames
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if isinstance(app, str):
        ref = app
        app = spark_tasks.load_app(ref)
    else:
        found = app_ref_of(app)
        if found is None:
            raise ValueError("the harness needs an application defined at module level (module:attribute)")
        ref = found
    source = workload if workload is not None else from_hints(app, keys)
    rng = random.Random(f"charon-harness-{seed}")
    invs = _workload_list(source, rng, steps)
    plan = _plan(invs, rng, initial or {})
    line = reproduce or reproduction(ref, source, invariants, seed, steps, faults, partition_rescale)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix=f"charon-harness-{seed}-", dir=base)
    grow = rng.random() < 0.5
    move = rng.random() < 0.6
    effects = _Effects(app, plan, seed) if app.effects else None  # the handlers as imported (test doubles)
    sim = _AppSimulation(seed, root, ref, plan, invariants, grow if rescale is None else rescale, faults,
                         move if partition_rescale is None else partition_rescale, effects)
    sim.trace_on = trace
    try:
        stats = sim.run()
        if effects is not None:  # every effect taken in was continued, exactly once, however often delivered
            ran: dict[str, int] = {}
            for e in range(stats["epochs"]):
                res = sim.results[e]
                for tid in res.order:
                    rid = res.requests[tid].request_id
                    ran[rid] = ran.get(rid, 0) + 1
            for eid in sorted(effects.taken):
                n = ran.get(eid + ".done", 0)
                if n != 1:
                    raise Violation(f"effect {eid}: its continuation ran {n} times (exactly once expected)")
    except (Violation, SimCrash) as exc:
        raise HarnessFailure(seed, str(exc), line) from None
    except Exception as exc:  # noqa: BLE001 - an engine error under these faults is a failure of the seed too
        raise HarnessFailure(seed, f"{type(exc).__name__}: {exc}", line) from exc
    finally:
        sim.close()
        shutil.rmtree(root, ignore_errors=True)
    digest = hashlib.sha256()
    for ev in sim.events:
        digest.update(ev.encode() + b"\n")
    for e in sorted(sim.expected):
        for k, v in sim.expected[e].items():
            digest.update(b"%d\0%s\0%s\n" % (e, k, v))
    for rid in sorted(sim.delivered):
        digest.update(repr(sim.delivered[rid]).encode() + b"\n")
    return Report(seed, stats["epochs"], stats["requests"], plan.retries, stats["crashes"], stats["rounds"],
                  stats["fired"], stats["log_resizes"], stats["engine_rescales"],
                  repr(sim.faults) + ("" if effects is None else f", {effects.faults!r}"), digest.hexdigest(),
                  sim.isolated, *(() if effects is None else (len(effects.taken), effects.attempts, effects.failures,
                                                              effects.duplicates)))
