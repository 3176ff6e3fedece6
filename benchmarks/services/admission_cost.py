"""Admission control: what its bookkeeping costs per request, off vs on in the same run, and a limit that binds.

``charon run charon.apps.ycsb:app`` (durable in-process node, ``--data-dir``, fsync per epoch) in its own process
through the shared harness, accounts seeded; YCSB-T transfers driven through HTTP from this process (closed loop,
``--concurrency`` keep-alive connections, a fresh Idempotency-Key each, as ``benchmarks/gateway/gateway_cpu.py``).
One node, phases of ``--duration`` seconds (after ``--warmup``) alternating ``off, on, off, on, ...``
(``--rounds`` pairs), the limit changed at run time between them (``POST /admin/limits``, applied at an epoch
boundary):

* **off**: no limit (``{"target": "account/transfer", "clear": true}``: the table is empty, admission returns at
  once);
* **on**: ``account/transfer`` limited by a concurrency limit and a token bucket far too large to bind
  (``concurrency`` 1,000,000, ``rate`` = ``burst`` = 1e9 per second, ``per`` ``--per``): every request is matched,
  its bucket found and charged, nothing waits, so only the bookkeeping is measured;
* **bind** (last, once): a token bucket that binds (``--bind-rate`` per second, burst ``--bind-burst``, per
  ``all``, ``queue`` ``--bind-queue``): requests wait (held) and past the queue are answered 429 ``RateLimited``;
  reported: answers by status, the waiting requests (the ``charon_admission_waiting`` gauge of ``/metrics``,
  sampled every 0.25 s: this phase alone reads ``/metrics``).

Per phase: server CPU per request (psutil, user + system of the node process over the measured window, / 200
answers), requests/s, p50/p99; then the ratio on/off of the means over the rounds (CPU per request, p50, p99).
Writes ``benchmarks/results/services/admission_cost.json`` and ``.png``.

    .venv/bin/python benchmarks/services/admission_cost.py --rounds 3 --duration 15 --concurrency 64
    .venv/bin/python benchmarks/services/admission_cost.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx
import psutil
from _meta import ROOT, header, loadavg, ms_summary

from charon.bench.engines import ConnectionPool, HttpConnection, start_node, transfer_request

OUT = ROOT / "benchmarks" / "results" / "services" / "admission_cost.json"
TOKEN = "t34"
KEYS = 1000
TARGET = "account/transfer"
_WAITING = re.compile(r"^charon_admission_waiting (\S+)$", re.M)


def limit_body(mode: str, a: argparse.Namespace) -> dict:
    if mode == "off":
        return {"target": TARGET, "clear": True}
    if mode == "on":
        return {"target": TARGET, "limit": {"concurrency": 1_000_000, "rate": 1e9, "burst": 1e9, "per": a.per,
                                            "queue": 1000}}
    return {"target": TARGET, "limit": {"rate": a.bind_rate, "burst": a.bind_burst, "per": "all",
                                        "queue": a.bind_queue}}


async def drive(url: str, tag: str, a: argparse.Namespace, proc: psutil.Process, sample: bool) -> dict:
    """Closed loop over ``a.concurrency`` connections; the window's server CPU, answers by status, latency of the
    200s (and of the 429s)."""
    rng = random.Random(34)
    lat: list[float] = []
    lat429: list[float] = []
    st = {"measure": False, "stop": False, "seq": 0}
    codes: dict[int, int] = {}
    waiting: list[float] = []
    async with ConnectionPool(url, a.concurrency) as pool:
        host, token = pool.host.encode(), TOKEN.encode()

        async def worker(conn: HttpConnection) -> None:
            while not st["stop"]:
                st["seq"] += 1
                req = transfer_request(host, token, rng.randrange(KEYS), rng.randrange(KEYS), 1,
                                       b"%s-%d" % (tag.encode(), st["seq"]))
                t = time.perf_counter()
                status, _ = await conn.send(req)
                dt = time.perf_counter() - t
                if st["measure"]:
                    codes[status] = codes.get(status, 0) + 1
                    if status == 200:
                        lat.append(dt)
                    elif status == 429:
                        lat429.append(dt)

        async def sampler() -> None:
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                                         timeout=10) as c:
                while not st["stop"]:
                    if st["measure"]:
                        m = _WAITING.search((await c.get("/metrics")).text)
                        if m:
                            waiting.append(float(m.group(1)))
                    await asyncio.sleep(0.25)

        tasks = [asyncio.create_task(worker(c)) for c in pool.connections]
        if sample:
            tasks.append(asyncio.create_task(sampler()))
        await asyncio.sleep(a.warmup)
        cpu0, t0 = proc.cpu_times(), time.perf_counter()
        st["measure"] = True
        await asyncio.sleep(a.duration)
        st["measure"] = False
        cpu1, t1 = proc.cpu_times(), time.perf_counter()
        st["stop"] = True
        await asyncio.gather(*tasks)
    wall = t1 - t0
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    ok = codes.get(200, 0)
    total = sum(codes.values())
    row = {"wall_s": round(wall, 3), "answers": {str(k): v for k, v in sorted(codes.items())},
           "committed_per_s": round(ok / wall, 1), "server_cpu_s": round(cpu, 3),
           "server_cpu_us_per_committed": round(cpu / ok * 1e6, 1) if ok else None,
           "server_cpu_us_per_answer": round(cpu / total * 1e6, 1) if total else None,
           "server_cpu_utilisation": round(cpu / wall, 3), "latency_ms": ms_summary(lat)}
    if sample:
        row["latency_429_ms"] = ms_summary(lat429)
        row["waiting_samples"] = len(waiting)
        row["waiting_max"] = max(waiting, default=0.0)
        row["waiting_mean"] = round(sum(waiting) / len(waiting), 1) if waiting else 0.0
    return row


def _mean(rows: list[dict], f) -> float | None:
    xs = [f(r) for r in rows if f(r) is not None]
    return sum(xs) / len(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per phase")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--per", default="key", help="the non-binding limit's buckets: all, key")
    ap.add_argument("--bind-rate", type=float, default=200.0)
    ap.add_argument("--bind-burst", type=float, default=20.0)
    ap.add_argument("--bind-queue", type=int, default=32)
    ap.add_argument("--no-bind", action="store_true", help="skip the binding phase")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke: 1 round, 2 s phases, 1 s warm-up, 16 connections, bind queue 8")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.duration, a.warmup, a.concurrency, a.bind_queue = 1, 2.0, 1.0, 16, 8
    modes = ["off", "on"] * a.rounds + ([] if a.no_bind else ["bind"])
    load0 = loadavg()
    node = start_node("charon.apps.ycsb:app", token=TOKEN)
    rows: list[dict] = []
    try:
        node.seed(KEYS, 1_000_000, timeout=120)
        proc = psutil.Process(node.pid)
        hdr = {"Authorization": f"Bearer {TOKEN}"}
        for i, mode in enumerate(modes):
            r = httpx.post(f"{node.url}/admin/limits", json=limit_body(mode, a), headers=hdr, timeout=30)
            r.raise_for_status()
            l0 = loadavg()
            row = {"phase": i, "mode": mode, "limit": limit_body(mode, a),
                   **asyncio.run(drive(node.url, f"p{i}", a, proc, mode == "bind"))}
            if mode == "bind":
                row["limits_after"] = httpx.get(f"{node.url}/admin/limits", headers=hdr, timeout=30).json()
            row["loadavg_1min"] = [l0[0], loadavg()[0]]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("limit", "limits_after")}), flush=True)
    finally:
        node.stop()
    off = [r for r in rows if r["mode"] == "off"]
    on = [r for r in rows if r["mode"] == "on"]
    ratio = {}
    for name, f in (("server_cpu_us_per_committed", lambda r: r["server_cpu_us_per_committed"]),
                    ("committed_per_s", lambda r: r["committed_per_s"]),
                    ("p50_ms", lambda r: r["latency_ms"].get("p50")), ("p99_ms", lambda r: r["latency_ms"].get("p99"))):
        mo, mn = _mean(off, f), _mean(on, f)
        ratio[name] = {"off": round(mo, 3) if mo else None, "on": round(mn, 3) if mn else None,
                       "on_over_off": round(mn / mo, 3) if mo and mn else None}
    doc = {**header(load0), "engine": "durable in-process node (charon run --data-dir, fsync per epoch)",
           "app": "charon.apps.ycsb:app", "concurrency": a.concurrency, "per": a.per, "rounds": a.rounds,
           "duration_s": a.duration, "warmup_s": a.warmup, "on_vs_off": ratio, "phases": rows}
    doc["columns"] = ["phase", "mode", "committed_per_s", "server_cpu_us_per_committed", "p50", "p99", "429s",
                      "waiting_max"]
    doc["rows"] = [{"phase": r["phase"], "mode": r["mode"], "committed_per_s": r["committed_per_s"],
                    "server_cpu_us_per_committed": r["server_cpu_us_per_committed"],
                    "p50": r["latency_ms"].get("p50"), "p99": r["latency_ms"].get("p99"),
                    "429s": r["answers"].get("429", 0), "waiting_max": r.get("waiting_max")} for r in rows]
    doc["rows"].append({"phase": "on/off", "mode": "ratio",
                        **{k: ratio[k2]["on_over_off"] for k, k2 in (("committed_per_s", "committed_per_s"),
                                                                       ("server_cpu_us_per_committed",
                                                                        "server_cpu_us_per_committed"),
                                                                       ("p50", "p50_ms"), ("p99", "p99_ms"))}})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    print(json.dumps({"on_vs_off": ratio, "loadavg": [doc["loadavg_before"], doc["loadavg_after"]]}, indent=1))
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["phases"]
    colors = {"off": "tab:blue", "on": "tab:orange", "bind": "tab:red"}
    labels = [f"{r['phase']}:{r['mode']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(labels, [r["server_cpu_us_per_committed"] or 0 for r in rows], color=[colors[r["mode"]] for r in rows])
    a.set_ylabel("server CPU µs per committed transfer")
    ratio = doc["on_vs_off"]["server_cpu_us_per_committed"]["on_over_off"]
    a.set_title(f"on/off = {ratio}, per={doc['per']}, c={doc['concurrency']}")
    for q, style in (("p50", "o"), ("p99", "^")):
        b.plot(labels, [r["latency_ms"].get(q, 0) for r in rows], style, label=q)
    b.set_ylabel("ms (200s)")
    b.set_yscale("log")
    b.legend(fontsize=8)
    b.set_title(f"{doc['commit']}, load {doc['loadavg_before'][0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
