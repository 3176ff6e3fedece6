"""Every bash block of the pages RUNS: one real durable `charon run` node of the quickstart's bank application per
module (token s3cret, seeded by the quickstart's own curl example), each command of a block run with the node's
``CHARON_URL``/``CHARON_TOKEN`` in the environment (``localhost:8000`` on a page means that node). A command's
comment states what to expect: ``exit N`` is its exit code (else 0), a JSON object names keys its output has, a
``charon: ...`` line is a line it prints (numbers and paths vary). A ``charon run`` line without ``exit N`` starts
a server of its own on a free port: it must answer ``/health`` and stop with 0 on Ctrl-C (SIGINT). A block marked
``<!-- needs: spark -->`` runs in the Spark-marked test; any other ``<!-- needs: REASON -->`` is listed, not run;
a block that is neither run nor marked fails here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from docblocks import EXAMPLES, ROOT, Block, blocks

from charon.server.serve import free_port

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHELL = [b for b in blocks() if b.lang == "bash"]
INCLUDED = [b for b in SHELL if b.snippets]  # the included .sh examples: tests/docs/test_examples.py runs them
RUN = [b for b in SHELL if b.needs is None and not b.snippets]
SPARK = [b for b in SHELL if b.needs == "spark"]
LISTED = {b.id: b.needs for b in SHELL if b.needs not in (None, "spark")}
CODE_REFS = "bank_v2:app,bank:app"  # what the operations page deploys


@dataclass(frozen=True)
class Command:
    line: int
    text: str
    note: str  # its trailing comment and the comment lines right below it

    @property
    def exit_code(self) -> int:
        m = re.search(r"\bexit (\d+)\b", self.note)
        return int(m.group(1)) if m else 0

    @property
    def starts_a_server(self) -> bool:
        words = self.text.split()
        while words and "=" in words[0]:
            words = words[1:]
        return words[:2] == [".venv/bin/charon", "run"] and not re.search(r"\bexit \d", self.note) \
            and not self.text.rstrip().endswith("&")


def _split_comment(line: str) -> tuple[str, str]:
    """``cmd  # note`` -> (cmd, note): the first ``#`` outside quotes that starts a word."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def commands(code: str) -> list[Command]:
    out: list[Command] = []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        cmd, note = _split_comment(text)
        if not cmd:
            if out and note:  # a comment line below a command: what it prints
                last = out[-1]
                out[-1] = Command(last.line, last.text, f"{last.note}\n{note}".strip())
            continue
        out.append(Command(start + 1, cmd, note))
    return out


def _shape(note: str) -> tuple[list[str], list[re.Pattern[str]]]:
    """The JSON keys and the ``charon: ...`` lines a note shows."""
    keys = re.findall(r'"(\w+)":', note)
    lines = []
    for ln in note.splitlines():
        if ln.startswith("charon:"):
            pat = re.escape(ln)
            pat = re.sub(r"(?:/[\w.-]+)+", r"\\S+", pat.replace(r"\-", "-"))  # paths vary
            pat = re.sub(r"\d+", r"\\d+", pat)  # so do ports, counts
            lines.append(re.compile(pat))
    return keys, lines


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"exited {proc.returncode}: {(proc.communicate()[0] or '')[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the node did not come up"
        time.sleep(0.1)


def _workdir(path: Path) -> Path:
    """A directory where ``.venv/bin/charon`` and the repository's scripts resolve, data directories do not clash."""
    path.mkdir(parents=True, exist_ok=True)
    for name in (".venv", "scripts", "benchmarks", "tests", "charon"):
        (path / name).symlink_to(ROOT / name)
    return path


def _env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CHARON_"))}
    return env | {"CHARON_URL": url, "CHARON_TOKEN": TOKEN, "PYTHONPATH": str(EXAMPLES),
                  "CHARON_GATEWAY_CODE_REFS": CODE_REFS}


