"""Engine-partition rescales among the fault harness's faults, and the showcase: a missing check that makes the
service pay twice only when a payment's retry meets a rescale.

``wallets.buggy_app`` dedups the provider's redeliveries in process memory instead of the wallet's state. On a
stable cluster (one worker, nothing failing) that holds; a rescale that scales out brings a new worker, the
wallets that move there no longer see the tokens credited before, and a redelivery after it is credited twice.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from charon.apps import wallets
from charon.cli.exitcodes import ExitCode
from charon.testing import Faults, HarnessFailure, Report, run_app
from charon.testing.simulation import run_seed

WALLETS = "charon.apps.wallets"
SEEDS = range(10)
CHARON = str(Path(sys.executable).with_name("charon"))


def _run(name: str, seed: int, **kw: object) -> Report:
    return run_app(f"{WALLETS}:{name}", wallets.payments, [wallets.credited_once], seed=seed, **kw)


def _stable_failures(**kw: object) -> list[HarnessFailure]:
    out = []
    for seed in SEEDS:
        try:
            _run("buggy_app", seed, faults=Faults.stable(), **kw)
        except HarnessFailure as exc:
            out.append(exc)
    return out


def test_a_retry_after_a_rescale_is_found_and_its_line_reproduces_it() -> None:
    found = _stable_failures()
    assert found, f"the missing check was not found in seeds {SEEDS}"
    exc = found[0]
    assert exc.seed < 5 and "invariant credited_once broken" in exc.cause and "the wallets hold" in exc.cause
    assert exc.reproduce == (f"charon test-app {WALLETS}:buggy_app --seed {exc.seed} --steps 50 --workload "
                             f"{WALLETS}:payments --invariant {WALLETS}:credited_once --cluster stable")
    assert str(exc).splitlines()[-1] == f"reproduce: {exc.reproduce}"
    # the line, as printed, in a new process (its own hash seed): the same failure, number for number, and its
    # trace shows the rescale and the worker that joined
    out = subprocess.run([CHARON, *shlex.split(exc.reproduce)[1:]], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "random"})
    assert out.returncode == ExitCode.FAILED, out.stdout + out.stderr
    assert f"FAIL seed {exc.seed}: {exc.cause} | reproduce: {exc.reproduce}" in out.stdout.splitlines()
    assert "] engine partitions " in out.stdout and "joins the cluster" in out.stdout, out.stdout


def test_without_rescales_the_same_seeds_do_not_find_it() -> None:
    """The control: the same seeds and the same stable cluster, rescales off: the defect stays hidden, so it is
    the rescale (with the retry after it) that exposes it."""
    assert _stable_failures(partition_rescale=True), "forced rescales must find it"
    assert _stable_failures(partition_rescale=False) == []
    quiet = [_run("buggy_app", s, faults=Faults.stable(), partition_rescale=False) for s in SEEDS]
    assert all(r.rescales == 0 and r.requests >= 40 for r in quiet)


def test_the_fixed_app_passes_the_same_seeds_with_rescales() -> None:
    stable = [_run("app", s, faults=Faults.stable(), partition_rescale=True) for s in SEEDS]
    drawn = [_run("app", s, partition_rescale=True) for s in SEEDS]  # with every other fault drawn too
    assert sum(r.rescales for r in stable) >= len(SEEDS) // 2 and sum(r.rescales for r in drawn) > 0
    assert sum(r.crashes for r in drawn) > 0


def test_rescales_are_drawn_from_the_seed_and_in_the_fingerprint() -> None:
    a, b = _run("app", 3, partition_rescale=True), _run("app", 3, partition_rescale=True)
    assert a == b and a.rescales > 0
    off = _run("app", 3, partition_rescale=False)
    assert off.rescales == 0 and off.fingerprint != a.fingerprint
    drawn = [_run("app", s).rescales for s in range(8)]
    assert any(drawn) and not all(drawn)  # drawn per seed: some seeds rescale, some do not


def test_the_simulator_rescales_under_every_fault() -> None:
    """``python -m charon.testing.simulation --rescale``: the engine's own workloads, crashes at the move's fault points
    included, stay serializable across the rescales (the input log growing too)."""
    outs = [run_seed(s, log_growth=True, engine_rescale=True) for s in range(40)]
    assert [o.error for o in outs if not o.ok] == []
    assert sum(o.stats["engine_rescales"] for o in outs) >= 20


@pytest.mark.parametrize(("argv", "code", "says"), [
    (["nosuchmodule:app"], ExitCode.APP_ERROR, "cannot import 'nosuchmodule'"),
    ([f"{WALLETS}:nosuch"], ExitCode.APP_ERROR, "has no attribute 'nosuch'"),
    ([f"{WALLETS}:app", "--cluster", "calm"], ExitCode.USAGE, "one of drawn, stable"),
    ([f"{WALLETS}:app", "--workload", "nosuchmodule:wl"], ExitCode.USAGE, "workload 'nosuchmodule:wl'"),
])
def test_the_command_refuses_with_one_line_and_its_exit_code(argv: list[str], code: int, says: str) -> None:
    out = subprocess.run([CHARON, "test-app", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stdout + out.stderr
    assert says in " ".join(out.stderr.split()) and "Traceback" not in out.stderr, out.stderr
