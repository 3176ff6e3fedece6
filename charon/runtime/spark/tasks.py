"""What runs on the executors: a round's task over its partitions' resident stores, an epoch's whole fallback or
rest in one task, state reads at an epoch, and the bulk load's bases."""

from __future__ import annotations

import math
import pickle
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from charon.core import determinism
from charon.core.partition import Control, Invoke, PartitionUnit, Prior, Reply, RoundOutput
from charon.core.routing import partition_of, store_key
from charon.runtime.control.codeversions import CodeEntry, RecordedCode
from charon.runtime.guard.quarantine import probing
from charon.runtime.guard.watchdog import task_budget
from charon.runtime.spark.layout import local_root
from charon.runtime.spark.session import forget_app, load_app
from charon.state.durable import DurableState, durable_at

if TYPE_CHECKING:
    from charon.operator import Application
    from charon.runtime.spark.hub import PeerLinks


def tune_worker_gc(threshold: int) -> None:
    """Tune the collector of this process once (a Python worker runs many tasks; the driver many epochs):
    unpickling a round's scratch and messages allocates objects by the hundred thousand, and with CPython's
    default threshold (700) each young collection walks the survivors again (half a big epoch's CPU)."""
    if threshold > 0:
        from charon.runtime.node.inprocess import tune_gc

        tune_gc(threshold)


_BOOK: list[RecordedCode] = []  # the last code book this process built (a resident gang's rounds reuse it)


def code_book(versions: tuple[CodeEntry, ...]) -> RecordedCode | None:
    """The code book of the recorded code history ``versions`` (:func:`~charon.runtime.control.codeversions.
    code_entries`): workflow version pinning in the partitions' units. Every loaded version's application is
    imported here, before the round's steps run (never inside one); kept while the history is the same. A version
    the history marks drained is unloaded: dropped from the book, this process's application cache and its import
    cache (:func:`~charon.runtime.control.codeversions.forget_module`)."""
    if not versions:
        return None
    if _BOOK and _BOOK[0].entries == versions:
        return _BOOK[0]
    prior = _BOOK[0] if _BOOK else None
    book = RecordedCode(versions, load_app, prior=prior).preload()
    _BOOK[:] = [book]
    if prior is not None:
        for ref in sorted(set(prior.apps) - set(book.apps)):
            forget_app(ref, book.apps.values())
    return book


def run_partitions(
    app_ref: str, parts: int, local_dir: str | None, durable_root: str, checkpoint: str,
    items: Iterable[tuple[int, bytes]], previous: tuple[int, str] | None = None, gc_threshold: int = 0,
    finalize_threads: int = 1, function_timeout: float | None = None, determinism_check: bool = False,
    probe_dir: str | None = None, versions: tuple[CodeEntry, ...] = (),
) -> Iterator[tuple[int, bytes]]:
    """One task of a round. ``previous``: a compatible code update's (first TID on ``app_ref``, the old
    code's ref): a transaction with a lower TID started before the update and runs the old code.
    ``gc_threshold``: see :func:`tune_worker_gc`. ``function_timeout``: the functions' default time budget
    (:func:`charon.runtime.guard.watchdog.task_budget`). ``determinism_check``: every function step runs twice
    (:mod:`charon.core.determinism`). ``probe_dir``: an epoch that failed is probed for a transaction that kills
    its worker (:func:`charon.runtime.guard.quarantine.probing`). ``versions``: the recorded code history, the
    units' code book (:func:`code_book`)."""

    if probe_dir is not None:
        with probing(probe_dir):
            yield from run_partitions(app_ref, parts, local_dir, durable_root, checkpoint, items, previous,
                                       gc_threshold, finalize_threads, function_timeout, determinism_check,
                                       versions=versions)
        return
    tune_worker_gc(gc_threshold)
    app = load_app(app_ref)
    prev = None if previous is None else (previous[0], load_app(previous[1]))
    book = code_book(versions)
    root = local_root(local_dir, checkpoint, durable_root)
    for pid, payload in items:
        if pid == FALLBACK_TASK:
            yield pid, _run_fallback_task(app, parts, root, durable_root, payload, prev, function_timeout,
                                          determinism_check, book)
            continue
        if pid == REST_TASK:
            yield pid, _run_rest_task(app, parts, root, durable_root, payload, prev, finalize_threads,
                                      function_timeout, determinism_check, book=book)
            continue
        if pid == SPLIT_REST_TASK:
            yield pid, _run_rest_task(app, parts, root, durable_root, payload, prev, finalize_threads,
                                      function_timeout, determinism_check, split=True, book=book)
            continue
        c0 = time.thread_time()  # the task's CPU for this partition (unpickling included): stats cpu_us
        control, scratch, inbox, cached = pickle.loads(payload)
        scratch_out, out = step_partition(app, parts, root, durable_root, pid, control, scratch, inbox, cached,
                                          prev, function_timeout, determinism_check, book=book)
        out.stats["cpu_us"] = int((time.thread_time() - c0) * 1e6)
        yield pid, pickle.dumps((scratch_out, out), protocol=pickle.HIGHEST_PROTOCOL)


