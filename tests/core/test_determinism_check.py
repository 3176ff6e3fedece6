"""The opt-in determinism check (charon.core.determinism): every function step runs twice on the same inputs and
a transaction whose two runs' effects differ aborts with NonDeterministicFunction naming the function, the key and
what differed. Over real HTTP against `charon run --check-determinism` with the repros' mistakes app (``rnd`` uses
random.random(), ``clock`` time.time()); deterministic programs (generated ones: calls, gathers, sends, timers,
ctx.random()/ctx.now(), aborts, the fallback) commit exactly as without the check; on real PySpark too."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core import partition
from charon.testing import workloads as wl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "repros"))

from test_mistakes import App  # noqa: E402 - the mistakes app over HTTP (its helpers)

ND = "NonDeterministicFunction"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """The mistakes app served by `charon run` with the check on, and without it (the default)."""
    checked = App("--check-determinism", "--function-timeout", "1",
                  "--data-dir", str(tmp_path_factory.mktemp("checked")))
    try:
        plain = App("--function-timeout", "1", "--data-dir", str(tmp_path_factory.mktemp("plain")))
    except BaseException:
        checked.close()
        raise
    yield checked, plain
    checked.close()
    plain.close()


def test_random_and_time_abort_with_the_check_over_http(servers: tuple[App, App]) -> None:
    checked, plain = servers
    r = checked.invoke("rnd", key="r1")
    assert r["status"] != 200 and r["error_type"] == ND, r
    assert "acc.rnd on key 'r1'" in r["error"] and "state writes (the value of acc 'r1')" in r["error"], r
    assert checked.state("acc", "r1") is None  # nothing of it committed
    r = checked.invoke("clock", key="c1")
    assert r["status"] != 200 and r["error_type"] == ND, r
    assert "acc.clock on key 'c1'" in r["error"] and "return values" in r["error"], r
    # off by default: the same functions commit (their non-determinism goes unnoticed)
    assert plain.invoke("rnd", key="r1")["status"] == 200
    assert isinstance(plain.state("acc", "r1"), float)
    assert plain.invoke("clock", key="c1")["status"] == 200


def test_deterministic_functions_reply_the_same_with_the_check_over_http(servers: tuple[App, App]) -> None:
    checked, plain = servers
    calls = [("setiter", "s", [["a", "b", "c", "d"]]), ("recurse", "rec", [5]), ("recurse_other", "ro", [4]),
             ("read", "rec", []), ("catch_callee", "cc", []), ("no_await", "na", []), ("put_set", "ps", []),
             ("ret_set", "rs", [])]
    for fn, key, args in calls:
        a, b = checked.invoke(fn, key, args), plain.invoke(fn, key, args)
        assert (a["status"], a.get("value"), a["error_type"], a["error"]) == (
            b["status"], b.get("value"), b["error_type"], b["error"]), (fn, a, b)
    assert checked.invoke("recurse", "rec2", [3])["value"] == 3


def test_a_runaway_function_is_stopped_in_either_run(servers: tuple[App, App]) -> None:
    """The watchdog stops the check's second run past its budget like the first: InvocationTimeout, and the
    engine keeps serving."""
    checked, _ = servers
    r = checked.invoke("spin", key="sp")
    assert r["error_type"] == "InvocationTimeout", r
    assert checked.invoke("recurse", "after", [2])["value"] == 2


# -- what differed, named (in process) ---------------------------------------------------------------------

op = Operator("op")


@op.function
async def emits(ctx: Context) -> None:
    ctx.emit("s", random.random())


@op.function
async def sends(ctx: Context) -> None:
    ctx.send(op, "b", sink, 1)
    ctx.send(op, "b", sink, random.random())


@op.function
async def targets(ctx: Context) -> None:
    await ctx.call(op, f"t{random.random()}", sink, 1)


@op.function
async def timer(ctx: Context) -> None:
    ctx.send_after(random.random(), op, "b", sink, 1)


@op.function
async def callee(ctx: Context) -> float:
    return random.random()


@op.function
async def caller(ctx: Context) -> float:
    return await ctx.call(op, "c", callee)


@op.function
async def fine(ctx: Context, n: int) -> float:
    v = ctx.random() + ctx.now() + n
    ctx.put(v)
    ctx.emit("s", v)
    ctx.send_after(ctx.random(), op, "b", sink, n)
    ctx.send(op, "b", sink, v)
    out = await ctx.gather(ctx.call(op, "x", sink, v), ctx.call(op, "y", sink, n))
    return v + sum(out)


@op.function
async def sink(ctx: Context, v: float) -> float:
    ctx.put_item("n", ctx.get_item("n", 0) + 1)
    return v


APP = Application("dcheck", [op])


def _one(fn: str, *args: object, check: bool = True) -> tuple[str | None, str]:
    rt = InProcessRuntime(APP, partitions=2, warmup_txns=0, determinism_check=check)
    res = rt.run_epoch([Request("q", "op", "a", fn, serde.encode(list(args)), ts=5.0)])
    rt.drain()
    rep = res.replies[res.order[0]]
    return rep.error_type, rep.error_message or ""


@pytest.mark.parametrize(("fn", "what"), [
    ("emits", "events emitted"),
    ("sends", "arguments of its 2nd send (ctx.send(op, 'b', sink, ...))"),
    ("targets", "targets of its 1st call"),
    ("timer", "state writes (the timers of op 'a')"),
    ("caller", "return values"),
])
def test_the_abort_names_the_function_and_what_differed(fn: str, what: str) -> None:
    etype, msg = _one(fn)
    assert etype == ND, (fn, etype, msg)
    where = "op.callee on key 'c'" if fn == "caller" else f"op.{fn} on key 'a'"
    assert where in msg and what in msg, msg
    assert not _one(fn, check=False)[0]  # committed without the check


def test_deterministic_effects_commit_the_same_with_and_without_the_check() -> None:
    results = []
    for check in (False, True):
        rt = InProcessRuntime(APP, partitions=2, warmup_txns=0, determinism_check=check)
        res = rt.run_epoch([Request(f"q{i}", "op", f"k{i}", "fine", serde.encode([i]), ts=5.0) for i in range(6)])
        rt.drain()
        replies = [(res.requests[t].request_id, res.replies[t]) for t in res.order]
        assert all(r.ok for _, r in replies), replies
        events = [e.value for e in rt.streams.read("s", 0, 100).events]
        results.append((replies, rt.snapshot(), events))
    assert results[0] == results[1]


# -- generated programs: with the check, every reply and the final state as without it ------------------------


def _run(w: wl.Workload, check: bool) -> tuple[list, dict]:
    rt = InProcessRuntime(wl.app, partitions=w.partitions, warmup_txns=0, determinism_check=check)
    assert all(u.check_determinism is check for u in rt.units)
    wl.load(rt, w)
    replies = []
    e = 0
    while e < len(w.epochs) or rt.coordinator.deferred:
        res = rt.run_epoch(w.requests(e) if e < len(w.epochs) else [], now=float(e + 1))
        replies += [(res.requests[t].request_id, res.replies[t]) for t in res.order]
        e += 1
        assert e < 40, "deferred transactions never finish"
    return replies, rt.snapshot()


@settings(deadline=None, derandomize=True, max_examples=300, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(wl.workloads(epochs=(1, 4), txns=(1, 12)))
def test_generated_programs_commit_exactly_as_without_the_check(w: wl.Workload) -> None:
    from charon.core import determinism

    saved, run_twice = partition.KEEP_LIVE_COROUTINES, determinism.run_twice
    steps = [0]

    def counted(unit: partition.PartitionUnit, frame: partition.Frame) -> object:
        steps[0] += 1
        return run_twice(unit, frame)

    partition.KEEP_LIVE_COROUTINES = w.live
    determinism.run_twice = counted  # type: ignore[assignment]
    try:
        with wl.engine_abort_rule():
            plain = _run(w, False)
            assert steps[0] == 0  # off: never called
            checked = _run(w, True)
    finally:
        partition.KEEP_LIVE_COROUTINES = saved
        determinism.run_twice = run_twice  # type: ignore[assignment]
    assert steps[0] > 0 or not any(w.epochs)  # every step of the checked run ran twice
    assert not any(r.error_type == ND for _, r in checked[0])
    assert checked == plain


# -- the oracle (charon.testing.serial_execute) has the same check ------------------------------------------------


def test_the_oracle_checks_determinism_too() -> None:
    from mistakes_app import app as mistakes

    from charon.testing import serial_execute

    def run(app: Application, fn: str, *args: object, check: bool = True) -> tuple:
        state: dict[bytes, bytes] = {}
        req = Request("q", _op_of(app), "k", fn, serde.encode(list(args)), ts=5.0)
        out = serial_execute(app, state, 1, req, determinism_check=check)
        return out, state

    (ok, err), state = run(mistakes, "rnd")
    assert not ok and err[0] == ND and "acc.rnd on key 'k'" in err[1] and "state writes" in err[1], err
    assert state == {}  # nothing applied
    (ok, err), _ = run(mistakes, "clock")
    assert not ok and err[0] == ND and "acc.clock on key 'k'" in err[1] and "return values" in err[1], err
    (ok, err), _ = run(APP, "caller")
    assert not ok and err[0] == ND and "op.callee on key 'c'" in err[1], err
    (ok, err), _ = run(APP, "sends")
    assert not ok and "arguments of its 2nd send" in err[1], err
    assert run(mistakes, "rnd", check=False)[0][0]  # committed without the check
    for fn, args in (("fine", (3,)), ("recurse_other", (3,))):
        app = APP if fn == "fine" else mistakes
        assert run(app, fn, *args) == run(app, fn, *args, check=False)
        assert run(app, fn, *args)[0][0]


def _op_of(app: Application) -> str:
    return "op" if app is APP else "acc"


@settings(deadline=None, derandomize=True, max_examples=60, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(wl.workloads(epochs=(1, 2), txns=(1, 8)))
def test_the_oracle_with_the_check_equals_the_oracle_without(w: wl.Workload) -> None:
    from charon.testing import serial_execute

    rt = InProcessRuntime(wl.app, partitions=1, warmup_txns=0)
    wl.load(rt, w)
    base = rt.snapshot()
    outs = []
    for check in (False, True):
        state, events, replies = dict(base), [], []
        with wl.engine_abort_rule():
            for e in range(len(w.epochs)):
                for i, req in enumerate(w.requests(e)):
                    replies.append(serial_execute(wl.app, state, 100 * e + i + 1, req, events=events,
                                                  determinism_check=check))
        outs.append((replies, state, events))
    assert outs[0] == outs[1]
