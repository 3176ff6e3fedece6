"""Deterministic simulation of the Spark runtime's paths (micro-batch, resident): the real code, a simulated cluster.

Per seed, a generated workload (:mod:`charon.testing.workloads`) runs through the real
:meth:`charon.runtime.spark.runtime.SparkRuntime._on_batch` (epoch records, replay of a recorded batch, ticks for
deferred work, compaction, the output log) and the real :class:`~charon.runtime.spark.exchange.SparkExchange`,
whose ``run_job`` is replaced by a simulated cluster: each round's payloads are cut into tasks that run
the real task function ``charon.runtime.spark.tasks.run_partitions`` in simulated workers, each with its own
live-coroutine table (``charon.core.partition._LIVE``) and its own executor-local LMDB directory. Spark's
micro-batch loop is simulated too: offsets are written before a batch runs (in Spark's format, read back by
the real ``batch_offsets``), and a batch is re-run until it completes.

Faults, drawn from the seed: a round's tasks land in another worker (live coroutines present or not), a
worker loses its local state (directory deleted, live table dropped) or its Python process (live table
dropped), a task runs twice (the first attempt dies after some of its partitions, or its result is lost),
state reads (the real ``read_entities``) run between rounds, and the driver crashes at every fault point of
an epoch (before a job, after a round, ``before_epoch``, ``after_finalize``, ``after_defer``, ``after_record``,
during compaction). Per seed, an epoch's rest runs in one task from the round where it is small
(``single_task_rest``, at a random ``task_min_bytes``) or round by round with the fallback in one task.
The next epoch's requests may arrive while a batch runs, so that the runtime defers the batch's finalize
into the next batch's first round (``pipeline_finalize``): crashes then also hit a batch whose predecessor
is not recorded yet, and recovery re-runs that epoch. A crash abandons the runtime object; recovery is the
real one: a new ``SparkRuntime`` over the same directories (durable copy, epoch records, input log)
re-running the batch.

Checked after every recorded epoch: the epoch equals serial execution (``charon.testing.check_epoch``)
from the previous verified state, with the durable copy as the state after; the replies delivered to the
output log equal the epoch's results, and a replay never contradicts a reply already delivered; the stream
log holds the epoch's atom of events exactly once (the programs emit at every put and add); the timers
programs register (``timer`` ops) fire exactly when due (``check_epoch`` with the partitions); state
reads return the verified state of the epoch they read. At the end: every request has exactly one reply,
nothing deferred is left, and the executors' state equals the verified state.

With ``log_growth`` (``--log-growth``) the input log is resized before some epochs' requests are appended
(:meth:`SparkRuntime.rescale_log`: it grows, then maybe shrinks its routing count), so batches read offsets
lists of different lengths and epochs grow their sequencers, under the same faults and checks.

With ``engine_rescale`` (``--rescale``) the engine partitions are rescaled at some epoch boundaries
(:meth:`SparkRuntime.rescale`, the real move: a deferred finalize is recorded first, the state as of the last
recorded epoch is re-placed by key group into a new layout, the driver may crash before or after its commit
point); the state then lives in other partitions, and the cluster follows: scaling out, a worker joins (a new
Python process), scaling in, one leaves; keys therefore move to other workers for good.

With ``exchange="resident"`` (``--exchange resident``; ``--exchange drawn``, the command line's default, gives
half the seeds to each mode) a seed runs the resident mode (:class:`ResidentSimulation`): the real
:class:`~charon.runtime.spark.sequencer.DirectSequencer`, driven turn by turn (its bounds written as late as it
allows and lost with a driver crash), and the real :class:`~charon.runtime.spark.resident.ResidentExchange` over a
simulated gang (:mod:`charon.testing.simulation_resident`: each task the real ``GangTask`` in a simulated Python
worker of a simulated executor, saying hello through the real ``admit``). Its fault points, drawn from the seed:
a task dies mid-round (before, between or after its partitions, i.e. after a finalize wrote its deltas and before
replying), a socket drops (before or after the task ran the frame) or is slow (the reply after the other tasks'),
the driver dies between rounds and at every crash point above (its gang dies with it), Spark relaunches the stage
(a second hello breaks the gang), and a task of an abandoned gang runs a frame already sent later, in its old
process, while newer gangs replay the epoch (a zombie; ``--no-zombies`` leaves them out). A lost gang restarts the
query as the runtime's supervisor does (a new exchange and sequencer resuming from the records and bounds); the
checks are the same.

In the resident mode the boundaries are the running runtime's: the rescale (``--rescale``) is the real
:meth:`SparkRuntime.rescale` of a running query (it holds the epoch gate, waits for the boundary, moves, commits the
layout, replaces the exchange: the next gang is launched with the new key groups), either while the sequencer is
idle or while the next epoch, its bound fixed, waits at the gate (a :class:`~charon.testing.simulation_resident.
SimGate` runs the move when that epoch would block, after a deferred finalize was recorded); the driver may crash
before or after the commit (the restarted one holds the gate again and retries), and a task may die in the new
gang's first round. With ``pauses`` (``--pause``) the operator pauses at some boundaries (now, or after the last
recorded epoch) and resumes; while paused a state read may run and the driver may die (a new driver's gate is open:
the operator pauses again, or not), and a rescale drawn at the same boundary is made while paused. The input log's
resize (``--log-growth``) runs between epochs, as on the micro-batch path (the real one needs no pause).

In both modes the runtime's reply writer runs on the simulated thread: a batch of replies is written when put or
later (then a driver crash loses it), drawn per seed, so a rerun finds its earlier run's replies, or not.

``python -m charon.testing.simulation --seeds 100000 [--start N]`` runs many seeds; ``--seed N`` reruns one and
prints its trace. A failing seed prints one line that reproduces it. ``--without early,early2`` leaves
program features out (to tell apart failures of different defects).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from charon import serde
from charon.config import SparkConfig
from charon.core import partition, timers
from charon.core.epoch import EpochResult
from charon.core.routing import partition_of, split_store_key, store_key
from charon.log.offsets import pad_offsets, pad_pair
from charon.messages import Reply, Request
from charon.runtime import faults
from charon.runtime.control.codeversions import CodeEntry
from charon.runtime.replies import ReplyWriter
from charon.runtime.spark import runtime as sr
from charon.runtime.spark import tasks as spark_tasks
from charon.runtime.spark.exchange import SparkExchange
from charon.runtime.spark.layout import local_root, read_layout
from charon.runtime.spark.resident import GangLost, ResidentExchange
from charon.runtime.spark.sequencer import DirectSequencer
from charon.state import lmdbstore
from charon.state.durable import DurableState
from charon.testing.simulation_resident import GangFaults, LazyWriter, SimGang, SimGate, SimTask
from charon.testing.workloads import (
    COUNTERS,
    FEATURES,
    ITEMS,
    KEYS,
    OPTIONAL_FEATURES,
    Shape,
    Workload,
    app,
    engine_abort_rule,
    random_workload,
)

APP_REF = "charon.testing.workloads:app"
SIM_SPARK = object()  # the resident mode's runtime has a "session" (it never asks it anything: the gang is simulated)
EXCHANGES = ("jobs", "resident", "drawn")  # --exchange: drawn = per seed, half of each


class Plan(Protocol):
    """What the simulator reads of a workload (:class:`~charon.testing.workloads.Workload`, or the application harness's
    plan): its epochs of requests and the run's placement."""

    partitions: int
    live: bool

    @property
    def epochs(self) -> Sequence[Sequence[object]]: ...

    def requests(self, epoch: int, prefix: str = "") -> list[Request]: ...