def step_partition(app: Any, parts: int, root: str, durable_root: str, pid: int, control: Control,
                   scratch: bytes | None, inbox: list, cached: dict | None, prev: tuple[int, Any] | None,
                   function_timeout: float | None, determinism_check: bool, fence: int | None = None,
                   book: RecordedCode | None = None) -> tuple[bytes | None, RoundOutput]:
    """One partition's round in a task from its pickled ``scratch`` (see :func:`step_unit`); returns the scratch
    after the round, pickled (None after a finalize), and the round's output: the job-per-round task's form."""
    unit, out = step_unit(app, parts, root, durable_root, pid, control, scratch, inbox, cached, prev,
                          function_timeout, determinism_check, fence, book=book)
    return (None if unit is None else unit.dump_scratch()), out


def unit_for(app: Application, parts: int, root: str, durable_root: str, pid: int,
             scratch: bytes | PartitionUnit | None, prev: tuple[int, Application] | None, determinism_check: bool,
             fence: int | None = None, book: RecordedCode | None = None) -> PartitionUnit:
    """Partition ``pid``'s unit for a round, over its resident store (claimed as the writer generation ``fence``
    before its first write, :meth:`~charon.state.durable.DurableState.claim`: a task of an older gang is refused
    from then on) and ``scratch``: pickled (:meth:`~PartitionUnit.dump_scratch`), or the unit this process kept
    from the partition's round before (the resident gang: reused as is if its store and code are still the ones
    this round runs with); ``book``: its code book (:func:`code_book`)."""
    from charon.state.lmdbstore import open_store

    store = open_store(root, pid, durable_root, fence)
    if fence is not None and store.durable is not None and not store.durable.holds(pid, fence):
        store.durable.claim(pid, fence)  # (once per partition and gang: a round after the first reads nothing)
    if isinstance(scratch, PartitionUnit) and scratch.store is store and scratch.app is app:
        unit = scratch  # kept between rounds in this process (the resident gang): nothing to unpickle
        unit.next_round()
    else:
        if isinstance(scratch, PartitionUnit):  # its store or code changed meanwhile: its scratch moves over
            scratch = scratch.dump_scratch()
        unit = PartitionUnit(pid, parts, app, store)
        unit.load_scratch(scratch)
    unit.previous, unit.code = prev, book
    unit.twice = determinism.run_twice if determinism_check else None
    return unit


def finalize_prior(unit: PartitionUnit, prior: Prior) -> RoundOutput:
    """The previous epoch's deferred finalize of ``unit`` (idempotent): its store brought to the epoch before,
    then its delta written; the output carries its events and next due time (``step_unit(done=...)``)."""
    unit.store.ensure_epoch(prior.epoch - 1)
    return unit.finalize_prior(prior)


def step_unit(app: Any, parts: int, root: str, durable_root: str, pid: int, control: Control,
              scratch: bytes | PartitionUnit | None, inbox: list, cached: dict | None, prev: tuple[int, Any] | None,
              function_timeout: float | None, determinism_check: bool, fence: int | None = None,
              done: RoundOutput | None = None, book: RecordedCode | None = None,
              ) -> tuple[PartitionUnit | None, RoundOutput]:
    """One partition's round in a task: its unit (:func:`unit_for`) over its resident store and ``scratch``, the
    previous epoch's deferred finalize first if ``control`` carries it (``control.prior`` is cleared: give each
    partition its own copy) or ``done``, its output when the caller ran it (:func:`finalize_prior`); returns the
    unit holding the scratch after the round (None after a finalize) and the round's output. The job-per-round
    task (:func:`step_partition`) and the resident gang (:mod:`~charon.runtime.spark.resident`) both step
    partitions here."""
    unit = unit_for(app, parts, root, durable_root, pid, scratch, prev, determinism_check, fence, book)
    store = unit.store
    t0 = time.perf_counter()
    prior = control.prior
    if prior is not None:  # the previous epoch's deferred finalize: its delta first (idempotent)
        done = finalize_prior(unit, prior)  # its events and next due time return with this round
        control.prior = None
    store.ensure_epoch(control.epoch - 1)
    t1 = time.perf_counter()
    if cached:
        unit.load_cache(cached)
    if control.finalize:
        out = unit.step(control, inbox, done)
    else:
        with store.reading(), task_budget([unit], function_timeout):
            out = unit.step(control, inbox, done)
    t2 = time.perf_counter()
    out.stats["restore_us"] = int((t1 - t0) * 1e6)
    out.stats["step_us"] = int((t2 - t1) * 1e6)
    return (None if control.finalize else unit), out


