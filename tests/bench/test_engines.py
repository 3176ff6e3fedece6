"""charon.bench.engines, the benchmarks' harness: a node started with ``charon run`` answers once it is returned,
seeding and the lean HTTP client go through the real gateway, a failed start says so; and ``benchmarks/`` keeps its
layout (scripts in folders by what they measure, outputs under ``results/``, nothing named after an issue)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from charon.bench import engines

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
AREAS = {"engine", "gateway", "e2e", "workloads", "spark", "recovery", "state", "effects", "streams",
         "observability", "log", "services"}


@pytest.mark.timeout(120)
def test_a_node_serves_once_started_and_takes_seeded_transfers_over_the_pool() -> None:
    with engines.start_node(token="t") as node:
        node.seed(10, 100)
        assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200
        assert node.data_dir is not None and node.data_dir.is_relative_to(node.workdir)

        async def transfers() -> list[int]:
            async with engines.ConnectionPool(node.url, 2) as pool:
                host = pool.host.encode()
                reqs = [engines.transfer_request(host, b"t", 0, 1, 30, b"k%d" % i) for i in range(4)]
                out = []
                for r in reqs:  # 3 x 30 fit in a balance of 100, the 4th does not
                    async with pool.connection() as c:
                        status, _ = await c.send(r)
                        out.append(status)
                return out

        assert asyncio.run(transfers()) == [200, 200, 200, 409]
        h = {"Authorization": "Bearer t"}
        assert httpx.get(f"{node.url}/state/account/a1", headers=h, timeout=5).json()["value"] == 190
        workdir = node.workdir
    assert node.proc.poll() is not None and not workdir.exists()


@pytest.mark.timeout(60)
def test_a_node_that_cannot_start_fails_the_start_at_once(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited"):
        engines.start_node("no_such_module:app", health_timeout=50)


def test_benchmarks_layout_scripts_by_area_outputs_under_results_nothing_named_after_an_issue() -> None:
    tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    top = {Path(p).relative_to("benchmarks").parts[0] for p in tracked}
    assert top <= AREAS | {"results", "README.md", "RESULTS.md", "HISTORY.md", "run.py"}, top - AREAS
    for p in tracked:
        parts = Path(p).relative_to("benchmarks").parts
        assert not re.search(r"issue\d", p), p
        if parts[0] in AREAS:  # scripts only: their outputs go under results/
            assert p.endswith(".py"), p
    assert {p.split("/")[2] for p in tracked if p.startswith("benchmarks/results/") and p.count("/") > 2} <= AREAS


def test_the_runner_help_names_quick_and_the_results_folder() -> None:
    p = subprocess.run([sys.executable, str(BENCH / "run.py"), "run", "--help"], capture_output=True, text=True,
                       check=True, timeout=60)
    assert "--quick" in p.stdout and "--results-dir" in p.stdout and "--no-render" in p.stdout
