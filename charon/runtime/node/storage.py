"""Durable single-node storage for the in-process engine: input log, output log, durable state, records.

One owner for what makes ``InProcessRuntime(app, data_dir=...)`` durable (the Spark runtime's pieces, reused):

* **Epoch boundaries before the epoch runs.** An epoch's requests are appended to the SQLite input log
  (:class:`charon.log.sqlite.InputLog`, one partition) together with a marker entry naming the epoch, in one
  transaction: one commit (one fsync with ``fsync=True``) per epoch, however many requests it has (group
  commit). An epoch never runs before its batch is durable, so its TIDs and results are reproducible, and
  replies may go out early (while the epoch still runs).
* **Checkpoints in the background.** A writer thread takes the finished epochs, stores their replies in the
  output log (:class:`charon.log.sqlite.OutputLog`, once per request id), writes each partition's merged writes as
  one delta of the durable copy (:class:`charon.state.durable.DurableState`: Arrow base + deltas), then an epoch
  record (sequencer counters, deferred transactions, input-log position) that commits the checkpoint.
  Every ``compact_every`` checkpoints it compacts the deltas and truncates the input log before the record.
* **Recovery** loads the state as of the newest record, drops partition deltas written after it, and
  replays the input log's epochs after it (same boundaries, same TIDs, same replies); replies the output
  log already has are not stored again.

**Object storage** (``storage_url``, ``charon run --storage s3://bucket/prefix``): the layout, the code history,
the epoch records, the partitions' snapshot files and the verdicts (each before it takes effect) are also written
there (:mod:`charon.storage`), and the effects store, streams and stream offsets per checkpoint
(:mod:`charon.runtime.sidefiles`); the data
directory becoming a cache: a node started on an empty directory with the same location (and the same networked
log, ``log_url``) takes them back and resumes where the lost machine's last checkpoint stopped, replaying the log
after it. Records are created once (``If-None-Match``) and manifests replaced only over the version this node
knows (``If-Match``), so a node that lost its place to another one fails instead of overwriting it.

``fsync=True``: an acknowledged reply survives a power loss or OS crash (its epoch's input is fsynced
before the epoch runs). ``fsync=False``: it survives the process being killed (SIGKILL), not an OS crash;
nothing waits for the disk. A data directory is used by one process at a time (an exclusive ``flock``), and
its layout (partition count) is fixed when it is created.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from charon import serde
from charon.errors import EngineUnavailable
from charon.log.location import open_input_log, open_output_log
from charon.log.sqlite import DedupRetention
from charon.messages import Reply, Request
from charon.runtime.faults import crash_point
from charon.runtime.guard.verdicts import FILE as VERDICTS_FILE
from charon.runtime.sidefiles import SideFiles
from charon.state.durable import DurableState
from charon.state.records import EpochRecord, encode_record, read_record
from charon.state.store import MemoryStore
from charon.storage.contract import ObjectNotFound, ObjectStore, StorageConflict, StorageDenied
from charon.storage.files import write_file_atomic
from charon.storage.location import open_storage
from charon.storage.metered import Metered, StorageMeter
from charon.storage.prefix import Prefixed, delete_prefix

T = TypeVar("T")

_outage = logging.getLogger("charon.engine")  # outages and recoveries, in the server log
EPOCH_MARK = "\x00epoch"  # operator of the marker entry that closes an epoch's batch in the input log
_RECORDS_KEPT = 2
#: seconds the object-store client retries one request: the node's writes are waited out by :meth:`_retry_log`
#: beyond that, which reports the outage (``/health``: ``log_wait``) from then on
STORAGE_RETRY_S = 3.0


class NodeError(Exception):
    """The data directory cannot be used (in use by another process, other layout, not fresh, failed)."""


class RecordingStore(MemoryStore):
    """A :class:`MemoryStore` that also keeps each committed epoch's delta until the writer takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[dict[bytes, bytes | None]] = []

    def commit(self, epoch: int, delta: dict[bytes, bytes | None]) -> None:
        if epoch <= self.epoch:
            return
        super().commit(epoch, delta)
        if delta:
            self.pending.append(dict(delta))

    def take(self) -> list[dict[bytes, bytes | None]]:
        out, self.pending = self.pending, []
        return out


@dataclass
class _Finished:
    """One finished epoch, waiting to be checkpointed."""

    epoch: int
    counters: list[int]
    deferred: list[tuple[int, Request]]
    log_end: int
    deltas: list[list[dict[bytes, bytes | None]]]
    replies: list[Reply] = field(default_factory=list)
    time: float = 0.0
    next_due: float = -math.inf
    admission: bytes = b""


