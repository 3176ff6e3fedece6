"""Fault injection for the crash and self-healing tests, one module for every runtime.

* ``CHARON_CRASH_AT="<point>:<epoch>"`` SIGKILLs this process when it reaches ``point`` in epoch ``epoch``
  (``<point>:*``: at the first epoch that gets there). The durable node's points are named ``node:<point>``
  (``CHARON_CRASH_AT=node:<point>:<epoch>``); the Spark runtime's are bare.
* ``CHARON_FAULT_AT`` names points (comma-separated) that raise :class:`RuntimeError` in :func:`fault_point`.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator

_intercept: Callable[[str, int], None] | None = None  # the simulator's (see intercepted)


def crash_point(point: str, epoch: int) -> None:
    """SIGKILL this process here if ``CHARON_CRASH_AT`` names this point at ``epoch`` (or at ``*``)."""
    if _intercept is not None:
        _intercept(point, epoch)
        return
    spec = os.environ.get("CHARON_CRASH_AT")
    if spec and spec in (f"{point}:{epoch}", f"{point}:*"):  # "*": at the first epoch that gets there
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def intercepted(hook: Callable[[str, int], None]) -> Iterator[None]:
    """Within the block, every :func:`crash_point` calls ``hook(point, epoch)`` instead (the seeded simulator
    makes concurrent events happen there, and perhaps a crash)."""
    global _intercept
    saved, _intercept = _intercept, hook
    try:
        yield
    finally:
        _intercept = saved


def fault_point(point: str) -> None:
    """Fault injection for the self-healing tests: ``CHARON_FAULT_AT`` names points (comma-separated) that raise
    here; ``session_restart``: starting a new Spark session after the JVM died fails."""
    if point in os.environ.get("CHARON_FAULT_AT", "").split(","):
        raise RuntimeError(f"injected fault at {point} (CHARON_FAULT_AT)")
