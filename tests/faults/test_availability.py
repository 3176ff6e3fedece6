"""Health endpoints answer fast while the log hangs; rescale answers say only what happened (no Spark)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from natsfix import NatsServer

from charon.apps.ycsb import app
from charon.runtime.contract import RescaleOutcome
from charon.runtime.remote import LogRuntime


@pytest.mark.nats  # a real nats-server
def test_remote_gateway_health_answers_fast_while_the_log_hangs(tmp_path: Path) -> None:
    """A stopped (SIGSTOP: connected but silent) nats-server: the remote gateway's health answers within about
    its probe timeout and says the log is unavailable, instead of waiting out a NATS timeout (~11 s)."""
    nats = NatsServer(tmp_path / "nats").start()
    rt = LogRuntime(app, f"{nats.url}/h{uuid.uuid4().hex[:6]}")  # health_timeout_s=1.0
    try:
        assert rt.health()["ok"] is True
        assert nats.proc is not None
        os.kill(nats.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(1.1)  # the cached answer is stale now
            for _ in range(3):  # each answer bounded, also while the first probe still hangs
                t0 = time.monotonic()
                h = rt.health()
                took = time.monotonic() - t0
                assert took < 2.5, f"health() took {took:.1f} s"
                assert h["ok"] is False and h["status"] == "log unavailable", h
        finally:
            os.kill(nats.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not rt.health()["ok"]:
            assert time.monotonic() < deadline, rt.health()
            time.sleep(0.2)
    finally:
        rt.close()
        nats.kill()


def test_a_log_only_rescale_answer_has_no_engine_fields() -> None:
    """``charon rescale --log-partitions M`` alone: the answer names the log's resize only (no null engine
    fields suggesting an engine rescale that did not happen)."""
    log = {"from": 2, "to": 3, "physical": 3, "epoch": 7, "switch_s": 0.01, "cpu_s": 0.001}
    assert RescaleOutcome(log=log, engine_moved=False).doc() == {"log": log}
    engine = {"from": 2, "to": 3, "epoch": 7, "keys": 10, "wait_s": 0.1, "pause_s": 0.2, "cpu_s": 0.05}
    moved = RescaleOutcome(from_=2, to=3, epoch=7, keys=10, wait_s=0.1, pause_s=0.2, cpu_s=0.05)
    assert moved.doc() == {**engine, "log": None}


def test_a_runtime_hold_survives_a_user_resume_and_keeps_the_users_pause() -> None:
    """The gate's hold (a rescale's move, a code switch) is the runtime's own: a user's resume meanwhile does not
    let an epoch start in the middle of the move, and a user's pause-after set before is still there after it."""
    from charon.runtime.control.gate import EpochGate

    gate = EpochGate()
    gate.pause(after_epoch=5)
    gate.hold()
    assert gate.closed_for(3) and not gate.paused_for(3)
    assert not gate.try_enter(3)
    gate.resume()  # a user's resume during the move
    assert gate.closed_for(3) and not gate.try_enter(3), "an epoch could start in the middle of the move"
    gate.pause(after_epoch=5)
    gate.release()
    assert not gate.closed_for(3) and gate.closed_for(6)  # the user's pause-after is kept
    assert gate.status(2)["pause_after"] == 5
    gate.resume()
    assert gate.try_enter(6)
