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
5. Finalize: each partition writes the epoch's delta to its store, idempotently. A runtime may defer it
   (``run_epoch(defer=...)``): the epoch's result then carries a :class:`~charon.core.partition.Prior`
   that the next epoch's first round executes before its own work (``run_epoch(prior=result)``), which
   saves a round per epoch; replies never wait for it (they are safe once the outcome is decided, as a
   replay is deterministic), only the epoch's durable record does, and its atom of events (the finalize
   gathers them): ``on_finalized(result)`` gets the deferred epoch with its events once that round returned,
   before any reply of the epoch carrying it (a runtime records it there and cuts its replies stream).

An epoch of more than ``EPOCH_CHUNK`` transactions runs steps 2–4 chunk by chunk (TID order): each chunk
sees what the chunks before it committed, so Aria's conflicts are counted within a chunk (see
:class:`EpochCoordinator`); sequencing and the finalize stay per epoch.

The serial order: chunk after chunk; within one, first every outcome decided without the fallback (validation
errors, lock-free commits, immediate aborts) in TID order, then the fallback's outcomes in TID order. Running
the epoch's transactions one at a time in that order on the state before the epoch gives exactly the state after it
and the same replies (see ``charon.testing``). Each reply carries its place in it (:func:`position`), known
when the reply is sent, so ordering all replies by (epoch, position) is a serial order of the whole
history; ``EpochResult.order`` is the epoch's TIDs sorted by position.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from charon import serde
from charon.core import timers as _timers
from charon.core.admission import BULK_FUNCTIONS, LIMITS_OPERATOR, Admission
from charon.core.partition import (
    MAX_INVOCATIONS,
    ROOT,
    Control,
    Invoke,
    Observed,
    Prior,
    RoundOutput,
    too_many_invocations,
)
from charon.core.partition import Reply as ReplyMsg
from charon.core.routing import MAX_KEY_BYTES, check_key, key_group
from charon.core.sequencer import Sequencer
from charon.core.shares import ONE, Share, add, is_one
from charon.errors import CallGraphLimitExceeded, CharonError
from charon.messages import Reply, Request
from charon.operator import Application

_decode = serde._dec.decode

_POSITION = operator.attrgetter("position")
MAX_REQUEUES = 3  # re-runs of one transaction with a grown read/write set within an epoch
# Transactions per chunk of an epoch (see EpochCoordinator): a protocol constant, as a replay must cut an epoch
# where its first run did. Aria's conflict share grows with the transactions decided together (uniform
# transfers over 10k accounts: 5% at 250, 31% at 2,000, 70% at 8,000) and each conflict runs again in the
# fallback, while a chunk costs a few in-process rounds: 256 keeps both small.
EPOCH_CHUNK = 256
Entity = tuple[str, str]
Event = tuple[int, str, bytes]  # (tid, stream, encoded value)
RawEvent = tuple[int, str, int, str, bytes]  # an event as a round reports it: (tid, inv, n, stream, value)
Msgs = Sequence[Invoke | ReplyMsg]  # one round's messages (invocations and replies to suspended callers)


class Exchange(Protocol):
    """How a runtime moves one round's messages to the partitions and back.

    Optional, looked up with ``getattr``: ``rest(job: RestJob) -> RestOutcome | None`` takes the rest of an
    epoch at a dry-run round (None: not this time), and ``fallback(job: FallbackJob) -> FallbackOutcome``
    runs an epoch's whole fallback; both must give what :func:`run_rest` / :func:`run_fallback` give over
    this exchange's partitions (the Spark runtime runs them in one task over every partition).
    """

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
    # the epoch's atom: committed transactions' events (tid, stream, value) in serial order (Context.emit);
    # when the finalize was deferred, set once it ran (before on_finalized sees this result)
    events: list[Event] = field(default_factory=list)
    time: float = 0.0  # the epoch's deterministic time (Sequencer.advance)
    timers: list[_timers.Timer] = field(default_factory=list)  # fired at the epoch's start, in TID order
    finalize: Prior | None = None  # set when the finalize was deferred: pass this result as the next's prior


def position(tid: int, last_tid: int, fallback: bool, base: int = 0) -> int:
    """A reply's place in its epoch's serial order (monotone, not dense).

    ``last_tid`` is the highest TID of the transaction's chunk (of the epoch when it has one chunk; known once
    it is sequenced); a fallback outcome comes after every outcome of its chunk decided without the fallback.
    ``base``: the chunk's offset (:func:`chunk_bases`), so that a chunk's places follow the chunk before's.
    """
    return base + (last_tid + 1 + tid if fallback else tid)


def chunk_bounds(roots: list[int], last_tid: int, size: int) -> list[int]:
    """The highest TID of each chunk of an epoch whose transactions that run are ``roots`` (ascending) and
    whose highest TID is ``last_tid``: chunks of ``size`` transactions in TID order (0: one chunk)."""
    if size <= 0 or len(roots) <= size:
        return [last_tid]
    return [roots[i] for i in range(size - 1, len(roots) - 1, size)] + [last_tid]


def chunk_bases(bounds: list[int]) -> list[int]:
    """Each chunk's :func:`position` offset: a chunk's places lie in [base + first TID, base + 2 * bound + 1],
    so the next chunk's base is ``base + bound + 1`` (its first TID exceeds the bound)."""
    bases, b = [], 0
    for hi in bounds:
        bases.append(b)
        b += hi + 1
    return bases


def atom_order(events: list[RawEvent], replies: dict[int, Reply]) -> list[Event]:
    """An epoch's committed events as (tid, stream, value) in atom order: by the transaction's place in the
    serial order, then by invocation (an invocation before its callees, callees in call order), then by
    emit order within the invocation. Placement-independent, so the same on every runtime and replay."""
    def key(ev: RawEvent) -> tuple[int | None, tuple[int, ...], int]:
        return (replies[ev[0]].position, tuple(int(x) for x in ev[1].split(".")), ev[2])

    return [(tid, stream, value) for tid, _, _, stream, value in sorted(events, key=key)]


class _Track:
    __slots__ = ("done", "shares", "failed", "rw", "invalid", "invocations", "events", "timers", "next_due",
                 "inv_total", "inv_rounds")

    def __init__(self) -> None:
        self.done: dict[int, bytes] = {}
        self.shares: dict[int, Share] = {}
        self.failed: dict[int, tuple[str, str]] = {}
        self.rw: dict[int, dict[Entity, bool]] = {}
        self.invalid: set[int] = set()
        self.invocations: dict[int, int] = {}  # summed over partitions and rounds (see inv_rounds)
        # While all the invocations reported (inv_total, an upper bound of any one transaction's) stay within the
        # limit, no transaction can exceed it: the reports wait in inv_rounds unsummed (None once summed).
        self.inv_total = 0
        self.inv_rounds: list[dict[int, int]] | None = []
        self.events: list[tuple[int, str, int, str, bytes]] = []  # finalize: committed events, any order
        self.timers: list[bytes] = []
        self.next_due = math.inf

    def complete(self, tid: int) -> bool:
        return tid in self.done and is_one(self.shares.get(tid))

    def forget(self, tid: int) -> None:
        """Drop what earlier runs of ``tid`` reported (it runs again)."""
        self.done.pop(tid, None)
        self.shares.pop(tid, None)
        self.failed.pop(tid, None)
        self.rw.pop(tid, None)
        self.invocations.pop(tid, None)
        for d in self.inv_rounds or ():
            d.pop(tid, None)
        self.invalid.discard(tid)


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


