"""Timers and delayed calls (charon.core.timers) on the in-process runtime and the durable node: they fire
exactly once, in the first epoch whose deterministic time passes them, also across SIGKILLs; they can be
cancelled and listed; a timer of an aborted transaction never exists; a generated mix against the oracle."""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from charon import InProcessRuntime, Request, Timer, serde
from charon.apps.holds import app
from charon.core import timers
from charon.testing import check_epoch

T0 = 1_000.0


def req(rid: str, key: str, fn: str, *args: object, ts: float = T0) -> Request:
    return Request(rid, "acct", key, fn, serde.encode(list(args)), ts)


def value(result, rid: str):
    rep = next(r for r in result.replies.values() if r.request_id == rid)
    assert rep.ok, rep
    return serde.decode(rep.value)


def epoch(rt: InProcessRuntime, reqs: list[Request], now: float, partitions: int, limit: int = 10_000):
    """One checked epoch: the engine against the serial oracle, which also decides which timers are due."""
    before, last = rt.snapshot(), rt.coordinator.sequencer.time
    result = rt.run_epoch(reqs, now=now)
    assert result.time == max(now, last), "the epoch's time is the logged one (never going back)"
    check_epoch(app, before, rt.snapshot(), result, partitions=partitions, timer_limit=limit)
    return result


def test_a_timer_fires_once_in_the_first_epoch_past_it_and_an_aborted_one_never_exists() -> None:
    rt = InProcessRuntime(app, partitions=3)
    rt.load("acct", {"a": 100, "b": 100})
    r = epoch(rt, [req("h", "a", "hold", "x", 30, 5.0), req("d", "b", "doomed", 1.0),
                   req("m", "a", "remind", "b", "hi", T0 + 3)], T0, 3)
    hold_id, remind_id = value(r, "h"), value(r, "m")
    assert not r.replies[2].ok and rt.timers("acct", "b") == [], "the aborted transaction's timer never exists"
    assert [t.id for t in rt.timers("acct", "a")] == sorted([hold_id, remind_id])
    assert [t.id for t in rt.pending_timers()] == [remind_id, hold_id], "the index is ordered by due time"
    assert rt.read_state("acct", "a") == 70
    fired_in: dict[str, int] = {}
    for e, now in enumerate([T0 + 1, T0 + 2.999, T0 + 3, T0 + 4, T0 + 5.5, T0 + 9]):
        r = epoch(rt, [req(f"p{e}", "a", "pending", ts=now)], now, 3)
        for t in r.timers:
            assert t.id not in fired_in, "fired twice"
            fired_in[t.id] = e
            rep = next(x for x in r.replies.values() if x.request_id == timers.REQUEST_PREFIX + t.id)
            assert rep.ok and serde.decode(rep.value) == 1
        listed = [x[0] for x in value(r, f"p{e}")]
        assert listed == sorted(set([hold_id, remind_id]) - set(fired_in)), "a due timer is gone before it runs"
    assert fired_in == {remind_id: 2, hold_id: 4}, "each fires in the first epoch whose time passes it"
    assert rt.read_items("acct", "b") == {"note:hi": 1} and rt.read_items("acct", "a") == {"fired:x": 1}
    assert rt.read_state("acct", "a") == 100 and rt.pending_timers() == []
    assert rt.coordinator.next_due == math.inf


def test_now_of_a_fired_timer_is_the_epoch_time_and_time_never_goes_back() -> None:
    rt = InProcessRuntime(app, partitions=2)
    rt.load("acct", {"a": 10})
    epoch(rt, [req("h", "a", "hold", "x", 1, 0.5)], T0, 2)
    r = epoch(rt, [], T0 - 50, 2)  # a clock that went back: the epoch keeps the previous time
    assert r.time == T0 and r.timers == []
    r = epoch(rt, [], T0 + 0.5, 2)
    assert [t.function for t in r.timers] == ["release"] and r.requests[min(r.requests)].ts == T0 + 0.5


def test_cancel_and_list() -> None:
    rt = InProcessRuntime(app, partitions=4)
    rt.load("acct", {"a": 100, "b": 0})
    r = epoch(rt, [req("h1", "a", "hold", "x", 10, 5.0), req("h2", "a", "hold", "y", 20, 5.0)], T0, 4)
    t1, t2 = value(r, "h1"), value(r, "h2")
    r = epoch(rt, [req("c", "a", "capture", "x", "b"), req("bogus", "b", "cancel", t2)], T0 + 1, 4)
    assert value(r, "c") is True
    assert value(r, "bogus") is False, "only the owner entity cancels its timer"
    assert [t.id for t in rt.timers("acct", "a")] == [t2]
    # due in this epoch: it fires at the epoch's start, so a capture in the same epoch is too late
    r = epoch(rt, [req("c2", "a", "capture", "y", "b"), req("c3", "a", "cancel", t1)], T0 + 6, 4)
    assert [t.id for t in r.timers] == [t2]
    assert value(r, "c2") is False and value(r, "c3") is False
    assert rt.entities("acct") == {"a": 90, "b": 10}
    assert rt.read_items("acct", "a") == {"fired:y": 1} and rt.pending_timers() == []


