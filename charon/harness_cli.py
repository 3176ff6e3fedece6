"""``charon test-app``: the fault harness (:mod:`charon.harness`) from the command line."""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import cast

import typer


def _load(ref: str, what: str) -> object:
    module, _, attr = ref.partition(":")
    if not attr:
        raise typer.BadParameter(f"{what} {ref!r}: give module:attribute")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise typer.BadParameter(f"{what} {ref!r}: {exc}") from None


def test_app(
    target: str = typer.Argument(..., help="The application, module:attribute."),
    seeds: int = typer.Option(20, "--seeds", help="How many seeds to run (from --start)."),
    start: int = typer.Option(0, "--start", help="The first seed."),
    seed: int | None = typer.Option(None, "--seed", help="Run this one seed, with its trace."),
    steps: int = typer.Option(50, "--steps", help="Invocations taken from the workload per seed."),
    workload: str | None = typer.Option(
        None, "--workload", help="module:function(rng) returning the invocations; default: drawn from the "
        "functions' type hints (hypothesis)."),
    invariant: list[str] = typer.Option([], "--invariant", help="module:function(snapshot), checked after every "
                                        "epoch (repeatable)."),
    keys: str = typer.Option("k0,k1,k2,k3", "--keys", help="Entity keys for generated workloads (comma-separated)."),
    functions: str = typer.Option("", "--functions", help="operator.function names a generated workload calls "
                                  "(comma-separated; default: all)."),
) -> None:
    """Run an application's workload under seeded faults (worker hops, lost worker state and processes, task
    re-runs, driver crashes at every fault point, client retries, timers, input-log rescales), checking the
    serial oracle and the invariants after every epoch. Exits 1 on a failure, printing the line that
    reproduces it."""
    from charon.harness import HarnessFailure, Invariant, WorkloadSource, from_hints, run_app
    from charon.operator import Application

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _load(target, "application")  # a clear message if it does not import
    wl = cast(WorkloadSource, _load(workload, "workload")) if workload else None
    if wl is not None and not callable(wl) and not isinstance(wl, Sequence):
        raise typer.BadParameter(f"workload {workload!r}: a function of a random.Random, or a list of invocations")
    key_list = [k for k in keys.split(",") if k]
    if wl is None:
        only = [f for f in functions.split(",") if f] or None
        wl = from_hints(cast(Application, _load(target, "application")), key_list, functions=only)
    invs = [cast(Invariant, _load(ref, "invariant")) for ref in invariant]
    if not all(callable(f) for f in invs):
        raise typer.BadParameter("an invariant is a function of the snapshot")
    opts = f" --steps {steps}"
    opts += f" --workload {shlex.quote(workload)}" if workload else ""
    opts += "".join(f" --invariant {shlex.quote(ref)}" for ref in invariant)
    opts += f" --keys {shlex.quote(keys)}" if workload is None and keys != "k0,k1,k2,k3" else ""
    opts += f" --functions {shlex.quote(functions)}" if workload is None and functions else ""
    run = [seed] if seed is not None else range(start, start + seeds)
    failed, t0 = 0, time.perf_counter()
    for s in run:
        line = f"charon test-app {shlex.quote(target)} --seed {s}{opts}"
        try:
            report = run_app(target, wl, invs, seed=s, steps=steps, reproduce=line,
                             trace=seed is not None)
        except HarnessFailure as exc:
            failed += 1
            cause = " ".join(exc.cause.split())[:400]
            typer.echo(f"FAIL seed {s}: {cause} | reproduce: {exc.reproduce}")
            continue
        if seed is not None:
            typer.echo(f"ok seed {s}: {report}")
    typer.echo(f"{len(run)} seeds: {failed} failed ({time.perf_counter() - t0:.1f}s)")
    if failed:
        raise typer.Exit(1)
