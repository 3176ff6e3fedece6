"""Stream-to-application wiring: one application's output stream as another's (or its own) input.

A :class:`StreamWire` reads a stream (:class:`charon.log.streams.StreamLog`) atom by atom and submits each
event to a target runtime as one invocation ``operator/key.function(*args)``, where the event's value is
``{"key": str, "args": [...]}`` (what the producing function emits, e.g.
``ctx.emit("orders", {"key": order_id, "args": [amount]})``).

Exactly once across restarts of either side: the invocation of the event at ``offset`` of stream ``s``
has the request id ``__charon.wire.<name>.<offset>``, so a durable target runs it once however often it
is submitted (a retried id gets the first reply), and the producer's stream is itself append-once by
epoch. The wire resumes from the offset stored in ``checkpoint`` (a small file, written after each atom
is fully answered); the request ids, not the file, are what makes delivery exactly once, so losing the
file only costs re-submissions (within the target's request-id dedup window: a durable node remembers
ids for ``CHARON_DEDUP_WINDOW_S``, so the checkpoint must not be older than that). An event whose value
does not name a valid invocation is answered like any bad request (its reply records the error) and
skipped. Cycles are allowed (a runtime may be wired to its own stream); the events of one atom are
submitted together and run in the target's next epochs.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from charon import serde
from charon.core.routing import check_stream
from charon.log.streams import StreamLog
from charon.messages import Reply
from charon.storage.files import write_file_atomic

__all__ = ["StreamWire", "WIRE_ID_PREFIX"]

WIRE_ID_PREFIX = "__charon.wire."  # reserved request ids (the gateway refuses them from clients)


class StreamWire:
    """Feed ``stream`` of ``source`` into ``target`` (a started runtime with ``submit``); see the module doc."""

    def __init__(
        self, source: StreamLog, stream: str, target: Any, operator: str, function: str, *,
        name: str | None = None, checkpoint: str | None = None, max_events: int = 1000, poll_s: float = 0.01,
    ) -> None:
        self.source = source
        self.stream = check_stream(stream)
        self.target = target
        self.operator = operator
        self.function = function
        self.name = check_stream(name or stream)
        self.checkpoint = checkpoint
        self.max_events = max_events
        self.poll_s = poll_s
        self.offset = self._load()
        self.delivered = 0  # events answered by this wire object (first replies or retried ones)
        self.rejected: list[Reply] = []  # events answered with an error (bounded by max_events per atom read)

    def _load(self) -> int:
        return load_offset(self.checkpoint)

    def _store(self) -> None:
        store_offset(self.checkpoint, self.offset)

    def request_id(self, offset: int) -> str:
        """The request id of the event at ``offset`` (the same on every delivery)."""
        return f"{WIRE_ID_PREFIX}{self.name}.{offset}"

    async def _deliver(self, offset: int, value: bytes) -> Reply:
        doc = serde.decode(value)
        key, args = (doc.get("key"), doc.get("args", [])) if isinstance(doc, dict) else (None, None)
        if not isinstance(key, str) or not isinstance(args, list):
            key, args = "?", [doc]  # the target rejects or runs it; either way it has one reply per id
        return await self.target.submit(self.operator, key, self.function, args, request_id=self.request_id(offset))

    async def step(self) -> int:
        """Deliver the next atoms available (up to ``max_events``); returns how many events were delivered."""
        page = self.source.read(self.stream, self.offset, self.max_events)
        if not page.events:
            self.offset = max(self.offset, page.next_offset)
            return 0
        replies = await asyncio.gather(*(self._deliver(e.offset, e.value) for e in page.events))
        for r in replies:
            if not r.ok and r.error_type in ("UnknownOperator", "UnknownFunction", "BadArguments", "InvalidKey"):
                self.rejected.append(r)
        del self.rejected[: max(0, len(self.rejected) - self.max_events)]
        self.delivered += len(replies)
        self.offset = page.next_offset
        self._store()
        return len(replies)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Deliver forever (or until ``stop`` is set), polling for new atoms every ``poll_s``."""
        while stop is None or not stop.is_set():
            if not await self.step():
                await asyncio.sleep(self.poll_s)


def load_offset(path: str | None) -> int:
    """A stream reader's saved offset (0 when there is no checkpoint file yet)."""
    if path is None:
        return 0
    with contextlib.suppress(FileNotFoundError, ValueError):
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    return 0


def store_offset(path: str | None, offset: int) -> None:
    """Save a stream reader's offset atomically and durably (nothing without a checkpoint path)."""
    if path is not None:
        write_file_atomic(path, str(offset).encode("ascii"))
