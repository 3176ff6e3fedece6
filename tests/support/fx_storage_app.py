"""The application of the object-storage effect test: ``acct/<k>.pay(amount)`` requests the effect ``note``, whose
handler appends its effect id to the file ``CHARON_TEST_FX_RUNS`` (every run of the handler is visible there); the
continuation ``noted`` counts its runs in the entity's value; every payment emits ``[key, amount]`` to the output
stream ``paid``. With ``CHARON_TEST_FX_SLEEP`` set, the handler of an amount over 6 first sleeps that many seconds (an
effect still running when its machine is lost)."""

from __future__ import annotations

import os
import time

from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def pay(ctx: Context, amount: int) -> str:
    ctx.put({"amount": amount, "runs": 0})
    ctx.emit("paid", [ctx.key, amount])
    return ctx.effect("note", ctx.key, amount, then=noted, carry=[amount])


@acct.function(public=True)
async def noted(ctx: Context, result: dict, amount: int) -> None:
    ctx.put({"amount": amount, "ok": result["ok"], "runs": ctx.get({}).get("runs", 0) + 1})


app = Application("fxstore", [acct])


@app.effect_handler("note")
def note(idempotency_key: str, who: str, amount: int) -> int:
    if amount > 6:
        time.sleep(float(os.environ.get("CHARON_TEST_FX_SLEEP", "0")))
    with open(os.environ["CHARON_TEST_FX_RUNS"], "a") as f:
        f.write(idempotency_key + "\n")
    return amount
