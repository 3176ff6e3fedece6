"""Configuration of a deployment, with sane embedded defaults (Spark local mode, files under ./charon-data)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: How the Spark runtime's epochs reach the partitions (SparkConfig.exchange): the first is the default.
EXCHANGES = ("resident", "jobs")


@dataclass
class SparkConfig:
    """How the Spark runtime runs.

    Every field can also be set from the environment as ``CHARON_<FIELD>`` (upper case), e.g.
    ``CHARON_MASTER=spark://host:7077``; see :meth:`from_env`.
    """

    master: str = "local[*]"  # local[N], spark://host:port, yarn, k8s://...
    data_dir: str = "charon-data"  # input log, output log and (by default) the checkpoint location
    checkpoint: str | None = None  # durable state, epoch records and Spark's query checkpoint
    # object storage for everything durable that is not the log (s3://bucket/prefix or file:///dir, configured by
    # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...; docs/guides/object-storage.md): the durable state, layout, epoch
    # records, bounds, verdicts and code history; the checkpoint directory and the executors' local directories
    # are then caches (no directory shared by the executors). Needs exchange="resident"
    storage_url: str | None = None
    # ... and the driver's output streams there (charon.runtime.sidefiles): each epoch's atom as a small segment, the
    # whole file once the segments since its last snapshot number streams_snapshot_segments or hold as many bytes
    # as that snapshot (at least streams_snapshot_bytes, also the most a segment holds)
    streams_snapshot_segments: int = 1000
    streams_snapshot_bytes: int = 16 << 20
    log_url: str | None = None  # input/output logs on NATS JetStream (nats://host:port/deployment); default:
    # SQLite files under data_dir (see charon.log.nats)
    partitions: int = 4  # engine partitions (each with its own resident store)
    log_partitions: int | None = None  # input-log partitions = sequencers (default: partitions)
    max_batch: int = 10_000  # most requests per epoch (micro-batch)
    # most bytes of requests per epoch (SQLite log; at least one request): a flood of large requests is spread
    # over epochs instead of one epoch whose payload runs the JVM out of heap
    max_batch_bytes: int = 32 << 20
    # after a (re)start, the first new epoch takes at most this many requests, each next one 4x as many up to
    # max_batch: the backlog a crash left does not all land in one long epoch, so new commits come quickly
    restart_batch: int = 1000
    trigger_ms: int = 0  # micro-batch trigger interval; 0 = as soon as the previous one ends
    idle_wait_ms: int = 1000  # an idle source waits this long for an append before reporting "no data"
    local_dir: str | None = None  # executor-local store directory (default: per-executor temp dir)
    # compact durable deltas every N epochs (in the background; each compaction merges the whole state once, so with
    # millisecond epochs N bounds its CPU: 200 is about once a second at full load)
    compact_every: int = 200
    truncate_log: bool = True  # drop input-log entries older than the last compacted snapshot
    # request ids (dedup) and their replies are kept this long; a retry after the window may run again
    dedup_window_s: float = 7 * 24 * 3600.0
    keep_epoch_records: int = 100  # epoch records kept before the last compacted epoch
    max_invocations: int = 100_000  # most invocations of one transaction, over all partitions
    # seconds a function may run without awaiting a call (per function: @op.function(timeout=...)); see
    # charon.runtime.guard.watchdog.task_budget
    function_timeout: float = 5.0
    task_max_failures: int = 4  # Spark attempts per task (local[N,F] in local mode, spark.task.maxFailures)
    epoch_max_failures: int = 3  # query restarts on the same epoch before the runtime gives up (deterministic)
    restart_backoff_s: float = 1.0  # first delay before restarting a failed query; doubles, at most 30 s
    health_timeout_s: float = 1.0  # health() waits at most this long for the log (a hung log: reported down)
    task_min_bytes: int = 262_144  # a round's payload bytes per extra Spark task (small rounds: one task)
    single_task_rest: bool = True  # a small epoch's rest (from the round where it is small) in one task
    # ... "small": its messages and scratch under this many bytes (local mode: one job of one task beats a
    # job of two tasks per round on few cores, and conflicts make the rounds' payloads grow with the epoch)
    rest_max_bytes: int = 32 << 20
    # an epoch's rest as one job of several tasks, each over a group of partitions, rounds exchanged between the
    # tasks (SparkExchange.rest_split): on a cluster every rest over all executor cores (else a job per round); in
    # local mode a task per split_rest_min_bytes of it (else one task); at most split_rest_tasks (0: one per core)
    # and the partitions. split_rest:
    # "off" (the default: on local[2] one task measured faster, the driver and its JVM sharing the cores, and no
    # multi-machine cluster was at hand to show a split paying off, benchmarks/results/spark/spark_scaling.md),
    # "cluster" (on a cluster only) or "on" (local mode too)
    split_rest: str = "off"
    split_rest_min_bytes: int = 262_144
    split_rest_tasks: int = 0
    # how epochs reach the partitions: "resident" (the default, issue 32: one long-running barrier job hosts the
    # partitions and takes every round over sockets, charon.runtime.spark.resident; epochs fixed by the driver's
    # own loop, charon.runtime.spark.sequencer) or "jobs" (a Structured Streaming micro-batch per epoch and a
    # Spark job per round, SparkExchange: for clusters where a barrier gang cannot run, e.g. dynamic allocation;
    # docs/internals/resident.md)
    exchange: str = "resident"
    # tasks of the resident gang, each over a group of partitions (0: local mode its cores but one, at least one,
    # so a Spark job beside the gang finds a slot; a cluster every executor core); at most the partitions
    resident_tasks: int = 0
    # a task writes a finalize's partitions (a one-task rest's, a resident task's) in this many threads
    finalize_threads: int = 4
    single_task_fallback: bool = True  # an epoch's whole fallback (every wave) in one Spark job of one task
    pipeline_finalize: bool = True  # under load, an epoch's finalize rides in the next epoch's first round
    # Python's collector in the driver and the Python workers (charon.runtime.node.inprocess.tune_gc): what is alive
    # at start is frozen, young collections every gc_threshold allocations (0: CPython's defaults untouched)
    gc_threshold: int = 50_000
    driver_reads: bool = True  # state reads from the durable copy in the driver (False: a Spark job per read)
    stop_timeout_s: float = 60.0  # on stop, wait at most this long for the running epoch to finish
    keep_epoch_stats: int = 1000  # per-epoch statistics kept in memory (the newest N)
    driver_memory: str = "512m"  # the driver JVM's heap (in local mode also the executors'): bounds its RSS
    fixed_heap: bool = True  # -Xms = -Xmx, pre-touched: the JVM's RSS does not step up during a long run
    checkpoint_batches: int = 100  # micro-batches Spark's query checkpoint retains (minBatchesToRetain)
    max_timers_per_epoch: int = 10_000  # timers one partition fires per epoch (keep it fixed for a checkpoint)
    timer_poll_ms: int = 50  # an idle driver checks this often whether a timer is due (then appends a tick)
    # PYTHONHASHSEED of every Python worker (and PySpark's own default): str hashes, hence the iteration order
    # of sets of strings, are the same in every task, executor and driver restart (replays stay exact)
    python_hash_seed: str = "0"
    # run every function step twice on the same inputs and abort its transaction with NonDeterministicFunction
    # when the two runs' effects differ (charon.core.determinism; a development aid, ~2x the functions' CPU)
    determinism_check: bool = False
    # the invocation inspector (charon.runtime.control.inspector): on, records kept, bytes of them kept (the
    # oldest go first)
    inspector: bool = True
    inspector_records: int = 10_000
    inspector_bytes: int = 32 << 20
    app_name: str = "charon"
    spark_conf: dict[str, str] = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.abspath(self.checkpoint or os.path.join(self.data_dir, "checkpoint"))

    def default_partitions(self) -> int:
        """The engine partitions a new deployment gets when none are given (``charon run``, ``charon demo``): in
        local mode the resident gang's size (the cores but one, at least one: each task then hosts one partition,
        and a partition costs every round and every finalize its own work, so more partitions than tasks only
        slow epochs down); on a cluster :attr:`partitions` (4; a rescale changes it at run time)."""
        m = self.master.strip()
        if not m.startswith("local"):
            return self.partitions
        inner = m[len("local"):].strip("[]").split(",")[0].strip()
        cores = (os.cpu_count() or 1) if inner == "*" else int(inner) if inner.isdigit() else 1  # "local": one
        return max(1, cores - 1)

    @property
    def n_log_partitions(self) -> int:
        return self.log_partitions or self.partitions

    @classmethod
    def from_env(cls, **overrides: object) -> SparkConfig:
        """Defaults, then ``CHARON_*`` environment variables, then ``overrides``."""
        cfg = cls()
        for name, f in cls.__dataclass_fields__.items():
            raw = os.environ.get(f"CHARON_{name.upper()}")
            if raw is None or name == "spark_conf":
                continue
            cur = getattr(cfg, name)
            if isinstance(cur, bool):
                value: object = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(cur, float):
                value = float(raw)
            elif isinstance(cur, int) or f.type in ("int", "int | None"):
                value = int(raw)
            else:
                value = raw
            setattr(cfg, name, value)
        for k, v in overrides.items():
            if v is not None:
                if k not in cls.__dataclass_fields__:
                    raise TypeError(f"unknown setting {k!r}")
                setattr(cfg, k, v)
        if cfg.partitions < 1:
            raise ValueError("partitions must be at least 1")
        if cfg.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, not {cfg.exchange!r}")
        cfg.check_exchange()
        return cfg

    def check_exchange(self) -> None:
        """Refuse (``ValueError``) settings the chosen exchange cannot honour: a split rest (``split_rest`` "on" or
        "cluster") is a rest hook of the job-per-round exchange; the resident gang already steps its groups of
        partitions in parallel tasks and has no split rest (docs/internals/resident.md, Limits)."""
        if self.storage_url and self.exchange != "resident":
            raise ValueError("storage_url needs exchange='resident' (the job-per-round exchange's streaming query "
                             "keeps its own checkpoint in the checkpoint directory)")
        if self.exchange == "resident" and self.split_rest != "off":
            raise ValueError(f"split_rest={self.split_rest!r} needs exchange='jobs' (a split rest is the job-per-round "
                             "exchange's; the resident exchange, the default, has none: set split_rest='off' or "
                             "exchange='jobs')")


def _default_max_connections() -> int:
    """Half the process's open-file limit (the rest is for logs, stores and Spark), within [64, 4096]."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX
        return 512
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 2))