class SimCrash(Exception):
    """The driver process dies here (the simulator abandons the runtime object and recovers)."""


class Violation(AssertionError):
    """An invariant or the serial oracle failed."""


@dataclass
class Faults:
    """Per-seed fault rates."""

    workers: int
    hop: float  # a task goes to a random worker instead of its partition's usual one
    lose: float  # per round: a worker loses its local directory and live coroutines
    restart: float  # per round: a worker's Python process is replaced (live coroutines lost)
    retry: float  # per task: run twice, first result discarded
    read: float  # per round: a state read between rounds
    crash: float  # per fault point: the driver crashes
    max_crashes: int

    @classmethod
    def stable(cls) -> Faults:
        """A stable cluster: one worker that never fails, no task re-runs, no driver crash (only the faults of the
        workload's plan, and rescales, which may bring more workers)."""
        return cls(1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)

    @classmethod
    def draw(cls, rng: random.Random) -> Faults:
        calm = rng.random() < 0.2  # some seeds without faults: the plain path must hold too
        p = (lambda hi: 0.0) if calm else (lambda hi: rng.choice([0.0, hi / 4, hi]))  # noqa: E731
        return cls(rng.randint(1, 3), p(0.6), p(0.1), p(0.2), p(0.3), p(0.4), p(0.15), rng.randint(0, 3))


class Worker:
    """A simulated executor: its local store directory and its Python worker's live-coroutine table."""

    def __init__(self, wid: int, root: str) -> None:
        self.wid = wid
        self.dir = os.path.join(root, f"w{wid}")
        self.live: dict = {}
        self.procs: list[dict] = []  # idle Python workers' live tables (the resident gang's tasks reuse them)

    def take_process(self) -> dict:
        """A Python worker for a gang task (an idle one, as Spark reuses them, or a new one): its live table."""
        return self.procs.pop() if self.procs else {}

    def give_back(self, live: dict) -> None:
        """A gang task ended: its Python worker (and live coroutines) stays for the next task."""
        self.procs.append(live)

    @contextlib.contextmanager
    def process(self) -> Iterator[None]:
        saved = partition._LIVE
        partition._LIVE = self.live
        try:
            yield
        finally:
            partition._LIVE = saved

    def close_stores(self) -> None:
        """Close this worker's LMDB handles (what its process exit does)."""
        prefix = os.path.realpath(self.dir) + os.sep
        for key in [k for k in lmdbstore._STORES if (k[0] + os.sep).startswith(prefix)]:
            lmdbstore._STORES.pop(key).close()

    def lose_state(self) -> None:
        self.close_stores()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.live = {}


class LateReplies(ReplyWriter):
    """The runtime's reply writer on the simulated thread: a batch is written when put, or left for a later write
    (``late()``: the writer's thread had not run yet), which a driver crash loses (``abandon``); a flush writes
    every batch left. A rerun then finds its earlier run's replies in the output log, or not."""

    late: Callable[[], bool] = staticmethod(lambda: False)  # set per simulation (see Simulation.patched)

    def __init__(self, write: Callable[[list[Reply]], object], name: str = "charon-replies") -> None:
        super().__init__(write, name)
        self.write = write
        self.queue: list[list[Reply]] = []

    def put(self, replies: list[Reply]) -> None:
        if replies:
            self.queue.append(replies)
            if not self.late():
                self.flush()

    def flush(self, timeout: float | None = None) -> None:
        while self.queue:
            self.write(self.queue.pop(0))

    def close(self) -> None:
        self.flush()

    def abandon(self) -> None:
        self.queue.clear()


