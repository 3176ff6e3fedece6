"""The operator's CLI over a running gateway: status, pause, resume, read, metrics; and `charon sql` over a
node's data directory in a subprocess (its own Spark session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.cli import app
from charon.cli.exitcodes import ExitCode
from charon.server.serve import BackgroundServer

TOKEN = "cli-t0ken"
CHARON = str(Path(sys.executable).parent / "charon")


def _run(*args: str, url: str) -> dict:
    res = CliRunner().invoke(app, [*args, "--url", url, "--token", TOKEN])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_cli_pause_resume_read_metrics() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2)
    rt.load("account", ycsb.initial_state(10, 50))
    with BackgroundServer(rt, token=TOKEN) as srv:
        assert _run("status", url=srv.url)["state"] == "running"
        assert _run("pause", url=srv.url)["state"] == "paused"
        assert _run("status", url=srv.url)["paused"] is True
        assert _run("resume", url=srv.url)["paused"] is False
        cut = _run("read", "account", url=srv.url)
        assert cut["count"] == 10 and sum(cut["entities"].values()) == 500 and "epoch" in cut
        assert _run("read", "account", "a1", "a2", url=srv.url)["entities"] == {"a1": 50, "a2": 50}
        up = _run("update", "bonus", "account", "deposit", "[5]", url=srv.url)
        assert up["committed"] == 10 and up["repeated"] is False
        assert _run("update", "bonus", "account", "deposit", "[5]", url=srv.url)["repeated"] is True
        assert sum(_run("read", "account", url=srv.url)["entities"].values()) == 550
        res = CliRunner().invoke(app, ["metrics", "--url", srv.url, "--token", TOKEN])
        assert res.exit_code == 0 and "charon_paused 0.0" in res.output
        bad = CliRunner().invoke(app, ["status", "--url", srv.url, "--token", "wrong"])
        assert bad.exit_code == ExitCode.REJECTED and "Unauthorized" in bad.output
        bad = CliRunner().invoke(app, ["read", "nosuch", "--url", srv.url, "--token", TOKEN])
        assert bad.exit_code == ExitCode.REJECTED


@pytest.mark.spark
def test_cli_sql_over_a_node_data_dir(tmp_path) -> None:
    data = tmp_path / "node"
    rt = InProcessRuntime(ycsb.app, partitions=3, data_dir=str(data), fsync=False)
    rt.load("account", ycsb.initial_state(40, 25))
    for i in range(30):
        rt.run_epoch([ycsb_request(i)])
    rt.close()
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, CHARON_MASTER="local[2]")
    out = subprocess.run([CHARON, "sql", "--data-dir", str(data),
                          "SELECT sum(value) AS total, count(*) AS n, max(epoch) AS e FROM account"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "1000" in out.stdout and "40" in out.stdout and "29" in out.stdout, out.stdout
    # its progress, stage by stage, on stderr; stdout is the result only
    stages = [line for line in out.stderr.splitlines() if line.startswith("charon: ")]
    assert stages == ["charon: reading the data directory's layout…", "charon: starting Spark (JVM warm-up ~40 s)…",
                      "charon: running the query at epoch 29…", "charon: stopping Spark…"], out.stderr
    assert "charon: " not in out.stdout
    bad = CliRunner().invoke(app, ["sql", "--data-dir", str(tmp_path / "none"), "SELECT 1"])  # in this process
    assert bad.exit_code == ExitCode.FAILED and "no Charon deployment" in bad.stderr, bad.stderr


def ycsb_request(i: int):
    from charon import serde
    from charon.messages import Request

    return Request(f"r{i}", "account", ycsb.key(i % 40), "transfer", serde.encode([ycsb.key((i * 7) % 40), 3]))


def test_cli_admin_mistakes_name_the_engines_class_and_exit_by_kind() -> None:
    """Each admin mistake prints the class the engine raises in-process (not BadRequest/GatewayError) and exits
    with the code of its kind: a refusal 4 (REJECTED), a refusal for now 3 (UNAVAILABLE)."""
    rt = InProcessRuntime(ycsb.app, partitions=2)
    rt.load("account", ycsb.initial_state(10, 50))
    with BackgroundServer(rt, token=TOKEN) as srv:
        cases = [
            (["sql", "SELEC 1"], "SQLSyntaxError", ExitCode.REJECTED),
            (["sql", "DROP TABLE account"], "SQLRejected", ExitCode.REJECTED),
            (["read", "account", "--epoch", "999999"], "EpochNotRetained", ExitCode.REJECTED),
            (["rescale", "--log-partitions", "2"], "NotSupported", ExitCode.REJECTED),
            (["requests", "list", "--status", "nope"], "BadRequest", ExitCode.REJECTED),
            (["requests", "show", "nosuch"], "RequestNotFound", ExitCode.REJECTED),
        ]
        for args, name, code in cases:
            res = CliRunner().invoke(app, [*args, "--url", srv.url, "--token", TOKEN])
            assert res.exit_code == code and f"{name}: " in res.output, (args, res.exit_code, res.output)
        assert _run("pause", url=srv.url)["state"] == "paused"
        res = CliRunner().invoke(app, ["rescale", "3", "--url", srv.url, "--token", TOKEN])
        assert res.exit_code == ExitCode.UNAVAILABLE and "RescaleBusy: " in res.output, res.output
        assert rt.partitions == 2
        _run("resume", url=srv.url)