FALLBACK_TASK = -1  # the payload id of a task that runs an epoch's whole fallback over every partition


class _TaskExchange:
    """An exchange inside one task: every partition's unit is here, a round steps them all in turn."""

    def __init__(self, units: list[PartitionUnit]) -> None:
        self.units = units
        self.partitions = len(units)

    def round(self, control: Control, inboxes: list[list]) -> list[RoundOutput]:
        outs = []
        for unit, inbox in zip(self.units, inboxes, strict=True):
            with unit.store.reading():
                outs.append(unit.step(control, inbox))
        return outs


def _run_fallback_task(app: Any, parts: int, root: str, durable_root: str, payload: bytes,
                       prev: tuple[int, Any] | None = None, function_timeout: float | None = None,
                       determinism_check: bool = False, book: RecordedCode | None = None) -> bytes:
    """An epoch's whole fallback (all cached rounds and locked waves) in this task, over every partition's
    store as of the previous epoch; returns the outcome and each partition's scratch. Writes nothing."""
    from charon.core.epoch import run_fallback
    from charon.state.lmdbstore import open_store

    c0 = time.thread_time()
    job, scratches, caches = pickle.loads(payload)
    units = []
    t0 = time.perf_counter()
    for pid in range(parts):
        store = open_store(root, pid, durable_root)
        store.ensure_epoch(job.epoch - 1)
        unit = PartitionUnit(pid, parts, app, store)
        unit.previous, unit.code = prev, book
        unit.twice = determinism.run_twice if determinism_check else None
        unit.load_scratch(scratches[pid])
        unit.load_cache(caches[pid])
        units.append(unit)
    t1 = time.perf_counter()
    with task_budget(units, function_timeout):
        out = run_fallback(app, _TaskExchange(units), job)
    out.stats["restore_us"] = int((t1 - t0) * 1e6)
    out.stats["step_us"] = int((time.perf_counter() - t1) * 1e6)
    scratches_out = [u.dump_scratch() for u in units]
    out.stats["cpu_us"] = int((time.thread_time() - c0) * 1e6)
    return pickle.dumps((out, scratches_out), protocol=pickle.HIGHEST_PROTOCOL)


REST_TASK = -2  # the payload id of a task that runs the rest of an epoch over every partition
SPLIT_REST_TASK = -3  # ... one of the tasks that run it together, each over a group of partitions (a split rest)


class _LeaderExchange:
    """The exchange of a split rest's first task, whose coordinator runs the rest of the epoch: a round sends each
    other task its partitions' inboxes (:class:`~charon.runtime.spark.hub.PeerLinks`), steps this task's
    partitions meanwhile, then takes in the others' outputs (:func:`_follow` is the other side)."""

    def __init__(self, units: dict[int, PartitionUnit], parts: int, links: PeerLinks, groups: list[list[int]],
                 ) -> None:
        self.units = units
        self.partitions = parts
        self.links = links
        self.groups = groups  # each task's partitions, in task order (this task's first)
        self.stats = {"hub_s": 0.0, "hub_rounds": 0, "hub_bytes": 0}

    def round(self, control: Control, inboxes: list[list[Invoke | Reply]]) -> list[RoundOutput]:
        s = self.stats
        for i, group in enumerate(self.groups[1:], 1):
            frame = pickle.dumps(("round", control, {pid: inboxes[pid] for pid in group}),
                                 protocol=pickle.HIGHEST_PROTOCOL)
            self.links.send(i, frame)
            s["hub_bytes"] += len(frame)
        outs: list[RoundOutput] = [RoundOutput()] * self.partitions  # each filled below
        for pid, unit in self.units.items():
            with unit.store.reading():
                outs[pid] = unit.step(control, inboxes[pid])
        t0 = time.perf_counter()
        for i in range(1, len(self.groups)):  # the other tasks' outputs
            frame = self.links.recv(i)
            s["hub_bytes"] += len(frame)
            for pid, out in pickle.loads(frame):
                outs[pid] = out
        s["hub_s"] += time.perf_counter() - t0
        s["hub_rounds"] += 1
        return outs

    def done(self, apply: list[int], reset: list[int]) -> None:
        """The epoch is decided: the other tasks leave their loops with what the finalize applies and resets."""
        frame = pickle.dumps(("done", apply, reset), protocol=pickle.HIGHEST_PROTOCOL)
        for i in range(1, len(self.groups)):
            self.links.send(i, frame)