class SimExchange(SparkExchange):
    """The real SparkExchange with ``run_job`` replaced by the simulated cluster."""

    def __init__(self, sim: Simulation, config: SparkConfig) -> None:
        super().__init__(None, sim.app_ref, config)
        self.sim = sim

    def run_job(self, payloads: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        return self.sim.run_job(self, payloads)


class Simulation:
    """One seed: workload, faults, cluster; :meth:`run` raises :class:`Violation` or an engine error."""

    def __init__(
        self, seed: int, root: str, trace: bool = False, without: frozenset[str] = frozenset(),
        workload: Plan | None = None, faults: Faults | None = None, log_growth: bool = False,
        engine_rescale: bool = False,
    ) -> None:
        self.seed = seed
        self.app_ref, self.app = APP_REF, app  # the application under test (the harness runs others)
        self.rng = random.Random(seed)
        shape = Shape(depth=2, ops=4, features=(FEATURES | OPTIONAL_FEATURES) - without)
        w = random_workload(self.rng, shape, epochs=(1, 4), txns=(2, 7))
        self.w: Plan = workload or w
        self.log_plan = self.draw_log_plan(seed, len(self.w.epochs), self.w.partitions) if log_growth else {}
        self.log_resizes = 0
        self.engine_plan = (self.draw_engine_plan(seed, len(self.w.epochs), self.w.partitions) if engine_rescale
                            else {})
        self.engine_rescales = 0
        self.max_tid = 0  # the highest TID of the verified epochs
        f = Faults.draw(self.rng)
        self.faults = faults or f
        self.root = root
        self.trace_on = trace
        self.events: list[str] = []
        self.config = SparkConfig(
            data_dir=os.path.join(root, "data"), partitions=self.w.partitions,
            compact_every=self.rng.choice([0, 1, 2]),
            exchange="jobs",  # the micro-batch sequencer and the job-per-round exchange, simulated here
        )
        self.durable_root = os.path.join(self.config.checkpoint_dir, "state")
        self.workers = [Worker(i, os.path.join(root, "local")) for i in range(self.faults.workers)]
        self.next_wid = len(self.workers)  # a rescale may add workers (:meth:`resize_cluster`)
        self.results: dict[int, Any] = {}  # epoch -> EpochResult of the run that completed it
        self.expected: dict[int, dict[bytes, bytes]] = {}  # epoch -> verified state after it
        self.delivered: dict[str, Reply] = {}
        self.crashes = 0
        self.crash_at: dict[str, int] = {}  # fault point -> driver crashes there
        self.rounds = 0
        self.pipelined = self.rng.choice([0.0, 0.5, 1.0])  # chance that the next epoch's requests come early
        # an epoch's rest in one task from the round where it is small, or round by round (fallback in one task)
        self.config.single_task_rest = self.rng.random() < 0.6
        self.config.task_min_bytes = self.rng.choice([1, 3000, 262_144])
        # a generated workload's epochs in chunks of a few transactions (EPOCH_CHUNK exceeds these epochs), from
        # an RNG of its own so that every other draw of a seed stays what it was; a given workload keeps its shape
        self.chunk = None if workload is not None else random.Random(seed * 7919 + 1).choice([0, 1, 2, 3, None])
        # overruns: a task attempt stops a function as past its budget (the in-task sampler's Interrupt), with this
        # chance per function start, from an RNG of its own (the other draws of a seed stay what they were)
        self.orng = random.Random(seed * 104_729 + 3)
        self.overrun = self.orng.choice([0.0, 0.0, 0.02, 0.1]) if faults is None and workload is None else 0.0
        self.overruns = 0
        # replies written at once or left for later (lost with a crash), from an RNG of its own
        self.reply_rng = random.Random(f"replies-{seed}")
        self.reply_late = self.reply_rng.choice([0.0, 0.5, 1.0])
        self.pipelined_epochs = 0
        self.fallback_jobs = 0
        self.atoms = 0  # epochs whose atom of events was checked in the stream log
        self.rest_jobs = 0
        self.where = "start"
        self.rt: sr.SparkRuntime | None = None

    # -- tracing ------------------------------------------------------------------------------------
    def trace(self, msg: str) -> None:
        self.events.append(msg)
        if self.trace_on:
            print(f"  [{self.seed}] {msg}")

    def fault_point(self, point: str, epoch: int) -> None:
        """The runtime's ``crash_point``: concurrent events happen here, then perhaps a crash."""
        self.where = f"{point}:{epoch}"
        self.between_rounds()
        self.maybe_crash(point, epoch)

    def maybe_crash(self, point: str, epoch: int) -> None:
        if self.crashes < self.faults.max_crashes and self.rng.random() < self.faults.crash:
            self.crashes += 1
            self.crash_at[point] = self.crash_at.get(point, 0) + 1
            self.trace(f"CRASH at {point} (epoch {epoch})")
            for w in self.workers:  # executors die with the driver's application; local dirs stay
                w.live = {}
            raise SimCrash(point)

    # -- the simulated cluster ----------------------------------------------------------------------
    def run_job(self, ex: SimExchange, payloads: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        f, rng = self.faults, self.rng
        self.rounds += 1
        if payloads[0][0] == spark_tasks.FALLBACK_TASK:
            self.fallback_jobs += 1
            self.trace(f"round {self.rounds}: the epoch's whole fallback in one task")
        elif payloads[0][0] == spark_tasks.REST_TASK:
            self.rest_jobs += 1
            self.trace(f"round {self.rounds}: the rest of the epoch in one task")
        self.where = f"before job {self.rounds}"
        self.maybe_crash("before_job", -1)
        self.between_rounds()
        n = rng.randint(1, len(payloads))
        cuts = sorted(rng.sample(range(1, len(payloads)), n - 1)) if n > 1 else []
        tasks = [payloads[a:b] for a, b in zip([0, *cuts], [*cuts, len(payloads)], strict=True)]
        out: list[tuple[int, bytes]] = []
        for task in tasks:
            w = self.pick_worker(task[0][0])
            if rng.random() < f.retry:  # the attempt dies after some of its partitions, or its result is lost
                upto = rng.randint(1, len(task))
                self.trace(f"round {self.rounds}: task {[p for p, _ in task]} run in w{w.wid} up to its "
                           f"partition #{upto}, result discarded")
                self.run_task(w, task, upto)
                w = self.pick_worker(task[0][0])
            out.extend(self.run_task(w, task))
        return out

    def pick_worker(self, pid: int) -> Worker:
        if self.rng.random() < self.faults.hop:
            return self.rng.choice(self.workers)
        return self.workers[pid % len(self.workers)]

    def run_task(self, w: Worker, task: list[tuple[int, bytes]], upto: int | None = None) -> list[tuple[int, bytes]]:
        """The real task function over the task's partitions in worker ``w`` (only the first ``upto``)."""
        fn = partial(spark_tasks.run_partitions, self.app_ref, self.config.partitions, w.dir, self.state_root,
                     self.config.checkpoint_dir)
        ex = self.rt.exchange if self.rt is not None else None
        assert ex is None or isinstance(ex, SparkExchange)  # the simulated runtime's (SimExchange)
        budget = ex.fn.keywords.get("function_timeout") if ex is not None else None
        # an overrun stands for a function past its budget in a run that may judge it: a first run, or a rerun
        # that provably replied nothing (a rerun that may have replied cannot judge, and exits for its supervisor)
        judging = self.rt is not None and self.rt.judging
        with w.process(), self.overrunning(budget is not None and judging):
            return list(itertools.islice(fn(task), upto))

    @contextlib.contextmanager
    def overrunning(self, budgets: bool) -> Iterator[None]:
        """While a task runs with budgets (an epoch's first run): each function start overruns its budget with
        chance ``overrun`` (this attempt only: a retry draws again), i.e. the task's sampler raises
        :class:`~charon.core.partition.Interrupt` in it."""
        if not self.overrun or not budgets:
            yield
            return
        sim = self
        fns = [f for op in self.app.operators.values() for f in op.functions.values()]
        saved = [f.body for f in fns]

        def overrun(body: Any, name: str) -> Any:
            async def run(ctx: Any, *args: Any) -> Any:
                if sim.orng.random() < sim.overrun:
                    sim.overruns += 1
                    sim.trace(f"OVERRUN of {name} on key {ctx.key!r} in this attempt")
                    raise partition.Interrupt
                return await body(ctx, *args)

            return run

        for f, body in zip(fns, saved, strict=True):
            f.body = overrun(body, f.qualname)
        try:
            yield
        finally:
            for f, body in zip(fns, saved, strict=True):
                f.body = body

    def between_rounds(self) -> None:
        f, rng = self.faults, self.rng
        if rng.random() < f.lose:
            w = rng.choice(self.workers)
            self.trace(f"{self.where}: w{w.wid} loses its local state")
            w.lose_state()
        if rng.random() < f.restart:
            w = rng.choice(self.workers)
            self.trace(f"{self.where}: w{w.wid}'s Python worker restarts")
            w.live = {}
        if rng.random() < f.read:
            self.read_check()

    def read_check(self) -> None:
        """A state read as the runtime does it (at the last recorded epoch), compared with the verified state."""
        assert self.rt is not None
        epoch = self.rt.last_recorded_epoch()
        want = self.expected.get(epoch)
        if want is None:  # recorded but not verified yet (only right after a crash): nothing to compare
            return
        self.compare_read(epoch, self.read_keys(want), want)

    def read_keys(self, want: dict[bytes, bytes]) -> list[bytes]:
        """The store keys a state read asks for (``want``: the verified state it is compared with)."""
        return [store_key("node", k, i) for k in self.rng.sample(KEYS, 2)
                for i in ("", *("\x01" + n for n in ITEMS + COUNTERS))]

    def compare_read(self, epoch: int, keys: list[bytes], want: dict[bytes, bytes]) -> None:
        """Read ``keys`` at ``epoch`` with the real ``read_entities`` in a random worker; each must equal ``want``."""
        by_pid: dict[int, list[bytes]] = {}
        for k in keys:
            op, key, _ = split_store_key(k)
            by_pid.setdefault(partition_of(op, key, self.config.partitions), []).append(k)
        w = self.rng.choice(self.workers)
        self.trace(f"{self.where}: state read at epoch {epoch} in w{w.wid}")
        with w.process():
            got = dict(spark_tasks.read_entities(self.app_ref, w.dir, self.state_root, self.config.checkpoint_dir,
                                                 epoch, list(by_pid.items())))
        for k in keys:
            if got.get(k) != want.get(k):
                raise Violation(f"state read at epoch {epoch}: {k!r} = {got.get(k)!r}, verified {want.get(k)!r}")

    # -- the driver ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Route the runtime's fault points and coordinator through this simulation (restored after)."""
        sim = self

        class Recording(sr.EpochCoordinator):
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                if sim.chunk is not None:
                    self.chunk = sim.chunk

            def run_epoch(self, epoch: int, requests: list, now: float | None = None, **kw: Any) -> Any:
                res = super().run_epoch(epoch, requests, now, **kw)
                if res.finalize is not None:
                    sim.pipelined_epochs += 1
                    sim.trace(f"epoch {epoch}: finalize deferred into the next batch's first round")
                sim.results[epoch] = res
                return res

        class Replies(LateReplies):
            @staticmethod
            def late() -> bool:
                return sim.reply_rng.random() < sim.reply_late

        saved = (sr.EpochCoordinator, partition.KEEP_LIVE_COROUTINES, sr.ReplyWriter)
        # deliberate patches of the module (restored below): the epochs recorded, replies written on this thread
        sr.EpochCoordinator, sr.ReplyWriter = Recording, Replies  # type: ignore[misc]
        partition.KEEP_LIVE_COROUTINES = self.w.live
        try:
            with faults.intercepted(self.fault_point), engine_abort_rule():
                yield
        finally:
            sr.EpochCoordinator, partition.KEEP_LIVE_COROUTINES, sr.ReplyWriter = saved  # type: ignore[misc]

    @staticmethod
    def draw_log_plan(seed: int, epochs: int, n: int) -> dict[int, int]:
        """Input-log resizes (``log_growth``): {workload epoch: routing count} applied before its requests are
        appended. Drawn from their own generator, so a seed's other draws stay what they are without it."""
        g = random.Random(f"log-growth-{seed}")
        if epochs < 2:
            return {}
        k = g.randrange(1, epochs)
        m = n + g.choice([1, 2, 3])
        plan = {k: m}
        if k + 1 < epochs and g.random() < 0.5:  # and shrink (route only) later
            plan[g.randrange(k + 1, epochs)] = g.randrange(1, m)
        return plan

    @staticmethod
    def draw_engine_plan(seed: int, epochs: int, n: int) -> dict[int, int]:
        """Engine-partition rescales (``engine_rescale``): {workload epoch: partition count} applied at the epoch
        boundary before its requests are appended; one or two, from a generator of their own."""
        g = random.Random(f"engine-rescale-{seed}")
        if epochs < 2:
            return {}
        plan: dict[int, int] = {}
        for k in sorted(g.sample(range(1, epochs), min(epochs - 1, g.choice([1, 1, 2])))):
            n = plan[k] = g.choice([m for m in range(1, 6) if m != n])
        return plan

    @property
    def state_root(self) -> str:
        """The durable state's directory of the layout in force (a rescale moves it)."""
        return self.rt.durable.root if self.rt is not None else self.durable_root

    def rescale_engine(self, rt: sr.SparkRuntime, partitions: int) -> sr.SparkRuntime:
        """Rescale the engine partitions at this boundary, as the runtime does it when its query pauses at the
        gate: a deferred finalize is recorded first, then the real move. The driver may crash in either (then
        recovery, and the move again unless its layout was committed). Returns the runtime in use after it."""
        while True:
            try:
                rt.flush()
                self.verify_recorded()
                if rt.config.partitions == partitions:
                    break
                info = rt.rescale(partitions)
                self.config.partitions = partitions
                rt.exchange = SimExchange(self, self.config)  # as the runtime does with a Spark session
                self.trace(f"engine partitions {info['from']} -> {info['to']} after epoch {info['epoch']} "
                           f"({info['keys']} items moved)")
                self.resize_cluster(partitions > info["from"])
                break
            except SimCrash:
                self.verify_recorded()
                rt = self.start_runtime()
        self.engine_rescales += 1
        return rt

    def resize_cluster(self, grow: bool) -> None:
        """A rescale follows the cluster: scaling out, an executor joins (a new Python worker, an empty local
        directory); scaling in, the newest one leaves (never the last)."""
        if grow:
            w = Worker(self.next_wid, os.path.join(self.root, "local"))
            self.next_wid += 1
            self.workers.append(w)
            self.trace(f"w{w.wid} joins the cluster")
        elif len(self.workers) > 1:
            w = self.workers.pop()
            w.close_stores()
            self.trace(f"w{w.wid} leaves the cluster")

    def append_epoch(self, rt: sr.SparkRuntime, index: int) -> tuple[sr.SparkRuntime, list[str]]:
        """Append workload epoch ``index``'s requests (rescaling the engine partitions, resizing the input log
        first if the plans say so; the driver may crash inside either: the restarted one opens the layout
        recorded). Returns the runtime in use after it and the appended request ids."""
        if index in self.engine_plan:
            rt = self.rescale_engine(rt, self.engine_plan[index])
        if index in self.log_plan:
            try:
                info = rt.rescale_log(self.log_plan[index])
                self.trace(f"input log {info['from']} -> {info['to']} partitions (physical {info['physical']})")
            except SimCrash:
                self.verify_recorded()
                rt = self.start_runtime()
            self.log_resizes += 1
        reqs = self.w.requests(index)
        rt.input_log.append_many(reqs)
        return rt, [r.request_id for r in reqs]

    def start_runtime(self) -> sr.SparkRuntime:
        """A driver (re)start: the real constructor over the same directories."""
        if self.rt is not None:
            self.rt._replies.abandon()  # the old driver is gone: replies it had not written yet are lost
            self.rt.input_log.close()
            self.rt.output_log.close()
        layout = read_layout(self.config.checkpoint_dir)
        if layout is not None:  # the engine partitions of the layout in force (a rescale may have moved them)
            self.config.partitions = layout.partitions
        rt = self.new_runtime()
        rt._start_compaction = rt._compact  # type: ignore[method-assign]  # a deliberate patch: synchronous: compaction's crash point is an ordinary step
        put_many = rt.output_log.put_many

        def deliver(replies: Iterable[Reply]) -> int:
            replies = list(replies)
            for r in replies:
                old = self.delivered.get(r.request_id)
                if old is not None and old != r:
                    raise Violation(f"a replay contradicts a delivered reply: {old} then {r}")
                self.delivered.setdefault(r.request_id, r)
            return put_many(replies)

        rt.output_log.put_many = deliver  # type: ignore[method-assign]  # a deliberate patch: the simulator sees every delivery
        self.rt = rt
        return rt

    def new_runtime(self) -> sr.SparkRuntime:
        """The real constructor; its exchange the simulated cluster's."""
        rt = sr.SparkRuntime(self.app_ref, self.config)
        rt.exchange = SimExchange(self, self.config)
        return rt

    def write_offsets(self, batch: int, starts: list[int], ends: list[int]) -> None:
        d = os.path.join(self.config.checkpoint_dir, "query", "offsets")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, str(batch)), "w", encoding="utf-8") as f:
            f.write("v1\n{}\n" + json.dumps({"offsets": ends, "start": starts}) + "\n")

    def load_initial(self) -> None:
        by_pid: dict[int, list[tuple[bytes, bytes]]] = {p: [] for p in range(self.config.partitions)}
        state: dict[bytes, bytes] = {}
        assert isinstance(self.w, Workload), "another plan loads its own initial state"
        for key, item, value in self.w.initial_state():
            k = store_key("node", key, "\x01" + item if item else "")
            state[k] = serde.encode(value)
            by_pid[partition_of("node", key, self.config.partitions)].append((k, state[k]))
        durable = DurableState(self.durable_root)
        for pid, rows in by_pid.items():
            durable.write_base(pid, -1, sorted(rows))
        self.expected[-1] = dict(sorted(state.items()))

    def durable_state(self, epoch: int) -> dict[bytes, bytes]:
        durable = DurableState(self.state_root)
        merged: dict[bytes, bytes] = {}
        for pid in range(self.config.partitions):
            data, reached = durable.load(pid, epoch)
            if reached != epoch:
                raise Violation(f"epoch {epoch} is recorded but p{pid}'s durable copy reaches {reached}")
            merged.update(data)
        return dict(sorted(merged.items()))

    def verify_recorded(self) -> None:
        """Check every newly recorded epoch against the oracle, in order."""
        from charon.testing import oracle

        assert self.rt is not None
        last = self.rt.last_recorded_epoch()
        e = max(self.expected) + 1
        while e <= last:
            res = self.results.get(e)
            if res is None:
                raise Violation(f"epoch {e} is recorded but no run of it completed")
            after = self.durable_state(e)
            self.committed(e, after, res)
            try:
                oracle.check_epoch(self.app, self.expected[e - 1], after, res, partitions=self.config.partitions,
                                    timer_limit=self.config.max_timers_per_epoch,
                                    verdicts=self.rt.verdict_book.verdicts)
            except AssertionError as exc:
                raise Violation(f"epoch {e}: {exc}") from None
            for tid in res.order:
                rid = res.requests[tid].request_id
                got = self.rt.output_log.get(rid)
                if got != res.replies[tid]:
                    raise Violation(f"epoch {e}: delivered reply {got} != epoch result {res.replies[tid]}")
            self.check_atom(e, res)
            # TIDs new in this epoch (not carried over deferred) exceed every earlier epoch's, also across a
            # growth of the input log (the sequencer's rebase)
            carried = set(self.results[e - 1].deferred) if e > 0 and e - 1 in self.results else set()
            new = [t for t in res.requests if t not in carried]
            if new and min(new) <= self.max_tid:
                raise Violation(f"epoch {e}: TID {min(new)} is not above the earlier epochs' {self.max_tid}")
            self.max_tid = max([self.max_tid, *res.requests])
            self.expected[e] = after
            self.trace(f"epoch {e} verified: {len(res.order)} outcomes, deferred {res.deferred}")
            e += 1

    def committed(self, e: int, after: dict[bytes, bytes], res: EpochResult) -> None:
        """Called with each recorded epoch's committed state and result before the oracle checks it (the
        application harness checks its invariants here)."""

    def check_atom(self, e: int, res: Any) -> None:
        """The stream log holds epoch ``e``'s atom exactly once, as the oracle-checked result has it (also when
        the epoch's finalize was deferred into the next batch, or the epoch re-run after a crash)."""
        assert self.rt is not None
        streams = self.rt.streams
        want: dict[str, list[bytes]] = {}
        for _, stream, value in res.events:
            want.setdefault(stream, []).append(value)
        for stream in set(want) | set(streams.streams()):
            got = [ev.value for ev in streams.read_range(stream, 0, streams.end_offset(stream)) if ev.epoch == e]
            if got != want.get(stream, []):
                raise Violation(f"epoch {e}: stream {stream!r} holds {len(got)} events, the epoch emitted "
                                f"{len(want.get(stream, []))}")
        self.atoms += bool(res.events)

    def run(self) -> dict[str, int]:
        with self.patched():
            try:
                return self._run()
            finally:
                if self.rt is not None:
                    self.rt._replies.abandon()
                    self.rt.input_log.close()
                    self.rt.output_log.close()
                for w in self.workers:
                    w.close_stores()
                self.close_gangs()

    def close_gangs(self) -> None:
        """Close what a simulated gang holds (the resident mode's)."""

    def _run(self) -> dict[str, int]:
        self.trace(f"workload: {len(self.w.epochs)} epochs, {self.w.partitions} partitions, live={self.w.live}, "
                   f"{self.faults}")
        self.load_initial()
        rt = self.start_runtime()
        submitted: list[str] = []
        batch, next_epoch = 0, 0
        prev_ends = [0] * self.config.n_log_partitions
        offsets_written = -1
        attempts = 0
        early = False  # the next epoch's requests were appended while the previous batch ran
        while True:
            if offsets_written < batch:
                if next_epoch < len(self.w.epochs) and not early:
                    rt, ids = self.append_epoch(rt, next_epoch)
                    submitted += ids
                    next_epoch += 1
                early = False
                ends = rt.input_log.end_offsets()
                prev_ends = pad_offsets(prev_ends, len(ends))  # as the source does when the log grew
                if ends == prev_ends:
                    break  # no new data: Spark runs no batch
                self.write_offsets(batch, prev_ends, ends)
                offsets_written = batch
            attempts += 1
            if attempts > 200:
                raise Violation("the run does not finish")
            if not early and next_epoch < len(self.w.epochs) and self.rng.random() < self.pipelined:
                # requests arrive while this batch runs: the runtime defers its finalize into the next batch
                rt, ids = self.append_epoch(rt, next_epoch)
                submitted += ids
                next_epoch += 1
                early = True
            try:
                self.trace(f"batch {batch}")
                rt._on_batch(None, batch)
            except SimCrash:
                self.verify_recorded()  # what the crashed driver recorded is final
                rt = self.start_runtime()
                continue
            self.verify_recorded()
            prev_ends = ends
            batch += 1
            if self.rng.random() < self.faults.read:
                self.where = f"after batch {batch - 1}"
                self.read_check()
        return self.end_checks(rt, submitted)

    def end_checks(self, rt: sr.SparkRuntime, submitted: list[str]) -> dict[str, int]:
        """The end of a run: every request has exactly one outcome and one reply, nothing deferred is left, every
        executor's local copy equals the verified state; returns the run's counters."""
        last = rt.last_recorded_epoch()
        rec = rt.read_record(last)
        if rec is not None and rec.deferred:
            raise Violation(f"deferred transactions left with no batch to run them: {rec.deferred}")
        outcomes = [r.request_id for e in range(last + 1) for t, r in self.results[e].requests.items()
                    if t in self.results[e].order and not r.request_id.startswith(timers.REQUEST_PREFIX)]
        self.fired = sum(len(self.results[e].timers) for e in range(last + 1))
        if sorted(outcomes) != sorted(submitted):
            raise Violation(f"requests and outcomes differ: {sorted(set(submitted) ^ set(outcomes))} "
                            f"or duplicates ({len(outcomes)} outcomes, {len(submitted)} requests)")
        for rid in submitted:
            if rt.output_log.get(rid) is None:
                raise Violation(f"{rid} has no reply")
        for w in self.workers:  # every executor's copy, brought to the last epoch, equals the verified state
            got = self.local_state(w, last)
            if got != self.expected[last]:
                raise Violation(f"w{w.wid}'s local state at epoch {last} differs from the verified state")
        return {"epochs": last + 1, "requests": len(submitted), "crashes": self.crashes, "rounds": self.rounds,
                "pipelined": self.pipelined_epochs, "fallback_jobs": self.fallback_jobs,
                "rest_jobs": self.rest_jobs, "atoms": self.atoms, "fired": self.fired,
                "log_resizes": self.log_resizes, "engine_rescales": self.engine_rescales,
                "log_partitions_read": len(rec.ends) if rec is not None else 0,
                "overruns": self.overruns, "verdicts": len(self.rt.verdict_book.verdicts) if self.rt else 0}

    def local_state(self, w: Worker, epoch: int) -> dict[bytes, bytes]:
        merged: dict[bytes, bytes] = {}
        root = self.state_root
        with w.process():
            for pid in range(self.config.partitions):  # where the task function keeps this layout's stores
                store = lmdbstore.open_store(local_root(w.dir, self.config.checkpoint_dir, root), pid, root)
                store.ensure_epoch(epoch)
                merged.update(store.items())
        return dict(sorted(merged.items()))


