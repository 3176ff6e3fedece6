"""Replies carry their serial position (issue 8, defect 6): ordering every reply of a multi-epoch history by
(epoch, position) is a serial order, checked with the oracle; the position reaches the output log, HTTP and
the Python client."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

import httpx
import msgspec
import pytest

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.client import Client
from charon.core.routing import partition_of
from charon.errors import TransactionAborted
from charon.log.sqlite import OutputLog
from charon.messages import Reply
from charon.server.serve import BackgroundServer
from charon.testing import check_epoch, serial_execute

acct = Operator("acct")
P = 4
KEYS = [f"a{i}" for i in range(6)]


class NotEnough(Exception):
    pass


@acct.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    balance = ctx.get(default=0)
    if balance < amount:
        raise NotEnough(f"{ctx.key} has {balance}")
    ctx.put(balance - amount)
    await ctx.call(acct, to, "deposit", amount)
    return balance - amount


@acct.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    v = ctx.get(default=0) + amount
    ctx.put(v)
    return v


@acct.function(public=True)
async def route(ctx: Context, base: str) -> int:
    """The callee's key depends on the state read: the read/write set changes when the state does."""
    v = ctx.get(default=0)
    r = await ctx.call(acct, f"{base}{v % 3}", "deposit", 1)
    ctx.put(v + 1)
    return r


@acct.function(public=True)
async def setall(ctx: Context, v: int, other: str) -> int:
    ctx.put(v)
    await ctx.call(acct, other, "setv", v * 2)
    return 0


@acct.function(public=True)
async def setv(ctx: Context, v: int) -> int:
    ctx.put(v)
    return 0


@acct.function(public=True)
async def getv(ctx: Context) -> int:
    return ctx.get(default=0)


@acct.function(public=True)
async def write_if_big(ctx: Context, other: str) -> int:
    x = ctx.get(default=0)
    v = await ctx.call(acct, other, "getv")
    if x > 3:
        ctx.put(x * 100 + v)
    return x


@acct.function(public=True)
async def audit(ctx: Context, keys: list) -> int:
    values = await ctx.gather(*(ctx.call(acct, k, "getv") for k in keys))
    ctx.send(acct, keys[0], "deposit", 0)
    return sum(values)


app = Application("positions", [acct])


def _history(seed: int) -> tuple[InProcessRuntime, list[Request], list[Any], dict[bytes, bytes]]:
    rng = random.Random(seed)
    rt = InProcessRuntime(app, partitions=P)
    rt.load("acct", {k: rng.randint(0, 20) for k in KEYS})
    initial = rt.snapshot()
    E = "E"
    C = next(f"C{i}" for i in range(100) if partition_of("acct", f"C{i}", P) != partition_of("acct", E, P))
    sent: list[Request] = []
    results = []
    n = 0

    def req(key: str, fn: str, *args: Any) -> Request:
        nonlocal n
        n += 1
        r = Request(f"s{seed}-r{n}", "acct", key, fn, serde.encode(list(args)), ts=float(n))
        sent.append(r)
        return r

    for epoch in range(6):
        batch = []
        if epoch == 1:  # r1's pattern: a deferral to the next epoch, a fast fallback commit
            batch += [req(E, "setall", 5, C), req(E, "write_if_big", C), req(E, "getv")]
        for _ in range(25):
            k = rng.choice(KEYS)
            kind = rng.random()
            if kind < 0.45:
                batch.append(req(k, "transfer", rng.choice(KEYS), rng.randint(1, 15)))
            elif kind < 0.7:
                batch.append(req(k, "route", "a"))
            elif kind < 0.85:
                batch.append(req(k, "audit", rng.sample(KEYS, 3)))
            elif kind < 0.95:
                batch.append(req(k, "deposit", rng.randint(1, 5)))
            else:
                batch.append(req(k, "no_such_function"))  # a validation error
        before = rt.snapshot()
        results.append(rt.run_epoch(batch))
        check_epoch(app, before, rt.snapshot(), results[-1])
    results += rt.drain()
    return rt, sent, results, initial


