"""The Python clients against a real gateway (uvicorn on 127.0.0.1) over the in-process runtime.

Network faults are real: a TCP proxy between client and gateway drops a connection after the request was
forwarded (the reply is lost) or answers 503 itself, and the clients' retries must reuse the idempotency
key so the transaction executes once.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import httpx
import pytest

from charon import Application, Context, Operator
from charon.client import (
    AsyncClient,
    BadRequest,
    Call,
    Client,
    GatewayError,
    GatewayUnavailable,
    RequestNotFound,
    Result,
    Unauthorized,
)
from charon.errors import (
    BadArguments,
    PayloadTooLarge,
    SerializationError,
    TransactionAborted,
    UnknownFunction,
    UnknownOperator,
)
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer, free_port

TOKEN = "client-test-token"

counter = Operator("counter")


class TooMuch(Exception):
    """Raised by ``counter.add`` when asked to add more than 1000."""


@counter.function(public=True)
async def add(ctx: Context, n: int) -> int:
    if n > 1000:
        raise TooMuch(f"{n} is more than 1000")
    value = ctx.get(default=0) + n
    ctx.put(value)
    return value


@counter.function(public=True)
async def echo(ctx: Context, payload: Any) -> Any:
    return payload


APP = Application("clienttest", [counter])


@pytest.fixture(scope="module")
def server() -> Any:
    runtime = InProcessRuntime(APP, partitions=4, epoch_max_txns=1000, epoch_max_ms=1.0)
    with BackgroundServer(runtime, token=TOKEN, max_body=64 * 1024) as srv:
        yield srv


@pytest.fixture()
def client(server: BackgroundServer) -> Any:
    with Client(server.url, token=TOKEN) as c:
        yield c


def uid(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class FaultyProxy:
    """A TCP proxy to the gateway that can lose replies or answer 503 on the next connections.

    ``drop_replies``: that many connections get their request forwarded, then are closed as soon as the
    gateway's response starts (the transaction ran, the client never hears of it). ``fail_503``: that many
    connections get a 503 from the proxy itself (nothing forwarded).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.drop_replies = 0
        self.fail_503 = 0
        self.dropped = 0
        self.failed = 0
        self.forwarded_connections = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.fail_503 > 0:
            self.fail_503 -= 1
            self.failed += 1
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
            writer.close()
            return
        drop = self.drop_replies > 0
        if drop:
            self.drop_replies -= 1
        self.forwarded_connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, lose: bool) -> None:
            try:
                while data := await src.read(65536):
                    if lose:
                        self.dropped += 1
                        break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                for w in (dst, writer, up_writer) if lose else (dst,):
                    w.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, drop))

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# ------------------------------------------------------------------------------------------------ sync client


def test_invoke_returns_value(client: Client) -> None:
    key = uid()
    assert client.invoke("counter", key, "add", 5) == 5
    assert client.invoke("counter", key, "add", 7) == 12
    assert client.state("counter", key) == 12


def test_dot_keys_name_their_own_entities(client: Client) -> None:
    """`.` and `..` are valid keys: the client must not let them become dot segments that the URL resolves away
    (`/invoke/counter/../add` would be `/invoke/add`)."""
    base = uid()
    keys = [".", "..", "...", f"{base}.", f".{base}"]
    for i, key in enumerate(keys):
        client.invoke("counter", key, "add", 0)  # may exist from an earlier run of this module's server
        before = client.state("counter", key)
        assert client.invoke("counter", key, "add", i + 1) == before + i + 1
        assert client.state("counter", key) == before + i + 1


def test_invoke_result_carries_tid_and_request_id(client: Client) -> None:
    res = client.invoke_result("counter", uid(), "add", 1, request_id="my-request-1-" + uid())
    assert isinstance(res, Result)
    assert res.request_id.startswith("my-request-1-")
    assert res.tid >= 0 and res.epoch >= 0 and res.value == 1


def test_values_roundtrip_including_bytes(client: Client) -> None:
    payload = {"b": b"\x00\x01\xfe", "f": 1.25, "l": [None, True, "s"], "nested": {"k": [1, 2]}}
    assert client.invoke("counter", uid(), "echo", payload) == payload


