"""What the controllable engines share: pause/resume/status over their epoch gate and the admin lock
(:class:`GatedControls`), the contract's calls they answer alike by asking their runtime (:class:`HostedEngine`),
and the runtime-side face of those controls (:class:`EngineBacked`)."""

from __future__ import annotations

import abc
import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from charon import serde
from charon.messages import Reply
from charon.operator import Application
from charon.runtime.contract import Controls, ControlStatus, Engine, RequestLog
from charon.runtime.control.codeversions import CodeHistory
from charon.runtime.control.gate import EpochGate
from charon.runtime.guard.verdicts import VerdictBook

if TYPE_CHECKING:
    from charon.core.timers import Timer
    from charon.log.streams import StreamLog

__all__ = ["EngineBacked", "GatedControls", "Hosted", "HostedEngine"]


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


class Hosted(Protocol):
    """What an engine asks of the runtime it faces, on every engine (the rest is each engine's own)."""

    app: Application
    epoch_stats: list[dict[str, float]]
    verdict_book: VerdictBook
    inspector: RequestLog

    @property
    def input_log(self) -> Any: ...

    @property
    def streams(self) -> StreamLog: ...

    async def submit(self, operator: str, key: str, function: str, args: list[Any], *,
                     request_id: str | None = None) -> Reply: ...

    def get_reply(self, request_id: str) -> Reply | None: ...

    def read_state(self, operator: str, key: str, default: Any = None) -> Any: ...

    def timers(self, operator: str, key: str) -> list[Timer]: ...

    def load(self, operator: str, values: dict[str, Any]) -> Any: ...

    def close(self) -> None: ...


class HostedEngine(Engine, GatedControls):
    """The contract's calls every controllable engine answers alike, by asking its runtime (``rt``)."""

    rt: Hosted
    code: CodeHistory

    @property
    def app(self) -> Application:
        return self.rt.app

    @property
    def input_log(self) -> Any:
        return self.rt.input_log

    @property
    def streams(self) -> StreamLog | None:
        return self.rt.streams

    @property
    def controls(self) -> Controls:
        return self

    def close(self) -> None:
        self.rt.close()

    async def submit(self, operator: str, key: str, function: str, args: list[Any], *,
                     request_id: str | None = None) -> Reply:
        return await self.rt.submit(operator, key, function, args, request_id=request_id)

    def get_reply(self, request_id: str) -> Reply | None:
        return self.rt.get_reply(request_id)

    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        return self.rt.read_state(operator, key, default)

    def timers(self, operator: str, key: str) -> list[Timer]:
        return self.rt.timers(operator, key)

    def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        return self.rt.verdict_book.dead_letters(limit)

    def version_at(self, epoch: int, tid: int | None = None) -> str:
        return self.code.label(epoch, tid)

    def epoch_stats(self) -> list[dict[str, float]]:
        return self.rt.epoch_stats

    def code_versions(self) -> list[dict[str, str | int | None]]:
        return [{"from_epoch": v.from_epoch, "version": v.version, "ref": v.ref,
                 "migration": None if v.migration is None else f"{v.migration[1]}.{v.migration[2]}",
                 "unloaded_at": v.unloaded_at}
                for v in self.code.versions]

    @property
    def requests(self) -> RequestLog:
        return self.rt.inspector

    def load(self, operator: str, values: dict[str, Any]) -> None:
        self.rt.load(operator, values)


class EngineBacked:
    """The runtime-side face of its engine's controls (a runtime's own Python API: dict documents, list args)."""

    controller: HostedEngine

    def pause(self, after_epoch: int | None = None) -> dict[str, Any]:
        """Start no epoch (after ``after_epoch``, if given) until :meth:`resume`; the status document."""
        return self.controller.pause_now(after_epoch).doc()

    def resume(self) -> dict[str, Any]:
        """Let epochs start again (the waiting requests run in arrival order); the status document."""
        return self.controller.resume_now().doc()

    def control_status(self) -> dict[str, Any]:
        """The control status document (:class:`charon.runtime.contract.ControlStatus`); blocking on Spark."""
        return self.controller.status_now().doc()

    async def run_alone(
        self, update_id: str, operator: str, function: str, args: list[Any] | tuple[Any, ...] = (),
        keys: list[str] | None = None,
    ) -> dict[str, Any]:
        """A serializable admin update: ``function`` on every key (default: every entity of ``operator``), alone
        at an epoch boundary, once per ``update_id`` (the engine's ``run_alone``)."""
        out = await self.controller.run_alone(update_id, operator, function, serde.encode(list(args)), keys)
        return out.doc()

    async def update_code(
        self, ref: str, version: str, migration: tuple[str, str, list[Any] | tuple[Any, ...]] | None = None,
        mode: str = "strict",
    ) -> dict[str, Any]:
        """Code update to ``ref`` (``module:attribute``) at one epoch boundary (the engine's ``update_code``;
        :class:`~charon.errors.VersionInUse` if it would drop the code of a version with workflows in flight)."""
        mig = None if migration is None else (migration[0], migration[1], serde.encode(list(migration[2])))
        return (await self.controller.update_code(ref, version, mig, mode)).doc()

    def version_at(self, epoch: int, tid: int | None = None) -> str:
        """The code version epoch ``epoch`` ran with (with ``tid``: the one that transaction ran with)."""
        return self.controller.version_at(epoch, tid)