def test_bad_timer_arguments_abort_with_typed_errors() -> None:
    rt = InProcessRuntime(app, partitions=2)
    rt.load("acct", {"a": 100})
    r = rt.run_epoch([req("neg", "a", "hold", "x", 10, -1.0), req("nan", "a", "remind", "b", "n", math.nan),
                      req("far", "a", "remind", "b", "n", 1e13), req("bad", "a", "cancel", "")], now=T0)
    assert {x.request_id: (x.ok, x.error_type) for x in r.replies.values()} == {
        "neg": (False, "ValueError"), "nan": (False, "ValueError"), "far": (False, "ValueError"),
        "bad": (False, "ValueError")}
    assert rt.pending_timers() == [] and rt.read_state("acct", "a") == 100


def test_timers_beyond_the_per_epoch_limit_fire_in_the_next_epochs() -> None:
    rt = InProcessRuntime(app, partitions=2, max_timers_per_epoch=2)
    rt.load("acct", {f"k{i}": 10 for i in range(6)})
    epoch(rt, [req(f"h{i}", f"k{i}", "hold", "x", 1, 0.1 * (i + 1)) for i in range(6)], T0, 2, limit=2)
    fired = []
    for e in range(4):
        r = epoch(rt, [], T0 + 10 + e, 2, limit=2)
        assert len(r.timers) <= 4  # at most 2 per partition
        fired += [t.id for t in r.timers]
    assert len(fired) == len(set(fired)) == 6 and rt.pending_timers() == []
    assert all(v == 10 for v in rt.entities("acct").values())


@pytest.mark.parametrize("seed", range(6))
def test_generated_timer_workload_against_the_oracle(seed: int) -> None:
    """Holds, captures, cross-entity reminders, cancels, listings and aborting registrations, over epochs of
    advancing (sometimes standing) time: every epoch equals the oracle, which also decides which timers are
    due; money is conserved; every timer fires exactly once unless it was cancelled first."""
    rng = random.Random(seed)
    parts = rng.choice([1, 2, 3, 4])
    limit = rng.choice([1, 3, 10_000])
    keys = [f"k{i}" for i in range(6)]
    rt = InProcessRuntime(app, partitions=parts, max_timers_per_epoch=limit)
    rt.load("acct", {k: 50 for k in keys})
    now = T0
    registered: dict[str, str] = {}  # timer id -> request that registered it
    fired: dict[str, int] = {}
    fired_timers: list[Timer] = []
    n = 0
    for e in range(30):
        now += rng.choice([0.0, 0.3, 1.0, 2.5])
        reqs = []
        for _ in range(rng.randrange(0, 9)):
            n += 1
            k = rng.choice(keys)
            x = rng.random()
            rid = f"r{n}"
            if x < 0.35:
                reqs.append(req(rid, k, "hold", f"g{rng.randrange(5)}", rng.randint(1, 70), rng.choice([0, 0.5, 2, 4]),
                                ts=now))
            elif x < 0.55:
                reqs.append(req(rid, k, "capture", f"g{rng.randrange(5)}", rng.choice(keys), ts=now))
            elif x < 0.7:
                reqs.append(req(rid, k, "remind", rng.choice(keys), f"n{n}", now + rng.choice([-1, 0, 1, 3]), ts=now))
            elif x < 0.8:
                reqs.append(req(rid, k, "doomed", 1.0, ts=now))
            elif x < 0.9 and registered:
                reqs.append(req(rid, k, "cancel", rng.choice(sorted(registered)), ts=now))
            else:
                reqs.append(req(rid, k, "pending", ts=now))
        r = epoch(rt, reqs, now, parts, limit)
        fired_timers += r.timers
        for t in r.timers:
            assert t.id in registered and t.id not in fired
            fired[t.id] = e
            assert t.due <= r.time
        for rep in r.replies.values():
            if rep.ok and rep.request_id.startswith("r"):
                v = serde.decode(rep.value)
                if isinstance(v, str) and v.startswith("t"):
                    registered[v] = rep.request_id
        assert sum(rt.entities("acct").values()) + sum(
            h[1] for k in keys for name, h in rt.read_items("acct", k).items() if name.startswith("hold:")
        ) == 50 * len(keys), "money is conserved"
        pending = {t.id for t in rt.pending_timers()}
        assert pending <= set(registered) and not pending & set(fired)
    while rt.coordinator.deferred or rt.pending_timers():
        now += 100
        r = epoch(rt, [], now, parts, limit)
        for t in r.timers:
            assert t.id not in fired
            fired[t.id] = -1
        fired_timers += r.timers
    assert set(fired) <= set(registered)
    want: dict[tuple[str, str], int] = {}  # what each entity must have counted: one per firing
    for t in fired_timers:
        name = ("fired:" if t.function == "release" else "note:") + serde.decode(t.args)[0]
        want[(t.key, name)] = want.get((t.key, name), 0) + 1
    have = {(k, name): v for k in keys for name, v in rt.read_items("acct", k).items()
            if name.startswith(("fired:", "note:"))}
    assert have == want and len(fired_timers) == len(fired)
    holds = [h for k in keys for name, h in rt.read_items("acct", k).items() if name.startswith("hold:")]
    assert sum(rt.entities("acct").values()) + sum(h[1] for h in holds) == 50 * len(keys)
    assert not {h[0] for h in holds} & set(fired), "a hold left over is one whose timer was cancelled"


