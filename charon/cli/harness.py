"""``charon test-app``: the fault harness (:mod:`charon.testing.harness`) from the command line.

:func:`make_test_app` builds the command around the CLI's ``load_app`` (one-line import errors, exit code
``APP_ERROR``), so that this module does not import the CLI. A failing seed exits ``FAILED``; a wrong option
``USAGE``.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import typer

from charon.cli.exitcodes import ExitCode

if TYPE_CHECKING:
    from charon.operator import Application

CLUSTERS = ("drawn", "stable")


def _load(ref: str, what: str) -> object:
    module, _, attr = ref.partition(":")
    if not attr:
        raise typer.BadParameter(f"{what} {ref!r}: give module:attribute")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:  # noqa: BLE001 - anything the user's module raises: one line, exit USAGE
        raise typer.BadParameter(f"{what} {ref!r}: {type(exc).__name__}: {exc}") from None


def options_line(steps: int, workload: str | None, invariant: Sequence[str], keys: str, functions: str,
                 cluster: str, rescales: bool | None) -> str:
    """The options after ``--seed S`` that rerun a seed exactly (the defaults left out)."""
    opts = f" --steps {steps}"
    opts += f" --workload {shlex.quote(workload)}" if workload else ""
    opts += "".join(f" --invariant {shlex.quote(ref)}" for ref in invariant)
    opts += f" --keys {shlex.quote(keys)}" if workload is None and keys != "k0,k1,k2,k3" else ""
    opts += f" --functions {shlex.quote(functions)}" if workload is None and functions else ""
    opts += f" --cluster {cluster}" if cluster != "drawn" else ""
    opts += "" if rescales is None else " --rescales" if rescales else " --no-rescales"
    return opts


def make_test_app(load_app: Callable[[str], Application]) -> Callable[..., None]:
    """The ``test-app`` command, loading the application with ``load_app`` (the CLI's)."""

    def test_app(
        target: str = typer.Argument(..., help="The application, module:attribute."),
        seeds: int = typer.Option(20, "--seeds", min=1, help="How many seeds to run (from --start)."),
        start: int = typer.Option(0, "--start", min=0, help="The first seed."),
        seed: int | None = typer.Option(None, "--seed", help="Run this one seed, with its trace."),
        steps: int = typer.Option(50, "--steps", min=1, help="Invocations taken from the workload per seed."),
        workload: str | None = typer.Option(
            None, "--workload", help="module:function(rng) returning the invocations; default: drawn from the "
            "functions' type hints (hypothesis)."),
        invariant: list[str] = typer.Option([], "--invariant", help="module:function(snapshot), checked after "
                                            "every epoch (repeatable)."),
        keys: str = typer.Option("k0,k1,k2,k3", "--keys", help="Entity keys for generated workloads "
                                 "(comma-separated)."),
        functions: str = typer.Option("", "--functions", help="operator.function names a generated workload "
                                      "calls (comma-separated; default: all)."),
        cluster: str = typer.Option("drawn", "--cluster", help="drawn: the cluster's faults drawn from the seed; "
                                    "stable: one worker that never fails, no re-runs, no driver crash."),
        rescales: bool | None = typer.Option(None, "--rescales/--no-rescales", help="Rescale the engine "
                                             "partitions at epoch boundaries, or never (default: drawn)."),
    ) -> None:
        """Run an application's workload under seeded faults (worker hops, lost worker state and processes, task
        re-runs, driver crashes at every fault point, client retries, timers, input-log rescales, engine-partition
        rescales), checking the serial oracle and the invariants after every epoch. Exits 6 (FAILED) if a seed
        fails, printing the line that reproduces it."""
        from charon.testing.harness import Faults, HarnessFailure, Invariant, WorkloadSource, from_hints, run_app

        if cluster not in CLUSTERS:
            raise typer.BadParameter(f"--cluster {cluster!r}: one of {', '.join(CLUSTERS)}")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        application = load_app(target)  # one line and APP_ERROR if it does not import
        wl = cast(WorkloadSource, _load(workload, "workload")) if workload else None
        if wl is not None and not callable(wl) and not isinstance(wl, Sequence):
            raise typer.BadParameter(f"workload {workload!r}: a function of a random.Random, or a list of "
                                     "invocations")
        if wl is None:
            only = [f for f in functions.split(",") if f] or None
            known = {fn.qualname for op in application.operators.values() for fn in op.functions.values()}
            if unknown := sorted(set(only or ()) - known):
                raise typer.BadParameter(f"--functions: no function {', '.join(unknown)} in {target} (give "
                                         f"operator.function; it has: {', '.join(sorted(known)) or 'none'})")
            wl = from_hints(application, [k for k in keys.split(",") if k], functions=only)
        invs = [cast(Invariant, _load(ref, "invariant")) for ref in invariant]
        if not all(callable(f) for f in invs):
            raise typer.BadParameter("an invariant is a function of the snapshot")
        opts = options_line(steps, workload, invariant, keys, functions, cluster, rescales)
        faults = Faults.stable() if cluster == "stable" else None
        run = [seed] if seed is not None else range(start, start + seeds)
        failed, t0 = 0, time.perf_counter()
        for s in run:
            line = f"charon test-app {shlex.quote(target)} --seed {s}{opts}"
            try:
                report = run_app(target, wl, invs, seed=s, steps=steps, reproduce=line, faults=faults,
                                 partition_rescale=rescales, trace=seed is not None)
            except HarnessFailure as exc:
                failed += 1
                cause = " ".join(exc.cause.split())[:400]
                typer.echo(f"FAIL seed {s}: {cause} | reproduce: {exc.reproduce}")
                continue
            if seed is not None:
                typer.echo(f"ok seed {s}: {report}")
        typer.echo(f"{len(run)} seeds: {failed} failed ({time.perf_counter() - t0:.1f}s)")
        if failed:
            raise typer.Exit(ExitCode.FAILED)

    return test_app
