"""The gateway's HTTP/1.1 protocol: httptools' parser (when installed) with the same guards as h11's."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest

from charon import Application, Operator
from charon.config import GatewayConfig
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server import http as server_http
from charon.server.serve import BackgroundServer

box = Operator("box")


@box.function(public=True)
async def put(ctx: Any, v: int) -> int:
    ctx.put(v)
    return v


APP = Application("httpproto", [box])


@pytest.fixture(scope="module")
def server() -> Any:
    cfg = GatewayConfig(header_timeout=1.0, max_header_bytes=4096)
    with BackgroundServer(InProcessRuntime(APP, partitions=1), config=cfg) as srv:
        yield srv


def _recv_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def test_httptools_protocol_is_used_when_installed() -> None:
    pytest.importorskip("httptools")
    cfg = server_http.uvicorn_config(None, "127.0.0.1", 0, GatewayConfig())
    assert issubclass(cfg.http, server_http.GuardedHttpTools)  # type: ignore[arg-type]


def test_a_head_within_the_limit_is_served(server: BackgroundServer) -> None:
    r = httpx.post(f"{server.url}/invoke/box/a/put", json={"args": [7]}, headers={"X-Pad": "p" * 3000}, timeout=10)
    assert r.status_code == 200 and r.json()["value"] == 7
    keep = httpx.Client(base_url=server.url, timeout=10)  # keep-alive: a second head on the same connection
    with keep:
        assert [keep.post("/invoke/box/b/put", json={"args": [i]}).json()["value"] for i in range(3)] == [0, 1, 2]


def test_a_head_over_max_header_bytes_gets_400_and_is_closed(server: BackgroundServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 3000)
        s.sendall(b"p" * 3000)  # 6 KB and still no end of the head
        data = _recv_all(s)
    assert data.startswith(b"HTTP/1.1 400"), data[:80]


def test_a_connection_without_a_head_is_closed_after_header_timeout(server: BackgroundServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTT")
        data = _recv_all(s)
        took = time.monotonic() - t0
    assert data == b"" and 0.5 < took < 4.0, (data, took)
