"""The Spark runtime: epochs fixed from the input log, partition state resident on executors.

* Resident mode (the default, ``exchange="resident"``): the driver's :class:`~charon.runtime.spark.sequencer.
  DirectSequencer` fixes epoch ``N``'s offsets straight from the input log and records them durably before anything
  depends on them; the epoch's rounds go over sockets to one long-running barrier gang
  (:mod:`~charon.runtime.spark.resident`). The ``jobs`` mode instead reads the log with the ``charon_log``
  streaming source: Spark writes ``offsets/N`` before batch N runs, and ``foreachBatch`` runs epoch ``N =
  batch_id``, each round a Spark job (:class:`SparkExchange`). Either way the driver reads the epoch's requests
  straight from the log (cheaper than a Spark read job) and calls the one core,
  :class:`~charon.core.epoch.EpochCoordinator`, through the same epoch path (:meth:`SparkRuntime._on_batch`).
* In the ``jobs`` mode each round is one Spark job: the partitions' inboxes and scratch go out in as many tasks
  as there are cores (the resident gang keeps them in its tasks); each task opens its partitions' executor-local
  LMDB stores (:mod:`charon.state.lmdbstore`), brings them to the previous epoch from the durable copy if they
  are missing or behind, and steps the :class:`~charon.core.partition.PartitionUnit`. Rounds only read the
  store; the finalize round writes the epoch's delta (durable file first, then LMDB) idempotently, so a
  replayed epoch is harmless.
* After the epoch, an epoch record (sequencer counters, deferred transactions, offsets) is written under
  the checkpoint; a replayed batch whose record exists is skipped. Replies go to the output log at once
  (early replies; ``INSERT OR IGNORE`` by request id makes delivery exactly-once).
* Every ``compact_every`` epochs the durable deltas are compacted in a background thread and the input log
  is truncated up to the compacted snapshot.

This module holds :class:`SparkRuntime`; its parts live beside it: :mod:`~charon.runtime.spark.layout` (the
checkpoint's layout and files), :mod:`~charon.runtime.spark.session` (Java, the Spark session, loading the
code), :mod:`~charon.runtime.spark.tasks` (what executors run), :mod:`~charon.runtime.spark.exchange` (a round
as a Spark job); fault injection is :mod:`charon.runtime.faults`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import msgspec

from charon import serde
from charon.client_errors import raise_for_reply
from charon.config import SparkConfig
from charon.core import timers as _timers
from charon.core.epoch import EpochCoordinator, EpochResult, Verdict
from charon.core.routing import partition_of, split_store_key, store_key
from charon.core.sequencer import Sequencer
from charon.errors import EngineUnavailable, ReservedRequestId
from charon.log.location import log_locations, open_input_log, open_output_log
from charon.log.offsets import pad_pair
from charon.log.sqlite import DedupRetention
from charon.log.streams import StreamLog
from charon.messages import Reply, Request, is_reserved_id
from charon.operator import Function, Operator
from charon.runtime.control.codeversions import code_entries
from charon.runtime.control.controls import EngineBacked
from charon.runtime.control.gate import EpochGate
from charon.runtime.control.inspector import Inspector, InspectorSettings, LiveRequest
from charon.runtime.control.owner import claim_data_dir
from charon.runtime.control.probe import LogProbe
from charon.runtime.faults import crash_point, fault_point
from charon.runtime.guard.quarantine import RecoveryAttempts, culprit_in
from charon.runtime.guard.verdicts import VerdictBook, letter
from charon.runtime.replies import ReplyWriter
from charon.runtime.sidefiles import SideFiles
from charon.runtime.spark.engine import SparkEngine
from charon.runtime.spark.files import CheckpointFiles
from charon.runtime.spark.layout import (
    Layout,
    check_layout,
    chunk_for,
    fsync_dir,
    layout_path,
    read_layout,
    record_path,
    records_dir,
    remove_old_layouts,
    storage_location,
)
from charon.runtime.spark.resident import gang_lost, make_exchange
from charon.runtime.spark.sequencer import DirectSequencer, read_bound, sequenced_directly
from charon.runtime.spark.session import (
    discard_dead_jvm,
    jvm_exit_code,
    load_app,
    make_session,
    ship_app_module,
    short_error,
    spark_log_path,
    trim_native_heap,
)
from charon.runtime.spark.tasks import read_entities, scan_prefix, tune_worker_gc, write_bases
from charon.state.durable import DurableState, DurableStateError
from charon.state.records import EpochRecord, encode_record, read_record
from charon.storage.contract import ObjectStore, StorageError
from charon.storage.files import write_file_atomic
from charon.storage.location import open_storage
from charon.storage.metered import Metered, StorageMeter
from charon.storage.prefix import Prefixed, delete_prefix

_Layout = TypeVar("_Layout")

_events = logging.getLogger("charon.engine")  # restarts, outages, quarantines: the server log

TICK = "__charon_tick__"  # input-log records that only make Spark run an epoch (for deferred work)


class _Stopping(Exception):
    """Raised into a micro-batch that would start while the runtime stops (the batch stays uncommitted)."""


class RescaleIncomplete(EngineUnavailable):
    """A combined rescale moved the engine partitions (``moved``: that answer) but could not resize the input log
    (it did not answer): the layout records the engine's new count and the log's old one; retry the log part."""

    def __init__(self, message: str, moved: dict[str, Any]) -> None:
        super().__init__(message)
        self.moved = moved


# error texts naming a transient failure of the infrastructure, not of the epoch (see SparkRuntime._outage): the
# log did not answer, SQLite busy past its timeout, a full / read-only / stale file system
_OUTAGE_ERRORS = ("NatsLogUnreachable", "database is locked", "database is busy", "No space left on device",
                  "Read-only file system", "Stale file handle", "StorageUnavailable")


class SparkRuntime(EngineBacked):
    """Deploy an application on Spark. ``app_ref`` is ``"module:attribute"`` of an installed module."""

    controller: SparkEngine  # the engine contract's face, and the control state it owns

    def __init__(self, app_ref: str, config: SparkConfig | None = None, spark: Any = None) -> None:
        self.app_ref = app_ref
        self.app = load_app(app_ref)
        cfg = config or SparkConfig.from_env()
        cfg.check_exchange()  # before anything is written: a setting the exchange cannot honour is refused
        claim_data_dir(cfg.data_dir, "spark")  # not an in-process node's directory (DataDirOwned)
        self.ckpt = cfg.checkpoint_dir
        os.makedirs(self.ckpt, exist_ok=True)
        # object storage (storage_url): the checkpoint directory is a cache of it, taken from it first
        #: the driver's requests and bytes to it (None without it): ``/metrics``
        self.storage_meter: StorageMeter | None = StorageMeter() if cfg.storage_url else None
        self.storage: ObjectStore | None = (
            Metered(open_storage(cfg.storage_url, meter=self.storage_meter), self.storage_meter)
            if cfg.storage_url else None)
        self.files = CheckpointFiles(self.ckpt, self.storage)
        self.files.hydrate()
        #: the effects store, output streams and stream offsets of the data directory, shipped before every epoch
        #: record (object storage only); taken back (on an empty directory) before anything opens them
        self.side = SideFiles(cfg.data_dir, self.storage, snapshot_segments=cfg.streams_snapshot_segments,
                              snapshot_bytes=cfg.streams_snapshot_bytes) if self.storage is not None else None
        if self.side is not None:
            os.makedirs(cfg.data_dir, exist_ok=True)
            self.side.restore()
        # every epoch's coordinator applies (and adds to) its verdicts
        self.verdict_book = VerdictBook(self.ckpt, on_write=self.files.upload)
        # which epoch ran last: a rerun may have replied already
        self._attempts = RecoveryAttempts(self.ckpt, self.files.write, self.files.remove)
        #: the epoch running now when an earlier run of it may have replied: none of its steps may take a new
        #: verdict (see _record_verdict)
        self._replied_epoch: int | None = None
        #: ``charon run``: a step that cannot be judged exits the process (75) for its supervisor; else the runtime
        #: fails for good (``on_fatal``)
        self.exit_when_stuck = False
        self._probe_epoch = -1  # an epoch that failed: its next run probes for a worker-killing transaction
        self._coord: EpochCoordinator | None = None  # the coordinator of the epoch running (or last run)
        self.inspector = Inspector(InspectorSettings(cfg.inspector, cfg.inspector_records, cfg.inspector_bytes),
                                   live=self._unanswered)
        self._epoch_started: float | None = None  # when the running epoch started (the inspector's sequenced_at)
        recorded = read_layout(self.ckpt)
        if recorded is not None and cfg.log_partitions is None:  # not set: an existing log keeps its count
            cfg = dataclasses.replace(cfg, log_partitions=recorded.log_partitions)
        self.input_location, self.output_location = log_locations(os.path.abspath(cfg.data_dir), cfg.log_url)
        layout = check_layout(self.ckpt, cfg.partitions, cfg.n_log_partitions,  # records the log count first
                              chunk_for(cfg), write=self.files.write)
        self._retired: list[str] = []  # state directories a rescale retired (deleted from storage after a compaction)
        if self.storage is not None:
            self._retired = self._stored_layouts(layout.state)
        self._first_chunk = layout.first_chunk
        # another count than the log's routes appends over it from now on (physical partitions only grow;
        # the epoch that first reads the new ones grows the sequencers, see _run_epoch)
        self.input_log = open_input_log(self.input_location, cfg.n_log_partitions, resize=True)
        wanted = cfg.partitions  # another count than the layout's: rescaled below, before anything runs
        self.config = dataclasses.replace(cfg, partitions=layout.partitions, log_partitions=cfg.n_log_partitions)
        cfg = self.config
        os.makedirs(records_dir(self.ckpt), exist_ok=True)
        self.output_log = open_output_log(self.output_location)
        self.output_log.mark_epoch(-1)  # this log's replies come in whole epochs (see charon_replies)
        # an epoch's replies are written while the next epoch runs, before the epoch's record (see _recorded)
        self._replies = ReplyWriter(self._write_replies)
        self._retention = DedupRetention(self.input_log, self.output_log, cfg.dedup_window_s, TICK)
        self.streams = StreamLog(os.path.join(cfg.data_dir, "streams.sqlite"))  # ctx.emit's atoms
        self.durable = self._open_durable(layout.state)
        self._layout_lock = threading.Lock()  # (config.partitions, durable) change together (see placement)
        self.layout_gen = 0
        self._rescale_lock = threading.Lock()
        self.rescale_pauses: list[dict[str, Any]] = []  # one per rescale (see rescale)
        self.log_rescales: list[dict[str, Any]] = []  # one per input-log resize (see rescale_log)
        self.gate = EpochGate()  # pause/resume at an epoch boundary
        self.controller = SparkEngine(self)  # the engine contract's face, and the control state it owns
        self.controller.recorded_code()  # a code update recorded here survives a restart
        self._spark = spark
        self._query: Any = None
        self._compactor: threading.Thread | None = None
        self._log_client: Any = None
        self.epoch_stats: list[dict[str, float]] = []  # the newest ``keep_epoch_stats`` epochs
        self.last_epoch = self.last_recorded_epoch()
        # supervision (see _supervise); health() reports these
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by stop(): ends a restart back-off at once
        self._supervisor: threading.Thread | None = None
        self._status = "stopped"
        self._fatal: str | None = None
        self._last_error: str | None = None
        self._restarts = 0
        self._jvm_restarts = 0  # new Spark sessions after the JVM died (see _supervise_loop)
        self._need_session = False  # the JVM died and the query runs in no new session yet
        self._reship = False  # a code update shipped a module with addPyFile: a resident gang must be replaced
        # called once with the reason when the runtime gives up (charon run then exits non-zero: see serve)
        self.on_fatal: Callable[[str], None] | None = None
        self._failures: dict[int, int] = {}  # epoch -> query failures while running it
        self._gang_losses: dict[int, int] = {}  # epoch -> resident gangs lost while running it (see _gang_retry)
        self._unconfirmed: int | None = None  # an epoch whose replies went out but that is not recorded yet
        # the epochs not recorded yet that this process delivered a reply of (a fired timer's too: see _replied_before)
        self._delivered: set[int] = set()
        # shutdown between epochs (see stop): stopping a query while an epoch's job runs cancels the job from
        # under the py4j callback (a StackOverflowError in Spark's stream thread, an epoch left half done)
        self._epoch_cv = threading.Condition()
        self._in_epoch = False
        self._stopping = False
        last = self.read_record(self.last_epoch)
        # when the next timer is due (recorded per epoch; a fresh checkpoint has none): the ticker's cue
        self._next_due = last.next_due if last is not None else math.inf
        self._ticker: threading.Thread | None = None
        self._last_tick_error: str | None = None  # the ticker's last failure to reach the log
        self.log_probe = LogProbe(self.input_log, cfg.health_timeout_s)  # health() answers within its timeout
        if wanted != self.config.partitions:
            self.rescale(wanted)

    # -- lifecycle ------------------------------------------------------------------------------------------
    @property
    def spark(self) -> Any:
        if self._spark is None:
            self._spark = make_session(self.config)
            self._storage_env(self._spark)
        return self._spark

    def _storage_env(self, spark: Any) -> None:
        """With object storage: a session made elsewhere (a shared one) lacks ``spark.executorEnv.AWS_*``; the
        Python workers of this runtime's jobs get the driver's ``AWS_*`` as their environment all the same (the
        job's environment, never a task's closure)."""
        if self.storage is not None:
            spark.sparkContext.environment.update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})

    def start(self) -> None:
        """Start the streaming query (epochs run in Spark's micro-batch thread) and its supervisor."""
        from charon.runtime.spark.source import register

        spark = self.spark
        self._storage_env(spark)
        register(spark)
        self._ship_recorded()
        tune_worker_gc(self.config.gc_threshold)  # the driver: loaded code, the session's objects frozen
        with self._epoch_cv:
            self._stopping = False
        self.controller.finish_update()  # a code update's migration a crash interrupted, before any request
        self.gate.reset()
        with self._lock:
            self._wake.clear()
            self._fatal = None
            self._status = "starting"
            self._start_query()
            self._status = "ok"
        self._supervisor = threading.Thread(target=self._supervise, name="charon-supervisor", daemon=True)
        self._supervisor.start()
        if self._ticker is None or not self._ticker.is_alive():
            self._ticker = threading.Thread(target=self._tick_timers, name="charon-timers", daemon=True)
            self._ticker.start()

    def _tick_timers(self) -> None:
        """While idle, append a tick when a timer is due: the epoch it triggers takes the tick's timestamp as
        its time (``EpochRecord.time``), so the timer fires there, deterministically on replay."""
        poll = max(self.config.timer_poll_ms, 1) / 1000.0
        n = 0
        while not self._wake.wait(poll):
            if self._next_due > time.time() or self._status not in ("ok", "recovering"):
                continue
            try:
                self._settle_recovery()  # a restart with nothing to replay: no epoch would ever say so
                if self._status != "ok":
                    continue
                rec = self.read_record(self.last_recorded_epoch())
                ends, tops = pad_pair(rec.ends if rec is not None else [], self.input_log.end_offsets())
                if any(e < t for e, t in zip(ends, tops, strict=True)):
                    continue  # an epoch is coming anyway (it advances the time too)
                n += 1
                self.input_log.append(Request(f"{TICK}timer:{time.time_ns()}:{n}", TICK, "", "", serde.encode([])))
            except Exception as e:  # noqa: BLE001 - the log or Spark's JVM is down: tick once it answers (never end)
                self._last_tick_error = f"{type(e).__name__}: {e}"

    @property
    def direct(self) -> bool:
        """Whether epochs are sequenced by the driver's own loop (the resident exchange,
        :mod:`~charon.runtime.spark.sequencer`) rather than by a Structured Streaming micro-batch."""
        return self.config.exchange == "resident"

    def _start_query(self) -> None:
        spark = self.spark
        self._new_exchange(spark)
        if self.direct:
            self._start_sequencer()
            return
        if sequenced_directly(self.ckpt) and self.last_recorded_epoch() >= 0:
            raise ValueError(f"the epochs under {self.ckpt} were sequenced by the resident mode (no streaming "
                             "query checkpoint describes them): run it with exchange='resident'")
        df = (
            spark.readStream.format("charon_log")
            .option("path", self.input_location)
            .option("maxRecordsPerBatch", str(self.config.max_batch))
            .option("maxBytesPerBatch", str(self.config.max_batch_bytes))
            .option("startRecordsPerBatch", str(self.config.restart_batch))  # short epochs first (a backlog)
            .option("idleWaitMs", str(self.config.idle_wait_ms))
            .load()
        )
        w = df.writeStream.foreachBatch(self._on_batch).option("checkpointLocation", self._query_ckpt)
        if self.config.trigger_ms > 0:
            w = w.trigger(processingTime=f"{self.config.trigger_ms} milliseconds")
        self._query = w.start()

    def _start_sequencer(self) -> None:
        """The resident mode's epochs: the driver's loop fixes them from the log (no streaming query)."""
        last = self.read_record(self.last_recorded_epoch())
        if last is not None and last.deferred:  # a crash may have come before the tick that runs them
            self.input_log.append(Request(f"{TICK}{last.epoch}", TICK, "", "", serde.encode([])))  # once (by id)
        self._query = DirectSequencer(
            self.ckpt, self.input_log, self.input_location, self.config,
            run_epoch=partial(self._on_batch, None), last_recorded=self.last_recorded_epoch,
            read_record=self.read_record, exchange=lambda: self.exchange, stopping=lambda: self._stopping,
            migrate=self._batch_offsets_if_any, write=self.files.write,
            remove=self.files.remove if self.storage is not None else None,
        ).start()

    def _batch_offsets_if_any(self, epoch: int) -> tuple[list[int], list[int]] | None:
        """The offsets the micro-batch mode fixed for ``epoch`` in its query checkpoint, if it did."""
        from charon.runtime.spark.source import batch_offsets, read_offset_log

        if read_offset_log(self._query_ckpt, epoch) is None:
            return None
        return batch_offsets(self._query_ckpt, epoch)

    def _epoch_offsets(self, epoch: int) -> tuple[list[int], list[int]]:
        """``(starts, ends)`` of epoch ``epoch`` as fixed before it ran: its bound (the direct sequencer) or its
        micro-batch's offsets in the query checkpoint."""
        q = self._query
        if isinstance(q, DirectSequencer):
            return q.fixed(epoch)
        if self.direct:
            return read_bound(self.ckpt, epoch)
        from charon.runtime.spark.source import batch_offsets

        return batch_offsets(self._query_ckpt, epoch)

    def _new_exchange(self, spark: Any) -> None:
        """The exchange of the epochs to come (``config.exchange``), after closing the one before if it has a gang
        to end (the resident exchange; the job-per-round exchange holds nothing)."""
        self._close_exchange()
        self.exchange = make_exchange(spark, self.app_ref, self.config, self.controller.previous,
                                      code_entries(self.controller.code))

    def _close_exchange(self) -> None:
        close = getattr(getattr(self, "exchange", None), "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # a gang already gone
                close()

    def _supervise(self) -> None:
        """Restart the query from its checkpoint when it fails (back-off doubling from ``restart_backoff_s``);
        give up loudly when the same epoch failed ``epoch_max_failures`` times (a deterministic failure).

        A failure during an outage of the infrastructure (see :meth:`_outage`: the log, the checkpoint directory)
        is nobody's epoch's fault: it is not counted; the supervisor waits until it is over, then restarts.
        Should the supervisor itself fail, the runtime reports it as failed (never a silent "recovering")."""
        try:
            self._supervise_loop()
        except BaseException as e:  # noqa: BLE001 - reported: nobody would restart the query any more
            with self._lock:
                stopped = self._status == "stopped"
            if not stopped:
                self._give_up(f"the query's supervisor failed: {type(e).__name__}: {e}")

    def _give_up(self, reason: str) -> None:
        """Failed for good: say so once (``FATAL``), and call :attr:`on_fatal` (``charon run`` then exits
        non-zero, so that a process supervisor restarts it: never alive-but-failed)."""
        self._fatal = reason
        self._status = "failed"
        _events.critical("FATAL: %s", reason, extra={"event": "fatal"})
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _supervise_loop(self) -> None:
        cfg = self.config
        while True:
            q = self._query
            if q is None:
                return
            err: BaseException | None = None
            try:
                q.awaitTermination()
            except BaseException as e:  # noqa: BLE001 - StreamingQueryException or a py4j error
                err = e
            outage = self._outage(err)
            gang = False  # a lost resident gang, retried as Spark retries a task: the first time at once
            with self._lock:
                if self._query is not q or self._status == "stopped" or self._fatal is not None:
                    return  # stopped on purpose, or failed for good
                epoch = self.last_recorded_epoch() + 1
                msg = short_error(err) if err is not None else "the streaming query terminated"
                code = jvm_exit_code()
                if code is not None:  # the query failed because Spark's JVM is gone: a new session is needed
                    msg = f"Spark's JVM died (exit {code}); starting a new Spark session"
                    self._need_session = True
                if outage is not None:
                    n = 1
                    self._last_error = f"epoch {epoch}: {outage}"
                    self._status = "recovering"
                    _events.warning("the streaming query stopped at epoch %d during an outage (not counted as a "
                                    "failure); restarting when it is over: %s", epoch, outage,
                                    extra={"event": "outage", "epoch": epoch})
                elif code is None and (k := self._gang_retry(epoch, err)) is not None:
                    n, gang = k, True  # the back-off grows with the gang's losses; the epoch's failures do not
                    self._quarantine_culprit(epoch)  # a probed run's worker-killing transaction is set aside
                    self._last_error = f"epoch {epoch}: {msg}"
                    self._status = "recovering"
                    _events.warning("the resident gang was lost at epoch %d (loss %d; as Spark retries a task, "
                                    "not counted as a failure of the epoch); restarting on a new gang: %s", epoch, k,
                                    msg, extra={"event": "gang_lost", "epoch": epoch, "losses": k})
                else:
                    n = self._failures[epoch] = self._failures.get(epoch, 0) + 1
                    self._last_error = f"epoch {epoch}: {msg}"
                    if self._quarantine_culprit(epoch):  # its worker-killing transaction is set aside: retry
                        n = self._failures[epoch] = 1
                    elif code is None:  # the next run of this epoch probes for one
                        self._probe_epoch = epoch
                    if n >= cfg.epoch_max_failures:
                        self._give_up(f"epoch {epoch} failed {n} times, giving up: {msg}")
                        return
                    self._status = "recovering"
                    _events.warning("the streaming query failed at epoch %d (failure %d of at most %d); restarting "
                                    "from the checkpoint: %s", epoch, n, cfg.epoch_max_failures, msg,
                                    extra={"event": "failure", "epoch": epoch, "failures": n,
                                           "error_type": None if err is None else type(err).__name__})
            # Restart; a restart that fails (e.g. its source's planning needs a Python worker Spark is still
            # replacing) is retried after the next back-off: awaiting the dead query again would count its old
            # failure once more and give up early.
            waits = 0
            while True:
                delay = min(30.0, cfg.restart_backoff_s * 2 ** (n - 1))
                if gang:  # Spark retries a lost task at once: so is an epoch's first gang loss, then backing off
                    delay = 0.0 if n == 1 else min(30.0, cfg.restart_backoff_s * 2 ** (n - 2))
                if outage is not None:  # poll until the outage is over (at most every 5 s)
                    delay = min(5.0, cfg.restart_backoff_s * 2 ** min(waits, 10))
                    waits += 1
                if self._wake.wait(delay):
                    return
                if outage is not None:  # a bounded probe first: a stopped server would hold _outage ~11 s per call
                    probe = self.log_probe.check(fresh=True)
                    still = probe.error if probe.error is not None else self._outage(None)
                    if still is not None:
                        self._last_error = f"epoch {epoch}: {still}"
                        continue
                failed: Exception | None = None
                with self._lock:
                    if self._status == "stopped":
                        return
                    self._restarts += 1
                    try:
                        if self._spark is None or jvm_exit_code() is not None:
                            self._new_session()
                        self._start_query()
                        self._need_session = False
                        _events.warning("the streaming query restarted at epoch %d (restart %d)%s", epoch,
                                        self._restarts, " after the outage" if outage is not None else "",
                                        extra={"event": "recovered" if outage is not None else "restart",
                                               "epoch": epoch, "restarts": self._restarts})
                        break
                    except Exception as e:  # noqa: BLE001 - counted as a failure of the same epoch
                        failed = e
                        self._last_error = f"restart: {short_error(e)}"
                        _events.warning("restarting the streaming query failed: %s", e,
                                        extra={"event": "restart_failed", "epoch": epoch,
                                               "error_type": type(e).__name__})
                outage = self._outage(failed)  # probed without the lock: stop() and a rescale need not wait for it
                if outage is not None:
                    continue
                with self._lock:
                    if self._status == "stopped":
                        return
                    n = self._failures[epoch] = self._failures.get(epoch, 0) + 1
                    gang = False
                    if n >= cfg.epoch_max_failures:
                        assert failed is not None
                        self._give_up(f"cannot restart the streaming query: {short_error(failed)}")
                        return
            with contextlib.suppress(OSError, sqlite3.Error):  # the log is down again: the ticker settles it
                self._settle_recovery()

    def _gang_retry(self, epoch: int, err: BaseException | None) -> int | None:
        """The resident mode's task retries. In the ``jobs`` mode Spark retries a task whose worker or executor died
        (``task_max_failures`` attempts) before the query fails; a resident gang cannot be retried in place (its
        tasks' scratch went with it), so the supervisor restarts the epoch on a new gang instead, and such a loss
        (:class:`~charon.runtime.spark.resident.GangLost`: a task, worker or executor gone, a relaunched stage, a
        gang that did not start or failed while idle) counts as a failure of the epoch only every
        ``task_max_failures``-th time, as Spark's retries would have absorbed the ones before. Returns the number
        of losses of ``epoch`` so far when this one is not counted, else None (an error raised by a round, e.g. an
        application's, is always counted: :class:`~charon.runtime.spark.resident.GangTaskFailed`)."""
        if not self.direct or not gang_lost(err):
            return None
        k = self._gang_losses[epoch] = self._gang_losses.get(epoch, 0) + 1
        return None if k % max(1, self.config.task_max_failures) == 0 else k

    def _quarantine_culprit(self, epoch: int) -> bool:
        """After a probed run of ``epoch`` failed: the transaction its dead worker was running, if one can be told,
        is recorded as Quarantined (before the epoch runs again, which refuses it). See
        :mod:`charon.runtime.guard.quarantine`; the probe files must be readable here (local mode, a shared
        directory)."""
        if self._probe_epoch != epoch:
            return False
        found = culprit_in(os.path.join(self.ckpt, "probe", str(epoch)))
        coord = self._coord
        req = coord.current.requests.get(found[0]) if found and coord and coord.current else None
        if found is None or req is None or req.request_id in self.verdict_book.verdicts:
            return False
        msg = (f"{req.operator}.{req.function} on key {req.key!r} (or a function it called) killed the Python "
               f"worker running it on every attempt of epoch {epoch}; the transaction was set aside")
        self.verdict_book.record(letter(req.request_id, req.operator, req.function, req.key,
                                        Verdict("Quarantined", msg, found[1]), epoch))
        _events.error("quarantined request %r: %s", req.request_id, msg,
                      extra={"event": "quarantined", "request_id": req.request_id, "operator": req.operator,
                             "function": req.function, "key": req.key, "epoch": epoch})
        return True

    def _new_session(self) -> None:
        """Spark's JVM died: start a new one (a new SparkSession, the log source registered, the application
        shipped); the caller then restarts the query, which resumes from its checkpoint (nothing the dead JVM
        held is needed: the epochs' state, records and logs are files)."""
        self._jvm_restarts += 1
        self._need_session = True
        _events.warning("Spark's JVM is gone; starting a new Spark session (attempt %d)", self._jvm_restarts,
                        extra={"event": "restart", "jvm_restarts": self._jvm_restarts})
        discard_dead_jvm()
        self._spark = None
        fault_point("session_restart")
        from charon.runtime.spark.source import register

        spark = self.spark
        self._storage_env(spark)
        register(spark)
        self._ship_recorded()

    def _ship_recorded(self) -> None:
        """Make the running code and every recorded version's still loaded (a compatible update's old code still
        running deferred transactions; the code a pinned workflow's steps run) importable by the executors."""
        refs = [self.app_ref, *(v.ref for v in self.controller.code.versions
                                if v.ref is not None and v.unloaded_at is None)]
        for ref in dict.fromkeys(refs):
            ship_app_module(self.spark, ref)

    def _outage(self, err: BaseException | None) -> str | None:
        """Why a query failure is an outage of the infrastructure rather than the epoch's fault, or None: the one
        rule for what the supervisor does not count towards ``epoch_max_failures`` (it waits instead).

        Either the input/output logs do not answer now, or the checkpoint directory (epoch records, durable
        state) cannot be written now, or object storage (``storage_url``) does not answer, or the failure names a
        transient one (:data:`_OUTAGE_ERRORS`: a NATS timeout or lost connection, possibly wrapped by Spark; SQLite
        busy; a full or read-only file system; object storage unavailable after its retries).
        A Python worker or executor lost is not: Spark already retried its tasks, and an epoch that kills its
        worker every time (e.g. too large for its memory) is the epoch's."""
        try:
            self.input_log.end_offsets()
            self.output_log.last_seq()
        except (OSError, sqlite3.Error) as e:  # sqlite3: "database is locked" (not an OSError) is transient too
            return f"the log is unavailable: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - never end the supervisor: the failure is counted instead
            _events.warning("probing the log failed: %s: %s", type(e).__name__, e,
                            extra={"event": "probe_failed", "error_type": type(e).__name__})
            return None
        for d in (records_dir(self.ckpt), self.durable.root):
            if d != records_dir(self.ckpt) and not os.path.lexists(d):
                continue  # no state stored yet
            probe = os.path.join(d, ".charon-probe")
            try:
                write_file_atomic(probe, b"probe")
                os.remove(probe)
            except OSError as e:
                return f"the checkpoint directory is not writable: {type(e).__name__}: {e}"
        if self.storage is not None:
            try:
                self.storage.get("layout.json")
            except StorageError as e:  # down, throttling or refusing: the epoch is not at fault
                return f"object storage is unavailable: {type(e).__name__}: {e}"
        text = str(err) if err is not None else ""
        if any(name in text for name in _OUTAGE_ERRORS):
            return f"a transient infrastructure failure: {short_error(err)}"  # type: ignore[arg-type]
        return None

    def caught_up(self, log_ends: list[int] | None = None) -> bool:
        rec = self.read_record(self.last_recorded_epoch())
        log_ends = self.input_log.end_offsets() if log_ends is None else log_ends
        ends, target = pad_pair(rec.ends if rec is not None else [], log_ends)
        return not (rec is not None and rec.deferred) and all(e >= t for e, t in zip(ends, target, strict=True))

    def _settle_recovery(self, log_ends: list[int] | None = None) -> None:
        """The one rule for leaving ``recovering`` without an epoch: the restarted query is active and nothing is
        left to replay (the log holds nothing past the last record, which is not deferred). Otherwise the next
        recorded epoch does it (:meth:`_recorded`). Applied by the supervisor right after a restart, by the
        timer ticker (it ticks only while serving) and by :meth:`health`."""
        q = self._query
        if self._status == "recovering" and q is not None and not self._need_session and jvm_exit_code() is None \
                and q.isActive and self.caught_up(log_ends):
            self._status = "ok"

    @property
    def judging(self) -> bool:
        """Whether the epoch running now may take new verdicts (False: a rerun of an epoch whose replies may have
        left, where only its recorded verdicts apply; the simulator overruns functions only where this holds)."""
        return self._replied_epoch is None  # set for each epoch before it runs

    def _record_verdict(self, req: Request, verdict: Verdict, epoch: int) -> None:
        """A task stopped a function past its budget: recorded (fsynced) before the epoch goes on. Not in a rerun
        of an epoch whose replies may have left (they may say the transaction ran): the runtime cannot judge
        there, and gives up (:meth:`_cannot_judge`)."""
        if self._replied_epoch == epoch:
            self._cannot_judge(req, verdict, epoch)
        self.verdict_book.record(letter(req.request_id, req.operator, req.function, req.key, verdict, epoch,
                                        f"{req.operator}.{req.function}"))

    def _replied_before(self, epoch: int, requests: list[Request], prev: EpochRecord | None) -> bool:
        """Whether an earlier run of ``epoch`` may have answered a client: a reply of this epoch is in the output
        log (clients read replies only from there; a reply a dead driver had not written yet never left; a fired
        timer's is found past the epoch's reply mark), or this process delivered one, or its output streams' atom
        was appended (a reader may have it; a rerun's atom is never appended again), or its finalize reached a
        partition's durable copy (a replayed epoch's delta and atom are never written again, so
        they hold the earlier run's outcomes, which a new verdict would contradict). True when it cannot be told
        (the log or the durable state failing)."""
        try:
            self._replies.flush(30)  # this process's earlier run (a query restart): its replies are written first
            if epoch in self._delivered:
                return True
            reqs = list(requests)
            if prev is not None:
                reqs += [serde.decode_request(b) for _, b in prev.deferred]
            for r in reqs:
                rep = self.output_log.get(r.request_id)
                if rep is not None and rep.epoch == epoch:
                    return True
            if self._wrote_replies_of(epoch):  # a fired timer's reply (its request is in no log)
                return True
            if self.streams.last_epoch() >= epoch:  # its atoms are out (readers may have them; never rewritten)
                return True
            parts, durable, _ = self.placement()
            return any(durable.recorded_epoch(pid) >= epoch for pid in range(parts))
        except Exception as e:  # noqa: BLE001 - cannot prove nothing left: it may have
            _events.warning("cannot tell whether epoch %d replied before (%s: %s): it takes no new verdicts", epoch,
                            type(e).__name__, e, extra={"event": "replied_unknown", "epoch": epoch})
            return True

    def _wrote_replies_of(self, epoch: int) -> bool:
        """Whether the output log holds a reply of ``epoch`` past the mark its first start recorded (True when no
        mark was kept: it cannot be told)."""
        seq = self._attempts.reply_mark(epoch)
        if seq is None:
            return True
        while page := self.output_log.read_since(seq, 5000):
            if any(rep.epoch == epoch for _, rep in page):
                return True
            seq = page[-1][0]
        return False

    def _cannot_judge(self, req: Request, verdict: Verdict, epoch: int) -> None:
        """A step of a rerun epoch whose replies may have left ran past its budget: no verdict can be taken (the
        replies sent may depend on it completing). FATAL, naming the function, then ``charon run`` exits (75) for
        its supervisor; a runtime in a program fails for good (``on_fatal``). Raises to stop the epoch."""
        reason = (f"{verdict.message} while epoch {epoch} was run again after a restart, and that epoch may have "
                  f"replied already (request {req.request_id!r}): no new verdict can be taken there; exiting for "
                  "the supervisor (a larger budget, @op.function(timeout=...), lets it complete)")
        if self.exit_when_stuck:
            _events.critical("FATAL: %s", reason, extra={"event": "fatal", "epoch": epoch, "operator": req.operator,
                                                          "function": req.function, "key": req.key})
            for handler in logging.getLogger("charon").handlers:
                handler.flush()
            os._exit(75)
        self._give_up(reason)
        raise _Stopping(f"epoch {epoch}: {reason}")

    def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Transactions the engine set aside (timed out, quarantined), newest first."""
        return self.verdict_book.dead_letters(limit)

    def health(self) -> dict[str, Any]:
        """The runtime's state: ``status`` (ok, starting, recovering, failed, stopped), the last recorded
        epoch, the last error, the number of query restarts and of new Spark sessions after the JVM died
        (``jvm_restarts``); ``ok`` is true only when serving and the
        input log answers. ``log_error`` says why the log does not (unreachable, or no answer within
        ``health_timeout_s``: health never waits for a hung log longer than that). In the resident mode ``gang``
        says where the gang runs (:meth:`~charon.runtime.spark.resident.ResidentExchange.placement`: each task's
        executor, Python worker and partitions)."""
        probe = self.log_probe.check()
        status = self._status
        last_error = self._last_error
        q = self._query
        try:
            if status in ("ok", "recovering") and (self._need_session or jvm_exit_code() is not None):
                status = "recovering"  # the supervisor is about to start a new session
                last_error = (self._last_error if self._need_session and self._last_error else
                              f"Spark's JVM died (exit {jvm_exit_code()}); a new Spark session is starting")
            elif status == "ok" and q is not None and not q.isActive:
                status = "recovering"  # terminated; the supervisor is about to notice
            elif status == "ok" and isinstance(q, DirectSequencer) and not q.warmed.is_set():
                status = "starting"  # the gang is launching (or the unrecorded epochs run again): not serving yet
            elif status == "recovering" and probe.ends is not None:
                self._settle_recovery(probe.ends)
                status = self._status
        except Exception as e:  # noqa: BLE001 - a JVM that died between the checks: truthful, never an error
            status = "recovering" if status in ("ok", "recovering") else status
            last_error = f"Spark does not answer ({type(e).__name__}); the supervisor restarts it"
        doc = {"status": status, "ok": status == "ok" and probe.ok, "epoch": self.last_recorded_epoch(),
               "last_error": last_error, "log_error": probe.error, "restarts": self._restarts,
               "jvm_restarts": self._jvm_restarts, "fatal": self._fatal, "unconfirmed_epoch": self._unconfirmed}
        placement = getattr(getattr(self, "exchange", None), "placement", None)
        if placement is not None:  # the resident gang: where its tasks run (ResidentExchange.placement)
            doc["gang"] = placement()
        return doc

    def stop(self) -> None:
        """Stop between epochs: no new epoch starts (its batch is left uncommitted, to run after a restart),
        the running one finishes (at most ``stop_timeout_s``), then the query is stopped."""
        with self._lock:
            self._status = "stopped"
            self._wake.set()
            self.gate.stopping()  # an epoch waiting at a paused gate fails and is replayed after a restart
            q, self._query = self._query, None
        with self._epoch_cv:
            self._stopping = True
            self._epoch_cv.wait_for(lambda: not self._in_epoch, timeout=self.config.stop_timeout_s)
        if q is not None:
            if isinstance(q, DirectSequencer):
                q.stop(self.config.stop_timeout_s)
            elif not self._need_session and jvm_exit_code() is None:  # else it died with its JVM
                q.stop()
            with contextlib.suppress(Exception):  # else the next start finalizes it (replays the epoch)
                self.flush()
            with contextlib.suppress(Exception):  # else the unrecorded epoch runs again after a restart
                self._replies.close()
        self._close_exchange()  # a resident gang ends here (after the flush, which may need it)
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=60)
            self._supervisor = None
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=60)
            self._ticker = None
        if self._compactor is not None:
            self._compactor.join()

    # -- rescaling by key groups ------------------------------------------------------------------------------
    def rescale(self, partitions: int | None = None, timeout: float = 300.0, *, log_partitions: int | None = None,
                ) -> dict[str, Any]:
        """Change the number of engine partitions at an epoch boundary, the streaming query running or not;
        with ``log_partitions``, then change the input log's partition count (:meth:`rescale_log`, no pause;
        its answer is merged in under ``log``). ``partitions=None``: the engine partitions stay.

        Refused at once with :class:`~charon.errors.EngineUnavailable` (HTTP 503, ``Retry-After``) while the
        query is recovering or failed, or while the input log does not answer. The engine part runs first: a
        ``TimeoutError`` leaves nothing changed (the log is not resized); a log resize that fails after the
        engine moved raises :class:`RescaleIncomplete` naming what moved (``moved``: the engine's answer).

        Entities map to fixed key groups (:data:`charon.core.routing.KEY_GROUPS`), groups to partitions
        (``group % partitions``). A running runtime closes its epoch gate: the running epoch finishes (a
        deferred finalize is recorded first) and the next micro-batch, already fixed, waits at the gate while
        the state as of the last recorded epoch is re-placed by key group (timers with their owner) into the
        bases of a new state directory; ``layout.json`` then names it (the commit point: a crash before it
        keeps the old layout, whose leftovers the next start removes), the driver switches to a new exchange,
        and the gate opens. The query itself is never stopped; requests keep being appended to the input log
        meanwhile and run right after. Executors restore the new layout's stores from its bases on first
        use. The input log's partitions (the sequencers) change only with ``log_partitions``.

        Returns (and appends to ``rescale_pauses``) ``from``, ``to``, ``epoch`` (the last epoch before the
        move), ``keys`` (items moved), ``wait_s`` (until the running epoch was done; epochs still ran),
        ``pause_s`` (no epoch could run: the move), ``cpu_s`` (the driver's CPU time in the move). It blocks:
        on an event loop, call it with ``asyncio.to_thread``. ``timeout``: the longest wait for the running
        epoch (``TimeoutError`` then, nothing moved, the gate reopened).
        """
        if partitions is not None and partitions < 1:
            raise ValueError("partitions must be at least 1")
        if log_partitions is not None and log_partitions < 1:
            raise ValueError("log_partitions must be at least 1")
        if partitions is None and log_partitions is None:
            raise ValueError("give partitions, log_partitions or both")
        # the engine first: its only failure, no boundary within ``timeout``, then leaves nothing changed
        info = self._rescale_engine(partitions, timeout) if partitions is not None else None
        if log_partitions is None:
            return info  # type: ignore[return-value]
        try:
            log_info = self.rescale_log(log_partitions)
        except Exception as exc:  # the log unreachable (typed 503), or another failure of its resize
            if info is None:
                raise
            raise RescaleIncomplete(f"the engine partitions moved {info['from']} -> {info['to']} at epoch "
                                    f"{info['epoch']}, but the input log was not resized: {exc}", info) from exc
        return {"log": log_info} if info is None else {**info, "log": log_info}

    def _check_serving(self, what: str) -> None:
        """Refuse (:class:`~charon.errors.EngineUnavailable`, at once) a rescale the runtime cannot do now: the
        query has failed and is not restarted yet, or the runtime gave up (a move would race the supervisor's
        restart, or wait for a boundary that may not come), or the input log does not answer within
        ``health_timeout_s``. A restarted query still replaying its backlog may rescale (at a boundary)."""
        q, status = self._query, self._status
        if q is not None and (status == "failed" or not q.isActive):  # restarted (active, replaying): it may
            state = "failed" if status == "failed" else "recovering"
            raise EngineUnavailable(f"cannot {what} while the runtime is {state} ({self._last_error}); retry "
                                    "when /health is ok")
        probe = self.log_probe.check(fresh=True)
        if probe.error is not None:
            raise EngineUnavailable(f"cannot {what}: {probe.error}; retry when /health is ok")

    def rescale_log(self, log_partitions: int) -> dict[str, Any]:
        """Change the input log's partition count (= the sequencers) of a running deployment; no pause.

        ``layout.json`` records the new routing count first (a restart applies it), then the log switches its
        appenders atomically (:meth:`~charon.log.sqlite.InputLog.resize`; NATS appenders in other processes
        within a second): growing adds physical partitions, shrinking only retires some from routing (they
        drain, and are still read). The streaming query reads the physical count at every batch it plans; the
        first epoch whose offsets name more partitions grows its sequencers so every new TID exceeds every
        earlier one (:meth:`~charon.core.sequencer.Sequencer.resize`). Nothing is fenced: dedup by request id
        spans the whole log and every physical partition is consumed, so no request is lost or run twice.

        Returns (and appends to ``log_rescales``) ``from`` / ``to`` (routing counts), ``physical`` (after),
        ``epoch`` (the last recorded one when it switched), ``switch_s`` (wall time of the switch; no epoch
        waits for it) and ``cpu_s``."""
        if log_partitions < 1:
            raise ValueError("log_partitions must be at least 1")
        self._check_serving("resize the input log")
        with self._rescale_lock:
            t0, c0 = time.perf_counter(), time.process_time()
            old = self.input_log.counts()[1]
            epoch = self.last_recorded_epoch()
            with self._lock:
                layout = read_layout(self.ckpt) or Layout(self.config.partitions, old)
                path = layout_path(self.ckpt)
                wanted = msgspec.structs.replace(layout, log_partitions=log_partitions)
                self.files.write(path, msgspec.json.encode(wanted))
                crash_point("log_relayout", epoch)  # recorded, the log not resized yet: the restart resizes it
                try:
                    physical, route = self.input_log.resize(log_partitions)
                except BaseException:  # the log did not switch (or not knowingly): the layout keeps the old count
                    self.files.write(path, msgspec.json.encode(layout))
                    raise
                self.config = dataclasses.replace(self.config, log_partitions=route)
            crash_point("log_resized", epoch)
            info = {"from": old, "to": route, "physical": physical, "epoch": epoch,
                    "switch_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
            self.log_rescales.append(info)
            return info

    def _rescale_engine(self, partitions: int, timeout: float) -> dict[str, Any]:
        self._check_serving("rescale")
        with self._rescale_lock:
            t0 = time.perf_counter()
            running = self._query is not None and self._status != "stopped"
            if running:  # the runtime's own hold: a user's resume meanwhile cannot start an epoch mid-move
                self.gate.hold()
            try:
                if running and not self.gate.wait_paused(self.last_recorded_epoch, timeout):
                    raise TimeoutError(f"no epoch boundary within {timeout} s: {self.control_status()}")
                t1 = time.perf_counter()
                if self._compactor is not None:  # it reads the old layout's files
                    self._compactor.join()
                info = self._move(partitions)
                info.update(wait_s=t1 - t0, pause_s=time.perf_counter() - t1)
            finally:
                if running:
                    self.gate.release()
            self.rescale_pauses.append(info)
            return info

    def _move(self, partitions: int) -> dict[str, Any]:
        """Re-place the state as of the last recorded epoch into a new layout and commit it (no epoch runs)."""
        c0 = time.process_time()
        epoch = self.last_recorded_epoch()
        old = self.config.partitions
        parts: list[list[tuple[bytes, bytes]]] = [[] for _ in range(partitions)]
        n = 0
        for pid in range(old):
            if self.storage is None and not os.path.isdir(os.path.join(self.durable.root, f"p{pid}")):
                continue  # nothing was ever stored there
            state, _ = self.durable.load(pid, epoch)
            for k, v in state.items():
                parts[partition_of(*_timers.placed_by(k, v), partitions)].append((k, v))
            n += len(state)
        name = f"state-{time.time_ns():x}"
        new = self._open_durable(name)
        for pid, items in enumerate(parts):
            items.sort()
            new.write_base(pid, epoch, items)
        fsync_dir(new.root)
        crash_point("relayout", epoch)  # the new state is written, the layout not switched
        with self._lock:  # a supervisor restarting the query meanwhile builds its exchange after the switch
            self.files.write(layout_path(self.ckpt),
                             msgspec.json.encode(Layout(partitions, self.config.n_log_partitions, name,
                                                        self._first_chunk)))
            crash_point("relayout_committed", epoch)  # switched; the old state directory is still there
            with self._layout_lock:
                self.config = dataclasses.replace(self.config, partitions=partitions)
                self._retired.append(os.path.basename(self.durable.root))
                self.durable = new
                self.layout_gen += 1
            if self._spark is not None and getattr(self, "exchange", None) is not None:
                self._new_exchange(self._spark)
        # the old directory goes with the next compaction (a state read may still be reading it) or restart
        return {"from": old, "to": partitions, "epoch": epoch, "keys": n, "cpu_s": time.process_time() - c0}

    def placement(self) -> tuple[int, DurableState, int]:
        """``(partitions, durable state, layout generation)`` of the layout in force, taken together."""
        with self._layout_lock:
            return self.config.partitions, self.durable, self.layout_gen

    def close(self) -> None:
        self.stop()
        if self.side is not None:
            self.side.close()
        if self._spark is not None:
            self._spark.stop()
            self._spark = None

    def __enter__(self) -> SparkRuntime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _query_ckpt(self) -> str:
        return os.path.join(self.ckpt, "query")

    def _record_path(self, epoch: int) -> str:
        return record_path(self.ckpt, epoch)

    def last_recorded_epoch(self) -> int:
        """The newest epoch with a record (records are only ever added, so probe forward from the last)."""
        e = getattr(self, "_known_epoch", None)
        if e is None:
            names = [n for n in os.listdir(records_dir(self.ckpt)) if n.endswith(".msgpack")]
            e = max((int(n.split(".")[0]) for n in names), default=-1)
        while os.path.exists(self._record_path(e + 1)):
            e += 1
        self._known_epoch = e
        return e

    def read_record(self, epoch: int) -> EpochRecord | None:
        return read_record(self._record_path(epoch))

    def _write_record(self, rec: EpochRecord) -> None:
        self.files.create(self._record_path(rec.epoch), encode_record(rec))

    # -- object storage ---------------------------------------------------------------------------------------
    def _open_durable(self, name: str) -> DurableState:
        """The durable state of the layout ``name``: its directory under the checkpoint, with object storage the
        cache of ``<storage>/<name>/`` (a follower: the executors write its partitions), each partition's manifest
        taken from there (a checkpoint directory moving onto object storage uploads what it has)."""
        root = os.path.join(self.ckpt, name)
        if self.storage is None:
            return DurableState(root)
        durable = DurableState(root, remote=Prefixed(self.storage, name), follow=True)
        for pid in range(self.config.partitions if hasattr(self, "config") else 0):
            durable.hydrate(pid)
        return durable

    def durable_location(self, durable: DurableState | None = None) -> str:
        """Where the executors (and Spark jobs reading state) find ``durable`` (default: the layout in force): its
        directory, or with object storage ``<storage URL>/<state dir>`` (:func:`charon.state.durable.durable_at`)."""
        d = durable if durable is not None else self.durable
        if self.storage is None or self.config.storage_url is None:
            return d.root
        return f"{storage_location(self.config.storage_url)}/{os.path.basename(d.root)}"

    def _stored_layouts(self, keep: str) -> list[str]:
        """The state directories on object storage other than ``keep`` (a rescale's old one, or a new one a crash
        left before its commit point): one listing, at the start."""
        assert self.storage is not None
        names = {o.key.split("/", 1)[0] for o in self.storage.list("state")}
        return sorted(n for n in names if n != keep and (n == "state" or n.startswith("state-")))

    # -- bulk load --------------------------------------------------------------------------------------------
    def load_dataframe(self, df: Any) -> int:
        """Initial state from a DataFrame (operator, key, item, value: msgpack bytes) as the first snapshot."""
        if self.last_epoch >= 0:
            raise RuntimeError("bulk load is only possible before the first epoch")
        fn = partial(write_bases, self.durable_location(), self.config.partitions)
        parts = self.config.partitions
        rdd = df.rdd.keyBy(lambda r: partition_of(r[0], r[1], parts)).partitionBy(parts).values()
        return sum(rdd.mapPartitions(fn).collect())

    def load_rows(self, rows: Iterable[tuple[str, str, str, bytes]]) -> int:
        """Initial state from ``(operator, key, item, value: msgpack bytes)`` rows, written by this process
        straight into the durable copy as the first snapshot (epoch -1): no Spark session, no job, no
        request per key. The fastest import path for a state that fits in this process's memory (1M accounts
        load in a few seconds); each executor copies its partitions into its local store at the first epoch.
        Returns the number of items written."""
        if self.last_epoch >= 0:
            raise RuntimeError("bulk load is only possible before the first epoch")
        return sum(write_bases(self.durable_location(), self.config.partitions, rows))

    def load(self, operator: str, values: dict[str, Any]) -> int:
        """Bulk-load entity values from the driver (small states; use :meth:`load_rows` or
        :meth:`load_dataframe` for big ones)."""
        rows = [(operator, k, "", serde.encode(v)) for k, v in values.items()]
        df = self.spark.createDataFrame(rows, "operator string, key string, item string, value binary")
        return self.load_dataframe(df)

    # -- requests ---------------------------------------------------------------------------------------------
    async def submit(
        self, operator: str, key: str, function: str, args: list | tuple = (), *, request_id: str | None = None,
        timeout: float = 120.0,
    ) -> Reply:
        """Append a request (group-committed) and wait for its reply in the output log; refused with
        :class:`~charon.errors.EngineUnavailable` once the runtime gave up (nothing would run it)."""
        from charon.log.client import LogClient

        if self._fatal is not None:
            raise EngineUnavailable(f"the runtime stopped: {self._fatal}")
        await self.controller.wait_admin()  # an admin update runs alone: new requests wait for it
        if self._log_client is None:
            self._log_client = LogClient(self.input_log, self.output_log)
        self.controller.submitting += 1  # admin updates wait for these to finish
        try:
            return await self._log_client.submit(operator, key, function, args, request_id=request_id,
                                                 timeout=timeout)
        finally:
            self.controller.submitting -= 1

    async def invoke(self, operator: str | Operator, key: str, function: str | Function, *args: Any,
                     request_id: str | None = None, timeout: float = 120.0) -> Any:
        """Like :meth:`submit` but returns the value, with the errors of ``InProcessRuntime.invoke`` and the HTTP
        clients: refusals (``UnknownFunction``, ``BadArguments``, ...) before the log, an abort as
        :class:`~charon.errors.TransactionAborted` (see :mod:`charon.errors`)."""
        op = operator.name if isinstance(operator, Operator) else operator
        fn = function.name if isinstance(function, Function) else function
        arglist = list(args)
        self.app.validate(op, fn, arglist, key=key)
        serde.check_value(arglist)
        if request_id is not None and is_reserved_id(request_id):  # the engine's own (timers, continuations...)
            raise ReservedRequestId(f"request id {request_id!r} is reserved for the engine's own transactions")
        return raise_for_reply(await self.submit(op, key, fn, arglist, request_id=request_id, timeout=timeout))

    def get_reply(self, request_id: str) -> Reply | None:
        return self.output_log.get(request_id)

    def wait_idle(self, timeout: float = 300.0) -> None:
        """Block until every request appended so far has been run and nothing is deferred."""
        deadline = time.monotonic() + timeout
        while True:  # a networked log may be reconnecting (it fails at once meanwhile): wait for it here too
            try:
                target = self.input_log.end_offsets()
                break
            except OSError:  # NatsLogError is an OSError
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        while time.monotonic() < deadline:
            if self._fatal is not None:
                raise EngineUnavailable(f"the runtime stopped: {self._fatal}")
            rec = self.read_record(self.last_recorded_epoch())
            if rec is not None and not rec.deferred and all(e >= t for e, t in zip(*pad_pair(rec.ends, target),
                                                                                  strict=True)):
                return
            time.sleep(0.05)
        raise TimeoutError("the runtime did not become idle")

    # -- one epoch per micro-batch ----------------------------------------------------------------------------
    def _on_batch(self, df: Any, batch_id: int) -> None:
        with self._epoch_cv:
            if self._stopping:  # fail the batch: Spark does not commit it, a restart runs it
                raise _Stopping(f"the runtime is stopping; epoch {batch_id} runs after the restart")
            self._in_epoch = True
        try:
            self._run_batch(int(batch_id))
        finally:
            with self._epoch_cv:
                self._in_epoch = False
                self._epoch_cv.notify_all()

    def _run_batch(self, epoch: int) -> None:
        ex = self.exchange
        pending, ex.pending = ex.pending, None
        done = self.read_record(epoch)
        if done is not None:  # already run before a crash: its state and replies are durable
            if self._status == "recovering":
                self._status = "ok"
            self.output_log.mark_epoch(epoch)
            if done.deferred:  # the crash may have come before the tick that runs the deferred transactions
                self.input_log.append(Request(f"{TICK}{epoch}", TICK, "", "", serde.encode([])))
            return
        if pending is not None and pending[0].epoch != epoch - 1:  # pragma: no cover - Spark runs batches in order
            pending = None
        if pending is None:
            # epochs Spark committed whose deferred finalize was lost with a crash: run them again (a replay is
            # deterministic: same TIDs, same outcomes, replies already delivered are not delivered twice)
            for e in range(self.last_recorded_epoch() + 1, epoch):
                self._run_epoch(e, None, recovering=True)
        self._run_epoch(epoch, pending)

    def _run_epoch(self, epoch: int, pending: tuple[EpochRecord, EpochResult] | None, recovering: bool = False,
                   ) -> None:
        """Run epoch ``epoch`` (its first round also finalizes ``pending``, the previous epoch, whose record is
        written once that round returned). Its own finalize is deferred to the next epoch when the input log
        already holds more (so that the next micro-batch comes at once) and ``pipeline_finalize`` is on."""
        cpu0 = time.thread_time()  # this thread's CPU in the epoch, by phase (epoch stats driver_*_cpu_s)
        # Budgets stop functions in every run of an epoch (a rerun without them would hold the engine forever on
        # an endless function). A rerun (after a driver crash, or of an epoch Spark committed) whose earlier run
        # may have delivered replies takes no new verdict: only those its earlier runs recorded apply
        # (_record_verdict gives up instead); one whose earlier runs provably replied nothing judges anew.
        # A later epoch already started: this one ran before (epochs start in order) and its deferred finalize was
        # lost with a crash. The direct sequencer resumes it as the epoch in flight (not as a recovered one) when
        # the next epoch's bound was not durable yet; its earlier run may have replied all the same.
        rerun = recovering or self._attempts.failed_before(epoch) or self._attempts.epoch > epoch
        # durable before any reply of this run can go out, with the output log's end at its first start
        mark = self._attempts.reply_mark(epoch)
        q = self._query
        # the resident sequencer writes the file beside the epoch's bound, durable before a reply or the finalize;
        # a rerun counts its attempt before it runs (an epoch that kills the process is then seen failing)
        beside = partial(q.write_beside, epoch) if isinstance(q, DirectSequencer) and not rerun else None
        self._attempts.starting(epoch, self.output_log.last_seq() if mark is None else mark, later=beside)
        probe = None
        if self._probe_epoch == epoch:  # it failed before: find a transaction that kills its worker
            probe = os.path.join(self.ckpt, "probe", str(epoch))
            shutil.rmtree(probe, ignore_errors=True)
        self.exchange.set_budget(self.config.function_timeout, probe)
        prev = pending[0] if pending is not None else (self.read_record(epoch - 1) if epoch > 0 else None)
        if epoch > 0 and prev is None and self.last_recorded_epoch() >= 0:
            raise RuntimeError(f"epoch record {epoch - 1} is missing under {self.ckpt}")
        starts, ends = self._epoch_offsets(epoch)
        rows = self.input_log.read_range(starts, ends)
        requests = [(p, r) for p, _, r in rows if r.operator != TICK]
        now = max((r.ts for _, _, r in rows), default=None)  # logged: the epoch's time (ticks included)
        self._replied_epoch = epoch if rerun and self._replied_before(epoch, [r for _, r in requests], prev) else None
        cpu = {"read": time.thread_time() - cpu0, "deliver": 0.0}

        # the direct sequencer writes the epoch's bound while its first rounds run: durable before a reply or the
        # finalize depends on it
        bound_durable = partial(q.wait_durable, epoch) if isinstance(q, DirectSequencer) else (lambda: None)

        def deliver(replies: list[Reply]) -> None:
            bound_durable()
            if replies and self._unconfirmed is None:
                self._unconfirmed = epoch  # from here on, the state must reach this epoch before reads
            if replies:
                self._delivered.add(epoch)
            c = time.thread_time()
            self._replies.put(replies)
            observed = coord.trace
            taken = list(observed) if observed else []
            if taken:
                del observed[:]  # in place: a fallback running here appends to this same list
            cur = coord.current
            self.inspector.replied(replies, cur.requests if cur is not None else {}, taken, self._epoch_started)
            cpu["deliver"] += time.thread_time() - c

        def finalized(res: EpochResult) -> None:
            assert pending is not None and pending[0].epoch == res.epoch
            self._append_atom(res)
            crash_point("after_finalize", res.epoch)  # its state and atom are written, its record is not
            self._recorded(pending[0])

        def defer() -> bool:
            bound_durable()  # asked once the outcome is decided, before the finalize runs (now or deferred)
            if recovering or not self.config.pipeline_finalize or self.gate.closed_for(epoch + 1):
                return False  # paused after this epoch: it is recorded before the pause, as without pipelining
            return bool(coord.deferred) or any(t > e for t, e in zip(*pad_pair(self.input_log.end_offsets(), ends),
                                                                     strict=True))

        if not self.gate.try_enter(epoch):  # paused: the batch is fixed but its epoch does not start
            if pending is not None:  # the previous epoch, deferred, is finalized and recorded before the pause
                self._flush(pending)
                pending = None
            self.gate.enter(epoch)
        deferred = False
        try:
            # built after the gate: a code update or a rescale made at this boundary (while paused) applies to
            # this epoch (a rescale replaced the exchange and the partition count)
            coord = EpochCoordinator(
                self.app, self.exchange, sequencers=len(ends),
                max_invocations=self.config.max_invocations, on_replies=deliver, on_finalized=finalized,
                chunk=self._epoch_chunk(prev),
            )
            coord.timer_limit = self.config.max_timers_per_epoch
            coord.verdicts, coord.on_verdict = self.verdict_book.verdicts, self._record_verdict
            coord.observe = self.inspector.observe  # the tasks report what they ran beside their output
            self.inspector.replaying = recovering  # a recovered epoch's aborts were logged when they first ran
            self._epoch_started = time.time()
            self._coord = coord  # the supervisor maps a probed epoch's culprit TID to its request
            coord.next_due = math.inf if epoch == 0 else -math.inf
            if prev is not None:
                # the epoch's sequencer count is its end offsets' length: the log grew since prev -> rebase
                coord.sequencer = Sequencer.restore(prev.counters, prev.time)
                coord.sequencer.resize(len(ends))
                coord.next_due = prev.next_due
                coord.deferred = [(tid, serde.decode_request(b)) for tid, b in prev.deferred]
                coord.admission.restore(prev.admission)
            if self.controller.previous is not None:  # a compatible update: deferred transactions keep the old code
                coord.previous = (self.controller.previous[0], load_app(self.controller.previous[1]))
            self.exchange.stats = {}
            crash_point("before_epoch", epoch)
            result = coord.run_epoch(epoch, requests, now, prior=pending[1] if pending is not None else None,
                                     defer=defer)
            result.stats.update({"driver_read_cpu_s": cpu["read"], "driver_deliver_cpu_s": cpu["deliver"],
                                 "driver_cpu_s": time.thread_time() - cpu0})
            deferred = self._after_epoch(epoch, coord, result, starts, ends)
        finally:
            if not deferred:  # a deferred epoch stays the gate's running one until it is recorded
                self.gate.leave()

    def _unanswered(self) -> list[LiveRequest]:
        """The requests not answered yet, for the inspector: those submitted through this runtime still in the input
        log (requests other processes appended are not listed), the running epoch's, and the deferred ones."""
        out: dict[str, LiveRequest] = {}
        lc = self._log_client
        if lc is not None:
            out.update((r.request_id, (r, "pending", None)) for r in lc.waiting())
        coord = self._coord
        if coord is None:
            return list(out.values())
        cur = coord.current
        if cur is not None:
            done = cur.replies
            out.update((r.request_id, (r, "pending", self._epoch_started))
                       for t, r in list(cur.requests.items()) if t not in done)
        out.update((r.request_id, (r, "deferred", None)) for _, r in list(coord.deferred))
        return list(out.values())

    def _after_epoch(self, epoch: int, coord: EpochCoordinator, result: EpochResult, starts: list[int],
                     ends: list[int]) -> bool:
        """Record the epoch, or leave it pending (True) when its finalize was deferred to the next epoch."""
        if self.controller.previous is not None:
            self.controller.retire_previous(coord.deferred)
        if result.finalize is None:  # else the atom and this fault point come once the finalize ran
            self._append_atom(result)
            crash_point("after_finalize", epoch)
        stats = dict(result.stats)
        stats.update({f"spark_{k}": v for k, v in self.exchange.stats.items()})
        rec = EpochRecord(
            epoch, list(coord.sequencer.counters),
            [(tid, serde.encode_request(r)) for tid, r in coord.deferred], list(starts), list(ends), stats,
            coord.sequencer.time, coord.next_due, next_chunk=self._chunk(), admission=coord.admission.snapshot(),
        )
        if result.finalize is not None:  # written by the next epoch's first round, recorded after it
            if coord.deferred:  # the next epoch must come even if no request does
                self.input_log.append(Request(f"{TICK}{epoch}", TICK, "", "", serde.encode([])))
            crash_point("after_defer", epoch)
            self.exchange.pending = (rec, result)
            early = getattr(self.exchange, "prefinalize", None)
            if early is not None:  # the resident gang writes it now, while the next epoch is cut
                early(result.finalize)
            return True
        self._recorded(rec)
        if coord.deferred:
            self.input_log.append(Request(f"{TICK}{epoch}", TICK, "", "", serde.encode([])))
        return False

    def _chunk(self) -> int:
        """Transactions per chunk for the epochs to come (:func:`chunk_for` of the configuration)."""
        return chunk_for(self.config)

    def _epoch_chunk(self, prev: EpochRecord | None) -> int:
        """The chunk size of the epoch after ``prev``: the one ``prev`` recorded, else (no epoch recorded yet) the
        one the checkpoint's layout recorded at its first start, so that a replayed epoch is cut as its first run
        was whatever the configuration after a restart. Recorded by a build from before chunks (-1): whole epochs,
        as that build ran them (the next record then names the configuration's)."""
        if prev is not None:
            return max(prev.next_chunk, 0)
        return max(self._first_chunk, 0)

    def _write_replies(self, replies: list[Reply]) -> None:
        """The reply writer's write: into the output log, then a submit waiting here is woken at once."""
        self.output_log.put_many(replies)
        lc = self._log_client
        if lc is not None:
            lc.replies_written(replies)

    def _append_atom(self, result: EpochResult) -> None:
        """Append an epoch's atom of events once its finalize ran and before its record is written (the one
        place of this rule): right after the epoch for an undeferred finalize, from ``on_finalized`` (or a
        flush) for a deferred one, whose events are known only then. A replay of an unrecorded epoch
        re-derives the same atom, and ``append_atom`` appends an epoch's atom once."""
        if result.events:
            self.streams.append_atom(result.epoch, [(s, v) for _, s, v in result.events])

    def _recorded(self, rec: EpochRecord) -> None:
        """Write the record of an epoch whose state is durable at every partition (and whose atom is
        appended, :meth:`_append_atom`); then it counts as done."""
        epoch = rec.epoch
        self._replies.flush()  # a recorded epoch never runs again: its replies are in the log first
        if self.side is not None and self.side.ship():  # so are its atoms on object storage: a driver restored
            crash_point("after_side_files", epoch)  # from it has them (shipped, the record not written)
        self._write_record(rec)
        if self._unconfirmed is not None and self._unconfirmed <= epoch:
            self._unconfirmed = None
        self._delivered = {e for e in self._delivered if e > epoch}
        self._next_due = rec.next_due
        self.output_log.mark_epoch(epoch)  # the replies stream cuts its atoms here
        self.last_epoch = epoch
        self._failures.pop(epoch, None)
        self._gang_losses.pop(epoch, None)
        if self._status == "recovering":
            self._status = "ok"
        self.epoch_stats.append({"epoch": epoch, "recorded_at": time.time(), **rec.stats})
        keep = max(1, self.config.keep_epoch_stats)
        if len(self.epoch_stats) > 2 * keep:  # amortized: trim to the newest ``keep``
            del self.epoch_stats[:-keep]
        crash_point("after_record", epoch)
        if self.config.compact_every and epoch > 0 and epoch % self.config.compact_every == 0:
            self._start_compaction(epoch - 1)

    def flush(self) -> None:
        """Finalize and record an epoch whose finalize waits for the next epoch (call with the query stopped)."""
        ex = getattr(self, "exchange", None)
        pending = ex.pending if ex is not None else None
        if ex is None or pending is None:
            return
        ex.pending = None
        self._flush(pending)

    def _flush(self, pending: tuple[EpochRecord, EpochResult]) -> None:
        """Finalize a deferred epoch in a round of its own, then append its atom and write its record. The gate's
        running epoch ends either way: one whose finalize failed (a lost gang) runs again after the restart, and a
        pause or a rescale waiting for the boundary must not wait for it meanwhile."""
        rec, result = pending
        try:
            coord = EpochCoordinator(self.app, self.exchange, sequencers=len(rec.counters),
                                     max_invocations=self.config.max_invocations)
            coord.finalize(result)
            self._append_atom(result)
            crash_point("after_finalize", rec.epoch)
            self._recorded(rec)
        finally:
            self.gate.leave()

    def _start_compaction(self, upto: int) -> None:
        if self._compactor is not None and self._compactor.is_alive():
            return
        self._compactor = threading.Thread(target=self._compact, args=(upto,), daemon=True)
        self._compactor.start()

    def _compact(self, upto: int) -> None:
        """Merge durable deltas up to a Spark-committed epoch; truncate the log up to that snapshot; delete
        the state directory a rescale retired."""
        parts, durable, _ = self.placement()
        for pid in range(parts):
            durable.compact(pid, upto)
            crash_point("compaction", upto + 1)  # after the first partition: a compaction half done
        layout = read_layout(self.ckpt)  # the layout in force (never the one this compaction began on)
        if layout is not None:
            remove_old_layouts(self.ckpt, layout.state)
            if self.storage is not None:
                for name in [n for n in self._retired if n != layout.state]:
                    delete_prefix(self.storage, name + "/")
                    self._retired.remove(name)
        rec = self.read_record(upto)
        if rec is not None and self.config.truncate_log:
            self.input_log.truncate(rec.ends)
            self._retain(upto)
        trim_native_heap()

    def _retain(self, upto: int) -> None:
        """Disk retention after a compaction: request ids and their replies older than ``dedup_window_s``
        are forgotten (:class:`~charon.log.sqlite.DedupRetention`); epoch records older than the compacted
        epoch minus ``keep_epoch_records`` are deleted."""
        cfg = self.config
        self._retention.after_truncate()
        lo = upto - max(1, cfg.keep_epoch_records)
        known = getattr(self, "_known_epoch", None)
        if known is not None and known < lo:
            self._known_epoch = None  # probing forward from there would stop at a deleted record: rescan
        epochs = records_dir(self.ckpt)
        for name in os.listdir(epochs):
            if name.endswith(".msgpack") and name[:-8].isdigit() and int(name[:-8]) < lo:
                with contextlib.suppress(FileNotFoundError, StorageError):
                    self.files.remove(os.path.join(epochs, name))

    # -- control: the engine contract (charon.runtime.spark.engine) -----------------------------------
    def engine(self) -> SparkEngine:
        """This runtime under the engine contract (what the gateway, admin routes, metrics and CLI use)."""
        return self.controller

    @property
    def fatal(self) -> str | None:
        """Why the runtime gave up for good (None while it serves or recovers)."""
        return self._fatal

    @property
    def log_file(self) -> str:
        """Where Spark's JVM writes what it prints (``<data_dir>/spark.log``)."""
        return spark_log_path(self.config)

    def ship_code(self, ref: str) -> None:
        """Make the installed module of ``ref`` importable by the executors (a code update, before its switch)."""
        if ship_app_module(self.spark, ref):
            self._reship = True  # a running gang's tasks do not fetch files added after they started

    def set_exchange_code(self, ref: str, previous: tuple[int, str] | None) -> None:
        """The executors run ``ref`` from the next epoch on (and ``previous`` for the transactions below its
        TID); nothing to do before the first start (the query's start builds the exchange). A module shipped
        with ``addPyFile`` reaches a resident gang only in a new gang: the exchange is replaced (at the update's
        epoch boundary, nothing of an epoch in its tasks)."""
        ex = getattr(self, "exchange", None)
        if ex is None:
            return
        if self._reship and self.direct and self._spark is not None:
            self._reship = False
            self._new_exchange(self._spark)  # built with the runtime's app_ref and the controller's previous
            return
        ex.set_code(ref, previous, code_entries(self.controller.code))

    code_update_modes = SparkEngine.code_update_modes

    def inspect(
        self, operator: str, keys: list[str] | None = None, epoch: int | None = None, limit: int = 10_000
    ) -> tuple[int, dict[bytes, bytes]]:
        """``(epoch, rows)``: ``operator``'s state rows as of one recorded epoch, from the durable copy."""
        out = self.controller.inspect_now(operator, keys, epoch, limit)
        return out.epoch, out.rows

    def state_frame(self, operator: str, epoch: int | None = None) -> Any:
        """``operator``'s state as a Spark DataFrame (key, item, value, value_json, epoch) at one epoch (default:
        the last recorded), read from the durable copy by parallel tasks (:mod:`charon.runtime.spark.statesql`)."""
        from charon.runtime.spark.statesql import DataDirLayout, state_frame

        return state_frame(self.spark, self._data_layout(DataDirLayout), operator, epoch)

    def _data_layout(self, kind: Callable[[str, int, int, str], _Layout]) -> _Layout:
        """The layout in force and the settled epoch, both from the same side of a rescale."""
        for _ in range(5):
            parts, durable, gen = self.placement()
            epoch = self.settled_epoch()
            if gen == self.layout_gen:
                break
        return kind(self.durable_location(durable), parts, epoch, "spark")

    def sql(
        self, query: str, epoch: int | None = None, max_rows: int = 1000, timeout_s: float = 30.0,
        max_entities: int | None = None, max_bytes: int = 4 << 20, max_memory: int = 512 << 20,
    ) -> dict[str, Any]:
        """One safe SELECT over the operators' state at one recorded epoch (the dashboard's SQL box), answered
        by SQLite in the SQL sandbox, never in the engine's JVM (:meth:`SparkEngine.sql`). Blocking."""
        return self.controller.sql_now(query, epoch, max_rows, timeout_s,
                                       100_000 if max_entities is None else max_entities, max_bytes,
                                       max_memory).doc()

    # -- state inspection ---------------------------------------------------------------------------------------
    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        """An entity's value as of the last completed epoch (consistent: read at an epoch boundary)."""
        return self.read_state_at(operator, key, default)[1]

    def read_state_at(self, operator: str, key: str, default: Any = None) -> tuple[int, Any]:
        """``(epoch, value)``: an entity's value and the (recorded) epoch it reflects."""
        epoch, got = self.read_keys_at([store_key(operator, key)])
        raw = got.get(store_key(operator, key))
        return epoch, default if raw is None else serde.decode(raw)

    def settled_epoch(self, timeout: float = 60.0) -> int:
        """The last recorded epoch, after waiting for the epoch of the newest reply to be recorded.

        Replies go out early (before their epoch's state is finalized); waiting here gives a client that
        got a reply read-your-writes on the next state read, still read at an epoch boundary. A state that
        cannot reach the newest reply (the runtime failed, or it did not get there in ``timeout``) is not
        served: :class:`~charon.errors.EngineUnavailable`.
        """
        last = self.output_log.last_seq()
        newest = self.output_log.read_between(last - 1, last) if last > 0 else []
        want = newest[0][1].epoch if newest else -1
        deadline = time.monotonic() + timeout
        epoch = self.last_recorded_epoch()
        while epoch < want:
            if self._fatal is not None:
                raise EngineUnavailable(f"the runtime stopped: {self._fatal}")
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"epoch {want} (of the newest reply) is not recorded yet; retry later")
            time.sleep(0.01)
            epoch = self.last_recorded_epoch()
        return epoch

    def read_keys(self, keys: list[bytes]) -> dict[bytes, bytes | None]:
        """The values of ``keys`` as of one epoch boundary (see :meth:`read_keys_at`)."""
        return self.read_keys_at(keys)[1]

    def read_keys_at(self, keys: list[bytes]) -> tuple[int, dict[bytes, bytes | None]]:
        """``(epoch, values)``: every key as of the same recorded epoch (one consistent cut)."""
        if self._fatal is not None:
            raise EngineUnavailable(f"the runtime stopped: {self._fatal}")
        for attempt in range(5):
            parts, durable, gen = self.placement()
            epoch = self.settled_epoch()
            if gen != self.layout_gen:  # rescaled meanwhile: the epoch may be newer than that layout's state
                continue
            by_pid: dict[int, list[bytes]] = {}
            for k in keys:
                op, key, _ = split_store_key(k)
                by_pid.setdefault(partition_of(op, key, parts), []).append(k)
            items = list(by_pid.items())
            if not items:
                return epoch, {}
            try:
                if self.config.driver_reads:
                    return epoch, self._read_durable(durable, items, epoch)
                fn = partial(read_entities, self.app_ref, self.config.local_dir, self.durable_location(durable),
                             self.ckpt, epoch)
                return epoch, dict(self.spark.sparkContext.parallelize(items, len(items)).mapPartitions(fn).collect())
            except Exception as e:
                # a compaction after the epoch was chosen: read again at a newer one
                if "compacted" not in str(e) or attempt == 4:
                    raise
        raise EngineUnavailable("the layout kept changing during the read; retry")

    @staticmethod
    def _read_durable(durable: DurableState, items: list[tuple[int, list[bytes]]], epoch: int,
                      ) -> dict[bytes, bytes | None]:
        """Read keys from the durable copy in the driver, as of recorded epoch ``epoch``.

        As consistent as reading the executors' stores: every partition's delta of a recorded epoch is durable
        (the finalize round writes it before the record), deltas after ``epoch`` are skipped, and a base
        compacted past ``epoch`` raises (the caller reads again at a newer epoch). Much cheaper than a Spark
        job per read (no job, stage, task or py4j objects on the driver; benchmarks/state/state_reads.py), and it
        works while the query restarts. Its cost grows with the partition's durable files (a scan of their
        memory-mapped key columns): for very large states, ``driver_reads=False`` reads the executors' indexed
        stores with a Spark job instead.
        """
        out: dict[bytes, bytes | None] = {}
        for pid, keys in items:
            got, _ = durable.read_keys(pid, keys, epoch)
            out.update(got)
        return out

    def timers(self, operator: str, key: str) -> list[_timers.Timer]:
        """The pending timers an entity registered, as of the last recorded epoch (by id): read from the durable copy
        in the driver (``driver_reads``: no Spark job, so no free slot beside the resident gang is needed), else by
        a Spark job over the executor's store."""
        for attempt in range(5):
            for _ in range(5):
                parts, durable, gen = self.placement()
                epoch = self.settled_epoch()
                if gen == self.layout_gen:
                    break
            pid, prefix = partition_of(operator, key, parts), _timers.owner_prefix(operator, key)
            if not self.config.driver_reads:
                fn = partial(scan_prefix, self.config.local_dir, self.durable_location(durable), self.ckpt, epoch)
                rows = self.spark.sparkContext.parallelize([(pid, prefix)], 1).mapPartitions(fn).collect()
                return [_timers.decode(v) for _, v in rows]
            try:
                return [_timers.decode(v) for _, v in durable.iter_prefix(pid, epoch, prefix)]
            except DurableStateError:  # compacted past the epoch meanwhile: read again at a newer one
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def snapshot(self) -> dict[bytes, bytes]:
        """All committed state (from the durable copy, as of the last recorded epoch)."""
        parts, durable, _ = self.placement()
        epoch = self.last_recorded_epoch()
        merged: dict[bytes, bytes] = {}
        for pid in range(parts):
            if self.storage is not None or os.path.isdir(os.path.join(durable.root, f"p{pid}")):
                data, _ = durable.load(pid, epoch)
                merged.update(data)
        return dict(sorted(merged.items()))

    def replies(self) -> list[Reply]:
        return [r for _, r in self.output_log.read_since(0, limit=1 << 30)]

    def epoch_requests(self, epoch: int) -> list[tuple[int, Request]]:
        """The (log partition, request) pairs epoch ``epoch`` ran, from its record (for differential tests)."""
        rec = self.read_record(epoch)
        if rec is None:
            raise KeyError(epoch)
        return [(p, r) for p, _, r in self.input_log.read_range(rec.starts, rec.ends) if r.operator != TICK]
