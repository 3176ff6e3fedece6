"""The epoch protocol (Styx §5–§6, Aria): the coordinator every runtime calls to run one epoch.

1. Sequencing: requests get TIDs from the :class:`~charon.core.sequencer.Sequencer`; transactions deferred by
   the previous epoch keep their (lower) TIDs, hence their priority.
2. Dry run: rounds of the runtime's :class:`Exchange` until no message is in flight; every transaction
   runs against the previous epoch's state plus its own writes; each partition reports the entities each
   transaction read or wrote. A call graph is complete when its ack shares (exact dyadic integers,
   :mod:`charon.core.shares`) sum to 1.
3. Lock-free commit (Aria): a transaction commits unless a lower TID wrote an entity it read or wrote.
   A transaction that raised is aborted for good (its error is the reply) unless it read an entity a
   lower TID wrote, in which case it is rerun like a conflict. Replies go out at once (early replies).
4. Fallback, in TID order. First the call-graph cache: every conflicting transaction's dry-run
   invocations are re-run at their partitions in one round with their cached arguments and replies; the
   ones that replay identically and share no entity with a lower unresolved transaction commit. The rest
   rerun from the root under deterministic locks on their known entity sets, acquired in TID order; one
   that touches an entity outside its set moves to the next epoch, keeping its TID.
5. Finalize: each partition writes the epoch's delta to its store, idempotently.

The serial order: first every outcome decided without the fallback (validation errors, lock-free
commits, immediate aborts) in TID order, then the fallback's outcomes in TID order. Running the epoch's
transactions one at a time in that order on the state before the epoch gives exactly the state after it
and the same replies (see ``charon.testing``). Each reply carries its place in it (:func:`position`), known
when the reply is sent, so ordering all replies by (epoch, position) is a serial order of the whole
history; ``EpochResult.order`` is the epoch's TIDs sorted by position.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from charon import serde
from charon.core import timers as _timers
from charon.core.partition import MAX_INVOCATIONS, ROOT, Control, Invoke, RoundOutput, too_many_invocations
from charon.core.partition import Reply as ReplyMsg
from charon.core.routing import partition_of
from charon.core.sequencer import Sequencer
from charon.core.shares import ONE, ZERO, Share, add, is_one
from charon.errors import CallGraphLimitExceeded, CharonError
from charon.messages import Reply, Request
from charon.operator import Application

MAX_REQUEUES = 3  # re-runs of one transaction with a grown read/write set within an epoch
Entity = tuple[str, str]
Event = tuple[int, str, bytes]  # (tid, stream, encoded value)


class Exchange(Protocol):
    """How a runtime moves one round's messages to the partitions and back."""

    partitions: int

    def round(self, control: Control, inboxes: list[list[Invoke | ReplyMsg]]) -> list[RoundOutput]: ...


@dataclass
class EpochResult:
    """Outcome of one epoch."""

    epoch: int
    replies: dict[int, Reply]  # by TID
    requests: dict[int, Request]  # by TID, every transaction run in this epoch
    order: list[int]  # committed and definitively aborted TIDs in serial order (by Reply.position)
    lockfree: list[int] = field(default_factory=list)
    fast: list[int] = field(default_factory=list)  # committed by the call-graph-cached fallback
    slow: list[int] = field(default_factory=list)  # committed or aborted by the locked fallback
    deferred: list[int] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    # the epoch's atom: committed transactions' events (tid, stream, value) in serial order (Context.emit)
    events: list[Event] = field(default_factory=list)
    time: float = 0.0  # the epoch's deterministic time (Sequencer.advance)
    timers: list[_timers.Timer] = field(default_factory=list)  # fired at the epoch's start, in TID order


def position(tid: int, last_tid: int, fallback: bool) -> int:
    """A reply's place in its epoch's serial order (monotone, not dense).

    ``last_tid`` is the highest TID of the epoch (known once it is sequenced); a fallback outcome comes
    after every outcome decided without the fallback.
    """
    return last_tid + 1 + tid if fallback else tid


