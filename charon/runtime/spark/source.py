"""PySpark streaming data sources over Charon's logs: ``charon_log`` (input log) and ``charon_replies``.

Usage::

    from charon.runtime.spark.source import register, batch_offsets
    register(spark)
    df = spark.readStream.format("charon_log").option("path", log_path).load()
    q = df.writeStream.foreachBatch(run_epoch).option("checkpointLocation", ckpt).start()

``charon_log`` options
    ``path`` (required) the :class:`~charon.log.sqlite.InputLog` file or a NATS log URL
    (:mod:`charon.log.nats`); ``partitions`` (optional, checked against the log's routing count when the
    query starts); ``maxRecordsPerBatch`` (default 10000) caps a micro-batch,
    spread fairly over the log partitions; ``startRecordsPerBatch`` (default: ``maxRecordsPerBatch``, no ramp)
    caps the first micro-batch this reader plans (after a query start or restart), each next one may take
    ``RAMP_GROWTH`` (4) times as many, up to ``maxRecordsPerBatch``: a backlog left by a crash is not taken in
    one long epoch (a batch in Spark's offset log but not committed is replayed with its recorded offsets,
    never re-planned); ``startingOffsets`` (a fresh query only): ``"earliest"`` (default:
    the first retained offsets, i.e. all zeros for an untruncated log), ``"latest"``, or a JSON list with
    one offset per log partition. ``idleWaitMs`` (default 1000): when the log has nothing new, how long
    ``latestOffset`` waits for an append before answering "no data" (idle means idle; 0 = answer at once).

    Rows: ``partition INT, offset LONG, request_id STRING, operator STRING, key STRING, function STRING,
    args BINARY, ts DOUBLE``; within a log partition, in offset order.

Offsets (JSON, what Spark writes to ``<checkpoint>/offsets/<batch_id>`` *before* the batch runs)
    ``{"offsets": [end_0, ..., end_{n-1}], "start": [start_0, ..., start_{n-1}]}``: the batch covers the
    offsets ``[start_p, end_p)`` of every log partition ``p``. ``"start"`` is redundant with the previous
    batch's end; it makes each offset-log entry self-describing. The lists have one entry per physical log
    partition when the batch was planned: the reader reads the count from the log at every plan, so a log
    that grew (:meth:`~charon.log.sqlite.InputLog.resize`) is read from the next batch on, and a shorter
    list (from before) is padded with 0s (:func:`charon.log.offsets.pad_offsets`). The initial offset (and so
    an empty first batch) is ``{"offsets": [...]}`` without ``"start"``. Spark hands a batch's offsets back unchanged on
    replay, so a batch always re-reads exactly the same requests. Use :func:`batch_offsets` inside
    ``foreachBatch`` to get ``(starts, ends)`` of the running batch, then read the requests on the driver
    with :meth:`charon.log.sqlite.InputLog.read_range` (cheaper than collecting the DataFrame).

``charon_replies`` options: ``path`` (the :class:`~charon.log.sqlite.OutputLog`), ``maxRecordsPerBatch`` (default
    10000). Offsets ``{"seq": end, "start": start}``: the batch holds the replies with ``start < seq <= end``.
    Rows: ``seq LONG, request_id STRING, tid LONG, epoch LONG, ok BOOLEAN, value BINARY, error_type STRING,
    error_message STRING, position LONG``. Ordering replies by ``(epoch, position)`` gives a serial order
    equivalent to the execution (``seq`` is delivery order, not serial order; ``position`` is null only
    for replies recorded before positions existed). With a checkpoint, each reply reaches the consuming
    query's sink exactly once per committed batch, and each micro-batch's replies form one atom.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from charon.log.offsets import pad_offsets, pad_pair

if TYPE_CHECKING:
    from charon.log.contract import InputLogLike, OutputLogLike
    from charon.log.sqlite import InputLog

__all__ = [
    "LOG_SCHEMA",
    "REPLIES_SCHEMA",
    "CharonLogDataSource",
    "CharonRepliesDataSource",
    "batch_offsets",
    "cap_bytes",
    "cap_offsets",
    "read_offset_log",
    "register",
]

DEFAULT_MAX_RECORDS = 10000
DEFAULT_IDLE_WAIT_MS = 1000
RAMP_GROWTH = 4  # after a start, each planned batch's cap grows by this factor up to maxRecordsPerBatch
_IDLE_POLL_S = (0.002, 0.02)  # an idle wait looks for an append (a stat) every 2 ms, backing off to 20 ms

LOG_SCHEMA = StructType(
    [
        StructField("partition", IntegerType(), False),
        StructField("offset", LongType(), False),
        StructField("request_id", StringType(), False),
        StructField("operator", StringType(), False),
        StructField("key", StringType(), False),
        StructField("function", StringType(), False),
        StructField("args", BinaryType(), False),
        StructField("ts", DoubleType(), False),
    ]
)

REPLIES_SCHEMA = StructType(
    [
        StructField("seq", LongType(), False),
        StructField("request_id", StringType(), False),
        StructField("tid", LongType(), False),
        StructField("epoch", LongType(), False),
        StructField("ok", BooleanType(), False),
        StructField("value", BinaryType(), False),
        StructField("error_type", StringType(), False),
        StructField("error_message", StringType(), False),
        StructField("position", LongType(), True),
    ]
)

# One open log of each kind per (process, path): Python workers are reused across tasks.
_open_inputs: dict[tuple[int, str], InputLogLike] = {}
_open_outputs: dict[tuple[int, str], OutputLogLike] = {}


def _location(path: str) -> str:
    """A log location as given: a NATS URL unchanged, a file path made absolute."""
    from charon.log.location import is_networked

    return path if is_networked(path) else os.path.abspath(path)


def _input_log(path: str) -> InputLogLike:
    from charon.log.location import open_input_log

    k = (os.getpid(), path)
    log = _open_inputs.get(k)
    if log is None:
        log = _open_inputs[k] = open_input_log(path)
    return log


def _output_log(path: str) -> OutputLogLike:
    from charon.log.location import open_output_log

    k = (os.getpid(), path)
    log = _open_outputs.get(k)
    if log is None:
        log = _open_outputs[k] = open_output_log(path)
    return log


def _close_cached(path: str) -> None:
    k = (os.getpid(), path)
    for cache in (_open_inputs, _open_outputs):
        log = cache.pop(k, None)
        if log is not None:
            log.close()


def _max_records(options: Any) -> int:
    n = int(options.get("maxRecordsPerBatch", DEFAULT_MAX_RECORDS))
    if n < 1:
        raise ValueError(f"maxRecordsPerBatch must be >= 1, got {n}")
    return n


def _start_records(options: Any, max_records: int) -> int:
    n = int(options.get("startRecordsPerBatch", max_records))
    if n < 1:
        raise ValueError(f"startRecordsPerBatch must be >= 1, got {n}")
    return min(n, max_records)


def cap_offsets(starts: Sequence[int], ends: Sequence[int], max_records: int) -> list[int]:
    """End offsets of a batch of at most ``max_records`` entries starting at ``starts``.

    Water-filling: every partition with data gets an equal share, shares a partition cannot use go to the
    others; the remainder (< number of partitions) rotates with the start position, so no partition
    starves. Deterministic in its arguments.
    """
    avail = [max(0, e - s) for s, e in zip(starts, ends, strict=True)]
    if sum(avail) <= max_records:
        return [s + a for s, a in zip(starts, avail, strict=True)]
    n = len(avail)
    alloc = [0] * n
    left = max_records
    active = [p for p in range(n) if avail[p] > 0]
    while left > 0 and active:
        share = left // len(active)
        if share == 0:
            rot = sum(starts) % len(active)
            for p in (active[rot:] + active[:rot])[:left]:
                alloc[p] += 1
            break
        for p in active:
            g = min(share, avail[p] - alloc[p])
            alloc[p] += g
            left -= g
        active = [p for p in active if alloc[p] < avail[p]]
    return [s + a for s, a in zip(starts, alloc, strict=True)]


def cap_bytes(log: InputLog, starts: list[int], ends: list[int], max_bytes: int) -> list[int]:
    """Fewer entries while ``[starts, ends)`` of a SQLite input log (its ``range_bytes``) would hold more than
    ``max_bytes`` (at least one entry): an epoch's payload is bounded in bytes, not only in count (a flood of large
    requests once ran the JVM out of heap)."""
    total = log.range_bytes(starts, ends)
    n = sum(max(0, e - s) for s, e in zip(starts, ends, strict=True))
    while total > max_bytes and n > 1:
        n = max(1, min(n - 1, int(n * max_bytes / total)))
        ends = cap_offsets(starts, ends, n)
        total = log.range_bytes(starts, ends)
    return ends


class LogRange(InputPartition):
    """Offsets ``[start, end)`` of one input-log partition (one Spark task)."""

    def __init__(self, path: str, partition: int, start: int, end: int) -> None:
        self.path = path
        self.partition = partition
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"LogRange(partition={self.partition}, start={self.start}, end={self.end})"


class CharonLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Stream reader over an :class:`~charon.log.sqlite.InputLog`; see the module docstring."""

    def __init__(self, options: Any) -> None:
        if "path" not in options:
            raise ValueError("charon_log needs option 'path' (the input log file)")
        self.path = _location(options["path"])
        parts = options.get("partitions")
        from charon.log.location import is_networked, open_input_log

        # The reader is pickled to the Python workers: it keeps only plain attributes, logs are opened
        # per process through a module-level cache (see ``log``).
        with open_input_log(self.path, None if parts is None else int(parts)):
            pass  # checks the count (the physical count is read from the log at every plan: it can grow)
        self.networked = is_networked(self.path)
        self.max_records = _max_records(options)
        # bytes a batch may hold at most (0: no cap; a SQLite log only: a NATS log does not tell sizes cheaply)
        self.max_bytes = int(options.get("maxBytesPerBatch", 0))
        # the ramp after a (re)start: the cap of the next batch this reader plans (it lives as long as the query)
        self.ramp = _start_records(options, self.max_records)
        self.starting = options.get("startingOffsets", "earliest")
        self.idle_wait = int(options.get("idleWaitMs", DEFAULT_IDLE_WAIT_MS)) / 1000.0
        self._target: list[int] | None = None

    @property
    def log(self) -> InputLogLike:
        return _input_log(self.path)

    def initialOffset(self) -> dict:
        s = self.starting
        if s == "earliest":
            offs = self.log.start_offsets()
        elif s == "latest":
            offs = self.log.end_offsets()
        else:
            offs = [int(x) for x in json.loads(s)]
            n = self.log.partitions
            if len(offs) != n:
                raise ValueError(f"startingOffsets needs {n} offsets, got {offs}")
        return {"offsets": offs}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_records)

    def _stamp(self) -> tuple:
        """Changes whenever the log is written (SQLite WAL mode: the -wal file, or the db after a checkpoint;
        a NATS log: its end offsets, one request to the server)."""
        from charon.log.sqlite import write_stamp

        if self.networked:
            return tuple(self.log.end_offsets())
        return write_stamp(self.path)

    def _end_offsets(self, starts: list[int]) -> list[int]:
        """The log's end offsets; when nothing is new, wait up to ``idleWaitMs`` for an append first.

        Spark asks again every few milliseconds while a query is idle (trigger 0), each time a round trip
        JVM -> this process -> SQLite: an idle deployment would burn CPU. Waiting here on a file stamp makes
        idle cost a ``stat`` every 20 ms (2 ms right after activity), and an append is seen within that."""
        ends = self.log.end_offsets()
        if self.idle_wait <= 0 or any(e > s for s, e in zip(*pad_pair(starts, ends), strict=True)):
            return ends
        deadline = time.monotonic() + self.idle_wait
        stamp = self._stamp()
        pause, longest = _IDLE_POLL_S
        while time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(longest, pause * 1.5)
            now = self._stamp()
            if now != stamp:
                stamp = now
                ends = self.log.end_offsets()
                if any(e > s for s, e in zip(*pad_pair(starts, ends), strict=True)):
                    break
        return ends

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        starts = list(start["offsets"])
        ends = self._end_offsets(starts) if self._target is None else list(self._target)
        starts, ends = pad_pair(starts, ends)  # the log grew since the start offsets: new partitions from 0
        if isinstance(limit, ReadMaxRows):
            ends = cap_offsets(starts, ends, min(limit.max_rows, self.ramp))
        elif isinstance(limit, ReadMinRows):
            if sum(max(0, e - s) for s, e in zip(starts, ends, strict=True)) < limit.min_rows:
                return start
        # ReadAllAvailable and limits that do not apply to a log (files, bytes): everything up to ends.
        ends = [max(s, e) for s, e in zip(starts, ends, strict=True)]
        if self.max_bytes and not self.networked:
            ends = self._cap_bytes(starts, ends)
        if ends == starts:
            return start  # no new data (in the new partitions neither): Spark plans no batch
        self.ramp = min(self.max_records, RAMP_GROWTH * self.ramp)  # a batch is planned: the next may be bigger
        return {"offsets": ends, "start": starts}

    def _cap_bytes(self, starts: list[int], ends: list[int]) -> list[int]:
        from charon.log.sqlite import InputLog

        log = self.log
        assert isinstance(log, InputLog), log  # a SQLite log only (the caller checks): NATS does not tell sizes
        return cap_bytes(log, starts, ends, self.max_bytes)

    def reportLatestOffset(self) -> dict:
        return {"offsets": self.log.end_offsets()}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.log.end_offsets()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        s, e = pad_pair(start["offsets"], end["offsets"])
        return [LogRange(self.path, p, s[p], e[p]) for p in range(len(e)) if e[p] > s[p]]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa

        from charon.serde import decode_request

        assert isinstance(partition, LogRange)
        rows = _input_log(partition.path).read_raw(partition.partition, partition.start, partition.end)
        if not rows:
            return
        reqs = [decode_request(d) for _, d in rows]
        yield pa.RecordBatch.from_arrays(
            [
                pa.array([partition.partition] * len(rows), pa.int32()),
                pa.array([o for o, _ in rows], pa.int64()),
                pa.array([r.request_id for r in reqs], pa.string()),
                pa.array([r.operator for r in reqs], pa.string()),
                pa.array([r.key for r in reqs], pa.string()),
                pa.array([r.function for r in reqs], pa.string()),
                pa.array([r.args for r in reqs], pa.binary()),
                pa.array([r.ts for r in reqs], pa.float64()),
            ],
            schema=pa.schema(
                [
                    pa.field("partition", pa.int32(), False),
                    pa.field("offset", pa.int64(), False),
                    pa.field("request_id", pa.string(), False),
                    pa.field("operator", pa.string(), False),
                    pa.field("key", pa.string(), False),
                    pa.field("function", pa.string(), False),
                    pa.field("args", pa.binary(), False),
                    pa.field("ts", pa.float64(), False),
                ]
            ),
        )

    def commit(self, end: dict) -> None:
        """Nothing to do: retention (:meth:`InputLog.truncate`) follows the runtime's snapshots."""

    def stop(self) -> None:
        _close_cached(self.path)


