"""The driver's side of a round: :class:`SparkExchange` runs each round of an epoch as one Spark job and holds the
partitions' scratch between rounds."""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from charon.config import SparkConfig
from charon.core.epoch import EpochResult, FallbackJob, FallbackOutcome, RestJob, RestOutcome
from charon.core.partition import Control, RoundOutput
from charon.runtime.control.codeversions import CodeEntry
from charon.runtime.faults import crash_point
from charon.runtime.spark.layout import durable_location
from charon.runtime.spark.tasks import FALLBACK_TASK, REST_TASK, SPLIT_REST_TASK, run_partitions
from charon.state.records import EpochRecord


class SparkExchange:
    """Runs one round as one Spark job; holds each partition's scratch between rounds of an epoch."""

    def __init__(self, spark: Any, app_ref: str, config: SparkConfig, previous: tuple[int, str] | None = None,
                 versions: tuple[CodeEntry, ...] = ()) -> None:
        self.sc = spark.sparkContext if spark is not None else None
        self.partitions = config.partitions
        self.config = config
        self.slots = max(1, min(config.partitions, self.sc.defaultParallelism if self.sc else 1))
        self.scratch: list[bytes | None] = [None] * config.partitions
        # The dry run's call-graph cache stays here; a cached fallback round gets back only its transactions.
        self.cache: list[dict[int, list]] = [{} for _ in range(config.partitions)]
        self.durable_root = durable_location(config)  # the layout in force (a rescale changes it)
        self.fn: partial[Iterator[tuple[int, bytes]]]  # a round's task (set_code)
        self.set_code(app_ref, previous, versions)
        self.stats: dict[str, float] = {}
        self.epoch = -1
        # One task over every partition only where every task sees every partition's resident store (local
        # mode: one executor-local directory); on a cluster that task would restore stores other executors hold.
        local = config.master.strip().startswith("local")
        self.one_task_rest = config.single_task_rest and local
        # A large rest as several tasks of one job, each over a group of partitions (rounds exchanged through the
        # driver's hub): on a cluster too, as each task restores only its own partitions' stores.
        if config.split_rest not in ("on", "off", "cluster"):
            raise ValueError(f"split_rest must be 'on', 'off' or 'cluster', not {config.split_rest!r}")
        self.split_rest = config.split_rest == "on" or (config.split_rest == "cluster" and not local)
        self.hub: Any = None  # the RoundHub, made with the first split rest
        if not (config.single_task_fallback and local):
            self.fallback = None  # type: ignore[assignment]  # the coordinator then runs it round by round
        # (record, finalize) of the last epoch when its finalize was deferred to the next epoch's first round:
        # it needs this exchange's scratch, so a new exchange (a restarted query) starts without one
        self.pending: tuple[EpochRecord, EpochResult] | None = None

    def set_budget(self, timeout: float | None, probe_dir: str | None = None) -> None:
        """The functions' default time budget in the next rounds' tasks (None: no budget, an epoch's rerun), and
        whether they probe for a transaction that kills its worker (an epoch that failed before)."""
        kw = self.fn.keywords
        if kw.get("function_timeout") != timeout or kw.get("probe_dir") != probe_dir:
            self.fn = partial(self.fn.func, *self.fn.args,
                              **{**kw, "function_timeout": timeout, "probe_dir": probe_dir})

    def set_code(self, app_ref: str, previous: tuple[int, str] | None = None,
                 versions: tuple[CodeEntry, ...] = ()) -> None:
        """The code the next rounds' tasks run (a code update, at an epoch boundary): ``app_ref``, and for a
        compatible update ``previous`` = (first TID on ``app_ref``, the old ref) while the old one is needed;
        ``versions``: the recorded code history, the units' code book (workflow version pinning)."""
        cfg = self.config
        self.fn = partial(run_partitions, app_ref, cfg.partitions, cfg.local_dir, self.durable_root,
                          cfg.checkpoint_dir, previous=previous, gc_threshold=cfg.gc_threshold,
                          finalize_threads=cfg.finalize_threads, function_timeout=cfg.function_timeout,
                          determinism_check=cfg.determinism_check, versions=versions)

    def round(self, control: Control, inboxes: list[list]) -> list[RoundOutput]:
        t0 = time.perf_counter()
        if control.epoch != self.epoch:  # the call-graph cache serves one epoch's fallback
            self.epoch = control.epoch
            self.cache = [{} for _ in range(self.partitions)]
        busy = bool(control.apply or control.reset or control.fast or control.finalize or control.prior
                    or control.timers)
        payloads = []
        outs: list[RoundOutput] = [RoundOutput() for _ in range(self.partitions)]
        for p in range(self.partitions):
            if busy or inboxes[p]:
                cache = self.cache[p]
                cached = {t: cache[t] for t in control.fast if t in cache} if control.fast else None
                payloads.append((p, pickle.dumps((control, self.scratch[p], inboxes[p], cached),
                                                 protocol=pickle.HIGHEST_PROTOCOL)))
        t1 = time.perf_counter()
        results = self.run_job(payloads) if payloads else []
        t2 = time.perf_counter()
        crash_point("after_round", control.epoch)  # fires after the epoch's first round (fault tests)
        for pid, blob in results:
            scratch, out = pickle.loads(blob)
            self.scratch[pid] = scratch
            outs[pid] = out
            if out.cached:
                cache = self.cache[pid]
                for tid, entries in out.cached.items():
                    cache.setdefault(tid, []).extend(entries)
                out.cached = {}
        if control.finalize:
            self.scratch = [None] * self.partitions
            self.cache = [{} for _ in range(self.partitions)]
        t3 = time.perf_counter()
        s = self.stats
        s["ser_s"] = s.get("ser_s", 0.0) + (t1 - t0) + (t3 - t2)
        s["job_s"] = s.get("job_s", 0.0) + (t2 - t1)
        s["jobs"] = s.get("jobs", 0) + (1 if payloads else 0)
        s["tasks"] = s.get("tasks", 0) + (self.tasks_for(payloads) if payloads else 0)
        s["bytes_out"] = s.get("bytes_out", 0) + sum(len(b) for _, b in payloads)
        s["bytes_in"] = s.get("bytes_in", 0) + sum(len(b) for _, b in results)
        s["task_cpu_s"] = s.get("task_cpu_s", 0.0) + sum(o.stats.pop("cpu_us", 0) for o in outs) / 1e6
        s["step_s"] = s.get("step_s", 0.0) + sum(o.stats.get("step_us", 0) for o in outs) / 1e6
        s["restore_s"] = s.get("restore_s", 0.0) + sum(o.stats.get("restore_us", 0) for o in outs) / 1e6
        return outs

    def rest(self, job: RestJob) -> RestOutcome | None:
        """Take the rest of the epoch as one Spark job of one task when it is small (``single_task_rest``, in
        local mode: its messages and scratch under ``rest_max_bytes``), else None: the coordinator runs the
        next round as a job of its own. One job of one task costs less than a job per round (each ~40 ms of
        PySpark whatever it carries, ~70 ms with two tasks) as long as a core is not idle meanwhile.

        A rest large enough to pay for more tasks (``split_rest``: a task per ``split_rest_min_bytes``, at most
        one per core and per partition) runs as one job of that many tasks instead (:meth:`rest_split`); on a
        cluster (no one-task rest there) every rest does, over all the executors' cores."""
        if not (self.one_task_rest or self.split_rest):
            return None
        scratch = self.scratch
        size = len(job.roots) * 160 + sum(len(x) for x in scratch if x)
        if size >= self.config.rest_max_bytes:
            return None
        if not self.one_task_rest:
            # a cluster: the rest as one gang over the executors' cores (each task over its group of partitions;
            # one executor: one task, every store is there) instead of a Spark job per round, whatever its size: a
            # round between tasks costs a round trip, a job ~40 ms
            if not self.split_rest:
                return None
            return self.rest_split(job, max(1, min(self.config.split_rest_tasks or self.partitions, self.partitions,
                                                   self.gang_slots())))
        tasks = self.rest_tasks_for(size)
        if tasks > 1:
            return self.rest_split(job, tasks)
        cache = self.cache if job.epoch == self.epoch else [{} for _ in range(self.partitions)]
        t0 = time.perf_counter()
        payload = pickle.dumps((job, scratch, cache), protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        results = self.run_job([(REST_TASK, payload)])
        t2 = time.perf_counter()
        crash_point("after_round", job.epoch)
        [(_, blob)] = results
        out, scratches = pickle.loads(blob)
        self.scratch = scratches
        self.epoch = job.epoch
        self.cache = [{} for _ in range(self.partitions)]
        self._account(t0, t1, t2, time.perf_counter(), len(payload), len(blob), out.stats)
        return out

    def rest_tasks_for(self, size: int) -> int:
        """How many tasks a rest of ``size`` bytes (its estimate in :meth:`rest`) gets in local mode: 1 (one task)
        unless ``split_rest``; else one per ``split_rest_min_bytes``, at most ``split_rest_tasks`` (0: as many as
        cores), cores and partitions. (On a cluster a split rest takes every executor core: see :meth:`rest`.)"""
        if not self.split_rest:
            return 1
        want = min(self.config.split_rest_tasks or self.slots, self.slots, self.partitions,
                   size // max(1, self.config.split_rest_min_bytes))
        return max(1, min(want, self.gang_slots())) if want > 1 else 1

    def gang_slots(self) -> int:
        """Tasks a gang (barrier-mode) job may have now: every one needs a free core at once. Local mode: its
        cores; a cluster: its registered executors' cores (Spark's default parallelism is at least 2 even on one
        core, and a barrier job asking more cores than exist waits, then fails)."""
        if self.sc is None or self.config.master.strip().startswith("local"):
            return self.slots
        try:
            executors = self.sc._jsc.sc().getExecutorMemoryStatus().size() - 1  # the driver's block manager too
            cores = int(self.sc.getConf().get("spark.executor.cores") or 1)
        except Exception:  # noqa: BLE001 - an unknown cluster: no gang
            return 1
        return max(1, executors * cores)

    @staticmethod
    def groups(parts: int, tasks: int) -> list[list[int]]:
        """The partitions of each task of a split rest: ``tasks`` contiguous groups in partition order."""
        return [list(range(i * parts // tasks, (i + 1) * parts // tasks)) for i in range(tasks)]

    def rest_split(self, job: RestJob, tasks: int) -> RestOutcome:
        """The rest of the epoch as one job of ``tasks`` tasks, each over a group of partitions (:meth:`groups`),
        started together (barrier mode). The first task runs the coordinator (as a one-task rest does); each round
        it sends the other tasks their partitions' inboxes and takes in their outputs, over direct connections
        the tasks set up through the driver's :class:`~charon.runtime.spark.hub.RoundHub`. The first task returns
        the outcome, each its group's scratch and its part of the prior finalize's events (gathered here in
        partition order, as one task gathers them)."""
        from charon.runtime.spark.hub import RoundHub

        if self.hub is None:
            self.hub = RoundHub.for_spark(self.sc) if self.sc is not None else RoundHub("127.0.0.1")
        scratch = self.scratch
        cache = self.cache if job.epoch == self.epoch else [{} for _ in range(self.partitions)]
        t0 = time.perf_counter()
        job_blob = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        token = self.hub.open()
        groups = self.groups(self.partitions, tasks)
        payloads = [(SPLIT_REST_TASK, pickle.dumps((job_blob, g, {p: scratch[p] for p in g}, {p: cache[p] for p in g},
                                                    (self.hub.address(), token, i, groups)),
                                                   protocol=pickle.HIGHEST_PROTOCOL))
                    for i, g in enumerate(groups)]
        t1 = time.perf_counter()
        try:
            results = self.run_gang(payloads)
        finally:
            self.hub.close(token)
        t2 = time.perf_counter()
        crash_point("after_round", job.epoch)
        out: RestOutcome | None = None
        events: list = []
        due = math.inf
        task: dict[str, float] = {}
        for _, blob in results:  # in task order: the groups' partitions in order
            first, scratches, prior_events, prior_due, stats = pickle.loads(blob)
            if first is not None:
                out = first
            for pid, sc in scratches.items():
                self.scratch[pid] = sc
            events.extend(prior_events)
            due = min(due, prior_due)
            for k, v in stats.items():
                task[k] = task.get(k, 0) + v
        assert out is not None  # the first task's
        out.prior_events = events
        out.next_due = min(out.next_due, due)
        self.epoch = job.epoch
        self.cache = [{} for _ in range(self.partitions)]
        s = self.stats
        s["split_rests"] = s.get("split_rests", 0) + 1
        s["hub_s"] = s.get("hub_s", 0.0) + task.pop("hub_s", 0.0)
        s["hub_rounds"] = s.get("hub_rounds", 0) + task.pop("hub_rounds", 0)
        s["hub_bytes"] = s.get("hub_bytes", 0) + task.pop("hub_bytes", 0)
        self._account(t0, t1, t2, time.perf_counter(), sum(len(b) for _, b in payloads),
                      sum(len(b) for _, b in results), task, tasks)
        return out

    def run_gang(self, payloads: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """One Spark job of one task per payload, all started together (barrier mode), results in task order."""
        assert self.sc is not None
        return self.sc.parallelize(payloads, len(payloads)).barrier().mapPartitions(self.fn).collect()

    def _account(self, t0: float, t1: float, t2: float, t3: float, sent: int, got: int, task: dict,
                 tasks: int = 1) -> None:
        s = self.stats
        s["ser_s"] = s.get("ser_s", 0.0) + (t1 - t0) + (t3 - t2)
        s["job_s"] = s.get("job_s", 0.0) + (t2 - t1)
        s["jobs"] = s.get("jobs", 0) + 1
        s["tasks"] = s.get("tasks", 0) + tasks
        s["bytes_out"] = s.get("bytes_out", 0) + sent
        s["bytes_in"] = s.get("bytes_in", 0) + got
        s["task_cpu_s"] = s.get("task_cpu_s", 0.0) + task.pop("cpu_us", 0) / 1e6
        s["step_s"] = s.get("step_s", 0.0) + task.pop("step_us", 0) / 1e6
        s["restore_s"] = s.get("restore_s", 0.0) + task.pop("restore_us", 0) / 1e6

    def fallback(self, job: FallbackJob) -> FallbackOutcome:
        """Run the epoch's whole fallback as one Spark job of one task (``single_task_fallback``): one job
        instead of one per round of every wave; the task reaches every partition's store (executor-local, or
        restored from the durable copy), which costs little here as the fallback only reads."""
        cache = self.cache
        caches = [{t: cache[p][t] for t in job.conflicted if t in cache[p]} for p in range(self.partitions)]
        t0 = time.perf_counter()
        payload = pickle.dumps((job, self.scratch, caches), protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        results = self.run_job([(FALLBACK_TASK, payload)])
        t2 = time.perf_counter()
        crash_point("after_round", job.epoch)
        [(_, blob)] = results
        out, scratches = pickle.loads(blob)
        self.scratch = scratches
        self._account(t0, t1, t2, time.perf_counter(), len(payload), len(blob), out.stats)
        return out

    def run_job(self, payloads: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """One Spark job: the payloads in at most as many tasks as there are cores, results collected.

        A task costs ~30 ms of PySpark overhead whatever it does, so a round gets a second task only for
        every ``task_min_bytes`` of payload (small rounds run their partitions one after another in one task)."""
        assert self.sc is not None  # a Spark session (None only in an exchange that never runs a job)
        return self.sc.parallelize(payloads, self.tasks_for(payloads)).mapPartitions(self.fn).collect()

    def tasks_for(self, payloads: list[tuple[int, bytes]]) -> int:
        """How many tasks a round's payloads get (see :meth:`run_job`)."""
        size = sum(len(b) for _, b in payloads)
        return max(1, min(self.slots, len(payloads), size // max(1, self.config.task_min_bytes)))
