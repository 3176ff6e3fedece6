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
import threading
from typing import Any

from charon import serde
from charon.core.routing import entity_prefix, partition_of, split_store_key, store_key
from charon.errors import CharonError
from charon.state.durable import DurableState, DurableStateError
from charon.state.store import MemoryStore

__all__ = ["EpochGate", "GateClosed", "EpochNotRetained", "read_durable", "read_stores", "decode_entities"]


class GateClosed(CharonError):
    """The runtime stopped while an epoch waited at a closed gate (the epoch did not run)."""


class EpochNotRetained(CharonError):
    """The state as of the requested epoch is not available (not reached yet, or compacted away)."""


class EpochGate:
    """Pause/resume at an epoch boundary (thread-safe; the in-process runtime awaits it on its event loop)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paused = False
        self._after: int | None = None
        self._active: int | None = None  # the epoch running now
        self._stopping = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def closed_for(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` must wait."""
        return self._paused or (self._after is not None and epoch > self._after)

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
            if self._after is not None and not self._paused and last_epoch < self._after:
                state = "running"
            return {"state": state, "paused": state == "paused", "pause_requested": self._paused,
                    "pause_after": self._after, "active_epoch": active}

    def wait_paused(self, last_epoch: Any, timeout: float = 60.0) -> bool:
        """Block until no epoch runs and the next one would wait (``last_epoch``: a callable)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._active is None and self.closed_for(last_epoch() + 1), timeout)


def decode_entities(rows: dict[bytes, bytes], operator: str) -> dict[str, dict[str, Any]]:
    """``{key: {"value": v, "items": {name: v}}}`` of ``operator`` from store rows (other operators ignored)."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in rows.items():
        op, key, item = split_store_key(k)
        if op != operator:
            continue
        ent = out.setdefault(key, {"value": None, "items": {}})
        if item == "":
            ent["value"] = serde.decode(v)
        else:
            ent["items"][item.lstrip("\x01")] = serde.decode(v)
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
    backlog = len(rt._queue) + len(rt.coordinator.deferred) + sum(len(b) for b, _ in rt._parked)
    return {**rt.gate.status(last), "epoch": last, "backlog": backlog, "logged_waiting": len(rt._parked),
            "engine": "inprocess", "durable": rt.durable, "retained_from": retained[0] if retained else last,
            "retained_epochs": retained + [last]}


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


def spark_status(rt: Any) -> dict[str, Any]:
    """Pause state, the last recorded epoch and the backlog (log entries after it) of a Spark runtime."""
    last = rt._last_recorded_epoch()
    rec = rt.read_record(last) if last >= 0 else None
    ends = rt.input_log.end_offsets()
    done = rec.ends if rec is not None else rt.input_log.start_offsets()
    backlog = sum(max(0, e - d) for e, d in zip(ends, done, strict=True))
    return {**rt.gate.status(last), "epoch": last, "backlog": backlog, "engine": "spark", "durable": True,
            "retained_from": _retained_from(rt.durable, rt.config.partitions)}


def spark_inspect(
    rt: Any, operator: str, keys: list[str] | None, epoch: int | None, limit: int
) -> tuple[int, dict[bytes, bytes]]:
    """Rows of ``operator`` as of ``epoch`` (default: the last recorded one, after the newest reply's) from the
    durable copy, on the driver (no Spark job: it never waits for the running query)."""
    last = rt._settled_epoch()
    if epoch is None:
        epoch = last
    if epoch > last or epoch < -1:
        raise EpochNotRetained(f"epoch {epoch} is not recorded (the last recorded epoch is {last})")
    return epoch, read_durable(rt.durable, rt.config.partitions, operator, epoch, keys, limit)


# -- serializable admin updates (in-process runtime) ----------------------------------------------------------
ADMIN_PREFIX = "__charon_admin:"  # request ids of admin updates (the gateway reserves __charon* for runtimes)


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
    import time

    from charon.messages import Request

    lock = getattr(rt, "_admin_lock", None)
    if lock is None:
        lock = rt._admin_lock = asyncio.Lock()
    async with lock:
        marker = f"{ADMIN_PREFIX}{update_id}"
        history: dict[str, dict[str, Any]] = rt.__dict__.setdefault("_admin_done", {})
        if update_id in history:
            return {**history[update_id], "repeated": True}
        was_paused = rt.gate._paused
        rt.gate.pause()
        try:
            while rt.gate._active is not None:  # the running epoch finishes first
                await asyncio.sleep(0.001)
            rt._run_parked()  # epochs logged while paused come first
            rt.drain()  # transactions deferred before the update run without it
            if keys is None:
                keys = sorted({split_store_key(k)[1] for k in read_stores(rt.stores, operator, None, 1 << 62)})
            reqs = [Request(f"{marker}:{k}", operator, k, function, args, time.time()) for k in keys]
            known = [rt.get_reply(r.request_id) for r in reqs]
            if any(k is not None for k in known):  # it ran before a restart: its epoch ran all of them
                return _update_outcome(update_id, reqs, known, [], repeated=True)
            result = rt.run_epoch(reqs)
            epochs = [result.epoch] + [r.epoch for r in rt.drain()]
        finally:
            if not was_paused:
                rt.gate.resume()
        out = _update_outcome(update_id, reqs, [rt.get_reply(r.request_id) for r in reqs], epochs, repeated=False)
        history[update_id] = out
        while len(history) > 1000:
            history.pop(next(iter(history)))
        return out


def _update_outcome(update_id: str, reqs: list[Any], replies: list[Any], epochs: list[int],
                    repeated: bool) -> dict[str, Any]:
    aborted = {r.key: f"{rep.error_type}: {rep.error_message}" for r, rep in zip(reqs, replies, strict=True)
               if rep is not None and not rep.ok}
    seen = sorted({rep.epoch for rep in replies if rep is not None})
    return {"id": update_id, "transactions": len(reqs), "committed": sum(1 for rep in replies if rep and rep.ok),
            "aborted": aborted, "epochs": epochs or seen, "repeated": repeated}
