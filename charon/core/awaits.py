"""What a function may await (only ``ctx.call``), enforced at the await itself; and, under the determinism check,
blocking I/O found at the call that does it.

**Foreign awaits.** A function's coroutine is driven by the engine, not by an event loop: awaiting an asyncio sleep
or future, an async HTTP client (httpx, aiohttp), anyio or anything else that needs a loop would fail inside the
library with an unrelated error (``RuntimeError: no running event loop``, sniffio's ``AsyncLibraryNotFoundError``, a
``TypeError`` from anyio), which the function might even catch. While a round of a partition runs functions
(``PartitionUnit._process``, the fast round; the oracle's ``_drive``), :data:`GUARD` is the thread's *running event
loop* and its *current task*: any library that looks for a loop or a task gets the guard, and the guard's first
attribute used (``create_future``, ``call_later``, ``get_debug``...) raises :class:`~charon.errors.IllegalAwait`
pointing at ``ctx.effect`` and notes it for the thread (:data:`TRIPS`): the engine aborts the transaction with
``IllegalAwait`` even if the function caught it. The cost: asyncio's ``_set_running_loop`` twice per round (each a
``getpid``: about 0.7 us on a sandboxed machine, so not per step) and, per step, one test of a module global (``if
TRIPS``: ~15 ns; see ``PartitionUnit._run``). The round's engine code around the steps never asks asyncio for a
loop.

**Blocking I/O** (sockets, files, subprocesses) does not go through a loop; it is found only by the determinism
check (:mod:`charon.core.determinism`): an audit hook (:func:`sys.addaudithook`, installed once when the check first
runs in a process, never removed) is gated by a thread-local flag the check sets around its runs of a step, by
:data:`GUARD` being the running loop, and by a walk up the stack (the function's own coroutine comes before the
engine's driver of the step, :data:`DRIVERS`, and before the engine's or the interpreter's own I/O: imports, source
lines of a traceback, finalizers the garbage collector runs); a gated event raises
:class:`~charon.errors.NonDeterministicFunction` naming the operation, and is noted like a foreign await so that
catching it changes nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
from asyncio import events, tasks
from collections.abc import Callable
from typing import Any

from charon.errors import IllegalAwait, NonDeterministicFunction

__all__ = ["GUARD", "TRIPS", "enter", "leave", "tripped", "trip_error", "raise_tripped", "illegal_await",
           "foreign_await", "described", "checking", "install_audit_hook", "EFFECT_HINT"]

#: asyncio's per-thread running loop (the C functions: the hot path calls them directly)
get_running_loop: Callable[[], object] = events._get_running_loop
set_running_loop: Callable[[Any], None] = events._set_running_loop

EFFECT_HINT = ("a function cannot wait on I/O or time: do I/O with ctx.effect(handler, ..., then=...), which runs "
               "the handler after the transaction commits and resumes the entity with its result; call other "
               "functions with ctx.call")

#: the trips noted per thread (thread id -> (the error's type, what was done)); the engine tests it is empty
#: after each step, so it must stay empty but for a step that tripped
TRIPS: dict[int, tuple[type[Exception], str]] = {}
_ident = threading.get_ident


class _Guard:
    """The running loop and current task of a thread while a function's step runs: any use is a foreign await."""

    __slots__ = ("__weakref__",)  # anyio keeps its tasks' state in a WeakKeyDictionary

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        what = f"an asyncio, anyio or async I/O operation, which needs an event loop (it used {name})"
        TRIPS[_ident()] = (IllegalAwait, what)
        raise IllegalAwait(f"a function awaited something other than ctx.call: {what}; {EFFECT_HINT}")

    def __repr__(self) -> str:
        return "<charon: no event loop in a function>"


GUARD = _Guard()


def _register_task() -> None:
    """Make ``asyncio.current_task()`` answer the guard while it is the running loop (sniffio then says
    "asyncio", and anyio reaches the loop instead of failing on a missing task)."""
    current = getattr(tasks, "_current_tasks", None)
    if isinstance(current, dict):
        current[GUARD] = GUARD


_register_task()


def enter() -> object:
    """Make the guard the running loop (before a step): returns what to give :func:`leave`."""
    prev = get_running_loop()
    set_running_loop(GUARD)
    return prev


def leave(prev: object) -> None:
    set_running_loop(prev)


def tripped() -> tuple[type[Exception], str] | None:
    """This thread's trip during the step that just ran (and forget it)."""
    return TRIPS.pop(_ident(), None) if TRIPS else None


