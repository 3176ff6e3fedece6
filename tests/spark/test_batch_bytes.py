"""An epoch (micro-batch) of the Spark source is bounded in bytes, not only in count (issue 22: a paused flood of
523 requests of 512 KB made one 268 MB epoch that ran Spark's JVM out of heap and hung its scheduler)."""

from __future__ import annotations

from pathlib import Path

from charon import serde
from charon.log.sqlite import InputLog
from charon.messages import Request
from charon.runtime.spark.source import CharonLogStreamReader


def test_a_batch_holds_at_most_max_bytes_and_always_one_request(tmp_path: Path) -> None:
    path = str(tmp_path / "input.sqlite")
    log = InputLog(path, partitions=2)
    big = "x" * 300_000
    log.append_many([Request(f"r{i}", "acc", f"k{i}", "blob", serde.encode([big])) for i in range(20)])
    reader = CharonLogStreamReader({"path": path, "maxRecordsPerBatch": "10000", "maxBytesPerBatch": "1000000"})
    start = reader.initialOffset()
    seen, batches = 0, 0
    while True:
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        if end == start:
            break
        n = sum(e - s for s, e in zip(start["offsets"], end["offsets"], strict=True))
        assert log.range_bytes(start["offsets"], end["offsets"]) <= 1_000_000 and 1 <= n <= 3, n
        seen += n
        batches += 1
        start = {"offsets": end["offsets"]}
    assert seen == 20 and batches >= 7
    # one request larger than the cap still makes a batch of its own (never stuck)
    log.append_many([Request("huge", "acc", "h", "blob", serde.encode(["y" * 1_500_000]))])
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert sum(e - s for s, e in zip(start["offsets"], end["offsets"], strict=True)) == 1