class _Queues:
    """Deterministic per-entity lock queues of the fallback (Calvin-style), and the rule deciding its outcomes.

    ``K[tid]`` is a transaction's known set (entity -> whether it writes it). Every unresolved transaction is
    queued, in TID order, on each entity of its set; two accesses conflict when one of them writes. A waiting
    transaction is *granted* (starts) when no lower unresolved transaction in its queues conflicts with it and
    no higher transaction that holds (is running on) one of its entities does (possible only after a lower
    one was re-queued onto that entity).

    Why the outcomes are those of the serial order (the fallback's transactions one at a time in TID order):
    :meth:`clear` decides a finished run of T as an outcome only if, for every entity e it touched, (i) no
    higher transaction's outcome (commit or abort: it did not see T) wrote e, nor touched it if T wrote it,
    (ii) no write to e was committed from T's first round on (T read every lower write to e), (iii) no lower
    unresolved transaction conflicting on e is queued on e (it still has to run before T) and no higher one
    holds e (it started before T's writes). On the entities of K[T] the queues guarantee all three; an entity
    outside K[T] (a re-run that stepped outside its set, e.g. a key derived from a counter) is validated by
    the same three checks, so a run that stepped outside its set onto entities nobody else wants commits at once. A run
    that fails them is queued again with the set it touched added (reconnaissance, Calvin's OLLP; at most
    ``MAX_REQUEUES`` times) only while no higher transaction's outcome touched what it touched
    (:meth:`settled_below`); otherwise it moves to the next epoch, keeping its TID. A lower transaction that
    later steps onto an entity a higher one decided on is deferred by that same rule.
    """

    __slots__ = ("K", "unresolved", "waiting", "queues", "holders", "decided", "decided_w", "wround")

    def __init__(self, K: dict[int, dict[Entity, bool]]) -> None:
        self.K = K
        self.unresolved = set(K)
        self.waiting = set(K)
        self.queues: dict[Entity, list[int]] = {}
        for tid in sorted(K):
            for e in K[tid]:
                q = self.queues.get(e)
                if q is None:
                    self.queues[e] = [tid]
                else:
                    q.append(tid)
        self.holders: dict[Entity, set[int]] = {}
        self.decided: dict[Entity, int] = {}  # entity -> highest TID whose outcome touched it
        self.decided_w: dict[Entity, int] = {}  # entity -> highest TID whose outcome wrote it
        self.wround: dict[Entity, int] = {}  # entity -> the last round a committed write to it was decided

    def grant(self, dirty: set[int], candidates: set[int]) -> tuple[list[int], list[int]]:
        """Start the granted transactions among ``dirty`` (the others wait): (cached replays, re-runs).

        A candidate may also start behind lower conflicting candidates that start in the same round."""
        K, queues, holders = self.K, self.queues, self.holders
        fast: list[int] = []
        roots: list[int] = []
        chain: set[int] = set()
        waiting = self.waiting
        heap = sorted(dirty & waiting)
        seen = set(heap)
        while heap:
            tid = heapq.heappop(heap)
            cand = tid in candidates
            ok = True
            for e, w in K[tid].items():
                for v in queues[e]:
                    if v >= tid:
                        break
                    if (w or K[v][e]) and not (cand and v in chain):
                        ok = False
                        break
                if not ok:
                    break
                hs = holders.get(e)
                if hs and any(v > tid and (w or K[v][e]) for v in hs):
                    ok = False
                    break
            if not ok:
                continue
            waiting.discard(tid)
            if cand:
                fast.append(tid)
                chain.add(tid)
            else:
                roots.append(tid)
            for e in K[tid]:
                hs = holders.get(e)
                if hs is None:
                    holders[e] = {tid}
                else:
                    hs.add(tid)
                if cand:  # the candidates queued right behind it may chain
                    q = queues[e]
                    for i in range(bisect.bisect_right(q, tid), len(q)):
                        v = q[i]
                        if v in waiting and v not in seen:
                            seen.add(v)
                            heapq.heappush(heap, v)
                        if K[v][e]:
                            break
        return fast, roots

    def clear(self, tid: int, touched: dict[Entity, bool], start: int | None) -> bool:
        """Whether a finished run of ``tid`` that touched ``touched``, started in round ``start`` (None: a cached
        replay, whose reads of lower writes the fast layer owns) is an outcome in TID order (see the class)."""
        K, queues, holders, wround = self.K, self.queues, self.holders, self.wround
        decided = self.decided
        for e, w in touched.items():
            if (decided if w else self.decided_w).get(e, 0) > tid:
                return False
            if start is None:  # a cached replay: the higher ones replayed with it read its writes (fast layer)
                hs = None
            else:
                if wround.get(e, -1) >= start:
                    return False
                hs = holders.get(e)
            q = queues.get(e)
            if q:
                for v in q:
                    if v >= tid:
                        break
                    if w or K[v][e]:
                        return False
            if hs and any(v > tid and (w or K[v][e]) for v in hs):
                return False
        return True

    def settled_below(self, tid: int, touched: dict[Entity, bool]) -> bool:
        """No higher transaction's outcome conflicts on what ``tid`` touched (so it may still run in TID order)."""
        decided, decided_w = self.decided, self.decided_w
        return all((decided if w else decided_w).get(e, 0) < tid for e, w in touched.items())

    def _release(self, tid: int, dirty: set[int]) -> None:
        """``tid`` stops holding its entities: wake those its queues may now grant."""
        K, queues, holders, waiting = self.K, self.queues, self.holders, self.waiting
        for e in K[tid]:
            hs = holders.get(e)
            if hs:
                hs.discard(tid)
            for v in queues[e]:  # the readers at the head, up to and with the first writer
                if v == tid:
                    continue
                if v in waiting:
                    dirty.add(v)
                if K[v][e]:
                    break

    def resolve(self, tid: int, touched: dict[Entity, bool], rnd: int, committed: bool,
                candidates: set[int]) -> set[int]:
        """``tid`` has its outcome (``touched``: what it touched; empty for a deferral) in round ``rnd``."""
        dirty: set[int] = set()
        self._release(tid, dirty)
        for e in self.K[tid]:
            self.queues[e].remove(tid)
        self.unresolved.discard(tid)
        self.waiting.discard(tid)
        dirty.discard(tid)
        candidates.discard(tid)
        decided, decided_w, wround = self.decided, self.decided_w, self.wround
        for e, w in touched.items():
            if decided.get(e, 0) < tid:
                decided[e] = tid
            if w:
                if decided_w.get(e, 0) < tid:
                    decided_w[e] = tid
                if committed:
                    wround[e] = rnd
        return dirty

    def requeue(self, tid: int, grow: dict[Entity, bool] | None, candidates: set[int]) -> set[int]:
        """``tid`` waits again, on its set grown by ``grow`` (None: the same set)."""
        dirty = {tid}
        self._release(tid, dirty)
        self.waiting.add(tid)
        if grow:
            known = self.K[tid]
            for e, w in grow.items():
                k = known.get(e)
                if k is None:
                    q = self.queues.get(e)
                    if q is None:
                        self.queues[e] = [tid]
                    else:
                        bisect.insort(q, tid)
                known[e] = w or bool(k)
        return dirty


@dataclass
class FallbackJob:
    """Everything the fallback of one epoch needs (picklable: a runtime may run it in one remote task)."""

    epoch: int
    conflicted: list[int]  # in TID order
    rw: dict[int, dict[Entity, bool]]  # the dry run's read/write sets of the conflicted transactions
    failed: dict[int, tuple[str, str]]  # conflicted transactions that raised in the dry run
    requests: dict[int, Request]  # of the conflicted transactions
    apply: list[int]  # lock-free commits, applied before the fallback's first round
    last_tid: int  # the highest TID of the chunk
    max_invocations: int
    base: int = 0  # the chunk's position offset (chunk_bases)
    observe: bool = False  # EpochCoordinator.observe
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # of its transactions, taken in it before (a rerun)


@dataclass
class FallbackOutcome:
    """What the fallback decided: replies in the order they were sent, and what the finalize applies."""

    replies: list[Reply]
    fast: list[int]
    slow: list[int]
    deferred: list[tuple[int, Request]]  # moved to the next epoch, keeping their TIDs
    apply: list[int]
    reset: list[int]
    stats: dict[str, float]
    next_due: float = math.inf  # the least due time of a timer registered in its rounds (see run_epoch)
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # taken while it ran (see EpochCoordinator._verdict)
    trace: list[Observed] = field(default_factory=list)  # what its rounds observed (EpochCoordinator.trace)


