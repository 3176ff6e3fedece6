"""Durable effects: the executor that runs ``ctx.effect`` requests and resumes their callers (issue 23).

An effect is a portal to the outside world (the shape of :mod:`charon.runtime.deployment`'s portals):

* ``ctx.effect(handler, *args, then=fn, carry=[...], timeout=s, attempts=n)`` appends an effect request to the
  transaction's reserved stream ``charon.effects``: it exists iff the transaction commits (an event of its epoch
  atom). Its id ``fx.<app>.<tid>.<inv>.<n>`` comes from the transaction, so a replayed epoch makes the same id.
* An :class:`EffectExecutor` reads that stream from a checkpointed offset and records each request once (by id)
  in its :class:`EffectStore` (one SQLite file, ``effects.sqlite`` next to ``streams.sqlite``), in the same
  SQLite transaction as the new offset: intake is exactly once.
* It runs the application's handler ``handler(effect_id, *args)`` (the id is the idempotency key the handler
  passes to the external service) **at least once**: each attempt at most ``timeout`` seconds, then again after
  an exponential backoff, at most ``attempts`` attempts. Attempts and the last error are recorded before and
  after each attempt, so a crash between an attempt and its record means one more attempt (never one fewer).
* The handler's value (or, after the last attempt, the failure) is recorded, then the continuation
  ``op/key.then(result, *carry)`` is submitted under the request id ``<effect id>.done``: the engine's request-id
  dedup makes it run **exactly once** however often a crashed executor submits it again. Those ids are reserved
  (:data:`charon.messages.RESERVED_ID_PREFIXES`: the gateway and the clients refuse them from anyone else, so no
  client's request can take a continuation's place); a worker process submits through the gateway's route of its
  own (``POST /effects/continue/...``, :meth:`charon.client.AsyncClient.continue_effect`).
  ``result`` is ``{"ok": True, "value": v}`` or ``{"ok": False, "error_type": t, "error": message,
  "attempts": n}``. A value above ``MAX_VALUE_BYTES`` is a ``ValueTooLarge`` failure (final); a continuation the
  resume path refuses before the log (:class:`ContinuationRefused`) is submitted again with a
  ``ContinuationRefused`` failure in place of the value; refused even so, the effect is parked for an operator.

Several executors (``charon effects`` worker processes) split the effects by ``crc32(id) % workers``: each
effect belongs to one worker, so no effect runs concurrently twice (all workers must be given the same count: to
change it, stop every worker, then start the new ones; an executor inside ``charon run`` is worker 0 of 1, and must
not run beside workers). Bounds: at most
``concurrency`` effects in flight and at most ``max_inflight_bytes`` of their requests; ``park_failed`` keeps an
effect whose attempts are exhausted as ``failed`` for an operator (:meth:`EffectStore.retry` or
:meth:`EffectStore.abandon`, which resumes the continuation with ``EffectAbandoned``) instead of resuming it with
the failure at once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import random
import sqlite3
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from charon import serde
from charon.core.context import CONTINUATION_SUFFIX, EFFECT_STREAM, MAX_VALUE_BYTES, too_large
from charon.log.streams import StreamLog
from charon.operator import Application

__all__ = ["EFFECTS_FILE", "ContinuationRefused", "EffectExecutor", "EffectMetrics", "EffectRow", "EffectStore",
           "Resume", "effect_partition"]

EFFECTS_FILE = "effects.sqlite"
#: ``resume(operator, key, function, args, request_id) -> (committed, error)``: submit a continuation once; raise
#: when it could not be submitted (retried later), return ``(False, "Type: message")`` when it aborted.
Resume = Callable[[str, str, str, list[Any], str], Awaitable[tuple[bool, str]]]

_FIELDS = {"id": str, "handler": str, "args": list, "op": str, "key": str, "then": str, "carry": list,
           "timeout": float, "attempts": int}
STATUSES = ("pending", "running", "resuming", "failed", "done")


def effect_partition(eid: str, workers: int) -> int:
    """The worker (of ``workers``) that owns effect ``eid``."""
    return zlib.crc32(eid.encode()) % workers


def well_formed(doc: object) -> bool:
    return isinstance(doc, dict) and all(isinstance(doc.get(k), t) for k, t in _FIELDS.items())


class EffectRow(msgspec.Struct, kw_only=True):
    """One effect as the store keeps it (what ``charon effects list`` and ``GET /admin/effects`` show)."""

    id: str
    handler: str
    status: str  # pending (waiting for an attempt or its backoff), running, resuming, failed (parked), done
    attempts: int
    max_attempts: int
    last_error: str
    next_at: float
    operator: str
    key: str
    then: str
    outcome: str  # ok, failed, abandoned ('' until the result is known)
    continuation_error: str  # the continuation aborted (its error), '' otherwise
    created: float
    updated: float


class EffectStore:
    """The executor's durable record: every effect request taken in (by id, once), its attempts, last error,
    status and result, and each reader's stream offset. One SQLite file (WAL) shared by the workers and the CLI."""

    def __init__(self, path: str, *, retain_done: int = 100_000) -> None:
        self.path = path
        self.retain_done = retain_done
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS effects (id TEXT PRIMARY KEY, part INTEGER NOT NULL, doc BLOB NOT NULL, "
            "handler TEXT NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, "
            "max_attempts INTEGER NOT NULL, last_error TEXT NOT NULL DEFAULT '', next_at REAL NOT NULL DEFAULT 0, "
            "result BLOB, outcome TEXT NOT NULL DEFAULT '', cont_error TEXT NOT NULL DEFAULT '', "
            "created REAL NOT NULL, updated REAL NOT NULL, seq INTEGER NOT NULL DEFAULT 0)")
        self._db.execute("CREATE INDEX IF NOT EXISTS effects_due ON effects (status, next_at)")
        self._db.execute("CREATE INDEX IF NOT EXISTS effects_seq ON effects (seq)")
        self._db.execute("CREATE TABLE IF NOT EXISTS offsets (reader TEXT PRIMARY KEY, offset INTEGER NOT NULL)")

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:  # one connection, used from the loop's worker threads
            return self._db.execute(sql, args).fetchall()

    # -- intake
    def offset(self, reader: str) -> int:
        """Where ``reader`` (``index/workers``) resumes. A reader of a new worker count starts where the slowest
        reader of the previous counts stopped (everything before it was taken in by its owner, and is found again
        here, not re-run); with none, at 0. Readers of its own count are no guide (they start together)."""
        rows = self._rows("SELECT offset FROM offsets WHERE reader = ?", (reader,))
        if rows:
            return int(rows[0][0])
        count = reader.partition("/")[2]
        low = self._rows("SELECT min(offset) FROM offsets WHERE substr(reader, instr(reader, '/') + 1) != ?",
                         (count,))
        return int(low[0][0]) if low and low[0][0] is not None else 0

    def take(self, reader: str, docs: list[tuple[str, bytes, dict[str, Any]]], offset: int) -> int:
        """Record ``docs`` ((id, encoded request, request)) once each and the reader's new offset, atomically;
        returns how many were new."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                n = 0
                for eid, raw, doc in docs:
                    n += self._db.execute(
                        "INSERT OR IGNORE INTO effects (id, part, doc, handler, status, max_attempts, created, "
                        "updated) VALUES (?, ?, ?, ?, 'pending', ?, ?, ?)",
                        (eid, zlib.crc32(eid.encode()), raw, doc["handler"], doc["attempts"], now, now)).rowcount
                self._db.execute("INSERT INTO offsets (reader, offset) VALUES (?, ?) ON CONFLICT (reader) DO UPDATE "
                                 "SET offset = excluded.offset", (reader, offset))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return n

    # -- the executor's transitions
    def recover(self, index: int, workers: int) -> int:
        """After a crash: this worker's ``running`` effects wait for another attempt (their count stays)."""
        return self._write("UPDATE effects SET status = 'pending' WHERE status = 'running' AND part % ? = ?",
                           (workers, index))

    def due(self, index: int, workers: int, now: float, limit: int, skip: set[str]) -> list[tuple[str, str, bytes,
                                                                                                   int, bytes | None]]:
        """This worker's effects ready to run or resume: (id, status, request, attempts, result)."""
        rows = self._rows(
            "SELECT id, status, doc, attempts, result FROM effects WHERE status IN ('pending', 'resuming') "
            "AND next_at <= ? AND part % ? = ? ORDER BY next_at, created LIMIT ?",
            (now, workers, index, limit + len(skip)))
        return [r for r in rows if r[0] not in skip][:limit]

    def start_attempt(self, eid: str) -> int:
        """Count an attempt before it runs (a crash then counts it too); returns the attempt's number, 0 when the
        effect is no longer pending (an operator abandoned it meanwhile)."""
        with self._lock:
            if not self._db.execute("UPDATE effects SET status = 'running', attempts = attempts + 1, updated = ? "
                                    "WHERE id = ? AND status = 'pending'", (time.time(), eid)).rowcount:
                return 0
            return int(self._db.execute("SELECT attempts FROM effects WHERE id = ?", (eid,)).fetchone()[0])

    def retry_later(self, eid: str, error: str, at: float) -> None:
        self._write("UPDATE effects SET status = 'pending', last_error = ?, next_at = ?, updated = ? WHERE id = ?",
                    (error[:2000], at, time.time(), eid))

    def resolved(self, eid: str, result: dict[str, Any], outcome: str, error: str = "",
                 park: bool = False) -> None:
        """The result is known: resume next (or park a failure for an operator)."""
        self._write("UPDATE effects SET status = ?, result = ?, outcome = ?, last_error = ?, next_at = 0, "
                    "updated = ? WHERE id = ?",
                    ("failed" if park else "resuming", serde.encode(result), outcome, error[:2000], time.time(), eid))

    def resume_later(self, eid: str, error: str, at: float) -> None:
        self._write("UPDATE effects SET last_error = ?, next_at = ?, updated = ? WHERE id = ? AND status = 'resuming'",
                    (error[:2000], at, time.time(), eid))

    def done(self, eid: str, cont_error: str) -> None:
        with self._lock:
            self._db.execute("UPDATE effects SET status = 'done', cont_error = ?, updated = ?, seq = "
                             "(SELECT coalesce(max(seq), 0) + 1 FROM effects) WHERE id = ?",
                             (cont_error[:2000], time.time(), eid))
            seq = self._db.execute("SELECT seq FROM effects WHERE id = ?", (eid,)).fetchone()
            if seq and seq[0] % 1000 == 0:  # bounded: the newest retain_done finished effects are kept
                self._db.execute("DELETE FROM effects WHERE status = 'done' AND seq <= ?", (seq[0] - self.retain_done,))

    # -- operators
    def get(self, eid: str) -> EffectRow | None:
        """One effect by id (None: not taken in yet, or a finished one past the retention)."""
        rows = self._rows("SELECT id, handler, status, attempts, max_attempts, last_error, next_at, doc, outcome, "
                          "cont_error, created, updated FROM effects WHERE id = ?", (eid,))
        return self._row(rows[0]) if rows else None

    def parked(self, after: str | None = None, limit: int = 100) -> list[EffectRow]:
        """A page of the parked (``failed``) effects in id order after the id ``after`` (bulk retries page
        through them with it)."""
        q = ("SELECT id, handler, status, attempts, max_attempts, last_error, next_at, doc, outcome, cont_error, "
             "created, updated FROM effects WHERE status = 'failed' AND id > ? ORDER BY id LIMIT ?")
        return [self._row(r) for r in self._rows(q, (after or "", limit))]

    @staticmethod
    def _row(r: Any) -> EffectRow:
        eid, handler, st, att, mx, err, nxt, raw, outcome, cerr, created, updated = r
        doc = serde.decode(raw)
        return EffectRow(id=eid, handler=handler, status=st, attempts=att, max_attempts=mx, last_error=err,
                         next_at=nxt, operator=doc["op"], key=doc["key"], then=doc["then"], outcome=outcome,
                         continuation_error=cerr, created=created, updated=updated)

    def list(self, status: str | None = None, limit: int = 1000) -> list[EffectRow]:
        """Effects (newest first), all or of one status."""
        q = ("SELECT id, handler, status, attempts, max_attempts, last_error, next_at, doc, outcome, cont_error, "
             "created, updated FROM effects")
        args: tuple[Any, ...] = ()
        if status is not None:
            q += " WHERE status = ?"
            args = (status,)
        rows = self._rows(q + " ORDER BY created DESC, id LIMIT ?", (*args, limit))
        out = []
        for eid, handler, st, att, mx, err, nxt, raw, outcome, cerr, created, updated in rows:
            doc = serde.decode(raw)
            out.append(EffectRow(id=eid, handler=handler, status=st, attempts=att, max_attempts=mx, last_error=err,
                                 next_at=nxt, operator=doc["op"], key=doc["key"], then=doc["then"], outcome=outcome,
                                 continuation_error=cerr, created=created, updated=updated))
        return out

    def counts(self) -> dict[str, int]:
        """How many effects are in each status."""
        rows = self._rows("SELECT status, count(*) FROM effects GROUP BY status")
        return {s: 0 for s in STATUSES} | {s: n for s, n in rows}

    def retry(self, eid: str) -> bool:
        """Give a parked (``failed``) effect a new round of attempts; False if it is not parked."""
        return self._write("UPDATE effects SET status = 'pending', attempts = 0, next_at = 0, result = NULL, "
                           "outcome = '', updated = ? WHERE id = ? AND status = 'failed'", (time.time(), eid)) == 1

    def abandon(self, eid: str) -> bool:
        """Stop trying a parked or pending effect and resume its continuation with an ``EffectAbandoned`` failure;
        False if it is running, resuming or done."""
        with self._lock:
            row = self._db.execute("SELECT attempts, last_error FROM effects WHERE id = ? AND status IN "
                                   "('failed', 'pending')", (eid,)).fetchone()
            if row is None:
                return False
            result = {"ok": False, "error_type": "EffectAbandoned",
                      "error": f"abandoned by an operator (last error: {row[1] or 'none'})", "attempts": row[0]}
            return self._db.execute(
                "UPDATE effects SET status = 'resuming', result = ?, outcome = 'abandoned', next_at = 0, updated = ? "
                "WHERE id = ? AND status IN ('failed', 'pending')",
                (serde.encode(result), time.time(), eid)).rowcount == 1

    def close(self) -> None:
        self._db.close()


