"""The one fault-injection module (:mod:`charon.runtime.faults`): both runtimes' ``CHARON_CRASH_AT`` syntaxes
(``<point>:<epoch>`` for Spark, ``node:<point>:<epoch>`` for the durable node), ``CHARON_FAULT_AT`` and the
simulator's interception."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from charon.runtime import faults


def _crash_in_child(spec: str | None, point: str, epoch: int) -> bool:
    """Whether ``crash_point(point, epoch)`` SIGKILLs a process started with ``CHARON_CRASH_AT=spec`` (``None``:
    the variable unset)."""
    code = f"from charon.runtime.faults import crash_point; crash_point({point!r}, {epoch}); print('alive')"
    env = {k: v for k, v in os.environ.items() if k != "CHARON_CRASH_AT"}
    if spec is not None:
        env["CHARON_CRASH_AT"] = spec
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env)
    if child.returncode == -signal.SIGKILL:
        assert b"alive" not in child.stdout
        return True
    assert child.returncode == 0 and b"alive" in child.stdout, child.stderr
    return False


@pytest.mark.parametrize(("spec", "point", "epoch", "crashes"), [
    ("after_finalize:4", "after_finalize", 4, True),  # a Spark point at its epoch
    ("after_finalize:4", "after_finalize", 3, False),
    ("relayout:*", "relayout", 7, True),  # "*": the first epoch that gets there
    ("node:relayout:2", "node:relayout", 2, True),  # a node point
    ("node:relayout:2", "relayout", 2, False),  # ... is not the Spark runtime's point of the same name
    ("relayout:2", "node:relayout", 2, False),  # ... nor the other way round
])
def test_one_syntax_for_both_runtimes(spec: str, point: str, epoch: int, crashes: bool) -> None:
    assert _crash_in_child(spec, point, epoch) is crashes


@pytest.mark.parametrize(("point", "epoch"), [("node:record", 1), ("after_finalize", 1), ("relayout", 0)])
def test_crash_points_are_inert_without_the_variable(point: str, epoch: int) -> None:
    """Without ``CHARON_CRASH_AT`` a crash point lets its process live (the child prints after it)."""
    assert _crash_in_child(None, point, epoch) is False
    assert _crash_in_child(f"{point}:{epoch}", point, epoch) is True  # the same point does kill when named


def test_intercepted_routes_every_crash_point_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARON_CRASH_AT", "after_round:*")  # would SIGKILL this process if not intercepted
    seen: list[tuple[str, int]] = []
    with faults.intercepted(lambda point, epoch: seen.append((point, epoch))):
        faults.crash_point("after_round", 3)
        faults.crash_point("node:logged", 4)
    assert seen == [("after_round", 3), ("node:logged", 4)]
    monkeypatch.delenv("CHARON_CRASH_AT")
    faults.crash_point("after_round", 5)  # the hook is gone
    assert seen == [("after_round", 3), ("node:logged", 4)]


def test_fault_point_raises_only_where_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARON_FAULT_AT", "other,session_restart")
    with pytest.raises(RuntimeError, match="session_restart"):
        faults.fault_point("session_restart")
    faults.fault_point("session")  # a prefix is not a name
    monkeypatch.delenv("CHARON_FAULT_AT")
    faults.fault_point("session_restart")
