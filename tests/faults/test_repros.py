"""The known-defect reproductions of ../shared/repros (adapted to the package's layer paths, in
tests/support/repros/) run as regression tests: each script runs in its own process on the real runtime and must
show the fixed behaviour.
The focused tests for the same scenarios are named in each case's comment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "support" / "repros"

CASES = {
    # test_fast_fallback.py::test_write_where_the_dry_run_only_read_does_not_leak
    "r1_fast_layer_leak": ["epoch 0: oracle OK"],
    # test_replay.py::test_r2_call_created_early
    "r2_replay_call_created_early": ["live=True partitions=2", "live=False partitions=1", "oracle OK"],
    # test_replay.py::test_r3_spark_hop
    "r3_spark_hop": ["same worker every round: reply ok=True, C = 10",
                     "later rounds in worker 1: reply ok=True, C = 10"],
    # test_limits.py: the limit does not depend on placement
    "r4_rounds_limit": ["partitions=1: ok=True 120", "partitions=4: ok=True 120"],
    # test_caught_callee.py
    "r5_caught_callee_error": ["engine: False", "oracle OK"],
    # test_keys.py::test_nul_key_is_rejected_and_does_not_alias
    "r6_nul_keys": ["scan_items of entity 'x' -> []", "oracle OK"],
    # test_lmdbstore.py::test_state_read_of_an_older_epoch_never_rolls_back, test_sim.py::test_r7_*
    "r7_read_state_truncates": ["epoch 2 round: ensure_epoch(1) ok, value b'v1'"],
    # test_keys.py::test_long_key_never_reaches_lmdb_after_reply
    "r8_long_key_poison": ["attempt 1: epoch finalized", "attempt 2: epoch finalized"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_repro_shows_the_fixed_behaviour(name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(HERE), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable}
    p = subprocess.run([sys.executable, str(HERE / f"{name}.py")], cwd=HERE, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "MISMATCH" not in out, out[-3000:]
    for want in CASES[name]:
        assert want in out, f"{name}: expected {want!r} in\n{out[-3000:]}"