class CharonLogDataSource(DataSource):
    """``spark.readStream.format("charon_log")``: the Charon input log as a stream."""

    @classmethod
    def name(cls) -> str:
        return "charon_log"

    def schema(self) -> StructType:
        return LOG_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return CharonLogStreamReader(self.options)


class SeqRange(InputPartition):
    """Replies with ``start < seq <= end``."""

    def __init__(self, path: str, start: int, end: int) -> None:
        self.path = path
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"SeqRange(start={self.start}, end={self.end})"


class CharonRepliesStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Stream reader over an :class:`~charon.log.sqlite.OutputLog`; see the module docstring."""

    def __init__(self, options: Any) -> None:
        if "path" not in options:
            raise ValueError("charon_replies needs option 'path' (the output log file)")
        self.path = _location(options["path"])
        from charon.log.location import open_output_log

        open_output_log(self.path).close()  # create it if missing; reopened per process (see ``log``)
        self.max_records = _max_records(options)
        self._target: int | None = None

    @property
    def log(self) -> OutputLogLike:
        return _output_log(self.path)

    def initialOffset(self) -> dict:
        return {"seq": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_records)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        s = int(start["seq"])
        last = self.log.last_seq() if self._target is None else self._target
        if isinstance(limit, ReadMaxRows):
            end = min(last, self.log.seq_after(s, limit.max_rows))
        elif isinstance(limit, ReadMinRows):
            end = last if len(self.log.read_between(s, last)) >= limit.min_rows else s
        else:
            end = last
        end = self._epoch_cut(s, end, last)
        if end <= s:
            return start
        return {"seq": end, "start": s}

    def _epoch_cut(self, s: int, end: int, last: int) -> int:
        """Move ``end`` to an epoch boundary so each micro-batch holds whole epochs (one atom per epoch).

        Logs written by the Spark runtime mark every finished epoch; a log without marks is cut as is.
        """
        later = self.log.epoch_boundaries(s, last)
        if not later:
            return s if self.log.epoch_boundaries(-1) else end  # marks exist: wait for a whole epoch
        within = [b for b in later if b <= end]
        return within[-1] if within else later[0]  # at least one whole epoch, even beyond the cap

    def reportLatestOffset(self) -> dict:
        return {"seq": self.log.last_seq()}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.log.last_seq()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        s, e = int(start["seq"]), int(end["seq"])
        return [SeqRange(self.path, s, e)] if e > s else []

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, SeqRange)
        for seq, r in _output_log(partition.path).read_between(partition.start, partition.end):
            yield (seq, r.request_id, r.tid, r.epoch, r.ok, r.value, r.error_type, r.error_message, r.position)

    def stop(self) -> None:
        _close_cached(self.path)


class CharonRepliesDataSource(DataSource):
    """``spark.readStream.format("charon_replies")``: the Charon output log as a stream."""

    @classmethod
    def name(cls) -> str:
        return "charon_replies"

    def schema(self) -> StructType:
        return REPLIES_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return CharonRepliesStreamReader(self.options)


def register(spark: Any) -> None:
    """Register the ``charon_log``, ``charon_replies`` and ``charon_stream`` data sources with a SparkSession."""
    from charon.runtime.spark.stream_source import CharonStreamDataSource

    spark.dataSource.register(CharonLogDataSource)
    spark.dataSource.register(CharonRepliesDataSource)
    spark.dataSource.register(CharonStreamDataSource)


def read_offset_log(checkpoint_location: str | os.PathLike[str], batch_id: int) -> list[dict] | None:
    """The source offsets Spark recorded for a batch (one dict per source, in query order), or None.

    Parses ``<checkpoint>/offsets/<batch_id>`` (line 1: version, line 2: metadata, then one JSON offset
    per source).
    """
    f = os.path.join(os.fspath(checkpoint_location), "offsets", str(batch_id))
    try:
        with open(f, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        return None
    return [json.loads(x) if x and x != "-" else {} for x in lines[2:]]


def batch_offsets(
    checkpoint_location: str | os.PathLike[str], batch_id: int, source_index: int = 0
) -> tuple[list[int], list[int]]:
    """``(starts, ends)`` of a ``charon_log`` micro-batch: it covers offsets ``[starts[p], ends[p])``.

    Call it inside ``foreachBatch(df, batch_id)`` with the query's checkpoint location (Spark writes the
    offsets before calling the batch function, so this is exactly what a replay of the batch sees).
    A batch whose end equals the previous batch's end is empty (``starts == ends``). ``starts`` has as many
    entries as ``ends`` (padded with 0s for partitions the log gained since the previous batch).
    """
    offs = read_offset_log(checkpoint_location, batch_id)
    if offs is None:
        raise FileNotFoundError(f"no offsets for batch {batch_id} under {checkpoint_location!r}")
    cur = offs[source_index]
    ends = list(cur["offsets"])
    if batch_id > 0:
        prev = read_offset_log(checkpoint_location, batch_id - 1)
        if prev is not None and list(prev[source_index].get("offsets", [])) == ends:
            return list(ends), ends
    return pad_offsets(cur.get("start", ends), len(ends)), ends
