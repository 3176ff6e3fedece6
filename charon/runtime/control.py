"""Runtime control shared by both runtimes: pause/resume at an epoch boundary and consistent state reads.

* :class:`EpochGate` is the one owner of "may the next epoch start?". A runtime asks it right before an epoch
  runs (:meth:`EpochGate.enter`, after the epoch's batch is fixed and before the coordinator runs it) and tells
  it when the epoch is done (:meth:`EpochGate.leave`). While the gate is closed no epoch starts; requests keep
  arriving (in the Spark runtime they wait in the durable input log). ``pause(after_epoch=N)`` lets epochs up
  to ``N`` run and closes the gate for every later one.
* :func:`read_durable` reads an operator's entities (or some of them) from the durable copy as of one epoch: one
  consistent cut, never mixing epochs; an epoch older than the durable copy's base is refused with
  :class:`EpochNotRetained`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from charon import serde
from charon.core.routing import entity_prefix, partition_of, split_store_key, store_key
from charon.core.sequencer import Sequencer
from charon.errors import CharonError
from charon.log.offsets import pad_pair
from charon.state.durable import DurableState, DurableStateError, write_file_atomic
from charon.state.store import MemoryStore

__all__ = ["Controllable", "EpochGate", "GateClosed", "GatePaused", "EpochNotRetained", "read_durable", "read_stores",
           "decode_entities"]


class GateClosed(CharonError):
    """The runtime stopped while an epoch waited at a closed gate (the epoch did not run)."""


class GatePaused(CharonError):
    """The runtime is paused (its epoch gate closed) and the operation needs epochs to run: refused at once
    instead of waiting for a resume until its timeout (HTTP 409 ``Paused``); nothing was changed."""


class EpochNotRetained(CharonError):
    """The state as of the requested epoch is not available (not reached yet, or compacted away)."""


class EpochGate:
    """Pause/resume at an epoch boundary (thread-safe; the in-process runtime awaits it on its event loop)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paused = False
        self._after: int | None = None
        self._holds = 0  # the runtime's own closings (a rescale's move, a code switch): a resume does not open them
        self._active: int | None = None  # the epoch running now
        self._stopping = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def closed_for(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` must wait."""
        return self._holds > 0 or self.paused_for(epoch)

    def paused_for(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` must wait for a user's :meth:`resume` (not counting the runtime's holds)."""
        return self._paused or (self._after is not None and epoch > self._after)

    def hold(self) -> None:
        """Close the gate for an operation of the runtime at the next boundary (a rescale's move, a code
        switch) until :meth:`release`, independently of the user's pause: a :meth:`resume` meanwhile does not
        let an epoch run in the middle of it, and the user's pause (or pause-after) is kept after it."""
        with self._cv:
            self._holds += 1
            self._cv.notify_all()

    def release(self) -> None:
        """End one :meth:`hold`; waiting epochs start if nothing else keeps the gate closed."""
        with self._cv:
            self._holds = max(0, self._holds - 1)
            self._cv.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:  # each rechecks (enter_async loops; wake_on_open's owner retries)
            loop.call_soon_threadsafe(ev.set)

    def pause(self, after_epoch: int | None = None) -> None:
        """Close the gate now (``after_epoch`` None) or once epoch ``after_epoch`` is done."""
        with self._cv:
            if after_epoch is None:
                self._paused = True
            else:
                self._after = after_epoch
            self._cv.notify_all()

    def resume(self) -> None:
        """Open the gate: waiting epochs start in order."""
        with self._cv:
            self._paused = False
            self._after = None
            self._cv.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)

    def stopping(self) -> None:
        """The runtime stops: an epoch waiting at the closed gate gives up with :class:`GateClosed`."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def reset(self) -> None:
        """The runtime (re)starts: waiting is possible again (the pause itself is kept)."""
        with self._cv:
            self._stopping = False

    def enter(self, epoch: int, timeout: float | None = None) -> None:
        """Block until epoch ``epoch`` may start, then mark it running (a thread of the runtime calls this)."""
        with self._cv:
            while self.closed_for(epoch):
                if self._stopping:
                    raise GateClosed(f"stopped while epoch {epoch} waited at the paused gate")
                self._cv.wait(timeout)
            self._active = epoch

    def try_enter(self, epoch: int) -> bool:
        """Mark epoch ``epoch`` running if it may start now (checked and marked at once); False if it must wait."""
        with self._cv:
            if self.closed_for(epoch):
                return False
            self._active = epoch
            return True

    async def enter_async(self, epoch: int) -> None:
        """Like :meth:`enter`, awaited on an event loop."""
        while True:
            with self._cv:
                if not self.closed_for(epoch):
                    self._active = epoch
                    return
                ev = asyncio.Event()
                self._waiters.append((asyncio.get_running_loop(), ev))
            await ev.wait()

    def wake_on_open(self, epoch: int, event: asyncio.Event) -> None:
        """Set ``event`` (on the running loop) when epoch ``epoch`` may start; at once if it may already."""
        with self._cv:
            if not self.closed_for(epoch):
                event.set()
                return
            if not any(ev is event for _, ev in self._waiters):
                self._waiters.append((asyncio.get_running_loop(), event))

    def leave(self) -> None:
        """The running epoch is done."""
        with self._cv:
            self._active = None
            self._cv.notify_all()

    def status(self, last_epoch: int) -> dict[str, Any]:
        """``state`` (running, pausing: closed with an epoch still running, paused), the pause settings."""
        with self._cv:
            closed = self.closed_for(last_epoch + 1)
            active = self._active
            state = "running" if not closed else ("pausing" if active is not None else "paused")
            if self._after is not None and not self._paused and not self._holds and last_epoch < self._after:
                state = "running"
            return {"state": state, "paused": state == "paused", "pause_requested": self._paused,
                    "pause_after": self._after, "active_epoch": active}

    def wait_paused(self, last_epoch: Any, timeout: float = 60.0) -> bool:
        """Block until no epoch runs and the next one would wait (``last_epoch``: a callable)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._active is None and self.closed_for(last_epoch() + 1), timeout)


