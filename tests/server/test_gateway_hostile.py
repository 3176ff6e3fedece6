"""Hostile input over real HTTP (issue 9 "Gateway hardening", issue 8 defect 4): every case is a typed 4xx
that reaches nothing, never a 500; plus the gateway's bounds, timeouts and its restart behaviour."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from typing import Any

import httpx
import msgspec
import pytest

from charon import Application, Context, Operator, serde
from charon.config import GatewayConfig
from charon.core.routing import MAX_KEY_BYTES
from charon.log.client import LogClient
from charon.log.sqlite import InputLog, OutputLog
from charon.messages import Reply
from charon.runtime.contract import Engine
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

box = Operator("box")


@box.function(public=True)
async def put(ctx: Context, value: Any) -> Any:
    ctx.put(value)
    return value


@box.function(public=True)
async def add(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


@box.function(public=True)
async def ping(ctx: Context) -> str:
    return "pong"


APP = Application("hostile", [box])


class SlowReads(InProcessRuntime):
    """An in-process runtime whose state reads block for a while (as a Spark read waiting for an epoch)."""

    def read_state(self, operator: Any, key: str, default: Any = None) -> Any:
        if key == "slow":
            time.sleep(3.0)
        return super().read_state(operator, key, default)


@pytest.fixture(scope="module")
def server() -> Any:
    cfg = GatewayConfig(recent_replies=5, body_timeout=1.5, header_timeout=1.5)
    with BackgroundServer(SlowReads(APP, partitions=2), token=TOKEN, config=cfg) as srv:
        yield srv


@pytest.fixture()
def http(server: BackgroundServer) -> Any:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30.0) as c:
        yield c


def uid(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def post(http: httpx.Client, path: str, body: bytes, ctype: str = "application/json", **headers: str) -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": ctype, **headers})


def error_type(r: httpx.Response) -> str:
    return r.json()["error"]["type"]


def never_seen(server: BackgroundServer, http: httpx.Client, rid: str) -> None:
    assert server.runtime.get_reply(rid) is None
    assert http.get(f"/requests/{rid}").status_code == 404


# ------------------------------------------------------------------------------------------------ keys


@pytest.mark.parametrize(
    "raw_key,why",
    [
        ("a%00b", "NUL"),
        ("x%00%01y", "NUL aliasing an item"),
        ("k" * (MAX_KEY_BYTES + 1), "too long"),
        ("%C3%A9" * (MAX_KEY_BYTES // 2 + 1), "too long in UTF-8"),
        ("%FF", "invalid UTF-8"),
        ("%FE", "invalid UTF-8"),
        ("ab%ED%A0%80", "encoded surrogate"),
    ],
)
def test_bad_keys_are_400_before_the_log(server: BackgroundServer, http: httpx.Client, raw_key: str, why: str) -> None:
    rid = uid("rid")
    r = post(http, f"/invoke/box/{raw_key}/add", b'{"args": [1]}', **{"Idempotency-Key": rid})
    assert r.status_code == 400, (why, r.text)
    assert error_type(r) == "InvalidKey"
    never_seen(server, http, rid)
    s = http.get(f"/state/box/{raw_key}")
    assert s.status_code == 400 and error_type(s) == "InvalidKey", s.text


def test_percent_ff_and_fe_do_not_alias_and_valid_utf8_works(http: httpx.Client) -> None:
    key = uid()
    r = post(http, f"/invoke/box/{key}%C3%A9/add", b'{"args": [4]}')
    assert r.status_code == 200, r.text
    assert http.get(f"/state/box/{key}é").json()["value"] == 4
    assert http.get(f"/state/box/{key}%EF%BF%BD").json()["value"] is None  # U+FFFD is another entity


def test_longest_key_is_accepted(http: httpx.Client) -> None:
    key = "k" * MAX_KEY_BYTES
    r = post(http, f"/invoke/box/{key}/add", b'{"args": [2]}')
    assert r.status_code == 200, r.text
    assert http.get(f"/state/box/{key}").json()["value"] == 2


# ------------------------------------------------------------------------------------------------ bodies


def deep_json(n: int) -> bytes:
    return b'{"args": [' + b"[" * n + b"]" * n + b"]}"


def deep_msgpack(n: int) -> bytes:
    return b"\x81\xa4args\x91" + b"\x91" * n + b"\x90"


@pytest.mark.parametrize(
    "body,ctype",
    [
        (deep_json(70), "application/json"),
        (deep_json(1_000), "application/json"),
        (deep_json(100_000), "application/json"),
        (deep_msgpack(1_000), "application/msgpack"),
        (deep_msgpack(100_000), "application/msgpack"),
        (b'{"args": ["\xff\xfe"]}', "application/json"),
        (b"\x81\xa4args\x91\xa2\xff\xfe", "application/msgpack"),  # non-UTF-8 msgpack str
        (b"\x81\xa4args\x91\xd4\x05\x01", "application/msgpack"),  # ext type 5
        (b"\x81\xa4args\x91\xd6\xff\x00\x00\x00\x01", "application/msgpack"),  # timestamp ext
        (b"\x81\xa4args\x91\x81\xcb?\xf8\x00\x00\x00\x00\x00\x00\x01", "application/msgpack"),  # float map key
        (b'{"args": [1], "extra": 2}', "application/json"),
        (b'[1, 2]', "application/json"),
        (b"\xc1", "application/msgpack"),
    ],
    ids=["json-70", "json-1k", "json-100k", "mp-1k", "mp-100k", "json-bad-utf8", "mp-bad-utf8", "mp-ext",
         "mp-timestamp", "mp-float-key", "extra-field", "not-object", "mp-garbage"],
)
def test_hostile_bodies_are_400(server: BackgroundServer, http: httpx.Client, body: bytes, ctype: str) -> None:
    rid = uid("rid")
    r = post(http, f"/invoke/box/{uid()}/put", body, ctype, **{"Idempotency-Key": rid})
    assert r.status_code == 400, r.text
    assert error_type(r) in ("BadRequest", "SerializationError")
    never_seen(server, http, rid)


def test_moderate_nesting_and_plain_types_are_accepted(http: httpx.Client) -> None:
    key = uid()
    value = {"a": [1, 2.5, None, True, "é", {"b": [[[]]]}], "1": 0}
    r = http.post(f"/invoke/box/{key}/put", content=msgspec.msgpack.encode({"args": [value]}),
                  headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 200, r.text
    assert http.get(f"/state/box/{key}").json()["value"] == value


def test_body_that_never_finishes_is_408(server: BackgroundServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(
            f"POST /invoke/box/{uid()}/add HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"args\"".encode()
        )
        t0 = time.monotonic()
        data = s.recv(4096)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert 1.0 < time.monotonic() - t0 < 8.0


def test_request_head_that_never_finishes_is_closed(server: BackgroundServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:  # trickle a header byte now and then: it must not keep it open
            try:
                s.sendall(b"X")
                time.sleep(0.3)
            except OSError:
                break
        assert s.recv(4096) == b""  # closed by the server
        assert time.monotonic() - t0 < 4.0


# ------------------------------------------------------------------------------------------------ idempotency


def test_idempotency_key_with_slash_or_odd_characters_is_400(server: BackgroundServer, http: httpx.Client) -> None:
    # ... and ids the runtimes reserve for their own log records (a client taking Spark's next epoch tick
    # would have its request deduplicated against a record that never gets a reply)
    for bad in ("a/b", "a?b", "a#b", "a%2Fb", "x" * 201, "é", "__charon_tick__3", "__charon"):
        r = http.post(f"/invoke/box/{uid()}/add?mode=async", json={"args": [1]},
                      headers={"Idempotency-Key": bad.encode("utf-8")})
        assert r.status_code == 400, (bad, r.text)


def test_reused_idempotency_key_with_another_payload_is_422(server: BackgroundServer, http: httpx.Client) -> None:
    key, rid = uid(), uid("rid")
    first = post(http, f"/invoke/box/{key}/add", b'{"args": [5]}', **{"Idempotency-Key": rid})
    assert first.status_code == 200
    same = post(http, f"/invoke/box/{key}/add", b'{"args": [5]}', **{"Idempotency-Key": rid})
    assert same.json() == first.json()
    for path, body in [(f"/invoke/box/{key}/add", b'{"args": [6]}'), (f"/invoke/box/{uid()}/add", b'{"args": [5]}'),
                       (f"/invoke/box/{key}/put", b'{"args": [5]}'), (f"/invoke/box/{key}/add?mode=async",
                                                                      b'{"args": [7]}')]:
        r = post(http, path, body, **{"Idempotency-Key": rid})
        assert r.status_code == 422, (path, body, r.text)
        assert error_type(r) == "IdempotencyConflict"
    assert http.get(f"/state/box/{key}").json()["value"] == 5


def test_reused_key_while_in_flight_is_422(server: BackgroundServer, http: httpx.Client) -> None:
    key, rid = uid(), uid("rid")
    a = post(http, f"/invoke/box/{key}/add?mode=async", b'{"args": [1]}', **{"Idempotency-Key": rid})
    b = post(http, f"/invoke/box/{key}/add?mode=async", b'{"args": [2]}', **{"Idempotency-Key": rid})
    assert a.status_code == 202
    # the second either meets the first in flight or its reply: a conflict both ways
    assert b.status_code == 422, b.text
    assert http.get(f"/requests/{rid}", params={"wait": 10}).json()["value"] == 1


# ------------------------------------------------------------------------------------------------ URLs, bounds


def test_status_url_is_relative_and_ignores_the_host_header(http: httpx.Client) -> None:
    rid = "a:b@c+d=e~f"
    r = post(http, f"/invoke/box/{uid()}/add?mode=async", b'{"args": [1]}',
             **{"Idempotency-Key": rid, "Host": "evil.example"})
    assert r.status_code == 202, r.text
    url = r.json()["status_url"]
    assert url == "/requests/a%3Ab%40c%2Bd%3De~f" and r.headers["location"] == url
    polled = http.get(url, params={"wait": 10})
    assert polled.status_code == 200 and polled.json()["request_id"] == rid


def test_public_url_is_the_base_of_status_urls() -> None:
    rt = InProcessRuntime(APP, partitions=1)
    cfg = GatewayConfig(public_url="https://api.example.com/charon/")
    with BackgroundServer(rt, config=cfg) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post(f"/invoke/box/{uid()}/ping?mode=async", json={"args": []}, headers={"Host": "evil.example"})
        assert r.json()["status_url"].startswith("https://api.example.com/charon/requests/")


def test_retained_replies_are_bounded(server: BackgroundServer, http: httpx.Client) -> None:
    for i in range(12):
        assert post(http, f"/invoke/box/{uid()}/add", b'{"args": [%d]}' % i).status_code == 200
    gw = server.app.state.gateway
    assert len(gw.recent) <= 5 and gw.recent_size > 0


def test_slow_state_read_does_not_block_the_gateway(server: BackgroundServer) -> None:
    async def main() -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as c:
            slow = asyncio.ensure_future(c.get("/state/box/slow"))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            h = await c.get("/health")
            took = time.monotonic() - t0
            assert h.status_code == 200
            return took, (await slow).status_code

    took, status = asyncio.run(main())
    assert status == 200
    assert took < 1.0, f"/health took {took:.2f} s during a slow state read"


# ------------------------------------------------------------------------------------------------ restart


class LogRuntime(Engine):
    """An engine front over the embedded logs with no engine attached (the engine is elsewhere or down)."""

    kind = "test-log-front"

    def __init__(self, d: str) -> None:
        self._input_log = InputLog(os.path.join(d, "in.sqlite"), 2)
        self.output_log = OutputLog(os.path.join(d, "out.sqlite"))
        self._client: LogClient | None = None

    @property
    def app(self) -> Any:
        return APP

    @property
    def partitions(self) -> int:
        return 1

    @property
    def input_log(self) -> Any:
        return self._input_log

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "ok": True}

    async def start(self) -> None:
        self._client = LogClient(self.input_log, self.output_log)

    async def stop(self) -> None:
        pass

    async def submit(self, operator: str, key: str, function: str, args: list[Any], *,
                     request_id: str | None = None) -> Reply:
        assert self._client is not None
        return await self._client.submit(operator, key, function, args, request_id=request_id)

    def get_reply(self, request_id: str) -> Reply | None:
        return self.output_log.get(request_id)

    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        return None


def test_request_in_the_log_is_pending_after_a_gateway_restart(tmp_path: Any) -> None:
    rid = "restart-1"
    with BackgroundServer(LogRuntime(str(tmp_path))) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post("/invoke/box/k/add?mode=async", json={"args": [1]}, headers={"Idempotency-Key": rid})
        assert r.status_code == 202
        deadline = time.monotonic() + 10
        while not srv.runtime.input_log.contains(rid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    runtime = LogRuntime(str(tmp_path))  # a new gateway process over the same logs
    with BackgroundServer(runtime) as srv, httpx.Client(base_url=srv.url) as c:
        pending = c.get(f"/requests/{rid}")
        assert pending.status_code == 202, pending.text
        assert pending.json()["status"] == "pending"
        assert c.get("/requests/never-sent").status_code == 404
        # a retry with another payload is refused from the log alone; the same payload joins it
        other = c.post("/invoke/box/k/add?mode=async", json={"args": [2]}, headers={"Idempotency-Key": rid})
        assert other.status_code == 422, other.text
        runtime.output_log.put(Reply(rid, 1, 0, True, serde.encode(1)))  # the engine answers
        done = c.get(f"/requests/{rid}")
        assert done.status_code == 200 and done.json()["value"] == 1


# ------------------------------------------------------------------------------------------------ Python client


def test_client_raises_the_typed_errors(server: BackgroundServer) -> None:
    from charon.client import Client
    from charon.errors import IdempotencyConflict, InvalidKey

    with Client(server.url, token=TOKEN) as c:
        for bad in ("a\0b", "k" * (MAX_KEY_BYTES + 1), "\ud800"):
            with pytest.raises(InvalidKey):
                c.invoke("box", bad, "add", 1)
            with pytest.raises(InvalidKey):
                c.state("box", bad)
        rid, key = uid("rid"), uid()
        assert c.invoke("box", key, "add", 2, request_id=rid) == 2
        assert c.invoke("box", key, "add", 2, request_id=rid) == 2
        with pytest.raises(IdempotencyConflict):
            c.invoke("box", key, "add", 3, request_id=rid)
        assert c.state("box", key) == 2


def test_openapi_bodies_are_strict_and_valid(server: BackgroundServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, item in doc["paths"].items():
        if not path.startswith("/invoke/"):
            continue
        for ctype, media in item["post"]["requestBody"]["content"].items():
            body = media["schema"]
            assert body["required"] == ["args"] and body["additionalProperties"] is False, (path, ctype)
            assert body["properties"]["args"].get("prefixItems") != [], path
    ping_args = doc["paths"]["/invoke/box/{key}/ping"]["post"]["requestBody"]["content"]["application/json"]
    assert ping_args["schema"]["properties"]["args"]["maxItems"] == 0
    assert "prefixItems" not in ping_args["schema"]["properties"]["args"]


def test_runtime_record_ids_are_reserved() -> None:
    """The ids the runtimes write for themselves fall under the prefix the gateway refuses."""
    from charon.runtime.spark.runtime import TICK
    from charon.server.wire import RESERVED_ID_PREFIX

    assert TICK.startswith(RESERVED_ID_PREFIX)