async def test_service_mode_fires_a_due_timer_without_any_request() -> None:
    rt = InProcessRuntime(app, partitions=2, epoch_max_ms=1.0)
    rt.load("acct", {"a": 5})
    async with rt:
        tid = await rt.invoke("acct", "a", "hold", "x", 5, 0.3)
        assert rt.read_state("acct", "a") == 0 and [t.id for t in rt.timers("acct", "a")] == [tid]
        for _ in range(300):
            if rt.get_reply(timers.REQUEST_PREFIX + tid) is not None:
                break
            await asyncio.sleep(0.01)
        rep = rt.get_reply(timers.REQUEST_PREFIX + tid)
        assert rep is not None and rep.ok and serde.decode(rep.value) == 1
        assert rt.read_state("acct", "a") == 5 and rt.timers("acct", "a") == []
        assert rt.coordinator.next_due == math.inf


# -- the durable node: SIGKILL at each step of logging and checkpointing ---------------------------------

def node_epoch(e: int) -> tuple[list[Request], float]:
    """A fixed timer workload: epoch ``e`` runs at time T0 + e."""
    now = T0 + e
    k = [f"a{i}" for i in range(4)]
    out = [req(f"e{e}-h", k[e % 4], "hold", f"x{e}", 5, float(e % 3), ts=now),
           req(f"e{e}-m", k[(e + 1) % 4], "remind", k[(e + 2) % 4], f"n{e}", now + 2, ts=now),
           req(f"e{e}-d", k[(e + 3) % 4], "doomed", 0.0, ts=now)]
    if e >= 2:
        out.append(req(f"e{e}-c", k[(e - 2) % 4], "capture", f"x{e - 2}", k[e % 4], ts=now))
    return out, now


_CRASH_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from test_timers import node_epoch
from charon.apps.holds import app
from charon.runtime.node.inprocess import InProcessRuntime
rt = InProcessRuntime(app, partitions=3, data_dir=sys.argv[2], compact_every=int(sys.argv[3]))
rt.load("acct", {f"a{i}": 100 for i in range(4)})
for e in range(8):
    reqs, now = node_epoch(e)
    rt.run_epoch(reqs, now=now)
    rt.node.flush()
"""


@pytest.mark.parametrize("point", ["logged", "delta0", "record", "compacting"])
def test_node_sigkill_fires_each_timer_once_in_the_same_epoch(tmp_path: Path, point: str) -> None:
    """SIGKILL at a step of epoch 4 (after timers fired in it and earlier); the recovered node has the
    uninterrupted run's state and timer replies (same epochs, same TIDs) and goes on identically."""
    env = {**os.environ, "CHARON_CRASH_AT": f"node:{point}:4"}
    compact = "5" if point == "compacting" else "2"  # the 5th checkpoint is epoch 4's
    p = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(Path(__file__).parent), str(tmp_path), compact],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    ref = InProcessRuntime(app, partitions=3)
    ref.load("acct", {f"a{i}": 100 for i in range(4)})
    ref_replies = {}
    for e in range(5):
        reqs, now = node_epoch(e)
        r = ref.run_epoch(reqs, now=now)
        ref_replies.update({x.request_id: x for x in r.replies.values()})
    fired_ref = [rid for rid in ref_replies if rid.startswith(timers.REQUEST_PREFIX)]
    assert len(fired_ref) >= 6
    rt = InProcessRuntime(app, partitions=3, data_dir=str(tmp_path))
    try:
        assert rt.epoch == 5 and rt.snapshot() == ref.snapshot()
        for rid, rep in ref_replies.items():
            assert rt.get_reply(rid) == rep, rid
        for e in range(5, 9):
            reqs, now = node_epoch(e)
            a, b = rt.run_epoch(reqs, now=now), ref.run_epoch(reqs, now=now)
            assert [t.id for t in a.timers] == [t.id for t in b.timers]
            assert a.replies == b.replies
        assert rt.snapshot() == ref.snapshot()
        counts = [v for k in range(4) for n, v in rt.read_items("acct", f"a{k}").items()
                  if n.startswith(("fired:", "note:"))]
        assert counts and all(v == 1 for v in counts), "no timer fired twice"
    finally:
        rt.close()