def test_typed_abort_raises_transaction_aborted(client: Client) -> None:
    key = uid()
    client.invoke("counter", key, "add", 1)
    with pytest.raises(TransactionAborted) as info:
        client.invoke("counter", key, "add", 5000, request_id="abort-" + key)
    assert info.value.error_type == "TooMuch"
    assert info.value.message == "5000 is more than 1000"
    assert info.value.request_id == "abort-" + key
    assert client.state("counter", key) == 1


def test_rejections_raise_typed_errors(client: Client) -> None:
    key = uid()
    with pytest.raises(UnknownOperator):
        client.invoke("nosuch", key, "add", 1)
    with pytest.raises(UnknownFunction):
        client.invoke("counter", key, "nosuch", 1)
    with pytest.raises(BadArguments):
        client.invoke("counter", key, "add", "one")
    with pytest.raises(BadArguments):
        client.invoke("counter", key, "add")
    with pytest.raises(PayloadTooLarge):
        client.invoke("counter", key, "echo", "x" * 100_000)
    with pytest.raises(SerializationError):
        client.invoke("counter", key, "echo", object())
    with pytest.raises(BadRequest):
        client.invoke("counter", key, "add", 1, request_id="bad key with spaces")
    with pytest.raises(UnknownOperator):
        client.state("nosuch", key)
    assert client.state("counter", key) is None


def test_unauthorized(server: BackgroundServer) -> None:
    for token in (None, "wrong"):
        with Client(server.url, token=token) as c:
            with pytest.raises(Unauthorized) as info:
                c.invoke("counter", uid(), "add", 1)
            assert isinstance(info.value, PermissionError)
            with pytest.raises(Unauthorized):
                c.state("counter", "x")


def test_submit_then_result(client: Client) -> None:
    key = uid()
    rid = client.submit("counter", key, "add", 4)
    assert client.result(rid, timeout=10) == 4
    assert client.result_of(rid, timeout=10).request_id == rid
    bad = client.submit("counter", key, "add", 4000)
    with pytest.raises(TransactionAborted) as info:
        client.result(bad, timeout=10)
    assert info.value.error_type == "TooMuch"
    with pytest.raises(RequestNotFound):
        client.result(uid("unknown"), timeout=1)
    with pytest.raises(UnknownFunction):
        client.submit("counter", key, "nosuch")
    assert client.state("counter", key) == 4


def test_same_request_id_executes_once(client: Client) -> None:
    key, rid = uid(), uid("rid")
    assert client.invoke("counter", key, "add", 3, request_id=rid) == 3
    assert client.invoke("counter", key, "add", 3, request_id=rid) == 3
    assert client.state("counter", key) == 3


def test_invoke_many_threads(client: Client) -> None:
    key = uid()
    calls = [Call("counter", key, "add", (1,)) for _ in range(60)]
    values = client.invoke_many(calls, concurrency=16)
    assert sorted(values) == list(range(1, 61))  # serializable: every prefix sum exactly once
    assert client.state("counter", key) == 60
    mixed = client.invoke_many(
        [("counter", key, "add", [1]), ("counter", key, "add", [9999])], return_exceptions=True
    )
    assert isinstance(mixed[1], TransactionAborted) and mixed[0] == 61


# ------------------------------------------------------------------------------------------------ faults


def test_lost_reply_is_retried_with_the_same_key_and_executes_once(server: BackgroundServer) -> None:
    key = uid()
    with FaultyProxy(server.port) as proxy, Client(proxy.url, token=TOKEN, retries=3) as c:
        proxy.drop_replies = 1
        assert c.invoke("counter", key, "add", 5) == 5  # the first attempt ran; its reply was lost
        assert proxy.dropped == 1
        assert proxy.forwarded_connections == 2
    with Client(server.url, token=TOKEN) as direct:
        assert direct.state("counter", key) == 5  # not 10: executed once


def test_lost_reply_without_retries_surfaces_then_a_retry_gets_the_first_reply(
    server: BackgroundServer,
) -> None:
    key, rid = uid(), uid("rid")
    with FaultyProxy(server.port) as proxy, Client(proxy.url, token=TOKEN, retries=0) as c:
        proxy.drop_replies = 1
        with pytest.raises(httpx.TransportError):
            c.invoke("counter", key, "add", 2, request_id=rid)
        assert proxy.dropped == 1
        assert c.invoke("counter", key, "add", 2, request_id=rid) == 2
        assert c.state("counter", key) == 2


