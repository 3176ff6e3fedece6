"""Several applications in one deployment, and portals between them (issue 12 items 3, 4).

A :class:`Deployment` holds one started runtime per application (in-process or durable nodes) and the
registry of what each exposes (:attr:`Application.portals`, :attr:`Application.streams`) and uses
(:attr:`Application.uses`). It refuses, with :class:`~charon.errors.UndeclaredPortal`, a ``uses`` entry the
other application does not expose and a wire over a stream that is not exposed or not used.

**Portals.** ``ctx.ask("payments.charge", key, *args, then="on_paid", carry=[...])`` in a function of
application A appends a request event to A's reserved stream ``charon.portal.requests``. A
:class:`PortalRouter` (one per application that uses portals) reads that stream atom by atom, submits each
request to the callee B as ``operator/key.function(*args)`` (the portal's target) under the request's id,
awaits B's reply and submits the continuation ``op/from.then(reply, *carry)`` to A under the id
``<request id>.reply``. What is atomic with what:

* the request is part of A's transaction: it exists iff that transaction commits (it is an event of
  A's epoch atom); its id ``__charon.portal.<A>.<tid>.<inv>.<n>`` is derived from the transaction id, the
  invocation and the ask's rank, so a replayed epoch produces the same id;
* B runs the request as one transaction of its own (B's state changes and B's events are atomic with
  each other, not with A's transaction); a failure of it (an exception: B's transaction aborted) is a
  reply too, ``{"ok": False, ...}``;
* the continuation is a new transaction of A's entity in a later epoch (no coroutine waits across
  epochs); A's state may have changed in between, so the continuation must re-read what it needs.

Exactly once across crashes of either side: B runs each request id once (its request-id dedup: a durable
node remembers ids for ``CHARON_DEDUP_WINDOW_S``), and A runs each continuation id once likewise. The router
keeps the offset of the first request atom not fully answered in ``portals.offset`` next to A's
``streams.sqlite`` (a durable node's ``data_dir``, Spark's ``data_dir``); after a
crash it re-submits from there, getting the stored replies back. The router itself holds nothing else.
Replies arrive in no particular order across requests (each request's continuation follows its reply).

**Across processes** (each application its own process, each killable alone): the callee's process runs a
:class:`PortalServer` that reads the callers' request streams (their ``streams.sqlite`` files), runs the
requests addressed to it and records each reply once (by request id) in its *outbox* (an SQLite file); the
caller's process runs a :class:`ReplyPump` that reads the outboxes and submits the continuations. Both keep
an offset checkpoint and rely on the same request-id dedup, so either process may be SIGKILLed anywhere.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from charon import serde
from charon.core.context import PORTAL_STREAM
from charon.errors import UndeclaredPortal
from charon.log.streams import StreamLog
from charon.messages import Reply
from charon.runtime.wiring import StreamWire, load_offset, store_offset

__all__ = ["Deployment", "PortalOutbox", "PortalRouter", "PortalServer", "ReplyPump"]

_DEFAULT_MAX_EVENTS = 500


_FIELDS = {"rid": str, "portal": str, "key": str, "args": list, "op": str, "from": str, "then": str, "carry": list}


def _well_formed(doc: object) -> bool:
    """A request event as ``ctx.ask`` writes it (anything else on the stream is skipped)."""
    return isinstance(doc, dict) and all(isinstance(doc.get(k), t) for k, t in _FIELDS.items())


def _split(name: str) -> tuple[str, str]:
    app, _, rest = name.partition(".")
    if not app or not rest:
        raise UndeclaredPortal(f"expected 'app.name', got {name!r}")
    return app, rest


class PortalRouter:
    """Carry the portal requests of ``caller`` (a runtime) to the deployment's applications and the
    replies back as continuations (see the module docstring)."""

    def __init__(self, deployment: Deployment, caller: str, *, max_events: int = _DEFAULT_MAX_EVENTS,
                 checkpoint: str | None = None) -> None:
        self.deployment = deployment
        self.caller = caller
        self.runtime = deployment.runtimes[caller]
        self.max_events = max_events
        self.checkpoint = checkpoint
        self.offset = self._load()
        self.requests = 0  # requests answered by this router object (first or retried replies)
        self.continuations = 0
        self.failed: list[Reply] = []  # replies of continuations that aborted (the newest max_events)
        self.malformed = 0  # events of the request stream that are not requests (skipped)

    def _load(self) -> int:
        return load_offset(self.checkpoint)

    def _store(self) -> None:
        store_offset(self.checkpoint, self.offset)

    async def _request(self, doc: dict[str, Any]) -> Reply:
        rid = doc["rid"]
        try:
            app, portal = _split(doc["portal"])
            callee = self.deployment.runtimes.get(app)
            target = callee.app.portals.get(portal) if callee is not None else None
            if callee is None or target is None:
                raise UndeclaredPortal(f"application {app!r} does not expose portal {portal!r}")
        except UndeclaredPortal as exc:
            return Reply(rid, -1, -1, False, error_type="UndeclaredPortal", error_message=str(exc))
        return await callee.submit(target[0], doc["key"], target[1], doc["args"], request_id=rid)

    async def _route(self, value: bytes) -> None:
        doc = serde.decode(value)
        if not _well_formed(doc):
            self.malformed += 1
            return
        reply = await self._request(doc)
        self.requests += 1
        arg: dict[str, Any] = (
            {"ok": True, "value": serde.decode(reply.value) if reply.value else None}
            if reply.ok else {"ok": False, "error_type": reply.error_type, "error": reply.error_message}
        )
        done = await self.runtime.submit(doc["op"], doc["from"], doc["then"], [arg, *doc["carry"]],
                                         request_id=doc["rid"] + ".reply")
        self.continuations += 1
        if not done.ok:  # the continuation aborted (its reply says why); kept for inspection, bounded
            self.failed.append(done)
            del self.failed[:-self.max_events]

    async def step(self) -> int:
        """Route the next request atoms (up to ``max_events`` requests); returns how many were routed."""
        page = self.runtime.streams.read(PORTAL_STREAM, self.offset, self.max_events)
        if not page.events:
            self.offset = max(self.offset, page.next_offset)
            return 0
        await asyncio.gather(*(self._route(e.value) for e in page.events))
        self.offset = page.next_offset
        self._store()
        return len(page.events)


class Deployment:
    """Several started runtimes (one per application, keyed by ``app.name``), their registry, their portal
    routers and stream wires. Use ``async with deployment:`` (or :meth:`start`/:meth:`stop`) after starting
    the runtimes; the runtimes are the caller's to start and stop."""

    def __init__(self, runtimes: Iterable[Any], *, max_events: int = _DEFAULT_MAX_EVENTS, poll_s: float = 0.005):
        self.runtimes: dict[str, Any] = {}
        for rt in runtimes:
            if "." in rt.app.name or not rt.app.name:
                raise ValueError(f"an application in a deployment needs a name without '.', got {rt.app.name!r}")
            if rt.app.name in self.runtimes:
                raise ValueError(f"two applications are named {rt.app.name!r}")
            self.runtimes[rt.app.name] = rt
        for name, rt in self.runtimes.items():
            for use in rt.app.uses:
                self._exposed(name, use)
        self.poll_s = poll_s
        self.routers: dict[str, PortalRouter] = {}
        for name, rt in self.runtimes.items():
            if any(self._is_portal(u) for u in rt.app.uses):
                ck = os.path.join(os.path.dirname(rt.streams.path), "portals.offset")  # by its streams file
                self.routers[name] = PortalRouter(self, name, max_events=max_events, checkpoint=ck)
        self.wires: list[StreamWire] = []
        self._tasks: list[asyncio.Task] = []
        self.errors: list[Exception] = []  # the last 100 errors of background steps (they are retried)
        self._stop = asyncio.Event()

    def _is_portal(self, use: str) -> bool:
        app, rest = _split(use)
        return rest in self.runtimes[app].app.portals

    def _exposed(self, user: str, use: str) -> None:
        app, rest = _split(use)
        rt = self.runtimes.get(app)
        if rt is None:
            raise UndeclaredPortal(f"{user!r} uses {use!r} but no application {app!r} is deployed")
        if rest not in rt.app.portals and rest not in rt.app.streams:
            raise UndeclaredPortal(f"{user!r} uses {use!r} but {app!r} exposes no portal or stream {rest!r}")

    def registry(self) -> dict[str, dict[str, Any]]:
        """What each application exposes and uses: ``{app: {"portals": {name: [op, fn]}, "streams": [...],
        "uses": [...]}}``."""
        return {
            name: {"portals": {p: list(t) for p, t in sorted(rt.app.portals.items())},
                   "streams": sorted(rt.app.streams), "uses": sorted(rt.app.uses)}
            for name, rt in sorted(self.runtimes.items())
        }

    def wire(self, stream: str, to: str, operator: str, function: str, **kwargs: Any) -> StreamWire:
        """Feed the exposed stream ``"app.stream"`` into application ``to`` (which must declare it in
        ``uses``) as invocations ``operator/key.function`` (see :class:`charon.runtime.wiring.StreamWire`)."""
        app, name = _split(stream)
        if app not in self.runtimes or name not in self.runtimes[app].app.streams:
            raise UndeclaredPortal(f"stream {stream!r} is not exposed")
        if to not in self.runtimes or stream not in self.runtimes[to].app.uses:
            raise UndeclaredPortal(f"application {to!r} does not declare {stream!r} in its uses")
        self.runtimes[to].app.resolve(operator, function)
        if "checkpoint" not in kwargs:
            where = os.path.dirname(self.runtimes[to].streams.path)
            kwargs["checkpoint"] = os.path.join(where, f"wire.{app}.{name}.{to}.offset")
        w = StreamWire(self.runtimes[app].streams, name, self.runtimes[to], operator, function,
                       name=f"{app}.{name}.{to}", **kwargs)
        self.wires.append(w)
        return w

    async def step(self) -> int:
        """One pass of every router and wire; returns how many requests/events moved."""
        n = 0
        for r in self.routers.values():
            n += await r.step()
        for w in self.wires:
            n += await w.step()
        return n

    async def _loop(self, step: Any) -> None:
        while not self._stop.is_set():
            try:
                moved = await step()
            except Exception as exc:  # e.g. a runtime stopped: keep the error, retry (nothing is lost)
                self.errors.append(exc)
                del self.errors[:-100]
                moved = 0
                await asyncio.sleep(0.1)
            if not moved:
                await asyncio.sleep(self.poll_s)

    async def start(self) -> None:
        """Run every router and wire in the background."""
        self._stop.clear()
        for r in self.routers.values():
            self._tasks.append(asyncio.create_task(self._loop(r.step)))
        for w in self.wires:
            self._tasks.append(asyncio.create_task(self._loop(w.step)))

    async def stop(self) -> None:
        """Stop the routers and wires (a step under way finishes first)."""
        self._stop.set()
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self, timeout: float = 60.0, quiet_s: float = 0.05) -> None:
        """Wait until no router or wire has moved anything for ``quiet_s`` (for tests and examples)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            before = self._positions()
            await asyncio.sleep(quiet_s)
            if self._positions() == before and all(
                r.offset >= r.runtime.streams.end_offset(PORTAL_STREAM) for r in self.routers.values()
            ) and all(w.offset >= w.source.end_offset(w.stream) for w in self.wires):
                return
            if loop.time() > deadline:
                raise TimeoutError("the deployment did not settle")

    def _positions(self) -> tuple:
        return (tuple(r.offset for r in self.routers.values()), tuple(w.offset for w in self.wires),
                tuple(rt.streams.end_offset(PORTAL_STREAM) for rt in self.runtimes.values()))

    async def __aenter__(self) -> Deployment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()



def _reply_doc(reply: Reply) -> dict[str, Any]:
    if reply.ok:
        return {"ok": True, "value": serde.decode(reply.value) if reply.value else None}
    return {"ok": False, "error_type": reply.error_type, "error": reply.error_message}


class PortalOutbox:
    """The replies of one callee application, each recorded once by request id, read in insertion order."""

    def __init__(self, path: str, *, retain: int = 1_000_000) -> None:
        self.path = path
        self.retain = retain
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS replies (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "caller TEXT NOT NULL, rid TEXT NOT NULL UNIQUE, doc BLOB NOT NULL)")

    def put(self, caller: str, rid: str, doc: dict[str, Any]) -> None:
        """Record ``doc`` as the reply to ``rid`` unless one is recorded already (keeps ``retain`` newest)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute("INSERT OR IGNORE INTO replies (caller, rid, doc) VALUES (?, ?, ?)",
                                   (caller, rid, serde.encode(doc)))
            if cur.rowcount and cur.lastrowid and cur.lastrowid % 1000 == 0:
                self._db.execute("DELETE FROM replies WHERE seq <= ?", (cur.lastrowid - self.retain,))

    def read(self, caller: str, after: int, limit: int) -> list[tuple[int, str, dict[str, Any]]]:
        """Replies for ``caller`` with ``seq > after``: (seq, request id, reply document)."""
        rows = self._db.execute("SELECT seq, rid, doc FROM replies WHERE caller = ? AND seq > ? ORDER BY seq "
                                "LIMIT ?", (caller, after, limit)).fetchall()
        return [(q, r, serde.decode(d)) for q, r, d in rows]

    def close(self) -> None:
        self._db.close()


