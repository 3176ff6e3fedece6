"""One error model: `InProcessRuntime.invoke` raises exactly what the HTTP client's `invoke` raises for the same
request (issue 22's repros: in-process tests used to catch other exceptions than production code)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from charon import InProcessRuntime, TransactionAborted
from charon.client import Client
from charon.server.serve import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from hostile_app import app  # noqa: E402

CASES = [  # (function, args, key): a root-level refusal, engine errors inside the call graph, an application error
    ("nosuch", [], "k"),
    ("deposit", ["not an int"], "k"),
    ("spin_callee", ["y"], "x"),
    ("boom", [], "k"),
    ("transfer", ["b", 10**9], "a"),
]


def _outcome(call) -> tuple[str, str]:  # noqa: ANN001
    try:
        call()
    except TransactionAborted as e:
        return "TransactionAborted", e.error_type
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e).__name__, ""
    return "ok", ""


@pytest.mark.parametrize("fn,args,key", CASES)
def test_in_process_and_http_raise_the_same(fn: str, args: list, key: str) -> None:
    rt = InProcessRuntime(app, function_timeout=0.3, watchdog_interval=0.05)
    srv = BackgroundServer(rt, token="t").start()
    try:
        http = _outcome(lambda: Client(srv.url, token="t").invoke("acc", key, fn, *args))
        local = _outcome(lambda: srv.call(rt.invoke("acc", key, fn, *args)))
    finally:
        srv.stop()
    assert http == local, (http, local)
    assert http[0] != "ok"


def test_the_cases_cover_both_kinds() -> None:
    """The cases above include refusals before the log and aborts inside the call graph."""
    rt = InProcessRuntime(app, function_timeout=0.3, watchdog_interval=0.05)

    async def main() -> list[tuple[str, str]]:
        out = []
        async with rt:
            for fn, args, key in CASES:
                try:
                    await rt.invoke("acc", key, fn, *args)
                    out.append(("ok", ""))
                except TransactionAborted as e:
                    out.append(("TransactionAborted", e.error_type))
                except Exception as e:  # noqa: BLE001
                    out.append((type(e).__name__, ""))
        return out

    got = asyncio.run(main())
    assert got == [("UnknownFunction", ""), ("BadArguments", ""), ("TransactionAborted", "InvocationTimeout"),
                   ("TransactionAborted", "RuntimeError"), ("TransactionAborted", "ValueError")], got


def test_state_reads_do_not_show_the_engines_timer_entries() -> None:
    """`charon read` / the admin scan list an entity's value and its own items, not the engine's timer entries
    (they once showed "\\u0002t2-0-1" beside the items)."""
    from charon import Application, Context, Operator
    from charon.runtime.control.reads import decode_entities

    acct = Operator("acct")

    @acct.function(public=True)
    async def later(ctx: Context) -> None:
        ctx.put(1)
        ctx.put_item("mine", 2)
        ctx.send_after(3600, acct, ctx.key, noop)

    @acct.function(public=True)
    async def noop(ctx: Context) -> None:
        pass

    rt = InProcessRuntime(Application("timers", [acct]))

    async def main() -> dict:
        async with rt:
            await rt.invoke("acct", "k", "later")
            assert rt.pending_timers(), "the timer is pending"
            return decode_entities(rt.snapshot(), "acct")

    got = asyncio.run(main())
    assert got == {"k": {"value": 1, "items": {"mine": 2}}}, got
