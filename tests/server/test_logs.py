"""Server logs (issue 26): ``charon run --log-format json`` writes one JSON object per line on stderr for start,
ready, every operator action (done or refused, with who and what) and shutdown; the formatter carries any
``extra`` field and the traceback; text lines carry the same fields."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from charon.server.logs import setup_logging
from charon.server.serve import free_port

TOKEN = "logs-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


def only_this_thread(handler: logging.Handler) -> logging.Handler:
    """Keep what other threads of the test process log (runtimes earlier tests left running) out of the lines."""
    me = threading.get_ident()
    handler.addFilter(lambda record: record.thread == me)
    return handler


@pytest.fixture
def restore_logging():
    yield
    from charon.server import logs

    logs.reset_logging()


def test_json_lines_carry_extra_fields_and_the_traceback(restore_logging) -> None:
    out = io.StringIO()
    handler = only_this_thread(setup_logging("info", "json", out))
    log = logging.getLogger("charon.requests")
    try:
        raise ValueError("cannot transfer 50 of 5")
    except ValueError:
        log.error("request aborted", exc_info=True, extra={
            "request_id": "r-1", "operator": "acct", "function": "transfer", "key": "a", "error_type": "ValueError",
            "epoch": 7, "position": 3})
    logging.getLogger("charon.engine").debug("below the level")
    handler.flush()  # the writer thread has written what was logged
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 1
    doc = lines[0]
    assert doc["level"] == "error" and doc["logger"] == "charon.requests" and doc["msg"] == "request aborted"
    assert doc["ts"].endswith("Z") and doc["ts"][:4].isdigit()
    assert {k: doc[k] for k in ("request_id", "operator", "function", "key", "error_type", "epoch", "position")} \
        == {"request_id": "r-1", "operator": "acct", "function": "transfer", "key": "a", "error_type": "ValueError",
            "epoch": 7, "position": 3}
    assert doc["traceback"].startswith("Traceback (most recent call last)")
    assert "ValueError: cannot transfer 50 of 5" in doc["traceback"]


def test_text_lines_carry_the_fields_and_the_traceback(restore_logging) -> None:
    out = io.StringIO()
    handler = only_this_thread(setup_logging("debug", "text", out))
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        logging.getLogger("charon.requests").error("request aborted", exc_info=True,
                                                   extra={"request_id": "r-2", "error_type": "ZeroDivisionError"})
    handler.flush()
    first, *rest = out.getvalue().splitlines()
    assert " ERROR charon.requests: request aborted " in first
    assert "request_id=r-2" in first and "error_type=ZeroDivisionError" in first
    assert rest[0].startswith("Traceback") and rest[-1] == "ZeroDivisionError: division by zero"


def test_bad_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "yaml")
    with pytest.raises(ValueError, match="log level"):
        setup_logging("loud", "json")


def _lines(err: str) -> list[dict]:
    out = []
    for line in err.splitlines():
        assert line.startswith("{"), f"not a JSON line: {line!r}"
        out.append(json.loads(line))
    return out


def test_charon_run_json_logs_start_ready_actions_and_shutdown(tmp_path: Path) -> None:
    """A real ``charon run`` with ``--log-format json``: every stderr line is JSON; start, ready, the operator's
    pause, resume and a refused rescale (with client, status and what was asked) and the shutdown are there."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "charon.cli", "run", "tests.support.contract_app:v1", "--port", str(port), "--token",
         TOKEN, "--data-dir", str(tmp_path / "data"), "--log-format", "json", "--log-level", "info"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "charon run did not become healthy"
            time.sleep(0.05)
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
            assert c.post("/invoke/acct/a/deposit", json={"args": [5]}).status_code == 200
            aborted = c.post("/invoke/acct/a/transfer", json={"args": ["b", 50]})
            assert aborted.status_code == 409 and aborted.json()["error"]["type"] == "ValueError"
            assert c.post("/admin/pause", json={"after_epoch": 1}).status_code == 200
            assert c.post("/admin/resume").status_code == 200
            assert c.post("/admin/rescale", json={"partitions": 0}).status_code == 400
            assert c.post("/admin/pause", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == 0, err
    lines = _lines(err)
    assert all({"ts", "level", "logger", "msg"} <= set(doc) for doc in lines)
    events = [doc.get("event") for doc in lines]
    assert events[0] == "start" and lines[0]["engine"] == "inprocess" and lines[0]["url"] == url
    assert "ready" in events and events[-2:] == ["shutdown", "stopped"]
    actions = [doc for doc in lines if doc["logger"] == "charon.admin"]
    assert [(a["action"], a["status"], a["level"]) for a in actions] == [
        ("pause", 200, "info"), ("resume", 200, "info"), ("rescale", 400, "warning")]  # a wrong token: nobody's
    assert actions[0]["after_epoch"] == 1 and actions[0]["client"].startswith("127.0.0.1:")
    assert actions[2]["error_type"] == "BadRequest" and "partitions must be" in actions[2]["msg"]


def test_a_log_outage_and_its_recovery_are_logged(restore_logging) -> None:
    """The durable node's log retry (a NATS outage is an OSError) logs the outage at once and its end."""
    from types import SimpleNamespace

    from charon.runtime.node.storage import NodeStorage

    out = io.StringIO()
    handler = only_this_thread(setup_logging("info", "json", out))
    failures = iter([ConnectionRefusedError("nats down"), ConnectionRefusedError("nats down")])

    def op() -> int:
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return 42

    node = SimpleNamespace(log_wait=None)
    assert NodeStorage._retry_log(node, op, "logging epoch 3") == 42  # type: ignore[arg-type]
    handler.flush()  # the writer thread has written what was logged
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(d["logger"], d["event"], d["level"]) for d in lines] == [
        ("charon.engine", "outage", "warning"), ("charon.engine", "recovered", "warning")]
    assert lines[0]["error_type"] == "ConnectionRefusedError" and lines[0]["what"] == "logging epoch 3"
    assert lines[1]["waited_s"] > 0 and node.log_wait is None