class PortalServer:
    """In the callee's process: run the portal requests that the ``callers`` (name -> path of their
    ``streams.sqlite``) address to ``runtime``'s application, and record the replies in ``outbox``.
    Checkpoints: ``<checkpoint_dir>/portal-server.<caller>.offset``."""

    def __init__(self, runtime: Any, callers: Mapping[str, str], outbox: PortalOutbox, *,
                 checkpoint_dir: str | None = None, max_events: int = _DEFAULT_MAX_EVENTS) -> None:
        self.runtime = runtime
        self.outbox = outbox
        self.max_events = max_events
        self.sources = {c: StreamLog(p, durable=False) for c, p in callers.items()}
        self._ck = {c: os.path.join(checkpoint_dir, f"portal-server.{c}.offset") if checkpoint_dir else None
                    for c in callers}
        self.offsets = {c: load_offset(self._ck[c]) for c in callers}
        self.served = 0

    async def _serve(self, caller: str, doc: dict[str, Any]) -> None:
        if not _well_formed(doc):
            return
        app, portal = doc["portal"].partition(".")[::2]
        if app != self.runtime.app.name:
            return
        target = self.runtime.app.portals.get(portal)
        if target is None:
            reply = {"ok": False, "error_type": "UndeclaredPortal",
                     "error": f"application {app!r} does not expose portal {portal!r}"}
        else:
            reply = _reply_doc(await self.runtime.submit(target[0], doc["key"], target[1], doc["args"],
                                                         request_id=doc["rid"]))
        self.outbox.put(caller, doc["rid"], {"reply": reply, "op": doc["op"], "from": doc["from"],
                                             "then": doc["then"], "carry": doc["carry"]})
        self.served += 1

    async def step(self) -> int:
        """Serve the next request atoms of every caller; returns how many events were read."""
        n = 0
        for caller, log in self.sources.items():
            page = log.read(PORTAL_STREAM, self.offsets[caller], self.max_events)
            if page.events:
                await asyncio.gather(*(self._serve(caller, serde.decode(e.value)) for e in page.events))
                n += len(page.events)
            if page.next_offset != self.offsets[caller]:
                self.offsets[caller] = max(self.offsets[caller], page.next_offset)
                store_offset(self._ck[caller], self.offsets[caller])
        return n