#: Replies a durable engine (and the gateway) keeps in memory for retries by default; older ones come from the
#: output log. ``charon run --reply-retention`` sets both.
DURABLE_REPLY_RETENTION = 10_000
#: The same for a volatile engine (``--ephemeral``, tests): nothing older can be answered, so it keeps more.
VOLATILE_REPLY_RETENTION = 100_000


@dataclass
class GatewayConfig:
    """Limits and settings of the HTTP gateway (each also ``CHARON_GATEWAY_<FIELD>`` in the environment)."""

    max_body: int = 1 << 20  # largest request body in bytes (413 above)
    # largest body of an effect worker's continuation (POST /effects/continue/..., that route only: it carries a
    # handler's value and the effect's carry, each up to CHARON_MAX_VALUE_BYTES); 0: twice that limit plus 1 MiB
    max_continuation_body: int = 0
    max_depth: int = 64  # deepest nesting of lists/maps in arguments (400 above)
    wait_timeout: float = 25.0  # a synchronous invoke still running after this answers 202 + status URL
    recent_replies: int = DURABLE_REPLY_RETENTION  # replies the gateway keeps for polling and retries (count) ...
    recent_bytes: int = 64 << 20  # ... and their total size in bytes
    # requests accepted and not answered yet (e.g. the backlog while paused), by their arguments' bytes (+512 each):
    # beyond it a new request is refused with 503 BacklogFull and Retry-After (nothing of it accepted)
    max_inflight_bytes: int = 256 << 20
    max_connections: int = field(default_factory=_default_max_connections)  # open connections; at the cap
    # the connection that has waited longest for its request head is closed to make room
    header_timeout: float = 10.0  # a connection must send a complete request head within this (seconds)
    body_timeout: float = 30.0  # a request body must arrive completely within this (408 otherwise)
    keep_alive: float = 5.0  # idle keep-alive connections are closed after this (seconds)
    max_header_bytes: int = 16 << 10  # largest request head (h11's incomplete-event limit)
    # pipelined requests waiting behind the one being answered, per connection (httptools): the last one kept
    # answers with Connection: close, those beyond it are dropped unanswered (the client retries them)
    max_pipeline: int = 128
    read_threads: int = 8  # threads for runtime reads (replies, state), off the event loop
    public_url: str | None = None  # base of status URLs (e.g. https://api.example.com); None: relative URLs
    max_batch_calls: int = 1000  # invocations in one client atomic batch (POST /batch; 422 above)
    stream_max_events: int = 1000  # events per GET /streams page (whole atoms; a larger first atom is whole)
    stream_max_waiters: int = 256  # concurrent long polls and server-sent-event connections (503 above)
    stream_sse_seconds: float = 300.0  # a server-sent-event connection ends after this; resume by offset
    max_scan: int = 10_000  # most entities one admin state read returns (/admin/state)
    max_scan_bytes: int = 8 << 20  # most bytes of entity rows one /admin/state page holds (it stops early, with next)
    max_partitions: int = 64  # largest engine partition count POST /admin/rescale accepts (400 above)
    code_refs: str | None = None  # comma-separated "module:attribute" refs /admin/code may deploy (None: none)
    sql_max_rows: int = 1000  # rows one /admin/sql answer returns (the rest: "truncated": true)
    sql_timeout_s: float = 30.0  # an /admin/sql query is cancelled after this (408 SQLTimeout)
    sql_max_chars: int = 10_000  # longest /admin/sql query text (400 above)
    sql_max_entities: int = 100_000  # /admin/sql: most entities of one operator it loads (413 above)
    sql_max_result_bytes: int = 4 << 20  # /admin/sql: largest answer, bytes of JSON rows (413 SQLResultTooLarge)
    sql_max_memory: int = 512 << 20  # /admin/sql: address space of the query's sandbox process (422 SQLTooExpensive)
    metrics_samples: int = 10_000  # recent replies the dashboard's throughput and percentiles are computed from
    metrics_history_samples: int = 900  # the dashboard's charts: one sample a second kept (15 minutes) ...
    metrics_history_bytes: int = 2 << 20  # ... and at most this many bytes of them (JSON); the oldest go first
    # POST /invoke answered from the HTTP protocol without an ASGI task where its checks run on the loop (the
    # in-process node): same checks and answers, about a third less server CPU per request (charon.server.lane)
    direct_invoke: bool = True
    # OpenTelemetry traces (charon.server.tracing): the OTLP/HTTP endpoint spans go to (e.g. http://collector:4318);
    # None: off, unless the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT variables name one
    otel_endpoint: str | None = None
    otel_max_queue: int = 2048  # spans waiting for export at most (more are dropped and counted by the SDK)
    otel_max_attribute_chars: int = 256  # longest span attribute value (a key, a function name...), cut beyond
    otel_function_spans: int = 1000  # function spans per traced request at most (its call graph's nodes); 0: none
    # one epoch span per epoch (a trace of its own, linked to its requests) instead of one under each request
    otel_shared_epoch_spans: bool = False
    # the share of requests without a sampled parent that are traced (0..1; parent-based: a client's traceparent
    # decides for its requests); 1.0: the SDK's sampler, from OTEL_TRACES_SAMPLER[_ARG] (default: every request)
    otel_sample_ratio: float = 1.0

    @classmethod
    def from_env(cls, **overrides: object) -> GatewayConfig:
        """Defaults, then ``CHARON_GATEWAY_*`` environment variables, then ``overrides`` that are not None."""
        cfg = cls()
        for name in cls.__dataclass_fields__:
            raw = os.environ.get(f"CHARON_GATEWAY_{name.upper()}")
            if raw is not None:
                cur = getattr(cfg, name)
                if isinstance(cur, bool):
                    value: object = raw.lower() in ("1", "true", "yes", "on")
                else:
                    value = raw if cur is None or isinstance(cur, str) else type(cur)(raw)
                setattr(cfg, name, value)
        for k, v in overrides.items():
            if k not in cls.__dataclass_fields__:
                raise TypeError(f"unknown gateway setting {k!r}")
            if v is not None:
                setattr(cfg, k, v)
        return cfg
