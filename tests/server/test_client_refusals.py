"""The Python clients refuse what the value model refuses before sending (a set is not silently a list), with the
engine's typed error; and a gateway that cannot be reached is a typed, retryable Charon error, not httpx's."""

from __future__ import annotations

import asyncio
import socket

import pytest

from charon import Application, Context, InProcessRuntime, Operator
from charon.client import AsyncClient, Client, GatewayUnavailable
from charon.errors import CharonError, EngineUnavailable, SerializationError

svc = Operator("svc")


@svc.function
async def echo(ctx: Context, v: object) -> object:
    return v


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on (closed again at once)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_engine_refuses_a_set_argument() -> None:
    rt = InProcessRuntime(Application("c", [svc]), partitions=1)

    async def main() -> None:
        with pytest.raises(SerializationError, match="set"):
            await rt.invoke("svc", "k", "echo", {1, 2})

    asyncio.run(main())


@pytest.mark.parametrize("bad", [{1, 2}, frozenset({"a"}), [1, {2}], {"x": {3}}], ids=repr)
def test_the_clients_refuse_a_set_before_sending(bad: object) -> None:
    url = _dead_url()  # never reached: refused before any connection
    with Client(url, retries=0) as c:
        with pytest.raises(SerializationError, match="set"):
            c.invoke("svc", "k", "echo", bad)
        with pytest.raises(SerializationError):
            c.invoke_batch([("svc", "k", "echo", [bad])])

    async def main() -> None:
        async with AsyncClient(url, retries=0) as ac:
            with pytest.raises(SerializationError):
                await ac.invoke("svc", "k", "echo", bad)

    asyncio.run(main())


def test_a_gateway_that_is_down_is_a_typed_unavailable_error() -> None:
    url = _dead_url()
    with Client(url, retries=1) as c:
        with pytest.raises(GatewayUnavailable) as raised:
            c.invoke("svc", "k", "echo", 1)
    exc = raised.value
    assert isinstance(exc, EngineUnavailable) and isinstance(exc, CharonError) and exc.retryable
    assert "cannot reach the gateway" in str(exc)

    async def main() -> None:
        async with AsyncClient(url, retries=1) as ac:
            with pytest.raises(GatewayUnavailable):
                await ac.invoke("svc", "k", "echo", 1)
            with pytest.raises(GatewayUnavailable):
                await ac.health()

    asyncio.run(main())


@pytest.mark.parametrize(("status", "etype", "code"), [(403, "Forbidden", 4), (404, "NotFound", 4),
                                                       (503, "Unavailable", 3), (500, "Internal", 3)])
def test_a_gateway_refusal_exits_rejected_and_an_outage_unavailable(status: int, etype: str, code: int) -> None:
    from charon import client
    from charon.cli.exitcodes import exit_code_of

    with pytest.raises(CharonError) as raised:
        client._raise_error(status, {"error": {"type": etype, "message": "m"}}, None)
    assert exit_code_of(raised.value) == code