class ReplyPump:
    """In the caller's process: submit the replies that the callees recorded for ``runtime``'s application
    (``outboxes``: callee name -> :class:`PortalOutbox`) as continuations (the outbox entry names the
    continuation: operator, key, function, carry). Checkpoints:
    ``<checkpoint_dir>/reply-pump.<callee>.offset``."""

    def __init__(self, runtime: Any, outboxes: Mapping[str, PortalOutbox], *, checkpoint_dir: str | None = None,
                 max_events: int = _DEFAULT_MAX_EVENTS) -> None:
        self.runtime = runtime
        self.outboxes = dict(outboxes)
        self.max_events = max_events
        self._ck = {c: os.path.join(checkpoint_dir, f"reply-pump.{c}.offset") if checkpoint_dir else None
                    for c in outboxes}
        self.offsets = {c: load_offset(self._ck[c]) for c in outboxes}
        self.continuations = 0
        self.failed: list[Reply] = []  # replies of continuations that aborted (the newest max_events)
        self.malformed = 0  # events of the request stream that are not requests (skipped)

    async def _resume(self, rid: str, doc: dict[str, Any]) -> None:
        done = await self.runtime.submit(doc["op"], doc["from"], doc["then"], [doc["reply"], *doc["carry"]],
                                         request_id=rid + ".reply")
        self.continuations += 1
        if not done.ok:  # the continuation aborted; kept for inspection, bounded
            self.failed.append(done)
            del self.failed[:-self.max_events]

    async def step(self) -> int:
        """Submit the next recorded replies as continuations; returns how many."""
        n = 0
        for callee, box in self.outboxes.items():
            rows = box.read(self.runtime.app.name, self.offsets[callee], self.max_events)
            if not rows:
                continue
            await asyncio.gather(*(self._resume(rid, doc) for _, rid, doc in rows))
            self.offsets[callee] = rows[-1][0]
            store_offset(self._ck[callee], self.offsets[callee])
            n += len(rows)
        return n
