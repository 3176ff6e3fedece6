"""The in-process runtime: the same deterministic core with an in-memory exchange.

It is the test harness application authors write their tests with (full transactional semantics) and a
low-latency single-node engine. Epochs close when ``epoch_max_txns`` requests are waiting or
``epoch_max_ms`` after the first one arrived (durable mode: as soon as the previous epoch is done; requests
arriving while an epoch's batch is being committed to the log form the next batch).

Without ``data_dir`` it is *volatile*: state, replies and request ids live in memory only. With
``data_dir`` it is *durable* (:mod:`charon.runtime.node`): every epoch's batch is in the SQLite input log before the
epoch runs, state and replies are checkpointed in the background, and a restart (clean or after SIGKILL)
recovers by replaying the log; a request id runs once across restarts and a retry gets the first reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from charon import serde
from charon.core.epoch import EpochCoordinator, EpochResult
from charon.core.partition import MAX_INVOCATIONS, Control, Invoke, PartitionUnit, RoundOutput
from charon.core.partition import Reply as ReplyMsg
from charon.core.routing import check_stream, entity_prefix, partition_of, store_key
from charon.log.streams import DEFAULT_RETAIN_EVENTS, StreamEvent, StreamLog
from charon.messages import Reply, Request
from charon.operator import Application, Operator, batch_request
from charon.state.store import MemoryStore

if TYPE_CHECKING:
    from charon.runtime.node import NodeStorage


class LocalExchange:
    """Delivers a round's inboxes to in-memory partition units, one after the other."""

    def __init__(self, units: list[PartitionUnit]) -> None:
        self.units = units
        self.partitions = len(units)

    def round(self, control: Control, inboxes: list[list[Invoke | ReplyMsg]]) -> list[RoundOutput]:
        return [u.step(control, box) for u, box in zip(self.units, inboxes, strict=True)]


