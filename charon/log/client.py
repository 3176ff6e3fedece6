"""Submitting requests through the input log and awaiting their replies from the output log.

Used by the Spark runtime's ``submit`` (and so by the gateway): appends are group-committed (one SQLite
transaction for every request that arrived in the last few milliseconds, after S-Store's group commit),
and a single task tails the output log and resolves the waiting futures, instead of every request polling.

Failure behaviour: an append that fails (e.g. the log stays locked longer than SQLite's busy wait) is
retried with exponential backoff for up to ``append_retry_s`` seconds; if it still fails, the waiters of
that batch get :class:`~charon.errors.LogUnavailable` (nothing of theirs was appended, a retry with the
same request id is safe) and the pump keeps serving everyone else. A request that has waited ``RECHECK_S`` is
looked up by id in the output log, besides the tail read: a reply stored before this client's tail position (a
lookup at submit that missed it) still reaches its waiter. A request id already in the log with a
different operator, key, function or arguments raises :class:`~charon.errors.IdempotencyConflict`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
import uuid
from collections.abc import Sequence

from charon import serde
from charon.core.routing import check_key
from charon.errors import IdempotencyConflict, LogUnavailable
from charon.log.contract import InputLogLike, OutputLogLike
from charon.messages import Reply, Request

log = logging.getLogger(__name__)
RECHECK_S = 2.0  # a request waiting this long has its reply looked up by id (not only in the tail read) ...
RECHECK_MAX = 256  # ... at most this many per look (the longest waiting first)


def check_same_request(stored: Request | None, req: Request) -> None:
    """Raise IdempotencyConflict if ``req`` reuses ``stored``'s id for another operation (the one rule)."""
    if stored is None:
        return
    if (stored.operator, stored.key, stored.function) != (req.operator, req.key, req.function):
        what = f"{stored.operator}/{stored.key}.{stored.function}"
    elif stored.args != req.args:
        what = f"{stored.operator}/{stored.key}.{stored.function} with other arguments"
    else:
        return
    raise IdempotencyConflict(f"request id {req.request_id!r} was already used for {what}")


def _differs(stored: Request, req: Request) -> bool:
    """Whether ``req`` reuses ``stored``'s id for another operation (:func:`check_same_request` raises then)."""
    return (stored.operator, stored.key, stored.function, stored.args) != (req.operator, req.key, req.function,
                                                                          req.args)


def stored_request(input_log: InputLogLike, request_id: str) -> Request | None:
    """The request appended under ``request_id`` if the log still holds it (None if unknown or truncated)."""
    return lookup_request(input_log, request_id)[1]


def lookup_request(input_log: InputLogLike, request_id: str) -> tuple[bool, Request | None]:
    """``(known, request)``: whether the log knows ``request_id`` (its ids outlive truncation), and the request
    appended under it if the log still holds it."""
    pos = input_log.position(request_id)
    if pos is None:
        return False, None
    try:
        got = input_log.read(pos[0], pos[1], pos[1] + 1)
    except ValueError:  # truncated
        return True, None
    return True, got[0] if got else None