@dataclass
class Node:
    url: str
    port: int
    cwd: Path


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    cwd = _workdir(tmp_path_factory.mktemp("node"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [".venv/bin/charon", "run", "bank:app", "--engine", "inprocess", "--data-dir", "./bank-data",
         "--token", TOKEN, "--port", str(port)],
        cwd=cwd, env=_env(url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        _wait_healthy(url, proc)
        seed = (EXAMPLES / "quickstart_http.sh").read_text().replace("localhost:8000", f"127.0.0.1:{port}")
        out = subprocess.run(["bash", "-e", "-c", seed], cwd=cwd, env=_env(url), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr  # alice 40, bob 60, request t-1 in the inspector
        abort = subprocess.run([".venv/bin/charon", "invoke", "account", "carol", "transfer", '["bob", 5]'], cwd=cwd,
                               env=_env(url), capture_output=True, text=True, timeout=60)
        assert abort.returncode == 1, abort.stderr  # one NotEnoughCredit, for the inspector and the charts
        deadline = time.monotonic() + 10
        while "NotEnoughCredit" not in httpx.get(f"{url}/admin/metrics/history", headers=AUTH).text:
            assert time.monotonic() < deadline, "the abort never reached the metrics history"
            time.sleep(0.2)
        yield Node(url, port, cwd)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(cmd: Command, where: Path, url: str) -> None:
    """A ``charon run`` line: on a free port, in a directory of its own; it serves and prints its ready line, then
    Ctrl-C stops it with 0."""
    port = free_port()
    words = re.sub(r"--port \d+", f"--port {port}", cmd.text).split(" ")
    n = next(i for i, w in enumerate(words) if "=" not in w)  # VAR=value prefixes stay in front of exec
    text = " ".join([*words[:n], "exec", *words[n:]])
    env = _env(url) | {"CHARON_PORT": str(port)}
    log = where / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(["bash", "-c", text], cwd=where, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        deadline = time.monotonic() + 10
        while not re.search(r'charon: ready|"event": ?"ready"', log.read_text()):  # text or JSON log lines
            assert time.monotonic() < deadline, f"{cmd.text}: no ready line\n{log.read_text()}"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, f"{cmd.text}: Ctrl-C stopped it with {proc.returncode}\n{output[-3000:]}"
    _, lines = _shape(cmd.note)
    for pat in lines:
        assert any(pat.fullmatch(ln) for ln in output.splitlines()), f"{cmd.text}: no line like {pat.pattern}\n{output}"


def run_block(block: Block, node: Node, scratch: Path) -> int:
    """Run each command of ``block`` (each asserts its exit code and promised output); how many ran."""
    ran = 0
    for cmd in commands(block.code):
        ran += 1
        where = f"{block.id} (line {block.line + cmd.line}): {cmd.text}"
        if cmd.starts_a_server:
            _serve(cmd, _workdir(scratch / f"serve-{cmd.line}"), node.url)
            continue
        text = re.sub(r"(localhost|127\.0\.0\.1):8000\b", f"127.0.0.1:{node.port}", cmd.text)
        text = re.sub(r"--port 8000\b", f"--port {node.port}", text)  # the port in use
        out = subprocess.run(["bash", "-c", text], cwd=node.cwd, env=_env(node.url), capture_output=True,
                             text=True, timeout=180)
        said = f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        assert out.returncode == cmd.exit_code, f"{where}: exit {out.returncode}\n{said}"
        keys, lines = _shape(cmd.note)
        for key in keys:
            assert f'"{key}"' in out.stdout, f"{where}: no {key!r} in its output\n{out.stdout[-2000:]}"
        for pat in lines:
            assert any(pat.fullmatch(ln) for ln in (out.stdout + out.stderr).splitlines()), (where, pat.pattern)
    return ran


def _ids(bs: list[Block]) -> list[str]:
    return [b.id for b in bs]


def test_every_shell_block_is_run_or_marked() -> None:
    """A block is run here (against the node, or as a server), in the Spark test, by test_examples, or listed with
    the reason it cannot run on one machine in a few seconds."""
    assert len(RUN) >= 10 and SPARK and INCLUDED
    for b in SHELL:
        kinds = [b in RUN, b in SPARK, b in INCLUDED, b.id in LISTED]
        assert sum(kinds) == 1, b.id
    for page_block, reason in LISTED.items():
        assert len(reason) > 10, f"{page_block}: say why it is not run"


@pytest.mark.parametrize("block", RUN, ids=_ids(RUN))
def test_shell_block_runs(block: Block, node: Node, tmp_path: Path) -> None:
    assert run_block(block, node, tmp_path) >= 1, f"{block.id}: a block with no command"  # each asserts its own


@pytest.mark.spark
@pytest.mark.parametrize("block", SPARK, ids=_ids(SPARK))
def test_spark_shell_block_runs(block: Block, node: Node, tmp_path: Path) -> None:
    assert run_block(block, node, tmp_path) >= 1, f"{block.id}: a block with no command"  # each asserts its own


def test_the_runner_checks_what_the_comments_promise(node: Node, tmp_path: Path) -> None:
    """Not vacuous: a wrong exit code, a missing key, a missing line each fail."""
    def block(code: str) -> Block:
        return Block("x.md", 1, "bash", code, False)

    run_block(block('.venv/bin/charon invoke account alice nosuch   # exit 4: UnknownFunction\n'), node, tmp_path)
    with pytest.raises(AssertionError, match="exit 4"):
        run_block(block(".venv/bin/charon invoke account alice nosuch\n"), node, tmp_path)
    with pytest.raises(AssertionError, match="no 'frobnicate'"):
        run_block(block('.venv/bin/charon status   # {"frobnicate": 1}\n'), node, tmp_path)
    with pytest.raises(AssertionError):
        run_block(block(".venv/bin/charon status\n# charon: ready — bank\n"), node, tmp_path)
    cmds = commands('a "x # y" \\\n  --b   # exit 3: z\n# {"k": 1}\n')
    assert [(c.text, c.exit_code, _shape(c.note)[0]) for c in cmds] == [('a "x # y"  --b', 3, ["k"])]
