"""Benchmarks: an open-loop harness, the PostgreSQL baseline, the suite and the report (JSON -> PNG + Markdown).

``charon bench WORKLOAD [--engine inprocess|spark|postgres[,...]] [--rates R1,R2,...] [suite options]``
runs one workload (ycsb, zipf, tpcc, deathstar, movie, or all) of :mod:`charon.bench.suite`.
"""

from __future__ import annotations

_RATES = {"ycsb": "--ycsb-rates", "tpcc": "--tpcc-rates", "deathstar": "--deathstar-rates",
          "movie": "--movie-rates", "zipf": "--zipf-rate"}


def translate(argv: list[str]) -> list[str]:
    """``WORKLOAD --engine E --rates R ...`` -> the suite's own options."""
    args = list(argv)
    workload = "all"
    if args and not args[0].startswith("-"):
        workload = args.pop(0)
    out: list[str] = []
    if workload != "all":
        if workload not in _RATES:
            raise SystemExit(f"unknown workload {workload!r}: one of {', '.join(_RATES)} or all")
        out += ["--only", workload]
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--engine", "--engines") and i + 1 < len(args):
            out += ["--systems", args[i + 1]]
            i += 2
        elif a == "--rates" and i + 1 < len(args):
            if workload == "all":
                raise SystemExit("--rates needs a single WORKLOAD")
            out += [_RATES[workload], args[i + 1]]
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``charon bench``."""
    from charon.bench.harness import run
    from charon.bench.suite import main as suite_main

    return run(suite_main(translate(list(argv or []))))
