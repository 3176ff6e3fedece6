"""Transfers of ``charon.apps.ycsb:app`` sent over HTTP the way a client that must not lose one does: each with its
``Idempotency-Key``, retried with the same key until answered (200 or 409), for the machine-loss tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

Call = tuple[str, str, list[Any], str]  # (account, function, args, idempotency key)


async def invoke_all(url: str, calls: list[Call], out: dict[str, dict[str, Any]], token: str,
                     timeout: float = 240.0) -> None:
    """POST every call with its Idempotency-Key (retried with the same key); its answer into ``out[key]``."""
    headers = {"Authorization": f"Bearer {token}"}

    async def one(client: httpx.AsyncClient, key: str, fn: str, args: list[Any], tag: str) -> None:
        while True:
            try:
                r = await client.post(f"/invoke/account/{key}/{fn}", json={"args": args},
                                      headers={**headers, "Idempotency-Key": tag})
            except httpx.HTTPError:
                await asyncio.sleep(0.3)
                continue
            if r.status_code in (200, 409):
                out[tag] = {**r.json(), "http": r.status_code}
                return
            assert r.status_code in (202, 503), (tag, r.status_code, r.text)
            await asyncio.sleep(0.3)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client, *c) for c in calls)), timeout)


def kill_mid_run(url: str, kill: Callable[[], None], calls: list[Call], after: int,
                 token: str) -> dict[str, dict[str, Any]]:
    """Send ``calls``; call ``kill`` once ``after`` of them are answered; the answers given by then."""
    got: dict[str, dict[str, Any]] = {}

    async def run() -> None:
        task = asyncio.ensure_future(invoke_all(url, calls, got, token))
        while len(got) < after:
            if task.done():
                task.result()  # raises what ended it early
                raise AssertionError(f"every call was answered before {after}")
            await asyncio.sleep(0.05)
        kill()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(run())
    return got


def balances(url: str, accounts: list[str], token: str) -> dict[str, int]:
    """Each account's balance (``GET /state/account/{key}``)."""
    out = {}
    for a in accounts:
        r = httpx.get(f"{url}/state/account/{a}", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert r.status_code == 200, r.text
        out[a] = r.json()["value"]
    return out


def expected_balances(start: dict[str, int], calls: list[Call], answers: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The balances after every transfer answered 200 applied once and the refused ones not."""
    want = dict(start)
    for key, fn, args, tag in calls:
        if fn == "transfer" and answers[tag]["http"] == 200:
            want[key] -= args[1]
            want[args[0]] += args[1]
    return want
