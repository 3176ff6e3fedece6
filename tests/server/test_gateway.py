"""The HTTP gateway over real HTTP (uvicorn on 127.0.0.1) in front of the in-process runtime."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import msgspec
import pytest

from charon import Application, Context, Operator
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

TOKEN = "gw-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 1 << 20

counter = Operator("counter")
account = Operator("account")


class Boom(Exception):
    """Raised on purpose by ``counter.boom``."""


class NotEnoughCredit(Exception):
    """Raised by ``account.transfer`` after the callee already deposited."""


@counter.function(public=True)
async def incr(ctx: Context, n: int) -> int:
    value = ctx.get(default=0) + n
    ctx.put(value)
    return value


@counter.function(public=True)
async def echo(ctx: Context, payload: Any) -> list:
    return [ctx.key, payload]


@counter.function(public=True)
async def boom(ctx: Context, message: str) -> None:
    ctx.put(-1)
    raise Boom(message)


@account.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    balance = ctx.get(default=0)
    ctx.put(balance - amount)
    await ctx.call(account, to, deposit, amount)
    if balance < amount:
        raise NotEnoughCredit(f"{ctx.key} has {balance}, needs {amount}")
    return balance - amount


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    value = ctx.get(default=0) + amount
    ctx.put(value)
    return value


APP = Application("gwtest", [counter, account])


@pytest.fixture(scope="module")
def server() -> Any:
    runtime = InProcessRuntime(APP, partitions=4, epoch_max_txns=1000, epoch_max_ms=1.0)
    with BackgroundServer(runtime, token=TOKEN, max_body=MAX_BODY) as srv:
        yield srv


@pytest.fixture()
def http(server: BackgroundServer) -> Any:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30.0) as c:
        yield c


def uid(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def state(http: httpx.Client, operator: str, key: str) -> Any:
    r = http.get(f"/state/{operator}/{key}")
    assert r.status_code == 200, r.text
    return r.json()["value"]


def assert_never_seen(server: BackgroundServer, http: httpx.Client, rid: str) -> None:
    """The runtime has no trace of the request id (nothing reached its input log)."""
    assert server.runtime.get_reply(rid) is None
    assert http.get(f"/requests/{rid}").status_code == 404


# ------------------------------------------------------------------------------------------------ basics


def test_health_is_open(server: BackgroundServer) -> None:
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_invoke_json_commits_and_returns_value(server: BackgroundServer, http: httpx.Client) -> None:
    key = uid()
    r = http.post(f"/invoke/counter/{key}/incr", json={"args": [5]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["value"] == 5
    assert body["status"] == "committed"
    assert isinstance(body["tid"], int) and isinstance(body["epoch"], int)
    assert len(body["request_id"]) == 32  # generated uuid4 hex
    r2 = http.post(f"/invoke/counter/{key}/incr", json={"args": [2]})
    assert r2.json()["value"] == 7
    assert r2.json()["request_id"] != body["request_id"]
    assert state(http, "counter", key) == 7


def test_invoke_msgpack_roundtrips_bytes(http: httpx.Client) -> None:
    key = uid()
    payload = {"blob": b"\x00\xffbinary", "n": [1, 2.5, None, True]}
    r = http.post(
        f"/invoke/counter/{key}/echo",
        content=msgspec.msgpack.encode({"args": [payload]}),
        headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
    )
    assert r.status_code == 200, r.content
    assert r.headers["content-type"].startswith("application/msgpack")
    body = msgspec.msgpack.decode(r.content)
    assert body["value"] == [key, payload]


def test_key_with_slash_and_unicode(http: httpx.Client) -> None:
    key = "dir/sub é " + uuid.uuid4().hex[:6]
    from urllib.parse import quote

    r = http.post(f"/invoke/counter/{quote(key, safe='')}/echo", json={"args": ["x"]})
    assert r.status_code == 200, r.text
    assert r.json()["value"] == [key, "x"]


def test_typed_abort_is_409_and_applies_nothing(server: BackgroundServer, http: httpx.Client) -> None:
    key = uid()
    r = http.post(f"/invoke/counter/{key}/boom", json={"args": ["kaboom"]})
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == {"type": "Boom", "message": "kaboom"}
    assert body["status"] == "aborted"
    assert isinstance(body["tid"], int) and body["request_id"]
    assert state(http, "counter", key) is None


def test_abort_deep_in_call_graph_rolls_back_every_entity(http: httpx.Client) -> None:
    a, b = uid("a"), uid("b")
    assert http.post(f"/invoke/account/{a}/deposit", json={"args": [10]}).status_code == 200
    r = http.post(f"/invoke/account/{a}/transfer", json={"args": [b, 50]})
    assert r.status_code == 409
    assert r.json()["error"]["type"] == "NotEnoughCredit"
    assert "needs 50" in r.json()["error"]["message"]
    assert state(http, "account", a) == 10
    assert state(http, "account", b) is None
    ok = http.post(f"/invoke/account/{a}/transfer", json={"args": [b, 4]})
    assert ok.status_code == 200 and ok.json()["value"] == 6
    assert (state(http, "account", a), state(http, "account", b)) == (6, 4)


# ------------------------------------------------------------------------------------------------ async mode


def test_async_mode_then_poll(server: BackgroundServer, http: httpx.Client) -> None:
    key = uid()
    r = http.post(f"/invoke/counter/{key}/incr?mode=async", json={"args": [3]})
    assert r.status_code == 202, r.text
    body = r.json()
    rid = body["request_id"]
    assert body["status_url"].endswith(f"/requests/{rid}")
    polled = http.get(body["status_url"], params={"wait": 10})
    assert polled.status_code == 200, polled.text
    assert polled.json()["value"] == 3 and polled.json()["request_id"] == rid
    # polling again (now answered from the reply cache / runtime) gives the same reply
    again = http.get(f"/requests/{rid}")
    assert again.json() == polled.json()
    assert state(http, "counter", key) == 3


def test_async_mode_abort_is_409_on_poll(http: httpx.Client) -> None:
    r = http.post(f"/invoke/counter/{uid()}/boom?mode=async", json={"args": ["later"]})
    assert r.status_code == 202
    polled = http.get(f"/requests/{r.json()['request_id']}", params={"wait": 10})
    assert polled.status_code == 409
    assert polled.json()["error"] == {"type": "Boom", "message": "later"}


def test_poll_unknown_request_is_404(http: httpx.Client) -> None:
    r = http.get(f"/requests/{uid('nope')}")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFound"


def test_routing_errors_are_typed_json(http: httpx.Client) -> None:
    """No such route (404) and a wrong method (405) answer in the same JSON error shape as every other error."""
    r = http.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"
    r = http.get("/invoke/counter/k/incr")
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowed"
    assert "POST" in r.headers["allow"]


# ------------------------------------------------------------------------------------------------ idempotency


def test_idempotency_key_executes_once(server: BackgroundServer, http: httpx.Client) -> None:
    key, rid = uid(), uid("rid")
    first = http.post(f"/invoke/counter/{key}/incr", json={"args": [10]}, headers={"Idempotency-Key": rid})
    second = http.post(f"/invoke/counter/{key}/incr", json={"args": [10]}, headers={"Idempotency-Key": rid})
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert first.json()["request_id"] == rid
    assert state(http, "counter", key) == 10  # changed once
    assert server.runtime.get_reply(rid) is not None


def test_concurrent_duplicates_execute_once(server: BackgroundServer) -> None:
    key, rid = uid(), uid("rid")
    results: list[httpx.Response] = []
    barrier = threading.Barrier(12)

    def worker() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30.0) as c:
            barrier.wait()
            results.append(
                c.post(f"/invoke/counter/{key}/incr", json={"args": [1]}, headers={"Idempotency-Key": rid})
            )

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12
    assert {r.status_code for r in results} == {200}
    assert {(r.json()["tid"], r.json()["value"]) for r in results} == {(results[0].json()["tid"], 1)}
    with httpx.Client(base_url=server.url, headers=AUTH) as c:
        assert state(c, "counter", key) == 1


def test_idempotent_abort_replays_the_same_error(http: httpx.Client) -> None:
    key, rid = uid(), uid("rid")
    r1 = http.post(f"/invoke/counter/{key}/boom", json={"args": ["once"]}, headers={"Idempotency-Key": rid})
    r2 = http.post(f"/invoke/counter/{key}/boom", json={"args": ["once"]}, headers={"Idempotency-Key": rid})
    assert r1.status_code == r2.status_code == 409
    assert r1.json() == r2.json()


def test_invalid_idempotency_key_is_400(server: BackgroundServer, http: httpx.Client) -> None:
    key = uid()
    r = http.post(f"/invoke/counter/{key}/incr", json={"args": [1]}, headers={"Idempotency-Key": "has space"})
    assert r.status_code == 400
    assert state(http, "counter", key) is None


# ------------------------------------------------------------------------------------------------ concurrency


def test_many_concurrent_clients_each_get_their_reply(server: BackgroundServer) -> None:
    n = 64
    barrier = threading.Barrier(n)
    got: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as c:
                barrier.wait()
                for j in range(5):
                    payload = {"client": i, "seq": j, "nonce": uuid.uuid4().hex}
                    r = c.post(f"/invoke/counter/c{i % 7}/echo", json={"args": [payload]})
                    assert r.status_code == 200, r.text
                    assert r.json()["value"] == [f"c{i % 7}", payload]
                    got[i * 100 + j] = r.json()["tid"]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(got) == n * 5
    assert len(set(got.values())) == n * 5  # one transaction each: distinct TIDs


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("path", "body", "status", "etype"),
    [
        ("/invoke/nosuchop/{key}/incr", {"args": [1]}, 404, "UnknownOperator"),
        ("/invoke/counter/{key}/nosuchfn", {"args": [1]}, 404, "UnknownFunction"),
        ("/invoke/counter/{key}/incr", {"args": []}, 422, "BadArguments"),
        ("/invoke/counter/{key}/incr", {"args": [1, 2]}, 422, "BadArguments"),
        ("/invoke/counter/{key}/incr", {"args": ["one"]}, 422, "BadArguments"),
        ("/invoke/counter/{key}/incr", {"args": [1.5]}, 422, "BadArguments"),
        ("/invoke/counter/{key}/incr", {"args": 1}, 422, "BadArguments"),
        ("/invoke/counter/{key}/incr", [1], 400, "BadRequest"),
        ("/invoke/counter/{key}/incr", {"args": [1], "kwargs": {}}, 400, "BadRequest"),
    ],
)
def test_rejected_before_the_runtime(
    server: BackgroundServer, http: httpx.Client, path: str, body: Any, status: int, etype: str
) -> None:
    key, rid = uid(), uid("rid")
    r = http.post(path.format(key=key), json=body, headers={"Idempotency-Key": rid})
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == etype
    assert r.json()["error"]["message"]
    assert_never_seen(server, http, rid)
    assert state(http, "counter", key) is None


@pytest.mark.parametrize(
    ("content", "ctype"),
    [
        (b'{"args": [1,', "application/json"),
        (b"not json at all", "application/json"),
        (b"\xc1\xc1\xc1", "application/msgpack"),
    ],
)
def test_malformed_body_is_400(
    server: BackgroundServer, http: httpx.Client, content: bytes, ctype: str
) -> None:
    key, rid = uid(), uid("rid")
    r = http.post(
        f"/invoke/counter/{key}/incr",
        content=content,
        headers={"Content-Type": ctype, "Idempotency-Key": rid},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequest"
    assert "malformed" in r.json()["error"]["message"]
    assert_never_seen(server, http, rid)


@pytest.mark.parametrize(
    "ctype", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", None]
)
def test_mutating_routes_require_json_or_msgpack(
    server: BackgroundServer, http: httpx.Client, ctype: str | None
) -> None:
    """curl's default form type (`curl -d`), text/plain and no type at all are 415, nothing reaches the log."""
    key, rid = uid(), uid("rid")
    headers = {"Idempotency-Key": rid} | ({"Content-Type": ctype} if ctype else {})
    r = http.post(f"/invoke/counter/{key}/incr", content=b'{"args": [3]}', headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["type"] == "UnsupportedMediaType"
    assert_never_seen(server, http, rid)
    ok = http.post(f"/invoke/counter/{key}/incr", content=b'{"args": [3]}',
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_ten_megabyte_body_is_413(server: BackgroundServer, http: httpx.Client) -> None:
    key, rid = uid(), uid("rid")
    big = b'{"args": ["' + b"x" * (10 * 1024 * 1024) + b'"]}'
    r = http.post(
        f"/invoke/counter/{key}/echo",
        content=big,
        headers={"Content-Type": "application/json", "Idempotency-Key": rid},
    )
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "PayloadTooLarge"
    assert_never_seen(server, http, rid)
    # the gateway still serves afterwards
    assert http.post(f"/invoke/counter/{key}/incr", json={"args": [1]}).json()["value"] == 1


def test_streamed_body_without_content_length_is_413(server: BackgroundServer, http: httpx.Client) -> None:
    key, rid = uid(), uid("rid")

    def chunks() -> Any:
        yield b'{"args": ["'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"]}'

    r = http.post(
        f"/invoke/counter/{key}/echo",
        content=chunks(),
        headers={"Content-Type": "application/json", "Idempotency-Key": rid},
    )
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    assert_never_seen(server, http, rid)


def test_body_just_under_the_limit_is_accepted(http: httpx.Client) -> None:
    key = uid()
    filler = "z" * (MAX_BODY - 100)
    r = http.post(f"/invoke/counter/{key}/echo", json={"args": [filler]})
    assert r.status_code == 200
    assert r.json()["value"][1] == filler


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]
)
def test_missing_or_wrong_token_is_401(server: BackgroundServer, http: httpx.Client, headers: dict) -> None:
    key, rid = uid(), uid("rid")
    with httpx.Client(base_url=server.url, headers=headers) as anon:
        r = anon.post(f"/invoke/counter/{key}/incr", json={"args": [1]}, headers={"Idempotency-Key": rid})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "Unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        # admin routes too: state reads and request polling
        assert anon.get(f"/state/counter/{key}").status_code == 401
        assert anon.get(f"/requests/{rid}").status_code == 401
        # unknown names are not disclosed before authentication
        assert anon.post("/invoke/nosuchop/k/f", json={"args": []}).status_code == 401
    assert_never_seen(server, http, rid)
    assert state(http, "counter", key) is None