class LogClient:
    """Async submit over an input log and an output log (one instance per event loop)."""

    def __init__(
        self, input_log: InputLogLike, output_log: OutputLogLike, poll_s: float = 0.001, append_retry_s: float = 60.0,
        group_commit_s: float = 0.001,
    ) -> None:
        """``group_commit_s``: appends start at most this often, so that one SQLite transaction (and sync)
        takes every request of that window rather than one each (1 ms: at most a thousand appends a second,
        whatever the rate). ``poll_s``: how often the output log's change counter is looked at while waiting."""
        self.input_log = input_log
        self.output_log = output_log
        self.poll_s = poll_s
        self.group_commit_s = group_commit_s
        self._last_append = 0.0
        self.append_retry_s = append_retry_s
        self._pending: list[Request] = []
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._requests: dict[str, Request] = {}  # the request of each waiter (for the conflict check)
        self._since: dict[str, float] = {}  # when each waiter started waiting (monotonic; oldest first)
        self._given: set[str] = set()  # pending ids a client chose: looked up before their append
        self._recheck_at = 0.0
        self._seq = output_log.last_seq()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._pump())

    def replies_written(self, replies: Sequence[Reply]) -> None:
        """From any thread: ``replies`` were just written to the output log (by a writer in this process), so
        their waiters here are answered now, not at the pump's next read (which finds them answered)."""
        loop = self._loop
        if loop is not None and self._waiters:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._answer, replies)

    def _answer(self, replies: Sequence[Reply]) -> None:
        for rep in replies:
            if rep.request_id in self._waiters:
                self._resolve(rep.request_id, rep)

    def _lookup(self, rid: str) -> tuple[Reply | None, Request | None]:
        return self.output_log.get(rid), stored_request(self.input_log, rid)

    def pending(self) -> int:
        """How many submits here wait for their reply."""
        return len(self._waiters)

    def waiting(self) -> list[Request]:
        """The requests submitted here that have no reply yet (a copy; from any thread: a RuntimeError when the
        loop changed them meanwhile)."""
        return list(self._requests.values())

    def is_pending(self, request_id: str) -> bool:
        """Whether the request is in the input log (or waiting to be appended here) but not answered."""
        if request_id in self._waiters:
            return True
        return self.output_log.get(request_id) is None and self.input_log.contains(request_id)

    async def submit(
        self, operator: str, key: str, function: str, args: Sequence[object] = (), *, request_id: str | None = None,
        timeout: float = 120.0,
    ) -> Reply:
        """Append one request (group-committed) and wait for its reply; a known request id runs once."""
        check_key(key)  # the log cannot hold every string (lone surrogates); the engine checks the rest again
        req = Request(request_id or uuid.uuid4().hex, operator, key, function, serde.encode(list(args)), time.time())
        rid = req.request_id
        fut = self.enqueue(req, given=request_id is not None)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply for request {rid} within {timeout} s") from None

    def enqueue(self, req: Request, given: bool = True) -> asyncio.Future[Reply]:
        """Register ``req`` (its arguments encoded, its key checked) and return its reply to come, without a
        coroutine per request (on the loop). Requests are appended in the order they came here (a client's next
        request after an accepted one runs after it); ``given``: the id is the client's, so the appender looks
        it up first (a stored reply answers it, another operation under it is an ``IdempotencyConflict``), for
        its whole batch in one thread hop. A request whose id waits here already shares its future."""
        rid = req.request_id
        fut = self._waiters.get(rid)
        if fut is None:
            fut = self._waiters[rid] = asyncio.get_running_loop().create_future()
            self._requests[rid] = req
            self._since[rid] = time.monotonic()
            self._pending.append(req)
            if given:
                self._given.add(rid)
            self._wake.set()
        else:
            check_same_request(self._requests.get(rid), req)
        self._ensure_task()
        return fut

    def _resolve(self, rid: str, rep: Reply | None = None, exc: BaseException | None = None) -> None:
        fut = self._waiters.pop(rid, None)
        self._requests.pop(rid, None)
        self._since.pop(rid, None)
        if fut is not None and not fut.done():
            if exc is not None:
                fut.set_exception(exc)
                fut.exception()  # a waiter may have timed out: never warn "exception never retrieved"
            else:
                assert rep is not None  # a reply or an error, never neither
                fut.set_result(rep)

    def _fresh(self, batch: list[Request], given: set[str]
               ) -> tuple[list[Request], list[tuple[Request, Reply | None, Request | None]]]:
        """In the appender's thread: the batch's requests to append, and those whose client-chosen id the logs
        know (with their stored reply and request): answered with the stored reply, or refused as a conflict."""
        fresh: list[Request] = []
        known: list[tuple[Request, Reply | None, Request | None]] = []
        for req in batch:
            if req.request_id in given:
                done, stored = self._lookup(req.request_id)
                if done is not None or (stored is not None and _differs(stored, req)):
                    known.append((req, done, stored))
                    continue
            fresh.append(req)
        return fresh, known

    async def _check_and_append(self, batch: list[Request]) -> None:
        """The batch's id lookups (one thread hop), then the append of what is new (:meth:`_append`)."""
        ids = {r.request_id for r in batch if r.request_id in self._given}
        if ids:
            try:
                batch, known = await asyncio.to_thread(self._fresh, batch, ids)
            except (sqlite3.Error, OSError) as exc:  # the logs cannot be read: nothing of the batch is appended
                err = LogUnavailable(f"the input log could not be read: {exc}; retry with the same id")
                for req in batch:
                    self._resolve(req.request_id, exc=err)
                return
            finally:
                self._given.difference_update(ids)
            for req, done, stored in known:
                try:
                    check_same_request(stored, req)
                except IdempotencyConflict as exc:
                    self._resolve(req.request_id, exc=exc)
                    continue
                assert done is not None
                self._resolve(req.request_id, done)
        if batch:
            await self._append(batch)

    async def _append(self, batch: list[Request]) -> None:
        """Append with retries and backoff; on final failure fail the batch's waiters (never the pump)."""
        deadline = time.monotonic() + self.append_retry_s
        delay = 0.05
        while True:
            try:
                await asyncio.to_thread(self.input_log.append_many, batch)
                return
            except (sqlite3.Error, OSError) as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("input log append failed for %d request(s): %s", len(batch), exc)
                    err = LogUnavailable(f"the input log did not take the request: {exc}; retry with the same id")
                    for req in batch:
                        self._resolve(req.request_id, exc=err)
                    return
                log.info("input log append failed (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except Exception as exc:  # not transient (e.g. an unencodable request): fail it alone, not the pump
                if len(batch) > 1:
                    for req in batch:
                        await self._append([req])
                    return
                log.warning("input log refused request %r: %s", batch[0].request_id, exc)
                self._resolve(batch[0].request_id, exc=LogUnavailable(f"the input log refused the request: {exc}"))
                return

    async def _recheck(self, before: float) -> None:
        """Look up by id the replies of the requests waiting since ``before`` (at most ``RECHECK_MAX``)."""
        ids: list[str] = []
        for rid, t in self._since.items():  # insertion order: the longest waiting first
            if t > before or len(ids) >= RECHECK_MAX:
                break
            ids.append(rid)
        if not ids:
            return
        try:
            found = await asyncio.to_thread(lambda: [(rid, self.output_log.get(rid)) for rid in ids])
        except Exception as exc:  # noqa: BLE001 - the tail read goes on; the next look tries again
            log.info("output log lookup failed (%s); looking again in %.1f s", exc, RECHECK_S)
            return
        for rid, rep in found:
            if rep is not None:
                self._resolve(rid, rep)

    async def _pump(self) -> None:
        """Append what is pending, read the replies that arrived, sleep ``poll_s`` (or until a submit)
        when nothing came. The output log is only read (in a worker thread) when its ``data_version`` moved:
        a poll that finds nothing costs one pragma in this thread, not a thread hop and a query."""
        seen: int | None = None
        limit = 100_000
        while self._waiters or self._pending:
            rows: list[tuple[int, Reply]] = []
            try:
                if self._pending:
                    wait = self._last_append + self.group_commit_s - time.monotonic()
                    if wait > 0:  # the window of the previous append is still open: gather more
                        await asyncio.sleep(wait)
                    self._last_append = time.monotonic()
                    batch, self._pending = self._pending, []
                    await self._check_and_append(batch)
                # a log without a cheap change counter (NATS: None) is read on every pass
                version = self.output_log.version()
                if version is None or version != seen:
                    rows = await asyncio.to_thread(self.output_log.read_since, self._seq, limit)
                    if len(rows) < limit:  # else more are waiting: read again before sleeping
                        seen = version
            except (sqlite3.Error, OSError) as exc:  # the output log is briefly unavailable: try again
                log.info("output log read failed (%s); retrying", exc)
                seen = None
                await asyncio.sleep(0.1)
                continue
            for seq, rep in rows:
                self._seq = max(self._seq, seq)
                self._resolve(rep.request_id, rep)
            now = time.monotonic()
            if self._since and now >= self._recheck_at:
                self._recheck_at = now + RECHECK_S
                await self._recheck(now - RECHECK_S)
            if not rows:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)
                except TimeoutError:
                    pass
