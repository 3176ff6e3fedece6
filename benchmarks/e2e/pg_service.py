"""The YCSB-T transfer as a PostgreSQL-backed HTTP service, written the way a competent team would.

starlette on uvicorn (httptools, one process, like Charon's gateway), psycopg 3 with an ``AsyncConnectionPool``,
PostgreSQL's durable defaults (``synchronous_commit = on``: fsync per commit). It serves the same request as
Charon's gateway, ``POST /invoke/account/{key}/transfer`` with ``{"args": [to, amount]}``, a bearer token and an
``Idempotency-Key``, and answers 200 (committed: the debtor's new balance) or 409 (``NotEnoughCredit``).

Two modes (``--isolation``):

- ``read_committed``: both account rows locked with ``SELECT ... FOR UPDATE`` in key order (no deadlock, no lost
  update), then the conditional debit and the credit;
- ``serializable``: the same statements under SERIALIZABLE without the explicit locks, the whole transaction
  retried (with a small random back-off) on serialization failure or deadlock.

The statements are :class:`charon.bench.postgres.YcsbSql`'s. Idempotency, since Charon deduplicates: a
``request`` table keyed by the request id holds the reply, written in the transfer's own transaction; a request
whose id is already there gets the stored reply, and two concurrent duplicates meet on the primary key (the
second waits for the first to commit, fails with a unique violation, rolls back and returns the stored reply).
An abort (insufficient funds) stores its 409 too: the failed conditional debit changed nothing, so it commits.

    python benchmarks/e2e/pg_service.py --dsn "host=127.0.0.1 port=5432 user=charon dbname=postgres" --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import psycopg
import uvicorn
from psycopg import errors as pgerr
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from charon.bench.postgres import ISOLATION, RETRYABLE, AppAbort, Record, YcsbSql


class YcsbService(YcsbSql):
    """YcsbSql's accounts plus the idempotency table."""

    schema = YcsbSql.schema + (
        "CREATE TABLE request (id text PRIMARY KEY, status smallint NOT NULL, body bytea NOT NULL);")


def setup(dsn: str, keys: int, balance: int) -> None:
    """(Re)create the schema and load ``keys`` accounts ``a0``..``a<keys-1>`` with ``balance`` each."""
    records: Iterable[Record] = (("account", f"a{i}", balance, None) for i in range(keys))
    YcsbService().setup(dsn, records)


def total(dsn: str) -> int:
    """The sum of all balances."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT coalesce(sum(balance), 0) FROM account").fetchone()
        assert row is not None
        return int(row[0])


def make_app(dsn: str, isolation: str, pool_size: int, token: str, max_retries: int = 100) -> Starlette:
    if isolation not in ISOLATION:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATION)}")
    sql = YcsbService()
    sql.lock_rows = isolation == "read_committed"
    transfer = sql.handlers()[("account", "transfer")]
    level = ISOLATION[isolation]
    auth = f"Bearer {token}"
    encode = msgspec.json.encode
    decode = msgspec.json.decode

    async def configure(conn: psycopg.AsyncConnection) -> None:
        # autocommit statements run at the server's default (READ COMMITTED); conn.transaction() begins with
        # ISOLATION LEVEL `level`
        await conn.set_autocommit(True)
        await conn.set_isolation_level(level)

    stats = {"retries": 0, "duplicates": 0}  # serialization failures / deadlocks retried; duplicate ids
    pool = AsyncConnectionPool(dsn, min_size=pool_size, max_size=pool_size, configure=configure, open=False)

    async def stored(conn: psycopg.AsyncConnection, rid: str) -> tuple[int, bytes] | None:
        cur = await conn.execute("SELECT status, body FROM request WHERE id = %s", (rid,))
        row = await cur.fetchone()
        return (int(row[0]), bytes(row[1])) if row else None

    async def once(conn: psycopg.AsyncConnection, rid: str, key: str, args: list) -> tuple[int, bytes]:
        async with conn.transaction():  # BEGIN ISOLATION LEVEL <level>
            try:
                value = await transfer(conn, key, args)
                status, body = 200, encode({"request_id": rid, "value": value, "status": "committed"})
            except AppAbort as exc:  # the conditional debit matched no row: nothing written, commit the reply
                status, body = 409, encode({"request_id": rid, "status": "aborted",
                                            "error": {"type": exc.error_type, "message": str(exc)}})
            await conn.execute("INSERT INTO request (id, status, body) VALUES (%s, %s, %s)", (rid, status, body))
            return status, body

    async def invoke(request: Request) -> Response:
        if request.headers.get("authorization") != auth:
            return Response(b'{"error":{"type":"Unauthorized"}}', 401, media_type="application/json")
        rid = request.headers.get("idempotency-key")
        if not rid or len(rid) > 200:
            return Response(b'{"error":{"type":"BadRequest","message":"Idempotency-Key"}}', 400,
                            media_type="application/json")
        try:
            args = decode(await request.body())["args"]
            to, amount = str(args[0]), int(args[1])
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError):
            return Response(b'{"error":{"type":"BadRequest"}}', 422, media_type="application/json")
        if amount <= 0:
            return Response(b'{"error":{"type":"BadRequest","message":"amount"}}', 422,
                            media_type="application/json")
        key = request.path_params["key"]
        async with pool.connection() as conn:
            prior = await stored(conn, rid)  # autocommit: READ COMMITTED, no predicate lock on the id's gap
            if prior is not None:
                stats["duplicates"] += 1
                return Response(prior[1], prior[0], media_type="application/json")
            attempt = 0
            while True:
                try:
                    status, body = await once(conn, rid, key, [to, amount])
                    break
                except pgerr.UniqueViolation:  # a concurrent duplicate committed first: its reply
                    stats["duplicates"] += 1
                    prior = await stored(conn, rid)
                    assert prior is not None
                    status, body = prior
                    break
                except RETRYABLE:
                    stats["retries"] += 1
                    attempt += 1
                    if attempt > max_retries:
                        return Response(b'{"error":{"type":"SerializationFailure"}}', 503,
                                        media_type="application/json")
                    await asyncio.sleep(random.uniform(0, 0.001 * min(attempt, 20)))
        return Response(body, status, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"ok")

    async def stats_route(request: Request) -> Response:
        return Response(encode(stats), media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await pool.open(wait=True)
        yield
        await pool.close()

    return Starlette(routes=[Route("/invoke/account/{key}/transfer", invoke, methods=["POST"]),
                             Route("/health", health), Route("/stats", stats_route)], lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--isolation", choices=sorted(ISOLATION), default="read_committed")
    ap.add_argument("--pool", type=int, default=8, help="connections in the pool")
    ap.add_argument("--token", default="e2e")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    args = ap.parse_args(argv)
    app = make_app(args.dsn, args.isolation, args.pool, args.token)
    uvicorn.run(app, host=args.host, port=args.port, http="httptools", access_log=False, log_level="warning",
                backlog=2048)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
