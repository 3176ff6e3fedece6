"""The fault harness for applications (charon.testing.harness, ``charon test-app``, the pytest plugin).

The example is :mod:`charon.apps.wallets`: ``buggy_app`` deduplicates a payment provider's redeliveries in
process memory, ``app`` in the wallet's state. The harness must find the defect within a few seeds, print a
line that reproduces it (run here in a new process), and pass the correct app on the same seeds.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from charon.apps import holds, wallets
from charon.cli import app as cli
from charon.cli.exitcodes import ExitCode
from charon.testing import Faults, HarnessFailure, Invocation, Snapshot, fault_seeds, from_hints, run_app

WALLETS = "charon.apps.wallets"
SEEDS = range(10)
CHARON = str(Path(sys.executable).with_name("charon"))


def _wallets(name: str, seed: int, **kw: object) -> object:
    return run_app(f"{WALLETS}:{name}", wallets.payments, [wallets.credited_once], seed=seed, **kw)


def _first_failure(name: str) -> HarnessFailure:
    for seed in SEEDS:
        try:
            _wallets(name, seed)
        except HarnessFailure as exc:
            return exc
    pytest.fail(f"no failure of {name} in seeds {SEEDS}")


def test_the_planted_defect_is_found_and_its_line_reproduces_it() -> None:
    exc = _first_failure("buggy_app")
    assert exc.seed < 5
    assert "invariant credited_once broken" in exc.cause and "the wallets hold" in exc.cause
    line = str(exc).splitlines()[-1]
    assert line == f"reproduce: {exc.reproduce}"
    assert exc.reproduce == (f"charon test-app {WALLETS}:buggy_app --seed {exc.seed} --steps 50 "
                             f"--workload {WALLETS}:payments --invariant {WALLETS}:credited_once")
    # the line, run as it is printed (a new process, its own hash seed): the same failure, number for number
    argv = shlex.split(exc.reproduce)
    out = subprocess.run([CHARON, *argv[1:]], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "random"})
    assert out.returncode == ExitCode.FAILED, out.stdout + out.stderr
    assert f"FAIL seed {exc.seed}: {exc.cause} | reproduce: {exc.reproduce}" in out.stdout.splitlines()


def test_the_correct_app_passes_the_same_seeds() -> None:
    reports = [_wallets("app", seed) for seed in SEEDS]
    assert all(r.isolated for r in reports)  # every simulated worker had its own copy of the module
    assert sum(r.requests for r in reports) >= 40 * len(SEEDS)
    # the seeds did inject faults: driver crashes, client retries, input-log rescales, several workers
    assert sum(r.crashes for r in reports) > 0 and sum(r.retries for r in reports) > 0
    assert sum(r.log_resizes for r in reports) > 0
    assert sum("workers=1," not in r.faults for r in reports) > 0


def test_without_faults_the_defect_stays_hidden() -> None:
    """The control: one worker process, nothing failing: the process memory holds and the defective app passes
    the seeds that fail under faults, so it is the faults that expose it."""
    quiet = Faults(workers=1, hop=0.0, lose=0.0, restart=0.0, retry=0.0, read=0.0, crash=0.0, max_crashes=0)
    failing = _first_failure("buggy_app").seed
    report = _wallets("buggy_app", failing, faults=quiet, rescale=False, partition_rescale=False)
    assert report.crashes == 0 and report.requests >= 40
    with pytest.raises(HarnessFailure):  # and the same seed with its drawn faults fails again
        _wallets("buggy_app", failing)


def test_the_serial_oracle_catches_it_without_invariants() -> None:
    """No invariant given: the engine's replies and state are compared with a serial execution (in its own copy
    of the module), which credits a redelivery once; the defect's double credit differs from it."""
    failing = _first_failure("buggy_app").seed
    with pytest.raises(HarnessFailure) as info:
        run_app(f"{WALLETS}:buggy_app", wallets.payments, seed=failing)
    assert "oracle" in info.value.cause or "differs from the serial execution" in info.value.cause, info.value.cause