class Controllable:
    """The control surface both runtimes share (the gateway's ``/admin/pause|resume|status`` call it): the one
    owner of pause/resume/status. A runtime sets ``gate`` (an :class:`EpochGate`) and ``control_engine``
    (``"inprocess"`` or ``"spark"``: which status function reads its epoch and backlog)."""

    gate: EpochGate
    control_engine: str = "inprocess"

    def pause(self, after_epoch: int | None = None) -> dict[str, Any]:
        """Start no epoch (after ``after_epoch``, if given) until :meth:`resume`; requests keep arriving and
        wait (in the input log on Spark and on a durable node). Returns the status."""
        self.gate.pause(after_epoch)
        return self.control_status()

    def resume(self) -> dict[str, Any]:
        """Let epochs start again; the waiting requests run in arrival (log) order. Returns the status."""
        self.gate.resume()
        return self.control_status()

    def control_status(self) -> dict[str, Any]:
        """``state`` (running, pausing, paused), the last committed ``epoch``, the ``backlog``, the code
        version and the retained epochs."""
        return spark_status(self) if self.control_engine == "spark" else inprocess_status(self)


def decode_entities(rows: dict[bytes, bytes], operator: str) -> dict[str, dict[str, Any]]:
    """``{key: {"value": v, "items": {name: v}}}`` of ``operator`` from store rows (other operators ignored)."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in rows.items():
        op, key, item = split_store_key(k)
        if op != operator or (item and not item.startswith("\x01")):  # the engine's own entries (timers): not shown
            continue
        ent = out.setdefault(key, {"value": None, "items": {}})
        if item == "":
            ent["value"] = serde.decode(v)
        else:
            ent["items"][item[1:]] = serde.decode(v)
    return out


def _wanted(operator: str, keys: list[str] | None, partitions: int) -> dict[int, list[str]] | None:
    if keys is None:
        return None
    by_pid: dict[int, list[str]] = {}
    for k in keys:
        by_pid.setdefault(partition_of(operator, k, partitions), []).append(k)
    return by_pid


def _pick(state: Any, operator: str, keys: list[str] | None, limit: int) -> dict[bytes, bytes]:
    """Rows of ``operator`` (only ``keys`` if given) from one partition's state; at most ``limit`` entities."""
    rows: dict[bytes, bytes] = {}
    if keys is not None:
        for key in keys:
            prefix = entity_prefix(operator, key)
            main = state.get(store_key(operator, key))
            if main is not None:
                rows[store_key(operator, key)] = main
            for k, v in _scan(state, prefix + b"\x01"):
                rows[k] = v
        return rows
    seen: set[bytes] = set()
    for k, v in _scan(state, f"{operator}\0".encode()):
        ent = k.split(b"\0", 2)[1]
        if ent not in seen:
            if len(seen) >= limit:
                continue
            seen.add(ent)
        rows[k] = v
    return rows


def _scan(state: Any, prefix: bytes) -> Any:
    if isinstance(state, MemoryStore):
        return state.scan(prefix)
    return ((k, v) for k, v in state.items() if k.startswith(prefix))


def read_stores(stores: list[MemoryStore], operator: str, keys: list[str] | None, limit: int) -> dict[bytes, bytes]:
    """The committed rows of ``operator`` in live stores (call it at an epoch boundary)."""
    wanted = _wanted(operator, keys, len(stores))
    rows: dict[bytes, bytes] = {}
    for pid, s in enumerate(stores):
        if wanted is not None and pid not in wanted:
            continue
        rows.update(_pick(s, operator, None if wanted is None else wanted[pid], limit - _count(rows)))
    return rows


def _count(rows: dict[bytes, bytes]) -> int:
    return len({k.split(b"\0", 2)[1] for k in rows})


def read_durable(
    durable: DurableState, partitions: int, operator: str, epoch: int, keys: list[str] | None, limit: int
) -> dict[bytes, bytes]:
    """The rows of ``operator`` as of ``epoch`` from the durable copy (every partition at the same epoch)."""
    wanted = _wanted(operator, keys, partitions)
    rows: dict[bytes, bytes] = {}
    for pid in range(partitions):
        if wanted is not None and pid not in wanted:
            continue
        try:
            state, _ = durable.load(pid, epoch)
        except DurableStateError as exc:
            raise EpochNotRetained(f"the state as of epoch {epoch} is no longer retained: {exc}") from None
        rows.update(_pick(state, operator, None if wanted is None else wanted[pid], limit - _count(rows)))
    return rows


