"""The invocation inspector's store: what happened to each request (``GET /admin/requests``, ``charon requests``).

One owner for both engines. The runtime hands it each batch of replies as they go out (:meth:`Inspector.replied`)
with what the coordinator observed of their transactions (``EpochCoordinator.trace``: the invocations each ran, and
the traceback of a function that raised). That observation travels beside the replies, never in them, in the input
log or in state. Requests still waiting or deferred come from the engine (``live``) when asked.

Bounded: at most ``max_records`` records and ``max_bytes`` bytes of them (the oldest dropped first), call graphs of
at most ``max_nodes`` invocations (``truncated``). Kept in memory only: a restart starts with an empty inspector.

Every abort also logs one WARNING record on the ``charon.requests`` logger, rate-limited (:class:`AbortLog`).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from charon import serde
from charon.core.partition import ASYNC, ROOT, Observed
from charon.errors import BadRequest
from charon.messages import Reply, Request
from charon.runtime.contract import REQUEST_STATUSES, RequestLog, RequestQuery

__all__ = ["AbortLog", "Inspector", "InspectorSettings", "LiveRequest"]

LOG = logging.getLogger("charon.requests")
_KINDS = {ROOT: "root", ASYNC: "send"}  # else "call"
_OVERHEAD = 256  # bytes counted per record beside its strings (the object, its fields)
_NODE_BYTES = 112  # bytes counted per observed invocation (its tuple and list slot)
#: (request, status "pending" | "deferred", the time its epoch started or None): what the engine has not answered
LiveRequest = tuple[Request, str, float | None]


@dataclasses.dataclass(frozen=True)
class InspectorSettings:
    """``enabled``: record requests (off: nothing recorded, aborts still logged); ``max_records``/``max_bytes``:
    retention (the oldest go first); ``max_nodes``: invocations kept of one call graph; ``log_rate``: abort log
    records per second at most (a burst of as many), the rest counted in a "suppressed" line; ``log_aborts``: off
    only for a scratch runtime (the engine's warm-up)."""

    enabled: bool = True
    max_records: int = 10_000
    max_bytes: int = 32 << 20
    max_nodes: int = 1000
    log_rate: float = 10.0
    log_aborts: bool = True

    def __post_init__(self) -> None:
        if self.max_records < 1 or self.max_bytes < 1 or self.max_nodes < 1:
            raise ValueError("inspector retention (records, bytes, nodes) must be at least 1")
        if self.log_rate <= 0:
            raise ValueError("log_rate must be positive")


class AbortLog:
    """One WARNING record per abort on ``charon.requests`` (fields in ``extra``), at most ``rate`` per second with a
    burst of as many (a token bucket); the aborts past it are counted and reported in one "suppressed" record when
    the bucket has a token again."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.tokens = rate
        self.clock = clock
        self.last = clock()
        self.suppressed = 0

    def abort(self, rid: str, op: str, fn: str, key: str, etype: str, message: str, tb: str | None) -> None:
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1.0:
            self.suppressed += 1
            return
        self.tokens -= 1.0
        if self.suppressed:
            LOG.warning("suppressed %d aborts (more than %g per second)", self.suppressed, self.rate,
                        extra={"suppressed": self.suppressed})
            self.suppressed = 0
        LOG.warning("request %s aborted: %s.%s on key %r raised %s: %s", rid, op, fn, key, etype, message,
                    extra={"request_id": rid, "operator": op, "function": fn, "key": key, "error_type": etype,
                           "error_message": message, "traceback": tb})


class _Record:
    """One answered request, kept as observed (the summary and the call graph are built when read)."""

    __slots__ = ("seq", "op", "key", "fn", "reply", "tb", "accepted", "sequenced", "replied", "seen", "truncated",
                 "size")
    seq: int
    op: str
    key: str
    fn: str
    reply: Reply
    tb: str | None
    accepted: float | None
    sequenced: float | None
    replied: float
    seen: list[Observed]  # what the coordinator observed of its last run (see Inspector._take)
    truncated: bool
    size: int

    def summary(self) -> dict[str, object]:
        r = self.reply
        ok = r.ok
        return {"request_id": r.request_id, "operator": self.op, "key": self.key, "function": self.fn,
                "status": "committed" if ok else "quarantined" if r.error_type == "Quarantined" else "aborted",
                "error_type": None if ok else r.error_type, "epoch": r.epoch, "position": r.position,
                "accepted_at": self.accepted, "sequenced_at": self.sequenced, "replied_at": self.replied}

    def graph(self) -> list[dict[str, object]]:
        """The call graph, root first, each invocation after its caller (in invocation-id order)."""
        invs: dict[str, tuple[str, str, str, int]] = {}
        raised: set[str] = set()
        for t in self.seen:
            if len(t) == 6:
                invs[t[1]] = (t[2], t[3], t[4], t[5])
            else:
                raised.add(t[1])
        ok = self.reply.ok
        order = sorted(invs, key=_inv_path)
        index = {inv: i for i, inv in enumerate(order)}
        out: list[dict[str, object]] = []
        for i, inv in enumerate(order):
            op, key, fn, kind = invs[inv]
            out.append({"index": i, "parent": index.get(inv.rpartition(".")[0]) if "." in inv else None,
                        "kind": _KINDS.get(kind, "call"), "operator": op, "key": key, "function": fn,
                        "outcome": "ok" if ok else ("raised" if inv in raised else None)})
        return out


def _inv_path(inv: str) -> tuple[int, ...]:
    return tuple(int(p) for p in inv.split("."))


class Inspector(RequestLog):
    """The store (see the module docstring). ``live()``: the engine's unanswered requests, asked per search."""

    def __init__(self, settings: InspectorSettings | None = None,
                 live: Callable[[], Iterable[LiveRequest]] | None = None) -> None:
        self.settings = s = settings or InspectorSettings()
        self.live = live
        self.aborts = AbortLog(s.log_rate)
        self._records: OrderedDict[str, _Record] = OrderedDict()  # by request id, oldest first
        self._tids: dict[int, str] = {}  # the kept records' request ids by TID (a workflow's history names TIDs)
        self._bytes = 0
        self._seq = 0
        # by TID: what was observed of transactions not answered yet (their last run's invocations and tracebacks)
        self._open: dict[int, list[Observed]] = {}
        self._lock = threading.Lock()
        #: the engine replays logged epochs (a recovery): their replies are recorded, their aborts not logged again
        self.replaying = False

    @property
    def observe(self) -> bool:
        """Whether the coordinator should observe its partitions' invocations (``EpochCoordinator.observe``)."""
        return self.settings.enabled

    # -- recording (the engine's thread) -----------------------------------------------------------------------
    def replied(self, replies: list[Reply], requests: Mapping[int, Request], trace: list[Observed],
                sequenced_at: float | None) -> None:
        """Record ``replies`` (``requests``: their transactions' requests by TID; ``trace``: what the coordinator
        observed since the last call, taken from it; ``sequenced_at``: when their epoch started); log the aborts."""
        s = self.settings
        opened = self._open
        if trace and s.enabled:
            for t in trace:  # a run from the root replaces what an earlier run of the transaction did
                tid = t[0]
                seen = opened.get(tid)
                if seen is None or (len(t) == 6 and t[5] == ROOT):
                    opened[tid] = [t]
                else:
                    seen.append(t)
        now = time.time()
        recs: list[_Record] = []
        cap = s.max_nodes
        for r in replies:
            req = requests.get(r.tid)
            seen = opened.pop(r.tid, None) if opened else None
            ok = r.ok
            if ok and not s.enabled:
                continue
            op, key, fn = (req.operator, req.key, req.function) if req is not None else ("", "", "")
            tb = None
            if not ok:
                if seen:
                    tbs = [t for t in seen if len(t) == 3]
                    if tbs:
                        tb = max(tbs, key=lambda t: _inv_path(t[1]))[2]  # the innermost
                if s.log_aborts and not self.replaying:
                    self.aborts.abort(r.request_id, op, fn, key, r.error_type, r.error_message, tb)
                if not s.enabled:
                    continue
            rec = _Record()
            rec.op, rec.key, rec.fn, rec.reply, rec.tb = op, key, fn, r, tb
            rec.accepted = req.ts if req is not None and req.ts else None
            rec.sequenced, rec.replied = sequenced_at, now
            if seen is None:
                seen = []
            rec.truncated = len(seen) > cap
            rec.seen = seen[:cap] if rec.truncated else seen
            # the strings of a node are shared with the engine's messages: a node costs its tuple and list slot
            rec.size = (_OVERHEAD + len(r.value) + len(r.error_message) + (len(tb) if tb else 0) + len(r.request_id)
                        + _NODE_BYTES * len(rec.seen))
            recs.append(rec)
        if recs:
            self._keep(recs)
        if len(opened) > 4 * s.max_records:  # observed but never answered here (e.g. a failed epoch's): bounded
            for tid in list(opened)[: len(opened) - 4 * s.max_records]:
                del opened[tid]

    def _keep(self, recs: list[_Record]) -> None:
        s = self.settings
        with self._lock:
            kept = self._records
            for rec in recs:
                self._seq += 1
                rec.seq = self._seq
                rid = rec.reply.request_id
                old = kept.pop(rid, None)
                if old is not None:
                    self._bytes -= old.size
                    self._forget(old)
                kept[rid] = rec
                self._tids[rec.reply.tid] = rid
                self._bytes += rec.size
            while kept and (len(kept) > s.max_records or self._bytes > s.max_bytes):
                _, old = kept.popitem(last=False)
                self._bytes -= old.size
                self._forget(old)

    def _forget(self, rec: _Record) -> None:
        if self._tids.get(rec.reply.tid) == rec.reply.request_id:
            del self._tids[rec.reply.tid]

    # -- reading (any thread) ----------------------------------------------------------------------------------
    def retention(self) -> dict[str, object]:
        with self._lock:
            oldest = next(iter(self._records.values()), None)
            return {"max_records": self.settings.max_records, "max_bytes": self.settings.max_bytes,
                    "oldest": None if oldest is None else (oldest.accepted or oldest.replied),
                    "records": len(self._records), "bytes": self._bytes}

    def _live(self) -> list[LiveRequest]:
        if self.live is None or not self.settings.enabled:
            return []
        try:
            return list(self.live())
        except RuntimeError:  # a list changed size while copied in another thread: report none this time
            return []

    def search(self, query: RequestQuery) -> dict[str, object]:
        q = query
        if q.status is not None and q.status not in REQUEST_STATUSES:
            raise BadRequest(f"status must be one of {', '.join(REQUEST_STATUSES)}")
        after = _decode_cursor(q.cursor) if q.cursor else None
        items: list[dict[str, object]] = []
        nxt: tuple[int, float, str] | None = None

        def match(d: dict[str, object]) -> bool:
            if q.status is not None and d["status"] != q.status:
                return False
            for f in ("operator", "key", "function", "error_type"):
                want = getattr(q, f)
                if want is not None and d[f] != want:
                    return False
            ep = d["epoch"]
            if q.epoch_min is not None and not (isinstance(ep, int) and ep >= q.epoch_min):
                return False
            if q.epoch_max is not None and not (isinstance(ep, int) and ep <= q.epoch_max):
                return False
            t = d["accepted_at"] or d["replied_at"]
            if q.since is not None and not (isinstance(t, float) and t >= q.since):
                return False
            return q.until is None or (isinstance(t, float) and t <= q.until)

        live = self._live()
        with self._lock:
            recs = list(self._records.values())
        answered = {r.reply.request_id for r in recs} if live else set()

        def newest_first() -> Iterable[tuple[tuple[int, float, str], dict[str, object]]]:
            # unanswered requests are newer than every answered one; then the records, newest first
            for req, status, seq_at in sorted(live, key=lambda x: (x[0].ts, x[0].request_id), reverse=True):
                if req.request_id not in answered:
                    yield (1, float(req.ts), req.request_id), _live_summary(req, status, seq_at)
            for rec in reversed(recs):
                yield (0, float(rec.seq), rec.reply.request_id), rec.summary()

        last: tuple[int, float, str] | None = None
        for key, d in newest_first():
            if after is not None and key >= after:
                continue
            if not match(d):
                continue
            if len(items) == q.limit:
                nxt = last
                break
            items.append(d)
            last = key
        return {"items": items, "next": None if nxt is None else _encode_cursor(nxt), "retention": self.retention()}

    def call_graph(self, request_id: str) -> list[dict[str, object]] | None:
        with self._lock:
            rec = self._records.get(request_id)
        return None if rec is None else rec.graph()

    def by_tid(self, tid: int) -> dict[str, object] | None:
        with self._lock:
            rid = self._tids.get(tid)
        return None if rid is None else self.detail(rid)

    def detail(self, request_id: str) -> dict[str, object] | None:
        with self._lock:
            rec = self._records.get(request_id)
        if rec is None:
            for req, status, seq_at in self._live():
                if req.request_id == request_id:
                    return {**_live_summary(req, status, seq_at), "reply": None, "error": None, "call_graph": [],
                            "truncated": False}
            return None
        r = rec.reply
        return {**rec.summary(),
                "reply": (serde.decode(r.value) if r.value else None) if r.ok else None,
                "error": None if r.ok else {"type": r.error_type, "message": r.error_message, "traceback": rec.tb},
                "call_graph": rec.graph(), "truncated": rec.truncated}


def _live_summary(req: Request, status: str, sequenced_at: float | None) -> dict[str, object]:
    return {"request_id": req.request_id, "operator": req.operator, "key": req.key, "function": req.function,
            "status": status, "error_type": None, "epoch": None, "position": None, "accepted_at": req.ts or None,
            "sequenced_at": sequenced_at, "replied_at": None}


def _encode_cursor(key: tuple[int, float, str]) -> str:
    raw = serde.encode(list(key))
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[int, float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        phase, t, rid = serde.decode(raw)
        if phase not in (0, 1) or not isinstance(rid, str):
            raise ValueError
        return (int(phase), float(t), rid)
    except Exception:  # noqa: BLE001 - any malformed cursor is the caller's error
        raise BadRequest("cursor is not one this server gave (pass a page's 'next' unchanged)") from None
