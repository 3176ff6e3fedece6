"""The in-process runtime seen through the engine contract, and the owner of its control state.

:class:`InProcessEngine` is what the gateway, admin routes, metrics and CLI hold for an
:class:`~charon.runtime.node.inprocess.InProcessRuntime` (volatile or a durable node): it answers the contract's calls
and owns what control needs beyond the epoch loop (the code history, the admin lock, the admin updates done).
Control operations run at an epoch boundary: the gate is held, the running epoch finishes, and the work runs in
the engine thread, where epochs run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from charon.core.routing import split_store_key
from charon.runtime.contract import (
    CodeUpdate,
    ControlStatus,
    Enqueue,
    EpochNotRetained,
    Inspection,
    NotSupported,
    RescaleBusy,
    RescaleOutcome,
    SqlResult,
    UpdateOutcome,
)
from charon.runtime.control import sqlstate
from charon.runtime.control.codeversions import (
    CodeHistory,
    CodeVersion,
    RecordedCode,
    admin_requests,
    code_entries,
    forget_module,
    load_app_ref,
    migration_of,
    update_outcome,
)
from charon.runtime.control.controls import GatedControls, HostedEngine
from charon.runtime.control.drain import plan_update
from charon.runtime.control.reads import (
    check_entities,
    node_retained_epochs,
    page_durable,
    page_stores,
    read_durable,
    read_stores,
)
from charon.storage.metered import MeterCollector

if TYPE_CHECKING:  # typing only: the runtime builds its engine
    from charon.operator import Application
    from charon.runtime.node.inprocess import InProcessRuntime


__all__ = ["InProcessEngine"]

_KEEP_UPDATES = 1000  # admin update outcomes kept for repeats of their ids


class InProcessEngine(HostedEngine):
    """The contract over one in-process runtime (``rt``)."""

    rt: InProcessRuntime

    kind: ClassVar[str] = "inprocess"
    code_update_modes: ClassVar[tuple[str, ...]] = ("strict", "compatible")

    def __init__(self, rt: InProcessRuntime) -> None:
        GatedControls.__init__(self)
        self.rt = rt
        self.gate = rt.gate
        self.base_app: Application = rt.app  # the constructed application (before any code switch)
        path = os.path.join(rt.node.data_dir, "code.json") if rt.node is not None else None
        self.code = CodeHistory(path, CodeVersion(0, str(getattr(rt.app, "version", "1")), None))
        # the recorded versions' applications (preloaded by recover_code and after each update, never in an epoch)
        self.book = RecordedCode(code_entries(self.code), load_app_ref, base=self.base_app)
        self.updates_done: dict[str, UpdateOutcome] = {}

    # -- Engine
    @property
    def partitions(self) -> int:
        return self.rt.partitions

    @property
    def durable(self) -> bool:
        return self.rt.durable

    @property
    def replayed_epochs(self) -> int:
        return self.rt.replayed_epochs

    @property
    def storage_metrics(self) -> MeterCollector | None:
        """Requests and bytes to object storage as Prometheus counters (None without ``--storage``): registered
        by the gateway's metrics."""
        meter = self.rt.node.meter if self.rt.node is not None else None
        return MeterCollector(meter) if meter is not None else None

    async def start(self) -> None:
        await self.rt.start()

    async def stop(self) -> None:
        await self.rt.stop()

    def health(self) -> dict[str, Any]:
        return self.rt.health()

    def on_fatal(self, callback: Callable[[str], None]) -> None:
        self.rt.fatal_callback = callback

    def describe(self) -> str:
        node = self.rt.node
        if node is None:
            return "EPHEMERAL: state, replies and request ids live in memory and are lost when it stops"
        return f"durable in {node.data_dir}, " + ("fsync per epoch" if node.fsync else
                                                  "no fsync: survives a killed process, not an OS crash")

    def enqueuer(self) -> Enqueue | None:
        """The runtime's queue, unless a subclass routes every request through its own ``submit``."""
        return self.rt.direct_enqueue()

    # -- Controls
    def status_now(self) -> ControlStatus:
        rt = self.rt
        last = rt.epoch - 1
        retained = node_retained_epochs(rt.node.durable, rt.partitions) if rt.node is not None else []
        backlog, parked = rt.backlog()
        return ControlStatus(
            **rt.gate.status(last), epoch=last, backlog=backlog, logged_waiting=parked, engine="inprocess",
            durable=rt.durable, retained_from=retained[0] if retained else last,
            code_version=self.code.label(last + 1),
            retained_epochs=sorted({*retained, last}),  # the last may be checkpointed too
            stuck=rt.watchdog.stuck, dead_letters=dict(rt.verdict_book.counts))

    async def inspect(self, operator: str, keys: list[str] | None = None, epoch: int | None = None,
                      limit: int = 10_000, *, after: str | None = None, prefix: str = "",
                      max_bytes: int | None = None) -> Inspection:
        """Rows as of ``epoch`` (default: the last committed one): the live stores between two epochs or, for an
        earlier epoch, the durable copy."""
        rt = self.rt
        last = rt.epoch - 1
        if epoch is None or epoch == last:
            def cut() -> Inspection | None:
                # held by a running epoch (its commit inserts keys into the sorted stores a page iterates): the
                # rows and their epoch as of one boundary, never part of an epoch's writes or a skipped entity
                with rt.finish_lock:
                    at = rt.epoch - 1
                    if epoch is not None and at != epoch:
                        return None  # the epoch asked for ended meanwhile: read it from the durable copy
                    if keys is None:
                        return Inspection(at, *page_stores(rt.stores, operator, limit, after, prefix, max_bytes))
                    return Inspection(at, read_stores(rt.stores, operator, keys, limit))

            live = await asyncio.to_thread(cut)  # off the loop: an epoch may hold the lock up to a budget
            if live is not None:
                return live
            assert epoch is not None  # (a read at the latest epoch always answers live)
            last = rt.epoch - 1
        if epoch > last or epoch < -1:
            raise EpochNotRetained(f"epoch {epoch} is not committed (the last committed epoch is {last})")
        node = rt.node
        if node is None:
            raise EpochNotRetained("a volatile runtime keeps only the state of its last committed epoch")
        if epoch > node.checkpointed_epoch:
            raise EpochNotRetained(f"epoch {epoch} is not checkpointed yet (checkpointed: {node.checkpointed_epoch})")
        retained = await asyncio.to_thread(node_retained_epochs, node.durable, rt.partitions)
        if epoch not in retained:
            raise EpochNotRetained(f"the state as of epoch {epoch} is not retained (retained: the checkpoints "
                                   f"{retained[-20:]} and the last committed epoch {last})")
        if keys is None:
            return Inspection(epoch, *await asyncio.to_thread(page_durable, node.durable, rt.partitions, operator,
                                                              epoch, limit, after, prefix, max_bytes))
        rows = await asyncio.to_thread(read_durable, node.durable, rt.partitions, operator, epoch, keys, limit)
        return Inspection(epoch, rows)

    async def sql(self, query: str, epoch: int | None = None, *, max_rows: int = 1000, timeout_s: float = 30.0,
                  max_entities: int = 100_000, max_bytes: int = 4 << 20,
                  max_memory: int = 512 << 20) -> SqlResult:
        """``query`` (one safe SELECT, checked by SQLite's authorizer) over the operators it names, read as one
        cut at ``epoch``, run in the SQL sandbox (:mod:`charon.runtime.control.sqlstate`). The cut's rows are copied
        in a thread holding the runtime's epoch lock; the check, the snapshot and the query run off the loop."""
        rt = self.rt
        ops = sorted(rt.app.operators)
        used = sorted(await asyncio.to_thread(sqlstate.referenced_tables, query, ops))
        raw: dict[str, dict[bytes, bytes]] = {}
        if epoch is None or epoch == rt.epoch - 1:
            def cut() -> tuple[int, dict[str, dict[bytes, bytes]]]:
                with rt.finish_lock:  # held by a running epoch: every operator as of the same boundary
                    return rt.epoch - 1, {op: read_stores(rt.stores, op, None, max_entities + 1) for op in used}

            at, raw = await asyncio.to_thread(cut)  # off the loop: an epoch may hold the lock up to a budget
        else:
            at = epoch
            await self.inspect(ops[0] if ops else "", [], epoch, 1)  # EpochNotRetained, even for no table
            for op in used:
                raw[op] = (await self.inspect(op, None, epoch, max_entities + 1)).rows
        check_entities(raw, max_entities)
        out = await asyncio.to_thread(sqlstate.sqlite_sql, query, used, raw, at, max_rows, timeout_s, max_bytes,
                                      max_memory)
        return msgspec.convert(out, SqlResult)

    @contextlib.asynccontextmanager
    async def _alone(self, drain: bool = True) -> AsyncIterator[None]:
        """Hold the runtime at an epoch boundary with nothing in flight: the gate held after the running epoch,
        epochs logged while paused run, transactions deferred before run (alone; not with ``drain`` False: they
        stay deferred); released afterwards (a user's pause is kept). One at a time."""
        rt = self.rt
        async with self.admin_lock:
            rt.gate.hold()
            try:
                while rt.gate.active is not None:  # the running epoch finishes first
                    await asyncio.sleep(0.001)
                await rt.in_engine(rt.run_parked)  # epochs logged while paused come first
                if drain:
                    await rt.in_engine(rt.drain)  # transactions deferred before run without what follows
                yield
            finally:
                rt.gate.release()

    def update_epochs(self, update_id: str, operator: str, function: str, args: bytes,
                      keys: list[str] | None) -> UpdateOutcome:
        """Run ``function`` on every key (default: every entity of ``operator``) as one epoch, then the epochs its
        deferred transactions need; call it at a quiet boundary (:meth:`_alone`, or during recovery)."""
        rt = self.rt
        if keys is None:
            keys = sorted({split_store_key(k)[1] for k in read_stores(rt.stores, operator, None, 1 << 62)})
        reqs = admin_requests(update_id, operator, function, args, keys)
        known = [rt.get_reply(r.request_id) for r in reqs]
        if any(k is not None for k in known):  # it ran before (e.g. before a restart): its epoch ran all of them
            return update_outcome(update_id, reqs, known, [], repeated=True)
        result = rt.run_epoch(reqs)
        epochs = [result.epoch] + [r.epoch for r in rt.drain()]
        return update_outcome(update_id, reqs, [rt.get_reply(r.request_id) for r in reqs], epochs, repeated=False)

    async def run_alone(self, update_id: str, operator: str, function: str, args: bytes,
                        keys: list[str] | None = None) -> UpdateOutcome:
        """A serializable admin update: ``operator/key.function(*args)`` for every key (default: every entity of
        ``operator`` as of the boundary), alone at an epoch boundary, once per ``update_id``.

        The runtime pauses after its running epoch, runs the epochs that only hold transactions deferred before
        the update, then one epoch with exactly the update's transactions (logged like any epoch in durable mode,
        so recovery replays it), then the epochs its own deferred transactions need, and resumes (unless it was
        paused before). Request ids are ``__charon_admin:<id>:<key>``: a repeat returns the first outcome."""
        done = self.updates_done.get(update_id)
        if done is not None:
            return msgspec.structs.replace(done, repeated=True)
        async with self._alone():
            out = await self.rt.in_engine(self.update_epochs, update_id, operator, function, args, keys)
        self.updates_done[update_id] = out
        while len(self.updates_done) > _KEEP_UPDATES:
            self.updates_done.pop(next(iter(self.updates_done)))
        return out

    # -- code versions
    def app_of(self, entry: CodeVersion) -> Application:
        return load_app_ref(entry.ref) if entry.ref is not None else self.base_app

    # the code book lent to the partition units (charon.core.context.CodeBook): workflow version pinning
    def label_of(self, epoch: int, tid: int) -> str:
        """The code version transaction ``tid`` of ``epoch`` runs with (what its reply's ``code_version`` says)."""
        return self.code.label(epoch, tid)

    def application_of(self, label: str) -> Application | None:
        """The application of the newest recorded version labelled ``label`` from the code book (imported by its
        ref before any epoch ran with it; the constructed application for the first one); None if no recorded
        version has that label, or it drained and was unloaded (``unloaded_at``)."""
        return self.book.application_of(label)

    def reload_book(self) -> None:
        """The code book of the recorded history now: the loaded versions' applications imported (those the book
        before held are reused), an unloaded one's dropped (its module too: :func:`forget_module`). Call it where
        no epoch runs (start-up, or holding the boundary of an update)."""
        old = self.book
        self.book = RecordedCode(code_entries(self.code), load_app_ref, base=self.base_app, prior=old).preload()
        keep = [*self.book.apps.values(), self.base_app, self.rt.app]
        for ref in sorted(set(old.apps) - set(self.book.apps)):
            forget_module(ref, keep)

    def recover_code(self) -> None:
        """Durable mode, at start-up (before replay): run the newest recorded code version (a code update
        flushes a checkpoint before it is recorded, so every epoch a recovery replays ran with the newest)."""
        hist = self.code.versions
        newest = hist[-1]
        if newest.first_tid is not None and len(hist) > 1:  # compatible: deferred transactions keep the old code
            self.rt.set_previous((newest.first_tid, self.app_of(hist[-2])))
            self.rt.retire_previous()
        if newest.ref is not None:
            self.rt.switch_app(load_app_ref(newest.ref))
        # a pinned workflow's steps may need an older version: imported now, never first inside an epoch (where a
        # budget's interrupt could land in the import); a version that fails to import is logged, its workflows'
        # next steps fail with VersionUnavailable; a drained one (unloaded_at) is not imported
        self.reload_book()

    def finish_migration(self) -> None:
        """After recovery: run the newest update's migration if it never ran (idempotent by its request ids)."""
        mig = migration_of(self.code.newest)
        if mig is not None:
            self.update_epochs(*mig, None)

    async def update_code(self, ref: str, version: str, migration: tuple[str, str, bytes] | None = None,
                          mode: str = "strict") -> CodeUpdate:
        """A code update at one epoch boundary e.

        ``strict``: every partition switches to ``ref`` at e, after every transaction that started on the old code
        finished (deferred ones included); ``migration`` (operator, function of the new code, encoded args) then
        runs on every entity of the operator in one epoch of its own, before any client transaction sees the new
        code. ``compatible`` (no migration): transactions sequenced from e on run the new code, while the ones
        deferred before e finish on the version they started with, kept until none is left (a reply's
        ``code_version`` says which). Durable mode records the update (``code.json``) after a checkpoint, so a
        restart keeps the new code and completes an interrupted migration. Rolling back is another update."""
        if mode not in ("strict", "compatible"):
            raise ValueError(f"mode must be 'strict' or 'compatible', not {mode!r}")
        if mode == "compatible" and migration is not None:
            raise ValueError("a compatible update has no migration (old and new code run side by side)")
        rt = self.rt
        app = load_app_ref(ref)
        compatible = mode == "compatible"
        async with self._alone(drain=not compatible):
            e = rt.epoch
            first_tid: int | None = None
            if compatible:
                if rt.coordinator.previous is not None:  # a third version at once: the oldest one finishes first
                    while rt.coordinator.previous is not None and rt.coordinator.deferred:
                        await rt.in_engine(rt.run_epoch, [])
                        rt.retire_previous()
                    e = rt.epoch
                first_tid = rt.coordinator.sequencer.first_tid()  # every later TID is at least this
            # at the boundary, before anything is recorded: VersionInUse, and the drained versions to unload
            keep = self.code.newest.version if compatible else None
            unload = await plan_update(self, self.code.versions, {*rt.app.workflows, *app.workflows}, ref, version,
                                       keep)
            mig: list[object] | None = None
            if migration is not None:
                mig = [f"code-{len(self.code.versions)}-{version}", migration[0], migration[1], list(migration[2])]
            entry = CodeVersion(e, version, ref, mig, first_tid)
            versions = self.code.updated(entry, unload)
            node = rt.node
            if node is not None:
                await asyncio.to_thread(node.flush)  # every epoch before e is checkpointed: no replay crosses e
                data = self.code.encoded(versions)
                path = self.code.path
                assert path is not None
                await asyncio.to_thread(node.write_file, path, data)
            kept = len(rt.coordinator.deferred)  # deferred before e: they finish on the old code
            if compatible and first_tid is not None:
                rt.set_previous((first_tid, rt.app))
            self.code.versions = versions
            rt.switch_app(app)
            self.reload_book()
            if compatible:
                rt.retire_previous()  # nothing deferred: no need to keep the old code
            out = None
            if mig is not None and migration is not None:
                out = await rt.in_engine(self.update_epochs, str(mig[0]), migration[0], migration[1], migration[2],
                                         None)
        return CodeUpdate(version=version, ref=ref, from_epoch=e, migration=out, mode=mode, kept_deferred=kept)

    # -- rescale
    async def rescale(self, partitions: int | None = None, *,
                      log_partitions: int | None = None) -> RescaleOutcome:
        if log_partitions is not None:
            raise NotSupported("this runtime has no input-log partitions to rescale (the in-process runtime's "
                               "input log is its node's single epoch log)")
        if partitions is None:
            raise ValueError("give partitions")
        if self.status_now().paused:  # its epoch loop waits at the gate: the move would wait for the resume
            raise RescaleBusy("the runtime is paused; resume it, then rescale")
        await self.rt.rescale(partitions)
        last = self.last_rescale()
        assert last is not None
        return last

    def last_rescale(self) -> RescaleOutcome | None:
        pauses = self.rt.rescale_pauses
        if not pauses:
            return None
        p = pauses[-1]
        return RescaleOutcome(from_=int(p["from"]), to=int(p["to"]), epoch=int(p["epoch"]), keys=int(p["keys"]),
                              wait_s=p.get("wait_s"), pause_s=p["pause_s"], cpu_s=p.get("cpu_s"))
