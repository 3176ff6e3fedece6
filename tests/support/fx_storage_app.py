"""The application of the object-storage effect test: ``acct/<k>.pay(amount)`` requests the effect ``note``, whose
handler appends its effect id to the file ``CHARON_TEST_FX_RUNS`` (every run of the handler is visible there); the
continuation ``noted`` counts its runs in the entity's value."""

from __future__ import annotations

import os

from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def pay(ctx: Context, amount: int) -> str:
    ctx.put({"amount": amount, "runs": 0})
    return ctx.effect("note", ctx.key, amount, then=noted, carry=[amount])


@acct.function(public=True)
async def noted(ctx: Context, result: dict, amount: int) -> None:
    ctx.put({"amount": amount, "ok": result["ok"], "runs": ctx.get({}).get("runs", 0) + 1})


app = Application("fxstore", [acct])


@app.effect_handler("note")
def note(idempotency_key: str, who: str, amount: int) -> int:
    with open(os.environ["CHARON_TEST_FX_RUNS"], "a") as f:
        f.write(idempotency_key + "\n")
    return amount
