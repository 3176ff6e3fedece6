"""Interrupts that land only in user code.

The watchdog (:mod:`charon.runtime.guard.watchdog`) stops a function past its budget by raising
:class:`~charon.core.partition.Interrupt` into the engine thread (``PyThreadState_SetAsyncExc``). An asynchronous
exception fires at the target thread's next *eval-breaker check*, which may be anywhere: in the engine's own code
(where it would escape the step) or in a library holding a lock (``logging.Handler.handle`` acquires before its
``try``: the lock would never be released). So it is delivered only when it is known to land in user code:

* **Where the thread is.** The engine thread's top frame and every frame below it, down to the engine frame that
  drives the step (a *driver*: ``PartitionUnit._run``, ``_replay_cached``, ``_user_str``), must be the
  application's code (:class:`UserCode`: not Charon's engine, the standard library or an installed package, unless
  it is the application's own package). The exception then fires in that top frame (the thread is paused at a
  check there, or in a C call whose return is followed by one) or at the first instruction of a function it calls
  (a ``RESUME`` check, before that function did anything), and unwinds through user frames into the driver.
* **Nothing moves between the look and the delivery.** The engine thread can only run when this thread passes an
  eval-breaker check (or releases the GIL). :func:`_window` reads the engine thread's top frame through a property
  whose getter is the C function ``PyThreadState_GetFrame`` (a ``LOAD_ATTR``: no check, no audit event), walks the
  frames with attribute loads, ``is`` and ``in`` on frozensets only (an unrolled walk: no backward jump), and sets
  the exception with one C call (ctypes' ``PyDLL``: the GIL stays held; the check after a call comes once it
  returned). The collector is off meanwhile (a collection could run a finalizer, that is Python code). So the look
  and the delivery are one indivisible step for the engine thread, on CPython 3.11 to 3.13.

A frame stack deeper than :data:`DEPTH` between the top and the driver, or any frame that is not user code, defers
the interrupt to the next sample (the function is still reported stuck, and given up on where configured).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable
from types import CodeType, FrameType
from typing import Any

_CHARON = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the charon package's directory
DEPTH = 96  # frames between the top one and the driver that the delivery walks at most

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.py_object]
_set_async_exc.restype = ctypes.c_int
# the same C function, for clearing (exc NULL): its own prototype, as argtypes belong to a function object
_clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))
_get_tstate = ctypes.pythonapi.PyThreadState_Get
_get_tstate.argtypes = []
_get_tstate.restype = ctypes.c_void_p
_get_frame = ctypes.pythonapi.PyThreadState_GetFrame
_get_frame.argtypes = [ctypes.c_void_p]
_get_frame.restype = ctypes.py_object


class ThreadHandle:
    """A thread's interpreter state, captured by the thread itself (:meth:`attach`), cleared by it before it
    leaves (:meth:`detach`): ``frame`` is its top frame, read without running any Python code."""

    __slots__ = ("_as_parameter_", "ident")

    def __init__(self) -> None:
        self._as_parameter_ = 0  # the PyThreadState* (what ctypes passes for this object); 0: no thread
        self.ident = 0

    frame = property(_get_frame)  # PyThreadState_GetFrame(self): a C getter (see the module docstring)

    def attach(self) -> None:
        """In the thread: it is the one to interrupt from now on."""
        self.ident = threading.get_ident()
        self._as_parameter_ = _get_tstate()

    def detach(self) -> None:
        """In the thread, before it leaves the engine: nothing to interrupt."""
        self._as_parameter_ = 0
        self.ident = 0


def clear_pending() -> None:
    """Drop an asynchronous exception set for the calling thread and not raised yet (a step that ended first)."""
    _clear_async_exc(threading.get_ident(), None)


# -- which code is the application's --------------------------------------------------------------------------------
@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {_CHARON}
    for k in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(k):
            roots.add(os.path.abspath(paths[k]))
    roots.update(os.path.abspath(p) for p in sys.path if "site-packages" in p or "dist-packages" in p)
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots))


class UserCode:
    """Classifies source files: the application's (``True``) or the engine's, the standard library's and
    installed packages' (``False``). Files under ``app_roots`` (the application's own packages, wherever they are
    installed) are always the application's; Charon's bundled example apps (``charon/apps``) count as applications."""

    def __init__(self, app_roots: Iterable[str] = ()) -> None:
        self.library = _library_roots()
        apps = os.path.join(_CHARON, "apps") + os.sep
        self.apps = (apps, *(os.path.abspath(r).rstrip(os.sep) + os.sep for r in app_roots))
        self._known: dict[str, bool] = {}
        self.files: frozenset[str] = frozenset()

    def is_user(self, filename: str) -> bool:
        v = self._known.get(filename)
        if v is None:
            if filename.startswith("<"):
                v = not filename.startswith("<frozen")  # exec'd application code (tests, notebooks)
            else:
                path = os.path.abspath(filename)
                v = path.startswith(self.apps) or not path.startswith(self.library)
            self._known[filename] = v
            if v:
                self.files = self.files | {filename}
        return v

    def learn(self, top: ThreadHandle) -> None:
        """Classify the files of the frames of ``top``'s thread, from its top frame down (before a delivery is
        tried: see :func:`deliver`). The frames are read in one indivisible step (:func:`_files_of`): walking
        another thread's frames while it runs can crash CPython 3.11 (a frame popped or a coroutine suspended
        between two ``f_back`` reads), so no frame of it is held across an eval-breaker check."""
        for name in _files_of(top):
            self.is_user(name)


def app_roots(functions: Iterable[Callable[..., Any]]) -> list[str]:
    """The directories of the applications' own packages (their top-level package; a module's own directory for
    Charon's bundled apps)."""
    out: set[str] = set()
    for fn in functions:
        mod = sys.modules.get(getattr(fn, "__module__", "") or "")
        path = getattr(mod, "__file__", None)
        if not path:
            continue
        name = mod.__name__ if mod is not None else ""
        top = sys.modules.get(name.split(".")[0])
        top_file = getattr(top, "__file__", None)
        if name.split(".")[0] == "charon" or not top_file or top is mod:
            out.add(os.path.dirname(os.path.abspath(path)))
        else:
            out.add(os.path.dirname(os.path.abspath(top_file)))
    return sorted(out)


