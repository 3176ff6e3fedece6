"""The command line as a user sees it (real `charon` processes): --version, exit codes, clean help, clean errors
for the user's module, a busy port, the one ready line, `charon sql --url`, `charon read --internal`, and help
defaults that agree with the code."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from charon import Application, Context, InProcessRuntime, Operator
from charon.apps import ycsb
from charon.cli import app as cli
from charon.cli import main
from charon.cli.exitcodes import DESCRIPTION, ExitCode
from charon.config import DURABLE_REPLY_RETENTION, VOLATILE_REPLY_RETENTION, GatewayConfig
from charon.server.serve import BackgroundServer, free_port

ROOT = Path(__file__).resolve().parents[2]
CHARON = str(Path(sys.executable).parent / "charon")
TOKEN = "product-t0ken"
READY = re.compile(r"^charon: ready — (\S+) engine=(\w+) (http://\S+) \(dashboard (http://\S+)/dashboard\)$")


def charon(*args: str, cwd: Path | None = None, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHARON, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "120", **env})


# ---- --version, exit codes, help


def test_version_comes_from_the_installed_package() -> None:
    for flag in ("--version", "-V"):
        out = charon(flag)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"charon {version('charon')}"


def test_exit_codes_page_lists_every_code_as_in_the_code() -> None:
    page = (ROOT / "docs" / "reference" / "exit-codes.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+) \|$", page, flags=re.M)
    assert [(int(c), n, d) for c, n, d in rows] == [(c.value, c.name, DESCRIPTION[c]) for c in ExitCode]
    assert ExitCode.USAGE == 2  # click's own usage errors keep meaning what the table says
    bad = charon("invoke", "--no-such-option")
    assert bad.returncode == ExitCode.USAGE


def _commands() -> list[list[str]]:
    import typer.main

    root = typer.main.get_command(cli)
    out: list[list[str]] = [[]]
    for name, cmd in root.commands.items():  # type: ignore[attr-defined]
        out.append([name])
        out += [[name, sub] for sub in getattr(cmd, "commands", {})]
    return out


def test_help_renders_cleanly_for_every_command() -> None:
    commands = _commands()
    assert ["run"] in commands and ["sql"] in commands and ["effects", "work"] in commands
    for path in commands:
        r = CliRunner().invoke(cli, [*path, "--help"], terminal_width=120)
        assert r.exit_code == 0, (path, r.output)
        for raw in ("``", "`", ":class:", ":func:", ":mod:", ":data:"):
            assert raw not in r.output, (path, raw, r.output)
    shown = charon("run", "--help")  # and as a user's terminal-less shell sees it
    assert shown.returncode == 0 and "`" not in shown.stdout and "--reply-retention" in shown.stdout


# ---- the user's module


BROKEN = {
    "syntaxmod.py": ("from charon import Application\n\ndef f(:\n    pass\n", "SyntaxError", "syntaxmod.py:3",
                     "def f(:"),
    "raisesmod.py": ("import json\n\nSETTINGS = json.loads('{not json')\n", "JSONDecodeError", "raisesmod.py:3",
                     "SETTINGS = json.loads('{not json')"),
}


@pytest.mark.parametrize("module", sorted(BROKEN))
@pytest.mark.parametrize("command", [["run"], ["effects", "work"]])
def test_an_error_in_the_users_module_is_one_clean_message(tmp_path: Path, module: str, command: list[str]) -> None:
    source, kind, where, line = BROKEN[module]
    (tmp_path / module).write_text(source)
    target = module.removesuffix(".py") + ":app"
    out = charon(*command, target, cwd=tmp_path)
    assert out.returncode == ExitCode.APP_ERROR, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 3, out.stderr  # error line, file:line with the offending line, the --debug hint
    assert err[0].startswith("error: importing") and kind in err[0]
    assert err[1].strip() == f"{where}: {line}"
    assert "Traceback" not in out.stderr and "charon/cli/" not in out.stderr
    debug = charon("--debug", *command, target, cwd=tmp_path)
    assert debug.returncode == ExitCode.APP_ERROR
    assert "Traceback" in debug.stderr and f"{where}: {line}" in debug.stderr


def test_a_missing_module_is_one_line(tmp_path: Path) -> None:
    out = charon("run", "no_such_module_q:app", cwd=tmp_path)
    assert out.returncode == ExitCode.APP_ERROR
    assert out.stderr.strip() == "error: cannot import 'no_such_module_q': No module named 'no_such_module_q'"


def test_an_unexpected_error_is_one_line_with_the_internal_code(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import charon.cli.ops as cli_module

    def boom(url: str, token: str | None) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_module, "_client", boom)
    monkeypatch.setattr(sys, "argv", ["charon", "status"])
    monkeypatch.delenv("CHARON_DEBUG", raising=False)
    with pytest.raises(SystemExit) as ex:
        main()
    assert ex.value.code == ExitCode.INTERNAL
    err = capsys.readouterr().err
    assert "unexpected RuntimeError: a bug" in err and "Traceback" not in err
    monkeypatch.setenv("CHARON_DEBUG", "1")
    with pytest.raises(SystemExit):
        main()
    assert "Traceback" in capsys.readouterr().err


# ---- charon run: the port first, one ready line


def test_a_busy_port_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = charon("run", "charon.apps.ycsb:app", "--port", str(port), "--data-dir", str(tmp_path / "d"),
                     "--token", TOKEN, cwd=tmp_path)
    assert out.returncode == ExitCode.UNAVAILABLE, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: the address is already in use (another process listens there; "
        "choose --port)"]
    assert not (tmp_path / "d").exists()  # refused before the engine created anything


class Lines:
    """A process's stderr lines as they come, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._t.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            self.lines.append((time.monotonic(), raw.decode().rstrip("\n")))

    def ready(self) -> list[str]:
        return [line for _, line in self.lines if line.startswith("charon: ready")]


