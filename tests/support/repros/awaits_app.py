"""Functions that await something other than ctx.call, or do blocking I/O: tests/core/test_foreign_awaits.py."""
import asyncio
import socket
import urllib.parse

import anyio
import httpx

from charon import Application, Context, Operator

io = Operator("io")


@io.function(public=True)
async def sleeps(ctx: Context) -> None:
    ctx.put(1)
    await asyncio.sleep(0.01)


@io.function(public=True)
async def sleeps0(ctx: Context) -> None:
    ctx.put(1)
    await asyncio.sleep(0)


@io.function(public=True)
async def future(ctx: Context) -> None:
    ctx.put(1)
    await asyncio.get_running_loop().create_future()


@io.function(public=True)
async def bare_future(ctx: Context) -> None:
    ctx.put(1)
    await asyncio.Future()


@io.function(public=True)
async def http(ctx: Context, url: str) -> int:
    ctx.put(1)
    async with httpx.AsyncClient() as client:
        return (await client.get(url)).status_code


@io.function(public=True)
async def http_caught(ctx: Context, url: str) -> str:
    """Catches whatever the client raises and goes on: still an IllegalAwait."""
    ctx.put(1)
    try:
        async with httpx.AsyncClient() as client:
            await client.get(url)
    except Exception:  # noqa: BLE001
        return "caught"
    return "fetched"


@io.function(public=True)
async def anyio_sleep(ctx: Context) -> None:
    ctx.put(1)
    await anyio.sleep(0.01)


@io.function(public=True)
async def reads_file(ctx: Context, path: str) -> str:
    ctx.put(1)
    with open(path) as f:
        return f.read()


@io.function(public=True)
async def connects(ctx: Context, url: str) -> int:
    ctx.put(1)
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return len(s.recv(100))


@io.function(public=True)
async def ok(ctx: Context) -> int:
    ctx.put(2)
    return 2


app = Application("awaits", [io])
