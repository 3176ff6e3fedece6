"""The partition-level unit of the deterministic core: one partition's share of an epoch, round by round.

A runtime drives a :class:`PartitionUnit` with ``step(control, inbox) -> RoundOutput``: the control part
(apply committed transactions, reset aborted ones, run the call-graph-cached fallback, finalize the epoch)
is processed first, then the inbox of messages (invocations and replies). Calls to entities of this same
partition are executed within the round; the rest are returned for the runtime to route. Everything the
unit keeps between rounds of an epoch is its *scratch* (write buffers, suspended frames, the dry run's
call-graph cache, the epoch's committed overlay), which :meth:`dump_scratch`/:meth:`load_scratch` move
between processes: on Spark the driver holds it, so any task in any worker can run the next round.
Committed state is read from a :class:`~charon.state.store.PartitionStore` as of the end of the previous epoch;
the store is written once per epoch, at finalize, idempotently.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar, final

from charon import serde
from charon.core import awaits as _awaits
from charon.core import timers as _timers
from charon.core.awaits import GUARD as _GUARD
from charon.core.awaits import TRIPS as _TRIPS
from charon.core.awaits import foreign_await, trip_error, tripped
from charon.core.awaits import get_running_loop as _get_running_loop
from charon.core.awaits import raise_tripped as _raise_tripped
from charon.core.awaits import set_running_loop as _set_running_loop
from charon.core.context import (
    MAX_VALUE_BYTES,
    CallRecord,
    CodeBook,
    EngineContext,
    Journal,
    check_awaited,
    child_inv,
    raised_in,
    too_large,
)
from charon.core.routing import entity_prefix, key_group, store_key
from charon.core.shares import ZERO as _ZERO
from charon.core.shares import Share, add, split
from charon.core.tracebacks import format_traceback
from charon.errors import CallGraphLimitExceeded, InvocationTimeout, NonDeterministicFunction
from charon.operator import Application
from charon.state.store import PartitionStore

_encode = serde._enc.encode
_decode = serde._dec.decode  # msgpack the engine itself encoded (serde.decode wraps errors in SerializationError)
_check_value = serde.check_value  # the value model of return values (serde.encode_value)
_SCALARS = serde._SCALARS

ROOT, SYNC, ASYNC = 0, 1, 2
_NONE = serde.encode(None)  # the value a sent invocation completes with (its return value is not delivered)
# Live coroutines kept across rounds in this process (see ``_live_table``). Keyed by partition and epoch,
# then by tid and frame.token, with the frame's journal.nsusp when it suspended (a resume needs the same). A stale
# coroutine of a failed attempt cannot be resumed wrongly (issue 9): ``token`` is drawn once per Frame, when an
# Invoke is first run (one int from a counter never reused, started at a random 64-bit multiple of 2**64 in each
# process, forked ones included), and travels in the scratch the driver re-sends. A query restart or a reset
# round re-creates the frames from new Invokes, so they get new tokens and never match an old entry (which is
# dropped at the partition's next epoch). The same (token, nsusp) comes back only when Spark retries a round
# from the very same inputs (the last successful scratch, the same inbox, a store that rounds only read):
# the stale coroutine is then exactly where replaying its journal would bring it, and an attempt that runs
# the frame again replaces the entry under the same key.
class _Judged(Exception):
    """Carries a judged step's verdict error to :meth:`PartitionUnit._run`'s handler (engine-internal)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


class Interrupt(BaseException):
    """Raised into the thread running a function that overran its time budget (``PyThreadState_SetAsyncExc``
    from the runtime's watchdog, :mod:`charon.runtime.guard.watchdog`): a ``BaseException``, so application code's
    ``except Exception`` does not swallow it. :meth:`PartitionUnit._run` turns it into the transaction's
    failure (:attr:`PartitionUnit.interrupt`, the recorded ``InvocationTimeout``)."""


_disarm: list[Callable[[], None]] = []


def on_disarm(fn: Callable[[], None]) -> None:
    """Register how to drop an interrupt set for this thread and not raised yet (the runtime's watchdog)."""
    if fn not in _disarm:
        _disarm.append(fn)


def disarm() -> None:
    """Drop an interrupt pending for this thread (a judged step ended before it landed)."""
    for fn in _disarm:
        fn()


def timeout_message(frame: Any) -> str:
    """The error of a function stopped past its budget (deterministic: the same wherever it is taken)."""
    msg = f"{frame.op}.{frame.fn} on key {frame.key!r} ran past its time budget without awaiting a call"
    return raised_in(msg, frame.op, frame.key, frame.fn) if frame.kind != ROOT else msg


_LIVE: dict[tuple[int, int], tuple[int, dict[int, LiveTable]]] = {}  # (thread, partition) -> (epoch, table)
_thread_id = threading.get_ident


def _token_counter() -> itertools.count[int]:
    """This process's frame tokens: 2**64 of them from a random multiple of 2**64 (one int per frame, no tuple)."""
    return itertools.count(int.from_bytes(os.urandom(8), "big") << 64)


_TOKENS = _token_counter()


def _forked() -> None:
    global _TOKENS
    _TOKENS = _token_counter()  # a forked worker must not draw its parent's tokens


os.register_at_fork(after_in_child=_forked)


def _next_token() -> int:
    """Unique per frame across processes (each process, forked ones too, counts from its own random start)."""
    return next(_TOKENS)
#: Keep suspended coroutines alive in this process and resume them directly (an optimization; the
#: journal replay is always available and is what a resumed frame uses in any other process).
KEEP_LIVE_COROUTINES = True
#: Default limit on the invocations (root, calls and sends) of one transaction, counted over all partitions
#: by the coordinator (a user-visible limit: it must not depend on placement; see ``EpochCoordinator``).
MAX_INVOCATIONS = 100_000

Entity = tuple[str, str]
S = TypeVar("S", bound=PartitionStore)  # a unit's store
#: A synchronous call's caller: (operator, key, invocation id, key group when known).
Caller = tuple[str, str, str, int | None]


def too_many_invocations(limit: int) -> CallGraphLimitExceeded:
    """The abort of a transaction that started more than ``limit`` invocations (one message everywhere)."""
    return CallGraphLimitExceeded(f"more than {limit} invocations")


