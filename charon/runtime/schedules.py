"""Schedules declared in code reach the engine (issue 34): at every start, one upsert per declaration.

Each upsert is a transaction of the built-in operator ``charon.schedule`` (:mod:`charon.core.schedules`) under a
reserved request id naming the spec's hash, submitted through the engine contract, so every engine does the same;
it changes nothing when the record already has that spec. A schedule declared before and no longer declared is
deleted the same way (a page of the records, read through ``Controls.inspect``).
"""

from __future__ import annotations

import asyncio
import logging

from charon import serde
from charon.core.routing import split_store_key
from charon.core.schedules import DECLARE_ID_PREFIX, SCHEDULE_OPERATOR, declarations
from charon.runtime.contract import Engine

__all__ = ["declare_schedules", "start_declaring"]

_log = logging.getLogger("charon.schedules")
MAX_LISTED = 10_000  # declared schedules looked at for removal


async def declare_schedules(engine: Engine) -> int:
    """Upsert every schedule the engine's application declares, delete the declared ones it no longer does;
    returns how many transactions committed."""
    app = engine.app
    done = 0
    for rid, spec in declarations(app):
        reply = await engine.submit(SCHEDULE_OPERATOR, spec["name"], "upsert", [spec, True], request_id=rid)
        done += reply.ok
        if not reply.ok:
            _log.warning("schedule %s was not declared: %s: %s", spec["name"], reply.error_type, reply.error_message)
    controls = engine.controls
    if controls is None:
        return done
    page = await controls.inspect(SCHEDULE_OPERATOR, None, None, MAX_LISTED)
    for k, v in sorted(page.rows.items()):
        _, name, item = split_store_key(k)
        rec = serde.decode(v) if item == "" else None
        if rec and rec.get("declared") and not rec.get("deleted") and name not in app.schedules:
            rid = f"{DECLARE_ID_PREFIX}{name}:undeclared:{rec.get('hash')}"
            reply = await engine.submit(SCHEDULE_OPERATOR, name, "delete", [], request_id=rid)
            done += reply.ok
    return done


def start_declaring(engine: Engine) -> asyncio.Task[int]:
    """:func:`declare_schedules` in the background (an engine's start does not wait for epochs); failures logged."""

    async def run() -> int:
        try:
            return await declare_schedules(engine)
        except Exception as exc:  # noqa: BLE001 - e.g. stopped meanwhile: the next start declares again
            _log.warning("declaring the schedules failed: %s: %s", type(exc).__name__, exc)
            return 0

    return asyncio.ensure_future(run())