def _follow(units: dict[int, PartitionUnit], links: PeerLinks, stats: dict[str, float]) -> tuple[list[int], list[int]]:
    """A split rest's other task: step this task's partitions on each round the first task sends, return their
    outputs to it; returns the epoch's (apply, reset) once it is decided."""
    while True:
        t0 = time.perf_counter()
        frame = links.recv(0)
        stats["hub_s"] += time.perf_counter() - t0
        msg = pickle.loads(frame)
        if msg[0] == "done":
            return msg[1], msg[2]
        _, control, inboxes = msg
        mine = []
        for pid, unit in units.items():
            with unit.store.reading():
                mine.append((pid, unit.step(control, inboxes[pid])))
        blob = pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL)
        links.send(0, blob)
        stats["hub_rounds"] += 1
        stats["hub_bytes"] += len(blob) + len(frame)


def _run_rest_task(app: Any, parts: int, root: str, durable_root: str, payload: bytes,
                   prev: tuple[int, Any] | None = None, finalize_threads: int = 1,
                   function_timeout: float | None = None, determinism_check: bool = False,
                   split: bool = False, book: RecordedCode | None = None) -> bytes:
    """The rest of an epoch (remaining dry-run rounds, lock-free decision, fallback) in this task over every
    partition; first the previous epoch's finalize if the job carries it (idempotent, as in any round), the
    partitions' in up to ``finalize_threads`` threads.

    ``split``: this task is one of a split rest's (:meth:`SparkExchange.rest_split`): it holds only its group of
    partitions; the first task runs the coordinator and exchanges each round with the others through the
    driver's hub (:class:`_LeaderExchange`, :func:`_follow`). Each returns its group's scratch and prior events,
    the first also the outcome."""
    from charon.core.epoch import run_rest
    from charon.state.lmdbstore import open_store

    c0 = time.process_time()  # this process's (the finalize's threads included)
    hub_at = None
    if split:
        job_blob, group, scratches, caches, hub_at = pickle.loads(payload)
        job = pickle.loads(job_blob)
        pids = list(group)
    else:
        job, scratches, caches = pickle.loads(payload)
        pids = list(range(parts))
    units = []
    prior_events: list = []
    prior_due = math.inf
    t0 = time.perf_counter()
    for pid in pids:
        unit = PartitionUnit(pid, parts, app, open_store(root, pid, durable_root))
        unit.previous, unit.code = prev, book
        unit.twice = determinism.run_twice if determinism_check else None
        unit.report_cache = False  # the rest of the epoch runs here: the call-graph cache stays in the unit
        unit.load_scratch(scratches[pid])
        units.append(unit)
    if job.prior is not None:
        prior = job.prior

        def finalize(unit: PartitionUnit) -> RoundOutput:
            unit.store.ensure_epoch(prior.epoch - 1)
            return unit.finalize_prior(prior)

        # Each partition's delta goes to its own durable file and LMDB environment, each with its fsyncs, which
        # queue behind the logs' (the same file system's journal): in threads, the waits overlap. The events
        # are still gathered in partition order.
        if finalize_threads > 1 and len(units) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(finalize_threads, len(units)),
                                    thread_name_prefix="charon-finalize") as pool:
                dones = list(pool.map(finalize, units))
        else:
            dones = [finalize(u) for u in units]
        for done in dones:
            prior_events.extend(done.events)
            if done.next_due is not None:
                prior_due = min(prior_due, done.next_due)
    for pid, unit in zip(pids, units, strict=True):
        unit.store.ensure_epoch(job.epoch - 1)
        unit.load_cache(caches[pid])
    t1 = time.perf_counter()
    if hub_at is not None:
        from charon.runtime.spark.hub import HubClient, PeerLinks

        address, token, index, groups = hub_at
        client = HubClient(address, token, index, len(groups))
        mine = dict(zip(pids, units, strict=True))
        out = None
        links = None
        try:
            links = PeerLinks.lead(client, token) if index == 0 else PeerLinks.follow(client, token, index)
            client.close()  # met: the rounds go task to task
            with task_budget(units, function_timeout):
                if index == 0:  # the coordinator of the rest
                    hub = _LeaderExchange(mine, parts, links, groups)
                    out = run_rest(app, hub, job)
                    hub.done(out.apply, out.reset)
                    stats = hub.stats
                    apply, reset = out.apply, out.reset
                else:
                    stats = {"hub_s": 0.0, "hub_rounds": 0, "hub_bytes": 0}
                    apply, reset = _follow(mine, links, stats)
        finally:
            client.close()
            if links is not None:
                links.close()
        for unit in units:
            unit.decided(apply, reset)
        stats = {"restore_us": int((t1 - t0) * 1e6), "step_us": int((time.perf_counter() - t1) * 1e6), **stats}
        scratches_out = {pid: u.dump_scratch() for pid, u in mine.items()}
        stats["cpu_us"] = int((time.process_time() - c0) * 1e6)
        return pickle.dumps((out, scratches_out, prior_events, prior_due, stats), protocol=pickle.HIGHEST_PROTOCOL)
    with task_budget(units, function_timeout):
        out = run_rest(app, _TaskExchange(units), job)
    for unit in units:  # the epoch is decided: its scratch shrinks to what the finalize writes
        unit.decided(out.apply, out.reset)
    out.prior_events = prior_events  # the driver puts them in atom order (it has the prior epoch's replies)
    out.next_due = min(out.next_due, prior_due)
    out.stats["restore_us"] = int((t1 - t0) * 1e6)
    out.stats["step_us"] = int((time.perf_counter() - t1) * 1e6)
    all_scratch = [u.dump_scratch() for u in units]
    out.stats["cpu_us"] = int((time.process_time() - c0) * 1e6)
    return pickle.dumps((out, all_scratch), protocol=pickle.HIGHEST_PROTOCOL)


