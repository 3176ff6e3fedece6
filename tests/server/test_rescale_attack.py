"""``POST /admin/rescale`` attacked over real HTTP (a real gateway and in-process runtime, httpx): hostile
bodies of every shape get a typed 4xx and move nothing, rescales sent together admit exactly one, and the
dashboard's numbers stay right across a state read and a rescale."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import msgspec
import pytest
import uvicorn

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.client import BadRequest, Client
from charon.config import GatewayConfig
from charon.runtime.node.inprocess_engine import InProcessEngine
from charon.server.gateway import create_app
from charon.server.http import uvicorn_config
from charon.server.serve import BackgroundServer

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}
MSGPACK = {**AUTH, "Content-Type": "application/msgpack"}


def _rt(partitions: int = 2) -> InProcessRuntime:
    rt = InProcessRuntime(ycsb.app, partitions=partitions, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(20, 100))
    return rt


def test_hostile_rescale_bodies_are_typed_4xx_and_move_nothing() -> None:
    rt = _rt()
    cfg = GatewayConfig(max_partitions=8, max_body=4096)
    with BackgroundServer(rt, token=TOKEN, config=cfg) as srv:
        url = srv.url + "/admin/rescale"
        cases: list[tuple[dict[str, str], bytes, int, str]] = [
            (JSON, b'{"partitions": "4"}', 400, "BadRequest"),
            (JSON, b'{"partitions": 4.0}', 400, "BadRequest"),
            (JSON, b'{"partitions": 1e400}', 400, "BadRequest"),
            (JSON, b'{"partitions": -4}', 400, "BadRequest"),
            (JSON, b'{"partitions": 100000000000000000000000000000000}', 400, "BadRequest"),
            (JSON, b'{"partitions": {"n": 4}}', 400, "BadRequest"),
            (JSON, b'{"partitions": [4]}', 400, "BadRequest"),
            (JSON, b'{"partitions": null, "log_partitions": null}', 400, "BadRequest"),
            (JSON, b'{"Partitions": 4}', 400, "BadRequest"),
            (JSON, b"[4]", 400, "BadRequest"),
            (JSON, b"4", 400, "BadRequest"),
            (JSON, b'"4"', 400, "BadRequest"),
            (JSON, b"null", 400, "BadRequest"),
            (JSON, b'{"partitions": 4', 400, "BadRequest"),
            (JSON, b"\xff\xfe", 400, "BadRequest"),
            (JSON, b'{"partitions": 4, "x": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400, "BadRequest"),
            (JSON, b'{"partitions": 4, "pad": "' + b"x" * 8000 + b'"}', 413, "PayloadTooLarge"),
            # msgpack maps may have keys of any type: mixed ones used to crash the route (500)
            (MSGPACK, msgspec.msgpack.encode({1: 2, "partitions": 4}), 400, "BadRequest"),
            (MSGPACK, b"\x82\x91\x01\x01\xa1a\x04", 400, "BadRequest"),  # {[1]: 1, "a": 4}: an array key
            (MSGPACK, msgspec.msgpack.encode({"partitions": b"\x04"}), 400, "BadRequest"),
            (MSGPACK, b"\xc1", 400, "BadRequest"),
            ({**AUTH, "Content-Type": "text/plain"}, b'{"partitions": 4}', 415, "UnsupportedMediaType"),
            ({**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, b"partitions=4", 415,
             "UnsupportedMediaType"),
            (AUTH, b'{"partitions": 4}', 415, "UnsupportedMediaType"),  # a body without a Content-Type
            ({"Content-Type": "application/json"}, b'{"partitions": 4}', 401, "Unauthorized"),
            ({"Authorization": "Bearer wrong", "Content-Type": "application/json"}, b'{"partitions": 4}', 401,
             "Unauthorized"),
            ({"Authorization": "Basic czNjcmV0", "Content-Type": "application/json"}, b'{"partitions": 4}', 401,
             "Unauthorized"),
            ({"Authorization": "Bearer", "Content-Type": "application/json"}, b'{"partitions": 4}', 401,
             "Unauthorized"),
        ]
        with httpx.Client(timeout=30) as h:
            for headers, body, status, kind in cases:
                r = h.post(url, content=body, headers=headers)
                assert r.status_code == status, (body[:60], r.status_code, r.text[:200])
                assert r.json()["error"]["type"] == kind, (body[:60], r.text[:200])
            for method in (h.get, h.put, h.delete):
                assert method(url, headers=AUTH).status_code == 405
            # the same hostile map on the other admin routes that take a body
            for path in ("/admin/pause", "/admin/resume", "/admin/sql", "/admin/update", "/admin/code"):
                r = h.post(srv.url + path, content=msgspec.msgpack.encode({1: 2, "a": 3}), headers=MSGPACK)
                assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", (path, r.text)
            st = h.get(srv.url + "/admin/status", headers=AUTH).json()
        assert rt.partitions == 2 and rt.rescale_pauses == [] and st["partitions"] == 2
        assert st["last_rescale"] is None and st["state"] == "running"
    rt.close()


def test_rescales_sent_together_admit_exactly_one() -> None:
    """The route's "one at a time" check is taken before any await: of five rescales sent together, one runs and
    four get 409 while it runs (the winner's move waits here until the other four were answered, so that a loaded
    machine cannot let it finish before the others arrive; a second one that got through would wait too, and
    show as a second 200)."""
    rt = _rt()
    original = rt.rescale
    others_answered = threading.Event()

    async def held_rescale(partitions: int) -> float:
        await asyncio.to_thread(others_answered.wait, 30)
        return await original(partitions)

    with BackgroundServer(rt, token=TOKEN) as srv:
        rt.rescale = held_rescale  # type: ignore[method-assign]

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as h:
                sent = [asyncio.create_task(h.post(srv.url + "/admin/rescale", json={"partitions": 3 + i},
                                                   headers=AUTH)) for i in range(5)]
                for n, answer in enumerate(asyncio.as_completed(sent), 1):
                    await answer
                    if n == 4:
                        others_answered.set()
                return [t.result() for t in sent]

        answers = asyncio.run(together())
        rt.rescale = original  # type: ignore[method-assign]
        codes = sorted(r.status_code for r in answers)
        assert codes == [200, 409, 409, 409, 409], [r.text for r in answers]
        assert all(r.json()["error"]["type"] == "RescaleRunning" for r in answers if r.status_code == 409)
        won = next(r.json() for r in answers if r.status_code == 200)
        assert len(rt.rescale_pauses) == 1 and rt.partitions == won["to"]
        assert sum(rt.entities("account").values()) == 20 * 100
        # the route is free again afterwards
        r = httpx.post(srv.url + "/admin/rescale", json={"partitions": 2}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and rt.partitions == 2
    rt.close()


def _committed(text: str) -> float:
    for line in text.splitlines():
        if line.startswith('charon_transactions_total{outcome="committed"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_dashboard_numbers_survive_a_state_read_and_follow_a_rescale() -> None:
    """A ``GET /state`` used to switch the gateway's metrics off (every later request and reply went
    uncounted: the dashboard's throughput and latency froze); after a rescale the per-partition load kept
    the old partition count."""
    rt = _rt(partitions=2)
    with BackgroundServer(rt, token=TOKEN) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as h:

        def transfer(i: int) -> None:
            r = h.post(f"/invoke/account/{ycsb.key(i)}/transfer", json={"args": [ycsb.key(i + 10), 1]})
            assert r.status_code == 200, r.text

        for i in range(3):
            transfer(i)
        assert h.get("/state/account/a1").json()["value"] == 99
        for i in range(3, 6):
            transfer(i)
        assert _committed(h.get("/metrics").text) == 6
        summary = h.get("/admin/summary").json()
        assert sum(summary["partition_load"]) == 6 and len(summary["partition_load"]) == 2
        assert summary["latency_ms"]["p50"] is not None and summary["throughput"] > 0
        assert h.post("/admin/rescale", json={"partitions": 4}).status_code == 200
        assert h.get("/admin/summary").json()["partition_load"] == [0, 0, 0, 0]
        for i in range(10):
            transfer(i)
        summary = h.get("/admin/summary").json()
        assert len(summary["partition_load"]) == 4 and sum(summary["partition_load"]) == 10
        assert _committed(h.get("/metrics").text) == 16
    rt.close()


@pytest.mark.parametrize("body", [{"log_partitions": 2}, {"partitions": 3, "log_partitions": 3}])
def test_a_log_rescale_on_the_inprocess_engine_is_501_and_moves_nothing(body: dict) -> None:
    rt = _rt()
    with BackgroundServer(rt, token=TOKEN) as srv:
        r = httpx.post(srv.url + "/admin/rescale", json=body, headers=AUTH)
        assert r.status_code == 501 and r.json()["error"]["type"] == "NotSupported"
        assert rt.partitions == 2 and rt.rescale_pauses == []
    rt.close()


class _SlowStart(InProcessEngine):
    """An in-process engine whose start takes long (as the Spark engine's does, ~20 s) until released."""

    slow_start = True

    def __init__(self, rt: InProcessRuntime) -> None:
        super().__init__(rt)
        self.release = threading.Event()

    async def start(self) -> None:
        await asyncio.to_thread(self.release.wait, 30)

    async def stop(self) -> None:
        self.release.set()


def test_a_rescale_while_the_runtime_starts_is_503_and_moves_nothing() -> None:
    """While a blocking start runs in the background (``charon run --engine spark``: ~20 s), a rescale used to
    move the stopped runtime's state while the query was being started from the old layout."""
    rt = InProcessRuntime(ycsb.app, partitions=2, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(20, 100))
    engine = _SlowStart(rt)
    srv = BackgroundServer(engine, token=TOKEN)
    srv.app = create_app(engine, token=TOKEN, manage_runtime=True, background_start=True)
    srv.server = uvicorn.Server(uvicorn_config(srv.app, srv.host, srv.port, srv.app.config))
    with srv:
        assert httpx.get(srv.url + "/health").json()["status"] == "starting"
        r = httpx.post(srv.url + "/admin/rescale", json={"partitions": 4}, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["type"] == "Unavailable", r.text
        assert "Retry-After" in r.headers and "starting" in r.json()["error"]["message"]
        assert rt.partitions == 2 and rt.rescale_pauses == []
        engine.release.set()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health").json().get("status") == "starting":
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_client_does_not_round_a_count() -> None:
    """``Client.rescale(2.5)`` used to send ``int(2.5)`` = 2 and move the deployment to 2 partitions."""
    rt = _rt(partitions=3)
    with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
        for bad in (2.5, 2.0, "2", True):
            with pytest.raises(BadRequest):
                c.rescale(bad)  # type: ignore[arg-type]
            with pytest.raises(BadRequest):
                c.rescale(log_partitions=bad)  # type: ignore[arg-type]
        assert rt.partitions == 3 and rt.rescale_pauses == []
        assert c.rescale(2)["to"] == 2
    rt.close()


@pytest.mark.nats  # a real nats-server
def test_admin_on_a_remote_gateway_says_where_to_go(tmp_path) -> None:  # noqa: ANN001
    """``charon status`` / ``charon rescale`` against an ``--engine remote`` gateway: 501 that names the cause."""
    from natsfix import NatsServer

    from charon.runtime.remote import LogRuntime

    nats = NatsServer(tmp_path / "nats").start()
    try:
        with BackgroundServer(LogRuntime(ycsb.app, f"{nats.url}/remote"), token=TOKEN) as srv:
            for method, path, body in (("GET", "/admin/status", None), ("POST", "/admin/rescale", {"partitions": 3}),
                                       ("POST", "/admin/rescale", {"log_partitions": 3})):
                r = httpx.request(method, srv.url + path, json=body, headers=AUTH)
                assert r.status_code == 501 and r.json()["error"]["type"] == "NotSupported", r.text
                assert "--engine remote" in r.json()["error"]["message"], r.text
    finally:
        nats.kill()
