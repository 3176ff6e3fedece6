"""What runtime control costs (in-process runtime, CPU time so other load on the machine matters little):

* metrics: CPU µs per request the gateway spends in :class:`charon.server.metrics.GatewayMetrics`
  (``observe_request`` + ``observe_reply``), and CPU ms per ``/metrics`` exposition;
* consistent reads: CPU ms of one cut over every entity (``InProcessRuntime.inspect``) per entity count;
* pause: wall ms from ``pause()`` to the ``paused`` state under load (an epoch finishing), and epochs run.

    .venv/bin/python benchmarks/observability/control_costs.py  # writes results/observability/control_costs.{json,png}
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from charon import InProcessRuntime, serde  # noqa: E402
from charon.apps import ycsb  # noqa: E402
from charon.messages import Reply, Request  # noqa: E402
from charon.server.metrics import GatewayMetrics  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "observability"


def metrics_cost(n: int = 50_000) -> dict[str, float]:
    rt = InProcessRuntime(ycsb.app, partitions=8)
    m = GatewayMetrics(rt, 8)
    reqs = [Request(f"r{i}", "account", ycsb.key(i % 1000), "transfer", serde.encode(["a1", 1])) for i in range(n)]
    reps = [Reply(f"r{i}", i, 0, i % 7 != 0, b"", "" if i % 7 else "NotEnoughCredit", "") for i in range(n)]
    t0 = time.process_time()
    for q, r in zip(reqs, reps, strict=True):
        m.observe_request(q)
        m.observe_reply(r, 0.003)
    per_req_us = (time.process_time() - t0) / n * 1e6
    t0 = time.process_time()
    for _ in range(100):
        m.exposition(0)
    expo_ms = (time.process_time() - t0) / 100 * 1e3
    return {"observe_per_request_us": per_req_us, "exposition_ms": expo_ms}


def cut_cost(sizes: tuple[int, ...] = (1_000, 10_000, 100_000)) -> dict[int, float]:
    out = {}
    for n in sizes:
        rt = InProcessRuntime(ycsb.app, partitions=8)
        rt.load("account", ycsb.initial_state(n, 10))

        async def read(rt: InProcessRuntime = rt, n: int = n) -> float:
            t0 = time.process_time()
            for _ in range(5):
                epoch, rows = await rt.inspect("account", limit=n + 1)
                assert len(rows) == n
            return (time.process_time() - t0) / 5 * 1e3

        out[n] = asyncio.run(read())
    return out


def pause_latency(trials: int = 20) -> list[float]:
    async def run() -> list[float]:
        rt = InProcessRuntime(ycsb.app, partitions=8, epoch_max_ms=1.0)
        rt.load("account", ycsb.initial_state(1000, 1_000_000))
        out = []
        async with rt:
            stop = asyncio.Event()

            async def load() -> None:
                i = 0
                while not stop.is_set():
                    rt.enqueue(Request(f"l{i}", "account", ycsb.key(i % 1000), "transfer",
                                       serde.encode([ycsb.key((i * 7) % 1000), 1])))
                    i += 1
                    if i % 50 == 0:
                        await asyncio.sleep(0)

            task = asyncio.create_task(load())
            for _ in range(trials):
                await asyncio.sleep(0.02)
                t0 = time.perf_counter()
                rt.pause()
                while rt.control_status()["state"] != "paused":
                    await asyncio.sleep(0)
                out.append((time.perf_counter() - t0) * 1e3)
                rt.resume()
            stop.set()
            await task
        return out

    return asyncio.run(run())


def main() -> None:
    res = {"metrics": metrics_cost(), "cut_cpu_ms": cut_cost(), "pause_to_paused_ms": pause_latency()}
    res["note"] = ("CPU time (process_time) except pause_to_paused_ms (wall); measured on a shared 2-core "
                   "machine; in-process runtime, YCSB-T accounts")
    (OUT / "control_costs.json").write_text(json.dumps(res, indent=2))
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    sizes = list(res["cut_cpu_ms"])
    ax[0].plot(sizes, [res["cut_cpu_ms"][s] for s in sizes], marker="o")
    ax[0].set(xscale="log", yscale="log", xlabel="entities in the cut", ylabel="CPU ms per consistent cut",
              title="consistent read of every entity")
    ax[1].hist(res["pause_to_paused_ms"], bins=20)
    ax[1].set(xlabel="ms from pause() to paused", ylabel="trials", title="pause under load (wall)")
    fig.suptitle(f"metrics: {res['metrics']['observe_per_request_us']:.1f} µs CPU per request, "
                 f"{res['metrics']['exposition_ms']:.2f} ms per /metrics scrape")
    fig.tight_layout()
    fig.savefig(OUT / "control_costs.png", dpi=100)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
