"""Tables (markdown, for RESULTS.md) and plots of the end-to-end benchmark's JSON (``run.py``'s output).

    .venv/bin/python benchmarks/e2e/report.py benchmarks/results/e2e/e2e.json            # prints the markdown
    .venv/bin/python benchmarks/e2e/report.py benchmarks/results/e2e/e2e.json --png      # and (re)draws the PNG
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PROCESS_NAMES = {"server": "Charon server", "service": "PG service", "postgres": "PostgreSQL server",
                 "generator": "generator"}


def best_under(rows: list[dict], p99_ms: float) -> dict | None:
    """The row with the highest achieved throughput whose p99 is under ``p99_ms`` and that had no errors."""
    ok = [r for r in rows if not r["errors"] and r["latency_ms"]["p99"] is not None
          and r["latency_ms"]["p99"] < p99_ms]
    if not ok:
        return None
    r = max(ok, key=lambda r: r["throughput"])
    return {"rate": r["rate"], "throughput": r["throughput"], "p99_ms": r["latency_ms"]["p99"]}


def cpu_row(target: dict) -> dict | None:
    """The row whose CPU per request is quoted: the highest throughput at p99 < 100 ms, else at p99 < 1 s, else
    the last row."""
    rows = target["rows"]
    for limit in (100, 1000):
        best = best_under(rows, limit)
        if best:
            return next(r for r in rows if r["rate"] == best["rate"])
    return rows[-1] if rows else None


def _ms(x: float | None) -> str:
    return "–" if x is None else (f"{x:.1f}" if x < 100 else f"{x:,.0f}")


def _server_us(row: dict) -> str:
    v = row.get("server_cpu_us_per_request")
    return "–" if v is None else f"{v:,.0f}"


def _best(b: dict | None) -> str:
    return "none" if b is None else f"{b['throughput']:,.0f}/s (offered {b['rate']:,.0f})"


def _retries(row: dict) -> str:
    n = row.get("service", {}).get("retries")
    return "" if n is None else f" ({n:,})"


def render_markdown(doc: dict[str, Any]) -> str:
    """The RESULTS.md section: provenance, one row per (target, rate), a summary per target."""
    p = doc["params"]
    lines = [
        f"Commit `{doc['git_commit'][:10]}`, {doc['date']}, {doc['cpus']} CPUs, load average "
        f"{doc['loadavg_start'][0]} at the start, {doc.get('loadavg_end', ['?'])[0]} at the end. "
        f"`{doc['command']}`: {p['keys']:,} accounts of {p['balance']:,}, transfers of 1–{p['max_amount']}, "
        f"{p['duration']:g} s measured per rate after {p['warmup']:g} s warm-up, open loop over "
        f"{p['connections']} keep-alive connections, generator in its own process.",
    ]
    pg = next((t["server_settings"] for t in doc["targets"].values() if "server_settings" in t), None)
    if pg:
        lines[-1] += (f" PostgreSQL {pg['server_version']}: fsync {pg['fsync']}, synchronous_commit "
                      f"{pg['synchronous_commit']}, wal_sync_method {pg['wal_sync_method']}, shared_buffers "
                      f"{pg['shared_buffers']}.")
    lines += [
        "",
        "| target | offered /s | achieved /s | p50 ms | p99 ms | p99.9 ms | errors | aborts (retries) | "
        "server CPU µs/req | generator µs/req (lag p99 ms) | load avg before → after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, t in doc["targets"].items():
        for r in t["rows"]:
            lat = r["latency_ms"]
            sat = " (saturated)" if r.get("saturated") else ""
            lines.append(
                f"| {name} | {r['rate']:,.0f} | {r['throughput']:,.0f}{sat} | {_ms(lat['p50'])} | {_ms(lat['p99'])} | "
                f"{_ms(lat['p999'])} | {r['errors']:,} | {r['aborted']:,}{_retries(r)} | {_server_us(r)} | "
                f"{r['cpu_us_per_request'].get('generator') or '–'} ({_ms(r['scheduler_lag_ms']['p99'])}) | "
                f"{r['loadavg_1min'][0]} → {r['loadavg_1min'][1]} |")
    lines += ["", "| target | throughput at p99 < 100 ms | at p99 < 1 s | CPU µs/request by process (at the "
                  "best p99 < 100 ms row, else < 1 s) | pool | money conserved |", "|---|---:|---:|---|---|---|"]
    for t in doc["targets"].values():
        best = t.get("max_throughput_p99_under_100ms") or best_under(t["rows"], 100)
        row = cpu_row(t)
        cpu = ", ".join(f"{PROCESS_NAMES.get(k, k)} {v:,.0f}" for k, v in (row or {}).get(
            "cpu_us_per_request", {}).items() if v is not None) or "–"
        pool = f"{t['pool']} ({t['pool_reason']})" if "pool" in t else "–"
        c = t["conservation"]
        second = best_under(t["rows"], 1000)
        conserved = f"{'yes' if c['ok'] else 'NO'}: {c['actual']:,} of {c['expected']:,}"
        lines.append(f"| {t['label']} | {_best(best)} | {_best(second)} | {cpu} | {pool} | {conserved} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: p50 and p99 against the offered rate per target; right: CPU per request by process at each
    target's :func:`cpu_row`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for i, (name, t) in enumerate(doc["targets"].items()):
        rows = t["rows"]
        x = [r["rate"] for r in rows]
        color = f"C{i}"
        ax.plot(x, [r["latency_ms"]["p99"] for r in rows], "o-", color=color, label=f"{name} p99")
        ax.plot(x, [r["latency_ms"]["p50"] for r in rows], "s--", color=color, alpha=0.6, label=f"{name} p50")
    ax.axhline(100, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered transfers / s (open loop)")
    ax.set_ylabel("latency from scheduled send, ms")
    ax.set_title("YCSB-T through HTTP: latency vs rate")
    ax.legend(fontsize=8)
    names = list(doc["targets"])
    procs = sorted({k for t in doc["targets"].values() for r in t["rows"] for k in r["cpu_us_per_request"]},
                   key=lambda k: list(PROCESS_NAMES).index(k) if k in PROCESS_NAMES else 99)
    bottoms = [0.0] * len(names)
    for j, proc in enumerate(procs):
        vals = []
        for name in names:
            t = doc["targets"][name]
            row = cpu_row(t)
            vals.append((row or {}).get("cpu_us_per_request", {}).get(proc) or 0.0)
        bx.bar(names, vals, bottom=bottoms, color=f"C{j}", label=PROCESS_NAMES.get(proc, proc))
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    bx.set_ylabel("CPU µs per request")
    bx.set_title("CPU per request by process (best row at p99 < 100 ms, else < 1 s)")
    bx.legend(fontsize=8)
    fig.suptitle(f"{doc['git_commit'][:10]} {doc['date']} load {doc['loadavg_start'][0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--png", action="store_true", help="also draw <json>.png")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    sys.stdout.write(render_markdown(doc))
    if args.png:
        plot(doc, Path(args.json).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