def run_fallback(
    app: Application, exchange: Exchange, job: FallbackJob, on_replies: Callable[[list[Reply]], None] | None = None,
    outer: EpochCoordinator | None = None,
) -> FallbackOutcome:
    """The fallback of one epoch (see :meth:`EpochCoordinator._fallback`) through ``exchange``.

    A runtime whose exchange has a ``fallback(job) -> FallbackOutcome`` method calls this where the
    partitions are (e.g. one Spark task holding them all, with an in-task exchange), so that all waves cost
    one job; the outcome is the same wherever it runs (it only depends on the job and the partitions' state).
    ``outer``: the coordinator of the epoch, when it runs here: verdicts taken in the fallback are its own (recorded
    by its ``on_verdict`` before the wave's replies go out); else they return in the outcome.
    """
    coord = EpochCoordinator(app, exchange, max_invocations=job.max_invocations, on_replies=on_replies)
    result = coord.current = EpochResult(job.epoch, {}, job.requests, [])
    coord.phase = 1
    coord.observe = job.observe
    if outer is not None:
        coord.verdicts, coord.on_verdict, coord.taken = outer.verdicts, outer.on_verdict, outer.taken
        coord.outer = outer
        coord.trace = outer.trace  # observed straight into the outer coordinator's (the outcome's stays empty)
    else:
        coord.verdicts = dict(job.verdicts)

    def reply(tid: int, ok: bool, value: bytes = b"", err: tuple[str, str] = ("", "")) -> Reply:
        return _reply(result, job.last_tid, tid, True, ok, value, err, job.base)

    track = _Track()
    track.rw = job.rw
    track.failed = dict(job.failed)
    stats: dict[str, float] = {}
    apply, reset = coord._fallback(job.epoch, job.conflicted, track, result, reply, job.apply, stats)
    return FallbackOutcome(list(result.replies.values()), result.fast, result.slow, coord.deferred, apply, reset,
                           stats, coord.due_seen, coord.taken, [] if outer is not None else coord.trace)


def _reply(result: EpochResult, last_tid: int, tid: int, fallback: bool, ok: bool, value: bytes = b"",
           err: tuple[str, str] = ("", ""), base: int = 0) -> Reply:
    """The reply of ``tid`` (recorded in ``result``) at its place in the epoch's serial order."""
    r = Reply(result.requests[tid].request_id, tid, result.epoch, ok, value, err[0], err[1],
              position(tid, last_tid, fallback, base))
    result.replies[tid] = r
    return r


VERDICT_ERRORS = frozenset({"InvocationTimeout"})  # failures a partition reports that are decisions (Verdict)


class Verdict(NamedTuple):
    """A recorded decision the engine took on a transaction from outside the deterministic core (a time budget
    overrun, a quarantine): by request id in :attr:`EpochCoordinator.verdicts`, applied the same way live, at
    recovery and on rerun. ``fallback``: it was taken while the transaction ran in its chunk's fallback (its dry
    run stays as it was, and it leaves the fallback with this error); otherwise in the dry run (it never runs).
    ``in_round``: the round of that fallback it was taken in (:attr:`EpochCoordinator.fallback_round`): a replay
    judges it there, see :meth:`EpochCoordinator._judged_here` (None: unknown, a record from before rounds were
    kept, or a quarantine decided after a crash: it leaves before the fallback starts, :meth:`_judge_late`)."""

    error_type: str
    message: str
    fallback: bool = False
    in_round: int | None = None
    epoch: int | None = None  # the epoch it was taken in (None: any)

    def refuses(self, epoch: int) -> bool:
        """Whether it refuses its transaction before it runs in ``epoch``: taken in that epoch's dry run, or in an
        earlier epoch (a retry of the request). A verdict taken in a later epoch (on a transaction this one
        deferred) does not apply here: replayed, this epoch runs the transaction as it did without it."""
        if self.epoch is None:
            return not self.fallback
        return self.epoch < epoch or (self.epoch == epoch and not self.fallback)

    def judges_fallback(self, epoch: int) -> bool:
        """Whether it was taken in the fallback of ``epoch`` (its transaction leaves it there)."""
        return self.fallback and (self.epoch is None or self.epoch == epoch)


@dataclass
class RestJob:
    """The rest of an epoch from a dry-run round of one of its chunks on (picklable: a runtime may run it in
    one task)."""

    epoch: int
    requests: dict[int, Request]  # of the transactions that run (not the ones refused by validation)
    roots: list[int]  # their TIDs, in order (every chunk's)
    msgs: Msgs  # the messages of round ``n`` of chunk ``chunk``
    track: _Track  # what that chunk's rounds 0..n-1 reported
    n: int
    prior: Prior | None  # the previous epoch's finalize, to run before anything else
    bounds: list[int]  # the highest TID of each chunk (chunk_bounds); the last is the epoch's highest TID
    max_invocations: int
    chunk: int = 0  # the chunk being run
    carry: tuple[list[int], list[int]] | None = None  # the chunk before's (apply, reset), not yet settled
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # EpochCoordinator.verdicts of the job's requests
    observe: bool = False  # EpochCoordinator.observe


@dataclass
class RestOutcome:
    """What the rest of an epoch decided: replies in the order they were sent and the outcome lists."""

    replies: list[Reply]
    lockfree: list[int]
    fast: list[int]
    slow: list[int]
    deferred: list[tuple[int, Request]]
    apply: list[int]
    reset: list[int]
    stats: dict[str, float]
    next_due: float = math.inf  # the least next due time reported in its rounds (see run_epoch)
    # the job's prior's finalize: its raw events (tid, inv, n, stream, value), put in atom order by the driver
    prior_events: list[RawEvent] = field(default_factory=list)
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # taken while it ran (see EpochCoordinator._verdict)
    trace: list[Observed] = field(default_factory=list)  # what its rounds observed (EpochCoordinator.trace)


def run_rest(app: Application, exchange: Exchange, job: RestJob) -> RestOutcome:
    """Run :class:`RestJob` through ``exchange`` (whose partitions already ran ``job.prior``, if any)."""
    coord = EpochCoordinator(app, exchange, max_invocations=job.max_invocations)
    coord.verdicts = dict(job.verdicts)
    coord.observe = job.observe
    result = coord.current = EpochResult(job.epoch, {}, job.requests, [])
    sent: list[Reply] = []
    coord.on_replies = sent.extend
    stats: dict[str, float] = {}
    apply, reset = coord._rest(job.epoch, job.roots, job.msgs, job.track, job.n, None, result, stats, job.bounds,
                               job.chunk, job.carry)
    return RestOutcome(sent, result.lockfree, result.fast, result.slow, coord.deferred, apply, reset, stats,
                       coord.due_seen, verdicts=coord.taken, trace=coord.trace)


