"""Output streams over HTTP (long polling and server-sent events) and from the Python clients."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from charon.client import AsyncClient, BadRequest, Client, Event, Unauthorized
from charon.config import GatewayConfig
from charon.errors import InvalidKey, TransactionAborted
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from streams_app import app as ledger  # noqa: E402

TOKEN = "stream-token"


@pytest.fixture()
def server() -> Any:
    runtime = InProcessRuntime(ledger, partitions=2, epoch_max_ms=1.0)
    runtime.load("acct", {"a": 1000, "b": 0})
    cfg = GatewayConfig.from_env(stream_max_events=5, stream_max_waiters=2)
    with BackgroundServer(runtime, token=TOKEN, config=cfg) as srv:
        yield srv
    runtime.close()


def test_long_polling_pages_and_subscribe(server: BackgroundServer) -> None:
    with Client(server.url, token=TOKEN) as c:
        got: list[Event] = []

        def consume() -> None:
            for ev in c.subscribe("credits", from_offset=0, wait=2.0):
                got.append(ev)
                if len(got) == 12:
                    return

        t = threading.Thread(target=consume)
        t.start()  # waits (long polls) before anything is there
        for i in range(12):
            c.invoke("acct", "a", "transfer", "b", 1, f"t{i}")
        with pytest.raises(TransactionAborted):
            c.invoke("acct", "b", "transfer", "a", 10_000, "too-much")
        t.join(30)
        assert [e.value for e in got] == [[f"t{i}", "b", 1] for i in range(12)]
        assert [e.offset for e in got] == list(range(12))
        page = c.read_stream("payments", 0, limit=100)
        assert len(page.events) == 5 and page.next_offset == 5  # capped by stream_max_events (one-event atoms)
        assert "too-much" not in [e.value["tag"] for e in c.read_stream("payments", 10, limit=5).events]
        page = c.read_stream("payments", 12, wait=0.2)  # nothing new: an empty page after the wait
        assert page.events == [] and page.next_offset == 12 == page.end_offset
        with pytest.raises(InvalidKey):
            c.read_stream("no/slash")
    with Client(server.url, token="wrong") as bad, pytest.raises(Unauthorized):
        bad.read_stream("credits")


def test_http_errors_are_typed(server: BackgroundServer) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/streams/credits").status_code == 401
        assert http.get("/streams/bad name", headers=h).json()["error"]["type"] == "InvalidKey"
        for q in ("from_offset=-1", "limit=0", "wait=31", "from_offset=x", "wait=nan"):
            r = http.get(f"/streams/credits?{q}", headers=h)
            assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", q
        r = http.get("/streams/credits?from_offset=0", headers={**h, "Accept": "application/msgpack"})
        assert r.status_code == 200 and msgspec.msgpack.decode(r.content)["events"] == []


def test_waiting_readers_are_bounded(server: BackgroundServer) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    results: list[int] = []

    def wait() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            results.append(http.get("/streams/quiet?wait=1.5", headers=h).status_code)

    ts = [threading.Thread(target=wait) for _ in range(2)]
    for t in ts:
        t.start()
    time.sleep(0.5)
    with httpx.Client(base_url=server.url) as http:
        r = http.get("/streams/quiet?wait=1", headers=h)
    for t in ts:
        t.join()
    assert r.status_code == 503 and r.json()["error"]["type"] == "StreamReadersFull", r.text
    assert r.headers["Retry-After"]
    assert results == [200, 200]


def test_server_sent_events_resume_by_last_event_id(server: BackgroundServer) -> None:
    with Client(server.url, token=TOKEN) as c:
        for i in range(4):
            c.invoke("acct", "a", "transfer", "b", 2, f"s{i}")
    h = {"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream"}

    def read_sse(headers: dict[str, str], n: int) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        with httpx.Client(base_url=server.url, timeout=10) as http, \
                http.stream("GET", "/streams/payments", headers=headers) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            ident = None
            for line in r.iter_lines():
                if line.startswith("id: "):
                    ident = line[4:]
                elif line.startswith("data: "):
                    out.append((ident, msgspec.json.decode(line[6:])))
                    if len(out) == n:
                        return out
        return out

    first = read_sse(h, 2)
    assert [d["value"]["tag"] for _, d in first] == ["s0", "s1"] and first[-1][0] == "2"
    rest = read_sse({**h, "Last-Event-ID": first[-1][0]}, 2)
    assert [(i, d["offset"], d["value"]["tag"]) for i, d in rest] == [("3", 2, "s2"), ("4", 3, "s3")]
    gw = server.app.state.gateway
    deadline = time.monotonic() + 10
    while gw.stream_waiters and time.monotonic() < deadline:  # closed event streams give their slots back
        time.sleep(0.05)
    assert gw.stream_waiters == 0


async def test_async_client_subscribe(server: BackgroundServer) -> None:
    async with AsyncClient(server.url, token=TOKEN) as c:
        for i in range(3):
            await c.invoke("acct", "a", "transfer", "b", 3, f"x{i}")
        seen = []
        async for ev in c.subscribe("payments", from_offset=1, wait=1.0):
            seen.append((ev.offset, ev.value["tag"]))
            if len(seen) == 2:
                break
        assert seen == [(1, "x1"), (2, "x2")]
        with pytest.raises(BadRequest):
            await c.read_stream("payments", -1)
