"""The invoke lane (charon.server.lane): POST /invoke answered from the protocol's callbacks (the direct path)
gives exactly the answers the ASGI route gives, over raw HTTP/1.1 (keep-alive, pipelining, a client gone while
waiting, the 202 of a sync wait past wait_timeout), and the direct path is the one taken."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from charon import Application, Context, Operator
from charon.config import GatewayConfig
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

TOKEN = "lane-token"
box = Operator("box")


@box.function(public=True)
async def add(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


@box.function(public=True)
async def fail(ctx: Context, why: str) -> None:
    raise ValueError(why)


APP = Application("lane", [box])


def _server(direct: bool, **cfg: Any) -> BackgroundServer:
    config = GatewayConfig(direct_invoke=direct, body_timeout=1.0, **cfg)
    return BackgroundServer(InProcessRuntime(APP, partitions=2), token=TOKEN, config=config)


def _head(path: str, body: bytes, *, token: str | None = TOKEN, extra: str = "",
          ctype: str | None = "application/json", length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if ctype is not None:
        lines.append(f"Content-Type: {ctype}")
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _read_answer(f: Any) -> tuple[int, dict[str, str], bytes]:
    status = int(f.readline().split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = f.read(int(headers.get("content-length", "0")))
    return status, headers, body


def _exchange(srv: BackgroundServer, raw: bytes, answers: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection((srv.host, srv.port), timeout=20) as s:
        s.sendall(raw)
        f = s.makefile("rb")
        return [_read_answer(f) for _ in range(answers)]


def _cases(tag: str) -> list[bytes]:
    """Requests covering every check of the route, each key and id unique to ``tag``."""
    k = f"k-{tag}"
    ok = json.dumps({"args": [2]}).encode()
    return [
        _head(f"/invoke/box/{k}/add", ok, extra=f"Idempotency-Key: {tag}-1"),
        _head(f"/invoke/box/{k}/add", ok, extra=f"Idempotency-Key: {tag}-1"),  # a retry: the first reply
        _head(f"/invoke/box/{k}/add", json.dumps({"args": [3]}).encode(), extra=f"Idempotency-Key: {tag}-1"),
        _head(f"/invoke/box/{k}/add", ok, token=None),
        _head(f"/invoke/box/{k}/add", ok, token="wrong"),
        _head(f"/invoke/box/{k}/add", ok, extra="Idempotency-Key: bad key!"),
        _head(f"/invoke/box/{k}/add", ok, extra="Idempotency-Key: __charon-mine"),
        _head(f"/invoke/box/{k}/add", b"{", extra=f"Idempotency-Key: {tag}-2"),
        _head(f"/invoke/box/{k}/add", ok, ctype="text/plain"),
        _head(f"/invoke/box/{k}/nope", ok),
        _head(f"/invoke/nobox/{k}/add", ok),
        _head(f"/invoke/box/{k}/add", json.dumps({"args": ["ten"]}).encode()),
        _head(f"/invoke/box/{k}/add", json.dumps({"args": [1], "x": 1}).encode()),
        _head(f"/invoke/box/{k}/fail", json.dumps({"args": ["no"]}).encode(), extra=f"Idempotency-Key: {tag}-3"),
        _head(f"/invoke/box/{k}/add", msgspec.msgpack.encode({"args": [5]}), ctype="application/msgpack",
              extra=f"Idempotency-Key: {tag}-4\r\nAccept: application/msgpack"),
        _head(f"/invoke/box/{k}/add", b"", ctype=None, extra=f"Idempotency-Key: {tag}-5"),
        _head(f"/invoke/box/{k}/add", ok, length=10 << 20),  # declared too large: 413, connection closed
    ]


def _normal(answer: tuple[int, dict[str, str], bytes], tag: str) -> tuple[Any, ...]:
    status, headers, body = answer
    doc: Any = (msgspec.msgpack.decode(body) if headers.get("content-type") == "application/msgpack"
                else json.loads(body) if headers.get("content-type") == "application/json" else body)
    if isinstance(doc, dict):  # the serial position differs between two runtimes; the rest may not
        doc = {k: v for k, v in doc.items() if k not in ("tid", "epoch", "position")}
        doc = json.loads(json.dumps(doc).replace(tag, "TAG"))
    kept = {h: headers.get(h) for h in ("content-type", "retry-after", "www-authenticate", "connection")}
    return status, kept, doc


def _counting(fn: Any, seen: list[int]) -> Any:
    def counted(call: Any) -> Any:
        seen.append(1)
        return fn(call)
    return counted


def test_direct_path_answers_exactly_as_the_asgi_route() -> None:
    got = {}
    for direct in (True, False):
        tag = f"t{uuid.uuid4().hex[:8]}"
        with _server(direct) as srv:
            seen: list[int] = []
            if direct:
                srv.app.direct.body_complete = _counting(srv.app.direct.body_complete, seen)
            got[direct] = [_normal(_exchange(srv, raw)[0], tag) for raw in _cases(tag)]
            if direct:  # the direct path took them (all but those refused before their body)
                assert len(seen) >= 9
    for i, (a, b) in enumerate(zip(got[True], got[False], strict=True)):
        assert a == b, f"case {i}: direct {a} != asgi {b}"
    statuses = [a[0] for a in got[True]]
    assert statuses == [200, 200, 422, 401, 401, 400, 400, 400, 415, 404, 404, 422, 400, 409, 200, 422, 413]


@pytest.fixture()
def direct_server() -> Iterator[BackgroundServer]:
    with _server(True, wait_timeout=0.3) as srv:
        yield srv


def test_pipelined_invokes_are_answered_in_order(direct_server: BackgroundServer) -> None:
    k = f"p-{uuid.uuid4().hex[:8]}"
    raw = b"".join(_head(f"/invoke/box/{k}/add", json.dumps({"args": [1]}).encode()) for _ in range(5))
    answers = _exchange(direct_server, raw, answers=5)
    assert [a[0] for a in answers] == [200] * 5
    assert [json.loads(a[2])["value"] for a in answers] == [1, 2, 3, 4, 5]


def test_sync_wait_past_timeout_is_202_and_a_client_gone_loses_nothing(direct_server: BackgroundServer) -> None:
    srv = direct_server
    k = f"w-{uuid.uuid4().hex[:8]}"
    rt = srv.runtime
    rt.pause()
    try:
        t0 = time.monotonic()
        [(status, headers, body)] = _exchange(srv, _head(f"/invoke/box/{k}/add", b'{"args": [7]}',
                                                         extra="Idempotency-Key: waited-1"))
        assert status == 202 and 0.25 <= time.monotonic() - t0 < 5
        doc = json.loads(body)
        assert doc == {"request_id": "waited-1", "status_url": "/requests/waited-1", "status": "pending"}
        assert headers["location"] == "/requests/waited-1"
        # a client that goes away while its request waits: the request still runs once
        with socket.create_connection((srv.host, srv.port), timeout=20) as s:
            s.sendall(_head(f"/invoke/box/{k}/add", b'{"args": [5]}', extra="Idempotency-Key: gone-1"))
            time.sleep(0.1)
    finally:
        rt.resume()
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    deadline = time.monotonic() + 20
    while True:
        raw = f"GET /requests/gone-1?wait=5 HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
        [(status, _, body)] = _exchange(srv, raw)
        if status == 200 or time.monotonic() > deadline:
            break
    assert status == 200 and json.loads(body)["value"] == 12
    [(status, _, body)] = _exchange(srv, f"GET /requests/waited-1 HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    assert status == 200 and json.loads(body)["value"] == 7
    assert rt.read_state("box", k) == 12


def test_body_that_never_finishes_is_408_on_the_direct_path(direct_server: BackgroundServer) -> None:
    with socket.create_connection((direct_server.host, direct_server.port), timeout=10) as s:
        s.sendall(_head("/invoke/box/slow/add", b'{"args"', length=100))
        t0 = time.monotonic()
        status, headers, body = _read_answer(s.makefile("rb"))
    assert status == 408 and json.loads(body)["error"]["type"] == "RequestTimeout"
    assert headers.get("connection") == "close" and 0.8 < time.monotonic() - t0 < 5


@pytest.mark.parametrize("direct", [True, False])
def test_a_retry_of_an_id_whose_log_entry_was_truncated_gets_its_reply(tmp_path: Any, direct: bool) -> None:
    """A durable node compacts its log: an old request's entry is gone, its id and reply are not. A retry
    with that id (after the gateway's and the runtime's reply caches forgot it) gets the stored reply at once,
    and the same id with other arguments is refused, on both paths (the direct path once took the truncated
    id for a new one, queued it, and the log dropped it as a duplicate: the client waited forever)."""
    rt = InProcessRuntime(APP, partitions=2, data_dir=str(tmp_path), reply_retention=2, compact_every=1,
                          checkpoint_s=0.0)
    config = GatewayConfig(direct_invoke=direct, recent_replies=2, wait_timeout=10)
    with BackgroundServer(rt, token=TOKEN, config=config) as srv:
        first = _exchange(srv, _head("/invoke/box/old/add", b'{"args": [4]}', extra="Idempotency-Key: old-1"))
        assert first[0][0] == 200
        for i in range(6):  # pushes old-1 out of both caches; checkpoints compact and truncate the log
            assert _exchange(srv, _head(f"/invoke/box/n{i}/add", b'{"args": [1]}',
                                        extra=f"Idempotency-Key: new-{i}"))[0][0] == 200
        rt.node.flush()
        assert rt.input_log.contains("old-1") and rt.input_log.position("old-1") is not None
        t0 = time.monotonic()
        [(status, _, body)] = _exchange(srv, _head("/invoke/box/old/add", b'{"args": [4]}',
                                                   extra="Idempotency-Key: old-1"))
        assert status == 200 and json.loads(body)["value"] == 4 and time.monotonic() - t0 < 5
        [(status, _, body)] = _exchange(srv, _head("/invoke/box/old/add", b'{"args": [5]}',
                                                   extra="Idempotency-Key: old-1"))
        assert status in (200, 422)  # a truncated entry cannot be compared: the stored reply, or a conflict
        assert rt.read_state("box", "old") == 4  # ran once


def test_answered_calls_leave_no_reference_cycles(direct_server: BackgroundServer) -> None:
    """An answered direct call lets go of uvicorn's cycle (which points back at it): with the collector off,
    a few hundred requests leave no cycles behind for it (they used to survive every young collection, and
    the collections that freed them paused the gateway for 10-30 ms)."""
    import gc

    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    gc.collect()
    gc.disable()
    try:
        with socket.create_connection((direct_server.host, direct_server.port), timeout=20) as s:
            f = s.makefile("rb")
            for i in range(200):
                s.sendall(_head(f"/invoke/box/gc-{i % 7}/add", b'{"args": [1]}', extra=f"Idempotency-Key: gc-{i}"))
                assert _read_answer(f)[0] == 200
        time.sleep(0.2)
        alive = sum(1 for o in gc.get_objects() if type(o) is RequestResponseCycle)
    finally:
        gc.enable()
    assert alive <= 5, f"{alive} request cycles still alive"