def read_entities(
    app_ref: str, local_dir: str | None, durable_root: str, checkpoint: str, epoch: int,
    items: Iterable[tuple[int, list[bytes]]],
) -> Iterator[tuple[bytes, bytes | None]]:
    from charon.state.lmdbstore import open_store

    root = local_root(local_dir, checkpoint, durable_root)
    for pid, keys in items:
        store = open_store(root, pid, durable_root)
        yield from store.read_at(epoch, keys).items()  # catches up, never rolls back


def scan_prefix(
    local_dir: str | None, durable_root: str, checkpoint: str, epoch: int, items: Iterable[tuple[int, bytes]],
) -> Iterator[tuple[bytes, bytes]]:
    """The items under a key prefix of a partition as of exactly ``epoch`` (timer listings)."""
    from charon.state.lmdbstore import open_store

    root = local_root(local_dir, checkpoint, durable_root)
    for pid, prefix in items:
        store = open_store(root, pid, durable_root)
        store.catch_up(epoch)
        with store.reading():
            if store.epoch == epoch:
                yield from list(store.scan(prefix))
                continue
        durable = store.durable if store.durable is not None else DurableState(durable_root)
        state, _ = durable.load(pid, epoch)  # the local copy is already ahead
        yield from sorted((k, v) for k, v in state.items() if k.startswith(prefix))


def write_bases(durable_root: str, parts: int, rows: Iterable[Any]) -> Iterator[int]:
    """The bulk load's bases (epoch -1) of the partitions ``rows`` fall in, written into the durable copy at
    ``durable_root`` (a directory, or object storage through a temporary cache)."""
    by_pid: dict[int, dict[bytes, bytes]] = {}
    for r in rows:
        op, key, item, value = r[0], r[1], r[2] or "", r[3]
        by_pid.setdefault(partition_of(op, key, parts), {})[store_key(op, key, item)] = bytes(value)
    with tempfile.TemporaryDirectory(prefix="charon-load-") as cache:
        durable = durable_at(durable_root, cache)
        for pid, items in by_pid.items():
            durable.write_base(pid, -1, sorted(items.items()))
            yield len(items)
