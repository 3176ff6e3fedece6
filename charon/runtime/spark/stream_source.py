"""``spark.readStream.format("charon_stream")``: an atomic output stream (``ctx.emit``) as a Spark source.

Usage::

    from charon.runtime.spark.stream_source import CharonStreamDataSource
    spark.dataSource.register(CharonStreamDataSource)   # or charon.runtime.spark.source.register(spark)
    df = (spark.readStream.format("charon_stream")
          .option("path", "<data_dir>/streams.sqlite").option("stream", "orders").load())

Options: ``path`` (required, the :class:`charon.log.streams.StreamLog` file; a deployment keeps it at
``<data_dir>/streams.sqlite``), ``stream`` (required), ``maxEventsPerBatch`` (default 10000: a micro-batch
holds whole atoms up to about this many events, and at least one whole atom), ``startingOffset`` (a fresh
query only: an event offset, default 0; ``"latest"`` starts at the stream's end).

Offsets: ``{"offset": end, "start": start}``: the micro-batch holds the events with ``start <= offset <
end``; ``end`` is always an atom boundary, so **every micro-batch is a sequence of whole atoms** (whole
epochs of the producing application). Spark replays a batch with the same offsets, so with a checkpoint
and an idempotent (or transactional) sink each atom reaches the sink exactly once.

Rows: ``stream STRING, offset LONG, epoch LONG, value BINARY`` (the event's msgpack encoding,
:func:`charon.serde.decode` in Python) ``, json STRING`` (the same value as JSON, for ``from_json``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

__all__ = ["STREAM_SCHEMA", "CharonStreamDataSource"]

DEFAULT_MAX_EVENTS = 10_000

STREAM_SCHEMA = StructType(
    [
        StructField("stream", StringType(), False),
        StructField("offset", LongType(), False),
        StructField("epoch", LongType(), False),
        StructField("value", BinaryType(), False),
        StructField("json", StringType(), True),
    ]
)

_open: dict[tuple[int, str], Any] = {}


def _log(path: str) -> Any:
    """One StreamLog per (process, path): Python workers are reused across tasks."""
    from charon.log.streams import StreamLog

    k = (os.getpid(), path)
    log = _open.get(k)
    if log is None:
        log = _open[k] = StreamLog(path)
    return log


class StreamRange(InputPartition):
    """Events ``start <= offset < end`` of one stream."""

    def __init__(self, path: str, stream: str, start: int, end: int) -> None:
        self.path, self.stream, self.start, self.end = path, stream, start, end

    def __repr__(self) -> str:
        return f"StreamRange({self.stream!r}, {self.start}, {self.end})"


class CharonStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of whole atoms of one output stream (see the module docstring)."""

    def __init__(self, options: Any) -> None:
        from charon.core.routing import check_stream

        for name in ("path", "stream"):
            if name not in options:
                raise ValueError(f"charon_stream needs option {name!r}")
        self.path = os.path.abspath(options["path"])
        self.stream = check_stream(options["stream"])
        self.max_events = int(options.get("maxEventsPerBatch", DEFAULT_MAX_EVENTS))
        if self.max_events < 1:
            raise ValueError("maxEventsPerBatch must be at least 1")
        self.starting = options.get("startingOffset", "0")
        self._target: int | None = None
        _log(self.path)  # creates the file if the producer has not yet

    def initialOffset(self) -> dict:
        if self.starting == "latest":
            return {"offset": _log(self.path).end_offset(self.stream)}
        return {"offset": int(self.starting)}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_events)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        s = int(start["offset"])
        ends = _log(self.path).atom_ends(self.stream, s, self._target)
        if not ends:
            return start
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        if isinstance(limit, ReadAllAvailable):
            cap = None
        end = ends[0]  # at least one whole atom, whatever its size
        for e in ends[1:]:
            if cap is not None and e - s > cap:
                break
            end = e
        return {"offset": end, "start": s}

    def reportLatestOffset(self) -> dict:
        return {"offset": _log(self.path).end_offset(self.stream)}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = _log(self.path).end_offset(self.stream)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        s, e = int(start["offset"]), int(end["offset"])
        return [StreamRange(self.path, self.stream, s, e)] if e > s else []

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        from charon import serde

        assert isinstance(partition, StreamRange)
        for ev in _log(partition.path).read_range(partition.stream, partition.start, partition.end):
            try:
                text = json.dumps(serde.decode(ev.value))
            except (TypeError, ValueError):
                text = None  # a value JSON cannot show (e.g. bytes): only the binary column has it
            yield (ev.stream, ev.offset, ev.epoch, ev.value, text)

    def commit(self, end: dict) -> None:
        """Nothing to do: the stream keeps its events (bounded by the producer's retention)."""

    def stop(self) -> None:
        k = (os.getpid(), self.path)
        log = _open.pop(k, None)
        if log is not None:
            log.close()


class CharonStreamDataSource(DataSource):
    """``spark.readStream.format("charon_stream")``: one Charon output stream."""

    @classmethod
    def name(cls) -> str:
        return "charon_stream"

    def schema(self) -> StructType:
        return STREAM_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return CharonStreamReader(self.options)