class NodeStorage:
    """The durable side of one in-process node under ``data_dir`` (see the module docstring)."""

    def __init__(
        self, data_dir: str, partitions: int, *, fsync: bool = True, checkpoint_s: float = 0.5,
        compact_every: int = 20, dedup_window_s: float | None = None, log_url: str | None = None,
        storage_url: str | None = None,
    ) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.log_url = log_url  # nats://host:port/deployment: the input/output logs on NATS (one node per URL)
        self.partitions = partitions
        self.fsync = fsync
        self.checkpoint_s = checkpoint_s
        self.compact_every = compact_every
        os.makedirs(self.data_dir, exist_ok=True)
        if os.path.isdir(os.path.join(self.data_dir, "checkpoint")):
            raise NodeError(f"{self.data_dir} holds a Spark deployment; use another --data-dir")
        self._lock_fd = os.open(os.path.join(self.data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise NodeError(f"{self.data_dir} is in use by another process") from None
        try:
            #: requests and bytes to object storage (None without it): metrics, the storage benchmark
            self.meter: StorageMeter | None = StorageMeter() if storage_url else None
            self.remote: ObjectStore | None = (
                Metered(open_storage(storage_url, fsync=fsync, meter=self.meter, retry_s=STORAGE_RETRY_S), self.meter)
                if storage_url else None)
            for name in ("node.json", "code.json"):
                self._hydrate_file(name)
            self._verdicts_etag: str | None = None  # the version of verdicts.jsonl this node wrote or read
            self._hydrate_verdicts()
            #: the effects store, output streams and stream offsets, shipped per checkpoint (object storage only)
            self.side = SideFiles(self.data_dir, self.remote) if self.remote is not None else None
            if self.side is not None:
                self.side.restore()
            state_dir = self._check_layout()
            in_loc = log_url or os.path.join(self.data_dir, "input.sqlite")
            self.input_log = open_input_log(in_loc, 1, durable=fsync)
            self.output_log = open_output_log(log_url or os.path.join(self.data_dir, "output.sqlite"), durable=fsync)
            self.durable = self._open_state(state_dir)
            os.makedirs(self._records_dir, exist_ok=True)
            self._hydrate_records()
            # request ids and replies older than the window are forgotten (CHARON_DEDUP_WINDOW_S, default 7 days)
            window = dedup_window_s if dedup_window_s is not None else float(
                os.environ.get("CHARON_DEDUP_WINDOW_S", 7 * 24 * 3600))
            self.retention = DedupRetention(self.input_log, self.output_log, window, EPOCH_MARK)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._cv = threading.Condition()
        self._finished: list[_Finished] = []
        self._epoch_replies: list[Reply] = []
        self._unflushed: dict[str, Reply] = {}
        self._flushing = 0  # epochs handed to the writer and not yet checkpointed
        self._writer: threading.Thread | None = None
        self._stop = False
        self._force = False
        self._last_checkpoint = time.monotonic()  # the first checkpoint comes checkpoint_s after the start
        self._checkpoints = 0
        self.error: BaseException | None = None
        #: while a log operation waits for the log to come back (an outage): what waits, since when
        #: (``time.monotonic()``), and the last error; None while the log answers (``health`` reports it)
        self.log_wait: tuple[str, float, str] | None = None
        self.checkpointed_epoch = self._newest_record_epoch()
        if self.remote is not None and log_url is None and self.checkpointed_epoch >= 0:
            rec = self.read_record(self.checkpointed_epoch)
            if rec is not None and rec.log_end > self.input_log.end_offsets()[0]:
                self.close()
                raise NodeError(f"{self.data_dir}: the checkpoint in {self.remote.url} is at input-log offset "
                                f"{rec.log_end}, past this directory's SQLite log (it was lost with its machine): "
                                "start with the deployment's old data directory, or use a networked log (--log)")

    # -- object storage ------------------------------------------------------------------------------
    def _open_state(self, name: str) -> DurableState:
        remote = Prefixed(self.remote, name) if self.remote is not None else None
        durable = DurableState(os.path.join(self.data_dir, name), fsync=self.fsync, remote=remote)
        if remote is not None:
            for pid in range(self.partitions):
                durable.hydrate(pid)
        return durable

    def _hydrate_file(self, name: str) -> None:
        """A file of the data directory the remote has and the directory lacks: downloaded."""
        path = os.path.join(self.data_dir, name)
        if self.remote is not None and not os.path.exists(path):
            with contextlib.suppress(ObjectNotFound):
                self.remote.get_file(name, path)

    def _hydrate_records(self) -> None:
        if self.remote is None:
            return
        have = set(self._record_epochs())
        names = [o.key for o in self.remote.list("epochs/") if o.key.endswith(".msgpack")]
        for key in names[-_RECORDS_KEPT:]:
            if int(key.split("/")[-1].split(".")[0]) not in have:
                self.remote.get_file(key, os.path.join(self.data_dir, key))

    def _hydrate_verdicts(self) -> None:
        """The verdicts on object storage are the truth: taken into the directory (over a cached copy, whose lines
        past the stored ones were never relied on: a verdict is effective only once stored), or, when the store has
        none, the directory's uploaded (a data directory moving onto object storage)."""
        if self.remote is None:
            return
        path = os.path.join(self.data_dir, VERDICTS_FILE)
        try:
            data, self._verdicts_etag = self.remote.get(VERDICTS_FILE)
        except ObjectNotFound:
            if os.path.exists(path):
                with open(path, "rb") as f:
                    self._verdicts_etag = self.remote.put(VERDICTS_FILE, f.read(), if_absent=True)
            return
        write_file_atomic(path, data)

    def ship_verdicts(self, path: str) -> None:
        """After a verdict's line is appended (and fsynced) to ``path``: the file replaces the stored one, over the
        version this node knows (``If-Match``; created with ``If-None-Match`` the first time), before the verdict
        takes effect (:class:`~charon.runtime.guard.verdicts.VerdictBook` calls this before it returns). An outage
        is waited out (nothing depends on the verdict meanwhile); a node that lost its place gets
        :class:`~charon.storage.contract.StorageConflict` instead of overwriting the newer node's verdicts."""
        remote = self.remote
        if remote is None:
            return
        with open(path, "rb") as f:
            data = f.read()

        def put() -> str:
            etag = self._verdicts_etag
            try:
                return remote.put(VERDICTS_FILE, data, if_absent=etag is None, if_match=etag)
            except StorageConflict:  # an attempt that reached the store before its answer was lost: it is ours
                have, tag = remote.get(VERDICTS_FILE)
                if have != data:
                    raise
                return tag

        self._verdicts_etag = self._retry_log(put, "storing a verdict")

    def write_file(self, path: str, data: bytes) -> None:
        """Replace a file of the data directory (e.g. the code history), on object storage too."""
        write_file_atomic(path, data)
        if self.remote is not None:
            self.remote.put(os.path.relpath(path, self.data_dir).replace(os.sep, "/"), data)

    # -- layout, lock, records -----------------------------------------------------------------------
    def _check_layout(self) -> str:
        """The layout (``node.json``): partition count and state directory. A directory created with another
        partition count opens with its own (``self.partitions``); the runtime then rescales it. Returns the
        state directory's name; state directories of an interrupted rescale are removed."""
        path = os.path.join(self.data_dir, "node.json")
        try:
            with open(path) as f:
                have = json.load(f)
        except FileNotFoundError:
            have = {"engine": "inprocess", "partitions": self.partitions, "version": 1}
            self._write_layout(have)
        self.partitions = int(have["partitions"])
        state = have.get("state", "state")
        for name in os.listdir(self.data_dir):  # leftovers of a rescale that did not reach its commit point
            if name.startswith("state") and name != state and os.path.isdir(os.path.join(self.data_dir, name)):
                shutil.rmtree(os.path.join(self.data_dir, name), ignore_errors=True)
        return state

    def _write_layout(self, layout: dict) -> None:
        self.write_file(os.path.join(self.data_dir, "node.json"), json.dumps(layout).encode())

    def relayout(self, partitions: int, parts: list[list[tuple[bytes, bytes]]], epoch: int) -> None:
        """Rescale: install ``parts`` (each new partition's sorted items, the state as of ``epoch``, which the
        newest record must be) as the bases of a new state directory, then switch ``node.json`` to it (the
        commit point: a crash before it leaves the old layout, whose leftovers the next open removes)."""
        self.flush()
        if epoch != self.checkpointed_epoch:
            raise NodeError(f"rescale at epoch {epoch}, but the last checkpoint is epoch {self.checkpointed_epoch}")
        old_root = self.durable.root
        name = f"state-{uuid.uuid4().hex[:12]}"
        old_name = os.path.basename(old_root)
        self.partitions, old_partitions = partitions, self.partitions
        try:
            new = self._open_state(name)
        finally:
            self.partitions = old_partitions
        for pid, items in enumerate(parts):
            new.write_base(pid, epoch, items)
        crash_point("node:relayout", epoch)  # the new state is written, the layout not switched
        self._write_layout({"engine": "inprocess", "partitions": partitions, "version": 1, "state": name})
        self.durable, self.partitions = new, partitions
        shutil.rmtree(old_root, ignore_errors=True)
        if self.remote is not None:
            delete_prefix(self.remote, old_name + "/")

    @property
    def _records_dir(self) -> str:
        return os.path.join(self.data_dir, "epochs")

    def _record_path(self, epoch: int) -> str:
        return os.path.join(self._records_dir, f"{epoch:012d}.msgpack")

    def _record_epochs(self) -> list[int]:
        return sorted(int(n.split(".")[0]) for n in os.listdir(self._records_dir) if n.endswith(".msgpack"))

    def _newest_record_epoch(self) -> int:
        return max(self._record_epochs(), default=-1)

    def read_record(self, epoch: int) -> EpochRecord | None:
        return read_record(self._record_path(epoch))

    def _write_record(self, rec: EpochRecord) -> None:
        data = encode_record(rec)
        if self.remote is not None:  # created once: a node that lost its place cannot write over another's
            key = f"epochs/{rec.epoch:012d}.msgpack"
            try:
                self.remote.put(key, data, if_absent=True)
            except StorageConflict:
                if self.remote.get(key)[0] != data:
                    raise
        self.durable.fs.write_atomic(self._record_path(rec.epoch), lambda f: f.write(data))

    # -- recovery ------------------------------------------------------------------------------------
    def is_fresh(self) -> bool:
        """No epoch was ever logged here (bulk loads are only allowed then)."""
        return self.input_log.end_offsets()[0] == 0

    def write_bases(self, stores: list[MemoryStore]) -> None:
        """Install the stores' contents as every partition's base before epoch 0 (after a bulk load)."""
        if not self.is_fresh():
            raise NodeError("bulk load is only possible into a fresh data directory")
        for pid, s in enumerate(stores):
            self.durable.write_base(pid, -1, list(s.items()))

    def recover(
        self,
    ) -> tuple[list[dict[bytes, bytes]], EpochRecord | None, list[tuple[int, list[Request], float]]]:
        """State per partition as of the newest record, that record, and the logged epochs after it (each with
        the time logged in its marker)."""
        rec = self.read_record(self.checkpointed_epoch) if self.checkpointed_epoch >= 0 else None
        if self.checkpointed_epoch >= 0 and rec is None:
            raise NodeError(f"epoch record {self.checkpointed_epoch} is unreadable under {self.data_dir}")
        upto = rec.epoch if rec is not None else -1
        states = []
        for pid in range(self.partitions):
            self.durable.truncate_after(pid, upto)  # deltas of a checkpoint that did not complete
            state, _ = self.durable.load(pid, upto)
            states.append(state)
        start = rec.log_end if rec is not None else self.input_log.start_offsets()[0]
        end = self.input_log.end_offsets()[0]
        epochs: list[tuple[int, list[Request], float]] = []
        batch: list[Request] = []
        expect = upto + 1
        for _, data in self.input_log.read_raw(0, start, end):
            req = serde.decode_request(data)
            if req.operator == EPOCH_MARK:
                if int(req.key) != expect:
                    raise NodeError(f"input log: epoch {req.key} follows epoch {expect - 1}")
                epochs.append((expect, batch, req.ts))
                batch, expect = [], expect + 1
            else:
                batch.append(req)
        if batch and self.input_log.atomic_batches:
            raise NodeError(f"input log: {len(batch)} entries after the last epoch marker")
        if batch:  # a networked log took part of an epoch's batch before a crash: that epoch never ran
            mark = Request(f"{EPOCH_MARK}:{expect}", EPOCH_MARK, str(expect), "", serde.encode([]), time.time())
            self.input_log.append_many([(mark, 0)])
            epochs.append((expect, batch, mark.ts))  # its time is the marker's, as for any logged epoch
        return states, rec, epochs

    # -- the epoch path ------------------------------------------------------------------------------
    def known(self, request_id: str, fresh: bool = False) -> Reply | bool:
        """The stored reply of a request id, else whether the id is in the input log (False: new). ``fresh``:
        the caller just found the id absent from the input log (a client's id: the runtime's own ids, e.g. the
        timers' replies, have a reserved prefix no client may use), so only the log's availability is checked."""
        rep = self._unflushed.get(request_id)
        if rep is not None:
            return rep
        wait = self.log_wait
        if wait is not None:  # the log is out: answer at once (503) instead of blocking the caller
            raise EngineUnavailable(f"the log is unavailable ({wait[0]}, waiting {time.monotonic() - wait[1]:.0f} s:"
                                    f" {wait[2]}); retry later")
        if fresh:
            return False
        rep = self.output_log.get(request_id)
        if rep is not None:
            return rep
        return self.input_log.contains(request_id)

    def log_epoch(
        self, epoch: int, requests: list[Request], now: float | None = None,
    ) -> tuple[list[Request], int, float]:
        """Append an epoch's batch and its marker in one commit; returns the new requests, the log end and
        the epoch's logged time (``now``, default the clock: the marker's timestamp, which timers fire by)."""
        self.raise_if_failed()
        start = self._retry_log(lambda: self.input_log.end_offsets()[0], f"logging epoch {epoch}")
        now = time.time() if now is None else now
        mark = Request(f"{EPOCH_MARK}:{epoch}", EPOCH_MARK, str(epoch), "", serde.encode([]), now)
        pos = self._retry_log(lambda: self.input_log.append_many([(r, 0) for r in requests] + [(mark, 0)]),
                              f"logging epoch {epoch}")
        if pos[-1][1] < start:
            raise NodeError(f"input log already holds epoch {epoch}")
        # a request id the log already had is not run again (it is answered by its first execution)
        fresh = [r for r, (_, off) in zip(requests, pos, strict=False) if off >= start]
        crash_point("node:logged", epoch)
        return fresh, pos[-1][1] + 1, now

    def _retry_log(self, op: Callable[[], T], what: str, budget_s: float | None = None) -> T:
        """``op()`` retried with back-off while the log is unreachable (an ``OSError``: a NATS outage), for as
        long as the outage lasts (or ``budget_s``); meanwhile :attr:`log_wait` says what waits, since when and
        the last error (``/health``: ``waiting for log``). Safe for :meth:`log_epoch`'s append: request ids
        and the epoch marker are deduplicated by the log, and ``start`` is read once before the first attempt,
        so whatever a failed attempt stored still counts as this epoch's (live run and replay see the same
        batch); the writer's replies are deduplicated by request id, its truncation is idempotent. Object
        storage waits the same way (a :class:`~charon.storage.contract.StorageUnavailable` is an ``OSError``; its
        writes are idempotent): new requests get a 503 meanwhile; a conflict or a refusal is raised at once."""
        started = time.monotonic()
        delay = 0.1
        warn_at = started
        try:
            while True:
                try:
                    value = op()
                except OSError as exc:
                    if isinstance(exc, (StorageConflict, StorageDenied)):  # not an outage: waiting cannot help
                        raise
                    waited = time.monotonic() - started
                    if budget_s is not None and waited + delay > budget_s:
                        raise
                    self.log_wait = (what, started, f"{type(exc).__name__}: {exc} (waiting {waited:.1f} s)")
                    if time.monotonic() >= warn_at:  # at once, then every 30 s of the outage
                        warn_at = time.monotonic() + 30.0
                        _outage.warning("the log is unavailable (%s) for %.1f s, waiting for it: %s", what, waited,
                                        exc, extra={"event": "outage", "what": what, "waited_s": round(waited, 3),
                                                    "error_type": type(exc).__name__})
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if warn_at != started:
                    waited = time.monotonic() - started
                    _outage.warning("the log is available again (%s) after %.1f s", what, waited,
                                    extra={"event": "recovered", "what": what, "waited_s": round(waited, 3)})
                return value
        finally:
            if self.log_wait is not None and self.log_wait[1] == started:
                self.log_wait = None

    def add_replies(self, replies: list[Reply]) -> None:
        for r in replies:
            self._unflushed[r.request_id] = r
        self._epoch_replies.extend(replies)

    def epoch_done(
        self, epoch: int, counters: list[int], deferred: list[tuple[int, Request]], log_end: int,
        stores: list[RecordingStore], time: float = 0.0, next_due: float = -math.inf, admission: bytes = b"",
    ) -> None:
        """Hand a finished epoch (its deltas and replies, its time, next due timer and admission state) to the
        writer."""
        item = _Finished(epoch, list(counters), list(deferred), log_end, [s.take() for s in stores],
                         self._epoch_replies, time, next_due, admission)
        self._epoch_replies = []
        with self._cv:
            self._finished.append(item)
            self._flushing += 1
            self._cv.notify()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise NodeError(f"the node's storage failed: {type(self.error).__name__}: {self.error}")

    # -- the writer ----------------------------------------------------------------------------------
    def start_writer(self) -> None:
        if self._writer is None:
            self._stop = False
            self._writer = threading.Thread(target=self._write_loop, name="charon-node-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._force
                           or (self._finished and time.monotonic() >= self._last_checkpoint + self.checkpoint_s)):
                    wait = self._last_checkpoint + self.checkpoint_s - time.monotonic() if self._finished else None
                    self._cv.wait(None if wait is None else max(wait, 0.001))
                batch, self._finished = self._finished, []
                self._force = False
                stop = self._stop
            if batch:
                try:
                    self._checkpoint(batch)
                except BaseException as exc:  # noqa: BLE001 - surfaced to every later request
                    self.error = exc
                    with self._cv:
                        self._cv.notify_all()
                    return
            if stop:
                return

    def _checkpoint(self, batch: list[_Finished]) -> None:
        last = batch[-1]
        replies = [r for f in batch for r in f.replies]
        self._retry_log(lambda: self.output_log.put_many(replies), f"storing the replies of epoch {last.epoch}")
        for pid in range(self.partitions):
            merged: dict[bytes, bytes | None] = {}
            for f in batch:
                for d in f.deltas[pid]:
                    merged.update(d)
            if merged:
                self._retry_log(lambda: self.durable.write_delta(pid, last.epoch, merged),  # noqa: B023 - called now
                                f"storing the checkpoint of epoch {last.epoch}")
            if pid == 0:
                crash_point("node:delta0", last.epoch)  # one partition's delta written, the others not
        crash_point("node:deltas", last.epoch)
        if self.side is not None:  # before the record: a restored node finds the files its record implies
            self._retry_log(self.side.ship, f"storing the side files of epoch {last.epoch}")
        rec = EpochRecord(last.epoch, last.counters, [(t, serde.encode_request(r)) for t, r in last.deferred],
                          time=last.time, next_due=last.next_due, log_end=last.log_end, admission=last.admission)
        self._retry_log(lambda: self._write_record(rec), f"storing the checkpoint of epoch {last.epoch}")  # commit
        self.checkpointed_epoch = last.epoch
        for r in replies:
            if self._unflushed.get(r.request_id) is r:
                self._unflushed.pop(r.request_id, None)
        for e in self._record_epochs()[:-_RECORDS_KEPT]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._record_path(e))
            if self.remote is not None:
                with contextlib.suppress(OSError):  # left for a later checkpoint's pass
                    self.remote.delete(f"epochs/{e:012d}.msgpack")
        crash_point("node:record", last.epoch)
        self._checkpoints += 1
        if self.compact_every and self._checkpoints % self.compact_every == 0:
            for pid in range(self.partitions):
                self._retry_log(lambda: self.durable.compact(pid, last.epoch),  # noqa: B023 - called now
                                f"compacting the checkpoint of epoch {last.epoch}")
                crash_point("node:compacting", last.epoch)  # after the first partition
            self._retry_log(lambda: self.input_log.truncate([last.log_end]), "truncating the input log")
            self._retry_log(self.retention.after_truncate, "forgetting old request ids")
        self._last_checkpoint = time.monotonic()
        with self._cv:
            self._flushing -= len(batch)
            self._cv.notify_all()

    def flush(self, timeout: float = 60.0) -> None:
        """Checkpoint every finished epoch now and wait for it."""
        deadline = time.monotonic() + timeout
        if self._writer is None or not self._writer.is_alive():
            with self._cv:
                batch, self._finished = self._finished, []
            if batch and self.error is None:
                self._checkpoint(batch)
            self.raise_if_failed()
            return
        with self._cv:
            self._force = True
            self._cv.notify_all()
            while self._flushing and self.error is None and self._writer.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the node's checkpoint writer did not finish in time")
                self._cv.wait(min(left, 0.05))
        self.raise_if_failed()

    def close(self) -> None:
        """Checkpoint what is finished, stop the writer, close the logs and release the directory."""
        try:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            if self._writer is not None:
                self._writer.join()
                self._writer = None
            if self.error is None and self._finished:
                batch, self._finished = self._finished, []
                self._checkpoint(batch)
        finally:
            self.input_log.close()
            self.output_log.close()
            if self.side is not None:
                self.side.close()
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