@final  # never subclassed: the engine tells messages apart with ``type(m) is Invoke``
class Invoke(Journal):
    """Run ``fn(*args)`` on entity (op, key) as invocation ``inv`` of transaction ``tid``.

    The partition that runs the message makes the same object the invocation's *frame* (:func:`start_frame`):
    it then also holds the invocation's :class:`~charon.core.context.Journal` (all a replay needs) and
    ``token``, so no second object is made per invocation. ``token`` is None while it is a message.
    """

    __slots__ = ("tid", "inv", "op", "key", "fn", "args", "share", "kind", "caller", "ts", "depth", "token", "kg")
    tid: int
    inv: str
    op: str
    key: str
    fn: str
    args: bytes
    share: Share
    kind: int  # ROOT, SYNC or ASYNC
    caller: Caller | None  # a synchronous call's caller, where its reply goes
    ts: float
    depth: int
    token: int | None
    kg: int | None

    def __init__(self, tid: int, inv: str, op: str, key: str, fn: str, args: bytes, share: Share, kind: int,
                 caller: Caller | None, ts: float, depth: int) -> None:
        # one store per attribute: a tuple assignment of more than three names builds and unpacks a tuple
        self.tid = tid
        self.inv = inv
        self.op = op
        self.key = key
        self.fn = fn
        self.args = args
        self.share = share
        self.kind = kind
        self.caller = caller
        self.ts = ts
        self.depth = depth
        self.token = self.kg = None  # kg: routing.key_group(op, key) once a router computed it (not pickled)

    def __reduce__(self) -> tuple[Callable[..., Invoke], tuple[object, ...]]:
        if self.token is None:
            return (_new_invoke, (
                self.tid, self.inv, self.op, self.key, self.fn, self.args, self.share, self.kind, self.caller,
                self.ts, self.depth,
            ))
        return (_new_frame, (
            self.tid, self.inv, self.op, self.key, self.fn, self.args, self.share, self.kind, self.caller,
            self.ts, self.depth, self.replies, self.reads, self.nsusp, self.pending, self.token,
        ))

    @property
    def journal(self) -> Journal:
        """The frame's journal (the frame itself)."""
        return self


#: An invocation in progress: its message, its journal and its token (see :class:`Invoke`).
Frame = Invoke


def start_frame(m: Invoke, replies: Any = None) -> Invoke:
    """Make message ``m`` the frame of a new run of its invocation (``replies``: (child, reply) pairs to preset,
    the call-graph-cached fallback's dry-run replies); an empty journal, a fresh token."""
    m.replies = dict(replies) if replies else {}
    m.reads = []
    m.nsusp = 0
    m.pending = None
    # Identifies this run of the invocation for the live-coroutine table: a transaction reset and rerun
    # gets new frames, so a coroutine left in some worker by an earlier run is never resumed for it.
    m.token = next(_TOKENS)  # _next_token(), inlined (one frame per invocation)
    return m


class Reply:
    """The return value of synchronous call ``child``, addressed to the suspended caller (op, key, inv).

    ``kg``: the caller's key group (routing.key_group(op, key)) when known, else None (not pickled)."""

    __slots__ = ("tid", "op", "key", "inv", "value", "share", "child", "kg")
    tid: int
    op: str
    key: str
    inv: str
    value: bytes
    share: Share
    child: str
    kg: int | None

    def __init__(self, tid: int, op: str, key: str, inv: str, value: bytes, share: Share, child: str,
                 kg: int | None = None) -> None:
        self.tid = tid  # one store per attribute (see Invoke.__init__)
        self.op = op
        self.key = key
        self.inv = inv
        self.value = value
        self.share = share
        self.child = child
        self.kg = kg

    def __reduce__(self) -> tuple[Callable[..., Reply], tuple[object, ...]]:
        return (_new_reply, (
            self.tid, self.op, self.key, self.inv, self.value, self.share, self.child,
        ))


#: What running one invocation step sends on (:meth:`PartitionUnit._run`): calls and sends, or the reply to its
#: caller (a tuple when that reply alone).
Outgoing = list[Invoke | Reply] | tuple[Invoke | Reply, ...]
#: A suspended frame's live coroutine in this process: (coroutine, its context, the journal's nsusp).
Live = tuple[Coroutine[Any, Any, Any], EngineContext, int]
#: One transaction's live coroutines by frame token (Invoke.token: never None once the Invoke is a frame).
LiveTable = dict[int | None, Live]


class Prior(NamedTuple):
    """The finalize of an earlier epoch carried by the next epoch's first round (one Spark job less).

    ``apply`` are the transactions whose buffered writes still enter the epoch's overlay, ``reset`` the
    ones whose writes are dropped; then the epoch's delta is written (:meth:`PartitionUnit.finalize_prior`).
    """

    epoch: int
    apply: list[int]
    reset: list[int]


#: What pickles a Control: (epoch, phase, apply, reset, fast, finalize, max_invocations, prior, timers, observe).
_ControlState = tuple[int, int, list[int], list[int], list[int], bool, int, Prior | None, tuple[float, int] | None,
                      bool]


class Control:
    """The coordinator's instructions for one round, the same for every partition.

    ``max_invocations`` is the coordinator's per-transaction limit; a partition fails a transaction on
    its own only when it alone started more than that within one round (so no round runs away; the coordinator,
    summing every partition's and round's counts before the round's errors, fails it the same way whenever
    the transaction's invocations over the epoch phase exceed the limit).
    ``prior``: the previous epoch's finalize, done before anything of this round (see :class:`Prior`).
    """

    __slots__ = ("epoch", "phase", "apply", "reset", "fast", "finalize", "max_invocations", "prior", "timers",
                 "observe")

    DRY, FALLBACK = 0, 1

    def __init__(self, epoch: int, phase: int = 0, apply: Iterable[int] = (), reset: Iterable[int] = (),
                 fast: Iterable[int] = (), finalize: bool = False,
                 max_invocations: int = MAX_INVOCATIONS, prior: Prior | None = None,
                 timers: tuple[float, int] | None = None) -> None:
        """``timers``: a collect round (epoch time, per-partition limit); see :mod:`charon.core.timers`."""
        self.epoch, self.phase, self.apply, self.reset = epoch, phase, list(apply), list(reset)
        self.fast, self.finalize, self.max_invocations = list(fast), finalize, max_invocations
        self.prior = prior
        self.timers = timers
        #: report the invocations run and the tracebacks of the functions that raised in ``RoundOutput.trace``
        #: (observation only, set by the coordinator: nothing deterministic depends on it)
        self.observe = False

    def __getstate__(self) -> _ControlState:
        return (self.epoch, self.phase, self.apply, self.reset, self.fast, self.finalize, self.max_invocations,
                self.prior, self.timers, self.observe)

    def __setstate__(self, st: _ControlState) -> None:
        (self.epoch, self.phase, self.apply, self.reset, self.fast, self.finalize, self.max_invocations,
         self.prior, self.timers, self.observe) = st


#: What pickles a RoundOutput (its fields in order).
_OutputState = tuple[
    list["Invoke | Reply"], list[tuple[int, bytes, Share]], list[tuple[int, Share]], list[tuple[int, str, str]],
    dict[int, dict[Entity, bool]], list[int], dict[int, int], dict[str, int], dict[int, list["Cached"]],
    list[tuple[int, str, int, str, bytes]], list[bytes], float | None, "list[Observed] | None",
]
#: What a round observed of one transaction (``Control.observe``), beside its deterministic output: an invocation
#: started ``(tid, inv, op, key, fn, kind)``, or the traceback of one that raised ``(tid, inv, traceback)``.
Observed = tuple[int, str, str, str, str, int] | tuple[int, str, str]