class EpochCoordinator:
    """Runs epochs through an :class:`Exchange`; keeps the sequencer and the deferred transactions.

    Limits a user sees do not depend on placement: call depth (``context.MAX_DEPTH``, checked where a
    call is made) and ``max_invocations`` per transaction, counted over all partitions here (partitions
    report per-TID counts in :class:`RoundOutput`). Rounds are not a limit: while a transaction is in
    flight every round consumes at least one of its messages (an invocation, or a reply to one), so it
    needs at most ``2 * max_invocations + 1`` rounds before it completes or exceeds its invocations;
    ``max_rounds`` is that bound plus one, a safety net that never binds first.

    An epoch runs in *chunks* of ``chunk`` transactions in TID order: each chunk's dry run, lock-free decision
    and fallback see everything the chunks before committed (their writes enter the partitions' overlay, as
    the lock-free commits do before a fallback), so the serial order is chunk after chunk, each as above
    (:func:`position` places them). Aria's conflicts are then counted among a chunk's transactions, not the
    whole epoch's; the finalize, the epoch's record and a deferred finalize stay per epoch.
    """

    def __init__(
        self,
        app: Application,
        exchange: Exchange,
        *,
        sequencers: int = 1,
        max_invocations: int = MAX_INVOCATIONS,
        on_replies: Callable[[list[Reply]], None] | None = None,
        on_finalized: Callable[[EpochResult], None] | None = None,
        chunk: int | None = None,
    ) -> None:
        if max_invocations < 1:
            raise ValueError("max_invocations must be at least 1")
        self.app = app
        # transactions per chunk of an epoch (0: one chunk; None: EPOCH_CHUNK); see the class docstring
        self.chunk = EPOCH_CHUNK if chunk is None else chunk
        self.previous: tuple[int, Application] | None = None  # see PartitionUnit.previous
        self.exchange = exchange
        self.sequencer = Sequencer(sequencers)
        self.max_invocations = max_invocations
        self.max_rounds = 2 * max_invocations + 2
        self.on_replies = on_replies
        # called with a deferred epoch's result (its events set) once the round that finalized it returned
        self.on_finalized = on_finalized
        self._prior: EpochResult | None = None  # the deferred epoch whose finalize this epoch carries
        self._held: list[Reply] = []  # replies decided before that finalize ran (see run_epoch)
        self.due_seen = math.inf  # the least next due time any partition reported in this epoch's rounds
        self.deferred: list[tuple[int, Request]] = []
        self.deferred_in: list[tuple[int, Request]] = []  # the deferred ones this epoch started with
        #: admission control (:mod:`charon.core.admission`): its held requests are in :attr:`deferred`
        self.admission = Admission()
        # the earliest due timer after the last epoch (-inf: unknown, e.g. after a restart; inf: none)
        self.next_due = -math.inf
        self.timer_limit = _timers.MAX_TIMERS_PER_EPOCH  # timers one partition fires per epoch (at most)
        #: recorded decisions by request id (see :class:`Verdict`; the runtime that records them owns the dict)
        self.verdicts: dict[str, Verdict] = {}
        #: the epoch being run (its requests by TID) and whether its fallback runs now (1) or its dry run (0):
        #: what a watchdog in another thread needs to record a verdict on a transaction that overran its budget
        self.current: EpochResult | None = None
        self.phase = 0
        #: records a verdict taken in this epoch durably before it counts (the driver's runtime; None: only here)
        self.on_verdict: Callable[[Request, Verdict, int], None] | None = None  # (request, verdict, epoch)
        self.taken: dict[str, Verdict] = {}  # verdicts this coordinator took (run_rest/run_fallback return them)
        #: ask the partitions what they run (``Control.observe``): the invocations and tracebacks they report are
        #: appended to :attr:`trace` (observation only; the runtime takes them, nothing here reads them)
        self.observe = False
        self.trace: list[Observed] = []
        #: the round of the chunk's fallback running now (a verdict taken in it records it: Verdict.in_round)
        self.fallback_round = 0
        self.outer: EpochCoordinator | None = None  # run_fallback's: the epoch's coordinator, told the round too

    def _verdict(self, tid: int, etype: str, msg: str) -> None:
        """A round reported ``tid`` failed by a decision from outside the core (``InvocationTimeout``): recorded
        (durably, by ``on_verdict``) before anything depends on it, then applied as every verdict (_judge)."""
        cur = self.current
        if cur is None:  # pragma: no cover - a round runs within an epoch
            return
        req = cur.requests.get(tid)
        if req is not None and req.request_id not in self.verdicts:
            fb = self.phase == 1
            self._adopt({req.request_id: Verdict(etype, msg, fb, self.fallback_round if fb else None, cur.epoch)},
                        {req.request_id: req})

    def _adopt(self, verdicts: dict[str, Verdict], reqs: dict[str, Request] | None = None) -> None:
        """Take in verdicts a task took (or this coordinator): each recorded first, then effective."""
        for rid, v in verdicts.items():
            if rid in self.verdicts:
                continue
            if self.on_verdict is not None:
                req = reqs.get(rid) if reqs is not None else None
                if req is None and self.current is not None:
                    req = next((r for r in self.current.requests.values() if r.request_id == rid), None)
                if req is not None:
                    self.on_verdict(req, v, self.current.epoch if self.current is not None else -1)
            self.verdicts[rid] = v
            self.taken[rid] = v

    # -- helpers ----------------------------------------------------------------------------------
    def _round(self, control: Control, msgs: Msgs, track: _Track, stats: dict[str, float]) -> list[Invoke | ReplyMsg]:
        parts = self.exchange.partitions
        inboxes: list[list[Invoke | ReplyMsg]] = [[] for _ in range(parts)]
        failed = track.failed
        for m in msgs:
            if failed and m.tid in failed:
                continue
            g = m.kg  # the key group a partition computed already, if any (routing.partition_of, inlined)
            if g is None:
                g = m.kg = key_group(m.op, m.key)
            inboxes[g % parts].append(m)
        control.max_invocations = limit = self.max_invocations
        control.observe = self.observe
        counts = track.invocations
        t0 = time.perf_counter()
        outs = self.exchange.round(control, inboxes)
        stats["exchange_s"] = stats.get("exchange_s", 0.0) + time.perf_counter() - t0
        stats["rounds"] = stats.get("rounds", 0) + 1
        nxt: list[Invoke | ReplyMsg] = []
        shares = track.shares
        for o in outs:  # the limit before the round's errors: an error ends a synchronous chain, so every
            inv = o.invocations  # invocation counted in its round came before it
            held = track.inv_rounds
            if held is not None:  # nothing summed yet: only the total, while it cannot exceed the limit
                track.inv_total += sum(inv.values())
                if track.inv_total <= limit:
                    held.append(inv)
                    continue
                track.inv_rounds = None  # the earlier reports (none exceeded the limit) summed, then this one
                for d in held:
                    for tid, n in d.items():
                        counts[tid] = counts.get(tid, 0) + n
            for tid, n in inv.items():
                n = counts[tid] = counts.get(tid, 0) + n
                if n > limit and tid not in failed:
                    failed[tid] = (CallGraphLimitExceeded.__name__, str(too_many_invocations(limit)))
        done, rw = track.done, track.rw
        for o in outs:  # (each field tested first: most are empty in most rounds)
            if o.done:
                for tid, value, share in o.done:
                    done[tid] = value
                    s = shares.get(tid)
                    shares[tid] = share if s is None else add(s, share)
            if o.acks:
                for tid, share in o.acks:
                    s = shares.get(tid)
                    shares[tid] = share if s is None else add(s, share)
            if o.failed:
                for tid, etype, msg in o.failed:
                    failed.setdefault(tid, (etype, msg))
                    if etype in VERDICT_ERRORS:  # a partition stopped a function past its budget: a verdict
                        self._verdict(tid, etype, msg)
            if o.rw:
                for tid, t in o.rw.items():  # a partition's own entities: disjoint from the other partitions'
                    had = rw.get(tid)
                    if had is None:
                        rw[tid] = t.copy()
                    else:
                        had.update(t)  # t is what the transaction touched here so far (a write stays a write)
            if o.invalid:
                track.invalid.update(o.invalid)
            if o.messages:
                nxt += o.messages
            if o.events:
                track.events.extend(o.events)
            if o.timers:
                track.timers.extend(o.timers)
            nd = o.next_due
            if nd is not None and nd < track.next_due:
                track.next_due = nd
                if nd < self.due_seen:
                    self.due_seen = nd
            for k, v in o.stats.items():
                stats[k] = stats.get(k, 0) + v
            if o.trace:
                self.trace += o.trace
        return nxt

    def _emit(self, replies: list[Reply]) -> None:
        if replies and self.on_replies is not None:
            self.on_replies(replies)

    # -- one epoch --------------------------------------------------------------------------------
    def finalize(self, result: EpochResult, stats: dict[str, float] | None = None) -> float:
        """Run the deferred finalize of ``result`` (an epoch's :attr:`EpochResult.finalize`) in a round of its
        own: set its events, clear ``finalize``, call ``on_finalized``; returns its exact next due time."""
        final = self._final_round(result, {} if stats is None else stats)
        self._finalized(result, final.events)
        return final.next_due

    def _final_round(self, result: EpochResult, stats: dict[str, float]) -> _Track:
        fin = result.finalize
        assert fin is not None
        final = _Track()
        self._round(Control(fin.epoch, Control.FALLBACK, apply=fin.apply, reset=fin.reset, finalize=True), [],
                    final, stats)
        return final

    def _finalized(self, result: EpochResult, events: list[RawEvent]) -> None:
        """The deferred finalize of ``result`` has run (its round returned with ``events``, raw): its atom
        is put in the same order as an undeferred finalize gives (:func:`atom_order`), then the runtime
        is told (it appends the atom, then writes the epoch's record: the one place that orders the two)."""
        result.events = atom_order(events, result.replies) if events else []
        result.finalize = None
        if self.on_finalized is not None:
            self.on_finalized(result)

    def run_epoch(
        self, epoch: int, requests: list[tuple[int, Request]], now: float | None = None, *,
        prior: EpochResult | None = None, defer: bool | Callable[[], bool] = False,
    ) -> EpochResult:
        """Run one epoch of ``requests`` given as (input-log partition, request) in log order.

        ``now``: the time the runtime logged for this epoch (None: the previous epoch's); the timers due by
        then fire first, as their own transactions (:mod:`charon.core.timers`). ``prior``: the previous
        epoch's result whose finalize was deferred, run within this epoch's first round (the collect round
        if there is one, else the dry run's first round, else a round of its own). ``defer`` (asked once the
        outcome is decided): leave this epoch's finalize to the caller, in :attr:`EpochResult.finalize`.
        """
        t_start = time.perf_counter()
        stats: dict[str, float] = {}
        txns: dict[int, Request] = dict(self.deferred)
        self.deferred_in, self.deferred = self.deferred, []
        self.due_seen = math.inf
        self._held = []
        self._prior = prior if prior is not None and prior.finalize is not None else None
        fin_prior = self._prior.finalize if self._prior is not None else None
        t_epoch = self.sequencer.advance(now)
        fired: list[_timers.Timer] = []
        collected = self.next_due <= t_epoch
        if collected:  # a collect round: the due timers leave the state before the epoch
            # The previous epoch's deferred finalize rides in it and runs first (PartitionUnit.step), so
            # the timers are collected from that epoch's finalized state, as without pipelining.
            ct = _Track()
            self._round(Control(epoch, Control.DRY, timers=(t_epoch, self.timer_limit), prior=fin_prior), [], ct,
                        stats)
            if fin_prior is not None:
                self._prior_ran(ct.events)
                fin_prior = None
            fired = sorted((_timers.decode(b) for b in ct.timers), key=lambda t: (t.due, t.id))
            for t in fired:
                txns[self.sequencer.assign(0)] = t.request(t_epoch)
            stats["timers"] = len(fired)
        for sid, req in requests:
            txns[self.sequencer.assign(sid)] = req
        self.sequencer.end_epoch()
        answered = self._admit(txns, requests, t_epoch, stats)
        result = EpochResult(epoch, {}, txns, [], time=t_epoch, timers=fired)
        self.current, self.phase = result, 0
        last_tid = max(txns, default=0)
        # Validation: a request naming nothing runnable gets its typed error and never runs.
        roots: list[Invoke] = []
        refused: list[tuple[int, tuple[str, str]]] = []
        prev = self.previous
        verdicts = self.verdicts
        judged: list[int] = []  # refused by a dry-run verdict: they keep their place in the chunks
        for tid in sorted(txns):
            req = txns[tid]
            if answered and tid in answered:
                continue
            if verdicts:
                v = verdicts.get(req.request_id)
                if v is not None and v.refuses(epoch):
                    refused.append((tid, (v.error_type, v.message)))
                    judged.append(tid)
                    continue
            try:
                app = prev[1] if prev is not None and tid < prev[0] else self.app
                try:
                    args = _decode(req.args)  # serde.decode, inlined (the common case: well-formed)
                except Exception:  # noqa: BLE001 - serde.decode raises its typed error
                    args = serde.decode(req.args)
                fn = app._resolved.get((req.operator, req.function))
                if fn is None or type(args) is not list:  # the checks of Application.validate, in its order
                    app.validate(req.operator, req.function, args, key=req.key)
                else:
                    key = req.key
                    if not (type(key) is str and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES and "\0" not in key):
                        check_key(key)  # its ASCII fast path above, inlined: the rest (or the typed error) in check_key
                    sigs = fn._sigs
                    if sigs is None or tuple(map(type, args)) not in sigs:  # Function.check_args's fast path, inlined
                        fn.check_args(args)
            except CharonError as exc:
                refused.append((tid, (type(exc).__name__, str(exc))))
                continue
            # _root(tid, req), inlined
            roots.append(Invoke(tid, "0", req.operator, req.key, req.function, req.args, ONE, ROOT, None, req.ts, 0))
        tids = [r.tid for r in roots]
        # a judged transaction counts where it ran when its verdict was taken, so the chunks are the same
        bounds = chunk_bounds(sorted(tids + judged) if judged else tids, last_tid, self.chunk)
        bases = chunk_bases(bounds) if len(bounds) > 1 else None
        early: list[Reply] = []
        for tid, err in refused:  # at its chunk's place (a chunk's transactions lie in (bound before, bound])
            j = bisect.bisect_left(bounds, tid) if bases else 0
            early.append(_reply(result, bounds[j], tid, False, False, err=err, base=bases[j] if bases else 0))
        for tid, (ok, value, err) in sorted(answered.items()) if answered else ():  # admission's (as refused)
            j = bisect.bisect_left(bounds, tid) if bases else 0
            early.append(_reply(result, bounds[j], tid, False, ok, value, err, base=bases[j] if bases else 0))
        if self._prior is not None:  # its on_finalized (a runtime records it, cuts its replies there) comes first
            self._held = early
        else:
            self._emit(early)
        first = roots if bases is None else roots[:bisect.bisect_right(tids, bounds[0])]
        apply_next, reset_next = self._rest(epoch, tids, first, _Track(), 0, fin_prior, result, stats, bounds,
                                            invokes=roots)
        replies = result.replies
        result.order = [r.tid for r in sorted(replies.values(), key=_POSITION)]  # the TIDs by position

        # Finalize: apply what is left and write each partition's delta (now, or in the next epoch's first round).
        result.finalize = Prior(epoch, apply_next, reset_next)
        if defer() if callable(defer) else defer:
            stats["finalize_deferred"] = 1
            # Timers and a deferred finalize (the rule's one owner): the next epoch decides whether to collect
            # before this finalize reported the exact next due time, so ``next_due`` is kept a lower bound:
            # the state's earliest due timer before this epoch (exact after a collect round) or any timer a
            # transaction registered in one of this epoch's rounds (partitions report those dues, in-task
            # rounds included). A collect round that finds nothing due changes nothing, so a low bound only
            # costs a round; the collect round then carries the deferred finalize and runs it first.
            self.next_due = self.due_seen if collected else min(self.next_due, self.due_seen)
        else:
            final = self._final_round(result, stats)
            result.finalize = None
            self.next_due = final.next_due
            if final.events:
                result.events = atom_order(final.events, replies)
        stats["duration_ms"] = (time.perf_counter() - t_start) * 1000.0
        stats["size"] = len(txns)
        stats["committed"] = len(result.lockfree) + len(result.fast) + sum(1 for t in result.slow if replies[t].ok)
        result.stats = stats
        return result

    def idle_until(self) -> float:
        """The time before which an epoch without new requests would do nothing (fire no timer, run no deferred
        transaction, admit no held request): -inf when a deferred transaction can run now. For a runtime's
        pacing only (when epochs run, never what they decide)."""
        if len(self.deferred) > len(self.admission.held):
            return -math.inf
        return min(self.next_due, self.admission.retry_at) if self.deferred else self.next_due

    def _admit(self, txns: dict[int, Request], requests: list[tuple[int, Request]], now: float,
               stats: dict[str, float]) -> dict[int, tuple[bool, bytes, tuple[str, str]]]:
        """Admission control over a sequenced epoch (:mod:`charon.core.admission`): applies the epoch's limit
        changes and bulk cancels (a cancel answers the held requests it matches ``InvocationCancelled``: they
        are held no more), moves the requests held over a limit from ``txns`` to :attr:`deferred` (keeping their
        TIDs) and returns the replies decided here by TID: the changes', the cancelled ones and the refusals
        (``RateLimited``, ``Overloaded``)."""
        adm = self.admission
        declared = self.app.limits
        changes = [t for t, r in txns.items() if r.operator == LIMITS_OPERATOR] if any(
            r.operator == LIMITS_OPERATOR for _, r in requests) else []
        carried = [(t, r) for t, r in self.deferred_in if t not in adm.held]
        self.deferred_in = []
        if not (declared or changes or adm.held or adm.overrides or adm.buckets):
            return {}
        out: dict[int, tuple[bool, bytes, tuple[str, str]]] = {}
        for t in sorted(changes):
            if txns[t].function in BULK_FUNCTIONS:  # a bulk cancel (or its dry run) of held requests
                out[t], gone = adm.cancel_held(txns[t], [(h, txns[h]) for h in sorted(adm.held) if h not in out])
                for h, why in gone:
                    out[h] = (False, b"", ("InvocationCancelled", why))
                continue
            out[t] = adm.change(declared, txns[t], [txns[h] for h in sorted(adm.held)])
        skip = {t for t, _ in carried}
        dec = adm.admit(declared, now, [(t, txns[t]) for t in sorted(txns) if t not in skip and t not in out],
                        carried)
        self.deferred = [(t, txns.pop(t)) for t in dec.held]
        for t, etype, msg, value in dec.refused:
            out[t] = (False, value, (etype, msg))
        stats.update(admission_held=len(dec.held), admission_admitted=dec.admitted,
                     admission_refused=len(dec.refused), admission_max_waiting=adm.max_waiting)
        return out

    def _prior_ran(self, events: list[RawEvent]) -> None:
        """The round carrying the previous epoch's deferred finalize returned with its (raw) events."""
        prior, self._prior = self._prior, None
        if prior is not None:
            self._finalized(prior, events)
        held, self._held = self._held, []
        self._emit(held)

    def _rest(self, epoch: int, roots: list[int], msgs: Msgs, track: _Track, n: int, prior: Prior | None,
              result: EpochResult, stats: dict[str, float], bounds: list[int], j: int = 0,
              carry: tuple[list[int], list[int]] | None = None, invokes: list[Invoke] | None = None,
              ) -> tuple[list[int], list[int]]:
        """The epoch from dry-run round ``n`` of chunk ``j`` on (``msgs``: that round's messages; ``carry``: what
        the chunk before decided, settled in the chunk's first round): for this chunk and each next one, the
        dry run's remaining rounds, the lock-free decision and the fallback; replies go out as decided.
        Returns what the finalize applies and resets. ``invokes``: the root invocations of ``roots`` (same order,
        none run yet), when the caller made them already.

        An exchange with a ``rest(job) -> RestOutcome | None`` method may take all of it at any round (e.g.
        in one Spark task holding every partition, when the rest is small); the outcome is the same."""
        taker = getattr(self.exchange, "rest", None)
        if prior is not None and not msgs:  # nothing to run: the prior's finalize in a round of its own
            assert self._prior is not None
            self.due_seen = min(self.due_seen, self.finalize(self._prior, stats))
            self._prior = prior = None
            held, self._held = self._held, []
            self._emit(held)
        bases = chunk_bases(bounds)
        while True:
            while msgs and n < self.max_rounds:
                if taker is not None:
                    job = RestJob(epoch, {t: result.requests[t] for t in roots}, roots, msgs, track, n, prior, bounds,
                                  self.max_invocations, j, carry, self._verdicts_of(roots, result), self.observe)
                    out = taker(job)
                    if out is not None:
                        return self._taken(out, prior is not None, result, stats)
                apply, reset = carry if carry is not None else ((), ())
                msgs = self._round(Control(epoch, Control.DRY, apply=apply, reset=reset, prior=prior), msgs, track,
                                   stats)
                carry = None
                if prior is not None:  # a dry round's events are the prior's (an epoch's own come at its finalize)
                    events, track.events = track.events, []
                    self._prior_ran(events)
                prior = None
                n += 1
            stats["dry_rounds"] = stats.get("dry_rounds", 0) + n
            lo = bisect.bisect_right(roots, bounds[j - 1]) if j else 0
            hi = bisect.bisect_right(roots, bounds[j]) if j + 1 < len(bounds) else len(roots)
            if lo == hi and carry is not None:  # every transaction of the chunk was refused by its verdict: the
                decided = carry  # chunk before's outcome is still to settle, in the next chunk or the finalize
            else:
                decided = self._decide(epoch, roots[lo:hi], msgs, track, n, result, stats, bounds[j], bases[j])
            j += 1
            if j == len(bounds):
                return decided
            # the next chunk: its dry run starts from the state this one left (its commits settled first)
            carry, track, n = decided, _Track(), 0
            nxt = bisect.bisect_right(roots, bounds[j]) if j + 1 < len(bounds) else len(roots)
            msgs = invokes[hi:nxt] if invokes is not None else [_root(t, result.requests[t]) for t in roots[hi:nxt]]

    def _taken(self, out: RestOutcome, carried_prior: bool, result: EpochResult, stats: dict[str, float],
               ) -> tuple[list[int], list[int]]:
        """The exchange ran the rest of the epoch (:meth:`_rest`): take in what it decided."""
        if carried_prior:
            self._prior_ran(out.prior_events)
        self.due_seen = min(self.due_seen, out.next_due)
        if out.verdicts:
            self._adopt(out.verdicts)  # recorded before the replies that depend on them go out
        if out.trace:
            self.trace += out.trace  # before the replies: the runtime takes a transaction's with its reply
        self._emit(out.replies)
        for r in out.replies:
            result.replies[r.tid] = r
        result.lockfree += out.lockfree
        result.fast += out.fast
        result.slow += out.slow
        result.deferred += [t for t, _ in out.deferred]
        self.deferred.extend(out.deferred)
        inner = {"rounds": "task_rounds", "exchange_s": "task_s"}
        for k, v in out.stats.items():
            k = inner.get(k, k)
            stats[k] = stats.get(k, 0) + v
        return out.apply, out.reset

    def _decide(self, epoch: int, roots: list[int], msgs: Msgs, track: _Track, n: int, result: EpochResult,
                stats: dict[str, float], last_tid: int, base: int) -> tuple[list[int], list[int]]:
        """One chunk's dry run is over (``roots``: its transactions, ``last_tid``/``base``: its place, see
        :func:`position`): the lock-free decision, then the fallback. Returns what is still to apply and reset."""
        for tid in {m.tid for m in msgs} - track.failed.keys():  # pragma: no cover - safety net, never binds
            track.failed[tid] = ("CallGraphLimitExceeded", f"call graph still running after {n} rounds")
        done, shares, failed = track.done, track.shares, track.failed
        for tid in roots:  # every call graph is complete (track.complete, inlined)
            s = shares.get(tid)  # is_one, inlined
            if tid not in failed and (tid not in done or s is None or s[0] != 1 << s[1]):  # pragma: no cover
                raise AssertionError(f"transaction {tid}: call graph ended with shares {track.shares.get(tid)}")

        forced, late = self._judge(roots, result, failed) if self.verdicts else ((), None)
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
        failed = track.failed
        for tid in roots:
            if forced and tid in forced:  # judged in the dry run: aborted with its verdict, never rerun
                aborted_now.append(tid)
                continue
            for e in rw.get(tid, ()):  # a lower writer of anything it touched: conflicted
                if min_writer.get(e, tid) < tid:
                    conflicted.append(tid)
                    break
            else:
                lv = late.get(tid) if late else None
                if lv is not None:  # a fallback verdict, yet no conflict (see _judge): aborted with it
                    failed[tid] = (lv.error_type, lv.message)
                    aborted_now.append(tid)
                elif tid in failed:
                    aborted_now.append(tid)
                else:
                    lockfree.append(tid)
        # _reply(result, last_tid, t, False, True, done[t], base), inlined: position(t, last_tid, False, base)
        reqs, replies, ep = result.requests, result.replies, result.epoch
        early = []
        for t in lockfree:
            r = replies[t] = Reply(reqs[t].request_id, t, ep, True, done[t], "", "", base + t)
            early.append(r)
        early += [_reply(result, last_tid, t, False, False, err=track.failed[t], base=base) for t in aborted_now]
        self._emit(early)
        result.lockfree += lockfree
        stats["lockfree"] = stats.get("lockfree", 0) + len(lockfree)
        stats["aborted"] = stats.get("aborted", 0) + len(aborted_now)
        stats["conflicts"] = stats.get("conflicts", 0) + len(conflicted)
        if conflicted and self.verdicts:
            conflicted = self._judge_late(conflicted, result, last_tid, base)
        if not conflicted:
            return list(lockfree), []
        job = FallbackJob(
            epoch, conflicted, {t: rw.get(t, {}) for t in conflicted},
            {t: track.failed[t] for t in conflicted if t in track.failed},
            {t: result.requests[t] for t in conflicted}, lockfree, last_tid, self.max_invocations, base,
            self.observe, self._verdicts_of(conflicted, result),
        )
        runner = getattr(self.exchange, "fallback", None)
        self.phase = 1
        if runner is None:  # round by round through the exchange, replies per wave
            out = run_fallback(self.app, self.exchange, job, self._emit, self)
            inner: dict[str, str] = {}
        else:  # the exchange runs all of it at once (one Spark job): its rounds are not the exchange's
            out = runner(job)
            if out.verdicts:
                self._adopt(out.verdicts)  # recorded before the replies that depend on them go out
            if out.trace:
                self.trace += out.trace
            self._emit(out.replies)
            inner = {"rounds": "fallback_task_rounds", "exchange_s": "fallback_task_s"}
        self.phase = 0
        self.due_seen = min(self.due_seen, out.next_due)  # a no-op when run_fallback ran here
        for r in out.replies:
            result.replies[r.tid] = r
        result.fast += out.fast
        result.slow += out.slow
        result.deferred += [t for t, _ in out.deferred]
        self.deferred.extend(out.deferred)
        for k, v in out.stats.items():
            k = inner.get(k, k)
            stats[k] = stats.get(k, 0) + v
        return out.apply, out.reset

    def _verdicts_of(self, tids: list[int], result: EpochResult) -> dict[str, Verdict]:
        """The verdicts of ``tids`` (by request id), for a job that runs them elsewhere."""
        verdicts, reqs = self.verdicts, result.requests
        if not verdicts:
            return {}
        return {rid: verdicts[rid] for rid in (reqs[t].request_id for t in tids) if rid in verdicts}

    def _judge(self, roots: list[int], result: EpochResult, failed: dict[int, tuple[str, str]],
               ) -> tuple[set[int], dict[int, Verdict]]:
        """The chunk's transactions with a dry-run verdict (taken while this dry run ran, e.g. a function
        stopped past its budget): they fail with the verdict's error, reserve nothing, and are not rerun in the
        fallback, exactly as when validation refuses them at a replay (run_epoch). And those with a verdict taken
        in this epoch's fallback: they reserve as they did when it was taken; one that does not conflict now (a rerun
        judging anew, whose dry run changed with a new dry-run verdict) is aborted with it, never committed beside
        it."""
        reqs, verdicts, epoch = result.requests, self.verdicts, result.epoch
        forced = set()
        late: dict[int, Verdict] = {}
        for tid in roots:
            v = verdicts.get(reqs[tid].request_id)
            if v is None:
                continue
            if v.refuses(epoch):
                failed[tid] = (v.error_type, v.message)
                forced.add(tid)
            elif v.judges_fallback(epoch):
                late[tid] = v
        return forced, late

    def _judge_late(self, conflicted: list[int], result: EpochResult, last_tid: int, base: int) -> list[int]:
        """Conflicted transactions with a fallback verdict of no known round (:attr:`Verdict.in_round`) leave the
        fallback with its error before it starts, at their place in it (replayed, the dry run is as it was when
        the verdict was taken, so the same ones conflict). One with a round stays: it is judged there."""
        reqs, verdicts = result.requests, self.verdicts
        late = []
        for tid in conflicted:
            v = verdicts.get(reqs[tid].request_id)
            if v is not None and v.in_round is None and v.judges_fallback(result.epoch):
                late.append(_reply(result, last_tid, tid, True, False, err=(v.error_type, v.message), base=base))
        if not late:
            return conflicted
        self._emit(late)
        gone = {r.tid for r in late}
        return [t for t in conflicted if t not in gone]

    def _fallback(
        self, epoch: int, conflicted: list[int], track: _Track, result: EpochResult,
        reply: Callable[..., Reply], apply_lockfree: list[int], stats: dict[str, float],
    ) -> tuple[list[int], list[int]]:
        """Resolve the conflicted transactions through deterministic per-entity lock queues (see :class:`_Queues`).

        Every unresolved transaction waits in TID order in the queue of each entity of its known set K (the dry
        run's read/write set, grown by re-queues). Each round starts every waiting transaction whose locks are
        all granted, and the round runs everything started alongside (no wave barrier: a transaction that
        finishes releases its locks, so the next in its queues starts in the next round). A transaction whose
        dry run may be replayed (a *candidate*) starts as a call-graph-cached replay
        (:meth:`PartitionUnit._fast_round`), and so does a candidate queued only behind candidates starting in
        the same round (a chain commits in one round, each replay reading the valid ones below it); the others
        re-run from their root with their cached replies forgotten. The decisions (:meth:`_Queues.clear`) make
        every outcome equal to running the fallback's transactions one at a time in TID order.
        """
        q = _Queues({tid: dict(track.rw.get(tid, {})) for tid in conflicted})
        K = q.K
        candidates = {t for t in conflicted if t not in track.failed}
        st = _Track()
        apply_next, reset_next = list(apply_lockfree), list(conflicted)
        fast_rounds = slow_rounds = rounds = outside = 0
        requeues: dict[int, int] = {}
        started: dict[int, int] = {}  # locked re-runs in flight -> the round their root runs in
        fast_now: list[int] = []  # candidates replayed in the coming round
        msgs: list[Invoke | ReplyMsg] = []
        dirty = set(conflicted)
        verdicts, reqs = self.verdicts, result.requests
        known: dict[int, Verdict] = {}  # verdicts taken in this fallback before it ran (replayed): see _judged_here
        if verdicts:
            for tid in conflicted:
                vd = verdicts.get(reqs[tid].request_id)
                if vd is not None and vd.judges_fallback(epoch):
                    known[tid] = vd
        due: set[int] = set()
        # a safety net, like max_rounds: every transaction runs at most MAX_REQUEUES + 1 times (more only while
        # a lower one commits first), each run in at most max_rounds rounds; a livelock fails loudly, not hangs
        round_cap = 4 * (len(conflicted) + 1) * (MAX_REQUEUES + 2) * (self.max_rounds + 1)
        while q.unresolved:
            if rounds > round_cap:
                raise RuntimeError(f"epoch {epoch}: the fallback made no progress in {rounds} rounds "
                                   f"({len(q.unresolved)} of {len(conflicted)} transactions unresolved)")
            fast_now, roots = q.grant(dirty, candidates)
            dirty = set()
            if not fast_now and not roots and not started:  # pragma: no cover - the lowest one is always free
                fast_now, roots = q.grant(set(q.waiting), candidates)
                if not fast_now and not roots:
                    raise AssertionError("fallback made no progress")
            for tid in fast_now:
                st.forget(tid)
            for tid in roots:
                st.forget(tid)
                started[tid] = rounds
                msgs.append(_root(tid, result.requests[tid]))
            self.fallback_round = rounds  # a verdict taken in this round records it (Verdict.in_round)
            if self.outer is not None:
                self.outer.fallback_round = rounds
            fast_run = fast_now
            if known:  # judged in this round: their runs do not run in it (live, it is where they overran)
                due = {t for t in started.keys() | set(fast_now) if (vd := known.get(t)) is not None
                       and (vd.in_round is None or vd.in_round <= rounds)}
                if due:
                    fast_run = [t for t in fast_now if t not in due]
                    msgs = [m for m in msgs if m.tid not in due]
            control = Control(epoch, Control.FALLBACK, apply=apply_next, reset=reset_next, fast=fast_run)
            msgs = self._round(control, msgs, st, stats)
            fast_rounds += bool(fast_now)
            slow_rounds += bool(started)
            apply_next, reset_next = [], []
            in_flight = {m.tid for m in msgs}
            finished: list[int] = []
            for tid in sorted(started):
                if tid in due:
                    continue
                if tid not in st.failed and not st.complete(tid):
                    if rounds - started[tid] + 1 < self.max_rounds and tid in in_flight:
                        continue  # the cap: a safety net, never binds
                    st.failed[tid] = (CallGraphLimitExceeded.__name__,
                                      f"call graph still running after {rounds - started[tid] + 1} rounds")
                finished.append(tid)
            replies: list[Reply] = []
            fast_set = set(fast_now)
            todo = fast_set.union(finished, due)
            fast_cut: int | None = None  # a candidate judged in this round's replays (see _judged_here)
            for tid in sorted(todo):
                verdict = known.get(tid) if known else None
                if verdict is None and verdicts:  # taken in this round (live), recorded already (_verdict)
                    verdict = verdicts.get(reqs[tid].request_id)
                    if verdict is not None and not verdict.judges_fallback(epoch):  # a later epoch's (replayed)
                        verdict = None
                if verdict is not None and (verdict.in_round is None or verdict.in_round <= rounds):
                    started.pop(tid, None)  # its round (live: a run of it reported the verdict): see _judged_here
                    if tid in fast_set and fast_cut is None:
                        fast_cut = tid
                    dirty |= self._judged_here(tid, verdict, q, rounds, candidates, reply, replies, reset_next)
                    continue
                touched = st.rw.get(tid, {})
                if tid in fast_set:
                    if fast_cut is not None or tid in st.invalid:  # above a judged one: as if invalid
                        candidates.discard(tid)
                    elif tid in st.done and q.clear(tid, K[tid], None):
                        if verdict is not None:  # before its round: never an outcome beside its verdict
                            fast_cut = tid
                            dirty |= self._judged_here(tid, verdict, q, rounds, candidates, reply, replies,
                                                       reset_next)
                            continue
                        replies.append(reply(tid, True, st.done[tid]))
                        result.fast.append(tid)
                        apply_next.append(tid)
                        dirty |= q.resolve(tid, touched, rounds, True, candidates)
                        continue
                    elif not q.settled_below(tid, K[tid]):  # never clear now: its re-run decides (defers it)
                        candidates.discard(tid)
                    reset_next.append(tid)
                    dirty |= q.requeue(tid, None, candidates)
                    continue
                start = started.pop(tid)
                grows = not _within(touched, K[tid])
                if q.clear(tid, touched, start):
                    if verdict is not None:  # before its round: never an outcome beside its verdict
                        dirty |= self._judged_here(tid, verdict, q, rounds, candidates, reply, replies, reset_next)
                        continue
                    outside += grows
                    failed = st.failed.get(tid)
                    if failed is not None:
                        replies.append(reply(tid, False, err=failed))
                        reset_next.append(tid)
                    else:
                        replies.append(reply(tid, True, st.done[tid]))
                        apply_next.append(tid)
                    result.slow.append(tid)
                    dirty |= q.resolve(tid, touched, rounds, failed is None, candidates)
                    continue
                if grows and requeues.get(tid, 0) >= MAX_REQUEUES or not q.settled_below(tid, touched):
                    if verdict is not None:  # nor a deferral (its next epoch would not judge it where this one did)
                        dirty |= self._judged_here(tid, verdict, q, rounds, candidates, reply, replies, reset_next)
                        continue
                    reset_next.append(tid)
                    self.deferred.append((tid, result.requests[tid]))
                    result.deferred.append(tid)
                    dirty |= q.resolve(tid, {}, rounds, False, candidates)
                    continue
                reset_next.append(tid)
                if grows:  # reconnaissance (Calvin's OLLP): queue again with the larger set
                    requeues[tid] = requeues.get(tid, 0) + 1
                dirty |= q.requeue(tid, touched if grows else None, candidates)
            msgs = [m for m in msgs if m.tid in started]
            rounds += 1
            self._emit(replies)
        for k, v in (("fast_rounds", fast_rounds), ("slow_rounds", slow_rounds), ("fallback_rounds", rounds),
                     ("fast", len(result.fast)), ("deferred", len(result.deferred)),
                     ("requeued", sum(requeues.values())),
                     ("outside", outside)):  # outside: re-runs that stepped outside their known set, decided at once
            stats[k] = stats.get(k, 0) + v
        return apply_next, reset_next

    @staticmethod
    def _judged_here(tid: int, v: Verdict, q: _Queues, rnd: int, candidates: set[int], reply: Callable[..., Reply],
                     replies: list[Reply], reset_next: list[int]) -> set[int]:
        """``tid`` has a verdict taken in this fallback (:attr:`Verdict.in_round`): it leaves with the verdict's error,
        never queued again (a re-run would forget the failure and might commit, contradicting the verdict). The error
        depends on no state and it has no effect, so it needs no clearance and marks nothing decided.

        Replay-exact: which transactions the fallback commits, aborts or defers (and so their replies' epochs and
        values) depends on when each leaves the queues, so a verdict takes effect in the round it was taken in, live and
        replayed alike. Live, a run of it reports the verdict in round r (recorded with r before the round's replies go
        out); replayed, it runs as it did live before round r (every earlier round is the same: the same grants and
        runs, the same earlier verdicts at the same rounds) and leaves in round r, where its run does not run (live,
        that is where it overran: a replay takes no new verdict, so it could spin). What a run does in a round is its
        own (its buffers, messages, read/write set), so the others' decisions are the same. A run of it that would be
        decided before its round (committed, aborted or deferred: only when the epoch's earlier run took another course,
        e.g. a crash between the watchdog's reservation and the step's end, or a rerun judging anew) is judged instead:
        never an outcome beside a verdict. A candidate judged in a cached replay (live, stopped at some partitions and
        maybe valid at others; replayed, not run) may have fed its writes to the higher candidates replayed in that
        round: those are requeued as if invalid (the caller's ``fast_cut``), so that round decides the same both ways.
        (Removing it before the fallback on replay, as :meth:`_judge_late` does for a verdict of no known round, frees
        its queue places earlier and can change who commits: a reply contradicted, see
        tests/core/test_fallback_verdicts.py.) Returns the transactions its released locks may wake."""
        replies.append(reply(tid, False, err=(v.error_type, v.message)))
        reset_next.append(tid)  # whatever its runs wrote to the overlay
        return q.resolve(tid, {}, rnd, False, candidates)