class InProcessRuntime:
    """Run an :class:`~charon.operator.Application` in this process."""

    def __init__(
        self,
        app: Application,
        partitions: int = 4,
        epoch_max_txns: int = 1000,
        epoch_max_ms: float = 1.0,
        max_invocations: int = MAX_INVOCATIONS,
        reply_retention: int | None = None,
        *,
        data_dir: str | None = None,
        fsync: bool = True,
        checkpoint_s: float = 0.5,
        compact_every: int = 20,
        stats_kept: int = 1000,
        log_url: str | None = None,
        retain_events: int = DEFAULT_RETAIN_EVENTS,
    ) -> None:
        """``reply_retention``: replies kept in memory for retries (default 100,000; durable mode: 10,000, a
        cache in front of the output log, which keeps replies for ``CHARON_DEDUP_WINDOW_S``, default 7 days).
        ``data_dir``: durable mode (see
        :mod:`charon.runtime.node` for ``fsync``, ``checkpoint_s`` and ``compact_every``; ``log_url`` puts its logs
        on NATS, see :mod:`charon.log.nats`). ``stats_kept``: how many
        recent epochs ``epoch_stats`` keeps. ``retain_events``: events kept per output stream
        (:class:`charon.log.streams.StreamLog`; durable mode: ``data_dir/streams.sqlite``, volatile: a temporary
        file removed with the runtime)."""
        self.app = app
        self.partitions = partitions
        self.epoch_max_txns = epoch_max_txns
        self.epoch_max_ms = epoch_max_ms
        self.node: NodeStorage | None = None
        if data_dir is not None:
            from charon.runtime.node import NodeStorage, RecordingStore

            self.node = NodeStorage(data_dir, partitions, fsync=fsync, checkpoint_s=checkpoint_s,
                                    compact_every=compact_every, log_url=log_url)
            self.stores: list[MemoryStore] = [RecordingStore() for _ in range(partitions)]
        else:
            self.stores = [MemoryStore() for _ in range(partitions)]
        self.units = [PartitionUnit(p, partitions, app, s) for p, s in enumerate(self.stores)]
        self.coordinator = EpochCoordinator(
            app, LocalExchange(self.units), sequencers=1, max_invocations=max_invocations,
            on_replies=self._deliver
        )
        self.epoch = 0
        self.epoch_stats: list[dict[str, float]] = []
        self._stats_kept = stats_kept
        self._retain_events = retain_events
        self._streams: StreamLog | None = None
        self._log_end = 0
        self._base_dirty = False
        self.replayed_epochs = 0  # durable mode: epochs replayed from the input log at recovery
        self.failed: BaseException | None = None  # set when an epoch could not be logged or run
        self._queue: list[Request] = []
        self._futures: dict[str, asyncio.Future[Reply]] = {}
        self._replies: OrderedDict[str, Reply] = OrderedDict()
        self._retention = reply_retention or (100_000 if data_dir is None else 10_000)
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        if self.node is not None:
            try:
                self._recover()
            except BaseException:
                self.node.close()
                raise

    @property
    def input_log(self) -> Any:
        """Durable mode: the input log (the gateway checks reused request ids and pending requests in it)."""
        return self.node.input_log if self.node is not None else None

    @property
    def durable(self) -> bool:
        """Whether this runtime keeps its state, replies and request ids across restarts."""
        return self.node is not None

    def _recover(self) -> None:
        """Durable mode: state as of the last checkpoint, then the logged epochs after it, replayed."""
        assert self.node is not None
        states, rec, epochs = self.node.recover()
        for store, state in zip(self.stores, states, strict=True):
            store.data.update(state)
            store.epoch = rec.epoch if rec is not None else -1
        if rec is not None:
            self.epoch = rec.epoch + 1
            self._log_end = rec.log_end
            self.coordinator.sequencer.counters = list(rec.counters)
            self.coordinator.deferred = [(tid, serde.decode_request(b)) for tid, b in rec.deferred]
        for epoch, requests in epochs:
            if epoch != self.epoch:
                raise RuntimeError(f"replay: epoch {epoch} logged where {self.epoch} was expected")
            self._log_end += len(requests) + 1
            self._run_logged(requests)
        self.replayed_epochs = len(epochs)

    def close(self) -> None:
        """Durable mode: checkpoint everything and release the data directory (volatile: nothing)."""
        if self.node is not None:
            self._write_base()
            self.node.close()
        if self._streams is not None:
            self._streams.close()

    # -- output streams -----------------------------------------------------------------------------
    @property
    def streams(self) -> StreamLog:
        """The output streams ``ctx.emit`` appends to (one atom per epoch and stream; see charon.log.streams)."""
        with _STREAMS_LOCK:  # created once, also when the gateway's read threads ask first
            return self._open_streams()

    def _open_streams(self) -> StreamLog:
        if self._streams is None:
            if self.node is not None:
                path = os.path.join(self.node.data_dir, "streams.sqlite")
                self._streams = StreamLog(path, durable=self.node.fsync, retain_events=self._retain_events)
            else:
                tmp = tempfile.mkdtemp(prefix="charon-streams-")
                self._streams = StreamLog(os.path.join(tmp, "streams.sqlite"), durable=False,
                                          retain_events=self._retain_events)
                weakref.finalize(self, _remove_volatile, self._streams, tmp)
        return self._streams

    async def subscribe(
        self, stream: str, from_offset: int = 0, *, max_events: int = 1000, poll_s: float = 0.005,
    ) -> AsyncIterator[StreamEvent]:
        """Events of ``stream`` from ``from_offset`` on, as they commit (whole atoms at a time; endless).

        Resume after a restart by passing the offset after the last event processed."""
        check_stream(stream)
        offset = from_offset
        log = self.streams
        while True:
            r = log.read(stream, offset, max_events)
            for ev in r.events:
                yield ev
            offset = r.next_offset
            if not r.events:
                await asyncio.sleep(poll_s)

    def _write_base(self) -> None:
        if self._base_dirty and self.node is not None:
            self.node.write_bases(self.stores)
            self._base_dirty = False

    # -- state --------------------------------------------------------------------------------------
    def _store_of(self, operator: str, key: str) -> MemoryStore:
        return self.stores[partition_of(operator, key, self.partitions)]

    def load(self, operator: str | Operator, values: dict[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Bulk-load entity values (before or between epochs)."""
        op = operator.name if isinstance(operator, Operator) else operator
        self._check_loadable()
        items = values.items() if isinstance(values, dict) else values
        for key, value in items:
            self._store_of(op, key).data[store_key(op, key)] = serde.encode(value)

    def load_items(self, operator: str | Operator, key: str, items: dict[str, Any]) -> None:
        """Bulk-load named items of one entity."""
        op = operator.name if isinstance(operator, Operator) else operator
        self._check_loadable()
        data = self._store_of(op, key).data
        for name, value in items.items():
            data[store_key(op, key, "\x01" + name)] = serde.encode(value)

    def _check_loadable(self) -> None:
        if self.node is not None:
            if self.epoch > 0 or not self.node.is_fresh():
                raise RuntimeError("bulk load is only possible into a fresh data directory, before epoch 0")
            self._base_dirty = True

    def read_state(self, operator: str | Operator, key: str, default: Any = None) -> Any:
        """An entity's committed value (consistent: read between epochs)."""
        op = operator.name if isinstance(operator, Operator) else operator
        raw = self._store_of(op, key).get(store_key(op, key))
        return default if raw is None else serde.decode(raw)

    def read_items(self, operator: str | Operator, key: str) -> dict[str, Any]:
        """An entity's committed named items."""
        op = operator.name if isinstance(operator, Operator) else operator
        prefix = entity_prefix(op, key) + b"\x01"
        return {k[len(prefix):].decode(): serde.decode(v) for k, v in self._store_of(op, key).scan(prefix)}

    def entities(self, operator: str | Operator) -> dict[str, Any]:
        """All committed main values of one operator (for checks in tests and benchmarks)."""
        op = operator.name if isinstance(operator, Operator) else operator
        out = {}
        for s in self.stores:
            for k, v in s.scan(f"{op}\0".encode()):
                o, key, item = k.decode().split("\0", 2)
                if item == "":
                    out[key] = serde.decode(v)
        return out

    def snapshot(self) -> dict[bytes, bytes]:
        """All committed state as store keys (sorted)."""
        merged: dict[bytes, bytes] = {}
        for s in self.stores:
            merged.update(s.items())
        return dict(sorted(merged.items()))

    def state_digest(self) -> str:
        """SHA-256 over all committed state: equal digests mean byte-identical state."""
        h = hashlib.sha256()
        for k, v in self.snapshot().items():
            h.update(len(k).to_bytes(4, "big") + k + len(v).to_bytes(4, "big") + v)
        return h.hexdigest()

    # -- synchronous batch mode (deterministic epoch boundaries) -----------------------------------
    def run_epoch(self, requests: list[Request]) -> EpochResult:
        """Run the given requests as exactly one epoch (plus transactions deferred into it)."""
        if self.node is not None:
            self._write_base()
            requests, self._log_end = self.node.log_epoch(self.epoch, requests)
        return self._run_logged(requests)

    def _run_logged(self, requests: list[Request]) -> EpochResult:
        """Run one epoch whose batch is logged (durable mode) or needs no log (volatile)."""
        result = self.coordinator.run_epoch(self.epoch, [(0, r) for r in requests])
        if result.events:  # idempotent by epoch: a replayed epoch appends nothing again
            self.streams.append_atom(self.epoch, [(s, v) for _, s, v in result.events])
        if self.node is not None:
            c = self.coordinator
            self.node.epoch_done(self.epoch, c.sequencer.counters, c.deferred, self._log_end,
                                 self.stores)  # type: ignore[arg-type]
        self.epoch += 1
        stats = self.epoch_stats
        stats.append({"epoch": result.epoch, **result.stats})
        if len(stats) > self._stats_kept:
            del stats[: len(stats) - self._stats_kept]
        return result

    def drain(self) -> list[EpochResult]:
        """Run empty epochs until no deferred transaction is left."""
        out = []
        while self.coordinator.deferred:
            out.append(self.run_epoch([]))
        return out

    # -- asynchronous service mode -----------------------------------------------------------------
    async def start(self) -> None:
        """Start closing epochs in the background of the running event loop."""
        if self._task is None:
            if self.node is not None:
                self._write_base()
                self.node.start_writer()
            self._stopping = False
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _halt(self, exc: BaseException) -> None:
        """An epoch could not be logged or run: fail every waiting request and accept no more.

        Durable mode: a request whose batch reached the log gets its real reply after a restart (replay)."""
        self.failed = exc
        if self.node is not None and self.node.error is None:
            self.node.error = exc
        self._queue.clear()
        futures, self._futures = self._futures, {}
        for f in futures.values():
            if not f.done():
                f.set_exception(RuntimeError(f"the runtime stopped: {type(exc).__name__}: {exc}"))

    def health(self) -> dict[str, Any]:
        """What ``GET /health`` reports: ``ok`` only while epochs run (not before start, after stop, or once
        an epoch or the durable writer failed); ``status``, the current epoch and the last error."""
        error = self.failed or (self.node.error if self.node is not None else None)
        if error is not None:
            status = "failed"
        elif self._task is None:
            status = "stopped"
        elif self._task.done():
            status = "failed"
            if not self._task.cancelled() and self._task.exception() is not None:
                error = self._task.exception()
        else:
            status = "ok"
        return {
            "status": status, "ok": status == "ok", "epoch": self.epoch - 1, "durable": self.durable,
            "last_error": f"{type(error).__name__}: {error}" if error is not None else None,
        }

    async def stop(self) -> None:
        """Finish waiting work and stop."""
        if self._task is not None:
            while (self._queue or self.coordinator.deferred or self._futures) and self.failed is None:
                await asyncio.sleep(0.001)
            self._stopping = True
            assert self._wake is not None
            self._wake.set()
            await self._task
            self._task = None
        if self.node is not None and self.failed is None:
            await asyncio.to_thread(self.node.flush)

    async def __aenter__(self) -> InProcessRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _deliver(self, replies: list[Reply]) -> None:
        if self.node is not None:
            self.node.add_replies(replies)
        for r in replies:
            self._replies[r.request_id] = r
            fut = self._futures.pop(r.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(r)
        while len(self._replies) > self._retention:
            self._replies.popitem(last=False)

    def get_reply(self, request_id: str) -> Reply | None:
        """The reply of a request, if it has been answered."""
        rep = self._replies.get(request_id)
        if rep is None and self.node is not None:
            known = self.node.known(request_id)
            if isinstance(known, Reply):
                return known
        return rep

    def enqueue(self, request: Request) -> asyncio.Future[Reply]:
        """Queue a request; the future resolves with its reply. A known request_id is not run twice."""
        loop = asyncio.get_running_loop()
        rid = request.request_id
        if self.failed is not None:
            raise RuntimeError(f"the runtime stopped: {type(self.failed).__name__}: {self.failed}")
        done = self._replies.get(rid)
        fut = self._futures.get(rid)
        if done is None and fut is None and self.node is not None:
            self.node.raise_if_failed()
            if rid.startswith("\x00"):
                raise ValueError("request ids starting with NUL are reserved")
            known = self.node.known(rid)
            if isinstance(known, Reply):
                done = known
            elif known:  # logged before a restart and not answered yet (deferred): its reply will come
                fut = self._futures[rid] = loop.create_future()
                return fut
        if done is not None or fut is not None:
            if fut is None:
                fut = loop.create_future()
                fut.set_result(done)
            return fut
        fut = self._futures[rid] = loop.create_future()
        self._queue.append(request)
        if self._wake is not None:
            self._wake.set()
        return fut

    async def submit(
        self, operator: str, key: str, function: str, args: list | tuple = (), *, request_id: str | None = None
    ) -> Reply:
        """Invoke ``operator/key.function(*args)`` as one transaction and wait for its reply."""
        if self._task is None:
            raise RuntimeError("the runtime is not started: use `async with runtime:` or `await runtime.start()`")
        req = Request(request_id or uuid.uuid4().hex, operator, key, function, serde.encode(list(args)), time.time())
        return await asyncio.shield(self.enqueue(req))

    async def submit_batch(self, calls: Iterable[Any], *, batch_id: str | None = None) -> Reply:
        """Run ``calls`` (``[operator, key, function, [args...]]`` each) as one client atomic batch: one
        transaction calling them in order, so all commit or none; the reply's value lists their values.
        ``batch_id`` is its request id (and entity key): a batch runs once per id."""
        op, fn, args = batch_request(calls)
        bid = batch_id or uuid.uuid4().hex
        return await self.submit(op, bid, fn, args, request_id=bid)

    async def invoke(self, operator: str | Operator, key: str, function: Any, *args: Any) -> Any:
        """Like :meth:`submit` but returns the value, or raises TransactionAborted / the engine's error."""
        from charon.client_errors import raise_for_reply

        op = operator.name if isinstance(operator, Operator) else operator
        fn = getattr(function, "name", function)
        return raise_for_reply(await self.submit(op, key, fn, list(args)))

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue and not self.coordinator.deferred:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            # durable mode: the previous batch's log commit is the batching window; no extra wait
            if self.node is None and len(self._queue) < self.epoch_max_txns and self.epoch_max_ms > 0:
                await asyncio.sleep(self.epoch_max_ms / 1000.0)
            batch = self._queue[: self.epoch_max_txns]
            del self._queue[: len(batch)]
            try:
                if self.node is None:
                    self.run_epoch(batch)
                else:  # the batch is committed to the input log off the loop, then the epoch runs
                    batch, self._log_end = await asyncio.to_thread(self.node.log_epoch, self.epoch, batch)
                    self._run_logged(batch)
            except Exception as exc:  # noqa: BLE001 - the runtime stops loudly instead of hanging its clients
                self._halt(exc)
                return
            await asyncio.sleep(0)


_STREAMS_LOCK = threading.Lock()


def _remove_volatile(log: StreamLog, tmp: str) -> None:
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
