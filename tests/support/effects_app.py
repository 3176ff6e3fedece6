"""The application of the effect tests: ``acct/<k>.pay(amount)`` charges ``amount`` through the external test
service (``CHARON_TEST_SERVICE_URL``) as an effect; the continuation ``charged``
counts its runs in the entity's value."""

from __future__ import annotations

import os

import httpx

from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def pay(ctx: Context, amount: int, timeout: float = 5.0, attempts: int = 50) -> str:
    ctx.put({"amount": amount, "state": "charging"})
    return ctx.effect("charge", ctx.key, amount, then=charged, carry=[amount], timeout=timeout, attempts=attempts)


@acct.function(public=True)
async def pay_sync(ctx: Context, amount: int, timeout: float, attempts: int) -> str:
    ctx.put({"amount": amount, "state": "charging"})
    return ctx.effect("charge_sync", ctx.key, amount, then=charged, carry=[amount], timeout=timeout,
                      attempts=attempts)


@acct.function(public=True)
async def charged(ctx: Context, result: dict, amount: int) -> None:
    runs = ctx.get({}).get("runs", 0) + 1  # how often the continuation ran (exactly once is the point)
    ctx.put({"amount": amount, "state": "paid" if result["ok"] else "failed", "result": result, "runs": runs})


app = Application("fxtest", [acct])


@app.effect_handler("charge")
async def charge(idempotency_key: str, who: str, amount: int) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(os.environ["CHARON_TEST_SERVICE_URL"] + "/apply",
                               json={"key": idempotency_key, "op": "charge", "who": who, "amount": amount})
    resp.raise_for_status()
    return {"applied": resp.json()["applied"]}


@app.effect_handler("charge_sync")
def charge_sync(idempotency_key: str, who: str, amount: int) -> dict:
    """The same as ``charge``, blocking (a sync handler runs on the executor's threads)."""
    resp = httpx.post(os.environ["CHARON_TEST_SERVICE_URL"] + "/apply", timeout=30,
                      json={"key": idempotency_key, "op": "charge", "who": who, "amount": amount})
    resp.raise_for_status()
    return {"applied": resp.json()["applied"]}