_SERVICE_SCRIPT = """
import asyncio, sys, time
from charon.apps.holds import app
from charon.runtime.node.inprocess import InProcessRuntime

async def main():
    rt = InProcessRuntime(app, partitions=2, data_dir=sys.argv[1], checkpoint_s=0.05)
    if rt.epoch == 0:
        rt.load("acct", {f"a{i}": 100 for i in range(4)})
    async with rt:
        if sys.argv[2] == "register":
            for i in range(4):
                await rt.invoke("acct", f"a{i}", "hold", "x", 10, 0.4 + 0.1 * i)
            await asyncio.to_thread(rt.node.flush)
            print("registered", flush=True)
            await asyncio.sleep(60)  # killed while the timers are pending (or firing)
        else:
            while rt.pending_timers():
                await asyncio.sleep(0.02)
    rt.close()

asyncio.run(main())
"""


def test_node_sigkill_while_timers_are_pending_then_restart(tmp_path: Path) -> None:
    """A serving node is SIGKILLed with timers pending; after a restart every timer fires, once."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE_SCRIPT, str(tmp_path), "register"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered", proc.stderr
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    p = subprocess.run([sys.executable, "-c", _SERVICE_SCRIPT, str(tmp_path), "run"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path))
    try:
        assert rt.pending_timers() == []
        assert rt.entities("acct") == {f"a{i}": 100 for i in range(4)}, "every hold released"
        for i in range(4):
            assert rt.read_items("acct", f"a{i}") == {"fired:x": 1}, "each timer fired exactly once"
    finally:
        rt.close()


def test_timer_records_are_typed() -> None:
    t = Timer("t1-0-1", T0, "acct", "a", "acct", "b", "noted", serde.encode(["x"]))
    assert timers.decode(timers.encode(t)) == t
    assert timers.index_key(t) < timers.index_key(Timer("t0", T0 + 0.000001, "a", "b", "a", "b", "f", b""))
    with pytest.raises(ValueError):
        timers.check_due("soon")


def test_http_admin_lists_timers_with_the_token() -> None:
    """``GET /timers/{operator}/{key}`` (and ``Client.timers``): the entity's pending timers; 401 without the
    token, 400 for a bad key, 404 for an unknown operator; a timer that fired is no longer listed."""
    import httpx

    from charon.client import Client, Unauthorized
    from charon.server.serve import BackgroundServer

    rt = InProcessRuntime(app, partitions=2, epoch_max_ms=1.0)
    rt.load("acct", {"a": 50})
    with BackgroundServer(rt, token="tok") as srv, Client(srv.url, token="tok") as c:
        near = c.invoke("acct", "a", "hold", "x", 10, 0.2)
        far = c.invoke("acct", "a", "remind", "b/c", "hello", 4e9)
        listed = c.timers("acct", "a")
        assert sorted(t["id"] for t in listed) == sorted([near, far])
        assert {t["id"]: (t["function"], t["key"], t["args"]) for t in listed}[far] == ("noted", "b/c", ["hello"])
        assert c.timers("acct", "b/c") == []
        with Client(srv.url, token=None) as anon, pytest.raises(Unauthorized):
            anon.timers("acct", "a")
        assert httpx.get(f"{srv.url}/timers/nope/a", headers={"Authorization": "Bearer tok"}).status_code == 404
        bad = httpx.get(f"{srv.url}/timers/acct/%00", headers={"Authorization": "Bearer tok"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "InvalidKey"
        for _ in range(300):
            if [t["id"] for t in c.timers("acct", "a")] == [far]:
                break
            time.sleep(0.01)
        assert [t["id"] for t in c.timers("acct", "a")] == [far], "the near timer fired"
        assert c.state("acct", "a") == 50
