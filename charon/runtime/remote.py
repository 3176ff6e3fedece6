"""A gateway's runtime when the engine runs in another process or machine: requests go to the input log, replies
come from the output log, and the driver is asked for its health over its control channel.

``charon run MODULE:APP --engine remote --log nats://host:port/deployment`` serves the HTTP gateway on a machine
without Spark; ``--data-dir DIR`` instead reads the SQLite logs of a driver on the same machine (what the gateway
processes of ``charon run --engine spark --gateways N`` are). :meth:`LogRuntime.submit` appends to the input log and
awaits the reply in the output log (:class:`~charon.log.client.LogClient`), exactly as the Spark runtime's own
submit does; the driver executes them. Idempotency keys, conflict checks and status polling work from the logs.

``driver_url`` names the driver's control channel (the full gateway the driver serves on localhost, authenticated
with the deployment's tokens): :meth:`health` then reports the driver's own health, or that it is unreachable, and
the gateway forwards the routes it cannot serve from the logs there (:mod:`charon.server.forward`). Without it,
entity state and admin routes are not served here (503 / 501).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, ClassVar

import httpx

from charon.errors import EngineUnavailable
from charon.log.client import LogClient
from charon.log.location import is_networked, log_locations, open_input_log, open_output_log
from charon.messages import Reply, Request
from charon.operator import Application
from charon.runtime.contract import Engine, Enqueue
from charon.runtime.control.probe import LogProbe

__all__ = ["DriverProbe", "LogRuntime"]


class DriverProbe:
    """The driver's ``/health`` document, asked over HTTP within ``timeout_s`` and reused for ``max_age_s`` (a
    polled ``/health`` on every gateway costs the driver one request per period, whatever the polling rate)."""

    def __init__(self, url: str, timeout_s: float = 1.0, max_age_s: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._last: tuple[float, dict[str, object]] | None = None
        self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=2))

    def check(self) -> dict[str, object]:
        """The driver's health document (``ok`` true or false), or ``{"status": "driver unreachable", "ok":
        False, "error": ...}`` when it does not answer within ``timeout_s`` or answers something else."""
        with self._lock:
            last = self._last
            if last is not None and time.monotonic() - last[0] < self.max_age_s:
                return last[1]
            try:
                resp = self._http.get(self.url + "/health")
                doc = resp.json()
                if not isinstance(doc, dict):
                    raise ValueError(f"HTTP {resp.status_code} without a health document")
                doc = {**doc, "ok": bool(doc.get("ok")) and resp.status_code == 200}
            except (httpx.HTTPError, ValueError) as exc:
                doc = {"status": "driver unreachable", "ok": False,
                       "error": f"the driver at {self.url} does not answer: {type(exc).__name__}: {exc}"[:500]}
            self._last = (time.monotonic(), doc)
            return doc

    def close(self) -> None:
        self._http.close()


class LogRuntime(Engine):
    """Submit through the logs (``log_url``, else the SQLite files in ``data_dir``); the engine reading them runs
    in another process or machine.

    An :class:`~charon.runtime.contract.Engine` without controls: admin routes go to the driver (forwarded when
    ``driver_url`` is given)."""

    kind: ClassVar[str] = "remote"

    def __init__(self, app: Application, log_url: str | None = None, health_timeout_s: float = 1.0, *,
                 data_dir: str | None = None, driver_url: str | None = None) -> None:
        if log_url is not None and not is_networked(log_url):
            raise ValueError(f"a remote gateway needs a networked log (nats://...), got {log_url!r}")
        if log_url is None:
            if data_dir is None:
                raise ValueError("a remote gateway needs a networked log (nats://...) or the driver's data directory")
            for path in log_locations(os.path.abspath(data_dir), None):
                if not os.path.exists(path):  # never create a log the driver has not: it owns the partition count
                    raise FileNotFoundError(f"no log at {path}: start the driver first (it creates the logs)")
        self._app = app
        self.log_url = log_url
        self.data_dir = data_dir
        in_loc, out_loc = log_locations(os.path.abspath(data_dir or "."), log_url)
        self._input_log = open_input_log(in_loc)
        self.output_log = open_output_log(out_loc)
        self._client: LogClient | None = None
        self._probe = LogProbe(self._input_log, health_timeout_s)
        self.driver = None if driver_url is None else DriverProbe(driver_url, health_timeout_s)

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
        where = self.log_url or f"SQLite logs in {os.path.abspath(self.data_dir or '.')}"
        driver = "" if self.driver is None else f", driver at {self.driver.url}"
        return f"gateway only, the engine runs elsewhere (logs on {where}{driver})"

    async def start(self) -> None:
        """Nothing to start: the engine runs elsewhere."""

    async def stop(self) -> None:
        """Nothing to stop (the logs stay open until :meth:`close`)."""

    def health(self) -> dict[str, Any]:
        """``ok`` while the log answers and, with a driver, the driver is healthy (its own document, with this
        gateway's ``gateway`` part); answered within ``health_timeout_s`` for each even when one hangs."""
        res = self._probe.check()
        me: dict[str, Any] = {"pid": os.getpid(), "log": self.log_url or "sqlite",
                              "waiting": 0 if self._client is None else self._client.pending()}
        if res.error is not None:
            return {"status": "log unavailable", "ok": False, "error": res.error, "gateway": me}
        if self.driver is None:
            return {"status": "ok", "ok": True, "log": self.log_url or "sqlite", "log_end_offsets": res.ends,
                    "gateway": me}
        doc = dict(self.driver.check())
        doc["gateway"] = me
        return doc

    @property
    def submit_checks_ids(self) -> bool:
        return True  # the log client looks each batch's client ids up before appending it

    @property
    def client(self) -> LogClient:
        """The log client (made on first use, on the serving loop)."""
        if self._client is None:
            self._client = LogClient(self._input_log, self.output_log)
        return self._client

    async def submit(
        self, operator: str, key: str, function: str, args: list[Any], *, request_id: str | None = None,
        timeout: float = 120.0,
    ) -> Reply:
        """Append the request to the input log and await its reply from the output log."""
        return await self.client.submit(operator, key, function, args, request_id=request_id, timeout=timeout)

    def enqueuer(self) -> Enqueue:
        """The gateway's direct entry: the checked request registered with the log client, no coroutine per
        request; an id the gateway did not mint (not ``fresh``) is looked up by the client's appender."""

        def enqueue(request: Request, fresh: bool = False) -> asyncio.Future[Reply]:
            return self.client.enqueue(request, given=not fresh)

        return enqueue

    def get_reply(self, request_id: str) -> Reply | None:
        return self.output_log.get(request_id)

    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        raise EngineUnavailable("entity state is served by the engine's gateway, not by a remote gateway")

    def close(self) -> None:
        self._input_log.close()
        self.output_log.close()
        if self.driver is not None:
            self.driver.close()
