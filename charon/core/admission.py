"""Admission control at sequencing: which of an epoch's requests run now, wait, or are refused (429).

One owner for every engine: :meth:`charon.core.epoch.EpochCoordinator.run_epoch` asks :meth:`Admission.admit`
once its requests have TIDs. A decision depends only on what a replay sees too: the requests and TIDs, the state
recorded with the previous epoch (:meth:`Admission.snapshot`: held TIDs, token buckets, run-time overrides), the
code's declarations and the epoch's recorded time. See ``docs/internals/admission.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from charon import serde
from charon.core.bulk import MAX_BULK_LIMIT, MAX_TEXT, match_request, parse_where
from charon.core.limits import Limit, check_target
from charon.messages import Request, is_reserved_id

__all__ = ["BULK_FUNCTIONS", "LIMITS_OPERATOR", "MAX_BUCKETS", "MAX_OVERRIDES", "MAX_WAITING", "Admission", "Decision"]

#: The reserved operator of run-time limit changes travelling the input log (functions ``set``, ``clear``,
#: ``show``; the key is the target).
LIMITS_OPERATOR = "charon.limits"
MAX_WAITING = 10_000  # held requests, all limits together (default of Admission.max_waiting)
MAX_BUCKETS = 65_536  # token buckets tracked (full ones are forgotten)
MAX_OVERRIDES = 1_024  # run-time overrides
#: the ``charon.limits`` functions of a bulk cancel of held requests: ``cancel`` and its dry run ``match``, each
#: with the arguments ``[where, limit, after_tid, reason]`` (:mod:`charon.core.bulk`)
BULK_FUNCTIONS = frozenset({"cancel", "match"})

Bucket = tuple[str, str]  # (target, bucket)
Match = tuple[str, Limit, str]  # (target, limit, bucket)


class _State(msgspec.Struct, omit_defaults=True):
    held: list[int] = []
    buckets: list[tuple[str, str, float, float]] = []  # (target, bucket, tokens, at time)
    overrides: list[tuple[str, Limit | None]] = []  # None: the code's limit removed


@dataclass
class Decision:
    """One epoch's admission: TIDs held (waiting) and refused with (error type, message, reply value)."""

    held: list[int] = field(default_factory=list)
    refused: list[tuple[int, str, str, bytes]] = field(default_factory=list)
    admitted: int = 0


def _decode_args(req: Request) -> object:
    try:
        return serde.decode(req.args)
    except Exception:  # noqa: BLE001 - a malformed request falls in the bucket "" (validation answers it)
        return None


