"""Awaiting anything but ``ctx.call`` (asyncio sleeps and futures, an async HTTP client, anyio) aborts the transaction
with ``IllegalAwait`` pointing at ``ctx.effect``, even when the function catches what the library raised, in-process,
in the oracle and through a real ``charon run`` node over HTTP; blocking I/O in a function (a file, a socket) is
flagged by the determinism check, naming the function and the operation (tests/support/repros/awaits_app.py)."""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from charon import InProcessRuntime, Request, serde
from charon.testing import serial_execute

REPROS = Path(__file__).resolve().parents[1] / "support" / "repros"
ROOT = REPROS.parents[2]
sys.path.insert(0, str(REPROS))
from awaits_app import app  # noqa: E402

TOKEN = "t"


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    """A real local HTTP service (what a function would call)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


AWAITS = ["sleeps", "sleeps0", "future", "bare_future", "http", "http_caught", "anyio_sleep"]


def _args(fn: str, url: str) -> list[object]:
    return [url] if fn.startswith("http") else []


def _one(fn: str, args: list[object], check: bool = False) -> tuple[str, str, bytes]:
    rt = InProcessRuntime(app, partitions=2, warmup_txns=0, determinism_check=check)
    res = rt.run_epoch([Request("q", "io", "k", fn, serde.encode(args), ts=5.0)])
    rt.drain()
    rep = res.replies[res.order[0]]
    assert rt.read_state("io", "k") is None or rep.ok  # an abort applies nothing
    return rep.error_type, rep.error_message or "", rep.value


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
@pytest.mark.parametrize("fn", AWAITS)
def test_each_foreign_await_is_an_illegal_await_in_process(fn: str, check: bool, service: str) -> None:
    etype, msg, _ = _one(fn, _args(fn, service), check)
    assert etype == "IllegalAwait", msg
    assert msg.startswith(f"io.{fn} awaited something other than ctx.call"), msg
    assert "ctx.effect" in msg
    # the oracle agrees (the same error type)
    ok, out = serial_execute(app, {}, 1, Request("q", "io", "k", fn, serde.encode(_args(fn, service))),
                             determinism_check=check)
    assert not ok and isinstance(out, tuple) and out[0] == "IllegalAwait", out


def test_the_guard_is_only_there_while_a_function_runs(service: str) -> None:
    """Engine code around the steps, and the caller's own event loop, keep asyncio as it was."""
    async def main() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        etype, _, _ = _one("sleeps", [])
        assert asyncio.get_running_loop() is loop
        await asyncio.sleep(0)
        async with httpx.AsyncClient() as client:
            assert (await client.get(service)).text == "hello"
        return etype, _one("ok", [])[0]

    assert asyncio.run(main()) == ("IllegalAwait", "")
    with pytest.raises(RuntimeError, match="no running event loop"):
        asyncio.get_running_loop()


def test_blocking_io_is_flagged_by_the_determinism_check(tmp_path: Path, service: str) -> None:
    path = tmp_path / "data.txt"
    path.write_text("hello")
    for fn, args, what in (("reads_file", [str(path)], f"open({str(path)!r}, 'r')"),
                           ("connects", [service], "socket.getaddrinfo('127.0.0.1')")):
        assert _one(fn, args)[0] == ""  # without the check: it runs (and the service answered the same)
        etype, msg, _ = _one(fn, args, check=True)
        assert etype == "NonDeterministicFunction", msg
        assert msg.startswith(f"io.{fn} on key 'k' did blocking I/O ({what}"), msg
        assert "ctx.effect" in msg
        ok, out = serial_execute(app, {}, 1, Request("q", "io", "k", fn, serde.encode(args)), determinism_check=True)
        assert not ok and isinstance(out, tuple) and out[0] == "NonDeterministicFunction", out
        assert serial_execute(app, {}, 1, Request("q", "io", "k", fn, serde.encode(args)))[0]


def test_imports_and_engine_io_in_a_checked_step_are_not_flagged() -> None:
    assert _one("ok", [], check=True)[0] == ""


# -- through a real node -------------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """`charon run awaits_app:app --engine inprocess` in its own process (this checkout's charon)."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from charon.cli import main; main()", "run", "awaits_app:app", "--engine",
             "inprocess", "--port", str(self.port), "--token", TOKEN, "--partitions", "2", "--data-dir",
             str(data_dir), *extra],
            cwd=REPROS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPROS), str(ROOT)])},
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def invoke(self, fn: str, args: list[object], key: str = "k") -> tuple[int, dict[str, object]]:
        r = httpx.post(f"{self.url}/invoke/io/{key}/{fn}", json={"args": args},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        return r.status_code, r.json()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    plain = Node(tmp_path_factory.mktemp("plain"))
    try:
        checked = Node(tmp_path_factory.mktemp("checked"), "--check-determinism")
    except BaseException:
        plain.close()
        raise
    yield plain, checked
    plain.close()
    checked.close()


def test_foreign_awaits_and_blocking_io_over_http(nodes: tuple[Node, Node], service: str, tmp_path: Path) -> None:
    plain, checked = nodes
    for node in nodes:
        for i, fn in enumerate(AWAITS):
            status, body = node.invoke(fn, _args(fn, service), key=f"k{i}")
            err = body["error"]
            assert isinstance(err, dict)
            assert (status, err["type"]) == (409, "IllegalAwait"), body
            assert "ctx.effect" in str(err["message"]) and f"io.{fn} awaited" in str(err["message"])
        assert node.invoke("ok", [])[0] == 200
    path = tmp_path / "data.txt"
    path.write_text("hello")
    for fn, args in (("reads_file", [str(path)]), ("connects", [service])):
        status, body = plain.invoke(fn, args, key="b")
        assert status == 200, body
        status, body = checked.invoke(fn, args, key="b")
        err = body["error"]
        assert isinstance(err, dict)
        assert (status, err["type"]) == (409, "NonDeterministicFunction"), body
        assert f"io.{fn} on key 'b' did blocking I/O" in str(err["message"])