class EffectMetrics:
    """The executor's counters, exposed through prometheus-client (:meth:`prometheus`): the counts are plain
    attributes the executor bumps (read at scrape time by a collector), the attempt latency a histogram."""

    def __init__(self) -> None:
        self.attempts = 0
        self.failures = 0  # attempts that failed (raised or timed out)
        self.exhausted = 0  # effects whose attempts ran out
        self.succeeded = 0
        self.resumed = 0  # continuations submitted and answered
        self.lost = 0  # requests dropped by the stream's retention before they were taken in
        self.store: EffectStore | None = None  # its rows by status, as a gauge
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram("charon_effect_attempt_seconds", "Seconds per effect attempt",
                                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30), registry=self.registry)
        self.registry.register(_EffectCounts(self))

    def observe(self, seconds: float) -> None:
        self.latency.observe(seconds)

    def prometheus(self) -> str:
        return generate_latest(self.registry).decode()


class _EffectCounts(Collector):
    """The counters and the store's gauge of an :class:`EffectMetrics`, read when scraped."""

    def __init__(self, m: EffectMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        for name, doc, value in (
                ("charon_effect_attempts", "Effect attempts", m.attempts),
                ("charon_effect_attempt_failures", "Effect attempts that raised or timed out", m.failures),
                ("charon_effect_exhausted", "Effects whose attempts ran out", m.exhausted),
                ("charon_effect_succeeded", "Effects that succeeded", m.succeeded),
                ("charon_effect_continuations", "Continuations submitted and answered", m.resumed),
                ("charon_effect_requests_lost", "Effect requests the stream dropped before intake", m.lost)):
            yield CounterMetricFamily(name, doc, value=value)
        if m.store is not None:
            g = GaugeMetricFamily("charon_effects", "Effects by status", labels=["status"])
            for status, n in sorted(m.store.counts().items()):
                g.add_metric([status], n)
            yield g

    def describe(self) -> Iterator[Metric]:
        return iter(())


class EffectExecutor:
    """Run the effects of ``app`` recorded on ``streams`` (see the module docstring): worker ``index`` of
    ``workers``; continuations go through ``resume``. ``app`` may be a callable giving the application running now
    (``lambda: engine.app``: after a code update, the new code's handlers run the effects not yet run)."""

    def __init__(self, app: Application | Callable[[], Application],
                 streams: StreamLog | Callable[[], StreamLog | None], resume: Resume,
                 store: EffectStore | str | None = None, *,
                 index: int = 0, workers: int = 1, concurrency: int = 16, max_inflight_bytes: int = 16 << 20,
                 backoff_s: float = 0.2, max_backoff_s: float = 30.0, poll_s: float = 0.05, max_events: int = 1000,
                 park_failed: bool = False) -> None:
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} is not in [0, {workers})")
        if concurrency < 1 or max_inflight_bytes < 1:
            raise ValueError("concurrency and max_inflight_bytes must be positive")
        self.streams: StreamLog  # both set by _open (at start, when an engine has its streams)
        self.store: EffectStore
        self._opened = False
        self._app = app  # or how to get the application running now (an engine's, which a code update switches)
        self._streams_of = streams
        self.resume = resume
        self._store_spec = store
        self.index, self.workers = index, workers
        self.reader = f"{index}/{workers}"
        self.concurrency = concurrency
        self.max_inflight_bytes = max_inflight_bytes
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.poll_s = poll_s
        self.max_events = max_events
        self.park_failed = park_failed
        self.metrics = EffectMetrics()
        self.inflight: dict[str, int] = {}  # effect id -> bytes of its request
        self.inflight_bytes = 0
        self.errors: list[str] = []  # the newest errors of the loop itself (retried)
        self.malformed = 0
        self.lost = 0  # requests dropped by the stream's retention before they were taken in (see intake)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._listener: Callable[[frozenset[str]], None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="charon-effect")

    def _open(self) -> None:
        """The stream log (an engine gives its own once started) and the store (default: ``effects.sqlite`` next to
        the stream log's file)."""
        if self._opened:
            return
        streams = self._streams_of if isinstance(self._streams_of, StreamLog) else self._streams_of()
        if streams is None:
            raise ValueError("effects need an engine with output streams (durable, or in memory with streams)")
        self.streams = streams
        spec = self._store_spec
        if spec is None:
            spec = os.path.join(os.path.dirname(os.path.abspath(streams.path)), EFFECTS_FILE)
        self.store = spec if isinstance(spec, EffectStore) else EffectStore(spec)
        self._opened = True

    # -- operators (charon.server.admin.EffectsAdmin)
    def list_effects(self, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(r) for r in self.store.list(status, limit)]

    def effect_counts(self) -> dict[str, int]:
        return self.store.counts()

    def get_effect(self, effect_id: str) -> dict[str, object] | None:
        row = self.store.get(effect_id)
        return None if row is None else msgspec.to_builtins(row)

    def parked_effects(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(r) for r in self.store.parked(after, limit)]

    def retry_effect(self, effect_id: str) -> bool:
        ok = self.store.retry(effect_id)
        self._poke()
        return ok

    def abandon_effect(self, effect_id: str) -> bool:
        ok = self.store.abandon(effect_id)
        self._poke()
        return ok

    def _poke(self) -> None:
        """Wake the loop now (from any thread)."""
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._wake.set)

    def prometheus(self) -> str:
        self.metrics.lost, self.metrics.store = self.lost, self.store if self._opened else None
        return self.metrics.prometheus()

    # -- intake
    def intake(self) -> int:
        """Record the next request atoms of this worker's effects; returns how many events were read."""
        offset = self.store.offset(self.reader)
        page = self.streams.read(EFFECT_STREAM, offset, self.max_events)
        if page.first_offset > offset:  # the stream's retention dropped requests this worker never took in
            self.lost += page.first_offset - offset
            self._error(ValueError(f"effect requests {offset}..{page.first_offset - 1} were dropped by the stream's "
                                   "retention before this worker took them in (raise the retention or run workers)"))
        docs = []
        for e in page.events:
            doc = serde.decode(e.value)
            if not well_formed(doc):
                self.malformed += 1
                continue
            if effect_partition(doc["id"], self.workers) == self.index:
                docs.append((doc["id"], e.value, doc))
        if page.next_offset != offset:
            self.store.take(self.reader, docs, max(offset, page.next_offset))
        return len(page.events)

    # -- running
    def _backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * (2 ** max(0, attempt - 1)))
        return base * (0.5 + random.random() / 2)  # noqa: S311 - jitter, not security

    async def _call(self, handler: Callable[..., Any], eid: str, args: list[Any], timeout: float) -> Any:
        if inspect.iscoroutinefunction(handler):
            return await asyncio.wait_for(handler(eid, *args), timeout)
        # sync handlers on threads of their own (``concurrency`` of them): a hung one holds its thread until it
        # returns, never one the store needs; when all are held, attempts wait for one and time out
        loop = asyncio.get_running_loop()
        value = await asyncio.wait_for(loop.run_in_executor(self._pool, functools.partial(handler, eid, *args)),
                                       timeout)
        if inspect.isawaitable(value):
            value = await asyncio.wait_for(value, timeout)
        return value

    async def _attempt(self, eid: str, doc: dict[str, Any]) -> None:
        attempt = await asyncio.to_thread(self.store.start_attempt, eid)
        if not attempt:
            return
        self.metrics.attempts += 1
        app = self._app if isinstance(self._app, Application) else self._app()
        handler = app.effects.get(doc["handler"])
        t0 = time.perf_counter()
        try:
            if handler is None:
                raise LookupError(f"no effect handler {doc['handler']!r} in this deployment's application")
            value = await self._call(handler, eid, doc["args"], doc["timeout"])
            size = len(serde.encode_value(value))  # the continuation's argument must be a value ...
        except Exception as exc:  # noqa: BLE001 - any failure of the outside world is an attempt's failure
            self.metrics.observe(time.perf_counter() - t0)
            self.metrics.failures += 1
            kind = "Timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            error = f"{kind}: {exc}" if str(exc) else kind
            if attempt >= doc["attempts"]:
                self.metrics.exhausted += 1
                result = {"ok": False, "error_type": kind, "error": str(exc) or kind, "attempts": attempt}
                await asyncio.to_thread(self.store.resolved, eid, result, "failed", error, self.park_failed)
            else:
                await asyncio.to_thread(self.store.retry_later, eid, error, time.time() + self._backoff(attempt))
            return
        self.metrics.observe(time.perf_counter() - t0)
        if size > MAX_VALUE_BYTES:  # ... within the value limit (any resume path carries that): final, not retried
            self.metrics.failures += 1
            error = str(too_large("the effect handler's value", size))
            result = {"ok": False, "error_type": "ValueTooLarge", "error": error, "attempts": attempt}
            await asyncio.to_thread(self.store.resolved, eid, result, "failed", f"ValueTooLarge: {error}")
            await self._resume(eid, doc, result)
            return
        self.metrics.succeeded += 1
        await asyncio.to_thread(self.store.resolved, eid, {"ok": True, "value": value}, "ok")
        await self._resume(eid, doc, {"ok": True, "value": value}, attempt)

    async def _resume(self, eid: str, doc: dict[str, Any], result: dict[str, Any], attempts: int = 0) -> None:
        try:
            committed, error = await self.resume(doc["op"], doc["key"], doc["then"], [result, *doc["carry"]],
                                                 eid + CONTINUATION_SUFFIX)
        except ContinuationRefused as exc:  # refused before the log: the continuation must still run, once
            if result.get("ok", False):  # with a failure in place of the value it could not carry
                error = f"the continuation with the handler's value was refused: {exc}"
                failure = {"ok": False, "error_type": "ContinuationRefused", "error": error, "attempts": attempts}
                await asyncio.to_thread(self.store.resolved, eid, failure, "failed", f"ContinuationRefused: {error}")
                await self._resume(eid, doc, failure, attempts)
            else:  # even a failure is refused (e.g. a code update removed the continuation): for an operator
                await asyncio.to_thread(self.store.resolved, eid, result, "failed",
                                        f"continuation refused: {exc}", True)
            return
        except Exception as exc:  # noqa: BLE001 - the engine is away: submit the same id again later
            await asyncio.to_thread(self.store.resume_later, eid, f"resume: {type(exc).__name__}: {exc}",
                                    time.time() + self.backoff_s)
            return
        self.metrics.resumed += 1
        await asyncio.to_thread(self.store.done, eid, "" if committed else error)

    async def _run(self, eid: str, status: str, raw: bytes, result: bytes | None, attempts: int = 0) -> None:
        try:
            doc = serde.decode(raw)
            if status == "resuming" and result is not None:
                await self._resume(eid, doc, serde.decode(result), attempts)
            else:
                await self._attempt(eid, doc)
        except Exception as exc:  # noqa: BLE001 - the store failed: the effect stays where it was, retried
            self._error(exc)
        finally:
            self.inflight_bytes -= self.inflight.pop(eid, 0)
            self._wake.set()

    async def dispatch(self) -> int:
        """Start this worker's due effects within the bounds; returns how many started."""
        room = self.concurrency - len(self.inflight)
        if room <= 0:
            return 0
        n = 0
        due = await asyncio.to_thread(self.store.due, self.index, self.workers, time.time(), room, set(self.inflight))
        for eid, status, raw, attempts, result in due:
            if eid in self.inflight:  # started meanwhile
                continue
            size = len(raw) + (len(result) if result else 0)
            if self.inflight and self.inflight_bytes + size > self.max_inflight_bytes:
                break  # bounded in bytes (one effect always fits: it is within the value-size bound)
            self.inflight[eid] = size
            self.inflight_bytes += size
            task = asyncio.ensure_future(self._run(eid, status, raw, result, attempts))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            n += 1
        return n

    async def step(self) -> int:
        """Take in new requests and start due effects; returns how much happened."""
        n = await asyncio.to_thread(self.intake)
        return n + await self.dispatch()

    def _error(self, exc: BaseException) -> None:
        self.errors.append(f"{type(exc).__name__}: {exc}")
        del self.errors[:-100]

    async def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the step: a wake during it (an append, a finished effect) is kept
            try:
                moved = await self.step()
            except Exception as exc:  # noqa: BLE001 - e.g. the stream file is busy: retried
                self._error(exc)
                moved = 0
                await asyncio.sleep(0.1)
            if not moved:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)
                except TimeoutError:
                    pass

    async def start(self) -> None:
        """Recover this worker's interrupted attempts and run in the background."""
        self._open()
        self._event_loop = loop = asyncio.get_running_loop()

        def appended(streams: frozenset[str]) -> None:  # an append by this process: take it in now
            if EFFECT_STREAM in streams:
                loop.call_soon_threadsafe(self._wake.set)

        self._listener = appended
        self.streams.add_listener(appended)
        await asyncio.to_thread(self.store.recover, self.index, self.workers)
        self._stop.clear()
        self._loop_task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop taking work; attempts under way are cancelled (they are retried by the next start)."""
        self._stop.set()
        self._wake.set()
        if self._listener is not None:
            self.streams.remove_listener(self._listener)
            self._listener = None
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def settle(self, timeout: float = 60.0) -> None:
        """Wait until every effect taken in is done or parked (tests and examples)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if (self.store.offset(self.reader) >= self.streams.end_offset(EFFECT_STREAM) and not self.inflight
                    and not any(self.store.counts()[s] for s in ("pending", "running", "resuming"))):
                return
            if loop.time() > deadline:
                raise TimeoutError(f"the effects did not settle: {self.store.counts()}")
            await asyncio.sleep(0.02)


class ContinuationRefused(Exception):  # noqa: N818 - the name says what happened
    """Raised by a :data:`Resume` when the continuation was refused before it reached the engine's log (e.g. a
    gateway's 413 or 422): nothing ran, so the executor submits it again (same request id) with a failure result
    (``error_type`` ``ContinuationRefused``) in place of the handler's value, never dropping it."""


def engine_resume(submit: Callable[..., Awaitable[Any]]) -> Resume:
    """A :data:`Resume` over an engine's ``submit`` (``Engine.submit``): the continuation's reply says whether it
    committed."""

    async def resume(op: str, key: str, fn: str, args: list[Any], rid: str) -> tuple[bool, str]:
        reply = await submit(op, key, fn, args, request_id=rid)
        return reply.ok, "" if reply.ok else f"{reply.error_type}: {reply.error_message}"

    return resume