def atom_order(events: list[tuple[int, str, int, str, bytes]], replies: dict[int, Reply]) -> list[Event]:
    """An epoch's committed events as (tid, stream, value) in atom order: by the transaction's place in the
    serial order, then by invocation (an invocation before its callees, callees in call order), then by
    emit order within the invocation. Placement-independent, so the same on every runtime and replay."""
    def key(ev: tuple[int, str, int, str, bytes]) -> tuple:
        return (replies[ev[0]].position, tuple(int(x) for x in ev[1].split(".")), ev[2])

    return [(tid, stream, value) for tid, _, _, stream, value in sorted(events, key=key)]


class _Track:
    __slots__ = ("done", "shares", "failed", "rw", "invalid", "invocations", "events", "timers", "next_due")

    def __init__(self) -> None:
        self.done: dict[int, bytes] = {}
        self.shares: dict[int, Share] = {}
        self.failed: dict[int, tuple[str, str]] = {}
        self.rw: dict[int, dict[Entity, bool]] = {}
        self.invalid: set[int] = set()
        self.invocations: dict[int, int] = {}  # summed over partitions and rounds
        self.events: list[tuple[int, str, int, str, bytes]] = []  # finalize: committed events, any order
        self.timers: list[bytes] = []
        self.next_due = math.inf

    def complete(self, tid: int) -> bool:
        return tid in self.done and is_one(self.shares.get(tid))


def _root(tid: int, req: Request) -> Invoke:
    """The root invocation of a transaction: the whole ack share, no caller."""
    return Invoke(tid, "0", req.operator, req.key, req.function, req.args, ONE, ROOT, None, req.ts, 0)


def _within(touched: dict[Entity, bool], known: dict[Entity, bool]) -> bool:
    """Whether a re-run stayed inside its known read/write set (no new entity, no new write)."""
    for e, wrote in touched.items():
        k = known.get(e)
        if k is None or (wrote and not k):
            return False
    return True


class _Locks:
    """Read/write locks held by lower unresolved transactions, for TID-ordered scheduling.

    Two transactions conflict when one writes an entity the other reads or writes; transactions that only
    read an entity in common commute, so they may run (or commit) in the same wave.
    """

    __slots__ = ("reads", "writes")

    def __init__(self) -> None:
        self.reads: set[Entity] = set()
        self.writes: set[Entity] = set()

    def conflicts(self, rw: dict[Entity, bool]) -> bool:
        writes, reads = self.writes, self.reads
        return any(e in writes or (w and e in reads) for e, w in rw.items())

    def add(self, rw: dict[Entity, bool]) -> None:
        for e, w in rw.items():
            self.reads.add(e)
            if w:
                self.writes.add(e)


