"""Durable effects: round-trip latency and executor throughput.

On the durable in-process node (fsync per epoch) with the effect executor in the same process (as
``charon run --effects``): an effect's round trip is from its transaction's commit (the reply of the
request that called ``ctx.effect``) to its continuation's commit (the reply of ``<effect id>.done``), through a
handler that sleeps ``--handler-ms`` (0: returns at once; the outside world's latency is not Charon's).
Latency: one effect at a time, p50/p99. Throughput: ``--burst`` effects requested at once, effects per second
from the first request to the last continuation committed. Writes ``benchmarks/results/effects/effects_latency.json``.

    .venv/bin/python benchmarks/effects/effects_latency.py --effects 300 --burst 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from charon import Application, Context, InProcessRuntime, Operator, serde
from charon.bench.harness import percentile
from charon.runtime.effects import EffectExecutor, engine_resume

OUT = Path(__file__).resolve().parents[1] / "results" / "effects" / "effects_latency.json"
HANDLER_S = 0.0

acct = Operator("acct")


@acct.function(public=True)
async def pay(ctx: Context, amount: int) -> str:
    ctx.put(amount)
    return ctx.effect("charge", amount, then=paid, timeout=10.0, attempts=3)


@acct.function(public=True)
async def paid(ctx: Context, result: dict) -> None:
    ctx.put_item("paid", result["ok"])


app = Application("fxbench", [acct])


@app.effect_handler("charge")
async def charge(idempotency_key: str, amount: int) -> int:
    if HANDLER_S:
        await asyncio.sleep(HANDLER_S)
    return amount


async def _done(eng, eid: str, poll_s: float = 0.0005) -> float:
    while eng.get_reply(eid + ".done") is None:
        await asyncio.sleep(poll_s)
    return time.perf_counter()


async def run(n: int, burst: int, concurrency: int, partitions: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="charon-fx-bench-")
    rt = InProcessRuntime(app, partitions=partitions, data_dir=os.path.join(tmp, "node"))
    await rt.start()
    eng = rt.engine()
    ex = EffectExecutor(app, eng.streams, engine_resume(eng.submit), concurrency=concurrency)  # as charon run --effects
    await ex.start()
    try:
        lat: list[float] = []
        tx: list[float] = []  # the calling transaction's own round trip (submit -> reply), for the ratio
        for i in range(n + 20):
            ts = time.perf_counter()
            reply = await eng.submit("acct", f"l{i}", "pay", [i])
            t0 = time.perf_counter()
            t1 = await _done(eng, serde.decode(reply.value))
            if i >= 20:  # warm-up
                lat.append(t1 - t0)
                tx.append(t0 - ts)
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(eng.submit("acct", f"b{i}", "pay", [i]) for i in range(burst)))
        submitted = time.perf_counter()
        await asyncio.gather(*(_done(eng, serde.decode(r.value), 0.005) for r in replies))
        t1 = time.perf_counter()
        return {
            "effects": n, "burst": burst, "concurrency": concurrency, "partitions": partitions,
            "handler_ms": HANDLER_S * 1000, "durable": True, "fsync": True,
            "roundtrip_ms": {"p50": percentile(lat, 50) * 1000, "p99": percentile(lat, 99) * 1000,
                             "mean": sum(lat) / len(lat) * 1000},
            "transaction_ms": {"p50": percentile(tx, 50) * 1000, "p99": percentile(tx, 99) * 1000},
            "roundtrip_over_transaction_p50": percentile(lat, 50) / percentile(tx, 50),
            "roundtrip_samples_ms": sorted(x * 1000 for x in lat),
            "load_average": os.getloadavg()[0],
            "throughput_effects_per_s": burst / (t1 - t0), "burst_submit_s": submitted - t0, "burst_total_s": t1 - t0,
            "attempts": ex.metrics.attempts, "failures": ex.metrics.failures,
        }
    finally:
        await ex.stop()
        await rt.stop()
        rt.close()


def main() -> None:
    global HANDLER_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--effects", type=int, default=300, help="effects measured one at a time (latency)")
    p.add_argument("--burst", type=int, default=2000, help="effects requested at once (throughput)")
    p.add_argument("--concurrency", type=int, default=16, help="the executor's effects at once")
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--handler-ms", type=float, default=0.0)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args()
    HANDLER_S = a.handler_ms / 1000
    result = asyncio.run(run(a.effects, a.burst, a.concurrency, a.partitions))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(a.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "roundtrip_samples_ms"}, indent=2))


def plot(result: dict, path: Path) -> None:
    """The round trips' distribution next to the calling transaction's, and the burst's throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = result["roundtrip_samples_ms"]
    a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label="effect round trip (commit -> continuation)")
    for q, style in (("p50", "--"), ("p99", ":")):
        a.axvline(result["transaction_ms"][q], color="grey", linestyle=style, label=f"calling transaction {q}")
    a.set_xlabel("ms")
    a.set_ylabel("fraction")
    a.set_xscale("log")
    a.legend(fontsize=8)
    a.set_title(f"one at a time, durable node (fsync), load {result['load_average']:.1f}")
    b.bar(["effects/s"], [result["throughput_effects_per_s"]])
    b.set_title(f"burst of {result['burst']}, concurrency {result['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
