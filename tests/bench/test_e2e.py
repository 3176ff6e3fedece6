"""benchmarks/e2e/run.py end to end at a tiny scale: the durable node and the PostgreSQL service (READ COMMITTED),
two rates of two seconds each, a pool sweep of two sizes; money conserved, every row present and sane, the
markdown table and the plot rendered."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

E2E = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e"


def _postgres_available() -> bool:
    from charon.bench import postgres

    return postgres.find_bin() is not None or os.geteuid() == 0


@pytest.mark.timeout(400)
def test_e2e_pipeline_tiny(tmp_path: Path) -> None:
    if not _postgres_available():
        pytest.skip("PostgreSQL is not installed and we are not root to install it")
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(E2E / "run.py"), "--targets", "charon,pg-rc", "--rates", "50,100", "--duration", "2",
         "--warmup", "1", "--drain", "5", "--connections", "16", "--keys", "100", "--balance", "40",
         "--pool-sweep", "2,4", "--pool-rate", "50", "--out", str(out)],
        capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["git_commit"] and doc["date"] and len(doc["loadavg_start"]) == 3
    assert set(doc["targets"]) == {"charon", "pg-rc"}
    for name, t in doc["targets"].items():
        c = t["conservation"]
        assert c["ok"] and c["actual"] == c["expected"] == 100 * 40, (name, c)
        assert len(t["rows"]) == 2, name  # 100/s does not saturate either target
        for r in t["rows"]:
            assert r["errors"] == 0, (name, r)
            assert r["scheduled"] == r["rate"] * 2
            assert r["answered"] == r["committed"] + r["aborted"] == r["scheduled"]
            assert 0.8 * r["rate"] <= r["throughput"] <= 1.2 * r["rate"], (name, r)
            lat = r["latency_ms"]
            assert 0 < lat["p50"] <= lat["p99"] <= lat["p999"] <= lat["max"] < 5000, (name, lat)
            assert r["server_cpu_us_per_request"] > 0 and r["cpu_us_per_request"]["generator"] > 0
            assert len(r["loadavg_1min"]) == 2
        assert t["max_throughput_p99_under_100ms"] is None or t["max_throughput_p99_under_100ms"]["rate"] in (50, 100)
    assert set(doc["targets"]["charon"]["rows"][0]["cpu_us_per_request"]) == {"server", "generator"}
    pg = doc["targets"]["pg-rc"]
    assert set(pg["rows"][0]["cpu_us_per_request"]) == {"service", "postgres", "generator"}
    assert pg["rows"][0]["cpu_us_per_request"]["postgres"] > 0  # the backends are counted
    assert pg["pool"] in (2, 4) and len(pg["pool_sweep"]) == 2 and pg["pool_reason"]
    assert out.with_suffix(".png").stat().st_size > 10_000

    spec = importlib.util.spec_from_file_location("e2e_report_under_test", E2E / "report.py")
    assert spec and spec.loader
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    md = report.render_markdown(doc)
    assert md.count("| charon |") == 2 and md.count("| pg-rc |") == 2
    assert "throughput at p99 < 100 ms" in md and "yes: 4,000 of 4,000" in md


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"e2e_{name}_under_test", E2E / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("isolation", ["read_committed", "serializable"])
def test_pg_service_transfers_once_and_aborts_on_insufficient_funds(isolation: str) -> None:
    """The PostgreSQL service: a repeated Idempotency-Key gets the stored reply without running again, an
    overdraft is a 409 that is stored too, and money is conserved."""
    if not _postgres_available():
        pytest.skip("PostgreSQL is not installed and we are not root to install it")
    from starlette.testclient import TestClient

    from charon.bench.postgres import PostgresCluster

    svc = _load("pg_service")
    with PostgresCluster() as cluster:
        svc.setup(cluster.dsn, 3, 10)
        auth = {"Authorization": "Bearer t"}
        with TestClient(svc.make_app(cluster.dsn, isolation, 2, "t")) as c:
            def send(rid: str, key: str, to: str, amount: int):
                return c.post(f"/invoke/account/{key}/transfer", json={"args": [to, amount]},
                              headers={**auth, "Idempotency-Key": rid})

            first = send("x1", "a0", "a1", 7)
            assert first.status_code == 200 and first.json()["value"] == 3
            again = send("x1", "a0", "a1", 7)
            assert again.status_code == 200 and again.content == first.content  # not run twice
            over = send("x2", "a0", "a2", 5)
            assert over.status_code == 409 and over.json()["error"]["type"] == "NotEnoughCredit"
            assert send("x2", "a0", "a2", 5).content == over.content
            assert c.post("/invoke/account/a0/transfer", json={"args": ["a1", 1]},
                          headers={"Idempotency-Key": "x3"}).status_code == 401
            assert c.get("/stats").json()["duplicates"] == 2
        assert svc.total(cluster.dsn) == 30
        import psycopg

        with psycopg.connect(cluster.dsn) as conn:
            assert conn.execute("SELECT balance FROM account ORDER BY key").fetchall() == [(3,), (17,), (10,)]
