"""Reading output streams over HTTP (``GET /streams/{stream}``): a page of whole atoms, long polling, or
server-sent events; one :class:`StreamWatch` wakes every waiting reader when an atom is appended.

Waiting readers (long polls and event streams) hold one of ``stream_max_waiters`` slots (503
``StreamReadersFull`` beyond, :class:`charon.server.limits.Slots`); a slot goes with its client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from charon import serde
from charon.config import GatewayConfig
from charon.core.routing import check_stream
from charon.errors import InvalidKey
from charon.log.streams import StreamEvent, StreamRead
from charon.server.limits import SlotResponse, Slots
from charon.server.wire import HTTPError, json_encoder

__all__ = ["StreamSource", "StreamWatch", "StreamReaders", "until_disconnected"]


class StreamSource(Protocol):
    """What a reader needs of a runtime's ``streams`` log (:class:`charon.log.streams.StreamLog`)."""

    def read(self, stream: str, from_offset: int = 0, max_events: int = 1000) -> StreamRead: ...

    def end_offset(self, stream: str) -> int: ...

    def add_listener(self, listener: Callable[[frozenset[str]], object]) -> None: ...

    def remove_listener(self, listener: Callable[[frozenset[str]], object]) -> None: ...

    def last_epoch(self) -> int: ...

#: how often the gateway's one stream watcher looks for atoms appended by another process while readers wait (the
#: runtime's own appends wake them at once)
_STREAM_FOREIGN_POLL_S = 1.0


