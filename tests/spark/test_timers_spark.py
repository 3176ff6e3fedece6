"""Timers on the Spark runtime across a driver SIGKILL: killed inside the epoch that fires them (after its
collect round, or after its finalize, before the epoch record), the restarted driver fires every timer
exactly once, in the epoch the recorded batch decides, equal to an in-process replay; timers are listed
and cancelled on Spark too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from charon.runtime.spark.cluster import ProcessTree

DRIVER = str(Path(__file__).resolve().parents[1] / "support" / "spark_timer_driver.py")


def run_driver(data: str, mode: str, log: Path, crash_at: str | None, timeout: float) -> int:
    env = {k: v for k, v in os.environ.items() if k != "CHARON_CRASH_AT"}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               CHARON_LOCAL_DIR=str(log.parent / "local"))
    if crash_at:
        env["CHARON_CRASH_AT"] = crash_at
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, DRIVER, data, mode], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, stdin=subprocess.DEVNULL)
    tree = ProcessTree(proc)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            tree.scan()
            time.sleep(0.2)
        return proc.returncode if proc.returncode is not None else -999
    finally:
        tree.kill()


@pytest.mark.spark
@pytest.mark.parametrize("point", ["after_round", "after_finalize"])
def test_spark_driver_killed_in_the_firing_epoch_fires_each_timer_once(tmp_path: Path, point: str) -> None:
    data = str(tmp_path / "data")
    log = tmp_path / "driver.log"
    rc = run_driver(data, "first", log, f"{point}:1", 300)
    assert rc == -signal.SIGKILL, f"the driver did not die at {point}:1 (exit {rc})\n{log.read_text()[-4000:]}"
    rc = run_driver(data, "resume", log, None, 400)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    out = json.loads(text.strip().splitlines()[-1])
    near = [out["ids"][k] for k in ["h0", "h1", "h2", "h3", "m0", "m1"]]
    assert sorted(out["timer_replies"]) == sorted("__charon_timer:" + t for t in near), "one reply per timer"
    assert all(out["fired"][t][0] == 1 and out["fired"][t][2] for t in near), "all fired in epoch 1, the killed one"
    assert {t: 1 for t in near} == {t: e for t, e in out["timer_epochs"].items() if t in near}
    assert out["replay_ok"], "the Spark run equals the in-process replay of its recorded epochs"
    assert out["balances"] == {f"a{i}": 100 for i in range(4)}, "every hold released once"
    for i in range(4):
        assert out["items"][f"a{i}"].get(f"fired:x{i}") == 1
    assert out["items"]["a1"].get("note:n0") == 1 and out["items"]["a2"].get("note:n1") == 1
    assert out["listed"] == [out["ids"]["far"]] and out["cancelled"] is True and out["listed_after"] == []