class Admission:
    """The admission state carried from epoch to epoch, and the decisions taken on it."""

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self.held: set[int] = set()  # TIDs in the coordinator's deferred list still to be admitted
        self.buckets: dict[Bucket, tuple[float, float]] = {}  # -> (tokens, at time)
        self.overrides: dict[str, Limit | None] = {}
        #: the earliest epoch time at which a held request may be admitted (-inf: none held; a runtime with
        #: nothing else to do may wait until then instead of running empty epochs; never part of a decision)
        self.retry_at = -math.inf

    # -- the table in force -----------------------------------------------------------------------------
    def table(self, declared: Mapping[str, Limit]) -> dict[str, Limit]:
        """The limits in force: the code's (``declared``, by target) with the run-time overrides over them."""
        if not self.overrides:
            return dict(declared)
        out = dict(declared)
        for t, lim in self.overrides.items():
            if lim is None:
                out.pop(t, None)
            else:
                out[t] = lim
        return out

    def _matches(self, table: Mapping[str, Limit], req: Request, args: object) -> list[Match]:
        out: list[Match] = []
        for target in (f"{req.operator}/{req.function}", req.operator):
            lim = table.get(target)
            if lim is not None:
                out.append((target, lim, lim.bucket(req.key, args)))
        return out

    def _level(self, b: Bucket, lim: Limit, now: float) -> float:
        had = self.buckets.get(b)
        size = lim.size
        if had is None or lim.rate is None:
            return size
        tokens, at = had
        return min(size, tokens + lim.rate * max(0.0, now - at))

    # -- one epoch --------------------------------------------------------------------------------------
    def admit(self, declared: Mapping[str, Limit], now: float, candidates: Iterable[tuple[int, Request]],
              carried: Iterable[tuple[int, Request]]) -> Decision:
        """Decide on ``candidates`` (held ones and the epoch's new requests, (TID, request)) at the epoch's
        recorded time ``now``; ``carried``: transactions already admitted that run in this epoch again (they take
        their concurrency slots first)."""
        table = self.table(declared)
        dec = Decision()
        if not table:
            self.held.clear()
            self.retry_at = -math.inf
            self.buckets.clear()
            return dec
        running: dict[Bucket, int] = {}
        for _, req in carried:
            for target, lim, b in self._matches(table, req, _decode_args(req)):
                if lim.concurrency is not None:
                    running[(target, b)] = running.get((target, b), 0) + 1
        entries: list[tuple[int, int, bool, list[Match]]] = []
        for tid, req in candidates:
            if is_reserved_id(req.request_id):
                continue
            args = _decode_args(req)
            ms = self._matches(table, req, args)
            if ms:
                entries.append((-ms[0][1].priority_of(args), tid, tid in self.held, ms))
        entries.sort(key=lambda e: (e[0], e[1]))
        waiting: dict[Bucket, int] = {}
        fresh: list[tuple[int, list[Match], bool]] = []  # new ones over a limit: (tid, matches, no bucket room)
        held: list[int] = []
        held_ms: list[list[Match]] = []
        for _, tid, was_held, ms in entries:
            ok = True
            crowded = False
            for target, lim, b in ms:
                if lim.concurrency is not None and running.get((target, b), 0) >= lim.concurrency:
                    ok = False
                if lim.rate is not None:
                    if (target, b) not in self.buckets and len(self.buckets) >= MAX_BUCKETS:
                        ok, crowded = False, True
                    elif self._level((target, b), lim, now) < 1.0:
                        ok = False
            if ok:
                for target, lim, b in ms:
                    if lim.concurrency is not None:
                        running[(target, b)] = running.get((target, b), 0) + 1
                    if lim.rate is not None:
                        self.buckets[(target, b)] = (self._level((target, b), lim, now) - 1.0, now)
                dec.admitted += 1
            elif was_held:
                held.append(tid)
                held_ms.append(ms)
                for target, _, b in ms:
                    waiting[(target, b)] = waiting.get((target, b), 0) + 1
            else:
                fresh.append((tid, ms, crowded))
        for tid, ms, crowded in fresh:  # in priority order: who waits first
            full = next(((t, lim, b) for t, lim, b in ms if waiting.get((t, b), 0) >= lim.queue), None)
            if full is not None:
                t, lim, b = full
                wait = (waiting.get((t, b), 0) + 1) / lim.rate if lim.rate else 1.0
                dec.refused.append((tid, "RateLimited", f"{t} ({b or 'all'}): {waiting.get((t, b), 0)} requests "
                                    f"wait (queue {lim.queue}); retry after {max(1.0, wait):.1f} s",
                                    serde.encode({"retry_after": max(1.0, wait)})))
            elif crowded or len(held) >= self.max_waiting:
                why = (f"{MAX_BUCKETS} rate buckets are in use" if crowded
                       else f"{len(held)} requests wait for admission (max_waiting {self.max_waiting})")
                dec.refused.append((tid, "Overloaded", f"{why}; retry later",
                                    serde.encode({"retry_after": 1.0})))
            else:
                held.append(tid)
                held_ms.append(ms)
                for t, _, b in ms:
                    waiting[(t, b)] = waiting.get((t, b), 0) + 1
        self.held = set(held)
        dec.held = sorted(held)
        self.retry_at = min((max([now] + [now + (1.0 - lvl) / lim.rate for t, lim, b in ms if lim.rate is not None
                                          and (lvl := self._level((t, b), lim, now)) < 1.0]) for ms in held_ms),
                            default=-math.inf)
        if self.buckets:  # a full bucket is the same as none: forget it (bounded by recent use)
            self.buckets = {b: v for b, v in self.buckets.items() if self._short(table.get(b[0]), b, now)}
        return dec

    def _short(self, lim: Limit | None, b: Bucket, now: float) -> bool:
        """Whether bucket ``b`` of ``lim`` is not full at ``now`` (a full one need not be kept)."""
        return lim is not None and lim.rate is not None and self._level(b, lim, now) < lim.size

    # -- run-time changes (requests to LIMITS_OPERATOR) --------------------------------------------------
    def change(self, declared: Mapping[str, Limit], req: Request,
               held: Iterable[Request]) -> tuple[bool, bytes, tuple[str, str]]:
        """Apply a ``charon.limits`` request: ``(ok, reply value, (error type, message))``."""
        try:
            if req.function == "show":
                return True, serde.encode(self.status(declared, held)), ("", "")
            target = check_target(req.key)
            if req.function == "set":
                args = serde.decode(req.args)
                if type(args) is not list or len(args) != 1 or type(args[0]) is not dict:
                    raise ValueError("set takes one argument: the limit as a map")
                lim = msgspec.convert(args[0], Limit)
                if target not in self.overrides and len(self.overrides) >= MAX_OVERRIDES:
                    raise ValueError(f"at most {MAX_OVERRIDES} limits may be changed at run time")
                self.overrides[target] = lim
            elif req.function == "remove":
                self.overrides[target] = None
            elif req.function == "clear":
                self.overrides.pop(target, None)
            else:
                raise ValueError(f"unknown limits operation {req.function!r} (set, remove, clear, show)")
        except (ValueError, msgspec.ValidationError) as exc:
            return False, b"", ("BadArguments", str(exc))
        return True, serde.encode(self.status(declared, held)), ("", "")

    def cancel_held(self, req: Request, held: list[tuple[int, Request]]
                    ) -> tuple[tuple[bool, bytes, tuple[str, str]], list[tuple[int, str]]]:
        """A bulk cancel (``match``: its dry run) of the held requests ``held`` ((TID, request), TID order):
        the first ``limit`` of them after TID ``after`` are looked at, those matching ``where`` are cancelled.
        Returns the cancel's reply ``(ok, value, error)`` and the cancelled ``(TID, message)``; the caller answers
        them ``InvocationCancelled`` and leaves them out of this epoch's admission (so they are held no more).
        Decided on logged data only (the requests, their TIDs and append times): a replay cancels the same."""
        try:
            args = serde.decode(req.args)
            if type(args) is not list or len(args) != 4:
                raise ValueError("a bulk cancel takes [where, limit, after, reason]")
            where = parse_where(args[0], "invocations")
            limit, after, reason = args[1], args[2], args[3]
            if type(limit) is not int or not 1 <= limit <= MAX_BULK_LIMIT:
                raise ValueError(f"limit must be an integer in 1..{MAX_BULK_LIMIT}")
            if after is not None and type(after) is not int:
                raise ValueError("after must be an integer (a page's next) or null")
            if type(reason) is not str or len(reason) > MAX_TEXT:
                raise ValueError(f"reason must be a string of at most {MAX_TEXT} characters")
        except (ValueError, msgspec.ValidationError) as exc:
            return (False, b"", ("BadArguments", str(exc))), []
        page = [(t, r) for t, r in held if after is None or t > after]
        more = len(page) > limit
        page = page[:limit]
        hits = [(t, r) for t, r in page if match_request(where, r)]
        dry = req.function == "match"
        gone = [] if dry else [(t, f"{reason} (bulk operation {req.request_id})") for t, _ in hits]
        doc = {"dry_run": dry, "examined": len(page), "matched": len(hits),
               "cancelled": 0 if dry else len(hits), "items": [r.request_id for _, r in hits],
               "held": len(held) - len(gone), "next": str(page[-1][0]) if more and page else None}
        return (True, serde.encode(doc), ("", "")), gone

    def status(self, declared: Mapping[str, Limit], held: Iterable[Request]) -> dict[str, object]:
        """The table in force (with where each limit comes from) and the waiting requests per bucket."""
        table = self.table(declared)
        waiting: dict[str, dict[str, int]] = {}
        total = 0
        for req in held:
            total += 1
            for target, _, b in self._matches(table, req, _decode_args(req)):
                w = waiting.setdefault(target, {})
                if b in w or len(w) < 100:
                    w[b] = w.get(b, 0) + 1
        limits = {t: {**msgspec.to_builtins(lim), "source": "admin" if t in self.overrides else "code"}
                  for t, lim in sorted(table.items())}
        return {"limits": limits, "waiting": waiting, "held": total, "max_waiting": self.max_waiting,
                "removed": sorted(t for t, v in self.overrides.items() if v is None)}

    # -- recorded state ----------------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The state after an epoch, for its record (``b""`` when there is none)."""
        if not (self.held or self.buckets or self.overrides):
            return b""
        return msgspec.msgpack.encode(_State(
            sorted(self.held), [(t, b, tok, at) for (t, b), (tok, at) in sorted(self.buckets.items())],
            sorted(self.overrides.items(), key=lambda o: o[0])))

    def restore(self, data: bytes) -> None:
        """The state an epoch record holds (``b""``: none)."""
        st = msgspec.msgpack.decode(data, type=_State) if data else _State()
        self.held = set(st.held)
        self.buckets = {(t, b): (tok, at) for t, b, tok, at in st.buckets}
        self.overrides = dict(st.overrides)