# -- the runtimes' control surface (their methods delegate here; the gateway calls those) --------------------
def inprocess_status(rt: Any) -> dict[str, Any]:
    """Pause state, the last committed epoch and the backlog (queued + deferred) of an in-process runtime."""
    last = rt.epoch - 1
    retained = node_retained_epochs(rt.node.durable, rt.partitions) if rt.node is not None else []
    backlog = len(rt._queue) + len(rt.coordinator.deferred) + sum(len(p[0]) for p in rt._parked)
    return {**rt.gate.status(last), "epoch": last, "backlog": backlog, "logged_waiting": len(rt._parked),
            "engine": "inprocess", "durable": rt.durable, "retained_from": retained[0] if retained else last,
            "code_version": version_at(rt, last + 1),
            "retained_epochs": sorted({*retained, last}),  # the last may be checkpointed too
            "stuck": rt.watchdog.stuck, "dead_letters": dict(rt.verdict_book.counts)}


def node_retained_epochs(durable: DurableState, partitions: int) -> list[int]:
    """The epochs the node's durable copy can still show: its checkpoints (a checkpoint covers several epochs,
    written as one delta named after its last epoch) since the oldest base, ascending."""
    found: set[int] = set()
    floor = -1
    for pid in range(partitions):
        m = durable.manifest(pid)
        floor = max(floor, m.base_epoch)
        found.update(m.deltas)
        found.add(m.base_epoch)
    return sorted(e for e in found if e >= floor and e >= 0)


def _retained_from(durable: DurableState, partitions: int) -> int:
    return max((durable.manifest(pid).base_epoch for pid in range(partitions)), default=-1)


async def inprocess_inspect(
    rt: Any, operator: str, keys: list[str] | None, epoch: int | None, limit: int
) -> tuple[int, dict[bytes, bytes]]:
    """Rows of ``operator`` as of ``epoch`` (default: the last committed one), read on the runtime's loop
    (the live stores between two epochs) or, for an earlier epoch, from the durable copy."""
    last = rt.epoch - 1
    if epoch is None or epoch == last:
        return last, read_stores(rt.stores, operator, keys, limit)
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
    return epoch, await asyncio.to_thread(read_durable, node.durable, rt.partitions, operator, epoch, keys, limit)


async def inprocess_sql(
    rt: Any, sql: str, epoch: int | None = None, max_rows: int = 1000, timeout_s: float = 30.0,
    max_entities: int = 100_000, max_bytes: int = 4 << 20, max_memory: int = 512 << 20,
) -> dict[str, Any]:
    """The dashboard's SQL box on an in-process runtime: ``sql`` (one safe SELECT, checked by SQLite's
    authorizer) over the operators it names, read as one cut at ``epoch`` (default: the last committed one;
    all of them between the same two epochs), run in the SQL sandbox (:mod:`charon.runtime.sqlstate`). The cut's
    rows are copied in a thread holding the runtime's epoch lock (bytes, at most ``max_entities`` per operator);
    the check, the snapshot and the query run in a thread and a child process."""
    from charon.runtime import sqlstate

    ops = sorted(rt.app.operators)
    used = sorted(await asyncio.to_thread(sqlstate.referenced_tables, sql, ops))
    raw: dict[str, dict[bytes, bytes]] = {}
    if epoch is None or epoch == rt.epoch - 1:
        def cut() -> tuple[int, dict[str, dict[bytes, bytes]]]:
            with rt._finish_lock:  # held by a running epoch: every operator as of the same boundary
                return rt.epoch - 1, {op: read_stores(rt.stores, op, None, max_entities + 1) for op in used}

        at, raw = await asyncio.to_thread(cut)  # off the loop: an epoch may hold the lock up to a function's budget
    else:
        at = epoch
        await inprocess_inspect(rt, ops[0] if ops else "", [], epoch, 1)  # EpochNotRetained, even for no table
        for op in used:
            _, raw[op] = await inprocess_inspect(rt, op, None, epoch, max_entities + 1)
    _check_entities(raw, max_entities)
    return await asyncio.to_thread(sqlstate.sqlite_sql, sql, used, raw, at, max_rows, timeout_s, max_bytes,
                                   max_memory)


def _check_entities(raw: dict[str, dict[bytes, bytes]], max_entities: int) -> None:
    from charon.runtime import sqlstate

    for op, rows in raw.items():
        if _count(rows) > max_entities:
            raise sqlstate.StateTooLarge(f"operator {op!r} holds more than {max_entities} entities (sql_max_entities);"
                                         " use `charon sql` (Spark SQL over the data directory) for big states")


def spark_sql(
    rt: Any, sql: str, epoch: int | None = None, max_rows: int = 1000, timeout_s: float = 30.0,
    max_entities: int = 100_000, max_bytes: int = 4 << 20, max_memory: int = 512 << 20,
) -> dict[str, Any]:
    """The dashboard's SQL box on a Spark runtime: the same sandbox as :func:`inprocess_sql` (never in the
    engine's JVM), over a cut read from the durable copy on the driver (:func:`spark_inspect`). Blocking."""
    from charon.runtime import sqlstate

    ops = sorted(rt.app.operators)
    used = sorted(sqlstate.referenced_tables(sql, ops))
    at, raw = epoch, {}
    if at is None or not used:
        at, _ = spark_inspect(rt, ops[0] if ops else "", [], epoch, 1)  # the epoch (EpochNotRetained if not)
    for op in used:
        at, raw[op] = spark_inspect(rt, op, None, at, max_entities + 1)
    _check_entities(raw, max_entities)
    return sqlstate.sqlite_sql(sql, used, raw, at, max_rows, timeout_s, max_bytes, max_memory)