class RoundOutput:
    """What one partition returns from a round."""

    __slots__ = ("messages", "done", "acks", "failed", "rw", "invalid", "invocations", "stats", "cached", "events",
                 "timers", "next_due", "trace")

    def __init__(self) -> None:
        self.messages: list[Invoke | Reply] = []  # for other partitions
        self.done: list[tuple[int, bytes, Share]] = []  # root finished: (tid, value, share)
        self.acks: list[tuple[int, Share]] = []  # terminal ack shares
        self.failed: list[tuple[int, str, str]] = []  # (tid, error type, message)
        # tid -> the entities it touched here so far in the epoch's phase, and whether it wrote each (the unit's
        # own dict, listed when it changed this round: a reader copies it before changing anything)
        self.rw: dict[int, dict[Entity, bool]] = {}
        self.invalid: list[int] = []  # call-graph-cached fallback: tids that did not replay identically
        self.invocations: dict[int, int] = {}  # tid -> invocations started this round (the coordinator sums)
        self.stats: dict[str, int] = {}
        # dry-run invocations completed this round, for the call-graph cache (a runtime that does not keep
        # the unit between rounds keeps them and hands back those of the fallback's transactions)
        self.cached: dict[int, list[Cached]] = {}
        # at finalize: the epoch's committed events here, (tid, inv, n, stream, value) (see Context.emit)
        self.events: list[tuple[int, str, int, str, bytes]] = []
        self.timers: list[bytes] = []  # a collect round: the encoded timers this partition fires
        self.next_due: float | None = None  # collect and finalize rounds: this partition's next due time
        self.trace: list[Observed] | None = None  # Control.observe: what the round observed (never deterministic)

    def __getstate__(self) -> _OutputState:
        return (self.messages, self.done, self.acks, self.failed, self.rw, self.invalid, self.invocations,
                self.stats, self.cached, self.events, self.timers, self.next_due, self.trace)

    def __setstate__(self, st: _OutputState) -> None:
        (self.messages, self.done, self.acks, self.failed, self.rw, self.invalid, self.invocations, self.stats,
         self.cached, self.events, self.timers, self.next_due, self.trace) = st


class Cached:
    """A dry-run invocation remembered for the call-graph-cached fallback: its completed ``frame`` (whose
    journal's replies never change again), the value it returned, the calls it made.

    ``access`` is how the dry run touched the invocation's entity: None (not at all), False (read),
    True (wrote); a cached replay must stay within it (see :meth:`PartitionUnit._fast_round`).
    """

    __slots__ = ("frame", "result", "calls", "access")

    def __init__(self, frame: Frame, result: bytes, calls: list[CallRecord] | None, access: bool | None) -> None:
        self.frame, self.result, self.calls, self.access = frame, result, calls, access

    def __reduce__(self) -> tuple[Callable[..., Cached], tuple[object, ...]]:
        f = self.frame
        return (_new_cached, (
            f.inv, f.op, f.key, f.fn, f.args, f.replies, self.result, self.calls, f.ts, f.depth, f.kind, self.access,
        ))


