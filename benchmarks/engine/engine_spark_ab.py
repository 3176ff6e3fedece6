"""The engine alone and YCSB-T on Spark, before and after a change (two checkouts), in one run.

    .venv/bin/python benchmarks/engine/engine_spark_ab.py --before-src /tmp/before21     # a checkout of the code before

The code before the change runs from ``--before-src`` (each side runs its own copy of the benchmark scripts with
its own ``charon`` first on ``PYTHONPATH``); the code after from this checkout. Sides alternate
(before, after, before, after) so that drift in the machine's load falls on both. Two figures:

1. the engine alone (``benchmarks/engine/engine_perf.py --only-engine``): CPU µs and user-space instructions per YCSB-T
   transaction through ``run_epoch`` (the instructions hardly move with the neighbours' load);
2. YCSB-T on the Spark runtime (``benchmarks/spark/spark_ycsb.py``, ``local[2]``, one rate): committed/s, latency p50
   and p99, Spark-side CPU µs per request.

Writes ``benchmarks/results/engine/engine_spark_ab.json`` and ``.png``, with the load average at each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AFTER = HERE.parents[1]


def script(src: Path, area: str, name: str) -> Path:
    """A benchmark script of checkout ``src``: ``benchmarks/AREA/NAME`` (``benchmarks/NAME`` before the folders)."""
    new = src / "benchmarks" / area / name
    return new if new.exists() else src / "benchmarks" / name


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def engine_alone(before: Path, repeat: int) -> dict[str, Any]:
    """engine_perf's figure 1, before and after alternating inside it (it takes both sources)."""
    out = Path(tempfile.mkdtemp(prefix="charon-ab-")) / "engine.json"
    cmd = [sys.executable, str(script(AFTER, "engine", "engine_perf.py")), "--only-engine", "--before-src",
           str(before), "--after-src", str(AFTER), "--repeat", str(repeat), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=AFTER)
    doc = json.loads(out.read_text())
    return {"engine": doc["engine"], "load_average": os.getloadavg()[0]}


def spark_run(side: str, src: Path, rate: int, duration: float) -> dict[str, Any]:
    """One YCSB-T run on Spark with the code of ``src``."""
    out = Path(tempfile.mkdtemp(prefix=f"charon-ab-{side}-"))
    cmd = [sys.executable, str(script(src, "spark", "spark_ycsb.py")), "--rates", str(rate), "--duration",
           str(duration), "--out", str(out), "--label", side]
    load0 = os.getloadavg()[0]
    subprocess.run(cmd, check=True, cwd=src, env=_env(src))
    [path] = list(out.glob("spark_ycsb_*.json"))
    doc = json.loads(path.read_text())
    res = doc[0] if isinstance(doc, list) else doc
    lat = res.get("latency_ms", {})
    return {"side": side, "rate": rate, "committed_per_s": res.get("committed_per_s"), "p50_ms": lat.get("p50"),
            "p99_ms": lat.get("p99"), "spark_cpu_us_per_request": res.get("spark_cpu_us_per_request"),
            "unfinished": res.get("unfinished"), "load_average_before": load0,
            "load_average_after": os.getloadavg()[0]}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    eng = doc["engine_alone"]["engine"]
    sides = ["before", "after"]
    instr = [eng.get(s, {}).get("instructions_per_tx") for s in sides]
    cpu = [eng.get(s, {}).get("tuned_gc", {}).get("us_per_tx_median") for s in sides]
    axes[0].bar(sides, [v or 0 for v in instr], color=["#888", "#2a7"])
    axes[0].set_title("engine alone: instructions / tx")
    axes[1].bar(sides, [v or 0 for v in cpu], color=["#888", "#2a7"])
    axes[1].set_title("engine alone: CPU µs / tx")
    runs = doc["spark"]
    for side, colour in (("before", "#888"), ("after", "#2a7")):
        xs = [i for i, r in enumerate(runs) if r["side"] == side]
        axes[2].plot(xs, [runs[i]["p99_ms"] for i in xs], "o-", color=colour, label=f"{side} p99")
        axes[2].plot(xs, [runs[i]["p50_ms"] for i in xs], "s--", color=colour, label=f"{side} p50")
    axes[2].set_title(f"Spark YCSB-T at {runs[0]['rate']}/s: latency ms (runs in order)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-src", required=True, type=Path)
    ap.add_argument("--rate", type=int, default=1500)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spark-pairs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=AFTER / "benchmarks" / "results" / "engine")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                           "load_average_start": os.getloadavg()[0]}
    doc["engine_alone"] = engine_alone(args.before_src.resolve(), args.repeat)
    doc["spark"] = []
    for _ in range(args.spark_pairs):
        for side, src in (("before", args.before_src.resolve()), ("after", AFTER)):
            doc["spark"].append(spark_run(side, src, args.rate, args.duration))
            print(json.dumps(doc["spark"][-1]), flush=True)
    doc["load_average_end"] = os.getloadavg()[0]
    path = args.out / "engine_spark_ab.json"
    path.write_text(json.dumps(doc, indent=1))
    plot(doc, args.out / "engine_spark_ab.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