@dataclass
class Boundary:
    """An operation of the resident mode at an epoch boundary: a pause (then a resume), an engine rescale, or both
    (the rescale made while paused); ``inline``: the rescale runs while the sequencer is idle, else the next epoch
    waits at the gate for it (``ResidentSimulation.at_gate``)."""

    pause: bool
    partitions: int | None
    inline: bool = False
    crashes: int = 0  # driver crashes while paused (at most two: the run must finish)


class ResidentSimulation(Simulation):
    """A seed of the resident mode (``exchange="resident"``): the real :class:`~charon.runtime.spark.sequencer.
    DirectSequencer` (driven turn by turn: ``resume``, then ``run_next``; its bounds written by a
    :class:`~charon.testing.simulation_resident.LazyWriter`) and the real :class:`~charon.runtime.spark.resident.
    ResidentExchange`, whose gang is simulated (:mod:`charon.testing.simulation_resident`) with the gang's fault
    points. A lost gang (``GangLost``) restarts the query as the runtime's supervisor does (``_start_query``: the
    old exchange closed, a new one and a new sequencer resuming from the records and bounds); a driver crash
    abandons the runtime, its gang dies with it (tasks with frames not run yet may linger as zombies). At some epoch
    boundaries (``engine_rescale``, ``pauses``, ``log_growth``) the running runtime is rescaled, paused and resumed,
    or its input log resized (:meth:`append_epoch`, :meth:`at_gate`)."""

    def __init__(self, seed: int, root: str, trace: bool = False, without: frozenset[str] = frozenset(),
                 workload: Plan | None = None, faults: Faults | None = None,
                 gang_faults: GangFaults | None = None, zombies: bool = True, log_growth: bool = False,
                 engine_rescale: bool = False, pauses: bool = False) -> None:
        super().__init__(seed, root, trace, without, workload, faults, log_growth=log_growth,
                         engine_rescale=engine_rescale)
        # the boundaries' draws, from a generator of their own (a seed without them keeps every other draw)
        self.brng = random.Random(f"boundaries-{seed}")
        self.pause_plan = self.draw_pause_plan(seed, len(self.w.epochs)) if pauses else set()
        self.due: Boundary | None = None  # the boundary operation under way
        self.doomed: ResidentExchange | None = None  # a task dies in this exchange's first round (after a rescale)
        self.doomed_deaths = 0
        self.paused = self.paused_crashes = 0
        g = random.Random(f"resident-{seed}")  # the resident draws, from a generator of their own
        self.gang_faults = gang_faults or (GangFaults.draw(g) if faults is None else GangFaults.calm())
        if not zombies:  # --no-zombies: no task of an abandoned gang runs a frame late (see the module's docstring)
            self.gang_faults.zombie = self.gang_faults.linger = 0.0
        self.config.exchange = "resident"
        self.config.resident_tasks = g.randint(1, self.config.partitions)
        self.config.single_task_rest = False  # job-per-round levers: the resident exchange ignores them
        self.gangs: list[SimGang] = []
        self.zombies: list[SimTask] = []
        self.writer: LazyWriter | None = None
        self.writer_jobs = 0  # bounds written and trimmed by the sequencers' writers before the last one
        self.seq: DirectSequencer | None = None
        self.query_restarts = 0
        self.gang_rounds = 0
        self.zombie_runs = 0

    def trace_faults(self) -> str:
        return f"{self.faults}, {self.gang_faults}, {self.config.resident_tasks} gang task(s)"

    def local_dir(self, w: Worker) -> str:
        """A gang task's executor-local store directory in worker ``w`` (as ``resident_task`` computes it)."""
        return local_root(w.dir, self.config.checkpoint_dir, self.state_root)

    def judging_budget(self) -> bool:
        """Whether a round runs with budgets in a run that may judge them (see :meth:`overrunning`)."""
        ex = self.rt.exchange if self.rt is not None else None
        return (isinstance(ex, ResidentExchange) and ex.function_timeout is not None and self.rt is not None
                and self.rt.judging)

    def new_runtime(self) -> sr.SparkRuntime:
        return sr.SparkRuntime(self.app_ref, self.config, spark=SIM_SPARK)

    def maybe_crash(self, point: str, epoch: int) -> None:
        if self.writer is not None:
            self.writer.poke(self.rng)  # the bound writer's thread ran meanwhile, or not
        super().maybe_crash(point, epoch)

    def between_rounds(self) -> None:
        if self.rng.random() < self.faults.restart / 2:  # idle Python workers restart (live coroutines lost)
            w = self.rng.choice(self.workers)
            self.trace(f"{self.where}: w{w.wid}'s idle Python workers restart")
            w.procs.clear()
        super().between_rounds()

    def before_round(self, ex: ResidentExchange) -> None:
        """Before each round the driver sends: zombies run when their time came; perhaps a driver crash; perhaps
        Spark relaunches the gang's stage (a second hello)."""
        self.gang_rounds += 1
        for z in list(self.zombies):
            if z.tick():
                self.zombies.remove(z)
                self.zombie_runs += 1
        self.where = f"before round {self.gang_rounds}"
        self.maybe_crash("before_round", -1)
        gang = self.gangs[-1] if self.gangs else None
        if (gang is not None and gang.ex is ex and ex.launched and ex.broken is None
                and self.rng.random() < self.gang_faults.relaunch and self.gang_faults.lose()):
            gang.relaunch_hello()

    def launch(self, ex: ResidentExchange) -> None:
        gang = SimGang(self, ex, len(self.gangs), self.gang_faults)
        self.gangs.append(gang)
        gang.launch()

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """As :meth:`Simulation.patched`, and the runtime's exchange and sequencer are the simulated gang's and a
        sequencer this simulation drives (no thread of its own)."""
        sim = self

        class Gang(ResidentExchange):
            def __init__(self, config: SparkConfig, previous: tuple[int, str] | None,
                         versions: tuple[CodeEntry, ...]) -> None:
                super().__init__(None, sim.app_ref, config, previous, versions, launch=sim.launch)

            def round(self, control: Any, inboxes: list[list]) -> Any:
                sim.before_round(self)
                return super().round(control, inboxes)

        class Driven(DirectSequencer):
            def __init__(self, *a: Any, **kw: Any) -> None:
                if sim.writer is not None:
                    sim.writer_jobs += sim.writer.written
                sim.writer = LazyWriter()
                super().__init__(*a, writer=sim.writer, **kw)
                sim.seq = self

            def start(self) -> Driven:
                return self  # the simulation calls resume() and run_next()

        def make(spark: Any, app_ref: str, config: SparkConfig, previous: tuple[int, str] | None = None,
                 versions: tuple[CodeEntry, ...] = ()) -> Any:
            config.check_exchange()
            return Gang(config, previous, versions)

        saved = (sr.make_exchange, sr.DirectSequencer)
        sr.make_exchange, sr.DirectSequencer = make, Driven  # type: ignore[misc]  # deliberate patches (restored below)
        try:
            with super().patched():
                yield
        finally:
            sr.make_exchange, sr.DirectSequencer = saved  # type: ignore[misc]

    def start_runtime(self) -> sr.SparkRuntime:
        """A driver (re)start: the old driver's gang dies with it (perhaps leaving zombies), its bound writer's
        jobs not run are lost; the real constructor, then the query's start (a new exchange, a new sequencer)."""
        if self.gangs:
            self.gangs[-1].driver_died()
        for w in self.workers:  # a new application: new executors, new Python workers (local dirs stay)
            w.procs.clear()
        if self.writer is not None:
            self.writer.drop()
        rt = super().start_runtime()
        rt.gate = rt.controller.gate = SimGate(self.at_gate)
        rt._status = "ok"  # a started runtime's (a rescale waits for a boundary only in a running one)
        op = self.due
        if op is not None and not op.inline:  # the operator's pause or rescale, again on the new driver
            if op.pause and self.brng.random() < 0.5:
                self.trace("the pause ended with the driver (a new driver's gate is open)")
                op.pause = False
            if op.pause or op.partitions is not None:
                self.arm(rt, op)
            else:
                self.due = None
        rt._start_query()
        return rt

    @staticmethod
    def draw_pause_plan(seed: int, epochs: int) -> set[int]:
        """Pauses (``pauses``): the workload epochs before whose requests the operator pauses the runtime (one or
        two boundaries), from a generator of their own."""
        g = random.Random(f"pauses-{seed}")
        if epochs < 2:
            return set()
        return set(g.sample(range(1, epochs), min(epochs - 1, g.choice([1, 1, 2]))))

    def arm(self, rt: sr.SparkRuntime, op: Boundary) -> None:
        """Close the gate for ``op``: the operator's pause (now, or after the last recorded epoch), else the rescale's
        own hold taken before the sequencer reached the boundary (the real rescale holds again: holds nest)."""
        if op.pause:
            last = rt.last_recorded_epoch()
            after = last if last >= 0 and self.brng.random() < 0.5 else None
            rt.gate.pause(after_epoch=after)
            self.trace(f"the operator pauses the runtime{'' if after is None else f' after epoch {after}'}")
        else:
            rt.gate.hold()
            self.trace(f"a rescale to {op.partitions} partitions holds the gate")

    def at_gate(self, epoch: int) -> None:
        """Epoch ``epoch`` is about to wait at the closed gate: the other threads' turn. Every epoch before it is
        recorded and none runs; while paused a state read may run and the driver may die; the rescale's move runs
        (the real :meth:`SparkRuntime.rescale`); then the gate opens (the operator's resume, the hold's release)."""
        rt, op = self.rt, self.due
        if rt is None or op is None or op.inline:
            raise Violation(f"epoch {epoch} waits at a gate nobody opens")
        self.verify_recorded()  # a deferred finalize was recorded before the pause
        if rt.last_recorded_epoch() != epoch - 1 or rt.gate.active is not None:
            raise Violation(f"epoch {epoch} waits at the gate after epoch {rt.last_recorded_epoch()}, "
                            f"{rt.gate.active} running")
        self.where = f"at the gate before epoch {epoch}"
        if op.pause:
            state = rt.gate.status(epoch - 1)["state"]
            if state != "paused":
                raise Violation(f"the gate holds epoch {epoch} but says {state!r}")
            self.paused += 1
            self.trace(f"paused before epoch {epoch}")
            if self.brng.random() < 0.5:
                self.read_check()
            if op.crashes < 2 and self.brng.random() < 0.4:
                op.crashes += 1
                self.crashes += 1
                self.paused_crashes += 1
                self.trace(f"CRASH while paused before epoch {epoch}")
                for w in self.workers:
                    w.live = {}
                raise SimCrash("paused")
        if op.partitions is not None:
            self.move(rt, op.partitions)
        if op.pause:
            rt.gate.resume()
            self.trace("the operator resumes the runtime")
        else:
            rt.gate.release()
        self.due = None

    def move(self, rt: sr.SparkRuntime, partitions: int) -> None:
        """The real rescale of the running runtime (it holds the gate, finds the boundary, moves the state, commits
        the layout, replaces the exchange and releases; the driver may crash before or after the commit); the
        cluster follows; perhaps a task dies in the new gang's first round."""
        if rt.config.partitions != partitions:
            info = rt.rescale(partitions, timeout=0.0)
            self.config.partitions = partitions
            self.trace(f"engine partitions {info['from']} -> {info['to']} after epoch {info['epoch']} "
                       f"({info['keys']} items moved)")
            self.resize_cluster(partitions > info["from"])
            if self.brng.random() < 0.5 and isinstance(rt.exchange, ResidentExchange):
                self.doomed = rt.exchange
                self.trace("a task of the new gang will die in its first round")
        self.engine_rescales += 1

    def append_epoch(self, rt: sr.SparkRuntime, index: int) -> tuple[sr.SparkRuntime, list[str]]:
        """As :meth:`Simulation.append_epoch`, at a boundary of the resident mode: a pause and a rescale close the
        gate for the next epoch (:meth:`at_gate`), or a rescale runs at once while the sequencer is idle; the input
        log may be resized (no pause). A driver crash in either raises :class:`SimCrash` (the caller recovers and
        appends again: the rescale is retried, as the micro-batch path does)."""
        pause, parts = index in self.pause_plan, self.engine_plan.get(index)
        self.pause_plan.discard(index)
        self.engine_plan.pop(index, None)
        if (pause or parts is not None) and self.due is not None:
            self.trace(f"the operation before epoch {index} is still under way: none more here")
        elif pause or parts is not None:
            idle = rt.exchange.pending is None and not pause
            self.due = Boundary(pause, parts, inline=idle and self.brng.random() < 0.5)
            if not self.due.inline:
                self.arm(rt, self.due)
        if self.due is not None and self.due.inline:
            assert self.due.partitions is not None
            self.move(rt, self.due.partitions)
            self.due = None
        if index in self.log_plan:
            m = self.log_plan.pop(index)
            self.log_resizes += 1
            info = rt.rescale_log(m)
            self.trace(f"input log {info['from']} -> {info['to']} partitions (physical {info['physical']})")
        reqs = self.w.requests(index)
        rt.input_log.append_many(reqs)
        return rt, [r.request_id for r in reqs]

    def restart(self, crashed: bool) -> list[int]:
        """Recovery after a driver crash (``crashed``) or a lost gang (the supervisor's restart of the query):
        until the sequencer resumed; returns the end offsets of the last epoch fixed."""
        while True:
            self.attempts += 1
            if self.attempts > 200:
                raise Violation("the run does not finish")
            try:
                if crashed:
                    self.start_runtime()
                else:
                    assert self.rt is not None
                    if self.writer is not None:  # the failed loop's writer shuts down: its jobs complete first
                        self.writer.shutdown()
                    self.query_restarts += 1
                    self.trace("the supervisor restarts the query on a new gang")
                    self.rt._start_query()
                assert self.seq is not None
                ends = self.seq.resume()
                self.verify_recorded()  # the epochs it re-ran
                return ends
            except SimCrash:
                crashed = True
            except GangLost as e:
                self.trace(f"gang lost: {e}")
                crashed = False
            self.verify_recorded()

    def _run(self) -> dict[str, int]:
        self.trace(f"workload: {len(self.w.epochs)} epochs, {self.w.partitions} partitions, live={self.w.live}, "
                   f"{self.trace_faults()}")
        self.load_initial()
        self.attempts = 0
        rt = self.start_runtime()
        submitted: list[str] = []
        next_epoch = 0
        early = False
        assert self.seq is not None
        try:
            prev_ends = self.seq.resume()
            self.verify_recorded()
        except (SimCrash, GangLost) as e:
            self.verify_recorded()
            prev_ends = self.restart(isinstance(e, SimCrash))
        while True:
            assert self.rt is not None and self.seq is not None
            rt = self.rt
            try:
                if not early and next_epoch < len(self.w.epochs):
                    rt, ids = self.append_epoch(rt, next_epoch)
                    submitted += ids
                    next_epoch += 1
                early = False
                avail = rt.input_log.end_offsets()
                if not any(e > s for s, e in zip(*pad_pair(prev_ends, avail), strict=True)):
                    break  # nothing new: the sequencer waits
                self.attempts += 1
                if self.attempts > 200:
                    raise Violation("the run does not finish")
                if next_epoch < len(self.w.epochs) and self.rng.random() < self.pipelined:
                    rt, ids = self.append_epoch(rt, next_epoch)  # arrives while the epoch runs: finalize deferred
                    submitted += ids
                    next_epoch += 1
                    early = True
            except SimCrash:  # in a rescale or a log resize at a boundary: nothing of this epoch was appended
                early = False
                self.verify_recorded()
                prev_ends = self.restart(True)
                continue
            try:
                self.trace(f"epoch {self.seq.next_epoch} over {avail}")
                prev_ends = self.seq.run_next(prev_ends, avail)
            except (SimCrash, GangLost) as e:
                if isinstance(e, GangLost):
                    self.trace(f"gang lost: {e}")
                self.verify_recorded()
                prev_ends = self.restart(isinstance(e, SimCrash))
                continue
            self.verify_recorded()
            if self.rng.random() < self.faults.read:
                self.where = "after an epoch"
                self.read_check()
        for z in self.zombies:  # the lingering tasks finish before the end checks (they must not change anything)
            z.zombie_after = 0
            z.tick()
            self.zombie_runs += 1
        self.zombies = []
        assert self.rt is not None
        stats = self.end_checks(self.rt, submitted)
        if self.due is not None:
            raise Violation(f"a boundary operation never ran: {self.due}")
        stats.update({"gangs": len(self.gangs), "query_restarts": self.query_restarts,
                      "zombie_runs": self.zombie_runs, "paused": self.paused, "paused_crashes": self.paused_crashes,
                      "relayout_crashes": self.crash_at.get("relayout", 0),
                      "committed_crashes": self.crash_at.get("relayout_committed", 0),
                      "rescale_task_deaths": self.doomed_deaths,
                      "writer_jobs": self.writer_jobs + (0 if self.writer is None else self.writer.written)})
        return stats

    def close_gangs(self) -> None:
        for g in self.gangs:
            for t in g.tasks:
                t.sock.close()
                t.drv.close()