class PartitionUnit(Generic[S]):
    """One partition of the deterministic core (see the module docstring); ``S``: the type of its store."""

    # Slots: attribute access stays the fast kind whatever the number of attributes (CPython 3.11 measured: with
    # a plain instance dict, a 27th attribute made a Deathstar search epoch ~2.5% more instructions). A new
    # attribute goes here.
    __slots__ = ("pid", "partitions", "app", "previous", "code", "store", "max_invocations", "report_cache",
                 "sole_writer", "_due", "_ltab", "_fresh", "epoch", "buffers", "frames", "touched", "cache", "_clog",
                 "overlay", "dead", "fast_layer", "_recording", "emits", "emitted", "_out", "_stat_reads",
                 "_stat_runs", "current", "doomed", "interrupt", "twice", "__weakref__")

    def __init__(self, pid: int, partitions: int, app: Application, store: S) -> None:
        self.pid = pid
        self.partitions = partitions
        self.app = app
        # a compatible code update (the engines): (first TID on ``app``, the previous application);
        # a transaction with a lower TID started before the update and finishes on the previous application
        self.previous: tuple[int, Application] | None = None
        #: the engine's code versions (a :class:`~charon.core.context.CodeBook`: workflow version pinning); None:
        #: an engine that lends none (Spark's executors get one built from the shipped history)
        self.code: CodeBook | None = None
        self.store = store
        self.max_invocations = MAX_INVOCATIONS  # set by each round's Control
        #: Whether rounds hand their dry-run invocations out in ``RoundOutput.cached``: a runtime that keeps this
        #: unit between rounds (the in-process one) turns it off, its cache stays here
        self.report_cache = True
        #: Whether this unit is its store's only writer (the in-process runtime): a finalize that writes nothing
        #: then reports the next due time it found last instead of scanning the timer index again
        self.sole_writer = False
        self._due: tuple[int, float] | None = None  # (store epoch, next due time) after the last finalize
        self._ltab: dict[int, LiveTable] = {}  # the live-coroutine table of the round being processed (_process)
        # whether the scratch is as _clear leaves it (nothing of an epoch here yet): a partition an epoch never
        # reached then clears and finalizes without allocating anything (see step)
        self._fresh = False
        #: the invocation whose code runs now (None between invocations): what a watchdog in another thread
        #: samples to find a function that overran its budget (see Interrupt)
        self.current: Frame | None = None
        #: the step the watchdog judged past its budget (set only while it is ``current``, before any interrupt is
        #: raised): whatever that step does next (return, raise, catch the interrupt), its transaction fails with
        #: the verdict (:meth:`_judged`)
        self.doomed: Frame | None = None
        #: called in this thread when an Interrupt stops ``frame``: records the verdict, returns the error that
        #: fails its transaction (the runtime's watchdog sets it; see Interrupt)
        self.interrupt: Callable[[Frame], BaseException] | None = None
        #: run every invocation step twice and abort on different effects (:mod:`charon.core.determinism`)
        self.twice: Callable[[PartitionUnit[Any], Frame], Outgoing] | None = None
        self._clear(-1)

    @property
    def check_determinism(self) -> bool:
        """Whether every invocation step runs twice: a runtime sets :attr:`twice` to
        :func:`charon.core.determinism.run_twice` (the core's partition does not import the check)."""
        return self.twice is not None

    def app_for(self, tid: int) -> Application:
        """The application transaction ``tid`` runs with (see :attr:`previous`)."""
        prev = self.previous
        return prev[1] if prev is not None and tid < prev[0] else self.app

    # -- scratch ----------------------------------------------------------------------------------
    def _clear(self, epoch: int) -> None:
        self.epoch = epoch
        if self._fresh:  # nothing was put in since the last clear
            return
        self._fresh = True
        self.buffers: dict[int, dict[Entity, dict[str, bytes | None]]] = {}
        self.frames: dict[int, dict[str, Frame]] = {}
        self.touched: dict[int, dict[Entity, bool]] = {}
        self.cache: dict[int, list[Cached]] = {}
        # dry-run completions not yet in ``cache``, per TID: (frame, value, calls, the tid's touched dict here);
        # see _take_cache (a transaction's cache entries are needed only if it conflicts)
        self._clog: dict[int, list[tuple[Frame, bytes, list[CallRecord] | None, dict[Entity, bool] | None]]] = {}
        self.overlay: dict[Entity, dict[str, bytes | None]] = {}
        self.dead: set[int] = set()
        self.fast_layer: dict[Entity, dict[str, bytes | None]] | None = None
        self._recording = True
        # events buffered like writes: per uncommitted TID, then the epoch's committed ones (applied)
        self.emits: dict[int, list[tuple[int, str, int, str, bytes]]] = {}
        self.emitted: list[tuple[int, str, int, str, bytes]] = []

    # The call-graph cache is not scratch: it leaves the unit once, in RoundOutput.cached (see load_cache).
    _SCRATCH = ("epoch", "buffers", "frames", "touched", "overlay", "dead", "emits", "emitted")

    def dump_scratch(self) -> bytes:
        """The unit's between-round state, for a runtime that runs the next round elsewhere."""
        return pickle.dumps(tuple(getattr(self, n) for n in self._SCRATCH), protocol=pickle.HIGHEST_PROTOCOL)

    def load_scratch(self, data: bytes | None) -> None:
        """Restore what :meth:`dump_scratch` produced (None or empty: a fresh epoch)."""
        if not data:
            self._clear(-1)
            return
        for n, v in zip(self._SCRATCH, pickle.loads(data), strict=True):
            setattr(self, n, v)
        self._fresh = False
        self.next_round()

    def next_round(self) -> None:
        """Before a round of a unit that holds an epoch's scratch (loaded, or kept from the round before by a
        runtime that keeps its units between rounds, like the resident gang): the call-graph cache of a round
        that reports it (:meth:`load_cache` gives this round's) and the fast path's layer start empty."""
        self.cache = {}
        self._clog = {}
        self.fast_layer = None

    def decided(self, apply: list[int], reset: list[int]) -> None:
        """The epoch's outcome is decided (``apply``/``reset``: what its finalize settles): settle them now and
        keep only what the finalize writes (the overlay and the committed events), so that a runtime shipping
        the scratch to the finalize's round ships only that. The finalize settles the same lists again: a no-op."""
        self._settle(apply, reset)
        self._fresh = False
        self.buffers, self.frames, self.touched, self.dead, self.emits = {}, {}, {}, set(), {}
        self.cache, self._clog = {}, {}

    def _take_cache(self, want: set[int] | None, report: dict[int, list[Cached]] | None = None) -> None:
        """Move the logged dry-run completions of the transactions in ``want`` (None: all) into the cache (and
        into ``report``). An entry's ``access`` is read from the transaction's touched dict of the dry run, which
        only a later invocation on the same entity could change (the replay is then invalid anyway)."""
        cache, clog = self.cache, self._clog
        if want is None:
            taken = list(clog.items())
            self._clog = {}
        else:  # only the wanted ones (an epoch's later chunks log more: never a scan of the whole log)
            taken = [(tid, clog.pop(tid)) for tid in want if tid in clog]
        for tid, entries in taken:
            for f, value, calls, t in entries:
                c = Cached(f, value, calls, t.get((f.op, f.key)) if t else None)
                lst = cache.get(tid)
                if lst is None:
                    cache[tid] = [c]
                else:
                    lst.append(c)
                if report is not None:
                    lst = report.get(tid)
                    if lst is None:
                        report[tid] = [c]
                    else:
                        lst.append(c)

    def load_cache(self, cached: dict[int, list[Cached]]) -> None:
        """Hand back dry-run invocations (from earlier RoundOutput.cached) before a call-graph-cached round."""
        self._fresh = False
        for tid, entries in cached.items():
            self.cache.setdefault(tid, []).extend(entries)

    # -- state access used by Context -------------------------------------------------------------
    def _touch(self, tid: int, e: Entity, wrote: bool) -> None:
        t = self.touched.get(tid)
        if t is None:
            t = self.touched[tid] = {}
        prev = t.get(e)
        if prev is None or (wrote and not prev):
            t[e] = wrote or bool(prev)
            self._out.rw[tid] = t

    def read(self, tid: int, op: str, key: str, item: str) -> bytes | None:
        e = (op, key)
        t = self.touched.get(tid)  # self._touch(tid, e, False), inlined (the hot path)
        if t is None:
            t = self.touched[tid] = {e: False}
            self._out.rw[tid] = t
        else:
            wrote = t.get(e)
            if wrote is None:
                t[e] = False
                self._out.rw[tid] = t
            elif wrote:  # only an entity the transaction wrote has a write buffer (see write)
                b = self.buffers.get(tid)
                if b is not None:
                    items = b.get(e)
                    if items is not None and item in items:
                        return items[item]
        if self.fast_layer is not None:
            items = self.fast_layer.get(e)
            if items is not None and item in items:
                return items[item]
        items = self.overlay.get(e)
        if items is not None and item in items:
            return items[item]
        self._stat_reads += 1
        return self.store.get(f"{op}\0{key}\0{item}".encode())  # routing.store_key, inlined

    def scan(self, tid: int, op: str, key: str, item_prefix: str, start: str | None = None,
             stop: str | None = None) -> list[tuple[str, bytes]]:
        """Items (store item names, sorted) starting with ``item_prefix`` and within ``[start, stop)``.

        ``start``/``stop`` are store item names too. Every name in ``[start, stop)`` starts with their common
        prefix, so the store is scanned under the longer of that and ``item_prefix``; names are compared as
        UTF-8 bytes, which order like the strings, and only the items in range are decoded.
        """
        e = (op, key)
        self._touch(tid, e, False)
        narrow = item_prefix
        if start is not None and stop is not None:
            common = os.path.commonprefix([start, stop])
            if common.startswith(narrow):
                narrow = common
            elif not narrow.startswith(common):
                return []  # no name starts with both
        lo = start.encode() if start is not None else None
        hi = stop.encode() if stop is not None else None
        plen = len(entity_prefix(op, key))
        b = self.buffers.get(tid)
        layers = [self.overlay.get(e), self.fast_layer.get(e) if self.fast_layer is not None else None,
                  b.get(e) if b is not None else None]
        if not (layers[0] or layers[1] or layers[2]):  # committed state alone: the store's order is the answer
            rows: list[tuple[str, bytes]] = []
            for k, v in self.store.scan(store_key(op, key, narrow)):
                it = k[plen:]
                if lo is not None and it < lo:
                    continue
                if hi is not None and it >= hi:
                    break  # the store scans in key order (UTF-8 bytes order like the strings)
                if it:  # never the main value (item "")
                    rows.append((it.decode(), v))
            return rows
        merged: dict[str, bytes | None] = {}
        for k, v in self.store.scan(store_key(op, key, narrow)):
            it = k[plen:]
            if lo is not None and it < lo:
                continue
            if hi is not None and it >= hi:
                break  # the store scans in key order
            merged[it.decode()] = v
        for layer in layers:
            if layer:
                for name, val in layer.items():
                    if name.startswith(narrow) and (start is None or name >= start) and (stop is None or name < stop):
                        merged[name] = val
        return sorted((k, v) for k, v in merged.items() if v is not None and k)

    def write(self, tid: int, op: str, key: str, item: str, value: bytes | None) -> None:
        """Buffer a write of ``tid``; its entity is marked written in ``touched`` (which alone says whether a
        write buffer of the entity may exist: :meth:`read` looks for one only then)."""
        e = (op, key)
        t = self.touched.get(tid)  # self._touch(tid, e, True), inlined
        if t is None:
            t = self.touched[tid] = {e: True}
            self._out.rw[tid] = t
        elif t.get(e) is not True:
            t[e] = True
            self._out.rw[tid] = t
        b = self.buffers.get(tid)
        if b is None:
            self.buffers[tid] = {e: {item: value}}
            return
        items = b.get(e)
        if items is None:
            b[e] = {item: value}
        else:
            items[item] = value

    def emit(self, tid: int, inv: str, n: int, stream: str, value: bytes) -> None:
        """Buffer event ``n`` of invocation ``inv`` with the transaction's writes (no read/write set entry)."""
        e = self.emits.get(tid)
        if e is None:
            e = self.emits[tid] = []
        e.append((tid, inv, n, stream, value))

    # -- one round --------------------------------------------------------------------------------
    def finalize_prior(self, prior: Prior) -> RoundOutput:
        """Settle and write an earlier epoch (:class:`Prior`) from this unit's scratch of that epoch (none
        here: an empty delta, which still advances the store to that epoch). Returns the output of the round
        carrying it so far: that epoch's events and next due time, its delta's size in ``stats["delta"]``
        (a caller that runs it outside :meth:`step` passes it to ``step(done=...)``)."""
        out = self._out = RoundOutput()
        if self.epoch != prior.epoch:
            self._clear(prior.epoch)
        self._settle(prior.apply, prior.reset)
        out.stats = {"delta": self._finalize()}
        self._out = None  # type: ignore[assignment]
        return out

    def step(self, control: Control, inbox: list[Invoke | Reply], done: RoundOutput | None = None) -> RoundOutput:
        """Process one round: the prior epoch's finalize (or ``done``, its output when the caller ran it),
        a collect round's timers (from the state that finalize wrote), control (apply, reset, fast
        fallback), then messages, then finalize. The events in the output are the prior's if it carries one,
        else this epoch's (at its finalize): a round never carries both."""
        if control.prior is not None:
            assert not control.finalize, "a round carries another epoch's finalize or its own, not both"
            done = self.finalize_prior(control.prior)
        elif (self._fresh and control.finalize and done is None and not inbox and not control.fast
              and control.timers is None):  # the epoch never reached this partition: only its empty finalize
            self.epoch = control.epoch  # (_clear of a fresh scratch; apply and reset change nothing in it)
            out = self._out = RoundOutput()
            self._finalize()
            out.stats = {"reads": 0, "runs": 0, "delta": 0}
            self._out = None  # type: ignore[assignment]
            return out
        if control.epoch != self.epoch:
            self._clear(control.epoch)
        if done is not None:
            out = self._out = done
            prior_delta = out.stats.get("delta", 0)
        else:
            out = self._out = RoundOutput()
            prior_delta = 0
        self.max_invocations = control.max_invocations
        if control.observe and out.trace is None:
            out.trace = []
        self._stat_reads = 0
        self._stat_runs = 0
        self._recording = control.phase == Control.DRY
        if inbox or control.fast or control.timers is not None:
            self._fresh = False  # (apply and reset change nothing in a fresh scratch)
        self._settle(control.apply, control.reset)
        if control.timers is not None:
            self._collect_timers(*control.timers)
        if control.fast:
            prev_loop = _get_running_loop()  # the guard is the running loop (see _process)
            _set_running_loop(_GUARD)
            try:
                self._fast_round(control.fast)
            finally:
                _set_running_loop(prev_loop)
        if inbox:
            self._process(inbox)
        if self._clog and self.report_cache:
            self._take_cache(None, out.cached)
        delta = self._finalize() if control.finalize else 0
        out.stats = {"reads": self._stat_reads, "runs": self._stat_runs, "delta": delta + prior_delta}
        self._out = None  # type: ignore[assignment]
        return out

    def timer_registered(self, due: float) -> None:
        """A transaction wrote a timer due at ``due``: reported in the round's ``next_due`` (a lower bound on
        the next due time, which the coordinator needs when this epoch's finalize is deferred)."""
        out = self._out
        if out.next_due is None or due < out.next_due:
            out.next_due = due

    def _settle(self, apply: list[int], reset: list[int]) -> None:
        """Committed transactions' buffers enter the overlay; reset ones are forgotten."""
        overlay = self.overlay
        buffers, emits = self.buffers, self.emits
        for tid in apply:
            b = buffers.pop(tid, None)
            if b is not None:
                for e, items in b.items():
                    o = overlay.get(e)
                    if o is None:
                        overlay[e] = items  # moved: the popped buffer was its only holder
                    else:
                        o.update(items)
            if emits:
                ev = emits.pop(tid, None)
                if ev:
                    self.emitted.extend(ev)
        if not reset:
            return
        touched, frames, dead = self.touched, self.frames, self.dead
        live = self._live_table()
        for tid in reset:
            t = live.pop(tid, None)  # self._live_drop(tid), inlined
            if t:
                for coro, ctx, _ in t.values():
                    ctx._drop(coro)
            buffers.pop(tid, None)
            emits.pop(tid, None)
            frames.pop(tid, None)
            touched.pop(tid, None)
            dead.discard(tid)

    def _process(self, inbox: list[Invoke | Reply]) -> None:
        self._ltab = self._live_table()  # for _run (the table stays the same within the round)
        queue = deque(inbox)
        out = self._out
        started = out.invocations
        limit = self.max_invocations
        trace = out.trace  # Control.observe (None: off, one test per invocation)
        run = self._run
        twice = self.twice
        if twice is not None:  # each step twice (per round: nothing per invocation when off)
            run = partial(twice, self)
        # the guard is asyncio's running loop while the round runs functions (per round: asyncio's setter costs
        # a getpid each time): a foreign await trips at once (charon.core.awaits; the round's engine code around
        # the steps never asks asyncio for a loop)
        prev_loop = _get_running_loop()
        _set_running_loop(_GUARD)
        try:
            self._run_queue(queue, run, trace, started, limit)
        finally:
            _set_running_loop(prev_loop)

    def _run_queue(self, queue: deque[Invoke | Reply], run: Callable[[Frame], Outgoing], trace: Any,
                   started: dict[int, int], limit: int) -> None:
        pid, parts = self.pid, self.partitions
        remote = self._out.messages
        frames = self.frames
        dead = self.dead
        frame: Frame | None
        while queue:
            m = queue.popleft()
            tid = m.tid
            if tid in dead:
                continue
            if type(m) is Invoke:
                n = started[tid] = started.get(tid, 0) + 1
                if n > limit:
                    self._fail(tid, too_many_invocations(limit))
                    continue
                if trace is not None:
                    trace.append((tid, m.inv, m.op, m.key, m.fn, m.kind))
                m.replies = {}  # start_frame(m), inlined
                m.reads = []
                m.nsusp = 0
                m.pending = None
                m.token = next(_TOKENS)
                frame = m
            else:
                tframes = frames.get(tid)
                if tframes is None:
                    continue  # its transaction was reset
                frame = tframes.get(m.inv)
                if frame is None:
                    continue  # its transaction was reset
                a, b = frame.share, m.share  # shares.add, inlined for equal exponents (the common case)
                if a[1] == b[1]:
                    n, e = a[0] + b[0], a[1]
                    while e and not n & 1 and n:
                        n >>= 1
                        e -= 1
                    frame.share = (n, e)
                else:
                    frame.share = add(a, b)
                pending = frame.pending  # frame.receive(m.child, m.value), inlined
                assert pending is not None  # a frame a reply is addressed to waits for it
                frame.replies[pending.pop(m.child)] = m.value
                if pending:
                    continue  # a gather still waiting for other replies
                frame.pending = None
                del tframes[m.inv]
            for msg in run(frame):
                g = msg.kg
                if g is None:
                    g = msg.kg = key_group(msg.op, msg.key)
                if g % parts == pid:  # routing.partition_of, inlined
                    queue.append(msg)
                else:
                    remote.append(msg)

    def _run(self, frame: Frame) -> Outgoing:
        """Run one invocation until it completes, suspends on a call, or raises.

        A frame resumed by a reply continues its live coroutine when this process still holds it (the
        in-process runtime always; a Spark worker when it ran the previous round of this partition);
        otherwise the function is replayed from its journal (:class:`charon.core.context.Journal`, which alone
        decides what is replayed). Both give the same effects.
        """
        self._stat_runs += 1
        live: Live | None = None
        if frame.nsusp:  # self._live_pop(frame), inlined
            t = self._ltab.get(frame.tid)
            if t:
                live = t.pop(frame.token, None)
                if live is not None and live[2] != frame.nsusp:  # another attempt's (a Spark retry): replay
                    live[1]._drop(live[0])
                    live = None
        try:
            if live is not None:
                coro, ctx, _ = live
                ctx._unit = self  # ctx._resume(self, frame), inlined
                ctx._frame = frame
                frame._awaits = frame.nsusp  # frame.at_end()
                frame._nread = len(frame.reads)
                frame.live = True
                ctx._sends = None
            else:
                ctx = EngineContext(self, frame)
                # through self.app each time: a code update swaps the unit's app (the engines)
                prev = self.previous  # app_for, inlined (the hot path)
                app = self.app if prev is None or frame.tid >= prev[0] else prev[1]
                fn = app._resolved.get((frame.op, frame.fn)) or app.resolve(frame.op, frame.fn)
                coro = fn.body(ctx, *_decode(frame.args))  # the engine's own encoding of checked arguments
            self.current = frame
            try:
                yielded = coro.send(None)  # (the guard is the running event loop: _process sets it per round)
            except StopIteration as stop:
                self.current = None  # from here on no verdict can be taken on this step (see doomed)
                if self.doomed is not None:
                    raise self._judged(frame) from None
                if _TRIPS:  # a foreign await (or blocking I/O under the check) the function caught
                    _raise_tripped(frame)
                if not frame.live:
                    msg = f"{frame.op}.{frame.fn} returned before replaying its journal"
                    raise NonDeterministicFunction(msg) from None
                calls = ctx._calls  # every ctx.call awaited (else UnawaitedCall): as many replies as calls made
                if calls is not None and len(frame.replies) != len(calls):  # (or sends among them: checked)
                    check_awaited(calls, frame.replies, frame.op, frame.fn, frame.key)
                kind = frame.kind
                if kind == ASYNC:  # a sent function's return value goes nowhere: not encoded (as serially)
                    value = _NONE
                else:
                    try:
                        value = _encode(stop.value)  # serde.encode_value, inlined
                    except Exception:  # noqa: BLE001 - its typed error
                        value = serde.encode(stop.value)
                    if type(stop.value) not in _SCALARS:
                        _check_value(stop.value)
                    if len(value) > MAX_VALUE_BYTES:  # aborts the transaction (the except below)
                        raise too_large(f"{frame.op}.{frame.fn}'s return value", len(value)) from None
                # self._complete(frame, ctx, value), inlined (two of a transfer's three runs complete)
                sends = ctx._sends
                msgs: Outgoing = ()
                if sends:
                    msgs = []
                    part, leftover = split(frame.share, len(sends))
                    self._emit_sends(frame, sends, part, msgs)
                else:
                    leftover = frame.share
                tid = frame.tid
                if kind == SYNC:
                    assert frame.caller is not None  # a synchronous call's
                    cop, ckey, cinv, ckg = frame.caller
                    r = Reply(tid, cop, ckey, cinv, value, leftover, frame.inv, ckg)
                    if msgs and isinstance(msgs, list):  # calls or sends made (_emit_sends filled the list)
                        msgs.append(r)
                    else:
                        msgs = (r,)
                elif kind == ROOT:
                    self._out.done.append((tid, value, leftover))
                elif leftover[0]:
                    self._out.acks.append((tid, leftover))
                if self._recording:  # for the call-graph cache (see _take_cache)
                    logged = self._clog.get(tid)
                    if logged is None:
                        self._clog[tid] = [(frame, value, ctx._calls, self.touched.get(tid))]
                    else:
                        logged.append((frame, value, ctx._calls, self.touched.get(tid)))
                return msgs
            self.current = None
            if self.doomed is not None:
                raise self._judged(frame)
            if _TRIPS:
                ctx._drop(coro)
                _raise_tripped(frame)
            if ctx._pending is None or getattr(yielded, "ctx", None) is not ctx:
                ctx._drop(coro)
                raise foreign_await(frame.op, frame.fn, yielded)
            msgs = self._suspend(frame, ctx)
            if KEEP_LIVE_COROUTINES:  # self._live_put(frame, coro, ctx), inlined
                table = self._ltab
                t = table.get(frame.tid)
                if t is None:
                    t = table[frame.tid] = {}
                t[frame.token] = (coro, ctx, frame.nsusp)
            else:
                ctx._drop(coro)
            return msgs
        except _Judged as judged:  # the step was judged past its budget: the recorded verdict aborts it
            tripped()  # a foreign await it also made changes nothing: the verdict stands
            self._fail(frame.tid, judged.error)
            return ()
        except Exception as exc:  # noqa: BLE001 - any application exception aborts the transaction
            try:  # raised by the step: its message is user code (str), still watched
                message = self._user_str(exc) if self.current is not None else str(exc)
            except Interrupt:  # pending at the call's first instruction: the step is doomed
                message = ""
            self.current = None
            trip = tripped()  # what the guard raised (a library may have wrapped it): its typed error
            if self.doomed is not None:  # judged while it ran (or while its message was made)
                try:
                    verdict = self._judged(frame)
                except Interrupt:  # pending at _judged's first instruction: none is left now
                    verdict = self._judged(frame)
                self._fail(frame.tid, verdict.error)
                return ()
            if trip is not None:
                self._fail(frame.tid, trip_error(frame, *trip), frame)
            else:
                self._fail(frame.tid, exc, frame, message)
            return ()
        except Interrupt:  # the watchdog stopped a function past its budget: the recorded error aborts it
            tripped()
            self.current = None
            self._fail(frame.tid, self._judged(frame).error)  # the verdict's message names the function already
            return ()
        finally:
            self.current = None

    def _user_str(self, exc: BaseException) -> str:
        """``str(exc)`` of an exception the step raised: application code, still watched (a driver of the
        interrupt, see :mod:`charon.runtime.guard.interrupts`); an interrupt landing in it leaves a placeholder (the
        step is doomed then, and fails with its verdict instead)."""
        try:
            return str(exc)
        except BaseException:  # noqa: BLE001 - an interrupt or a failing __str__
            return f"<{type(exc).__name__}: str() failed>"

    def _judged(self, frame: Frame) -> _Judged:
        """The step ended after the watchdog judged it (:attr:`doomed`): drop an interrupt not raised yet, record
        the verdict (the hook, in this thread, before anything depends on it) and return what fails the
        transaction. An interrupt landing at this call's first instruction reaches the caller's ``except
        Interrupt``, which settles again."""
        self.doomed = None
        self.current = None
        disarm()
        hook = self.interrupt
        if hook is not None:
            return _Judged(hook(frame))
        return _Judged(InvocationTimeout(timeout_message(frame)))

    # Live coroutines of suspended frames, per process and thread:
    # {(thread, pid): (epoch, {tid: {token: (coro, ctx, nsusp)}})}. Per thread: rounds running at the same
    # time in other threads (another runtime, a finalize pool) never close or resume this thread's coroutines;
    # a frame resumed in another thread than the one that suspended it replays its journal instead.
    def _live_table(self) -> dict[int, LiveTable]:
        k = (_thread_id(), self.pid)
        entry = _LIVE.get(k)
        if entry is not None and entry[0] == self.epoch:
            return entry[1]
        self._live_clear()  # an earlier epoch's leftovers (finished elsewhere, or aborted by a callee)
        entry = _LIVE[k] = (self.epoch, {})
        return entry[1]

    def _live_clear(self) -> None:
        """Close every coroutine this thread keeps for this partition (at finalize, or a new epoch)."""
        entry = _LIVE.pop((_thread_id(), self.pid), None)
        if entry is not None:
            for t in entry[1].values():
                for coro, ctx, _ in t.values():
                    ctx._drop(coro)

    def _live_put(self, frame: Frame, coro: Any, ctx: EngineContext) -> None:
        if not KEEP_LIVE_COROUTINES:
            ctx._drop(coro)
            return
        self._live_table().setdefault(frame.tid, {})[frame.token] = (coro, ctx, frame.nsusp)

    def _live_pop(self, frame: Frame) -> tuple[Any, EngineContext] | None:
        t = self._live_table().get(frame.tid)
        live = t.pop(frame.token, None) if t else None
        if live is None:
            return None
        if live[2] != frame.nsusp:  # another attempt's (see _run)
            live[1]._drop(live[0])
            return None
        return live[0], live[1]

    def _live_drop(self, tid: int) -> None:
        for coro, ctx, _ in self._live_table().pop(tid, {}).values():
            ctx._drop(coro)

    def _fail(self, tid: int, exc: BaseException, frame: Frame | None = None, message: str | None = None) -> None:
        """Abort ``tid``: the error names the called or sent function (``frame``) that raised it."""
        self._live_drop(tid)
        self.dead.add(tid)
        self.frames.pop(tid, None)
        if message is None:
            message = str(exc)
        if frame is not None:
            if frame.kind != ROOT:
                message = raised_in(message, frame.op, frame.key, frame.fn)
            trace = self._out.trace
            if trace is not None:  # observed: where it was raised (beside the reply, never in it)
                trace.append((tid, frame.inv, format_traceback(exc)))
        self._out.failed.append((tid, type(exc).__name__, message))

    def _emit_sends(self, frame: Frame, sends: Sequence[CallRecord], share: Share, msgs: list[Invoke | Reply]) -> None:
        tid, inv, ts, depth = frame.tid, frame.inv, frame.ts, frame.depth + 1
        for n, op, key, fn, args in sends:
            msgs.append(Invoke(tid, child_inv(inv, n), op, key, fn, args, share, ASYNC, None, ts, depth))

    def _suspend(self, frame: Frame, ctx: EngineContext) -> list[Invoke | Reply]:
        msgs: list[Invoke | Reply] = []
        sends = ctx._sends or ()
        pending = ctx._pending or ()
        # shares.split(frame.share, k), inlined: the frame keeps one part and the rest
        n, e = frame.share
        k = len(sends) + len(pending) + 1
        m = (k - 1).bit_length()
        e += m
        r = (1 << m) - k
        each, rest = (n, e), ((n * r, e) if r else _ZERO)
        if sends:
            self._emit_sends(frame, sends, each, msgs)
        caller = (frame.op, frame.key, frame.inv, frame.kg)  # the caller's key group routes the reply
        tid, ts, depth = frame.tid, frame.ts, frame.depth + 1
        # the calls the await sent, with their invocation ids from the journal's pending table (same order)
        if len(pending) == 1:  # one awaited call (the common case)
            [inv] = frame.pending  # type: ignore[misc]
            op, key, fn, args = pending[0].target
            msgs.append(Invoke(tid, inv, op, key, fn, args, each, SYNC, caller, ts, depth))
        else:
            for c, inv in zip(pending, frame.pending or (), strict=True):
                op, key, fn, args = c.target
                msgs.append(Invoke(tid, inv, op, key, fn, args, each, SYNC, caller, ts, depth))
        frame.share = (each[0] + rest[0], each[1]) if rest[0] else each
        tframes = self.frames.get(frame.tid)
        if tframes is None:
            tframes = self.frames[frame.tid] = {}
        tframes[frame.inv] = frame
        return msgs

    # -- call-graph-cached fallback ---------------------------------------------------------------
    def _fast_round(self, tids: list[int]) -> None:
        """Re-run each listed transaction's cached invocations here, in TID order, on the latest state.

        This method owns the rule of what a transaction may see of another in the call-graph-cached
        fallback. A transaction is *valid here* when each of its invocations at this partition (at most one
        per entity) makes the same calls with the same arguments as in the dry run, returns the same value
        to a synchronous caller (its callees' replies are the dry run's; the callees re-run at their own
        partitions in this same round and are checked there), and touches its entity within the dry run's
        access (:attr:`Cached.access`: no write where the dry run only read, no touch where it did not).
        Only a valid transaction's writes enter the fast layer, which the higher TIDs replayed after it
        here read; an invalid one's writes are dropped. The coordinator commits a transaction only if it
        is valid at every partition and conflicts with no lower unresolved transaction's *dry-run*
        read/write set K.

        Why no uncommitted value reaches a committed transaction: let T commit, having read here a value
        written by a lower U in this round. U was valid here, so that write lies in U's dry-run write set:
        either U commits in this round as well (U precedes T in the serial order, as T's read assumes), or
        U stays unresolved (invalid at some other partition, or valid but blocked by a lower unresolved
        transaction) and its K, which contains the write, blocks T. Conversely nothing T wrote was read by a
        lower unresolved U's dry run (K[U] would block T), and a U whose rerun later reaches outside K[U]
        onto what T touched is moved to the next epoch by the coordinator (T committed there first).
        """
        if self._clog:
            self._take_cache(set(tids))
        layer: dict[Entity, dict[str, bytes | None]] = {}
        self.fast_layer = layer
        invalid = self._out.invalid
        for tid in sorted(tids):
            cached = self.cache.get(tid)
            if not cached:
                continue
            self.buffers.pop(tid, None)
            self.emits.pop(tid, None)
            self.touched.pop(tid, None)
            access = {(c.frame.op, c.frame.key): c.access for c in cached}
            ok = len(access) == len(cached) and self._replay_cached(tid, cached)
            if ok:
                for e, wrote in self.touched.get(tid, {}).items():
                    known = access.get(e)
                    if known is None or (wrote and not known):
                        ok = False
                        break
            buf = self.buffers.get(tid)
            if ok:
                if buf:
                    for e, items in buf.items():
                        o = layer.get(e)
                        if o is None:
                            layer[e] = dict(items)
                        else:
                            o.update(items)
            else:
                invalid.append(tid)
                self.buffers.pop(tid, None)
                self.emits.pop(tid, None)
        self.fast_layer = None

    def _replay_cached(self, tid: int, cached: list[Cached]) -> bool:
        for c in sorted(cached, key=lambda c: c.frame.inv):
            f = c.frame
            frame = start_frame(Invoke(tid, f.inv, f.op, f.key, f.fn, f.args, _ZERO, ROOT, None, f.ts, f.depth),
                                f.replies)
            ctx = EngineContext(self, frame, fast=True)
            self._stat_runs += 1
            try:
                fn = self.app_for(tid).resolve(f.op, f.fn)
                coro = fn.body(ctx, *serde.decode(f.args))
                self.current = frame
                try:
                    coro.send(None)  # (the guard is the running loop: step sets it for the fast round)
                except StopIteration as stop:
                    self.current = None
                    if self.doomed is not None:  # judged past its budget: its verdict
                        tripped()
                        return self._judged_fast(frame)
                    if _TRIPS and tripped() is not None:  # the slow path runs it again and aborts it
                        return False
                    if ctx._calls != c.calls:
                        return False
                    if f.kind == ASYNC:  # its return value goes nowhere (see _run)
                        continue
                    value = serde.encode_value(stop.value)
                    if len(value) > MAX_VALUE_BYTES:  # the slow path aborts it (ValueTooLarge)
                        return False
                    if f.kind == ROOT:  # the client's reply may change; nothing else consumed it
                        self._out.done.append((tid, value, _ZERO))
                    elif f.kind == SYNC and value != c.result:  # the caller consumed the cached reply
                        return False
                    continue
                self.current = None
                tripped()
                coro.close()
                return self._judged_fast(frame) if self.doomed is not None else False
            except Exception:  # noqa: BLE001 - raising in the fast path sends it to the slow path
                self.current = None
                tripped()
                return self._judged_fast(frame) if self.doomed is not None else False
            except Interrupt:  # past its budget: its verdict, as in the slow path
                self.current = None
                tripped()
                return self._judged_fast(frame)
            finally:
                self.current = None
        return True

    def _judged_fast(self, frame: Frame) -> bool:
        """A cached replay's step was stopped past its budget: its transaction gets the verdict here, as in the slow
        path (an interrupt that only sent it to the slow path would change the fallback's schedule, which no replay
        could follow; the coordinator judges it in this round, see ``EpochCoordinator._judged_here``). False: the
        replay is invalid."""
        try:
            err = self._judged(frame).error
        except Interrupt:  # pending at _judged's first instruction: none is left now
            err = self._judged(frame).error
        self._fail(frame.tid, err)
        return False

    # -- end of epoch -----------------------------------------------------------------------------
    def epoch_delta(self) -> dict[bytes, bytes | None]:
        """The epoch's committed changes as store keys."""
        return self._delta()[0]

    def _delta(self) -> tuple[dict[bytes, bytes | None], dict[bytes, bytes | None]]:
        """The epoch's committed changes as store keys, and the part of them that are timer items."""
        delta: dict[bytes, bytes | None] = {}
        timer_items: dict[bytes, bytes | None] = {}
        tp = _timers.ITEM_PREFIX
        for (op, key), items in self.overlay.items():
            if len(items) == 1 and "" in items:  # the main value alone (the common case)
                delta[f"{op}\0{key}\0".encode()] = items[""]  # routing.store_key, inlined
                continue
            prefix = entity_prefix(op, key)
            for item, v in items.items():
                k = prefix + item.encode()
                delta[k] = v
                if item.startswith(tp):
                    timer_items[k] = v
        return delta, timer_items

    def _collect_timers(self, now: float, limit: int) -> None:
        """A collect round (first of the epoch): take the timers due at ``now`` out of the state before
        any of the epoch's transactions runs, and report them (see :mod:`charon.core.timers`)."""
        fired, nxt = _timers.due(self.store.scan(_timers.INDEX_PREFIX), now, limit)
        out = self._out
        for t in fired:
            e = (t.owner_operator, t.owner_key)
            self.overlay.setdefault(e, {})[_timers.ITEM_PREFIX + t.id] = None
            out.timers.append(_timers.encode(t))
        out.next_due = nxt

    def _finalize(self) -> int:
        if self._fresh:  # the epoch never reached this partition: an empty delta, no events
            delta: dict[bytes, bytes | None] = {}
            timer_items = None
        else:
            delta, timer_items = self._delta()
            self._out.events = self.emitted
        if timer_items:  # index_delta looks at timer items only
            delta.update(_timers.index_delta(self.store.get, timer_items))
        store = self.store
        due = self._due
        # an empty delta leaves the timer index as the last finalize found it (nothing else writes the store)
        same = not delta and due is not None and due[0] == getattr(store, "epoch", None)
        store.commit(self.epoch, delta)
        nxt = due[1] if same else _timers.next_due(store.scan(_timers.INDEX_PREFIX))  # type: ignore[index]
        self._out.next_due = nxt
        if self.sole_writer:
            self._due = (getattr(store, "epoch", None), nxt)  # type: ignore[assignment]
        self._clear(self.epoch)
        self._live_clear()
        return len(delta)


