"""Stream delivery latency: from an epoch's atom being appended (``ctx.emit`` events committed) to its
events being visible to a consumer.

A durable in-process node (``fsync=False``) runs one epoch every ``--interval-ms`` with one emitting
transaction (``tests/support/streams_app.py``'s ``credit``); the time each epoch's ``run_epoch`` returns is the
append time (the atom is in ``streams.sqlite`` by then). Consumers in the same process, all on the same
clock:

- ``poll``: a reader on its own SQLite connection polling ``StreamLog.read`` every 1 ms (what a
  consumer in another process sees);
- ``http``: ``Client.subscribe`` long-polling the gateway's ``GET /streams/credits`` (``--skip-http`` omits it);
- ``spark``: a Spark Structured Streaming query (``local[1]``) over ``charon_stream`` with the default
  trigger, timing each atom when its micro-batch reaches ``foreachBatch`` (``--skip-spark`` omits it).

The machine is shared (2 cores, several other processes): read the figures as orders of magnitude.

    .venv/bin/python benchmarks/streams/stream_latency.py --atoms 200 --interval-ms 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "support"))

from streams_app import app  # noqa: E402

from charon import InProcessRuntime, serde  # noqa: E402
from charon.bench.harness import percentile  # noqa: E402
from charon.log.streams import StreamLog  # noqa: E402
from charon.messages import Request  # noqa: E402


def summary(lat_ms: list[float]) -> dict[str, float]:
    s = sorted(lat_ms)
    return {"n": len(s), "p50_ms": percentile(s, 50), "p90_ms": percentile(s, 90), "p99_ms": percentile(s, 99),
            "max_ms": s[-1] if s else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--atoms", type=int, default=200)
    p.add_argument("--interval-ms", type=float, default=50.0)
    p.add_argument("--skip-spark", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--out", default=str(HERE.parent / "results" / "streams" / "stream_latency"))
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="charon-stream-lat-")
    rt = InProcessRuntime(app, partitions=2, data_dir=os.path.join(tmp, "node"), fsync=False)
    path = rt.streams.path
    appended: dict[int, float] = {}
    seen: dict[str, dict[int, float]] = {"poll": {}, "http": {}, "spark": {}}
    done = threading.Event()

    def poll() -> None:
        log = StreamLog(path, durable=False)
        off = 0
        while not done.is_set():
            r = log.read("credits", off, 1000)
            now = time.time()
            for ev in r.events:
                seen["poll"].setdefault(ev.epoch, now)
            off = r.next_offset
            if not r.events:
                time.sleep(0.001)
        log.close()

    threads = [threading.Thread(target=poll, daemon=True)]
    server = None
    if not a.skip_http:
        from charon.client import Client
        from charon.server.serve import BackgroundServer

        class _Reader:  # the gateway only reads this runtime's streams (epochs run on the bench thread)
            def __init__(self) -> None:
                self.app, self.streams = app, rt.streams

            async def start(self) -> None: ...

            async def stop(self) -> None: ...

        server = BackgroundServer(_Reader(), token="lat").start()  # type: ignore[arg-type]

        def http() -> None:
            off = 0
            with Client(server.url, token="lat") as c:
                while not done.is_set():
                    page = c.read_stream("credits", off, wait=0.5)
                    now = time.time()
                    for ev in page.events:
                        seen["http"].setdefault(ev.epoch, now)
                    off = page.next_offset

        threads.append(threading.Thread(target=http, daemon=True))
    query = spark = None
    if not a.skip_spark:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        from pyspark.sql import SparkSession

        from charon.runtime.spark.source import register

        spark = (SparkSession.builder.master("local[1]").appName("charon-stream-latency")
                 .config("spark.ui.enabled", "false").config("spark.python.unix.domain.socket.enabled", "true")
                 .config("spark.sql.shuffle.partitions", "1").getOrCreate())
        register(spark)

        def sink(df: object, batch_id: int) -> None:
            now = time.time()
            for r in df.select("epoch").collect():  # type: ignore[attr-defined]
                seen["spark"].setdefault(r.epoch, now)

        query = (spark.readStream.format("charon_stream").option("path", path).option("stream", "credits").load()
                 .writeStream.foreachBatch(sink).option("checkpointLocation", os.path.join(tmp, "ckpt")).start())
    for t in threads:
        t.start()
    time.sleep(3.0 if spark is not None else 0.5)  # the consumers are waiting before the first atom
    for i in range(a.atoms):
        t0 = time.monotonic()
        req = Request(f"c{i}", "acct", f"k{i % 7}", "credit", serde.encode([1, f"c{i}"]), time.time())
        epoch = rt.run_epoch([req]).epoch
        appended[epoch] = time.time()
        time.sleep(max(0.0, a.interval_ms / 1000 - (time.monotonic() - t0)))
    deadline = time.monotonic() + 60
    active = ["poll"] + ([] if a.skip_http else ["http"]) + ([] if a.skip_spark else ["spark"])
    while time.monotonic() < deadline and any(len(seen[k]) < len(appended) for k in active):
        time.sleep(0.1)
    done.set()
    for t in threads:
        t.join(5)
    if query is not None:
        query.stop()
        spark.stop()  # type: ignore[union-attr]
    if server is not None:
        server.stop()
    rt.close()
    shutil.rmtree(tmp, ignore_errors=True)

    results = {}
    for k in active:
        lat = [(seen[k][e] - t) * 1000 for e, t in appended.items() if e in seen[k]]
        results[k] = summary(lat)
        results[k]["missing"] = len(appended) - len(lat)
    doc = {"benchmark": "stream delivery latency (atom appended -> visible to the consumer)",
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, "
                      f"Python {platform.python_version()})",
           "generated": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "command": "benchmarks/streams/stream_latency.py " + " ".join(sys.argv[1:]),
           "atoms": a.atoms, "interval_ms": a.interval_ms, "results": results,
           "samples_ms": {k: [round((seen[k][e] - t) * 1000, 3) for e, t in appended.items() if e in seen[k]]
                          for k in active}}
    Path(a.out + ".json").write_text(json.dumps(doc, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in active:
        xs = sorted(doc["samples_ms"][k])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{k} (p50 {results[k]['p50_ms']:.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("append -> visible (ms, log scale)")
    ax.set_ylabel("fraction of atoms")
    ax.set_title("Charon output streams: delivery latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
