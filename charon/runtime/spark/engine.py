"""The Spark runtime seen through the engine contract, and the owner of its control state.

:class:`SparkEngine` is what the gateway, admin routes, metrics and CLI hold for a
:class:`~charon.runtime.spark.runtime.SparkRuntime`: the runtime's blocking calls run in threads, its answers are
the contract's types, and it owns what control needs beyond the epoch loop: the code history
(``<checkpoint>/code.json``), the previous code a compatible update keeps, the admin lock and the hold that
makes new submissions wait while an admin update runs alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from charon.core.routing import split_store_key
from charon.core.sequencer import Sequencer
from charon.log.offsets import pad_pair
from charon.messages import Request
from charon.runtime.contract import (
    CodeUpdate,
    ControlStatus,
    EpochNotRetained,
    GateClosed,
    GatePaused,
    Inspection,
    RescaleOutcome,
    SqlResult,
    UpdateOutcome,
)
from charon.runtime.control import sqlstate
from charon.runtime.control.codeversions import (
    CodeHistory,
    CodeVersion,
    admin_requests,
    load_app_ref,
    migration_of,
    update_outcome,
)
from charon.runtime.control.controls import GatedControls, HostedEngine
from charon.runtime.control.drain import plan_update
from charon.runtime.control.reads import check_entities, page_durable, read_durable, retained_from
from charon.runtime.schedules import start_declaring
from charon.storage.metered import MeterCollector

if TYPE_CHECKING:  # typing only: the runtime builds its engine
    from charon.runtime.spark.runtime import SparkRuntime

__all__ = ["SparkEngine"]


class SparkEngine(HostedEngine):
    """The contract over one Spark runtime (``rt``)."""

    rt: SparkRuntime

    kind: ClassVar[str] = "spark"
    slow_start: ClassVar[bool] = True
    status_blocks = True
    code_update_modes: ClassVar[tuple[str, ...]] = ("strict", "compatible")
    log_rescalable: ClassVar[bool] = True

    def __init__(self, rt: SparkRuntime) -> None:
        GatedControls.__init__(self)
        self.rt = rt
        self.gate = rt.gate
        self.code = CodeHistory(os.path.join(rt.ckpt, "code.json"),
                                CodeVersion(0, str(getattr(rt.app, "version", "1")), rt.app_ref))
        # a compatible code update's (first TID on the new code, the old ref) while transactions begun on the
        # old code are deferred
        self.previous: tuple[int, str] | None = None
        self.hold_submissions: asyncio.Event | None = None  # cleared while an admin update runs alone
        self.submitting = 0  # submissions under way (an admin update waits for them)
        self.declaring: asyncio.Task[int] | None = None  # the start's upserts of the declared schedules

    # -- Engine
    @property
    def partitions(self) -> int:
        return self.rt.config.partitions

    @property
    def durable(self) -> bool:
        return True

    @property
    def storage_metrics(self) -> MeterCollector | None:
        """The driver's requests and bytes to object storage as Prometheus counters (None without ``--storage``;
        the executors' own requests are not counted here): registered by the gateway's metrics."""
        meter = self.rt.storage_meter
        return MeterCollector(meter) if meter is not None else None

    @property
    def submit_checks_ids(self) -> bool:
        return True  # the runtime's log client looks each batch's client ids up before appending it

    async def start(self) -> None:
        await asyncio.to_thread(self.rt.start)
        self.declaring = start_declaring(self)  # schedules declared in code (charon.core.schedules)

    async def stop(self) -> None:
        if self.declaring is not None:
            self.declaring.cancel()
        await asyncio.to_thread(self.rt.stop)

    def health(self) -> dict[str, Any]:
        return self.rt.health()

    def describe(self) -> str:
        return f"durable in {os.path.abspath(self.rt.config.data_dir)}"

    @property
    def log_file(self) -> str | None:
        return self.rt.log_file

    def on_fatal(self, callback: Callable[[str], None]) -> None:
        self.rt.on_fatal = callback

    # -- Controls
    def status_now(self) -> ControlStatus:
        """Pause state, the last recorded epoch and the backlog (log entries after it). The log is asked through
        the runtime's bounded probe first: while it does not answer, ``backlog`` and ``log_partitions`` are null
        and ``log_error`` says why (answered within ``health_timeout_s``)."""
        rt = self.rt
        last = rt.last_recorded_epoch()
        probe = rt.log_probe.check(fresh=True)  # fresh: a backlog read right after an append counts it
        backlog: int | None = None
        log_partitions: dict[str, int] | None = None
        if probe.ends is not None:
            rec = rt.read_record(last) if last >= 0 else None
            ends, done = pad_pair(probe.ends, rec.ends if rec is not None else rt.input_log.start_offsets())
            physical, route = rt.input_log.counts()
            backlog = sum(max(0, e - d) for e, d in zip(ends, done, strict=True))
            log_partitions = {"route": route, "physical": physical}
        return ControlStatus(
            **rt.gate.status(last), epoch=last, engine="spark", durable=True, log_error=probe.error,
            backlog=backlog, log_partitions=log_partitions,
            retained_from=retained_from(rt.durable, rt.config.partitions),
            code_version=self.code.label(last + 1), dead_letters=dict(rt.verdict_book.counts))

    def inspect_now(self, operator: str, keys: list[str] | None, epoch: int | None, limit: int,
                    after: str | None = None, prefix: str = "", max_bytes: int | None = None) -> Inspection:
        """Rows as of ``epoch`` (default: the last recorded one, after the newest reply's) from the durable copy,
        on the driver (no Spark job: it never waits for the running query). Blocking."""
        rt = self.rt
        for _ in range(5):  # the layout and the epoch from the same side of a rescale
            parts, durable, gen = rt.placement()
            last = rt.settled_epoch()
            if gen == rt.layout_gen:
                break
        if epoch is None:
            epoch = last
        if epoch > last or epoch < -1:
            raise EpochNotRetained(f"epoch {epoch} is not recorded (the last recorded epoch is {last})")
        if keys is None:
            return Inspection(epoch, *page_durable(durable, parts, operator, epoch, limit, after, prefix, max_bytes))
        return Inspection(epoch, read_durable(durable, parts, operator, epoch, keys, limit))

    async def inspect(self, operator: str, keys: list[str] | None = None, epoch: int | None = None,
                      limit: int = 10_000, *, after: str | None = None, prefix: str = "",
                      max_bytes: int | None = None) -> Inspection:
        return await asyncio.to_thread(self.inspect_now, operator, keys, epoch, limit, after, prefix, max_bytes)

    def sql_now(self, query: str, epoch: int | None, max_rows: int, timeout_s: float, max_entities: int,
                max_bytes: int, max_memory: int) -> SqlResult:
        """The SQL sandbox over a cut read from the durable copy on the driver (never in the engine's JVM)."""
        ops = sorted(self.rt.app.operators)
        used = sorted(sqlstate.referenced_tables(query, ops))
        at, raw = epoch, {}
        if at is None or not used:
            at = self.inspect_now(ops[0] if ops else "", [], epoch, 1).epoch  # EpochNotRetained if not
        for op in used:
            got = self.inspect_now(op, None, at, max_entities + 1)
            at, raw[op] = got.epoch, got.rows
        check_entities(raw, max_entities)
        out = sqlstate.sqlite_sql(query, used, raw, at, max_rows, timeout_s, max_bytes, max_memory)
        return msgspec.convert(out, SqlResult)

    async def sql(self, query: str, epoch: int | None = None, *, max_rows: int = 1000, timeout_s: float = 30.0,
                  max_entities: int = 100_000, max_bytes: int = 4 << 20,
                  max_memory: int = 512 << 20) -> SqlResult:
        return await asyncio.to_thread(self.sql_now, query, epoch, max_rows, timeout_s, max_entities, max_bytes,
                                       max_memory)

    # -- admin updates
    def _paused(self) -> bool:
        """Whether the next epoch would wait at the gate (paused now, or its pause-after epoch is done)."""
        return self.gate.paused_for(self.rt.last_recorded_epoch() + 1)

    def refuse_if_paused(self, what: str) -> None:
        """Raise :class:`GatePaused` when paused: ``what`` needs epochs to run (before anything of it is
        recorded or logged), and none will until a resume."""
        if self._paused():
            raise GatePaused(f"the runtime is paused: {what} needs epochs to run; resume it first "
                             "(nothing was changed)")

    async def _until(self, pred: Callable[[], bool], what: str, deadline: float, needs_epochs: bool = False) -> None:
        """Wait for ``pred()``; ``needs_epochs``: only epochs make it true, so a pause refuses (GatePaused) at
        once (use only where nothing was recorded yet)."""
        while not await asyncio.to_thread(pred):
            if self.rt.fatal is not None:
                raise GateClosed(f"the runtime stopped: {self.rt.fatal}")
            if needs_epochs and await asyncio.to_thread(self._paused):
                raise GatePaused(f"the runtime is paused while waiting for {what}; resume it first "
                                 "(nothing was changed)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)

    async def wait_admin(self) -> None:
        """A submission waits here while an admin update runs alone."""
        hold = self.hold_submissions
        if hold is not None:
            await hold.wait()

    @contextlib.asynccontextmanager
    async def _alone(self, deadline: float) -> AsyncIterator[None]:
        """Hold new submissions (they wait in the gateway), let the ones under way finish and every logged
        request run; release afterwards. One at a time."""
        async with self.admin_lock:
            if self.hold_submissions is None:
                self.hold_submissions = asyncio.Event()
            hold = self.hold_submissions
            hold.clear()
            try:
                await self._until(lambda: self.submitting == 0 and self.rt.caught_up(), "the accepted requests",
                                  deadline, needs_epochs=True)
                yield
            finally:
                hold.set()

    def update_requests(self, update_id: str, operator: str, function: str, args: bytes,
                        keys: list[str] | None) -> list[Request]:
        rt = self.rt
        if keys is None:
            rows = read_durable(rt.durable, rt.config.partitions, operator, rt.last_recorded_epoch(), None, 1 << 62)
            keys = sorted({split_store_key(k)[1] for k in rows})
        return admin_requests(update_id, operator, function, args, keys)

    async def _update_epochs(self, update_id: str, operator: str, function: str, args: bytes,
                             keys: list[str] | None, deadline: float) -> UpdateOutcome:
        rt = self.rt
        reqs = await asyncio.to_thread(self.update_requests, update_id, operator, function, args, keys)
        known = [rt.get_reply(r.request_id) for r in reqs]
        if any(k is not None for k in known):
            return update_outcome(update_id, reqs, known, [], repeated=True)
        first = rt.last_recorded_epoch() + 1
        if reqs:
            await asyncio.to_thread(rt.input_log.append_many, reqs)
        await self._until(lambda: rt.caught_up() and all(rt.get_reply(r.request_id) is not None for r in reqs),
                          f"update {update_id} to run", deadline)
        epochs = list(range(first, rt.last_recorded_epoch() + 1))
        return update_outcome(update_id, reqs, [rt.get_reply(r.request_id) for r in reqs], epochs, repeated=False)

    async def run_alone(self, update_id: str, operator: str, function: str, args: bytes,
                        keys: list[str] | None = None, timeout: float = 600.0) -> UpdateOutcome:
        """A serializable admin update. New submissions are held (they wait in the gateway, not yet in the log)
        until the update is done; the submissions already under way run to their replies, then the update's
        requests are appended (request ids ``__charon_admin:<id>:<key>``: the logs make them run once) and run by
        epochs that hold nothing else, then submissions continue."""
        deadline = time.monotonic() + timeout
        self.refuse_if_paused(f"admin update {update_id}")
        async with self._alone(deadline):
            return await self._update_epochs(update_id, operator, function, args, keys, deadline)

    # -- code versions
    def recorded_code(self) -> None:
        """At construction: run the newest recorded code version (a code update survives a restart); after a
        compatible one, keep the previous code while the last record holds transactions deferred before it."""
        rt = self.rt
        hist = self.code.versions
        newest = hist[-1]
        if newest.ref is not None and newest.ref != rt.app_ref:
            rt.app_ref, rt.app = newest.ref, load_app_ref(newest.ref)
        self.previous = None
        if newest.first_tid is not None and len(hist) > 1 and hist[-2].ref is not None:
            rec = rt.read_record(rt.last_recorded_epoch())
            deferred = [] if rec is None else [(tid, None) for tid, _ in rec.deferred]
            self.previous = (newest.first_tid, hist[-2].ref)
            self.retire_previous(deferred)

    def retire_previous(self, deferred: list[tuple[int, Any]]) -> None:
        """After an epoch (``deferred``: what it left for the next): drop the code a compatible update kept once
        no transaction that started on it is deferred any more (the executors stop loading it)."""
        prev = self.previous
        if prev is not None and not any(tid < prev[0] for tid, _ in deferred):
            self.previous = None
            self.rt.set_exchange_code(self.rt.app_ref, None)

    def finish_update(self) -> None:
        """At start, before the query runs: a code update a crash interrupted appends its migration now (before
        any client request can be logged), so it still runs alone; :meth:`update_code` marks it done."""
        mig = migration_of(self.code.newest)
        if mig is not None and mig[0].endswith("?"):  # pending
            uid, op, fn, args = mig
            reqs = self.update_requests(uid[:-1], op, fn, args, None)
            if reqs and not any(self.rt.get_reply(r.request_id) is not None for r in reqs):  # it never ran
                self.rt.input_log.append_many(reqs)

    @contextlib.asynccontextmanager
    async def _boundary(self, deadline: float) -> AsyncIterator[None]:
        """Hold the runtime at an epoch boundary (its gate closed, no epoch running, the last one recorded; the
        next batch may be fixed and waits at the gate) without draining anything; reopened afterwards unless it
        was paused before. Call it holding the admin lock."""
        rt = self.rt
        self.gate.hold()
        try:
            await self._until(lambda: self.gate.wait_paused(rt.last_recorded_epoch, 0.05), "an epoch boundary",
                              deadline)
            yield
        finally:
            self.gate.release()

    async def _update_compatible(self, ref: str, version: str, deadline: float) -> CodeUpdate:
        rt = self.rt
        app = load_app_ref(ref)
        async with self.admin_lock:
            # at most two versions at once: the transactions still deferred on the oldest code finish first
            await self._until(lambda: self.previous is None, "the transactions deferred on the oldest code",
                              deadline, needs_epochs=True)
            await asyncio.to_thread(rt.ship_code, ref)
            async with self._boundary(deadline):
                # at the boundary: record the update (the commit point), then run ``ref`` with the old code kept
                # for the transactions deferred before it
                # before anything is recorded: VersionInUse, and the drained versions to unload (the version
                # running now is kept: a transaction deferred before the boundary may start a workflow on it)
                unload = await plan_update(self, self.code.versions, {*rt.app.workflows, *app.workflows}, ref,
                                           version, keep=self.code.newest.version)
                last = rt.last_recorded_epoch()
                rec = rt.read_record(last) if last >= 0 else None
                e = last + 1
                # every TID from epoch e on is >= it (the recorded counters' own count: the log may have grown)
                first_tid = Sequencer.restore(rec.counters).first_tid() if rec is not None and rec.counters else 1
                entry = CodeVersion(e, version, ref, None, first_tid)
                versions = self.code.updated(entry, unload)
                await asyncio.to_thread(self.code.record, rt.files.write, versions)  # the commit point
                self.code.versions = versions
                old_ref = rt.app_ref
                kept = sum(1 for tid, _ in (rec.deferred if rec is not None else []) if tid < first_tid)
                self.previous = (first_tid, old_ref) if kept else None
                rt.app_ref, rt.app = ref, app
                rt.set_exchange_code(ref, self.previous)  # none before the first start (_start_query builds it)
                return CodeUpdate(version=version, ref=ref, from_epoch=e, migration=None, mode="compatible",
                                  kept_deferred=kept, first_tid=first_tid)

    async def update_code(self, ref: str, version: str, migration: tuple[str, str, bytes] | None = None,
                          mode: str = "strict", timeout: float = 600.0) -> CodeUpdate:
        """A code update on the Spark runtime.

        *strict*: with submissions held and everything logged run (so no transaction spans versions), the driver
        and the executors switch to ``ref`` from the next epoch; the migration runs alone, then submissions
        continue. Recorded in ``<checkpoint>/code.json`` first (pending) and again once the migration ran, so a
        restart keeps the new code and finishes the migration.

        *compatible* (no migration): nothing is drained or held. The gate closes at the next epoch boundary e,
        the update is recorded with the first TID of e, and the driver and the executors run ``ref`` from e on,
        while a transaction deferred before e finishes on the old code, kept until no such transaction is left
        (:meth:`retire_previous`). A second compatible update first waits for the transactions still deferred on
        the oldest code: at most two versions run.

        While paused: a compatible update applies at once (a paused gate is an epoch boundary) unless it must
        wait for deferred transactions; a strict one applies at once when nothing logged is left to run and it
        has no migration. Otherwise :class:`GatePaused` at once, nothing changed."""
        if mode not in ("strict", "compatible"):
            raise ValueError(f"mode must be 'strict' or 'compatible', not {mode!r}")
        deadline = time.monotonic() + timeout
        if mode == "compatible":
            if migration is not None:
                raise ValueError("a compatible update has no migration (old and new code run side by side)")
            return await self._update_compatible(ref, version, deadline)
        rt = self.rt
        app = load_app_ref(ref)
        hist = self.code
        if migration is not None:  # it runs in epochs of its own after the switch: refuse before recording anything
            self.refuse_if_paused("a strict code update's migration")
        async with self._alone(deadline):
            if migration is not None:
                self.refuse_if_paused("a strict code update's migration")
            # before anything is recorded: VersionInUse, and the drained versions to unload
            unload = await plan_update(self, hist.versions, {*rt.app.workflows, *app.workflows}, ref, version)
            e = rt.last_recorded_epoch() + 1
            uid = f"code-{len(hist.versions)}-{version}"
            mig: list[object] | None = None
            if migration is not None:
                mig = [uid + "?", migration[0], migration[1], list(migration[2])]
            entry = CodeVersion(e, version, ref, mig)
            versions = hist.updated(entry, unload)
            await asyncio.to_thread(hist.record, rt.files.write, versions)
            hist.versions = versions
            await asyncio.to_thread(rt.ship_code, ref)
            rt.app_ref, rt.app = ref, app
            self.previous = None  # nothing is deferred here: no transaction of an older version is left
            rt.set_exchange_code(ref, None)
            out = None
            if migration is not None:
                out = await self._update_epochs(uid, migration[0], migration[1], migration[2], None, deadline)
                entry.migration = [uid, migration[0], migration[1], list(migration[2])]
                await asyncio.to_thread(hist.record, rt.files.write)
        return CodeUpdate(version=version, ref=ref, from_epoch=e, migration=out, mode="strict")

    # -- rescale
    async def rescale(self, partitions: int | None = None, *,
                      log_partitions: int | None = None) -> RescaleOutcome:
        out = await asyncio.to_thread(self.rt.rescale, partitions, log_partitions=log_partitions)
        return _outcome(out, moved=partitions is not None)

    def last_rescale(self) -> RescaleOutcome | None:
        """The newer of the last engine rescale and the last input-log resize (the same epoch: both)."""
        pauses, logs = self.rt.rescale_pauses, self.rt.log_rescales
        last = _outcome(pauses[-1], moved=True) if pauses else None
        if logs and (last is None or last.epoch is None or logs[-1]["epoch"] >= last.epoch):
            if last is not None and last.log is None and logs[-1]["epoch"] == last.epoch:
                return msgspec.structs.replace(last, log=logs[-1])
            return RescaleOutcome(log=logs[-1], engine_moved=False)
        return last


def _outcome(info: dict[str, Any], moved: bool) -> RescaleOutcome:
    if not moved:
        return RescaleOutcome(log=info.get("log"), engine_moved=False)
    return RescaleOutcome(from_=info.get("from"), to=info.get("to"), epoch=info.get("epoch"), keys=info.get("keys"),
                          wait_s=info.get("wait_s"), pause_s=info.get("pause_s"), cpu_s=info.get("cpu_s"),
                          log=info.get("log"))
