"""Turning a reply into a value or a typed exception (shared by the runtimes' and clients' invoke)."""

from __future__ import annotations

from typing import Any

from charon import serde
from charon.errors import ENGINE_ERRORS, TransactionAborted
from charon.messages import Reply


def raise_for_reply(reply: Reply) -> Any:
    """The reply's value; raises the engine's typed error, or TransactionAborted for application errors."""
    if reply.ok:
        return serde.decode(reply.value) if reply.value else None
    cls = ENGINE_ERRORS.get(reply.error_type)
    if cls is not None:
        raise cls(reply.error_message)
    raise TransactionAborted(reply.error_type, reply.error_message, reply.request_id)
