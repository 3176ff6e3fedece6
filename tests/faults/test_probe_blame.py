"""The recovery probe (issue 31): it blames only a step that started and did not end, the child dying in it or the
step running past its own function's budget; an epoch of many steps each within its budget is never cut short by
an epoch-wide deadline; a child that dies after its last step ended (in the engine's own work) blames nobody, and
recovery exits (75) with a FATAL line naming the epoch instead of quarantining an innocent, possibly answered,
transaction. Real forked children, as at recovery."""

from __future__ import annotations

import os
import subprocess
import sys

_SETUP = """
import os, sys, time
from charon import Application, Context, InProcessRuntime, Operator, serde
from charon.messages import Request
from charon.runtime.guard.quarantine import quarantine_killers

op = Operator("acct")

@op.function
async def step(ctx: Context) -> int:
    t = time.monotonic()
    while time.monotonic() - t < 0.4:  # well within its budget
        pass
    ctx.put(1)
    return 1

@op.function(timeout=0.3)
async def spin(ctx: Context) -> int:
    while True:
        pass

@op.function
async def die(ctx: Context) -> int:
    os._exit(9)

rt = InProcessRuntime(Application("t", [op]), partitions=1, warmup_txns=0)
def reqs(*fns):
    return [Request(f"req-{i}-{fn}", "acct", f"k{i}", fn, serde.encode([])) for i, fn in enumerate(fns)]
def report(out):
    print("quarantined", out, sorted((d["request_id"], d["error_type"]) for d in rt.dead_letters()))
"""


def _run(body: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _SETUP + body], env=dict(os.environ), capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_an_epoch_longer_than_the_probe_deadline_quarantines_nobody() -> None:
    """Five steps of 0.4 s under a 1 s probe deadline: each step is within its budget, nobody is blamed."""
    p = _run("""
out = quarantine_killers(0, lambda: rt._run_logged(reqs(*["step"] * 5), time.time()), lambda: rt.coordinator,
                         rt.verdict_book, 1.0, default_budget=5.0)
report(out)
""")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "quarantined [] []", p.stdout


def test_the_probe_blames_the_step_that_killed_the_child_or_overran_its_own_budget() -> None:
    p = _run("""
out = quarantine_killers(0, lambda: rt._run_logged(reqs("step", "die", "step", "spin", "step"), time.time()),
                         lambda: rt.coordinator, rt.verdict_book, 30.0, default_budget=5.0)
report(out)
""")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == ("quarantined ['req-1-die', 'req-3-spin'] [('req-1-die', 'Quarantined'), "
                                       "('req-3-spin', 'Quarantined')]"), p.stdout


def test_a_death_after_every_step_ended_blames_nobody_and_exits_for_the_supervisor() -> None:
    p = _run("""
def run_then_die():  # every function completes; the process dies in engine code afterwards
    rt._run_logged(reqs("step", "step"), time.time())
    os._exit(137)
try:
    report(quarantine_killers(7, run_then_die, lambda: rt.coordinator, rt.verdict_book, 10.0, default_budget=5.0))
finally:
    print("letters", rt.dead_letters())
""")
    assert p.returncode == 75, (p.returncode, p.stdout, p.stderr)
    assert "quarantined" not in p.stdout and "letters" not in p.stdout, p.stdout
    assert "FATAL: replaying epoch 7 stops the engine's process outside any function" in p.stderr, p.stderr


def test_spark_probe_files_blame_only_a_started_step_never_a_torn_marker(tmp_path: object) -> None:
    from pathlib import Path

    from charon.runtime.guard.quarantine import culprit_in

    d = Path(str(tmp_path))
    (d / "1.log").write_bytes(b"S 3 0\nE\nS 12 1\n")  # died in tid 12's step (in its fallback)
    assert culprit_in(str(d)) == (12, True)
    (d / "1.log").write_bytes(b"S 3 0\nE\nS 1")  # died writing the start of tid 1x's step: it had not started
    assert culprit_in(str(d)) is None
    (d / "1.log").write_bytes(b"S 3 0\nE\n")  # died after its last step ended: nobody
    assert culprit_in(str(d)) is None
