"""YCSB-T on a Spark standalone cluster with the NATS JetStream log and remote gateways; a Worker killed and
replaced mid-run.

Processes (all on 127.0.0.1, each its own): ``nats-server -js`` (the log), a Spark Master and ``--workers``
Workers (``charon.runtime.spark.cluster``; one single-core executor each), the Spark driver (this script's
process: ``SparkRuntime`` with ``log_url``), and ``--gateways`` HTTP gateways (``charon run --engine remote
--log nats://...``) that only talk to nats-server. Paced clients send YCSB-T transfers with Idempotency-Keys
round-robin to the gateways (a failed call is retried with the same key on the next gateway). At
``--kill-at`` seconds Worker 1 is SIGKILLed with its executor and Python workers; ``--replace-after`` seconds
later a new Worker joins. At the end the script checks that every request was answered exactly once, that
the balances equal the initial ones plus the acknowledged transfers (money conserved), and writes
``cluster_nats.json`` and ``cluster_nats.png`` (throughput and latency per second, the kill marked).

    .venv/bin/python benchmarks/recovery/cluster_nats.py --seconds 90 --rate 20

On a real multi-machine cluster the same deployment is: nats-server on one host (``nats://logs:4222/ycsb``),
``CHARON_MASTER=spark://master:7077`` and ``CHARON_CHECKPOINT`` on storage every executor and the driver reach
(NFS, or a path mounted on all machines), gateways anywhere with ``--engine remote --log nats://logs:4222/ycsb``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from charon.apps import ycsb
from charon.bench.engines import start_node
from charon.bench.harness import percentile
from charon.config import SparkConfig
from charon.runtime.spark.cluster import StandaloneCluster, free_port
from charon.runtime.spark.runtime import SparkRuntime

OUT = Path(__file__).resolve().parents[1] / "results" / "recovery"
TOKEN = "cluster"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
BALANCE = 1000


def start_nats(root: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "nats.log", "wb")
    proc = subprocess.Popen([binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(root / "store")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"nats://127.0.0.1:{port}/ycsb"
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("nats-server did not start")


def start_gateway(log_url: str, root: Path, i: int) -> tuple[subprocess.Popen, str]:
    node = start_node("charon.apps.ycsb:app", engine="remote", token=TOKEN, durable=False,
                      args=["--log", log_url], workdir=root, log=root / f"gateway{i}.log")
    return node.proc, node.url


async def drive(gateways: list[str], accounts: int, rate: float, seconds: float, clients: int,
                events: dict[str, float], on_tick) -> list[dict]:
    """Paced clients; returns one record per request: tag, call, status, start/end times, attempts."""
    rng = random.Random(7)
    records: list[dict] = []
    t0 = time.monotonic()
    per_client = rate / clients

    async def client(c: int, http: httpx.AsyncClient) -> None:
        n = 0
        while True:
            due = t0 + n / per_client + c / rate
            if due - t0 > seconds:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tag = f"c{c}-{n}"
            src, dst = rng.randrange(accounts), rng.randrange(accounts)
            amount = rng.randint(1, 50)
            rec = {"tag": tag, "src": f"a{src}", "dst": f"a{dst}", "amount": amount, "start": time.monotonic() - t0,
                   "attempts": 0}
            n += 1
            for attempt in range(600):
                gw = gateways[(c + attempt) % len(gateways)]
                rec["attempts"] = attempt + 1
                try:
                    r = await http.post(f"{gw}/invoke/account/a{src}/transfer", json={"args": [f"a{dst}", amount]},
                                        headers={**HEADERS, "Idempotency-Key": tag})
                except httpx.HTTPError:
                    await asyncio.sleep(0.5)
                    continue
                if r.status_code in (200, 409):
                    rec.update(status=r.status_code, end=time.monotonic() - t0, body=r.json())
                    break
                await asyncio.sleep(0.5)
            records.append(rec)

    async def ticker() -> None:
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(on_tick, time.monotonic() - t0, events)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(ticker(), *(client(c, http) for c in range(clients)))
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--rate", type=float, default=20, help="requests per second over all clients")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--accounts", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--kill-at", type=float, default=30)
    p.add_argument("--replace-after", type=float, default=10)
    p.add_argument("--out", default=str(OUT / "cluster_nats"))
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON of --out")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out + ".json").read_text()), args.out + ".png")
        return 0

    root = Path(tempfile.mkdtemp(prefix="charon-cluster-"))
    procs: list[subprocess.Popen] = []
    cluster = StandaloneCluster(str(root / "cluster"), workers=args.workers, cores=1, memory="1g")
    rt = None
    try:
        nats, log_url = start_nats(root / "nats")
        procs.append(nats)
        t = time.monotonic()
        cluster.start()
        cluster_start_s = time.monotonic() - t
        cfg = SparkConfig(master=cluster.master_url, data_dir=str(root / "driver"), partitions=args.partitions,
                          log_url=log_url, max_batch=500, idle_wait_ms=200,
                          spark_conf={**cluster.app_conf(executor_cores=1, max_cores=args.workers + 1),
                                      "spark.sql.streaming.stopTimeout": "60s"})
        t = time.monotonic()
        rt = SparkRuntime("charon.apps.ycsb:app", cfg)
        rt.load("account", ycsb.initial_state(args.accounts, balance=BALANCE))
        rt.start()
        driver_start_s = time.monotonic() - t
        gateways = []
        for i in range(args.gateways):
            proc, url = start_gateway(log_url, root, i)
            procs.append(proc)
            gateways.append(url)
        print(f"cluster {cluster_start_s:.0f} s, driver {driver_start_s:.0f} s; gateways {gateways}", flush=True)

        def on_tick(now: float, events: dict[str, float]) -> None:
            cluster.scan()
            if "kill" not in events and now >= args.kill_at:
                assert cluster.kill_worker(1), "worker 1 survived SIGKILL"
                events["kill"] = now
                print(f"{now:.1f} s: worker 1 SIGKILLed", flush=True)
            elif "kill" in events and "replace" not in events and now >= events["kill"] + args.replace_after:
                i = cluster.add_worker()
                events["replace"] = time.monotonic() - t_run
                print(f"{events['replace']:.1f} s: worker {i} registered", flush=True)

        events: dict[str, float] = {}
        t_run = time.monotonic()
        records = asyncio.run(drive(gateways, args.accounts, args.rate, args.seconds, args.clients, events, on_tick))
        rt.wait_idle(600)

        # -- verdict ----------------------------------------------------------------------------------------
        unanswered = [r["tag"] for r in records if "status" not in r]
        balances = rt.snapshot()
        from charon import serde
        from charon.core.routing import split_store_key

        state = {split_store_key(k)[1]: serde.decode(v) for k, v in balances.items() if split_store_key(k)[2] == ""}
        want = {ycsb.key(i): BALANCE for i in range(args.accounts)}
        for r in records:
            if r.get("status") == 200:
                want[r["src"]] -= r["amount"]
                want[r["dst"]] += r["amount"]
        counts: dict[str, int] = {}
        for _, rep in rt.output_log.read_since(0, limit=1 << 30):
            counts[rep.request_id] = counts.get(rep.request_id, 0) + 1
        answered_once = all(counts.get(r["tag"]) == 1 for r in records if "status" in r)
        conserved = sum(state.values()) == BALANCE * args.accounts
        matches = {k: state.get(k, 0) for k in want} == want
        spark_log = Path(cfg.data_dir, "spark.log").read_text(errors="replace")
        lost_executor = "Lost executor" in spark_log or "lost worker" in spark_log.lower()

        secs = int(args.seconds) + 1
        per_s = [0] * (secs + 60)
        lat: list[list[float]] = [[] for _ in range(secs + 60)]
        for r in records:
            if "end" in r:
                b = min(int(r["end"]), len(per_s) - 1)
                per_s[b] += 1
                lat[b].append((r["end"] - r["start"]) * 1000)
        doc = {
            "what": "YCSB-T on a standalone Spark cluster (Master + Workers on 127.0.0.1), NATS JetStream log, "
                    "remote gateways; worker 1 SIGKILLed and replaced mid-run",
            "command": "python benchmarks/recovery/cluster_nats.py " + " ".join(sys.argv[1:]),
            "args": vars(args),
            "cluster_start_s": round(cluster_start_s, 1), "driver_start_s": round(driver_start_s, 1),
            "events_s": {k: round(v, 1) for k, v in events.items()},
            "requests": len(records), "ok": sum(r.get("status") == 200 for r in records),
            "refused_409": sum(r.get("status") == 409 for r in records), "unanswered": len(unanswered),
            "retried": sum(r["attempts"] > 1 for r in records),
            "answered_exactly_once": answered_once, "money_conserved": conserved,
            "balances_match_acknowledged": matches, "spark_noticed_lost_executor": lost_executor,
            "latency_ms_p50": percentile([x for b in lat for x in b], 50),
            "latency_ms_p99": percentile([x for b in lat for x in b], 99),
            "per_second": [{"t": i, "completed": per_s[i], "p50_ms": percentile(lat[i], 50) if lat[i] else None,
                            "max_ms": max(lat[i]) if lat[i] else None} for i in range(len(per_s)) if i < secs + 30],
            "note": "2-core machine shared with other jobs; latencies are disturbed by them",
        }
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
        plot(doc, args.out + ".png")
        print(json.dumps({k: v for k, v in doc.items() if k != "per_second"}, indent=1))
        ok = answered_once and conserved and matches and not unanswered
        return 0 if ok else 1
    finally:
        if rt is not None:
            rt.close()
        for pr in procs:
            try:
                os.killpg(pr.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["per_second"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    done = [r["completed"] for r in rows]
    w = 5  # replies arrive per epoch (seconds apart here): a 5 s moving average shows the rate
    avg = [sum(done[max(0, i - w + 1):i + 1]) / min(w, i + 1) for i in range(len(done))]
    a1.bar([r["t"] for r in rows], done, width=0.8, color="#cfd8e3", label="per second")
    a1.plot([r["t"] for r in rows], avg, lw=1.5, label=f"{w} s moving average")
    a1.set_ylabel("completed requests / s")
    a1.legend(loc="upper left", fontsize=8)
    a2.scatter([r["t"] for r in rows if r["p50_ms"] is not None],
               [r["p50_ms"] for r in rows if r["p50_ms"] is not None], s=8, label="p50 of the second")
    a2.scatter([r["t"] for r in rows if r["max_ms"] is not None],
               [r["max_ms"] for r in rows if r["max_ms"] is not None], s=8, marker="x", label="max of the second")
    a2.set_yscale("log")
    a2.set_ylabel("latency (ms)")
    a2.set_xlabel("seconds")
    for name, t in doc["events_s"].items():
        for ax in (a1, a2):
            ax.axvline(t, color="red" if name == "kill" else "green", ls="--", lw=1)
        a1.annotate(f" worker {'killed' if name == 'kill' else 'replaced'}", (t, a1.get_ylim()[1] * 0.9), fontsize=8)
    a2.legend()
    fig.suptitle("YCSB-T, standalone cluster + NATS log + remote gateways")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