def spark_status(rt: Any) -> dict[str, Any]:
    """Pause state, the last recorded epoch and the backlog (log entries after it) of a Spark runtime.

    The log is asked through the runtime's bounded probe first: while it does not answer, ``backlog`` and
    ``log_partitions`` are null and ``log_error`` says why (answered within ``health_timeout_s``)."""
    last = rt._last_recorded_epoch()
    probe = rt._log_probe.check(fresh=True)  # fresh: a backlog read right after an append counts it
    base = {**rt.gate.status(last), "epoch": last, "engine": "spark", "durable": True, "log_error": probe.error}
    if probe.ends is None:
        base.update(backlog=None, log_partitions=None)
    else:
        rec = rt.read_record(last) if last >= 0 else None
        ends, done = pad_pair(probe.ends, rec.ends if rec is not None else rt.input_log.start_offsets())
        physical, route = rt.input_log.counts()
        base.update(backlog=sum(max(0, e - d) for e, d in zip(ends, done, strict=True)),
                    log_partitions={"route": route, "physical": physical})
    return {**base,
            "retained_from": _retained_from(rt.durable, rt.config.partitions),
            "code_version": spark_version_at(rt, last + 1), "dead_letters": dict(rt.verdict_book.counts)}


def spark_inspect(
    rt: Any, operator: str, keys: list[str] | None, epoch: int | None, limit: int
) -> tuple[int, dict[bytes, bytes]]:
    """Rows of ``operator`` as of ``epoch`` (default: the last recorded one, after the newest reply's) from the
    durable copy, on the driver (no Spark job: it never waits for the running query)."""
    for _ in range(5):  # the layout and the epoch from the same side of a rescale
        parts, durable, gen = rt._placement()
        last = rt._settled_epoch()
        if gen == rt._layout_gen:
            break
    if epoch is None:
        epoch = last
    if epoch > last or epoch < -1:
        raise EpochNotRetained(f"epoch {epoch} is not recorded (the last recorded epoch is {last})")
    return epoch, read_durable(durable, parts, operator, epoch, keys, limit)


# -- serializable admin updates (in-process runtime) ----------------------------------------------------------
ADMIN_PREFIX = "__charon_admin:"  # request ids of admin updates (the gateway reserves __charon* for runtimes)


@contextlib.asynccontextmanager
async def _alone(rt: Any, drain: bool = True) -> AsyncIterator[None]:
    """Hold the in-process runtime at an epoch boundary with nothing in flight: paused after the running
    epoch, epochs logged while paused run, transactions deferred before run (alone; not with ``drain``
    False: they stay deferred); resumed afterwards unless it was paused before. One at a time."""
    lock = getattr(rt, "_admin_lock", None)
    if lock is None:
        lock = rt._admin_lock = asyncio.Lock()
    async with lock:
        rt.gate.hold()
        try:
            while rt.gate._active is not None:  # the running epoch finishes first
                await asyncio.sleep(0.001)
            await rt.in_engine(rt._run_parked)  # epochs logged while paused come first
            if drain:
                await rt.in_engine(rt.drain)  # transactions deferred before run without what follows
            yield
        finally:
            rt.gate.release()


def _update_epochs(
    rt: Any, update_id: str, operator: str, function: str, args: bytes, keys: list[str] | None
) -> dict[str, Any]:
    """Run ``function`` on every key (default: every entity of ``operator``) as one epoch, then the epochs its
    deferred transactions need; call it at a quiet boundary (:func:`_alone`, or during recovery)."""
    from charon.messages import Request

    marker = f"{ADMIN_PREFIX}{update_id}"
    if keys is None:
        keys = sorted({split_store_key(k)[1] for k in read_stores(rt.stores, operator, None, 1 << 62)})
    reqs = [Request(f"{marker}:{k}", operator, k, function, args, time.time()) for k in keys]
    known = [rt.get_reply(r.request_id) for r in reqs]
    if any(k is not None for k in known):  # it ran before (e.g. before a restart): its epoch ran all of them
        return _update_outcome(update_id, reqs, known, [], repeated=True)
    result = rt.run_epoch(reqs)
    epochs = [result.epoch] + [r.epoch for r in rt.drain()]
    return _update_outcome(update_id, reqs, [rt.get_reply(r.request_id) for r in reqs], epochs, repeated=False)


async def inprocess_run_alone(
    rt: Any, update_id: str, operator: str, function: str, args: bytes, keys: list[str] | None
) -> dict[str, Any]:
    """A serializable admin update: ``operator/key.function(*args)`` for every key (default: every entity of
    ``operator`` as of the boundary), run alone at an epoch boundary, once per ``update_id``.

    The runtime pauses after its running epoch, runs the epochs that only hold transactions deferred before
    the update, then one epoch with exactly the update's transactions (logged like any epoch in durable mode,
    so recovery replays it), then the epochs its own deferred transactions need, and resumes (unless it was
    paused before). No client transaction shares those epochs. The functions are the deployed
    application's; request ids are ``__charon_admin:<id>:<key>``, so an update id runs once (a repeat
    returns the first outcome)."""
    history: dict[str, dict[str, Any]] = rt.__dict__.setdefault("_admin_done", {})
    if update_id in history:
        return {**history[update_id], "repeated": True}
    async with _alone(rt):
        out = await rt.in_engine(_update_epochs, rt, update_id, operator, function, args, keys)
    history[update_id] = out
    while len(history) > 1000:
        history.pop(next(iter(history)))
    return out


