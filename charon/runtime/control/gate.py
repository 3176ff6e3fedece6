"""The epoch gate: the one owner of "may the next epoch start?" (pause/resume at an epoch boundary).

A runtime asks it right before an epoch runs (:meth:`EpochGate.enter`, after the epoch's batch is fixed and before
the coordinator runs it) and tells it when the epoch is done (:meth:`EpochGate.leave`). While the gate is closed no
epoch starts; requests keep arriving (on Spark and a durable node they wait in the durable input log).
``pause(after_epoch=N)`` lets epochs up to ``N`` run and closes the gate for every later one; a runtime's own
:meth:`EpochGate.hold` (a rescale's move, a code switch) closes it independently of the user's pause.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from charon.runtime.contract import GateClosed

__all__ = ["EpochGate"]


class EpochGate:
    """Pause/resume at an epoch boundary (thread-safe; the in-process runtime awaits it on its event loop)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paused = False
        self._after: int | None = None
        self._holds = 0  # the runtime's own closings (a rescale's move, a code switch): a resume does not open them
        self._active: int | None = None  # the epoch running now
        self._stopping = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def active(self) -> int | None:
        """The epoch running now (None between epochs)."""
        return self._active

    def closed_for(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` must wait."""
        return self._holds > 0 or self.paused_for(epoch)

    def paused_for(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` must wait for a user's :meth:`resume` (not counting the runtime's holds)."""
        return self._paused or (self._after is not None and epoch > self._after)

    def hold(self) -> None:
        """Close the gate for an operation of the runtime at the next boundary (a rescale's move, a code
        switch) until :meth:`release`, independently of the user's pause: a :meth:`resume` meanwhile does not
        let an epoch run in the middle of it, and the user's pause (or pause-after) is kept after it."""
        with self._cv:
            self._holds += 1
            self._cv.notify_all()

    def release(self) -> None:
        """End one :meth:`hold`; waiting epochs start if nothing else keeps the gate closed."""
        with self._cv:
            self._holds = max(0, self._holds - 1)
            self._cv.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:  # each rechecks (enter_async loops; wake_on_open's owner retries)
            loop.call_soon_threadsafe(ev.set)

    def pause(self, after_epoch: int | None = None) -> None:
        """Close the gate now (``after_epoch`` None) or once epoch ``after_epoch`` is done."""
        with self._cv:
            if after_epoch is None:
                self._paused = True
            else:
                self._after = after_epoch
            self._cv.notify_all()

    def resume(self) -> None:
        """Open the gate: waiting epochs start in order."""
        with self._cv:
            self._paused = False
            self._after = None
            self._cv.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)

    def stopping(self) -> None:
        """The runtime stops: an epoch waiting at the closed gate gives up with :class:`GateClosed`."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def reset(self) -> None:
        """The runtime (re)starts: waiting is possible again (the pause itself is kept)."""
        with self._cv:
            self._stopping = False

    def enter(self, epoch: int, timeout: float | None = None) -> None:
        """Block until epoch ``epoch`` may start, then mark it running (a thread of the runtime calls this)."""
        with self._cv:
            while self.closed_for(epoch):
                if self._stopping:
                    raise GateClosed(f"stopped while epoch {epoch} waited at the paused gate")
                self._cv.wait(timeout)
            self._active = epoch

    def try_enter(self, epoch: int) -> bool:
        """Mark epoch ``epoch`` running if it may start now (checked and marked at once); False if it must wait."""
        with self._cv:
            if self.closed_for(epoch):
                return False
            self._active = epoch
            return True

    async def enter_async(self, epoch: int) -> None:
        """Like :meth:`enter`, awaited on an event loop."""
        while True:
            with self._cv:
                if not self.closed_for(epoch):
                    self._active = epoch
                    return
                ev = asyncio.Event()
                self._waiters.append((asyncio.get_running_loop(), ev))
            await ev.wait()

    def wake_on_open(self, epoch: int, event: asyncio.Event) -> None:
        """Set ``event`` (on the running loop) when epoch ``epoch`` may start; at once if it may already."""
        with self._cv:
            if not self.closed_for(epoch):
                event.set()
                return
            if not any(ev is event for _, ev in self._waiters):
                self._waiters.append((asyncio.get_running_loop(), event))

    def leave(self) -> None:
        """The running epoch is done."""
        with self._cv:
            self._active = None
            self._cv.notify_all()

    def status(self, last_epoch: int) -> dict[str, Any]:
        """``state`` (running, pausing: closed with an epoch still running, paused), the pause settings."""
        with self._cv:
            closed = self.closed_for(last_epoch + 1)
            active = self._active
            state = "running" if not closed else ("pausing" if active is not None else "paused")
            if self._after is not None and not self._paused and not self._holds and last_epoch < self._after:
                state = "running"
            return {"state": state, "paused": state == "paused", "pause_requested": self._paused,
                    "pause_after": self._after, "active_epoch": active}

    def wait_paused(self, last_epoch: Callable[[], int], timeout: float = 60.0) -> bool:
        """Block until no epoch runs and the next one would wait (``last_epoch``: a callable)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._active is None and self.closed_for(last_epoch() + 1), timeout)