def test_a_seed_is_the_same_run_bit_for_bit() -> None:
    a, b = _wallets("app", 3), _wallets("app", 3)
    assert a == b
    assert a.fingerprint != _wallets("app", 4).fingerprint
    bug = [str(_first_failure("buggy_app")), str(_first_failure("buggy_app"))]
    assert bug[0] == bug[1]


def test_an_invariant_returning_false_fails_with_its_name() -> None:
    def never_negative(s: Snapshot) -> bool:
        return all(v >= 0 for v in s.entities("wallet").values()) and s.epoch < 2

    with pytest.raises(HarnessFailure) as info:
        _ = run_app(wallets.app, wallets.payments, [never_negative], seed=1)
    assert info.value.cause == "epoch 2: invariant never_negative broken"
    # a local invariant cannot be named on the command line: the line is the call to rerun
    assert info.value.reproduce == (f"charon.testing.run_app('{WALLETS}:app', <the workload>, <the invariants>, "
                                    "seed=1, steps=50)")


def _holds_conserved(s: Snapshot) -> None:
    """Balances plus held money equal the money deposited by clients (``transfer`` and ``capture`` deposit too, but
    inside a transaction: those are not client invocations)."""
    deposited = sum(inv.args[0] for inv, _ in s.committed() if inv.function == "deposit")
    held = sum(h[1] for k in s.entities("acct") for n, h in s.items("acct", k).items() if n.startswith("hold:"))
    assert sum(s.entities("acct").values()) + held == deposited


def test_a_workload_from_type_hints_with_timers() -> None:
    """The workload drawn from the functions' type hints (hypothesis), the same for the same seed; holds register
    timers that fire as time passes (the run's final tick), and money stays conserved under the faults."""
    wl = from_hints(holds.app, keys=["a", "b", "c"], functions=["acct.deposit", "acct.transfer", "acct.hold",
                                                                  "acct.capture"])
    drawn = wl(random.Random(7), 30)
    assert drawn == wl(random.Random(7), 30) and drawn != wl(random.Random(8), 30)
    assert len(drawn) == 30 and {i.function for i in drawn} <= {"deposit", "transfer", "hold", "capture"}
    assert all(isinstance(i.args[0], int) and 0 <= i.args[0] <= 1000 for i in drawn if i.function == "deposit")
    fired = 0
    for seed in range(6):
        report = run_app(holds.app, wl, [_holds_conserved], seed=seed, steps=30)
        fired += report.timers_fired
    assert fired > 0


def test_invocations_as_tuples_and_client_retries_execute_once() -> None:
    """Invocations given as tuples; a client resends some of them (the same request id): each runs once."""
    def deposits(rng: random.Random) -> list[tuple]:
        return [("acct", rng.choice("ab"), "deposit", rng.randint(1, 9)) for _ in range(40)]

    retried = 0
    for seed in range(8):
        report = run_app(holds.app, deposits, [_holds_conserved], seed=seed)
        retried += report.retries
        assert report.requests == 40
    assert retried > 0
    assert Invocation.of(("acct", "a", "deposit", 5)) == Invocation("acct", "a", "deposit", (5,))


def test_an_application_not_at_module_level_is_refused() -> None:
    from charon import Application, Operator

    op = Operator("x")

    @op.function
    async def f(ctx: object) -> None:
        return None

    with pytest.raises(ValueError, match="module level"):
        run_app(Application("local", [op]), [("x", "k", "f")], seed=0)


def test_the_command_exits_nonzero_with_the_lines() -> None:
    args = ["test-app", f"{WALLETS}:buggy_app", "--seeds", "3", "--workload", f"{WALLETS}:payments",
            "--invariant", f"{WALLETS}:credited_once"]
    # in this process (the command's code as `charon` runs it; the line run as a new process: the test above)
    bad = CliRunner().invoke(cli, args)
    fails = [ln for ln in bad.stdout.splitlines() if ln.startswith("FAIL seed ")]
    assert bad.exit_code == ExitCode.FAILED and fails, bad.stdout + bad.stderr
    assert all(" | reproduce: charon test-app " in ln for ln in fails)
    assert bad.stdout.splitlines()[-1].startswith(f"3 seeds: {len(fails)} failed")
    args[1] = f"{WALLETS}:app"
    good = CliRunner().invoke(cli, args)
    assert good.exit_code == 0 and good.stdout.startswith("3 seeds: 0 failed"), good.stdout + good.stderr


