"""A downstream Spark query over a Charon output stream, run as a subprocess (so it can be SIGKILLed).

    python tests/support/stream_consumer.py STREAMS_DB STREAM CHECKPOINT SINK_DB UNTIL [CRASH_BATCH]

Reads ``charon_stream`` in micro-batches of at most 7 events (whole atoms) and writes each batch to the
SQLite sink in one transaction keyed by the batch id (a replayed batch id is recorded in ``replays`` and
not written again: the idempotent sink that makes the query exactly once). With CRASH_BATCH it SIGKILLs
itself right after the sink committed that batch (before Spark's commit log has it). Exits once the sink
holds UNTIL events.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import time

from pyspark.sql import SparkSession

from charon.runtime.spark.source import register


def main() -> int:
    streams_db, stream, ckpt, sink_db, until = sys.argv[1:6]
    crash_batch = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    sink = sqlite3.connect(sink_db, isolation_level=None, check_same_thread=False)  # foreachBatch: another thread
    sink.execute("CREATE TABLE IF NOT EXISTS batches (batch INTEGER PRIMARY KEY, lo INTEGER, hi INTEGER)")
    sink.execute("CREATE TABLE IF NOT EXISTS rows (batch INTEGER, offset INTEGER, epoch INTEGER, value BLOB)")
    sink.execute("CREATE TABLE IF NOT EXISTS replays (batch INTEGER, same INTEGER)")

    def write(df: object, batch_id: int) -> None:
        rows = sorted((r.offset, r.epoch, bytes(r.value)) for r in df.collect())  # type: ignore[attr-defined]
        lo, hi = (rows[0][0], rows[-1][0]) if rows else (-1, -1)
        sink.execute("BEGIN IMMEDIATE")
        prev = sink.execute("SELECT lo, hi FROM batches WHERE batch = ?", (batch_id,)).fetchone()
        if prev is not None:
            sink.execute("INSERT INTO replays VALUES (?, ?)", (batch_id, int(prev == (lo, hi))))
        else:
            sink.execute("INSERT INTO batches VALUES (?, ?, ?)", (batch_id, lo, hi))
            sink.executemany("INSERT INTO rows VALUES (?, ?, ?, ?)", [(batch_id, *r) for r in rows])
        sink.execute("COMMIT")
        if batch_id == crash_batch and prev is None:
            os.kill(os.getpid(), signal.SIGKILL)

    spark = (
        SparkSession.builder.master("local[1]").appName("charon-stream-consumer")
        .config("spark.python.unix.domain.socket.enabled", "true")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
        .getOrCreate()
    )
    register(spark)
    q = (
        spark.readStream.format("charon_stream").option("path", streams_db).option("stream", stream)
        .option("maxEventsPerBatch", "7").load()
        .writeStream.foreachBatch(write).option("checkpointLocation", ckpt)
        .trigger(processingTime="100 milliseconds").start()
    )
    print("started", flush=True)
    while sink.execute("SELECT count(*) FROM rows").fetchone()[0] < int(until):
        if q.exception() is not None:
            print(q.exception(), file=sys.stderr)
            return 1
        time.sleep(0.1)
    q.stop()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