def test_503_is_retried(server: BackgroundServer) -> None:
    key = uid()
    with FaultyProxy(server.port) as proxy, Client(proxy.url, token=TOKEN, retries=3) as c:
        proxy.fail_503 = 2
        assert c.invoke("counter", key, "add", 6) == 6
        assert proxy.failed == 2
    with FaultyProxy(server.port) as proxy, Client(proxy.url, token=TOKEN, retries=3) as c:
        proxy.fail_503 = 5
        with pytest.raises(GatewayError) as info:
            c.invoke("counter", key, "add", 1)
        assert info.value.status == 503
        assert proxy.failed == 4  # one attempt and three retries
        proxy.fail_503 = 0
        assert c.state("counter", key) == 6


def test_connection_refused_raises_after_retries() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", token=TOKEN, retries=2, timeout=2.0) as c:
        with pytest.raises(GatewayUnavailable) as raised:  # typed (availability, retryable), httpx's as the cause
            c.invoke("counter", "k", "add", 1)
    assert isinstance(raised.value.__cause__, httpx.ConnectError)


# ---------------------------------------------------------------------------------------------- async client


async def test_async_client_basics(server: BackgroundServer) -> None:
    key = uid()
    async with AsyncClient(server.url, token=TOKEN) as c:
        assert await c.invoke("counter", key, "add", 2) == 2
        fut = c.invoke_future("counter", key, "add", 3)
        assert await fut == 5
        rid = await c.submit("counter", key, "add", 10)
        assert await c.result(rid, timeout=10) == 15
        with pytest.raises(TransactionAborted) as info:
            await c.invoke("counter", key, "add", 2000)
        assert info.value.error_type == "TooMuch"
        with pytest.raises(UnknownOperator):
            await c.invoke("nope", key, "add", 1)
        with pytest.raises(BadArguments):
            await c.invoke("counter", key, "add", 1.5)
        assert await c.state("counter", key) == 15
        assert (await c.health())["status"] == "ok"


async def test_async_invoke_many_each_gets_its_reply(server: BackgroundServer) -> None:
    n = 200
    payloads = [{"i": i, "nonce": uuid.uuid4().hex} for i in range(n)]
    async with AsyncClient(server.url, token=TOKEN) as c:
        values = await c.invoke_many(
            [Call("counter", f"e{i % 13}", "echo", (p,)) for i, p in enumerate(payloads)]
        )
        assert values == payloads
        key = uid()
        totals = await c.invoke_many([("counter", key, "add", [1])] * 80, concurrency=80)
        assert sorted(totals) == list(range(1, 81))
        mixed = await c.invoke_many(
            [("counter", key, "add", [1]), ("counter", key, "add", [5000])], return_exceptions=True
        )
        assert mixed[0] == 81 and isinstance(mixed[1], TransactionAborted)


async def test_async_lost_reply_executes_once(server: BackgroundServer) -> None:
    key = uid()
    with FaultyProxy(server.port) as proxy:
        proxy.drop_replies = 1
        async with AsyncClient(proxy.url, token=TOKEN, retries=3) as c:
            assert await c.invoke("counter", key, "add", 8) == 8
            assert proxy.dropped == 1
            assert await c.state("counter", key) == 8


def test_async_client_pools_honour_http_proxy_and_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The async client's hand-built pools take the environment's proxy like httpx's own clients (and skip it for
    NO_PROXY hosts): a real listener standing in for the proxy sees the request in absolute form."""
    from charon.client import AsyncClient

    seen: list[bytes] = []

    async def main() -> None:
        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.readline())
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = f"http://127.0.0.1:{free_port()}"
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        c = AsyncClient(target, retries=0)
        with pytest.raises(Exception):  # noqa: B017 - the stand-in proxy answers 400: any error will do
            await c.invoke("acct", "k", "get")
        await c.aclose()
        assert seen and seen[0].startswith(f"POST {target}/".encode()), seen
        seen.clear()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        c = AsyncClient(target, retries=0)
        with pytest.raises(GatewayUnavailable):  # straight to the (closed) target port, not through the proxy
            await c.invoke("acct", "k", "get")
        await c.aclose()
        assert seen == []
        server.close()

    asyncio.run(main())