class StreamWatch:
    """Wakes the waiting readers of an output stream (long polls, server-sent events) when an atom is appended:
    one watcher for all of them, so an idle reader costs nothing but its connection.

    The runtime's own appends notify it at once (:meth:`charon.log.streams.StreamLog.add_listener`, called on
    the appending thread); atoms another process appends to the same file are seen by one cheap query per
    ``_STREAM_FOREIGN_POLL_S`` while anyone waits."""

    def __init__(self, log: StreamSource) -> None:
        self.log = log
        self.loop = asyncio.get_running_loop()
        self.events: dict[str, asyncio.Event] = {}  # per stream, replaced when it fires
        self.waiting = 0
        self._poller: asyncio.Task[None] | None = None
        log.add_listener(self._appended)

    def close(self) -> None:
        self.log.remove_listener(self._appended)
        if self._poller is not None:
            self._poller.cancel()

    def _appended(self, streams: frozenset[str]) -> None:  # on the appending thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._fire, streams)

    def _fire(self, streams: frozenset[str] | None) -> None:
        for name in (list(self.events) if streams is None else streams):
            ev = self.events.pop(name, None)
            if ev is not None:
                ev.set()

    def event(self, stream: str) -> asyncio.Event:
        """The event the next append to ``stream`` sets (take it *before* reading, then wait on it)."""
        ev = self.events.get(stream)
        if ev is None:
            ev = self.events[stream] = asyncio.Event()
        return ev

    async def wait(self, ev: asyncio.Event, timeout: float, also: asyncio.Future[Any] | None = None) -> None:
        """Until ``ev`` fires, ``also`` is done, or ``timeout`` passes."""
        self.waiting += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())
        waiter = asyncio.ensure_future(ev.wait())
        try:
            await asyncio.wait({waiter} if also is None else {waiter, also}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            self.waiting -= 1

    async def _poll(self) -> None:
        """Appends by other processes: one query per interval while anyone waits (then it ends)."""
        interval = _STREAM_FOREIGN_POLL_S
        last = await asyncio.to_thread(self.log.last_epoch)
        while self.waiting:
            await asyncio.sleep(interval)
            now = await asyncio.to_thread(self.log.last_epoch)
            if now != last:
                last = now
                self._fire(None)


async def until_disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the client of a request (whose body was read or is empty) disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass


class StreamReaders:
    """The readers of one gateway's output streams: their parameters, pages, event streams, waiting slots and
    the one :class:`StreamWatch` they share. ``off_loop`` runs a log read without blocking the event loop."""

    def __init__(self, cfg: GatewayConfig, off_loop: Callable[..., Awaitable[Any]]) -> None:
        self.cfg = cfg
        self.off_loop = off_loop
        self.waiters = Slots(cfg.stream_max_waiters, "StreamReadersFull",
                             lambda cap: f"{cap} stream readers are waiting (stream_max_waiters); retry later")
        self.watch: StreamWatch | None = None

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def params(self, request: HTTPRequest) -> tuple[str, int, int, float]:
        """``(stream, from_offset, limit, wait)`` of a read (typed 400s); ``Last-Event-ID`` resumes."""
        stream = request.path_params["stream"]
        try:
            check_stream(stream)
        except InvalidKey as exc:
            raise HTTPError("InvalidKey", str(exc)) from None
        q = request.query_params
        try:
            start = q.get("from_offset") or request.headers.get("last-event-id") or "0"
            offset = int(start)
            limit = int(q.get("limit", self.cfg.stream_max_events))
            wait = float(q.get("wait", 0))
        except ValueError:
            raise HTTPError("BadRequest", "from_offset and limit must be integers, wait a number") from None
        if offset < 0 or limit < 1 or not 0 <= wait <= 30:
            raise HTTPError("BadRequest", "from_offset >= 0, limit >= 1 and 0 <= wait <= 30 are required")
        return stream, offset, min(limit, self.cfg.stream_max_events), wait

    def watcher(self, log: StreamSource) -> StreamWatch:
        if self.watch is None or self.watch.log is not log:
            if self.watch is not None:
                self.watch.close()
            self.watch = StreamWatch(log)
        return self.watch

    @staticmethod
    def event_doc(ev: StreamEvent) -> dict[str, Any]:
        return {"offset": ev.offset, "epoch": ev.epoch, "value": serde.decode(ev.value)}

    async def page(self, request: HTTPRequest, log: StreamSource, stream: str, offset: int, limit: int,
                   wait: float) -> dict[str, Any]:
        """A page of ``stream`` from ``offset``; when there is nothing yet, waits up to ``wait`` seconds for it."""
        page = await self.off_loop(log.read, stream, offset, limit)
        if not page.events and wait > 0:
            release = self.waiters.take()
            gone = asyncio.ensure_future(until_disconnected(request.receive))  # the slot goes with the client
            try:
                watch = self.watcher(log)
                deadline = time.monotonic() + wait
                while not page.events:
                    left = deadline - time.monotonic()
                    if left <= 0 or gone.done():
                        break
                    ev = watch.event(stream)
                    if await self.off_loop(log.end_offset, stream) > page.next_offset:
                        page = await self.off_loop(log.read, stream, page.next_offset, limit)
                        continue
                    await watch.wait(ev, left, gone)
            finally:
                gone.cancel()
                release()
        return {"stream": stream, "events": [self.event_doc(e) for e in page.events],
                "next_offset": page.next_offset, "first_offset": page.first_offset, "end_offset": page.end_offset}

    def sse(self, log: StreamSource, stream: str, offset: int, limit: int) -> Response:
        """Server-sent events of ``stream`` from ``offset``, for at most ``stream_sse_seconds``."""
        release = self.waiters.take()
        readers = self

        async def events() -> AsyncIterator[bytes]:
            nonlocal offset
            try:
                watch = readers.watcher(log)
                deadline = time.monotonic() + readers.cfg.stream_sse_seconds
                yield b": charon stream " + stream.encode() + b"\n\n"
                while time.monotonic() < deadline:
                    ev = watch.event(stream)
                    page = await readers.off_loop(log.read, stream, offset, limit)
                    for e in page.events:
                        data = json_encoder.encode(dict(readers.event_doc(e), stream=stream))
                        yield b"id: %d\nevent: %s\ndata: %s\n\n" % (e.offset + 1, stream.encode(), data)
                    offset = page.next_offset
                    if not page.events:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        await watch.wait(ev, left)  # a disconnect cancels this (starlette listens for it)
            finally:
                release()

        return SlotResponse(events(), media_type="text/event-stream", release=release,
                            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
