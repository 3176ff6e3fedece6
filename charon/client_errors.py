"""Turning a reply into a value or a typed exception (shared by the runtimes' and clients' invoke)."""

from __future__ import annotations

from typing import Any

from charon import serde
from charon.errors import aborted
from charon.messages import Reply


def raise_for_reply(reply: Reply) -> Any:
    """The reply's value; for an aborted reply raises its :class:`~charon.errors.TransactionAborted` (the engine
    error's abort class, e.g. ``UnknownFunctionAborted``, or TransactionAborted for an application's exception),
    carrying the reply's request id, tid, epoch and position."""
    if reply.ok:
        return serde.decode(reply.value) if reply.value else None
    raise aborted(reply.error_type, reply.error_message, reply.request_id, tid=reply.tid,
                  epoch=reply.epoch, position=reply.position)
