"""Every Spark Python worker hashes str alike, whatever PYTHONHASHSEED the driver was started with: a function
iterating a set of strings (the repros' ``setiter``) gives the same order on every worker, in every driver run,
and as ``charon run``'s in-process engine (which pins PYTHONHASHSEED=0 too). Real PySpark, local[2]."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
TESTS = Path(__file__).resolve().parents[1] / "support"


def _driver(data_dir: Path, seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "PYTHONPATH": str(TESTS / "repros")}
    p = subprocess.run([sys.executable, str(TESTS / "spark_hashseed_driver.py"), str(data_dir)], env=env,
                       capture_output=True, text=True, timeout=400, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _in_process_seed0() -> tuple[int, list]:
    code = ("import sys, json; sys.path.insert(0, 'repros'); from spark_hashseed_driver import NAMES; "
            "print(json.dumps([hash('x'), list(set(NAMES))]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env={**os.environ, "PYTHONHASHSEED": "0"},
                       capture_output=True, text=True, timeout=60, check=True)
    h, order = json.loads(p.stdout)
    return h, order


@pytest.mark.timeout(900)
def test_workers_iterate_sets_alike_whatever_the_driver_seed(tmp_path: Path) -> None:
    h0, order0 = _in_process_seed0()
    runs = [_driver(tmp_path / f"d{seed}", seed) for seed in ("1", "random")]
    for run in runs:
        assert set(run["hashes"]) == {h0}, run["hashes"]  # was the driver's seed (1) or a random one
        assert len(run["replies"]) == 4, run
        for value in run["replies"].values():
            assert value == order0, (value, order0)  # the same set order as an in-process run under seed 0