def run_until_ready(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None,
                    ) -> tuple[subprocess.Popen, Lines, str, list[int]]:
    """Start `charon run`; poll /health until the ready line appears: the process, its stderr, the URL and
    every /health status seen before the line."""
    port = free_port()
    proc = subprocess.Popen([CHARON, "run", *args, "--port", str(port), "--token", TOKEN], cwd=cwd,
                            env={**os.environ, "PYSPARK_PYTHON": sys.executable, **(env or {})},
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    lines = Lines(proc)
    url = f"http://127.0.0.1:{port}"
    before: list[int] = []
    deadline = time.monotonic() + timeout
    while not lines.ready():
        assert proc.poll() is None, "\n".join(line for _, line in lines.lines)
        assert time.monotonic() < deadline, "no ready line: " + "\n".join(line for _, line in lines.lines)
        try:
            before.append(httpx.get(url + "/health", timeout=5).status_code)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return proc, lines, url, before


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(2)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def check_ready(lines: Lines, url: str, app_name: str, engine: str) -> None:
    ready = lines.ready()
    assert len(ready) == 1, ready
    m = READY.match(ready[0])
    assert m is not None and m.groups() == (app_name, engine, url, url), ready
    # the node accepts work the moment the line is out
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(url + "/invoke/account/ready-1/deposit", json={"args": [3]}, headers=auth, timeout=60)
    deadline = time.monotonic() + 120  # a cold JVM on a loaded machine: the reply may come past the gateway's wait
    while r.status_code == 202 and time.monotonic() < deadline:
        r = httpx.get(url + r.json()["status_url"] + "?wait=20", headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["value"] is None, r.text


def test_inprocess_prints_one_ready_line_once_it_accepts_work(tmp_path: Path) -> None:
    proc, lines, url, _ = run_until_ready(["charon.apps.ycsb:app", "--data-dir", str(tmp_path / "d")], tmp_path, 60)
    try:
        starting = [line for _, line in lines.lines if line.startswith("charon: starting ycsb")]
        assert len(starting) == 1 and f"on {url}" in starting[0]
        check_ready(lines, url, "ycsb", "inprocess")
    finally:
        assert stop(proc) == 0
    assert len(lines.ready()) == 1


@pytest.mark.spark
def test_spark_prints_the_same_ready_line_only_once_spark_is_up(tmp_path: Path) -> None:
    proc, lines, url, before = run_until_ready(
        ["charon.apps.ycsb:app", "--engine", "spark", "--partitions", "2", "--data-dir", str(tmp_path / "d")],
        tmp_path, 300, {"CHARON_MASTER": "local[2]"})
    try:
        assert 503 in before, before  # the port answered "starting" for a while, without a ready line
        check_ready(lines, url, "ycsb", "spark")
    finally:
        assert stop(proc) == 0
    assert len(lines.ready()) == 1


# ---- charon sql --url, charon read --internal


def test_sql_through_a_running_gateway() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2)
    rt.load("account", ycsb.initial_state(12, 50))
    with BackgroundServer(rt, token=TOKEN) as srv:
        t0 = time.monotonic()
        query = "SELECT sum(value) AS total, count(*) AS n FROM account"
        out = charon("sql", "--url", srv.url, "--token", TOKEN, query)
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        assert re.search(r"│\s*600\s*│\s*12\s*│", out.stdout), out.stdout
        assert "total" in out.stdout and out.stderr == ""
        # the refusals in this process (the CLI's code as the subprocess runs it; a `charon` start each cost ~1 s)
        bad = CliRunner().invoke(cli, ["sql", "--url", srv.url, "--token", TOKEN, "SELEC nonsense"])
        assert bad.exit_code == ExitCode.REJECTED and "syntax error" in bad.stderr, bad.stderr
        assert "SQLSyntaxError" in bad.stderr and "BadRequest" not in bad.stderr, bad.stderr  # the engine's class
        assert "syntax error" not in bad.stdout, bad.stdout
        refused = CliRunner().invoke(cli, ["sql", "--url", srv.url, "--token", TOKEN, "DROP TABLE account"])
        assert refused.exit_code == ExitCode.REJECTED and "SQLRejected" in refused.stderr, refused.stderr
        denied = CliRunner().invoke(cli, ["sql", "--url", srv.url, "--token", "wrong", "SELECT 1"])
        assert denied.exit_code == ExitCode.REJECTED and "Unauthorized" in denied.stderr, denied.stderr
    assert took < 30, took  # no local Spark session (a JVM start alone takes longer on this machine)


remind = Operator("remind")


@remind.function(public=True)
async def note(ctx: Context, text: str) -> str:
    ctx.put_item("text", text)
    ctx.send_after(3600, remind, ctx.key, "ping")  # pending for an hour: an internal item of this entity
    return text


@remind.function(public=True)
async def ping(ctx: Context) -> None:
    return None


@remind.function(public=True)
async def alarm_only(ctx: Context) -> None:
    ctx.send_after(3600, remind, ctx.key, "ping")  # no value, no item of its own: only the timer


def test_read_hides_internal_items_unless_asked() -> None:
    rt = InProcessRuntime(Application("reminders", [remind]), partitions=2)
    with BackgroundServer(rt, token=TOKEN) as srv:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert c.post("/invoke/remind/r1/note", json={"args": ["hello"]}).status_code == 200
            assert c.post("/invoke/remind/r2/alarm_only", json={"args": []}).status_code == 200
        args = ["read", "remind", "--url", srv.url, "--token", TOKEN]  # in this process: not about the process
        plain = json.loads(CliRunner().invoke(cli, args).stdout)
        assert plain["items"] == {"r1": {"text": "hello"}}
        assert plain["entities"] == {"r1": None} and plain["count"] == 1
        full = json.loads(CliRunner().invoke(cli, [*args, "--internal"]).stdout)
        timers = [name for name in full["items"]["r1"] if name != "text"]
        assert len(timers) == 1 and timers[0].startswith("\x02"), full
        assert set(full["entities"]) == {"r1", "r2"} and full["count"] == 2


# ---- defaults in help agree with the code


def _option_help(command: str, name: str) -> str:
    import typer.main

    cmd = typer.main.get_command(cli).commands[command]  # type: ignore[attr-defined]
    (param,) = [p for p in cmd.params if p.name == name]
    return " ".join(str(param.help).split())


def test_reply_retention_defaults_agree_in_help_docs_and_code() -> None:
    help_text = _option_help("run", "reply_retention")
    assert (f"default: {DURABLE_REPLY_RETENTION:,} on a durable engine" in help_text
            and f"{VOLATILE_REPLY_RETENTION:,} with --ephemeral" in help_text), help_text
    assert GatewayConfig().recent_replies == DURABLE_REPLY_RETENTION
    assert InProcessRuntime(ycsb.app, partitions=1)._retention == VOLATILE_REPLY_RETENTION
    notes = (ROOT / "docs" / "reference" / "_configuration-notes.md").read_text()
    row = next(line for line in notes.splitlines() if line.startswith("| `reply_retention`"))
    assert f"{VOLATILE_REPLY_RETENTION:,} volatile; {DURABLE_REPLY_RETENTION:,} durable" in row


def test_run_option_defaults_in_help_are_the_code_defaults() -> None:
    from charon.config import SparkConfig
    from charon.runtime.guard.watchdog import DEFAULT_TIMEOUT

    assert GatewayConfig().max_body == 1 << 20 and "(default 1 MiB)" in _option_help("run", "max_body")
    stated = re.search(r"\(default ([\d.]+);", _option_help("run", "function_timeout"))
    assert stated is not None and float(stated.group(1)) == DEFAULT_TIMEOUT == SparkConfig().function_timeout


def test_readme_runs_charon_from_the_venv() -> None:
    """After the documented set-up only `.venv/bin/charon` exists: no shell line of the README or the operations
    guide runs a bare one (tests/docs checks every page's shell blocks the same way)."""
    for page in (ROOT / "README.md", ROOT / "docs" / "guides" / "operations.md"):
        text = page.read_text()
        blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
        bare = [line for b in blocks for line in b.splitlines() if re.match(r"\s*charon\s", line)]
        assert bare == [], page
    assert ".venv/bin/charon status" in (ROOT / "docs" / "guides" / "operations.md").read_text()
