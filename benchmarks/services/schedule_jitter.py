"""Schedules: how late a firing runs after its slot, on the durable node (fsync per epoch), idle and under load.

``charon run services_app:app`` (this folder's ``services_app.py``: YCSB-T's accounts, and ``clock/record``, which
appends ``[slot, tick time, ctx.now()]`` to its entity) in its own process through the shared harness,
``--data-dir`` (fsync per epoch), accounts seeded. A schedule firing every second (``* * * * * *``, 6 fields,
seconds first) is created at run time (``POST /schedules``) on ``clock/record``, left for ``--duration`` seconds,
then deleted; its entity's list is read back. Per firing: **jitter** = the firing transaction's timestamp
(``ctx.now()``, the epoch's logged time) - the slot; also the tick's lateness (the schedule's own transaction,
the first epoch past the slot; the firing runs in an epoch after it). First idle, then (unless ``--rate 0``)
under a background open loop of YCSB-T transfers at ``--rate`` per second (keep-alive connections, a fresh
Idempotency-Key each). Writes ``benchmarks/results/services/schedule_jitter.json`` and ``.png``.

    .venv/bin/python benchmarks/services/schedule_jitter.py --duration 60 --rate 500
    .venv/bin/python benchmarks/services/schedule_jitter.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx
from _meta import ROOT, header, loadavg, ms_summary, pythonpath

from charon.bench.engines import ConnectionPool, start_node, transfer_request

HERE = Path(__file__).resolve().parent
OUT = ROOT / "benchmarks" / "results" / "services" / "schedule_jitter.json"
TOKEN = "t34"
KEYS = 1000


async def background(url: str, rate: float, stop: asyncio.Event, tag: bytes) -> dict:
    """Transfers sent at ``rate`` per second (open loop; a request waits for a free connection if all 64 are
    busy) until ``stop``: sent, answered 200, other answers, latency."""
    rng = random.Random(34)
    lat: list[float] = []
    st = {"sent": 0, "ok": 0, "other": 0}
    async with ConnectionPool(url, 64) as pool:
        host, token = pool.host.encode(), TOKEN.encode()

        async def one(i: int) -> None:
            async with pool.connection() as c:
                t = time.perf_counter()
                status, _ = await c.send(transfer_request(host, token, rng.randrange(KEYS), rng.randrange(KEYS), 1,
                                                          b"%s-%d" % (tag, i)))
                lat.append(time.perf_counter() - t)
                st["ok" if status == 200 else "other"] += 1

        tasks: set[asyncio.Task] = set()
        start = time.perf_counter()
        i = 0
        while not stop.is_set():
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(one(i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            i += 1
        wall = time.perf_counter() - start
        await asyncio.gather(*tasks)
    st["sent"] = i
    return {**st, "rate": rate, "achieved_per_s": round(i / wall, 1), "latency_ms": ms_summary(lat)}


async def phase(url: str, name: str, duration: float, rate: float) -> dict:
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=hdr, timeout=30) as c:
        stop = asyncio.Event()
        bg = asyncio.create_task(background(url, rate, stop, name.encode())) if rate > 0 else None
        if bg is not None:
            await asyncio.sleep(2.0)  # the load is steady before the first slot measured
        r = await c.post("/schedules", json={"name": f"jitter-{name}", "cron": "* * * * * *", "operator": "clock",
                                             "key": name, "function": "record", "args": [], "catch_up": 0})
        r.raise_for_status()
        created = time.time()
        await asyncio.sleep(duration)
        deleted = time.time()
        (await c.delete(f"/schedules/jitter-{name}")).raise_for_status()
        stop.set()
        load = await bg if bg is not None else None
        await asyncio.sleep(1.5)  # a firing already ticked commits
        r = await c.get(f"/state/clock/{name}")
        r.raise_for_status()
        rows = r.json()["value"] or []
    slots = [s for s, _, _ in rows]
    jitter = [now - s for s, _, now in rows]
    tick = [t - s for s, t, _ in rows]
    expected = int(deleted) - int(created)  # the whole seconds in (created, deleted]
    return {"name": name, "background_rate": rate, "duration_s": duration, "firings": len(rows),
            "slots_in_window": expected, "duplicate_slots": len(slots) - len(set(slots)),
            "jitter_ms": ms_summary(jitter), "tick_late_ms": ms_summary(tick), "background": load,
            "samples_ms": [round(x * 1000, 3) for x in jitter]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--rate", type=float, default=500.0, help="background transfers per second (0: idle only)")
    ap.add_argument("--quick", action="store_true", help="a smoke: 6 s per phase, 100 transfers/s")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    if a.quick:
        a.duration, a.rate = 6.0, 100.0
    load0 = loadavg()
    node = start_node("services_app:app", token=TOKEN, env={"PYTHONPATH": pythonpath(HERE)})
    try:
        node.seed(KEYS, 1_000_000, timeout=120)

        async def run() -> list[dict]:
            out = [await phase(node.url, "idle", a.duration, 0.0)]
            if a.rate > 0:
                out.append(await phase(node.url, "load", a.duration, a.rate))
            return out

        phases = asyncio.run(run())
    finally:
        node.stop()
    doc = {**header(load0), "engine": "durable in-process node (charon run --data-dir, fsync per epoch)",
           "app": "benchmarks/services/services_app.py", "cron": "* * * * * *", "phases": phases}
    doc["columns"] = ["phase", "background_per_s", "firings", "slots_in_window", "jitter_p50", "jitter_p99",
                      "jitter_max", "tick_late_p50", "tick_late_max"]
    doc["rows"] = [{"phase": p["name"], "background_per_s": p["background_rate"], "firings": p["firings"],
                    "slots_in_window": p["slots_in_window"],
                    **{f"jitter_{q}": p["jitter_ms"].get(q) for q in ("p50", "p99", "max")},
                    **{f"tick_late_{q}": p["tick_late_ms"].get(q) for q in ("p50", "max")}}
                   for p in phases]  # run.py's table (ms)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    short = {k: v for k, v in doc.items() if k not in ("rows", "columns")}
    short["phases"] = [{k: v for k, v in p.items() if k != "samples_ms"} for p in phases]
    print(json.dumps(short, indent=1))
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in doc["phases"]:
        xs = sorted(p["samples_ms"])
        if xs:
            label = "idle" if not p["background_rate"] else f"{p['background_rate']:g} transfers/s"
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], marker=".", label=label)
    ax.set_xlabel("firing's ctx.now() - slot (ms)")
    ax.set_ylabel("fraction")
    ax.set_title(f"schedule jitter, every second, durable node, {doc['commit']}, load {doc['loadavg_before'][0]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