def test_an_unread_stderr_never_blocks_the_logging_thread(restore_logging, monkeypatch) -> None:
    """A stream that blocks (a pipe nobody reads) holds the writer thread, never the caller: lines beyond the
    queue are dropped and counted, then reported once the stream moves again."""
    from charon.server import logs

    gate = threading.Event()

    class Stuck(io.StringIO):
        def write(self, s: str) -> int:
            gate.wait(10)  # bounded: a failing test never hangs the suite
            return super().write(s)

    monkeypatch.setattr(logs, "LOG_QUEUE", 50)
    monkeypatch.setattr(logs, "STOP_WAIT", 0.5)
    out = Stuck()
    handler = only_this_thread(setup_logging("info", "json", out))
    log = logging.getLogger("charon.requests")
    try:
        t0 = time.monotonic()
        for i in range(500):
            log.warning("request r%d aborted", i, extra={"request_id": f"r{i}"})
        assert time.monotonic() - t0 < 2.0  # 500 lines logged while the stream writes nothing
        # at most the queue, the record in the writer's hands and one ``log_dropped`` line got through
        assert isinstance(handler, logs.NonBlocking) and handler.dropped_total >= 500 - 52
    finally:
        gate.set()  # a failing assertion never leaves the writer stuck
    handler.flush()  # the stream moves again: the queued lines are written
    log.warning("after", extra={"request_id": "last"})
    handler.flush()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    written = [x for x in lines if x["msg"].startswith("request r")]
    dropped = [x for x in lines if x.get("event") == "log_dropped"]
    assert dropped and sum(d["dropped"] for d in dropped) + len(written) == 500, lines[-3:]
    assert sum(d["dropped"] for d in dropped) == handler.dropped_total
    assert lines[-2] == dropped[-1] and lines[-1]["request_id"] == "last"


def test_a_stream_that_never_moves_does_not_keep_the_process_alive(restore_logging, monkeypatch) -> None:
    """Stopping the writer (a new setup, the process's exit) waits at most ``STOP_WAIT`` s for a stuck stream."""
    from charon.server import logs

    gate = threading.Event()

    class Stuck(io.StringIO):
        def write(self, s: str) -> int:
            gate.wait(30)
            return super().write(s)

    monkeypatch.setattr(logs, "STOP_WAIT", 0.3)
    only_this_thread(setup_logging("info", "json", Stuck()))
    try:
        for i in range(20):
            logging.getLogger("charon.requests").warning("line %d", i)
        t0 = time.monotonic()
        logs._stop_listener()
        assert time.monotonic() - t0 < 2.0 and logs._listener is None
    finally:
        gate.set()