# -- the indivisible look-and-deliver ------------------------------------------------------------------------------
def _make_window(depth: int) -> Callable[..., int]:
    """``window(top, files, drivers, unit, frame, exc, set_exc) -> int``: 0 the judged step is over (nothing
    done), 1 the interrupt was set, 2 it was deferred (the thread is not in user code now). Straight-line code:
    see the module docstring."""
    src = [
        "def window(top, files, drivers, unit, frame, exc, set_exc):",
        "    if unit.current is not frame or unit.doomed is not frame:",
        "        return 0",
        "    if not top._as_parameter_:",
        "        return 2",
        "    try:",
        "        f = top.frame",
        "    except ValueError:",
        "        return 0",
        "    c = f.f_code",
        "    st = 2 if c in drivers or c.co_filename not in files else 0",
    ]
    for _ in range(depth):
        src += [
            "    if st == 0:",
            "        f = f.f_back",
            "        if f is None:",
            "            st = 2",
            "        else:",
            "            c = f.f_code",
            "            if c in drivers:",
            "                st = 1",
            "            elif c.co_filename not in files:",
            "                st = 2",
        ]
    src += [
        "    if st != 1 or unit.current is not frame:",
        "        return 2",
        "    set_exc(top.ident, exc)",
        "    return 1",
    ]
    ns: dict[str, Any] = {}
    exec(compile("\n".join(src), "<charon.interrupts.window>", "exec"), ns)  # noqa: S102 - our own generated code
    return ns["window"]


_window = _make_window(DEPTH)
NOT_RUNNING, DELIVERED, DEFERRED = 0, 1, 2


def _make_files_of(depth: int) -> Callable[[ThreadHandle], tuple[str, ...]]:
    """``files_of(top) -> tuple``: the source files of the top ``depth + 1`` frames of ``top``'s thread, read
    with attribute loads and tuple concatenation only (no call, no backward jump: no eval-breaker check, so the
    thread does not move meanwhile; the caller keeps the collector off)."""
    src = [
        "def files_of(top):",
        "    if not top._as_parameter_:",
        "        return ()",
        "    try:",
        "        f = top.frame",
        "    except ValueError:",
        "        return ()",
        "    names = (f.f_code.co_filename,)",
    ]
    for _ in range(depth):
        src += [
            "    if f is not None:",
            "        f = f.f_back",
            "        if f is not None:",
            "            names = names + (f.f_code.co_filename,)",
        ]
    src.append("    return names")
    ns: dict[str, Any] = {}
    exec(compile("\n".join(src), "<charon.interrupts.files_of>", "exec"), ns)  # noqa: S102 - our own generated code
    return ns["files_of"]


_files_of_unguarded = _make_files_of(DEPTH)


def _files_of(top: ThreadHandle) -> tuple[str, ...]:
    enabled = gc.isenabled()
    gc.disable()  # a collection could run a finalizer (Python code: a check) in the middle of the walk
    try:
        return _files_of_unguarded(top)
    finally:
        if enabled:
            gc.enable()


def deliver(top: ThreadHandle, user: UserCode, drivers: frozenset[CodeType], unit: Any, frame: Any,
            exc: type[BaseException]) -> int:
    """Raise ``exc`` in the thread of ``top`` if it still runs ``frame``'s judged step (``unit.current is frame
    and unit.doomed is frame``) in user code: :data:`DELIVERED`, :data:`DEFERRED` (not in user code now: a later
    look tries again) or :data:`NOT_RUNNING` (the step is over)."""
    user.learn(top)
    files = user.files
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _window(top, files, drivers, unit, frame, exc, _set_async_exc)
    finally:
        if enabled:
            gc.enable()


def _make_doom() -> Callable[[Any, Any], int]:
    ns: dict[str, Any] = {}
    exec(compile("def doom(unit, frame):\n"  # noqa: S102 - our own generated code: no check between look and set
                 "    if unit.current is not frame:\n"
                 "        return 0\n"
                 "    unit.doomed = frame\n"
                 "    return 2 if unit.fast_layer is not None else 1\n", "<charon.interrupts.doom>", "exec"), ns)
    return ns["doom"]


#: ``doom(unit, frame) -> int``: mark ``frame``'s step if it still runs (``unit.doomed = frame`` while it is
#: ``unit.current``: one look, no eval-breaker check in between): :data:`JUDGED` (a step whose outcome is now the
#: verdict), :data:`FAST` (a step of the cached fallback's fast path: judged as well, its transaction leaves the
#: fallback in that round), or 0 (the step is over: nothing done)
doom = _make_doom()
JUDGED, FAST = 1, 2


def user_frame_chain(top: FrameType | None, user: UserCode, drivers: frozenset[CodeType]) -> bool:
    """Whether ``top`` and the frames below it down to a driver are all user code (for a caller running *in* the
    thread, such as a signal handler: nothing moves meanwhile, a plain walk will do)."""
    f, n = top, 0
    if f is None or f.f_code in drivers:
        return False
    while f is not None and n <= DEPTH:
        c = f.f_code
        if c in drivers:
            return True
        if not user.is_user(c.co_filename):
            return False
        f, n = f.f_back, n + 1
    return False
