"""Report: JSON run results -> PNG plots (matplotlib, Agg) and ``benchmarks/RESULTS.md`` tables.

A results file is a JSON list of run results from :func:`charon.bench.harness.run_open_loop`, each with
``experiment`` (``ycsb``, ``zipf``, ``tpcc``, ``deathstar``...), ``system`` (``charon-inprocess``,
``postgres``, ``charon-spark``...) and optionally ``zipf`` and ``checks`` (violations found after the run).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

#: Styx paper (SIGMOD 2025) figures, measured on other hardware (see docs/DESIGN.md §7).
PAPER_FIGURES: list[tuple[str, str]] = [
    ("YCSB-T at 2,000 TPS, Styx", "p50 19 ms, p99 34 ms"),
    ("YCSB-T at 2,000 TPS, T-Statefun / Boki / Beldi", "p50 695 ms / 9.8 s / 43.8 s"),
    ("YCSB-T highest throughput at sub-second latency, Styx", "48,000 TPS on 112 CPUs; 15.5K TPS on 2 x 1-CPU workers"),
    ("TPC-C, 100 warehouses, Styx at 2K TPS", "p50 40 ms, p99 169 ms; up to 3K TPS with sub-second p99"),
    ("Recovery, Styx", "~2.5 s"),
]


def load_results(out_dir: str | Path) -> list[dict]:
    """All run results from the ``*.json`` files of a directory (lists or single results)."""
    results: list[dict] = []
    for p in sorted(Path(out_dir).glob("*.json")):
        data = json.loads(p.read_text())
        results.extend(data if isinstance(data, list) else [data])
    return results


def _group(results: list[dict], experiment: str) -> dict[str, list[dict]]:
    by_sys: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        if r.get("experiment") == experiment:
            by_sys[r.get("system", "?")].append(r)
    for runs in by_sys.values():
        runs.sort(key=lambda r: (r.get("zipf", 0), r["input_rate"]))
    return dict(by_sys)


def _ms(v: float | None) -> float:
    """A latency for a log-scale plot: NaN (a gap) where nothing finished."""
    return math.nan if v is None or v <= 0 else v


def _log_y(ax: Any) -> None:
    """A log-scale y axis where the axes plot some positive value (none, e.g. nothing finished: linear, since
    matplotlib refuses to log-scale an axis without one)."""
    if any(np.any(np.asarray(line.get_ydata(), dtype=float) > 0) for line in ax.get_lines()):
        ax.set_yscale("log")


def plot_latency_throughput(results: list[dict], experiment: str, path: Path) -> Path | None:
    """Latency (p50 solid, p99 dashed, log scale) against committed throughput, one curve per system."""
    groups = _group(results, experiment)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (system, runs) in enumerate(sorted(groups.items())):
        color = f"C{i}"
        x = [r["committed_per_s"] for r in runs]
        ax.plot(x, [_ms(r["latency_ms"]["p50"]) for r in runs], "o-", color=color, label=f"{system} p50")
        ax.plot(x, [_ms(r["latency_ms"]["p99"]) for r in runs], "s--", color=color, label=f"{system} p99")
        for r in runs:
            if r["latency_ms"]["p50"] is None:
                continue
            ax.annotate(f"{r['input_rate']:g}", (r["committed_per_s"], r["latency_ms"]["p50"]), fontsize=6,
                        textcoords="offset points", xytext=(2, 3))
    _log_y(ax)
    ax.set_xlabel("committed transactions / s")
    ax.set_ylabel("latency (ms, log)")
    ax.set_title(f"{experiment}: latency vs throughput (labels = input rate)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_zipf(results: list[dict], path: Path) -> Path | None:
    """Abort rate (and, for Charon, the share of transactions that needed the fallback) per Zipf coefficient."""
    groups = _group(results, "zipf")
    if not groups:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for i, (system, runs) in enumerate(sorted(groups.items())):
        z = [r.get("zipf", 0) for r in runs]
        labels = [f"{v:g}" for v in z]
        ax1.plot(labels, [100 * (r["abort_rate"] or 0) for r in runs], "o-", color=f"C{i}",
                 label=f"{system} aborted")
        fb = [r.get("epochs", {}).get("fallback_share") for r in runs]
        if any(v is not None for v in fb):
            ax1.plot(labels, [100 * (v or 0) for v in fb], "^:", color=f"C{i}", label=f"{system} fallback")
        if any("retries" in r for r in runs):
            ax1.plot(labels, [100 * r.get("retries", 0) / max(1, r["completed"]) for r in runs], "v:",
                     color=f"C{i}", label=f"{system} retries/txn")
        ax2.plot(labels, [_ms(r["latency_ms"]["p50"]) for r in runs], "o-", color=f"C{i}", label=f"{system} p50")
        ax2.plot(labels, [_ms(r["latency_ms"]["p99"]) for r in runs], "s--", color=f"C{i}", label=f"{system} p99")
    ax1.set_xlabel("Zipf coefficient")
    ax1.set_ylabel("% of transactions")
    ax1.set_title("YCSB-T aborts / conflicts")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("Zipf coefficient")
    ax2.set_ylabel("latency (ms, log)")
    _log_y(ax2)
    ax2.set_title("YCSB-T latency")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(results: list[dict], experiment: str, path: Path) -> Path | None:
    """Committed/s and p50 latency over time for each system's highest-rate run of an experiment."""
    groups = _group(results, experiment)
    if not groups:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.4, 5), sharex=True)
    for i, (system, runs) in enumerate(sorted(groups.items())):
        r = max(runs, key=lambda x: x["input_rate"])
        tl = r.get("timeline", [])
        t = [p["t"] for p in tl]
        ax1.plot(t, [p["committed"] for p in tl], color=f"C{i}", label=f"{system} @ {r['input_rate']:g}/s")
        ax2.plot(t, [_ms(p["p50_ms"]) for p in tl], color=f"C{i}")
        if r.get("warmup_s"):
            ax1.axvline(r["warmup_s"], color="grey", ls=":", lw=0.8)
    ax1.set_ylabel("committed / s")
    ax1.legend(fontsize=7)
    ax2.set_ylabel("p50 latency (ms, log)")
    _log_y(ax2)
    ax2.set_xlabel("time (s); dotted line = end of warm-up")
    ax1.set_title(f"{experiment}: throughput and latency over time (highest input rate)")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(v: Any, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(runs: list[dict], zipf: bool = False) -> str:
    """A Markdown table of runs."""
    head = (["zipf"] if zipf else []) + ["system", "input/s", "committed/s", "aborted/s", "abort %", "p50 ms",
                                          "p90 ms", "p99 ms", "max ms", "unfinished", "epochs (n, mean size, p50 ms)",
                                          "fallback %", "pg retries"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        lat = r["latency_ms"]
        ep = r.get("epochs")
        eps = f"{ep['count']}, {_f(ep['size_mean'])}, {_f(ep['duration_ms_p50'])}" if ep else "–"
        fb = _f(100 * ep["fallback_share"]) if ep and "fallback_share" in ep else "–"
        row = ([_f(r.get("zipf"), 3)] if zipf else []) + [
            r.get("system", "?"), _f(r["input_rate"], 0), _f(r["committed_per_s"]), _f(r["aborted_per_s"]),
            _f(100 * r["abort_rate"] if r["abort_rate"] == r["abort_rate"] else None), _f(lat["p50"]),
            _f(lat["p90"]), _f(lat["p99"]), _f(lat["max"]), _f(r["unfinished"]), eps, fb,
            _f(r.get("retries")) if "retries" in r else "–",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


TITLES = {
    "ycsb": "YCSB-T (transfers, uniform)",
    "zipf": "YCSB-T Zipf sweep (creditor skew)",
    "tpcc": "TPC-C NewOrder + Payment",
    "deathstar": "Deathstar travel mix (60% search, 39% recommend, 0.5% login, 0.5% reserve)",
    "movie": "Deathstar movie review (compose_review, 8 functions)",
}


def write_report(out_dir: str | Path, md_path: str | Path, command: str = "", notes: list[str] | None = None
                 ) -> Path:
    """Draw every plot into ``out_dir`` and write the Markdown report; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = Path(md_path)
    results = load_results(out)
    rel = lambda p: Path(os.path.relpath(Path(p).resolve(), md.parent.resolve())).as_posix()  # noqa: E731
    parts = [
        "# Benchmark results",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} on {platform.node()} ({platform.machine()}, "
        f"{_cpus()} CPUs, Python {platform.python_version()}).",
        "",
        f"Command: `{command}`" if command else "",
        "",
        "Open-loop load at a fixed input rate; latency from a request's due time to its reply (so client lag "
        "counts); warm-up discarded. `charon-inprocess` runs the engine and the load generator in one Python "
        "process (one event loop); `postgres` is PostgreSQL from Debian's packages on 127.0.0.1 with "
        "SERIALIZABLE transactions retried on serialization failure (`postgres-rc`: READ COMMITTED with "
        "`SELECT ... FOR UPDATE` in a fixed lock order), driven by the same harness. Both share the "
        "same 2 cores, so compare them as ratios within this run, not as absolute figures.",
        "",
    ]
    for note in notes or []:
        parts += [f"- {note}"]
    parts.append("")
    kept = _kept_section(md)
    if kept:  # a section marked as kept (an earlier table's) survives a regeneration of the rest
        parts += [kept, ""]
    for exp in ("ycsb", "zipf", "tpcc", "deathstar", "movie"):
        groups = _group(results, exp)
        if not groups:
            continue
        parts += [f"## {TITLES.get(exp, exp)}", ""]
        runs = [r for sys_runs in sorted(groups.items()) for r in sys_runs[1]]
        parts += [table(runs, zipf=(exp == "zipf")), ""]
        checks = [(r.get("system"), c) for r in runs for c in r.get("checks", [])]
        checked = [r for r in runs if "checks" in r]
        if checked:
            parts += [f"Consistency checks after the runs: "
                      f"{'**all passed**' if not checks else f'**{len(checks)} violations**'}.", ""]
            for s, c in checks[:20]:
                parts.append(f"- {s}: {c}")
        figs = []
        if exp == "zipf":
            figs.append(plot_zipf(results, out / "zipf.png"))
        else:
            figs.append(plot_latency_throughput(results, exp, out / f"{exp}_latency_throughput.png"))
            figs.append(plot_timeline(results, exp, out / f"{exp}_timeline.png"))
        for f in figs:
            if f is not None:
                parts += [f"![{exp}]({rel(f)})", ""]
    spark = [r for r in results if "spark" in str(r.get("system", ""))]
    if not spark:
        parts += ["## Spark runtime", "", "Not measured in this run (the Spark runtime's numbers are added with "
                  "`benchmarks/workloads/suite.py --systems spark`).", ""]
    parts += ["## Reference: the Styx paper (SIGMOD 2025), other hardware", "",
              "These figures are **from the paper**, measured on the authors' cluster, not on this machine; they "
              "are listed for orientation only.", "", "| what | figure (paper) |", "|---|---|"]
    parts += [f"| {a} | {b} |" for a, b in PAPER_FIGURES]
    md.write_text("\n".join(parts) + "\n")
    return md


KEPT_START, KEPT_END = "<!-- issue10:start -->", "<!-- issue10:end -->"


def _kept_section(md: Path) -> str:
    """The section another script owns in ``md`` (between the issue-10 markers), if any."""
    text = md.read_text() if md.exists() else ""
    if KEPT_START not in text or KEPT_END not in text:
        return ""
    return KEPT_START + text.split(KEPT_START, 1)[1].split(KEPT_END, 1)[0] + KEPT_END


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/workloads/suite"
    print(write_report(out, sys.argv[2] if len(sys.argv) > 2 else f"{out}/RESULTS.md"))