# -- strict code updates (in-process runtime) -----------------------------------------------------------------
class CodeVersion(msgspec.Struct):
    """One deployed code version: from which epoch on, its label, its module reference, its migration."""

    from_epoch: int
    version: str
    ref: str | None  # "module:attribute"; None: the application the runtime was constructed with
    migration: list[Any] | None = None  # [update id, operator, function, encoded args]
    # compatible updates: the first TID on this version (a lower TID started before, on the previous one)
    first_tid: int | None = None


def load_app_ref(ref: str) -> Any:
    """Import ``module:attribute`` of an installed module (code only comes from what is deployed)."""
    import importlib

    from charon.operator import Application

    mod, _, attr = ref.partition(":")
    app = getattr(importlib.import_module(mod), attr or "app", None)
    if not isinstance(app, Application):
        raise TypeError(f"{ref} is not a charon.Application")
    return app


def _switch(rt: Any, app: Any) -> None:
    rt.app = app
    rt.coordinator.app = app
    for u in rt.units:
        u.app = app


def _code_file(rt: Any) -> str | None:
    return os.path.join(rt.node.data_dir, "code.json") if rt.node is not None else None


def code_history(rt: Any) -> list[CodeVersion]:
    """The code versions of a runtime, oldest first (the first is the one it was constructed with)."""
    hist = rt.__dict__.get("_code_history")
    if hist is None:
        rt.__dict__.setdefault("_base_app", rt.app)  # the constructed application (before any switch)
        hist = [CodeVersion(0, str(getattr(rt.app, "version", "1")), None)]
        path = _code_file(rt)
        if path is not None and os.path.exists(path):
            with open(path, "rb") as f:
                hist = msgspec.json.decode(f.read(), type=list[CodeVersion])
        rt._code_history = hist
    return hist


def version_at(rt: Any, epoch: int, tid: int | None = None) -> str:
    """The code version epoch ``epoch`` ran (or runs) with; with ``tid``, the version transaction ``tid``
    (committed in ``epoch``) ran with: after a compatible update, one started before it kept the old one."""
    return _label(code_history(rt), epoch, tid)


def _label(hist: list[CodeVersion], epoch: int, tid: int | None) -> str:
    label = hist[0].version
    for v in hist:
        if v.from_epoch <= epoch and (tid is None or v.first_tid is None or tid >= v.first_tid):
            label = v.version
    return label


def _set_previous(rt: Any, previous: tuple[int, Any] | None) -> None:
    rt.coordinator.previous = previous
    for u in rt.units:
        u.previous = previous


def retire_previous(rt: Any) -> None:
    """After an epoch: drop the application kept by a compatible update once no transaction started on it
    is deferred any more."""
    prev = rt.coordinator.previous
    if prev is not None and not any(tid < prev[0] for tid, _ in rt.coordinator.deferred):
        _set_previous(rt, None)


def _app_of(rt: Any, entry: CodeVersion) -> Any:
    return load_app_ref(entry.ref) if entry.ref is not None else rt.__dict__.get("_base_app", rt.app)


def recover_code(rt: Any) -> None:
    """Durable mode, at start-up (before replay): run the newest recorded code version, and finish its
    migration if a crash came before it ran. An update flushes a checkpoint before it is recorded, so every
    epoch a recovery replays ran with the newest version."""
    hist = code_history(rt)
    newest = hist[-1]
    if newest.first_tid is not None and len(hist) > 1:  # compatible: deferred transactions keep the old code
        _set_previous(rt, (newest.first_tid, _app_of(rt, hist[-2])))
        retire_previous(rt)
    if newest.ref is not None:
        _switch(rt, load_app_ref(newest.ref))


def finish_migration(rt: Any) -> None:
    """After recovery: run the newest update's migration if it never ran (idempotent by its request ids)."""
    newest = code_history(rt)[-1]
    if newest.migration is not None:
        uid, op, fn, args = newest.migration
        _update_epochs(rt, uid, op, fn, bytes(args) if isinstance(args, list) else args, None)


