"""The example files the pages include (docs/examples): each runs, each is shown on a page, and the quickstart's
shell and client examples run against a real `charon run` node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from docblocks import EXAMPLES, ROOT, blocks

from charon.server.serve import free_port

NEEDS_NODE = {"client.py"}  # run by test_quickstart_against_a_real_node
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in NEEDS_NODE)


def _run(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLES), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, **kw)  # type: ignore[call-overload,no-any-return]


def test_every_example_is_shown_on_a_page() -> None:
    shown = {s for b in blocks() for s in b.snippets}
    assert shown >= {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")}


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs(name: str) -> None:
    out = _run([sys.executable, name], cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr


def test_timer_example_prints_what_its_comments_promise() -> None:
    out = _run([sys.executable, "reminders.py"], cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["70 ['release']", "100 ['release']", "False", "True 50", "50 []"]


def test_workflow_example_prints_what_its_guide_says() -> None:
    out = _run([sys.executable, "checkout.py"], cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["done {'shipped': 'apple'} ['reserve', 'charged', 'approved', 'ship']",
                                       "compensated ['reserve', 'charged'] 3"]


def test_pinning_example_prints_what_its_guide_says() -> None:
    out = _run([sys.executable, "pinning.py"], cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['v1:welcome', 'v1:verify']", "['v1:welcome', 'v2:verify']",
                                       "2 ['v2:welcome']"]


def test_migration_example_prints_what_its_guide_says() -> None:
    out = _run([sys.executable, "migrating.py"], cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "2 approved_v2 {'amount': 40, 'currency': 'EUR'}",
        "bob stays on 1: the migration of workflow 'checkout' from '1' maps no step 'review' (maps: approved, "
        "charged)",
        "v2 paid 40 EUR | v1 reviewed 500"]


def test_quickstart_against_a_real_node(tmp_path: Path) -> None:
    port = free_port()
    node = subprocess.Popen(
        [str(ROOT / ".venv/bin/charon"), "run", "bank:app", "--engine", "inprocess", "--ephemeral",
         "--token", "s3cret", "--port", str(port)],
        cwd=EXAMPLES, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert node.poll() is None, node.stdout.read() if node.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the node did not come up"
            time.sleep(0.1)
        shell = (EXAMPLES / "quickstart_http.sh").read_text().replace(":8000", f":{port}")
        out = subprocess.run(["bash", "-e", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        # curl prints each answer without a newline: three JSON documents, then the CLI's line
        decoder, text, answers = json.JSONDecoder(), out.stdout, []
        for _ in range(3):
            doc, end = decoder.raw_decode(text)
            answers.append(doc)
            text = text[end:]
        deposit, transfer, state = answers
        assert deposit["status"] == "committed" and deposit["value"] is None
        assert (transfer["request_id"], transfer["value"], transfer["status"]) == ("t-1", 70, "committed")
        assert {"tid", "epoch", "position"} <= transfer.keys()  # the place in the serial order the comment shows
        assert state["value"] == 70
        assert text.strip() == "40"  # charon invoke prints the return value
        client = (EXAMPLES / "client.py").read_text().replace(":8000", f":{port}")
        (tmp_path / "client.py").write_text(client)
        out = _run([sys.executable, "client.py"], cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        value, epoch, position = out.stdout.split()
        assert value == "None" and int(epoch) >= 1 and int(position) >= 0
    finally:
        node.terminate()
        node.wait(timeout=30)