@dataclass
class Outcome:
    seed: int
    ok: bool
    error: str = ""
    stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def seed_exchange(seed: int, exchange: str) -> str:
    """The exchange seed ``seed`` runs (``exchange`` "drawn": half the seeds each, from a generator of its own)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, not {exchange!r}")
    if exchange != "drawn":
        return exchange
    return "resident" if random.Random(f"exchange-{seed}").random() < 0.5 else "jobs"


def run_seed(seed: int, trace: bool = False, keep: bool = False, without: frozenset[str] = frozenset(),
             log_growth: bool = False, engine_rescale: bool = False, exchange: str = "jobs",
             zombies: bool = True, pauses: bool = False) -> Outcome:
    """Run one seed in a fresh directory (on tmpfs when available); never raises. ``log_growth``: the input
    log is resized between epochs (:meth:`Simulation.draw_log_plan`); ``engine_rescale``: the engine partitions
    are rescaled at epoch boundaries (:meth:`Simulation.draw_engine_plan`); ``exchange``: "jobs" (the micro-batch
    path), "resident" (:class:`ResidentSimulation`) or "drawn" (per seed); ``zombies`` False: the resident mode's
    abandoned gang tasks never run a frame late; ``pauses``: the resident mode pauses and resumes at some epoch
    boundaries (:meth:`ResidentSimulation.draw_pause_plan`; the micro-batch path ignores it)."""
    mode = seed_exchange(seed, exchange)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix=f"charon-sim-{seed}-", dir=base)
    t0 = time.perf_counter()
    sim = (ResidentSimulation(seed, root, trace, without, zombies=zombies, log_growth=log_growth,
                              engine_rescale=engine_rescale, pauses=pauses) if mode == "resident" else
           Simulation(seed, root, trace, without, log_growth=log_growth, engine_rescale=engine_rescale))
    try:
        stats = sim.run()
        out = Outcome(seed, True, stats=stats)
    except Exception as exc:  # noqa: BLE001 - any failure of a seed is reported, not raised
        lines = [x for x in str(exc).splitlines() if x.strip()]
        msg = lines[0] + (f" ... {lines[-1].strip()}" if len(lines) > 1 else "") if lines else ""
        out = Outcome(seed, False, f"{type(exc).__name__}: {msg}"[:400])
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    out.seconds = time.perf_counter() - t0
    return out


def repro_line(o: Outcome, without: frozenset[str] = frozenset(), log_growth: bool = False,
               engine_rescale: bool = False, exchange: str = "jobs", zombies: bool = True,
               pauses: bool = False) -> str:
    opt = f" --exchange {seed_exchange(o.seed, exchange)}"
    opt += "" if zombies else " --no-zombies"
    opt += f" --without {','.join(sorted(without))}" if without else ""
    opt += " --log-growth" if log_growth else ""
    opt += " --rescale" if engine_rescale else ""
    opt += " --pause" if pauses else ""
    return f"FAIL seed {o.seed}: {o.error} | reproduce: python -m charon.testing.simulation --seed {o.seed}{opt}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m charon.testing.simulation", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=1000, help="how many seeds to run")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--seed", type=int, default=None, help="rerun one seed and print its trace")
    ap.add_argument("--keep", action="store_true", help="keep the seed's directory (with --seed)")
    ap.add_argument("--without", default="", help=f"program features to leave out, of {','.join(sorted(FEATURES))}")
    ap.add_argument("--log-growth", action="store_true", help="resize the input log between epochs")
    ap.add_argument("--rescale", action="store_true", help="rescale the engine partitions at epoch boundaries")
    ap.add_argument("--exchange", choices=EXCHANGES, default="drawn",
                    help="the micro-batch path with the job exchange, the resident mode, or drawn per seed")
    ap.add_argument("--pause", action="store_true", help="resident mode: pause and resume at epoch boundaries")
    ap.add_argument("--no-zombies", action="store_true",
                    help="resident mode: no task of an abandoned gang runs a frame late")
    a = ap.parse_args(argv)
    lg, er, ex, zb, pz = a.log_growth, a.rescale, a.exchange, not a.no_zombies, a.pause
    without = frozenset(x for x in a.without.split(",") if x)
    if without - FEATURES:
        ap.error(f"unknown features: {sorted(without - FEATURES)}")
    if a.seed is not None:
        o = run_seed(a.seed, trace=True, keep=a.keep, without=without, log_growth=lg, engine_rescale=er, exchange=ex,
                     zombies=zb, pauses=pz)
        ok = f"ok seed {o.seed}: {o.stats} in {o.seconds:.2f}s"
        print(repro_line(o, without, lg, er, ex, zb, pz) if not o.ok else ok)
        return 0 if o.ok else 1
    t0 = time.perf_counter()
    failed = 0
    totals: dict[str, int] = {}
    for seed in range(a.start, a.start + a.seeds):
        o = run_seed(seed, without=without, log_growth=lg, engine_rescale=er, exchange=ex, zombies=zb, pauses=pz)
        if not o.ok:
            failed += 1
            print(repro_line(o, without, lg, er, ex, zb, pz), flush=True)
        for k, v in o.stats.items():
            totals[k] = totals.get(k, 0) + v
    dt = time.perf_counter() - t0
    print(f"{a.seeds} seeds from {a.start}: {failed} failed, {dt:.1f}s ({dt / max(1, a.seeds) * 1000:.0f} ms/seed)")
    print(f"totals over the seeds that passed: {totals}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