@pytest.mark.parametrize("seed", range(4))
def test_epoch_and_position_order_is_a_serial_order(seed: int) -> None:
    rt, sent, results, initial = _history(seed)
    # the replies the runtime delivered (its reply path), one per request
    replies = {r.request_id: rt.get_reply(r.request_id) for r in sent}
    assert all(rep is not None for rep in replies.values())
    requests = {r.request_id: r for r in sent}
    assert sum(len(res.fast) for res in results) and sum(len(res.slow) for res in results)
    assert sum(len(res.deferred) for res in results), "the history must include a deferral"

    for res in results:  # positions: outcomes decided without the fallback by TID, then the fallback's
        late = set(res.fast) | set(res.slow)
        assert res.order == sorted(res.replies, key=lambda t: res.replies[t].position)
        assert res.order == sorted(set(res.replies) - late) + sorted(late)
        assert len({r.position for r in res.replies.values()}) == len(res.replies)

    serial = sorted(replies.values(), key=lambda r: (r.epoch, r.position))
    state = dict(initial)
    for rep in serial:
        ok, out = serial_execute(app, state, rep.tid, requests[rep.request_id])
        assert rep.ok == ok, (rep, out)
        if ok:
            assert rep.value == out, (rep, serde.decode(out))
        else:
            assert rep.error_type == out[0], (rep, out)
    assert dict(sorted(state.items())) == rt.snapshot()

    # (epoch, tid) is not that order: fallback outcomes come after higher-TID lock-free ones
    assert [r.tid for r in serial] != [r.tid for r in sorted(serial, key=lambda r: (r.epoch, r.tid))]


def test_output_log_keeps_position_and_reads_old_rows(tmp_path: Any) -> None:
    out = OutputLog(str(tmp_path / "out.db"))
    rep = Reply("new", 7, 3, True, serde.encode(1), position=42)
    assert out.put_many([rep]) == 1
    assert out.get("new") == rep

    class OldReply(msgspec.Struct):  # a row written before replies had a position
        request_id: str
        tid: int
        epoch: int
        ok: bool
        value: bytes = b""
        error_type: str = ""
        error_message: str = ""

    with sqlite3.connect(str(tmp_path / "out.db")) as c:
        c.execute("INSERT INTO replies (request_id, epoch, data) VALUES (?, ?, ?)",
                  ("old", 2, msgspec.msgpack.encode(OldReply("old", 5, 2, True, serde.encode(0)))))
    assert out.get("old") == Reply("old", 5, 2, True, serde.encode(0), position=None)
    assert [r.request_id for _, r in out.read_since(0)] == ["new", "old"]


def test_position_over_http_and_in_the_client() -> None:
    rt = InProcessRuntime(app, partitions=P, epoch_max_ms=1.0)
    rt.load("acct", {"x": 3})
    with BackgroundServer(rt) as srv, Client(srv.url) as client:
        res = client.invoke_result("acct", "x", "transfer", "y", 2, request_id="ok-1")
        stored = srv.call(_get_reply(rt, "ok-1"))
        assert res.position is not None and res.position == stored.position
        assert (res.tid, res.epoch) == (stored.tid, stored.epoch)
        with pytest.raises(TransactionAborted) as info:
            client.invoke_result("acct", "x", "transfer", "y", 50, request_id="ab-1")
        assert info.value.position == srv.call(_get_reply(rt, "ab-1")).position  # type: ignore[attr-defined]
        body = httpx.get(srv.url + "/requests/ok-1").json()
        assert body["position"] == stored.position
        schema = httpx.get(srv.url + "/openapi.json").json()["components"]["schemas"]
        assert "position" in schema["Reply"]["required"]
        assert schema["Reply"]["properties"]["position"]["type"] == ["integer", "null"]
        assert "position" in schema["Error"]["properties"]


async def _get_reply(rt: InProcessRuntime, rid: str) -> Reply:
    rep = rt.get_reply(rid)
    assert rep is not None
    return rep