async def inprocess_update_code(
    rt: Any, ref: str, version: str, migration: tuple[str, str, bytes] | None = None, mode: str = "strict"
) -> dict[str, Any]:
    """A code update at one epoch boundary e.

    ``mode="strict"``: every partition switches to ``ref`` at e, after every transaction that started on the
    old code finished (deferred ones included); ``migration`` (operator, function of the new code, encoded
    args) then runs on every entity of the operator in one epoch of its own, before any client transaction
    sees the new code. ``mode="compatible"`` (no migration): transactions sequenced from e on run the new
    code, while the ones deferred before e (re-run in later epochs) finish on the version they started with,
    kept until none is left (a reply's ``code_version`` says which); nothing waits for them. Durable mode
    records the update (``code.json``) after a checkpoint, so a restart keeps the new code (and the old one
    for the deferred transactions) and completes an interrupted migration. Rolling back is another update."""
    if mode not in ("strict", "compatible"):
        raise ValueError(f"mode must be 'strict' or 'compatible', not {mode!r}")
    if mode == "compatible" and migration is not None:
        raise ValueError("a compatible update has no migration (old and new code run side by side)")
    app = load_app_ref(ref)
    hist = code_history(rt)
    compatible = mode == "compatible"
    async with _alone(rt, drain=not compatible):
        e = rt.epoch
        first_tid: int | None = None
        if compatible:
            if rt.coordinator.previous is not None:  # a third version at once: the oldest one finishes first
                while rt.coordinator.previous is not None and rt.coordinator.deferred:
                    await rt.in_engine(rt.run_epoch, [])
                    retire_previous(rt)
                e = rt.epoch
            c = rt.coordinator
            first_tid = c.sequencer.first_tid()  # every later TID is at least this
        mig = None
        if migration is not None:
            mig = [f"code-{len(hist)}-{version}", migration[0], migration[1], list(migration[2])]
        entry = CodeVersion(e, version, ref, mig, first_tid)
        path = _code_file(rt)
        if path is not None:
            await asyncio.to_thread(rt.node.flush)  # every epoch before e is checkpointed: no replay crosses e
            data = msgspec.json.encode([*hist, entry])
            await asyncio.to_thread(rt.node.durable.fs.write_atomic, path, lambda f: f.write(data))
        kept = len(rt.coordinator.deferred)  # deferred before e: they finish on the old code
        if compatible and first_tid is not None:  # (set above when compatible)
            _set_previous(rt, (first_tid, rt.app))
        hist.append(entry)
        _switch(rt, app)
        if compatible:
            retire_previous(rt)  # nothing deferred: no need to keep the old code
        out = None
        if mig is not None:
            out = await rt.in_engine(_update_epochs, rt, mig[0], mig[1], mig[2], migration[2], None)  # type: ignore[index]
    return {"version": version, "ref": ref, "from_epoch": e, "migration": out, "mode": mode, "kept_deferred": kept}


def _update_outcome(update_id: str, reqs: list[Any], replies: list[Any], epochs: list[int],
                    repeated: bool) -> dict[str, Any]:
    aborted = {r.key: f"{rep.error_type}: {rep.error_message}" for r, rep in zip(reqs, replies, strict=True)
               if rep is not None and not rep.ok}
    seen = sorted({rep.epoch for rep in replies if rep is not None})
    return {"id": update_id, "transactions": len(reqs), "committed": sum(1 for rep in replies if rep and rep.ok),
            "aborted": aborted, "epochs": epochs or seen, "repeated": repeated}


def _paused(rt: Any) -> bool:
    """Whether the next epoch would wait at the gate (paused now, or its pause-after epoch is done)."""
    return rt.gate.paused_for(rt._last_recorded_epoch() + 1)


def refuse_if_paused(rt: Any, what: str) -> None:
    """Raise :class:`GatePaused` when ``rt`` is paused: ``what`` needs epochs to run (before anything of it is
    recorded or logged), and none will until a resume."""
    if _paused(rt):
        raise GatePaused(f"the runtime is paused: {what} needs epochs to run; resume it first (nothing was changed)")


