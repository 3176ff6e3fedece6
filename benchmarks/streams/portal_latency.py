"""Latency of a portal round trip and of stream delivery, in-process and on durable nodes.

* **portal round trip**: ``asker/k.go`` commits ``ctx.ask("echo.ping", k)``; the router submits it to the
  ``echo`` application, and the reply resumes ``asker/k.done``, which emits to stream ``done``; measured from
  the submission of ``go`` until that event is readable (three transactions in two applications, at least
  three epochs).
* **stream delivery**: ``emitter/k.emit`` emits one event; measured from its submission until a second
  ``StreamLog`` on the same file (what another process's consumer uses) reads the event, polling every 1 ms.

Both one request at a time (``--n`` each) on volatile runtimes and on durable nodes (``fsync=False``).
Wall times on a shared 2-core machine are disturbed by other processes; the CPU time of this process per
operation (``time.process_time``) is reported alongside.

    .venv/bin/python benchmarks/streams/portal_latency.py --n 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from charon import Application, Context, Deployment, InProcessRuntime, Operator  # noqa: E402
from charon.bench.harness import percentile  # noqa: E402
from charon.log.streams import StreamLog  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "streams"

asker = Operator("asker")
echo_op = Operator("echo")


@asker.function
async def go(ctx: Context) -> str:
    return ctx.ask("echo.ping", ctx.key, ctx.key, then="done")


@asker.function
async def done(ctx: Context, reply: dict) -> None:
    ctx.emit("done", reply["value"])


@asker.function
async def emit(ctx: Context) -> None:
    ctx.emit("events", ctx.key)


@echo_op.function
async def ping(ctx: Context, v: str) -> str:
    ctx.put(ctx.get(0) + 1)
    return v


asker_app = Application("asker", [asker], uses=["echo.ping"])
echo_app = Application("echo", [echo_op], portals={"ping": ("echo", "ping")})


async def _wait(log: StreamLog, stream: str, offset: int) -> None:
    while log.end_offset(stream) <= offset:
        await asyncio.sleep(0.001)


async def measure(durable: bool, n: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        kw = [{"data_dir": f"{tmp}/{a}", "fsync": False} if durable else {} for a in ("asker", "echo")]
        a = InProcessRuntime(asker_app, partitions=2, **kw[0])
        e = InProcessRuntime(echo_app, partitions=2, **kw[1])
        out: dict[str, dict[str, float]] = {}
        async with a, e, Deployment([a, e], poll_s=0.001):
            reader = StreamLog(a.streams.path, durable=False)
            for name, fn, stream in (("portal_round_trip", "go", "done"), ("stream_delivery", "emit", "events")):
                lat: list[float] = []
                cpu0 = time.process_time()
                for i in range(n + 20):  # the first 20 warm up
                    t0 = time.perf_counter()
                    await a.submit("asker", f"k{i}", fn, [])
                    await _wait(reader, stream, i)
                    if i >= 20:
                        lat.append((time.perf_counter() - t0) * 1000)
                cpu = (time.process_time() - cpu0) / (n + 20) * 1000
                out[name] = {"n": n, "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90),
                             "p99_ms": percentile(lat, 99), "mean_ms": sum(lat) / len(lat), "cpu_ms_per_op": cpu}
            reader.close()
        for rt in (a, e):
            rt.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    results = {"volatile": asyncio.run(measure(False, args.n)), "durable": asyncio.run(measure(True, args.n))}
    (OUT / "portal_latency.json").write_text(json.dumps(
        {"command": f"benchmarks/streams/portal_latency.py --n {args.n}", "results": results}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, xs = [], 0
    for mode, r in results.items():
        for metric, v in r.items():
            ax.bar(xs, v["p50_ms"], color="C0" if metric.startswith("portal") else "C1")
            ax.errorbar(xs, v["p50_ms"], yerr=[[0], [v["p99_ms"] - v["p50_ms"]]], color="k", capsize=4)
            labels.append(f"{metric.replace('_', ' ')}\n{mode}")
            xs += 1
    ax.set_xticks(range(xs), labels, fontsize=8)
    ax.set_ylabel("ms (bar p50, whisker p99)")
    ax.set_title("Portal round trip and stream delivery latency (one at a time)")
    fig.tight_layout()
    fig.savefig(OUT / "portal_latency.png", dpi=120)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