class EpochCoordinator:
    """Runs epochs through an :class:`Exchange`; keeps the sequencer and the deferred transactions.

    Limits a user sees do not depend on placement: call depth (``context.MAX_DEPTH``, checked where a
    call is made) and ``max_invocations`` per transaction, counted over all partitions here (partitions
    report per-TID counts in :class:`RoundOutput`). Rounds are not a limit: while a transaction is in
    flight every round consumes at least one of its messages (an invocation, or a reply to one), so it
    needs at most ``2 * max_invocations + 1`` rounds before it completes or exceeds its invocations;
    ``max_rounds`` is that bound plus one, a safety net that never binds first.
    """

    def __init__(
        self,
        app: Application,
        exchange: Exchange,
        *,
        sequencers: int = 1,
        max_invocations: int = MAX_INVOCATIONS,
        on_replies: Callable[[list[Reply]], None] | None = None,
    ) -> None:
        if max_invocations < 1:
            raise ValueError("max_invocations must be at least 1")
        self.app = app
        self.exchange = exchange
        self.sequencer = Sequencer(sequencers)
        self.max_invocations = max_invocations
        self.max_rounds = 2 * max_invocations + 2
        self.on_replies = on_replies
        self.deferred: list[tuple[int, Request]] = []
        # the earliest due timer after the last epoch (-inf: unknown, e.g. after a restart; inf: none)
        self.next_due = -math.inf
        self.timer_limit = _timers.MAX_TIMERS_PER_EPOCH  # timers one partition fires per epoch (at most)

    # -- helpers ----------------------------------------------------------------------------------
    def _round(self, control: Control, msgs: list, track: _Track, stats: dict) -> list:
        parts = self.exchange.partitions
        inboxes: list[list] = [[] for _ in range(parts)]
        failed = track.failed
        for m in msgs:
            if m.tid not in failed:
                inboxes[partition_of(m.op, m.key, parts)].append(m)
        control.max_invocations = limit = self.max_invocations
        counts = track.invocations
        t0 = time.perf_counter()
        outs = self.exchange.round(control, inboxes)
        stats["exchange_s"] = stats.get("exchange_s", 0.0) + time.perf_counter() - t0
        stats["rounds"] = stats.get("rounds", 0) + 1
        nxt: list = []
        shares = track.shares
        for o in outs:
            for tid, value, share in o.done:
                track.done[tid] = value
                shares[tid] = add(shares.get(tid, ZERO), share)
            for tid, share in o.acks:
                shares[tid] = add(shares.get(tid, ZERO), share)
            for tid, etype, msg in o.failed:
                failed.setdefault(tid, (etype, msg))
            for tid, n in o.invocations.items():
                n = counts[tid] = counts.get(tid, 0) + n
                if n > limit and tid not in failed:
                    failed[tid] = (CallGraphLimitExceeded.__name__, str(too_many_invocations(limit)))
            rw = track.rw
            for tid, op, key, wrote in o.rw:
                d = rw.get(tid)
                if d is None:
                    d = rw[tid] = {}
                e = (op, key)
                d[e] = wrote or d.get(e, False)
            track.invalid.update(o.invalid)
            nxt.extend(o.messages)
            if o.events:
                track.events.extend(o.events)
            if o.timers:
                track.timers.extend(o.timers)
            if o.next_due is not None and o.next_due < track.next_due:
                track.next_due = o.next_due
            for k, v in o.stats.items():
                stats[k] = stats.get(k, 0) + v
        return nxt

    def _emit(self, replies: list[Reply]) -> None:
        if replies and self.on_replies is not None:
            self.on_replies(replies)

    # -- one epoch --------------------------------------------------------------------------------
    def run_epoch(self, epoch: int, requests: list[tuple[int, Request]], now: float | None = None) -> EpochResult:
        """Run one epoch of ``requests`` given as (input-log partition, request) in log order.

        ``now``: the time the runtime logged for this epoch (None: the previous epoch's); the timers due by
        then fire first, as their own transactions (:mod:`charon.core.timers`)."""
        t_start = time.perf_counter()
        stats: dict[str, float] = {}
        txns: dict[int, Request] = dict(self.deferred)
        self.deferred = []
        t_epoch = self.sequencer.advance(now)
        fired: list[_timers.Timer] = []
        if self.next_due <= t_epoch:  # a collect round: the due timers leave the state before the epoch
            ct = _Track()
            self._round(Control(epoch, Control.DRY, timers=(t_epoch, self.timer_limit)), [], ct, stats)
            fired = sorted((_timers.decode(b) for b in ct.timers), key=lambda t: (t.due, t.id))
            for t in fired:
                txns[self.sequencer.assign(0)] = t.request(t_epoch)
            stats["timers"] = len(fired)
        for sid, req in requests:
            txns[self.sequencer.assign(sid)] = req
        self.sequencer.end_epoch()
        result = EpochResult(epoch, {}, txns, [], time=t_epoch, timers=fired)
        replies = result.replies
        last_tid = max(txns, default=0)
        in_fallback: set[int] = set()  # filled once the lock-free decision is made

        def reply(tid: int, ok: bool, value: bytes = b"", err: tuple[str, str] = ("", "")) -> Reply:
            pos = position(tid, last_tid, tid in in_fallback)
            r = Reply(txns[tid].request_id, tid, epoch, ok, value, err[0], err[1], pos)
            replies[tid] = r
            return r

        # Validation: a request naming nothing runnable gets its typed error and never runs.
        roots: list[Invoke] = []
        early: list[Reply] = []
        for tid in sorted(txns):
            req = txns[tid]
            try:
                self.app.validate(req.operator, req.function, serde.decode(req.args), key=req.key)
            except CharonError as exc:
                early.append(reply(tid, False, err=(type(exc).__name__, str(exc))))
                continue
            roots.append(_root(tid, req))
        self._emit(early)

        # Dry run.
        track = _Track()
        control = Control(epoch, Control.DRY)
        msgs: list = roots
        n = 0
        while msgs and n < self.max_rounds:
            msgs = self._round(control, msgs, track, stats)
            n += 1
        stats["dry_rounds"] = n
        for tid in {m.tid for m in msgs} - track.failed.keys():  # pragma: no cover - safety net, never binds
            track.failed[tid] = ("CallGraphLimitExceeded", f"call graph still running after {n} rounds")
        for r in roots:
            if r.tid not in track.failed and not track.complete(r.tid):  # pragma: no cover - engine bug
                raise AssertionError(f"transaction {r.tid}: call graph ended with shares {track.shares.get(r.tid)}")

        # Aria's rule, with reservations from every transaction that did not raise.
        rw = track.rw
        min_writer: dict[Entity, int] = {}
        for tid, ents in rw.items():
            if tid in track.failed:
                continue
            for e, wrote in ents.items():
                if wrote and (e not in min_writer or tid < min_writer[e]):
                    min_writer[e] = tid
        lockfree: list[int] = []
        conflicted: list[int] = []
        aborted_now: list[int] = []
        for r in roots:
            tid = r.tid
            ents = rw.get(tid, {})
            if any(min_writer.get(e, tid) < tid for e in ents):
                conflicted.append(tid)
            elif tid in track.failed:
                aborted_now.append(tid)
            else:
                lockfree.append(tid)
        in_fallback.update(conflicted)
        early = [reply(t, True, track.done[t]) for t in lockfree]
        early += [reply(t, False, err=track.failed[t]) for t in aborted_now]
        self._emit(early)
        result.lockfree = lockfree
        stats["lockfree"] = len(lockfree)
        stats["aborted"] = len(aborted_now)
        stats["conflicts"] = len(conflicted)

        apply_next: list[int] = list(lockfree)
        reset_next: list[int] = []
        if conflicted:
            apply_next, reset_next = self._fallback(epoch, conflicted, track, result, reply, apply_next, stats)
        result.order = sorted(replies, key=lambda t: replies[t].position)

        # Finalize: apply what is left and write each partition's delta.
        final = _Track()
        self._round(Control(epoch, Control.FALLBACK, apply=apply_next, reset=reset_next, finalize=True), [],
                    final, stats)
        self.next_due = final.next_due
        if final.events:
            result.events = atom_order(final.events, replies)
        stats["duration_ms"] = (time.perf_counter() - t_start) * 1000.0
        stats["size"] = len(txns)
        stats["committed"] = len(lockfree) + len(result.fast) + sum(1 for t in result.slow if replies[t].ok)
        result.stats = stats
        return result

    def _fallback(self, epoch, conflicted, track, result, reply, apply_lockfree, stats):
        """Alternate call-graph-cached rounds and locked re-runs until every conflict is resolved.

        A cached round re-runs the dry-run invocations of the candidates in one round; a transaction
        commits if it replayed validly at every partition (:meth:`PartitionUnit._fast_round` defines it,
        and argues why no uncommitted write leaks) and conflicts (read/write or write/write on an entity)
        with no lower unresolved transaction's dry-run set (otherwise it stays a candidate). Transactions
        that did not replay validly re-run from their root in waves: a wave takes, in TID order, every such
        transaction that conflicts with no lower unresolved one, so the result equals running them in TID
        order.
        """
        K = {tid: track.rw.get(tid, {}) for tid in conflicted}
        candidates = {t for t in conflicted if t not in track.failed}
        rest = list(conflicted)
        apply_next, reset_next = list(apply_lockfree), list(conflicted)
        fast_rounds = slow_rounds = 0
        committed_by: dict[Entity, int] = {}  # entity -> highest TID committed by the fallback touching it
        requeues: dict[int, int] = {}
        while rest:
            if candidates:
                ft = _Track()
                self._round(
                    Control(epoch, Control.FALLBACK, apply=apply_next, reset=reset_next, fast=sorted(candidates)),
                    [], ft, stats,
                )
                fast_rounds += 1
                # valid = replayed within its dry-run set K at every partition (PartitionUnit._fast_round
                # owns that rule and keeps invalid writes out of its fast layer), so blocking on K is exact
                candidates -= ft.invalid
                blocked = _Locks()
                committed: list[int] = []
                remaining: list[int] = []
                for tid in rest:
                    if tid in candidates and not blocked.conflicts(K[tid]):
                        committed.append(tid)
                    else:
                        remaining.append(tid)
                        blocked.add(K[tid])
                self._emit([reply(t, True, ft.done[t]) for t in committed])
                for t in committed:
                    for e in K[t]:
                        committed_by[e] = max(committed_by.get(e, 0), t)
                result.fast.extend(committed)
                candidates.difference_update(committed)
                rest = remaining
                apply_next, reset_next = committed, list(remaining)
                if not rest:
                    break
            # One wave of locked re-runs from the root.
            blocked = _Locks()
            wave: list[int] = []
            for tid in rest:
                if tid not in candidates and not blocked.conflicts(K[tid]):
                    wave.append(tid)
                blocked.add(K[tid])
            if not wave:  # pragma: no cover - the lowest unresolved transaction is always free
                raise AssertionError("fallback made no progress")
            a, r, n, again = self._locked_wave(epoch, wave, K, result, reply, apply_next, reset_next,
                                               stats, committed_by, requeues)
            apply_next, reset_next = a, r
            slow_rounds += n
            waved = set(wave) - set(again)
            rest = [t for t in rest if t not in waved]
        stats["fast_rounds"] = fast_rounds
        stats["slow_rounds"] = slow_rounds
        stats["fast"] = len(result.fast)
        stats["deferred"] = len(result.deferred)
        stats["requeued"] = sum(requeues.values())
        return apply_next, reset_next

    def _locked_wave(self, epoch, wave, K, result, reply, apply_next, reset_next, stats, committed_by,
                     requeues):
        """Re-run ``wave`` (pairwise non-conflicting) from the root; decide commit, abort, re-queue or defer.

        A re-run that stepped outside its known read/write set is re-queued in this epoch's fallback with
        the larger set (reconnaissance, as in Calvin's OLLP), as long as no higher TID already committed
        on what it now touches (so TID order still serializes it); otherwise, or after
        ``MAX_REQUEUES`` tries, it moves to the next epoch keeping its TID.
        """
        again: list[int] = []
        outside: list[int] = []
        slow_track = _Track()
        msgs = []
        for tid in wave:
            req = result.requests[tid]
            msgs.append(_root(tid, req))
        running = set(wave)
        rounds = 0
        replies: list[Reply] = []
        done_apply: list[int] = []
        done_reset: list[int] = []
        while running:
            control = Control(epoch, Control.FALLBACK, apply=apply_next, reset=reset_next)
            apply_next, reset_next = [], []
            msgs = self._round(control, msgs, slow_track, stats)
            rounds += 1
            in_flight = {m.tid for m in msgs}
            for tid in sorted(running):
                if tid not in slow_track.failed and not slow_track.complete(tid):
                    if rounds < self.max_rounds and tid in in_flight:  # the cap: a safety net, never binds
                        continue
                    slow_track.failed[tid] = (CallGraphLimitExceeded.__name__,
                                              f"call graph still running after {rounds} rounds")
                running.discard(tid)
                touched = slow_track.rw.get(tid, {})
                if not _within(touched, K[tid]):
                    done_reset.append(tid)
                    outside.append(tid)  # decided once the whole wave has finished
                elif tid in slow_track.failed:
                    replies.append(reply(tid, False, err=slow_track.failed[tid]))
                    done_reset.append(tid)
                    result.slow.append(tid)
                    for e in touched:  # an abort is an outcome in TID order too: what it read is settled
                        committed_by[e] = max(committed_by.get(e, 0), tid)
                else:
                    replies.append(reply(tid, True, slow_track.done[tid]))
                    done_apply.append(tid)
                    result.slow.append(tid)
                    for e in touched:
                        committed_by[e] = max(committed_by.get(e, 0), tid)
            msgs = [m for m in msgs if m.tid in running]
        for tid in sorted(outside):
            touched = slow_track.rw.get(tid, {})
            if requeues.get(tid, 0) < MAX_REQUEUES and all(committed_by.get(e, 0) < tid for e in touched):
                requeues[tid] = requeues.get(tid, 0) + 1
                merged = dict(K[tid])
                for e, w in touched.items():
                    merged[e] = w or merged.get(e, False)
                K[tid] = merged
                again.append(tid)
            else:
                self.deferred.append((tid, result.requests[tid]))
                result.deferred.append(tid)
        self._emit(replies)
        return done_apply, done_reset, rounds, again