_awaits.DRIVERS.update((PartitionUnit._run.__code__, PartitionUnit._replay_cached.__code__))


def _new_invoke(*st: Any) -> Invoke:
    o = Invoke.__new__(Invoke)
    o.tid = st[0]
    o.inv = st[1]
    o.op = st[2]
    o.key = st[3]
    o.fn = st[4]
    o.args = st[5]
    o.share = st[6]
    o.kind = st[7]
    o.caller = st[8]
    o.ts = st[9]
    o.depth = st[10]
    o.token = o.kg = None
    return o


def _new_reply(*st: Any) -> Reply:
    o = Reply.__new__(Reply)
    o.tid = st[0]
    o.op = st[1]
    o.key = st[2]
    o.inv = st[3]
    o.value = st[4]
    o.share = st[5]
    o.child = st[6]
    o.kg = None
    return o


def _new_frame(*st: Any) -> Frame:
    o = _new_invoke(*st[:11])
    o.replies, o.reads, o.nsusp, o.pending, o.token = st[11:]
    o.at_end()
    return o


def _new_cached(inv: str, op: str, key: str, fn: str, args: bytes, replies: dict[int, bytes], result: bytes,
                calls: list[CallRecord] | None, ts: float, depth: int, kind: int, access: bool | None) -> Cached:
    f = _new_invoke(None, inv, op, key, fn, args, None, kind, None, ts, depth)
    f.replies = replies
    return Cached(f, result, calls, access)
