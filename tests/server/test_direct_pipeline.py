"""Pipelining, partial bodies and slow clients over real HTTP/1.1: the direct invoke path (charon.server.lane's
DirectInvoke, answered from the protocol's callbacks) and the ASGI route give the same answers and close the
connection at the same points (a differential test over raw sockets), and the two defects of issue 31 item 5 stay
fixed: a long pipeline answered at once is answered whole (it recursed: RecursionError after ~140 answers, the
rest never answered; repro r4) and a pipelined request whose body stops midway gets its 408 (it had no timer at
all: a slow-loris the connection cap cannot evict; repro r9)."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from charon import Application, Context, Operator
from charon.config import GatewayConfig
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

box = Operator("box")


@box.function(public=True)
async def add(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


APP = Application("pipe", [box])
BODY_TIMEOUT = 1.0
HEADER_TIMEOUT = 1.0
KEEP_ALIVE = 1.0
WAIT_TIMEOUT = 2.5


def _req(path: str, body: bytes = b'{"args": [1]}', extra: str = "", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n"
            f"{extra}\r\n").encode() + body


def _bad(k: str) -> bytes:
    """A request the route refuses before running anything (400: a malformed Idempotency-Key): answered at once."""
    return _req(f"/invoke/box/{k}/add", extra="Idempotency-Key: !bad!\r\n")


@dataclass
class Talk:
    answers: list[tuple[int, str | None, str | None]]  # status, Connection header, error type
    closed: float | None  # seconds after the first send when the server closed the connection (None: still open)
    values: list[Any]


def _parse(buf: bytes) -> tuple[list[tuple[int, dict[str, str], bytes]], bytes]:
    out = []
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return out, buf
        lines = buf[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        n = int(headers.get("content-length", "0"))
        if len(buf) < end + 4 + n:
            return out, buf
        out.append((int(lines[0].split()[1]), headers, buf[end + 4:end + 4 + n]))
        buf = buf[end + 4 + n:]


def _talk(srv: BackgroundServer, steps: list[tuple[float, bytes]], wait: float = 8.0,
          expect: int | None = None) -> Talk:
    """Sends each step's bytes after its pause, then reads until the server closes the connection, ``expect``
    answers arrived and a moment passed without more, or ``wait`` seconds passed."""
    with socket.create_connection((srv.host, srv.port), timeout=20) as s:
        t0 = time.monotonic()
        for pause, data in steps:
            time.sleep(pause)
            s.sendall(data)
        s.settimeout(0.2)
        buf = b""
        closed = None
        answers: list[tuple[int, dict[str, str], bytes]] = []
        while time.monotonic() - t0 < wait:
            try:
                d = s.recv(1 << 20)
            except TimeoutError:
                if expect is not None and len(answers) >= expect:
                    break
                continue
            except ConnectionResetError:
                d = b""
            if not d:
                closed = time.monotonic() - t0
                break
            got, buf = _parse(buf + d)
            answers += got
    out = []
    values = []
    for status, headers, body in answers:
        doc = json.loads(body) if headers.get("content-type") == "application/json" else None
        err = doc["error"]["type"] if isinstance(doc, dict) and "error" in doc else None
        out.append((status, headers.get("connection"), err))
        values.append(doc.get("value", doc.get("status")) if isinstance(doc, dict) else None)
    return Talk(out, closed, values)


def _server(direct: bool, **cfg: Any) -> BackgroundServer:
    config = GatewayConfig(direct_invoke=direct, body_timeout=BODY_TIMEOUT, header_timeout=HEADER_TIMEOUT,
                           keep_alive=KEEP_ALIVE, wait_timeout=WAIT_TIMEOUT, **cfg)
    return BackgroundServer(InProcessRuntime(APP, partitions=2), config=config)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[bool, BackgroundServer]]:
    """A server per path (True: direct), both with deep pipelines allowed (max_pipeline 1000)."""
    with _server(True, max_pipeline=1000) as direct, _server(False, max_pipeline=1000) as asgi:
        yield {True: direct, False: asgi}


def _k() -> str:
    return f"k{uuid.uuid4().hex[:8]}"


# -- the scenarios: each gives a Talk, compared between the two paths --------------------------------------------

def pipeline_answered_at_once(srv: BackgroundServer) -> Talk:
    """r4: one request that runs, then 400 answered at once, in one write."""
    k = _k()
    return _talk(srv, [(0, _req(f"/invoke/box/{k}/add") + b"".join(_bad(k) for _ in range(400)))], expect=401)


def pipeline_of_runs(srv: BackgroundServer) -> Talk:
    k = _k()
    return _talk(srv, [(0, b"".join(_req(f"/invoke/box/{k}/add") for _ in range(50)))], expect=50)


def pipelined_partial_body(srv: BackgroundServer) -> Talk:
    """r9: a complete request, then a second whose body stops after 7 of its 13 bytes; then silence."""
    k = _k()
    second = _req(f"/invoke/box/{k}2/add")[:-6]
    return _talk(srv, [(0, _req(f"/invoke/box/{k}/add") + second)])


def pipelined_partial_body_completed(srv: BackgroundServer) -> Talk:
    """The same, but the rest of the body arrives (within body_timeout)."""
    k = _k()
    second = _req(f"/invoke/box/{k}/add")
    return _talk(srv, [(0, _req(f"/invoke/box/{k}/add") + second[:-6]), (0.3, second[-6:])], expect=2)


def answered_at_once_then_a_slow_run(srv: BackgroundServer) -> Talk:
    """A 400 answered within the read, then a request that waits past keep_alive (the runtime paused): it is
    answered 202 after wait_timeout (the keep-alive timer the 400 armed closed the connection under it)."""
    k = _k()
    srv.runtime.pause()
    try:
        return _talk(srv, [(0, _bad(k) + _req(f"/invoke/box/{k}/add"))], expect=2)
    finally:
        srv.runtime.resume()


def trickled_body(srv: BackgroundServer) -> Talk:
    """A body in three pieces within body_timeout: answered."""
    raw = _req(f"/invoke/box/{_k()}/add")
    return _talk(srv, [(0, raw[:-10]), (0.2, raw[-10:-5]), (0.2, raw[-5:])], expect=1)


def trickled_body_too_slow(srv: BackgroundServer) -> Talk:
    """A body one byte each 0.3 s, then silence: 408 body_timeout after the head (each byte does not restart
    the timer), and the connection is closed."""
    raw = _req(f"/invoke/box/{_k()}/add")
    steps = [(0.0, raw[:-13])] + [(0.3, raw[i:i + 1]) for i in range(len(raw) - 13, len(raw) - 10)]
    return _talk(srv, steps)


def partial_body_then_silence(srv: BackgroundServer) -> Talk:
    return _talk(srv, [(0, _req(f"/invoke/box/{_k()}/add", b'{"ar', length=13))])


def slow_head(srv: BackgroundServer) -> Talk:
    """A head that never completes: closed after header_timeout, without an answer."""
    raw = _req(f"/invoke/box/{_k()}/add")
    return _talk(srv, [(0, raw[:20]), (0.3, raw[20:30])])


def pipelined_partial_head(srv: BackgroundServer) -> Talk:
    """A request, then half of a pipelined head: the answer, then closed after header_timeout."""
    k = _k()
    return _talk(srv, [(0, _req(f"/invoke/box/{k}/add") + _req(f"/invoke/box/{k}/add")[:30])])


def idle_after_an_answer(srv: BackgroundServer) -> Talk:
    """An answer, then nothing: closed after keep_alive."""
    return _talk(srv, [(0, _req(f"/invoke/box/{_k()}/add"))])


SCENARIOS = [pipeline_answered_at_once, pipeline_of_runs, pipelined_partial_body, pipelined_partial_body_completed,
             answered_at_once_then_a_slow_run, trickled_body, trickled_body_too_slow, partial_body_then_silence,
             slow_head, pipelined_partial_head, idle_after_an_answer]


def _closed_bucket(closed: float | None) -> str:
    """When the server closed: at once (with an answer), after one of the 1 s timers, or not within the wait."""
    if closed is None:
        return "open"
    return "soon" if closed < 0.9 else "timer" if closed < 5 else "late"


def _expected(name: str, talk: Talk) -> None:
    """What the ASGI route is known to answer in each scenario."""
    statuses = [a[0] for a in talk.answers]
    if name == "pipeline_answered_at_once":
        assert statuses == [200] + [400] * 400, f"{len(statuses)} answers"
    elif name == "pipeline_of_runs":
        assert statuses == [200] * 50 and talk.values == list(range(1, 51))
    elif name == "pipelined_partial_body":
        assert talk.answers == [(200, None, None), (408, "close", "RequestTimeout")]
        assert _closed_bucket(talk.closed) == "timer"
    elif name == "pipelined_partial_body_completed":
        assert statuses == [200, 200] and talk.values == [1, 2]
    elif name == "answered_at_once_then_a_slow_run":
        assert statuses == [400, 202] and talk.values[1] == "pending"
    elif name == "trickled_body":
        assert statuses == [200]
    elif name in ("trickled_body_too_slow", "partial_body_then_silence"):
        assert talk.answers == [(408, "close", "RequestTimeout")] and _closed_bucket(talk.closed) == "timer"
    elif name == "slow_head":
        assert talk.answers == [] and _closed_bucket(talk.closed) == "timer"
    elif name in ("idle_after_an_answer", "pipelined_partial_head"):
        assert statuses == [200] and _closed_bucket(talk.closed) == "timer"
    else:
        raise AssertionError(name)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_direct_path_and_asgi_route_answer_alike(servers: dict[bool, BackgroundServer], scenario: Any) -> None:
    """The differential: each scenario on both paths, the same answers (status, Connection header, error type,
    values) and the same point where the server closes; each as the ASGI route is known to answer it."""
    name = scenario.__name__
    direct = servers[True].app.direct
    take = direct.take
    taken: list[bool] = []

    def counted(proto: Any, cycle: Any) -> bool:
        ok = bool(take(proto, cycle))
        taken.append(ok)
        return ok

    direct.take = counted
    try:
        got = {path: scenario(srv) for path, srv in servers.items()}
    finally:
        del direct.take
    a, b = got[True], got[False]
    _expected(name, b)
    assert a.answers == b.answers and a.values == b.values
    assert _closed_bucket(a.closed) == _closed_bucket(b.closed)
    if name not in ("slow_head", "idle_after_an_answer"):  # the direct path took the invokes
        assert taken and all(taken)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "asgi"])
def test_a_pipeline_deeper_than_max_pipeline_is_cut_alike(direct: bool) -> None:
    """At most max_pipeline requests wait behind the one being answered: the last kept one is answered with
    Connection: close, the rest are dropped unanswered, on both paths."""
    with _server(direct, max_pipeline=4) as server:
        k = _k()
        talk = _talk(server, [(0, _req(f"/invoke/box/{k}/add") + b"".join(_bad(k) for _ in range(10)))])
        assert [a[0] for a in talk.answers] == [200, 400, 400, 400, 400]
        assert talk.answers[-1][1] == "close" and _closed_bucket(talk.closed) == "soon"
        # a new connection is served as usual, and so is a pipeline within the bound
        talk = _talk(server, [(0, b"".join(_req(f"/invoke/box/{k}/add") for _ in range(5)))], expect=5)
        assert [a[0] for a in talk.answers] == [200] * 5 and talk.answers[-1][1] is None


def test_r4_a_long_pipeline_answered_at_once_is_answered_whole(servers: dict[bool, BackgroundServer]) -> None:
    """Repro r4 on the direct path: 1 request that runs and 400 pipelined behind it answered at once, in one
    write. Each answer started the next request from within itself (RecursionError after ~140 answers, the rest
    never answered); now a loop goes on from one to the next: all 401 answered, in order."""
    talk = pipeline_answered_at_once(servers[True])
    assert [a[0] for a in talk.answers] == [200] + [400] * 400
    assert talk.closed is None  # the connection stays usable


def test_r9_a_pipelined_request_whose_body_stops_gets_408(servers: dict[bool, BackgroundServer]) -> None:
    """Repro r9 on the direct path: a request, then a pipelined one whose body stops midway. Taken from the
    pipeline (not by a read) it got no body timer, and no head or keep-alive timer either: the connection
    stayed open for good and the connection cap could not evict it. Now: 408 after body_timeout, closed."""
    talk = pipelined_partial_body(servers[True])
    assert talk.answers == [(200, None, None), (408, "close", "RequestTimeout")]
    assert talk.closed is not None and BODY_TIMEOUT * 0.8 < talk.closed < BODY_TIMEOUT + 4
