"""Operations that send one transaction per item (bulk operations, workflow migration): each transaction's request
id is derived from the operation and the item (so a repeated call sends nothing twice), the replies are awaited
together within a bound, and counted."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Iterable

from charon.messages import Reply
from charon.server.wire import HTTPError

__all__ = ["await_replies", "derived_id", "tally"]


def derived_id(kind: str, op: str, *parts: str) -> str:
    """The request id of one transaction of operation ``op`` of ``kind`` (reserved: no client can take it)."""
    digest = hashlib.blake2b("\0".join((op, *parts)).encode(), digest_size=16).hexdigest()
    return f"__charon.{kind}:{digest}"


async def await_replies(calls: Iterable[Awaitable[Reply]], timeout_s: float, what: str, op: str) -> list[Reply]:
    """The replies of ``calls``; a 503 naming ``what`` and its Idempotency-Key ``op`` when no epoch answered them all
    within ``timeout_s`` (what was sent applies when epochs run; a repeated call sends nothing twice)."""
    try:
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))
    except TimeoutError:
        raise HTTPError("Unavailable", f"no epoch answered {what} {op} within {timeout_s:.0f} s (paused?): what was "
                        f"sent applies when epochs run; repeat the call with the Idempotency-Key {op} to see it "
                        "(nothing is sent twice)") from None


def tally(replies: Iterable[Reply]) -> tuple[int, dict[str, int]]:
    """``(done, skipped)``: the replies that applied, and the others by error type (each decided it did not apply:
    nothing changed)."""
    done, skipped = 0, dict[str, int]()
    for rep in replies:
        if rep.ok:
            done += 1
        else:
            skipped[rep.error_type] = skipped.get(rep.error_type, 0) + 1
    return done, skipped
