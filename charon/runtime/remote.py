"""A gateway's runtime when the engine runs elsewhere: requests go to a networked log, replies come from it.

``charon run MODULE:APP --engine remote --log nats://host:port/deployment`` serves the HTTP gateway on a machine
without Spark: :meth:`LogRuntime.submit` appends to the NATS input log and awaits the reply in the NATS output
log (:class:`~charon.log.client.LogClient`), exactly as the Spark runtime's own gateway does; the Spark driver
(``charon run MODULE:APP --engine spark --log <same URL>``, or any process running :class:`SparkRuntime` with
``log_url``) executes them. Idempotency keys, conflict checks and status polling work from the logs. Entity
state lives with the engine, so ``GET /state`` answers 503 here (ask the driver's gateway).
"""

from __future__ import annotations

from typing import Any, ClassVar

from charon.errors import EngineUnavailable
from charon.log.client import LogClient
from charon.log.location import is_networked, open_input_log, open_output_log
from charon.messages import Reply
from charon.operator import Application
from charon.runtime.contract import Engine
from charon.runtime.probe import LogProbe

__all__ = ["LogRuntime"]


class LogRuntime(Engine):
    """Submit through the logs at ``log_url``; the engine reading them runs in another process or machine.

    An :class:`~charon.runtime.contract.Engine` without controls (admin requests go to the engine's gateway)."""

    kind: ClassVar[str] = "remote"

    def __init__(self, app: Application, log_url: str, health_timeout_s: float = 1.0) -> None:
        if not is_networked(log_url):
            raise ValueError(f"a remote gateway needs a networked log (nats://...), got {log_url!r}")
        self._app = app
        self.log_url = log_url
        self._input_log = open_input_log(log_url)
        self.output_log = open_output_log(log_url)
        self._client: LogClient | None = None
        self._probe = LogProbe(self._input_log, health_timeout_s)

    @property
    def app(self) -> Application:
        return self._app

    @property
    def partitions(self) -> int:
        """1: the engine's partitions are the engine's own (counted there)."""
        return 1

    @property
    def durable(self) -> bool:
        return True

    @property
    def input_log(self) -> Any:
        return self._input_log

    def describe(self) -> str:
        return f"gateway only, the engine runs elsewhere (logs on {self.log_url})"

    async def start(self) -> None:
        """Nothing to start: the engine runs elsewhere."""

    async def stop(self) -> None:
        """Nothing to stop (the logs stay open until :meth:`close`)."""

    def health(self) -> dict[str, Any]:
        """``ok`` while the log answers (the engine's own health is reported by its process); answered within
        ``health_timeout_s`` even when the log server hangs (:class:`~charon.runtime.probe.LogProbe`)."""
        res = self._probe.check()
        if res.error is not None:
            return {"status": "log unavailable", "ok": False, "error": res.error}
        return {"status": "ok", "ok": True, "log": self.log_url, "log_end_offsets": res.ends}

    async def submit(
        self, operator: str, key: str, function: str, args: list[Any], *, request_id: str | None = None,
        timeout: float = 120.0,
    ) -> Reply:
        """Append the request to the input log and await its reply from the output log."""
        if self._client is None:
            self._client = LogClient(self._input_log, self.output_log)
        return await self._client.submit(operator, key, function, args, request_id=request_id, timeout=timeout)

    def get_reply(self, request_id: str) -> Reply | None:
        return self.output_log.get(request_id)

    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        raise EngineUnavailable("entity state is served by the engine's gateway, not by a remote gateway")

    def close(self) -> None:
        self._input_log.close()
        self.output_log.close()
