"""The gateway's bounds in bytes and counts, each with its typed refusal (settings:
:class:`charon.config.GatewayConfig`).

- request bodies: at most ``max_body`` bytes (413 ``PayloadTooLarge``, from ``Content-Length`` and again while
  streaming), arriving within ``body_timeout`` seconds (408 ``RequestTimeout``): :func:`read_body`;
- requests in flight and retained replies: their sizes as counted against ``max_inflight_bytes`` and
  ``recent_bytes`` (:func:`inflight_size`, :func:`reply_size`);
- slots taken at once and given back exactly once, refused with a typed error when none is free: waiting stream
  readers (``stream_max_waiters``, 503 ``StreamReadersFull``), SQL queries (429 ``SQLBusy``): :class:`Slots`,
  and :class:`SlotResponse` for a streaming answer that holds one.

The connection limits (request-head timeout and size, open connections) are the uvicorn protocol's:
:mod:`charon.server.http`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from charon.messages import Reply, Request
from charon.server.wire import HTTPError

__all__ = ["read_body", "inflight_size", "reply_size", "Slots", "SlotResponse"]


async def read_body(request: HTTPRequest, max_body: int, timeout: float) -> bytes:
    """The request's body: at most ``max_body`` bytes (413), received within ``timeout`` seconds (408)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise HTTPError("BadRequest", "invalid Content-Length") from None
        if n > max_body:
            raise HTTPError("PayloadTooLarge", f"body of {n} bytes exceeds the limit of {max_body}")
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                total += len(chunk)
                if total > max_body:
                    raise HTTPError("PayloadTooLarge", f"body exceeds the limit of {max_body} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise HTTPError("RequestTimeout", f"body not received within {timeout} s") from None
    return b"".join(chunks)


def inflight_size(req: Request) -> int:
    """What an in-flight request counts toward ``max_inflight_bytes``: its arguments and a fixed overhead."""
    return 512 + len(req.args) + len(req.key)


def reply_size(rep: Reply) -> int:
    """What a retained reply counts toward ``recent_bytes``."""
    return 128 + len(rep.request_id) + len(rep.value) + len(rep.error_type) + len(rep.error_message)


class Slots:
    """``cap`` slots; :meth:`take` takes one at once (no await between the check and the taking: a burst cannot
    exceed the cap) or raises the typed refusal, and returns the slot's release (idempotent)."""

    def __init__(self, cap: int, error_type: str, refusal: Callable[[int], str]) -> None:
        self.cap = cap
        self.taken = 0
        self.error_type = error_type
        self.refusal = refusal  # the refusal's message, given the cap

    def take(self) -> Callable[[], None]:
        if self.taken >= self.cap:
            raise HTTPError(self.error_type, self.refusal(self.cap))
        self.taken += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.taken -= 1

        return release


class SlotResponse(StreamingResponse):
    """A streaming response that gives back its slot (e.g. a stream reader's) when it ends, however it ends
    (finished, client gone, or never started)."""

    def __init__(self, *args: Any, release: Callable[[], None], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
