"""What every services benchmark records beside its figures: commit, date, machine, load average, command."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def header(load_before: list[float]) -> dict:
    """The JSON's header: call :func:`loadavg` before the benchmark, this after it."""
    rel = os.path.relpath(sys.argv[0], ROOT)
    return {"commit": commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "command": " ".join([".venv/bin/python", rel, *sys.argv[1:]]),
            "loadavg_before": load_before, "loadavg_after": loadavg()}


def ms_summary(xs: list[float]) -> dict:
    """p50/p90/p99/max/mean of seconds, in ms."""
    from charon.bench.harness import percentile

    if not xs:
        return {"n": 0}
    return {"n": len(xs), **{f"p{q}": round(percentile(xs, q) * 1000, 3) for q in (50, 90, 99)},
            "max": round(max(xs) * 1000, 3), "mean": round(sum(xs) / len(xs) * 1000, 3)}


def pythonpath(first: Path) -> str:
    """``first`` before this process's ``PYTHONPATH`` (the node imports its application from there)."""
    return os.pathsep.join(filter(None, [str(first), os.environ.get("PYTHONPATH")]))
