"""Portals between applications of one deployment (issue 12 items 3, 4, 6): the registry, typed errors for
what is not declared, the order -> payment -> shipping example under load with random aborts, and a
SIGKILL of the deployment between requests and replies keeping every side exactly once."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from charon import Application, Context, InProcessRuntime, Operator
from charon.apps.orderflow import check_conservation, orders_app, payments_app, shipping_app
from charon.errors import UndeclaredPortal
from charon.runtime.deployment import Deployment

TESTS = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(TESTS))
from portal_deployment import CUSTOMERS, ITEMS, MONEY_EACH, STOCK_EACH  # noqa: E402

probe = Operator("probe")


@probe.function
async def sneak(ctx: Context, portal: str) -> str:
    """Ask a portal this application may not use."""
    return ctx.ask(portal, "c0", 1, "x", then="got")


@probe.function
async def got(ctx: Context, reply: dict, *carry: str) -> None:
    ctx.put([reply, list(carry)])


@probe.function
async def ask_with_carry(ctx: Context) -> str:
    return ctx.ask("payments.refund", "c9", 5, ctx.key, then=got, carry=["a", "b"])


@probe.function
async def forge(ctx: Context) -> None:
    ctx.emit("charon.portal.requests", {"rid": "x"})  # reserved: refused


@probe.function
async def fails(ctx: Context, reply: dict) -> None:
    raise RuntimeError("the continuation aborts")


@probe.function
async def ask_then_fail(ctx: Context) -> str:
    return ctx.ask("payments.refund", "c8", 1, ctx.key, then="fails")


@probe.function
async def ask_missing(ctx: Context) -> str:
    return ctx.ask("payments.refund", "c8", 1, ctx.key, then="no_such_function")


def test_the_registry_refuses_what_is_not_declared() -> None:
    """A use that no application exposes, a stream wired without being exposed or used: UndeclaredPortal."""
    o, p, s = (InProcessRuntime(a, partitions=1) for a in (orders_app, payments_app, shipping_app))
    dep = Deployment([o, p, s])
    reg = dep.registry()
    assert reg["payments"]["portals"] == {"charge": ["wallets", "charge"], "refund": ["wallets", "refund"]}
    assert reg["shipping"]["streams"] == ["shipments"] and "shipping.ship" in reg["orders"]["uses"]
    with pytest.raises(UndeclaredPortal):
        Deployment([o, p])  # orders uses shipping.ship, not deployed
    bad = Application("bad", [probe], uses=["payments.steal"])
    with pytest.raises(UndeclaredPortal, match="steal"):
        Deployment([InProcessRuntime(bad, partitions=1), p])
    with pytest.raises(UndeclaredPortal, match="uses"):
        dep.wire("shipping.shipments", "orders", "orders", "on_paid")  # orders does not use the stream
    with pytest.raises(UndeclaredPortal, match="not exposed"):
        dep.wire("payments.ledger", "orders", "orders", "on_paid")
    with pytest.raises(ValueError):
        Deployment([o, InProcessRuntime(orders_app, partitions=1)])  # two applications of one name
    with pytest.raises(ValueError, match="without"):
        Deployment([InProcessRuntime(Application("a.b", [probe]), partitions=1)])


async def test_an_undeclared_portal_aborts_and_a_declared_one_round_trips_with_carry() -> None:
    app = Application("prober", [probe], uses=["payments.refund"])
    q, p = InProcessRuntime(app, partitions=1), InProcessRuntime(payments_app, partitions=1)
    async with q, p:
        dep = Deployment([q, p])
        async with dep:
            r = await q.submit("probe", "k", "sneak", ["payments.charge"])
            assert not r.ok and r.error_type == "UndeclaredPortal"
            r = await q.submit("probe", "k", "ask_with_carry", [])
            assert r.ok
            await dep.settle()
        reply, carry = q.entities("probe")["k"]
        assert reply["ok"] and reply["value"] == 5 and carry == ["a", "b"]
        assert p.entities("wallets") == {"c9": 5}
        assert dep.routers["prober"].requests == 1 and dep.routers["prober"].continuations == 1
        assert not dep.routers["prober"].failed
        r = await q.submit("probe", "k2", "forge", [])
        assert not r.ok and r.error_type == "InvalidKey"
        r = await q.submit("probe", "k2", "ask_missing", [])
        assert not r.ok and r.error_type == "UnknownFunction"  # the continuation must exist when asking
        async with dep:
            assert (await q.submit("probe", "k3", "ask_then_fail", [])).ok
            await dep.settle()
        (failed,) = dep.routers["prober"].failed  # the callee ran; the aborted continuation is recorded
        assert failed.error_type == "RuntimeError" and p.entities("wallets")["c8"] == 1


async def test_order_flow_under_load_conserves_money_and_stock() -> None:
    """300 concurrent orders with fraud-check aborts, insufficient funds and stock-outs (refunds): every
    order ends final after exactly its continuations, each charge/refund/shipment ran once."""
    o, p, s = (InProcessRuntime(a, partitions=3) for a in (orders_app, payments_app, shipping_app))
    rng = random.Random(7)
    async with o, p, s:
        for c in range(CUSTOMERS):
            await p.invoke("wallets", f"c{c}", "deposit", MONEY_EACH)
        for i in range(ITEMS):
            await s.invoke("stock", f"i{i}", "restock", STOCK_EACH)
        async with Deployment([o, p, s]) as dep:
            await asyncio.gather(*(
                o.submit("orders", f"o{k}", "place",
                         [f"c{rng.randrange(CUSTOMERS)}", f"i{rng.randrange(ITEMS)}", rng.randint(1, 3),
                          rng.randint(1, 9)]) for k in range(300)))
            await dep.settle()
        by = check_conservation(o, p, s, CUSTOMERS * MONEY_EACH, ITEMS * STOCK_EACH)
        assert sum(by.values()) == 300 and min(by.get(k, 0) for k in ("shipped", "rejected", "cancelled")) > 0, by
        assert s.streams.end_offset("shipments") == by["shipped"]


def test_sigkill_between_requests_and_replies_keeps_each_side_exactly_once(tmp_path: Path) -> None:
    """The deployment (three durable nodes) is SIGKILLed at random moments while orders flow through the
    portals, then restarted until done: money and stock are conserved and every charge, refund, shipment
    and continuation ran exactly once."""
    n, rng, resumed, kills = 240, random.Random(3), [], 0
    env = {**os.environ, "PYTHONPATH": str(TESTS.parents[1])}
    for attempt in range(10):
        proc = subprocess.Popen([sys.executable, str(TESTS / "portal_deployment.py"), str(tmp_path), str(n)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("started"), proc.stderr.read() if proc.stderr else ""
        resumed.append(int(line.split()[1]))
        if attempt < 4:
            try:
                proc.wait(rng.uniform(0.3, 0.8))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                kills += proc.returncode == -signal.SIGKILL
                continue
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and "done" in out, err[-3000:]
        break
    assert kills >= 2 and any(r > 0 for r in resumed[1:]), (kills, resumed)
    rts = [InProcessRuntime(a, partitions=2, data_dir=str(tmp_path / a.name))
           for a in (orders_app, payments_app, shipping_app)]
    try:
        by = check_conservation(*rts, CUSTOMERS * MONEY_EACH, ITEMS * STOCK_EACH)
        assert sum(by.values()) == n, by
        assert rts[2].streams.end_offset("shipments") == by["shipped"]
    finally:
        for rt in rts:
            rt.close()


def test_the_readme_example_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "charon.apps.orderflow"], capture_output=True, text=True,
                         timeout=120, cwd=TESTS.parents[1])
    assert out.returncode == 0, out.stderr
    assert "money and stock conserved" in out.stdout and '"shipped"' in out.stdout


def _start(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(TESTS / "portal_split.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(TESTS.parents[1])})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("started"), proc.stderr.read() if proc.stderr else ""
    return proc, int(line.split()[1])


def _kill(proc: subprocess.Popen) -> bool:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return proc.returncode == -signal.SIGKILL


def test_sigkill_of_one_side_in_its_own_process_keeps_exactly_once(tmp_path: Path) -> None:
    """Orders in one process, payments + shipping in another (PortalServer / outbox / ReplyPump): the callee
    process is SIGKILLed three times and the caller once, each alone while the other runs; at the end
    every order is final, each charge/refund/shipment/continuation ran once, money and stock conserved."""
    n, rng = 250, random.Random(11)
    caller, _ = _start("caller", str(tmp_path), str(n))
    callee, _ = _start("callee", str(tmp_path))
    kills, resumed = 0, []
    for i in range(3):
        time.sleep(rng.uniform(0.3, 0.8))
        kills += _kill(callee)
        if i == 0:  # the caller cannot finish while its callees are down: kill it alone too, then restart it
            time.sleep(rng.uniform(0.1, 0.3))
            kills += _kill(caller)
            caller, _ = _start("caller", str(tmp_path), str(n))
        callee, off = _start("callee", str(tmp_path))
        resumed.append(off)
    out, err = caller.communicate(timeout=240)
    assert caller.returncode == 0 and "done" in out, err[-3000:]
    (tmp_path / "stop").touch()
    out, err = callee.communicate(timeout=60)
    assert callee.returncode == 0 and "done" in out, err[-3000:]
    assert kills == 4 and any(r > 0 for r in resumed), (kills, resumed)  # 3 callee kills, 1 caller kill
    rts = [InProcessRuntime(a, partitions=2, data_dir=str(tmp_path / a.name / "node"))
           for a in (orders_app, payments_app, shipping_app)]
    try:
        by = check_conservation(*rts, CUSTOMERS * MONEY_EACH, ITEMS * STOCK_EACH)
        assert sum(by.values()) == n, by
    finally:
        for rt in rts:
            rt.close()


def test_the_outbox_records_each_reply_once(tmp_path: Path) -> None:
    from charon.runtime.deployment import PortalOutbox

    box = PortalOutbox(str(tmp_path / "sub" / "outbox.sqlite"))
    box.put("a", "r1", {"reply": 1})
    box.put("a", "r1", {"reply": 2})  # a re-served request: the first reply stays
    box.put("b", "r2", {"reply": 3})
    rows = box.read("a", 0, 10)
    assert [(r, d) for _, r, d in rows] == [("r1", {"reply": 1})]
    assert box.read("a", rows[0][0], 10) == [] and [r for _, r, _ in box.read("b", 0, 10)] == ["r2"]
    box.close()
