"""Submitting requests through the input log and awaiting their replies from the output log.

Used by the Spark runtime's ``submit`` (and so by the gateway): appends are group-committed (one SQLite
transaction for every request that arrived in the last few milliseconds, after S-Store's group commit),
and a single task tails the output log and resolves the waiting futures, instead of every request polling.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from charon import serde
from charon.log import InputLog, OutputLog
from charon.messages import Reply, Request


class LogClient:
    """Async submit over an input log and an output log (one instance per event loop)."""

    def __init__(self, input_log: InputLog, output_log: OutputLog, poll_s: float = 0.003) -> None:
        self.input_log = input_log
        self.output_log = output_log
        self.poll_s = poll_s
        self._pending: list[Request] = []
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._seq = output_log.last_seq()
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump())

    async def submit(
        self, operator: str, key: str, function: str, args: list | tuple = (), *, request_id: str | None = None,
        timeout: float = 120.0,
    ) -> Reply:
        """Append one request (group-committed) and wait for its reply; a known request id runs once."""
        rid = request_id or uuid.uuid4().hex
        fut = self._waiters.get(rid)
        if fut is None:
            done = self.output_log.get(rid)
            if done is not None:
                return done
            fut = self._waiters[rid] = asyncio.get_running_loop().create_future()
            self._pending.append(Request(rid, operator, key, function, serde.encode(list(args)), time.time()))
            self._wake.set()
        self._ensure_task()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply for request {rid} within {timeout} s") from None

    async def _pump(self) -> None:
        while self._waiters or self._pending:
            if self._pending:
                batch, self._pending = self._pending, []
                await asyncio.to_thread(self.input_log.append_many, batch)
            rows = await asyncio.to_thread(self.output_log.read_since, self._seq, 100_000)
            for seq, rep in rows:
                self._seq = max(self._seq, seq)
                fut = self._waiters.pop(rep.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(rep)
            if not rows:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)
                except TimeoutError:
                    pass