async def _until(rt: Any, pred: Any, what: str, deadline: float, needs_epochs: bool = False) -> None:
    """Wait for ``pred()``; ``needs_epochs``: only epochs make it true, so a pause refuses (GatePaused) at once
    (use only where nothing was recorded yet)."""
    while not await asyncio.to_thread(pred):
        if rt._fatal is not None:
            raise GateClosed(f"the runtime stopped: {rt._fatal}")
        if needs_epochs and await asyncio.to_thread(_paused, rt):
            raise GatePaused(f"the runtime is paused while waiting for {what}; resume it first (nothing was changed)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _spark_alone(rt: Any, deadline: float) -> AsyncIterator[None]:
    """Hold new submissions of a Spark runtime (they wait in the gateway), let the ones under way finish and
    every logged request run; release afterwards. One at a time."""
    lock = getattr(rt, "_admin_lock", None)
    if lock is None:
        lock = rt._admin_lock = asyncio.Lock()
    async with lock:
        hold = rt.__dict__.setdefault("_admin_hold", asyncio.Event())
        hold.clear()
        try:
            await _until(rt, lambda: rt.__dict__.get("_submitting", 0) == 0 and rt._caught_up(),
                         "the accepted requests", deadline, needs_epochs=True)
            yield
        finally:
            hold.set()


def _spark_update_requests(rt: Any, update_id: str, operator: str, function: str, args: bytes,
                           keys: list[str] | None) -> list[Any]:
    from charon.messages import Request

    if keys is None:
        rows = read_durable(rt.durable, rt.config.partitions, operator, rt._last_recorded_epoch(), None, 1 << 62)
        keys = sorted({split_store_key(k)[1] for k in rows})
    marker = f"{ADMIN_PREFIX}{update_id}"
    return [Request(f"{marker}:{k}", operator, k, function, args, time.time()) for k in keys]


async def _spark_update_epochs(rt: Any, update_id: str, operator: str, function: str, args: bytes,
                               keys: list[str] | None, deadline: float) -> dict[str, Any]:
    reqs = await asyncio.to_thread(_spark_update_requests, rt, update_id, operator, function, args, keys)
    known = [rt.get_reply(r.request_id) for r in reqs]
    if any(k is not None for k in known):
        return _update_outcome(update_id, reqs, known, [], repeated=True)
    first = rt._last_recorded_epoch() + 1
    if reqs:
        await asyncio.to_thread(rt.input_log.append_many, reqs)
    await _until(rt, lambda: rt._caught_up() and all(rt.get_reply(r.request_id) is not None for r in reqs),
                 f"update {update_id} to run", deadline)
    epochs = list(range(first, rt._last_recorded_epoch() + 1))
    return _update_outcome(update_id, reqs, [rt.get_reply(r.request_id) for r in reqs], epochs, repeated=False)


async def spark_run_alone(
    rt: Any, update_id: str, operator: str, function: str, args: bytes, keys: list[str] | None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """A serializable admin update on the Spark runtime (see :func:`inprocess_run_alone`).

    New submissions are held (they wait in the gateway, not yet in the log) until the update is done; the
    submissions already under way run to their replies, then the update's requests are appended (request ids
    ``__charon_admin:<id>:<key>``: the log and the output log make them run once) and run by epochs that hold
    nothing else, then submissions continue."""
    deadline = time.monotonic() + timeout
    refuse_if_paused(rt, f"admin update {update_id}")
    async with _spark_alone(rt, deadline):
        return await _spark_update_epochs(rt, update_id, operator, function, args, keys, deadline)


# -- strict code updates on Spark: <checkpoint>/code.json ------------------------------------------------------
def _spark_code_path(ckpt: str) -> str:
    return os.path.join(ckpt, "code.json")


def spark_code_history(rt: Any) -> list[CodeVersion]:
    """The Spark runtime's code versions (the first is the ref it was started with when none is recorded)."""
    hist = rt.__dict__.get("_code_history")
    if hist is None:
        path = _spark_code_path(rt.ckpt)
        if os.path.exists(path):
            with open(path, "rb") as f:
                hist = msgspec.json.decode(f.read(), type=list[CodeVersion])
        else:
            hist = [CodeVersion(0, str(getattr(rt.app, "version", "1")), rt.app_ref)]
        rt._code_history = hist
    return hist


def spark_recorded_code(rt: Any) -> None:
    """At construction: run the newest recorded code version (a code update survives a restart); after a
    compatible one, keep the previous code while the last record holds transactions deferred before it."""
    hist = spark_code_history(rt)
    newest = hist[-1]
    if newest.ref is not None and newest.ref != rt.app_ref:
        rt.app_ref, rt.app = newest.ref, load_app_ref(newest.ref)
    rt._code_previous = None
    if newest.first_tid is not None and len(hist) > 1 and hist[-2].ref is not None:
        rec = rt.read_record(rt._last_recorded_epoch())
        deferred = [] if rec is None else [(tid, None) for tid, _ in rec.deferred]
        rt._code_previous = (newest.first_tid, hist[-2].ref)
        spark_retire_previous(rt, deferred)


def spark_retire_previous(rt: Any, deferred: list[tuple[int, Any]]) -> None:
    """After an epoch (``deferred``: what it left for the next): drop the code a compatible update kept
    once no transaction that started on it is deferred any more (the executors stop loading it)."""
    prev = rt._code_previous
    if prev is not None and not any(tid < prev[0] for tid, _ in deferred):
        rt._code_previous = None
        ex = rt.__dict__.get("exchange")
        if ex is not None:
            ex.set_code(rt.app_ref, None)


def spark_finish_update(rt: Any) -> None:
    """At start, before the query runs: a code update a crash interrupted appends its migration now (before
    any client request can be logged), so it still runs alone; :func:`spark_update_code` marks it done."""
    newest = spark_code_history(rt)[-1]
    if newest.migration is not None and newest.migration[0].endswith("?"):  # pending
        uid, op, fn, args = newest.migration
        reqs = _spark_update_requests(rt, uid[:-1], op, fn, bytes(args), None)
        if reqs and not any(rt.get_reply(r.request_id) is not None for r in reqs):  # it never ran
            rt.input_log.append_many(reqs)


@contextlib.asynccontextmanager
async def _spark_boundary(rt: Any, deadline: float) -> AsyncIterator[None]:
    """Hold a Spark runtime at an epoch boundary (its gate closed, no epoch running, the last one recorded;
    the next batch may be fixed and waits at the gate) without draining anything; reopened afterwards
    unless it was paused before. Call it holding the admin lock."""
    rt.gate.hold()
    try:
        await _until(rt, lambda: rt.gate.wait_paused(rt._last_recorded_epoch, 0.05), "an epoch boundary", deadline)
        yield
    finally:
        rt.gate.release()


async def _spark_update_compatible(rt: Any, ref: str, version: str, deadline: float) -> dict[str, Any]:
    """See :func:`spark_update_code` (``mode="compatible"``)."""
    from charon.runtime.spark.session import ship_app_module

    app = load_app_ref(ref)
    hist = spark_code_history(rt)
    lock = getattr(rt, "_admin_lock", None)
    if lock is None:
        lock = rt._admin_lock = asyncio.Lock()
    async with lock:
        # at most two versions at once: the transactions still deferred on the oldest code finish first
        await _until(rt, lambda: rt._code_previous is None, "the transactions deferred on the oldest code",
                     deadline, needs_epochs=True)
        await asyncio.to_thread(ship_app_module, rt.spark, ref)
        async with _spark_boundary(rt, deadline):
            return await _switch_compatible(rt, ref, app, version, hist)


async def _switch_compatible(rt: Any, ref: str, app: Any, version: str, hist: list[CodeVersion]) -> dict[str, Any]:
    """At the boundary: record the update (the commit point), then run ``ref`` with the old code kept for
    the transactions deferred before it."""
    last = rt._last_recorded_epoch()
    rec = rt.read_record(last) if last >= 0 else None
    e = last + 1
    # every TID from epoch e on is >= it (the recorded counters' own count: the log may have grown since)
    first_tid = Sequencer.restore(rec.counters).first_tid() if rec is not None and rec.counters else 1
    entry = CodeVersion(e, version, ref, None, first_tid)
    data = msgspec.json.encode([*hist, entry])
    await asyncio.to_thread(write_file_atomic, _spark_code_path(rt.ckpt), data)  # the commit point
    hist.append(entry)
    old_ref = rt.app_ref
    kept = sum(1 for tid, _ in (rec.deferred if rec is not None else []) if tid < first_tid)
    rt._code_previous = (first_tid, old_ref) if kept else None
    rt.app_ref, rt.app = ref, app
    ex = rt.__dict__.get("exchange")  # none before the first start (then _start_query builds it)
    if ex is not None:
        ex.set_code(ref, rt._code_previous)
    return {"version": version, "ref": ref, "from_epoch": e, "migration": None, "mode": "compatible",
            "kept_deferred": kept, "first_tid": first_tid}


async def spark_update_code(
    rt: Any, ref: str, version: str, migration: tuple[str, str, bytes] | None = None, mode: str = "strict",
    timeout: float = 600.0,
) -> dict[str, Any]:
    """A code update on the Spark runtime.

    *strict*: with submissions held and everything logged run (so no transaction spans versions), the driver
    and the executors switch to ``ref`` from the next epoch; the migration runs alone, then submissions
    continue. Recorded in ``<checkpoint>/code.json`` first (pending) and again once the migration ran, so a
    restart keeps the new code and finishes the migration.

    *compatible* (no migration): nothing is drained or held. The gate closes at the next epoch boundary e
    (the epoch running finishes and is recorded), the update is recorded in ``code.json`` with the first TID
    of e (every transaction sequenced from e on has at least that TID), and the driver and the executors run
    ``ref`` from e on, while a transaction deferred before e (a lower TID) finishes on the old code, kept
    until no such transaction is left (:func:`spark_retire_previous`; a reply's ``code_version`` says which
    it ran). A restart reads the same from ``code.json`` and the last epoch record. A second compatible
    update first waits for the transactions still deferred on the oldest code: at most two versions run.

    While the runtime is paused: a compatible update applies at once (a paused gate is an epoch boundary)
    unless it must wait for deferred transactions; a strict one applies at once when nothing logged is left to
    run and it has no migration. Otherwise it raises :class:`GatePaused` at once, nothing changed."""
    if mode not in ("strict", "compatible"):
        raise ValueError(f"mode must be 'strict' or 'compatible', not {mode!r}")
    deadline = time.monotonic() + timeout
    if mode == "compatible":
        if migration is not None:
            raise ValueError("a compatible update has no migration (old and new code run side by side)")
        return await _spark_update_compatible(rt, ref, version, deadline)
    app = load_app_ref(ref)
    hist = spark_code_history(rt)
    if migration is not None:  # it runs in epochs of its own after the switch: refuse before recording anything
        refuse_if_paused(rt, "a strict code update's migration")
    async with _spark_alone(rt, deadline):
        if migration is not None:
            refuse_if_paused(rt, "a strict code update's migration")
        e = rt._last_recorded_epoch() + 1
        uid = f"code-{len(hist)}-{version}"
        mig = None if migration is None else [uid + "?", migration[0], migration[1], list(migration[2])]
        entry = CodeVersion(e, version, ref, mig)
        path = _spark_code_path(rt.ckpt)

        def record(entries: list[CodeVersion]) -> None:
            write_file_atomic(path, msgspec.json.encode(entries))

        await asyncio.to_thread(record, [*hist, entry])
        hist.append(entry)
        from charon.runtime.spark.session import ship_app_module

        await asyncio.to_thread(ship_app_module, rt.spark, ref)
        rt.app_ref, rt.app = ref, app
        rt._code_previous = None  # nothing is deferred here: no transaction of an older version is left
        rt.exchange.set_code(ref, None)
        out = None
        if migration is not None:
            out = await _spark_update_epochs(rt, uid, migration[0], migration[1], migration[2], None, deadline)
            entry.migration = [uid, migration[0], migration[1], list(migration[2])]
            await asyncio.to_thread(record, hist)
    return {"version": version, "ref": ref, "from_epoch": e, "migration": out, "mode": "strict"}


def spark_version_at(rt: Any, epoch: int, tid: int | None = None) -> str:
    """The code version epoch ``epoch`` ran (or runs) with; with ``tid``, the one transaction ``tid`` ran."""
    return _label(spark_code_history(rt), epoch, tid)