def trip_error(frame: Any, cls: type[Exception], what: str) -> Exception:
    """The typed error of a step of ``frame`` (an invocation: ``op``, ``fn``, ``key``) that tripped."""
    if cls is IllegalAwait:
        return illegal_await(frame.op, frame.fn, what)
    return cls(f"{frame.op}.{frame.fn} on key {frame.key!r} did {what} in a function step (found by the "
               f"determinism check): its result may differ on a replay; {EFFECT_HINT}")


def raise_tripped(frame: Any) -> None:
    """Raise the typed error of this thread's trip (called when :data:`TRIPS` is not empty after a step)."""
    trip = tripped()
    if trip is not None:
        raise trip_error(frame, *trip)


def illegal_await(op: str, fn: str, what: str) -> IllegalAwait:
    return IllegalAwait(f"{op}.{fn} awaited something other than ctx.call ({what}); {EFFECT_HINT}")


def described(yielded: object) -> str:
    """What a coroutine that yielded ``yielded`` to the engine (instead of a ``ctx.call``) awaited."""
    if yielded is None:
        return "a bare yield to the event loop, as asyncio.sleep(0) does"
    if isinstance(yielded, asyncio.Future):
        return f"an asyncio {type(yielded).__name__}"
    return f"a {type(yielded).__module__}.{type(yielded).__qualname__}"


def foreign_await(op: str, fn: str, yielded: object) -> IllegalAwait:
    """The error of a step of ``op.fn`` that yielded ``yielded`` to the engine instead of a ``ctx.call``."""
    return illegal_await(op, fn, described(yielded))


# -- blocking I/O under the determinism check --------------------------------------------------------------------

#: audit events that are blocking I/O when a function's own code raises them (``time.sleep`` is not: a slow
#: function is the watchdog's, see ``--function-timeout``)
BLOCKING = frozenset({
    "open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.truncate",
    "shutil.copyfile", "shutil.rmtree", "shutil.move",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "http.client.connect", "urllib.Request",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.startfile",
    "sqlite3.connect",
})

_checking = threading.local()
_installed = False
_install_lock = threading.Lock()


class checking:  # noqa: N801 - used as a statement: with checking(): ...
    """The determinism check's runs of a step (``with checking():``): the audit hook reports blocking I/O."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = getattr(_checking, "on", False)
        _checking.on = True

    def __exit__(self, *exc: object) -> None:
        _checking.on = self.prev


#: files whose I/O is the interpreter's, not the function's: the import system (a module imported for the first
#: time in a function), the source lines a warning or a traceback shows, and finalizers the garbage collector
#: runs while the step happens to run (``weakref.finalize``, ``__del__``: another object's cleanup)
_BENIGN = ("linecache.py", "tokenize.py", "traceback.py", "warnings.py", "weakref.py")


_CHARON = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: the code of the engine's drivers of a function's steps (``PartitionUnit._run``, the oracle's): the walk up the
#: stack from an event stops there
DRIVERS: set[Any] = set()


def _functions_own() -> bool:
    """Whether the event was raised by a function's own code: walking up the stack, a coroutine outside the
    engine comes before the engine's driver of the step (:data:`DRIVERS`: engine code around the step, such as
    the watchdog recording a verdict, is not the function's), before the engine's own code (a state read under
    ``ctx.get``), and before the interpreter's own I/O (:data:`_BENIGN`)."""
    f: Any = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code in DRIVERS:
            return False
        name = code.co_filename
        if name.startswith(_CHARON) or name.startswith("<frozen importlib") or name.endswith(_BENIGN) \
                or code.co_name == "__del__":
            return False
        if code.co_flags & inspect.CO_COROUTINE:
            return True
        f = f.f_back
    return False


def _describe(event: str, args: tuple[Any, ...]) -> str:
    if event == "open" and args:
        return f"open({args[0]!r}, {args[1]!r})" if len(args) > 1 and args[1] is not None else f"open({args[0]!r})"
    if event in ("socket.connect", "socket.sendto", "socket.bind") and len(args) > 1:
        return f"{event} to {args[1]!r}" if event != "socket.bind" else f"{event} on {args[1]!r}"
    if event in ("socket.getaddrinfo", "socket.gethostbyname") and args:
        return f"{event}({args[0]!r})"
    if event == "subprocess.Popen" and len(args) > 1:
        return f"subprocess.Popen({args[1]!r})"
    return event


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in BLOCKING or not getattr(_checking, "on", False) or get_running_loop() is not GUARD:
        return
    if not _functions_own():
        return
    what = f"blocking I/O ({_describe(event, args)})"
    TRIPS[_ident()] = (NonDeterministicFunction, what)
    raise NonDeterministicFunction(f"a function did {what} in its step (the determinism check); {EFFECT_HINT}")


def install_audit_hook() -> None:
    """Install the blocking-I/O audit hook once per process (it cannot be removed: it stays, gated)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True
