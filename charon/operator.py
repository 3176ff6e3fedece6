"""The programming model: operators (entity types), their functions, and the application grouping them."""

from __future__ import annotations

import inspect
import itertools
import re
import typing
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, Concatenate, Generic, Never, ParamSpec, TypeVar

import msgspec

from charon.core.limits import Limit, check_target
from charon.core.routing import check_key, check_operator_name, check_stream
from charon.core.schedule_spec import schedule_spec
from charon.errors import BadArguments, InvalidKey, UnknownFunction, UnknownOperator, ValueTooLarge

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
#: An ``async def f(ctx, *args) -> R`` body: its first parameter takes the context (typed ``Never`` here, so that
#: this layer needs no import of the context: any annotation of it is accepted), the rest are the function's ``P``.
Body = Callable[Concatenate[Never, P], Coroutine[object, object, R]]
FunctionBody = Callable[..., Coroutine[Any, Any, Any]]
_FAST: dict[Any, tuple[type, ...]] = {int: (int,), str: (str,), bool: (bool,), float: (float, int), bytes: (bytes,)}


class Function(Generic[P, R_co]):
    """A registered ``async def`` function of an operator; calls go through ``ctx.call``/``ctx.send``.

    Typed by its parameters after the context (``P``) and its return type (``R_co``): ``@op.function`` on
    ``async def deposit(ctx: Context, amount: int) -> int`` gives a ``Function[[int], int]``, and
    ``await ctx.call(op, key, deposit, 5)`` is an ``int`` for a type checker.
    """

    def __init__(self, operator: Operator, body: Body[P, R_co], *, timeout: float | None = None,
                 public: bool = False, limit: Limit | None = None) -> None:
        if not inspect.iscoroutinefunction(body):
            raise TypeError(f"{body.__qualname__} must be an `async def` function")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"{body.__qualname__}: timeout must be a positive number of seconds")
        self.operator = operator
        self.body: FunctionBody = body
        self.name = body.__name__
        #: this function's time budget in seconds (None: the runtime's ``function_timeout``); see
        #: :mod:`charon.runtime.guard.watchdog`
        self.timeout = timeout
        #: whether clients may invoke it over HTTP (``@op.function(public=True)``); an internal function (the
        #: default) runs only when another function calls it (``ctx.call``/``ctx.send``, timers, effect
        #: continuations) or when trusted in-process code submits it (``InProcessRuntime.invoke``): the gateway
        #: answers 404 for it, as for a function that does not exist, and leaves it out of its OpenAPI document
        self.public = bool(public)
        if limit is not None and not isinstance(limit, Limit):
            raise TypeError(f"{body.__qualname__}: limit must be a charon.Limit")
        #: its admission limit (``@op.function(limit=Limit(...))``; see :mod:`charon.core.admission`)
        self.limit = limit
        sig = inspect.signature(body)
        params = list(sig.parameters.values())
        if not params:
            raise TypeError(f"{self.name} must take the context as its first parameter")
        self.params = params[1:]
        try:
            hints = typing.get_type_hints(body)
        except Exception:  # unresolvable forward references: skip type checks
            hints = {}
        self._types = [hints.get(p.name, Any) for p in self.params]
        self._min_args = sum(
            1 for p in self.params if p.default is inspect.Parameter.empty and p.kind != p.VAR_POSITIONAL
        )
        self._varargs = any(p.kind == p.VAR_POSITIONAL for p in self.params)
        self._max_args = len(self.params)
        # Fast paths for plain scalar hints; anything else is checked with msgspec.convert.
        self._checks = [
            None if t is Any else _FAST.get(t, t) for t, p in zip(self._types, self.params, strict=True)
            if p.kind != p.VAR_POSITIONAL
        ]
        # Exact type signatures accepted by the scalar fast path of check_args (every hint a plain scalar, no
        # *args, few combinations): a set lookup instead of the loop.
        self._sigs: frozenset[tuple[type, ...]] | None = None
        scalar = [c for c in self._checks if type(c) is tuple]
        if not self._varargs and len(scalar) == len(self._checks):
            sigs: set[tuple[type, ...]] = set()
            for n in range(self._min_args, self._max_args + 1):
                sigs.update(itertools.product(*scalar[:n]))
            if len(sigs) <= 256:
                self._sigs = frozenset(sigs)
        self.__doc__ = body.__doc__

    @property
    def qualname(self) -> str:
        return f"{self.operator.name}.{self.name}"

    def check_args(self, args: list | tuple) -> None:
        """Raise BadArguments unless ``args`` fit this function's arity and type hints."""
        sigs = self._sigs
        if sigs is not None and tuple(map(type, args)) in sigs:
            return
        n = len(args)
        if n < self._min_args or (not self._varargs and n > self._max_args):
            expected = (
                f"{self._min_args}" if self._min_args == self._max_args else f"{self._min_args}..{self._max_args}"
            )
            raise BadArguments(f"{self.qualname} takes {expected} argument(s), got {n}")
        checks = self._checks
        for i, value in enumerate(args):
            if i >= len(checks):
                break
            tp = checks[i]
            if tp is None:
                continue
            if type(tp) is tuple:  # fast scalar check: (exact types accepted)
                if type(value) in tp:
                    continue
                raise BadArguments(
                    f"{self.qualname} argument {self.params[i].name!r}: expected {tp[0].__name__}, "
                    f"got {type(value).__name__}"
                )
            try:
                msgspec.convert(value, tp, strict=True)
            except msgspec.ValidationError as exc:
                raise BadArguments(f"{self.qualname} argument {self.params[i].name!r}: {exc}") from None
            except TypeError:  # a hint msgspec cannot check (e.g. a class): skip
                pass

    def by_position(self, args: tuple[object, ...], kwargs: Mapping[str, object]) -> tuple[object, ...]:
        """``args`` and ``kwargs`` as the positional arguments they bind to (calls carry arguments by position): a
        parameter skipped before one given by name takes its default. Raises BadArguments for a name this function
        has no positional parameter for, or one given twice, or a required parameter left out before a named one."""
        out = list(args)
        rest = dict(kwargs)
        named = [p for p in self.params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for p in named[: len(args)]:
            if p.name in rest:
                raise BadArguments(f"{self.qualname} got two values for argument {p.name!r}")
        filled = len(out)
        for p in named[len(args):]:
            if not rest:
                break
            if p.name in rest and p.kind is not p.POSITIONAL_ONLY:
                out.append(rest.pop(p.name))
                filled = len(out)
            elif p.default is not p.empty:
                out.append(p.default)  # kept only if a later parameter is given by name
            else:
                raise BadArguments(f"{self.qualname} is missing argument {p.name!r} (given: {', '.join(kwargs)})")
        if rest:
            names = ", ".join(repr(n) for n in rest)
            raise BadArguments(f"{self.qualname} has no parameter {names} that can be passed (arguments are "
                               "passed by position: a keyword-only or positional-only parameter cannot be named)")
        return tuple(out[:filled])

    def signature(self) -> list[dict[str, Any]]:
        """Parameter names and annotations, for documentation (OpenAPI, CLI)."""
        return [
            {"name": p.name, "type": getattr(t, "__name__", str(t)), "required": p.default is p.empty}
            for p, t in zip(self.params, self._types, strict=False)
        ]

    def __repr__(self) -> str:
        return f"<charon function {self.qualname}>"


class Operator:
    """An entity type: state partitioned by key, and the functions that run on one entity at a time."""

    def __init__(self, name: str) -> None:
        try:
            check_operator_name(name)
        except InvalidKey as exc:
            raise ValueError(f"invalid operator name {name!r}: {exc}") from None
        self.name = name
        self.functions: dict[str, Function[..., object]] = {}

    @typing.overload
    def function(self, body: Body[P, R], /, *, timeout: float | None = None, public: bool = False,
                 limit: Limit | None = None) -> Function[P, R]: ...

    @typing.overload
    def function(self, body: None = None, /, *, timeout: float | None = None, public: bool = False,
                 limit: Limit | None = None) -> Callable[[Body[P, R]], Function[P, R]]: ...

    def function(self, body: Body[P, R] | None = None, /, *, timeout: float | None = None, public: bool = False,
                 limit: Limit | None = None) -> Function[P, R] | Callable[[Body[P, R]], Function[P, R]]:
        """Decorator registering an ``async def f(ctx, *args)`` as a function of this operator:
        ``@op.function``, or with options: ``@op.function(public=True)`` makes it an entry point clients may
        invoke over HTTP (functions are internal by default: only other functions, timers, effect continuations
        and trusted in-process code run them; the gateway answers 404 for them), ``@op.function(timeout=30.0)``
        gives it a time budget of its own (seconds it may run without awaiting a call; default: the runtime's
        ``function_timeout``), ``@op.function(limit=Limit(concurrency=4))`` an admission limit
        (:mod:`charon.core.admission`)."""
        if body is None:
            return lambda b: self.function(b, timeout=timeout, public=public, limit=limit)
        fn: Function[P, R] = Function(self, body, timeout=timeout, public=public, limit=limit)
        if fn.name in self.functions:
            raise ValueError(f"{self.name}.{fn.name} is defined twice")
        self.functions[fn.name] = fn
        return fn

    def __repr__(self) -> str:
        return f"<charon operator {self.name}>"


class Application:
    """A deployable set of operators, and what it exposes to (and uses of) other applications.

    ``portals``: request/reply entry points other applications may ``ctx.ask``: portal name ->
    ``(operator, function)`` of this application. ``streams``: output streams other applications may be
    wired to. ``uses``: what this application reaches in others, as ``"app.portal"`` / ``"app.stream"``
    (checked by :class:`charon.runtime.deployment.Deployment`; ``ctx.ask`` refuses anything else).
    """

    def __init__(
        self, name: str, operators: Iterable[Operator], *, portals: Mapping[str, tuple[str, str]] | None = None,
        streams: Iterable[str] = (), uses: Iterable[str] = (),
        effects: Mapping[str, Callable[..., Any]] | None = None, workflows: Iterable[Operator] = (),
    ) -> None:
        self.name = name
        self.operators: dict[str, Operator] = {}
        # (names or this application's own objects) -> function
        self._resolved: dict[tuple[str | Operator, str | Function[..., object]], Function[..., object]] = {}
        #: the workflows (``charon.Workflow``, each an operator of its own: ``charon.workflow.<name>``), by name
        self.workflows: dict[str, Operator] = {}
        for wf in workflows:
            wname = getattr(wf, "workflow", None)
            if not isinstance(wname, str) or wf.name != WORKFLOW_OPERATOR_PREFIX + wname:
                raise TypeError(f"workflows= takes charon.Workflow objects, got {wf!r}")
            if wname in self.workflows:
                raise ValueError(f"workflow {wname!r} is registered twice")
            check = getattr(wf, "check_declared", None)  # its declared migrations map to steps it has
            if callable(check):
                check()
            self.workflows[wname] = wf
        for op in [*operators, *self.workflows.values()]:
            if op.name in self.operators:
                raise ValueError(f"operator {op.name!r} is registered twice")
            if op.name.startswith(WORKFLOW_OPERATOR_PREFIX) and op.name[len(WORKFLOW_OPERATOR_PREFIX):] not in \
                    self.workflows:
                raise ValueError(f"operator name {op.name!r} is reserved (workflows: Application(workflows=[...]))")
            if op.name in _BUILTINS:
                raise ValueError(f"operator name {op.name!r} is reserved (a built-in operator)")
            self.operators[op.name] = op
        self.portals: dict[str, tuple[str, str]] = {}
        for pname, (op_name, fn_name) in (portals or {}).items():
            check_stream(pname)  # URL-safe, no '/'
            self.resolve(op_name, fn_name)  # the target exists
            self.portals[pname] = (op_name, fn_name)
        self.streams: frozenset[str] = frozenset(streams)
        self.uses: frozenset[str] = frozenset(uses)
        #: effect handlers (name -> sync or async callable ``handler(idempotency_key, *args)``), registered by the
        #: deployment's code (``effects=`` or :meth:`effect_handler`), never by a client; see ``ctx.effect``
        self.effects: dict[str, Callable[..., Any]] = {}
        for hname, handler in (effects or {}).items():
            self.effect_handler(hname)(handler)
        #: schedules declared in code (:meth:`schedule`): name -> spec (see :mod:`charon.core.schedules`)
        self.schedules: dict[str, dict[str, Any]] = {}
        for u in self.uses:
            if not isinstance(u, str) or u.count(".") < 1 or not all(u.split(".", 1)):
                raise ValueError(f"uses entries are 'app.portal' or 'app.stream', got {u!r}")
        self._limits: dict[str, Limit] = {}

    def limit(self, target: str, limit: Limit) -> None:
        """Declare an admission limit on ``target``: an operator (``"account"``) or one of its functions
        (``"account/withdraw"``, as ``@op.function(limit=...)``); see :mod:`charon.core.admission`."""
        check_target(target)
        if not isinstance(limit, Limit):
            raise TypeError("limit must be a charon.Limit")
        self._limits[target] = limit

    @property
    def limits(self) -> dict[str, Limit]:
        """The admission limits the code declares, by target (``operator`` or ``operator/function``)."""
        out = {f"{op.name}/{fn.name}": fn.limit for op in self.operators.values() for fn in op.functions.values()
               if fn.limit is not None}
        out.update(self._limits)
        return out

    def effect_handler(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering ``handler(idempotency_key, *args)`` (sync or async; I/O allowed) as the effect
        handler ``name`` (``ctx.effect(name, ...)``; run by an effect executor, :mod:`charon.runtime.effects`)."""
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,100}", name):
            raise ValueError(f"an effect handler name is 1-100 characters of A-Z a-z 0-9 _ . : -, got {name!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", self.name):  # effect ids (idempotency keys) carry it
            raise ValueError(f"an application with effects needs a name of 1-60 characters of A-Z a-z 0-9 _ -, "
                             f"got {self.name!r}")

        def register(handler: Callable[..., Any]) -> Callable[..., Any]:
            if not callable(handler):
                raise TypeError(f"effect handler {name!r} is not callable")
            if name in self.effects:
                raise ValueError(f"effect handler {name!r} is registered twice")
            self.effects[name] = handler
            return handler

        return register

    def schedule(self, expr: str, *, key: str, name: str | None = None, args: Iterable[object] = (),
                 catch_up: int = 0) -> Callable[[Function[P, R]], Function[P, R]]:
        """Decorator declaring a schedule in code: ``@app.schedule("*/5 * * * *", key="main")`` over an operator's
        function ``f(ctx, firing, *args)`` runs it on entity ``key`` at every slot of the cron expression (5
        fields, or 6 with seconds first; UTC), each slot once (:mod:`charon.core.schedules`). ``name`` (default:
        ``operator.function``) names it for the schedule routes and CLI; ``catch_up``: how many slots missed while
        the engine was down also fire (0..100; the slot due now always fires). Upserted at every engine start."""

        def declare(fn: Function[P, R]) -> Function[P, R]:
            if not isinstance(fn, Function):
                raise TypeError("@app.schedule goes above @operator.function (it schedules an operator's function)")
            sname = fn.qualname if name is None else name
            if sname in self.schedules:
                raise ValueError(f"schedule {sname!r} is declared twice")
            try:
                self.schedules[sname] = schedule_spec(self, sname, expr, fn.operator.name, key, fn.name,
                                                      list(args), catch_up)
            except (BadArguments, InvalidKey, UnknownOperator, UnknownFunction, ValueTooLarge) as exc:
                raise ValueError(f"schedule {sname!r}: {exc}") from None
            return fn

        return declare

    def resolve(self, operator: str | Operator, function: str | Function[..., object]) -> Function[..., object]:
        """The function object for (operator, function) names; raises UnknownOperator/UnknownFunction."""
        try:
            fn = self._resolved.get((operator, function))  # names, or this application's own objects
        except TypeError:  # unhashable: not a name (typed below)
            fn = None
        if fn is not None:
            return fn
        op_name = operator.name if isinstance(operator, Operator) else operator
        if type(op_name) is not str:
            raise UnknownOperator(f"an operator is named by a string or an Operator, got {type(operator).__name__}")
        if not isinstance(function, (str, Function)):
            raise UnknownFunction(f"a function is named by a string or a Function, got {type(function).__name__}")
        op = self.operators.get(op_name)
        if op is None:
            op = _BUILTINS.get(op_name)  # every application runs client atomic batches, promises, schedules
        if op is None:
            raise UnknownOperator(f"unknown operator {op_name!r} (have: {', '.join(sorted(self.operators))})")
        fn_name = function.name if isinstance(function, Function) else function
        fn = op.functions.get(fn_name)
        if fn is None:
            raise UnknownFunction(
                f"operator {op_name!r} has no function {fn_name!r} (have: {', '.join(sorted(op.functions))})"
            )
        self._resolved[(op_name, fn_name)] = fn
        if (op is operator or type(operator) is str) and (fn is function or type(function) is str):
            self._resolved[(operator, function)] = fn  # the app's own objects only: the cache stays bounded
        return fn

    def validate(
        self, operator: str | Operator, function: str | Function[..., object], args: list | tuple, key: object = None,
        *, public_only: bool = False,
    ) -> Function[..., object]:
        """Check a request before it enters the log: names exist, the key is valid and arguments fit.

        ``key`` is checked with :func:`charon.core.routing.check_key` unless it is ``None``. ``public_only``: the
        function must be public (:meth:`exposed`; the gateway's check of a client's call).
        """
        if not isinstance(args, list | tuple):
            raise BadArguments("args must be a list")
        if public_only and type(operator) is str and type(function) is str:
            fn = self.exposed(operator, function)
        else:
            fn = self.resolve(operator, function)
        if key is not None:
            check_key(key)
        fn.check_args(args)
        return fn

    def public_functions(self) -> dict[str, list[str]]:
        """``{operator: [function, ...]}`` of the functions clients may invoke over HTTP (``public=True``), in name
        order; operators without one are left out."""
        out = {name: sorted(f for f, fn in op.functions.items() if fn.public) for name, op in self.operators.items()}
        return {name: fns for name, fns in sorted(out.items()) if fns}

    def exposed(self, operator: str, function: str) -> Function[..., object]:
        """The function a client names over HTTP, if it is public (or the built-in batch); otherwise
        UnknownOperator/UnknownFunction exactly as for a name that does not exist, naming only the public
        functions (an internal function is not told from a missing one)."""
        try:
            fn = self.resolve(operator, function)
        except (UnknownOperator, UnknownFunction):
            if type(operator) is not str or type(function) is not str:
                raise
            fn = None
        if fn is not None and fn.public:
            return fn
        public = self.public_functions()
        if operator not in public and operator != BATCH_OPERATOR:
            raise UnknownOperator(f"unknown operator {operator!r} (have: {', '.join(public)})")
        have = public.get(operator) or sorted(_batch_operator.functions)
        raise UnknownFunction(f"operator {operator!r} has no function {function!r} (have: {', '.join(have)})")

    def describe(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """Operators, their functions and parameters (for OpenAPI and the CLI)."""
        return {
            name: {fname: fn.signature() for fname, fn in op.functions.items()}
            for name, op in self.operators.items()
        }


#: the operator name prefix of workflows (``charon.core.workflows``; an operator of its own per workflow)
WORKFLOW_OPERATOR_PREFIX = "charon.workflow."


# -- client atomic batches (S-Store) -------------------------------------------------------------------------
#: The built-in operator every application has: a batch is one transaction whose root calls each invocation.
BATCH_OPERATOR = "charon.batch"
BATCH_FUNCTION = "run"
MAX_BATCH_CALLS = 1000  # invocations in one batch (the gateway's default bound)
_batch_operator = Operator(BATCH_OPERATOR)
#: the built-in operators every application has (by name; their functions are internal but the batch's ``run``)
_BUILTINS: dict[str, Operator] = {BATCH_OPERATOR: _batch_operator}


def register_builtin(op: Operator) -> None:
    """Make ``op`` an operator of every application (``charon.core.promises``, ``charon.core.schedules``)."""
    if _BUILTINS.setdefault(op.name, op) is not op:
        raise ValueError(f"built-in operator {op.name!r} is registered twice")


def check_batch(calls: object, max_calls: int = MAX_BATCH_CALLS) -> list[list]:
    """``calls`` as ``[[operator, key, function, args], ...]`` (1..``max_calls`` of them); BadArguments otherwise."""
    if not isinstance(calls, list | tuple) or not 1 <= len(calls) <= max_calls:
        raise BadArguments(f"a batch is a list of 1..{max_calls} calls")
    out = []
    for i, c in enumerate(calls):
        if (not isinstance(c, list | tuple) or len(c) != 4 or not all(type(x) is str for x in c[:3])
                or not isinstance(c[3], list | tuple)):
            raise BadArguments(f"batch call {i} must be [operator, key, function, [args...]]")
        out.append([c[0], c[1], c[2], list(c[3])])
    return out


@_batch_operator.function(public=True)  # its calls are checked one by one (the gateway: public ones only)
async def run(ctx: Any, calls: list) -> list:
    """Run a client's atomic batch: each call in order, each seeing the writes of the ones before it, all
    in this one transaction (so all commit or none: any call that raises aborts the batch)."""
    out = []
    for op, key, fn, args in check_batch(calls, len(calls) or 1):
        out.append(await ctx.call(op, key, fn, *args))
    return out


def batch_request(calls: Iterable[Any]) -> tuple[str, str, list]:
    """(operator, function, args) of the transaction that runs ``calls`` as one atomic batch; its key and
    request id are the batch id."""
    return BATCH_OPERATOR, BATCH_FUNCTION, [check_batch(list(calls), 1 << 30)]