def test_state_of_unknown_operator_is_404(http: httpx.Client) -> None:
    r = http.get("/state/nosuchop/k")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "UnknownOperator"


# ------------------------------------------------------------------------------------------------ openapi


def test_openapi_document_describes_routes_and_functions(server: BackgroundServer) -> None:
    r = httpx.get(server.url + "/openapi.json")  # open, like /health
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for p in (
        "/invoke/{operator}/{key}/{function}",
        "/requests/{request_id}",
        "/state/{operator}/{key}",
        "/health",
    ):
        assert p in paths
    incr_op = paths["/invoke/counter/{key}/incr"]["post"]
    assert incr_op["x-charon-parameters"] == ["n"]
    args = incr_op["requestBody"]["content"]["application/json"]["schema"]["properties"]["args"]
    assert args["prefixItems"][0]["type"] == "integer"
    assert args["minItems"] == args["maxItems"] == 1
    transfer_op = paths["/invoke/account/{key}/transfer"]["post"]
    assert transfer_op["x-charon-parameters"] == ["to", "amount"]
    assert set(transfer_op["responses"]) >= {"200", "202", "401", "404", "409", "413", "422"}
    ops = doc["x-charon-operators"]
    assert [p["name"] for p in ops["account"]["functions"]["transfer"]["parameters"]] == ["to", "amount"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
