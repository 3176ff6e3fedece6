"""The ``charon`` command line against real gateways (a background server and a ``charon run`` process)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from charon import Application, Context, Operator
from charon.cli import app as cli
from charon.cli.exitcodes import ExitCode
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer, free_port

TOKEN = "cli-test-token"
runner = CliRunner()

wallet = Operator("wallet")


class Broke(Exception):
    """Raised by ``wallet.spend`` when the balance is too low."""


@wallet.function(public=True)
async def top_up(ctx: Context, amount: int) -> int:
    value = ctx.get(default=0) + amount
    ctx.put(value)
    return value


@wallet.function(public=True)
async def spend(ctx: Context, amount: int) -> int:
    value = ctx.get(default=0)
    if value < amount:
        raise Broke(f"only {value}")
    ctx.put(value - amount)
    return value - amount


APP = Application("clitest", [wallet])

APP_SOURCE = textwrap.dedent(
    """
    from charon import Application, Context, Operator

    wallet = Operator("wallet")

    @wallet.function(public=True)
    async def top_up(ctx: Context, amount: int) -> int:
        value = ctx.get(default=0) + amount
        ctx.put(value)
        return value

    app = Application("cliapp", [wallet])
    """
)


@pytest.fixture(scope="module")
def server() -> Any:
    runtime = InProcessRuntime(APP, partitions=2, epoch_max_txns=1000, epoch_max_ms=1.0)
    with BackgroundServer(runtime, token=TOKEN) as srv:
        yield srv


def uid() -> str:
    return f"w-{uuid.uuid4().hex[:8]}"


def cli_run(*args: str) -> Any:
    return runner.invoke(cli, list(args))


def test_invoke_and_state(server: BackgroundServer) -> None:
    key = uid()
    r = cli_run("invoke", "wallet", key, "top_up", "[25]", "--url", server.url, "--token", TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == 25
    r = cli_run("state", "wallet", key, "--url", server.url, "--token", TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == 25


def test_url_and_token_from_environment(server: BackgroundServer) -> None:
    key = uid()
    r = runner.invoke(
        cli, ["invoke", "wallet", key, "top_up", "[3]"], env={"CHARON_URL": server.url, "CHARON_TOKEN": TOKEN}
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == 3


def test_abort_exits_1_with_the_typed_error(server: BackgroundServer) -> None:
    key = uid()
    r = cli_run("invoke", "wallet", key, "spend", "[5]", "--url", server.url, "--token", TOKEN)
    assert r.exit_code == ExitCode.ABORTED == 1
    assert "Broke" in r.stderr and "only 0" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["invoke", "nosuch", "k", "top_up", "[1]"], "UnknownOperator", ExitCode.REJECTED),
        (["invoke", "wallet", "k", "nosuch", "[1]"], "UnknownFunction", ExitCode.REJECTED),
        (["invoke", "wallet", "k", "top_up", '["x"]'], "BadArguments", ExitCode.REJECTED),
        (["invoke", "wallet", "k", "top_up", "[1"], "not valid JSON", ExitCode.USAGE),
        (["invoke", "wallet", "k", "top_up", '{"a": 1}'], "must be a JSON list", ExitCode.USAGE),
    ],
)
def test_rejections_exit_rejected_or_usage(server: BackgroundServer, args: list[str], needle: str,
                                           code: ExitCode) -> None:
    r = cli_run(*args, "--url", server.url, "--token", TOKEN)
    assert r.exit_code == code
    assert needle in r.stderr


def test_wrong_token_exits_rejected(server: BackgroundServer) -> None:
    r = cli_run("state", "wallet", "k", "--url", server.url, "--token", "nope")
    assert r.exit_code == ExitCode.REJECTED
    assert "Unauthorized" in r.stderr


def test_unreachable_gateway_exits_unavailable() -> None:
    r = cli_run("invoke", "wallet", "k", "top_up", "[1]", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.exit_code == ExitCode.UNAVAILABLE
    assert "cannot reach the gateway" in r.stderr


def test_bench_delegates_or_explains() -> None:
    bench = importlib.util.find_spec("charon.bench")
    module = importlib.import_module("charon.bench") if bench else None
    if module is None or not (hasattr(module, "main") or hasattr(module, "app")):
        r = cli_run("bench")
        assert r.exit_code == ExitCode.FAILED
        assert "charon.bench" in r.stderr
    else:  # an entry point exists: only check the command is wired (running it is a benchmark)
        r = cli_run("bench", "--help")
        assert r.exit_code == 0 and "charon.bench" in r.stdout


def test_run_serves_an_app_module(tmp_path: Path) -> None:
    (tmp_path / "cli_app_mod.py").write_text(APP_SOURCE)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "charon.cli", "run", "cli_app_mod:app", "--port", str(port), "--token", TOKEN],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "charon run did not come up"
            time.sleep(0.1)
        r = cli_run("invoke", "wallet", "bob", "top_up", "[7]", "--url", url, "--token", TOKEN)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout) == 7
        assert httpx.post(url + "/invoke/wallet/bob/top_up", json={"args": [1]}).status_code == 401
        doc = httpx.get(url + "/openapi.json").json()
        assert "/invoke/wallet/{key}/top_up" in doc["paths"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert "starting cliapp" in err
    assert err.count(f"charon: ready — cliapp engine=inprocess {url} (dashboard {url}/dashboard)") == 1, err


def test_run_rejects_a_bad_target(tmp_path: Path) -> None:
    r = runner.invoke(cli, ["run", "no_such_module_xyz:app"])
    assert r.exit_code != 0
    assert "no_such_module_xyz" in r.output


def test_run_refuses_log_partitions_in_process(tmp_path: Path) -> None:
    r = runner.invoke(cli, ["run", "charon.apps.ycsb:app", "--data-dir", str(tmp_path / "d"), "--log-partitions", "2"])
    assert r.exit_code != 0
    assert "--log-partitions applies to --engine spark only" in r.output
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_run_refuses_a_spark_exchange_in_process_or_unknown(tmp_path: Path) -> None:
    r = runner.invoke(cli, ["run", "charon.apps.ycsb:app", "--data-dir", str(tmp_path / "d"),
                            "--spark-exchange", "resident"])
    assert r.exit_code != 0
    assert "--spark-exchange applies to --engine spark only" in r.output
    r = runner.invoke(cli, ["run", "charon.apps.ycsb:app", "--engine", "spark", "--data-dir", str(tmp_path / "d"),
                            "--spark-exchange", "sockets"])
    assert r.exit_code != 0
    assert "--spark-exchange must be one of resident, jobs" in r.output
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_demo_inprocess_checks_invariants() -> None:
    r = cli_run("demo", "--engine", "inprocess", "--accounts", "50", "--transactions", "300", "--concurrency", "32")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "balance conserved" in out and "✓" in out
    assert "5000 → 5000" in out  # 50 accounts × 100
    assert "300/300 answered" in out
    assert "0 got a different reply" in out
