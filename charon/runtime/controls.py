"""What the controllable engines share: pause/resume/status over their epoch gate, and the admin lock."""

from __future__ import annotations

import abc
import asyncio

from charon.runtime.contract import Controls, ControlStatus
from charon.runtime.gate import EpochGate

__all__ = ["GatedControls"]


class GatedControls(Controls):
    """Pause, resume and status over an :class:`EpochGate` (the one owner of "may the next epoch start?").

    A subclass says how its status is read (:meth:`status_now`, blocking where the engine must ask its log)."""

    gate: EpochGate
    #: whether :meth:`status_now` may block (then the async calls run it in a thread)
    status_blocks: bool = False

    def __init__(self) -> None:
        self.admin_lock = asyncio.Lock()  # one admin operation (update, code update) at a time

    @abc.abstractmethod
    def status_now(self) -> ControlStatus:
        """The control state now (any thread)."""

    def pause_now(self, after_epoch: int | None = None) -> ControlStatus:
        self.gate.pause(after_epoch)
        return self.status_now()

    def resume_now(self) -> ControlStatus:
        self.gate.resume()
        return self.status_now()

    async def _answer(self, fn: object, *args: int | None) -> ControlStatus:
        assert callable(fn)
        if self.status_blocks:
            out: ControlStatus = await asyncio.to_thread(fn, *args)
            return out
        out2: ControlStatus = fn(*args)
        return out2

    async def pause(self, after_epoch: int | None = None) -> ControlStatus:
        return await self._answer(self.pause_now, after_epoch)

    async def resume(self) -> ControlStatus:
        return await self._answer(self.resume_now)

    async def status(self) -> ControlStatus:
        return await self._answer(self.status_now)
