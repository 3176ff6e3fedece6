"""Durable effects, the API (issue 23 item 1): ``ctx.effect`` records an effect request on the reserved stream iff
the transaction commits, with a deterministic id; bad calls (unknown handler, bad policy, unknown continuation,
values outside the value model or above the value-size bound) abort the transaction with a typed error."""

from __future__ import annotations

import asyncio

import pytest

from charon import Application, Context, InProcessRuntime, Operator, UnknownEffect, serde
from charon.core.context import EFFECT_STREAM, MAX_VALUE_BYTES

shop = Operator("shop")


@shop.function(public=True)
async def buy(ctx: Context, amount: int, fail: bool) -> str:
    ctx.put(amount)
    eid = ctx.effect("charge", ctx.key, amount, then=paid, carry=[amount], timeout=2.0, attempts=3)
    if fail:
        raise RuntimeError("aborted after the effect call")
    return eid


@shop.function(public=True)
async def paid(ctx: Context, result: dict, amount: int) -> None:
    ctx.put_item("paid", [result, amount])


@shop.function(public=True)
async def bad(ctx: Context, what: str) -> None:
    if what == "handler":
        ctx.effect("no_such_handler", then=paid)
    elif what == "then":
        ctx.effect("charge", then="no_such_function")
    elif what == "timeout":
        ctx.effect("charge", then=paid, timeout=0)
    elif what == "attempts":
        ctx.effect("charge", then=paid, attempts=0)
    elif what == "value":
        ctx.effect("charge", {1, 2}, then=paid)
    elif what == "large":
        ctx.effect("charge", b"x" * (MAX_VALUE_BYTES + 1), then=paid)


app = Application("fxapi", [shop])


@app.effect_handler("charge")
def charge(idempotency_key: str, who: str, amount: int) -> dict:  # never run here
    return {"charged": amount}


def test_effect_request_exists_iff_the_transaction_commits(tmp_path) -> None:
    async def go() -> None:
        rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path))
        await rt.start()
        try:
            ok = await rt.submit("shop", "alice", "buy", [7, False])
            no = await rt.submit("shop", "bob", "buy", [9, True])
            assert ok.ok and not no.ok and no.error_type == "RuntimeError"
            eid = serde.decode(ok.value)
            assert eid.startswith("fx.fxapi.") and eid.endswith(".1")
            page = rt.engine().streams.read(EFFECT_STREAM, 0, 100)
            docs = [serde.decode(e.value) for e in page.events]
            assert docs == [{"id": eid, "handler": "charge", "args": ["alice", 7], "op": "shop", "key": "alice",
                             "then": "paid", "carry": [7], "timeout": 2.0, "attempts": 3}]
            for what, err in (("handler", "UnknownEffect"), ("then", "UnknownFunction"), ("timeout", "UnknownEffect"),
                              ("attempts", "UnknownEffect"), ("value", "SerializationError"),
                              ("large", "ValueTooLarge")):
                r = await rt.submit("shop", "carol", "bad", [what])
                assert not r.ok and r.error_type == err, (what, r)
            assert rt.engine().streams.end_offset(EFFECT_STREAM) == 1  # nothing of the aborted ones
        finally:
            await rt.stop()
            rt.close()

    asyncio.run(go())


def test_handlers_are_registered_by_the_application_only() -> None:
    with pytest.raises(ValueError, match="twice"):
        app.effect_handler("charge")(charge)
    with pytest.raises(ValueError, match="effect handler name"):
        Application("x", [], effects={"bad name": charge})
    with pytest.raises(ValueError, match="name of 1-60"):
        Application("bad app", [], effects={"ok": charge})
    assert Application("y", [], effects={"c": charge}).effects == {"c": charge}
    assert issubclass(UnknownEffect, Exception)


def test_run_refuses_effects_without_an_engine_here() -> None:
    from typer.testing import CliRunner

    from charon.cli import app as cli

    r = CliRunner().invoke(cli, ["run", "charon.apps.saga:app", "--engine", "remote", "--log",
                                 "nats://127.0.0.1:1/x", "--effects"])
    assert r.exit_code != 0 and "--effects runs beside the engine" in r.output


@shop.function(public=True)
async def buy_two(ctx: Context, amount: int) -> list:
    """Two effects, a callee's effect, and one that aborts: the ids and events the oracle must reproduce."""
    a = ctx.effect("charge", ctx.key, amount, then=paid, carry=[amount])
    b = ctx.effect("charge", ctx.key, amount + 1, then="paid", carry=[amount + 1], attempts=1)
    if amount < 0:
        ctx.effect("no_such_handler", then=paid)
    c = await ctx.call(shop, ctx.key + "-sub", buy, amount, False)
    return [a, b, c]


def test_the_oracle_makes_the_same_effect_requests() -> None:
    from charon import Request
    from charon.testing import check_epoch

    rt = InProcessRuntime(app, partitions=3)
    batch = [Request(f"r{i}", "shop", f"k{i % 4}", "buy_two", serde.encode([i - 2])) for i in range(8)]
    before = rt.snapshot()
    result = rt.run_epoch(batch)
    check_epoch(app, before, rt.snapshot(), result)  # the same replies, state and events (the effect requests)
    docs = [serde.decode(v) for _, s, v in result.events if s == EFFECT_STREAM]
    assert len(docs) == 3 * 6 and len({d["id"] for d in docs}) == len(docs)  # 2 aborted, 3 effects per commit
    assert sum(not r.ok for r in result.replies.values()) == 2