def test_the_pytest_plugin(tmp_path: Path) -> None:
    """``@fault_seeds`` and the ``charon_harness`` fixture (the installed ``pytest11`` plugin), in a real pytest run
    of a user's test file; the printed line reruns the failing seed alone."""
    (tmp_path / "test_wallets.py").write_text(textwrap.dedent("""
        from charon.apps import wallets
        from charon.testing import fault_seeds

        @fault_seeds(2)
        def test_fixed(charon_harness):
            charon_harness.run(wallets.app, wallets.payments, [wallets.credited_once])

        @fault_seeds(4)
        def test_buggy(charon_harness):
            charon_harness.run(wallets.buggy_app, wallets.payments, [wallets.credited_once])
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARON_HARNESS")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run([*cmd, "test_wallets.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=env)
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED ")]
    assert failed and all(ln.startswith("FAILED test_wallets.py::test_buggy[") for ln in failed), out
    assert f"{len(failed)} failed, {6 - len(failed)} passed" in out, out  # the fixed app's 2 seeds pass
    # one line per failing seed (pytest repeats it in the short summary where it does not cut it: with CI set)
    lines = sorted({ln.split("reproduce: ", 1)[1] for ln in out.splitlines()
                    if "reproduce: CHARON_HARNESS_SEED=" in ln})
    assert len(lines) == len(failed), out
    seed = lines[0].split()[0].split("=")[1]
    assert lines[0] == f"CHARON_HARNESS_SEED={seed} python -m pytest 'test_wallets.py::test_buggy[{seed}]'"
    words = shlex.split(lines[0])
    again = subprocess.run([sys.executable, *words[2:], "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env={**env, "CHARON_HARNESS_SEED": seed})
    assert again.returncode == 1 and "1 failed" in again.stdout and "passed" not in again.stdout, again.stdout
    assert f"seed {seed}: epoch" in again.stdout


def test_fault_seeds_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    mark = fault_seeds(3, start=5)
    assert list(mark.args[1]) == [5, 6, 7]
    monkeypatch.setenv("CHARON_HARNESS_SEEDS", "2")
    assert list(fault_seeds(3).args[1]) == [0, 1]
    monkeypatch.setenv("CHARON_HARNESS_SEED", "42")
    assert list(fault_seeds(3).args[1]) == [42]


DICT_APP = '''
from charon import Application, Context, Operator

order = Operator("order")


@order.function
async def place(ctx: Context, items: dict[str, int], tags: list[int] | None) -> int:
    ctx.put({"items": items, "tags": tags})
    return len(items)


app = Application("orders", [order])
'''


def _test_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    """``charon test-app dictapp:app ARGS`` in this process (CliRunner), the module in ``tmp_path`` on the path as
    the current directory is for the command."""
    (tmp_path / "dictapp.py").write_text(DICT_APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "dictapp", raising=False)
    return CliRunner().invoke(cli, ["test-app", "dictapp:app", *args])


def test_a_generated_workload_draws_container_ints_in_the_value_model(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``dict[str, int]``: hypothesis' unbounded ints used to crash the command (exit 70, SerializationError)."""
    run = _test_app(tmp_path, monkeypatch, "--seeds", "2", "--steps", "30", "--cluster", "stable")
    assert run.exit_code == 0, run.stdout + run.stderr + repr(run.exception)
    assert "2 seeds: 0 failed" in run.stdout


def test_an_unknown_function_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _test_app(tmp_path, monkeypatch, "--seeds", "1", "--functions", "order.place,order.nosuch")
    assert run.exit_code == ExitCode.USAGE == 2, run.stdout + run.stderr
    assert "no function order.nosuch" in run.stderr and "order.place" in run.stderr


def test_from_hints_refuses_an_unknown_function() -> None:
    with pytest.raises(ValueError, match="no function wallet.nosuch"):
        from_hints(wallets.app, functions=["wallet.nosuch"])(random.Random(0), 3)
