"""Journal replay is exact: calls created before they are awaited, awaited out of order, twice or late.

Every scenario of ``replay_app`` runs with live coroutines and with journal replay only, on 1, 2 and 4
partitions, and through the Spark exchange's task function with rounds hopping between simulated worker
processes; each run is checked against the serial oracle and against what the scenario must leave behind
(a send sent once, a call awaited long after it was created, a ``finally`` block run once).
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings

import pytest
import replay_app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.config import SparkConfig
from charon.core import partition
from charon.core.epoch import EpochCoordinator
from charon.core.routing import partition_of, split_store_key, store_key
from charon.runtime.spark.exchange import SparkExchange
from charon.state.durable import DurableState
from charon.testing import CaughtCalleeError, check_epoch

FUNCTIONS = list(replay_app.SCENARIOS)

# every round a job of its own, as these tests hop rounds between workers (the one-task modes: test_sim)
ROUND_BY_ROUND = {"single_task_rest": False, "single_task_fallback": False}


def _requests() -> list[Request]:
    return [Request(fn, "s", fn, fn, serde.encode([]), ts=100.0 + i) for i, fn in enumerate(FUNCTIONS)]


def _reference() -> InProcessRuntime:
    rt = InProcessRuntime(replay_app.app, partitions=1)
    for (op, key), items in replay_app.initial_state().items():
        rt.load_items(op, key, items)
    return rt


def _check_expected(read) -> None:
    for fn, expected in replay_app.SCENARIOS.items():
        for suffix, value in expected.items():
            assert read("acct", f"{fn}.{suffix}") == value, (fn, suffix)


def _outcome(result) -> dict[str, tuple]:
    return {result.requests[t].request_id: (r.ok, r.value, r.error_type) for t, r in result.replies.items()}


@pytest.mark.parametrize("partitions", [1, 2, 4])
@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
@pytest.mark.parametrize("scenario", FUNCTIONS)
def test_scenario_in_process(monkeypatch, scenario, live, partitions):
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt = InProcessRuntime(replay_app.app, partitions=partitions)
    for (op, key), items in replay_app.initial_state().items():
        rt.load_items(op, key, items)
    before = rt.snapshot()
    result = rt.run_epoch([r for r in _requests() if r.function == scenario])
    assert [r.ok for r in result.replies.values()] == [True], result.replies
    check_epoch(replay_app.app, before, rt.snapshot(), result)
    for suffix, value in replay_app.SCENARIOS[scenario].items():
        assert rt.read_state("acct", f"{scenario}.{suffix}") == value, suffix
    if scenario == "finally_block":
        assert rt.read_items("s", scenario)["fin"] == 1


def test_r2_call_created_early(monkeypatch):
    """Repro r2: a send between creating a call and awaiting it is sent once; a read there is journaled once."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", False)
    rt = InProcessRuntime(replay_app.app, partitions=2)
    rt.load_items("s", "early_read", {"a": 1, "b": 2})
    result = rt.run_epoch([r for r in _requests() if r.function in ("early_send", "early_read")])
    values = {result.requests[t].function: serde.decode(r.value) for t, r in result.replies.items()}
    assert rt.read_state("acct", "early_send.C") == 10
    assert values == {"early_send": 0, "early_read": [1, 2, 0, 0]}


def test_both_ways_give_identical_effects(monkeypatch):
    """Live resume and journal replay: the same replies and the same state, for every partition count."""
    seen = set()
    for live in (False, True):
        monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
        for partitions in (1, 2, 4):
            rt = InProcessRuntime(replay_app.app, partitions=partitions)
            for (op, key), items in replay_app.initial_state().items():
                rt.load_items(op, key, items)
            out = _outcome(rt.run_epoch(_requests()))
            seen.add((tuple(sorted(out.items())), tuple(sorted(rt.snapshot().items()))))
    assert len(seen) == 1


class HoppingExchange(SparkExchange):
    """The Spark exchange's task function run here, each round in one of two simulated worker processes."""

    def __init__(self, *args, pick, **kw) -> None:
        super().__init__(*args, **kw)
        self.tables: list[dict] = [{}, {}]
        self.pick = pick
        self.n = 0

    def run_job(self, payloads):
        table = self.tables[self.pick(self.n)]
        self.n += 1
        saved = partition._LIVE
        partition._LIVE = table
        try:
            return list(self.fn(payloads))
        finally:
            partition._LIVE = saved


_PATTERNS = {
    "same-worker": lambda n: 0,
    "hop-after-first": lambda n: 0 if n == 0 else 1,
    "alternate": lambda n: n % 2,
    **{f"random-{seed}": (lambda rng: lambda n: rng.randrange(2))(random.Random(seed)) for seed in range(3)},
}


@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
@pytest.mark.parametrize("pattern", list(_PATTERNS))
def test_scenarios_through_spark_task_function(tmp_path, monkeypatch, pattern, live):
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    parts = 2
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=parts, local_dir=str(tmp_path / "local"),
                      **ROUND_BY_ROUND)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    reference = _reference()
    before = reference.snapshot()
    by_pid: dict[int, list] = {}
    for k, v in before.items():
        op, key, _ = split_store_key(k)
        by_pid.setdefault(partition_of(op, key, parts), []).append((k, v))
    for pid in range(parts):
        durable.write_base(pid, -1, sorted(by_pid.get(pid, [])))
    ex = HoppingExchange(None, "replay_app:app", cfg, pick=_PATTERNS[pattern])
    result = EpochCoordinator(replay_app.app, ex, sequencers=1).run_epoch(0, [(0, r) for r in _requests()])
    state: dict[bytes, bytes] = {}
    for pid in range(parts):
        state.update(durable.load(pid, 0)[0])
    after = dict(sorted(state.items()))
    check_epoch(replay_app.app, before, after, result)
    expected = reference.run_epoch(_requests())
    assert _outcome(result) == _outcome(expected)
    assert after == reference.snapshot()
    _check_expected(reference.read_state)
    assert ex.n > 3  # the calls really crossed partitions over several rounds


def test_r3_spark_hop(tmp_path):
    """Repro r3: the round resuming ``early_send`` lands in another worker than the one holding its coroutine."""
    parts = 2
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=parts, local_dir=str(tmp_path / "local"),
                      **ROUND_BY_ROUND)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(parts):
        durable.write_base(pid, -1, [])
    ex = HoppingExchange(None, "replay_app:app", cfg, pick=_PATTERNS["hop-after-first"])
    req = [r for r in _requests() if r.function == "early_send"]
    assert partition_of("s", "early_send", parts) != partition_of("acct", "early_send.B", parts)
    result = EpochCoordinator(replay_app.app, ex, sequencers=1).run_epoch(0, [(0, r) for r in req])
    state: dict[bytes, bytes] = {}
    for pid in range(parts):
        state.update(durable.load(pid, 0)[0])
    assert [r.ok for r in result.replies.values()] == [True]
    assert serde.decode(state[store_key("acct", "early_send.C")]) == 10


flaky_op = Operator("flaky")
_RUNS = {"reads": 0, "returns": 0}


@flaky_op.function
async def noop(ctx: Context) -> int:
    return 0


@flaky_op.function
async def reads_once(ctx: Context) -> int:
    """Reads only in its first run: a replay would serve later reads from the wrong journal entries."""
    _RUNS["reads"] += 1
    if _RUNS["reads"] == 1:
        ctx.get()
    await ctx.call(flaky_op, "x", noop)
    return ctx.get(default=0)


@flaky_op.function
async def returns_early(ctx: Context) -> int:
    """Suspends at a second call in its second run, returns without it in the third."""
    _RUNS["returns"] += 1
    await ctx.call(flaky_op, "x", noop)
    if _RUNS["returns"] <= 2:
        await ctx.call(flaky_op, "y", noop)
    return 0


flaky_app = Application("flaky", [flaky_op])


@pytest.mark.parametrize("fn", ["reads_once", "returns_early"])
def test_a_replay_that_diverges_aborts(monkeypatch, fn):
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", False)
    monkeypatch.setitem(_RUNS, "reads", 0)
    monkeypatch.setitem(_RUNS, "returns", 0)
    rt = InProcessRuntime(flaky_app, partitions=2)
    result = rt.run_epoch([Request("q", "flaky", "me", fn, serde.encode([]))])
    (reply,) = result.replies.values()
    assert (reply.ok, reply.error_type) == (False, "NonDeterministicFunction")
    assert rt.snapshot() == {}


# -- random programs: calls created early, awaited late, out of order, twice or never ---------------------
prog_op = Operator("p")


class Stop(Exception):
    pass


@prog_op.function
async def prog(ctx: Context, steps: list) -> list:
    """Interpret ``steps``; every value seen goes into the result, so any replay slip changes it."""
    calls: list = []
    seen: list = []
    for step in steps:
        kind = step[0]
        if kind == "call":
            calls.append(ctx.call(prog_op, step[1], prog, step[2]))
        elif kind == "await" and calls:
            seen.append(await calls[step[1] % len(calls)])
        elif kind == "gather" and calls:
            seen.append(await ctx.gather(*(calls[i % len(calls)] for i in step[1])))
        elif kind == "send":
            ctx.send(prog_op, step[1], prog, step[2])
        elif kind == "read":
            seen.append(ctx.get(default=0))
        elif kind == "write":
            ctx.put(ctx.get(default=0) + step[1])
        elif kind == "item":
            ctx.put_item(step[1], len(seen))
            seen.append(ctx.get_item(step[1]))
        elif kind == "scan":
            seen.append(len(ctx.scan_items()))
        elif kind == "rand":
            r = int(ctx.random() * 100)
            ctx.put_item("r", r)
            seen.append(r)
        elif kind == "raise" and ctx.get(default=0) % 3 == step[1]:
            raise Stop("stop")
    for c in calls:  # a call left unawaited aborts with UnawaitedCall (tested on its own: test_mistakes); beside
        await c  # another branch's error, which one a client sees is not ordered by the serial execution
    return seen


prog_app = Application("prog", [prog_op])


@st.composite
def programs(draw, pool: str, depth: int):
    steps: list = []
    gathered = 0
    for i in range(draw(st.integers(0, 7))):
        kind = draw(st.sampled_from(["call", "call", "await", "await", "gather", "send", "read", "write", "item",
                                     "scan", "rand", "raise"]))
        if kind in ("call", "send") and depth == 0:
            kind = "read"
        if kind == "call":
            # Calls awaited together run concurrently: each gets keys of its own (sequential awaits could share).
            sub = f"{pool}.{i}"
            steps.append(["call", f"{sub}-{draw(st.integers(0, 1))}", draw(programs(sub, depth - 1))])
        elif kind == "send":
            sub = f"{pool}.s{i}"
            steps.append(["send", f"{sub}-{draw(st.integers(0, 1))}", draw(programs(sub, depth - 1))])
        elif kind == "await":
            steps.append(["await", draw(st.integers(0, 5))])
        elif kind == "gather":
            gathered += 1
            steps.append(["gather", draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))])
        elif kind == "write":
            steps.append(["write", draw(st.integers(1, 3))])
        elif kind == "item":
            steps.append(["item", draw(st.sampled_from(["x", "y"]))])
        elif kind == "raise":
            steps.append(["raise", draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 9])
        else:
            steps.append([kind])
    return steps


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(
    batch=st.lists(st.tuples(st.integers(0, 3), programs("t", 3)), min_size=1, max_size=6),
    partitions=st.sampled_from([1, 2, 4]),
)
def test_random_programs_equal_the_oracle_both_ways(monkeypatch, batch, partitions):
    """Replay-only and live-coroutine runs give identical replies and state, equal to the serial oracle.

    Transactions share keys (conflicts, fallback); within one, calls awaited together and sends get keys
    of their own (concurrent branches).
    """
    outcomes = []
    for live in (False, True):
        monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
        rt = InProcessRuntime(prog_app, partitions=partitions)
        reqs = [Request(f"q{i}", "p", f"root-{k}", "prog", serde.encode([steps]), ts=10.0 + i)
                for i, (k, steps) in enumerate(batch)]
        before = rt.snapshot()
        result = rt.run_epoch(reqs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CaughtCalleeError)
            check_epoch(prog_app, before, rt.snapshot(), result)
        outcomes.append((_outcome(result), rt.snapshot()))
    assert outcomes[0] == outcomes[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(
    batch=st.lists(st.tuples(st.integers(0, 3), programs("t", 3)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    live=st.booleans(),
)
def test_random_programs_hopping_workers_equal_in_process(monkeypatch, batch, seed, live):
    """Through the Spark task function, each round in a random simulated worker: as in-process, as the oracle."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    reqs = [Request(f"q{i}", "p", f"root-{k}", "prog", serde.encode([steps]), ts=10.0 + i)
            for i, (k, steps) in enumerate(batch)]
    parts = 3
    with tempfile.TemporaryDirectory() as tmp:
        cfg = SparkConfig(data_dir=tmp, partitions=parts, local_dir=os.path.join(tmp, "local"),
                          **ROUND_BY_ROUND)
        durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
        for pid in range(parts):
            durable.write_base(pid, -1, [])
        rng = random.Random(seed)
        ex = HoppingExchange(None, "test_replay:prog_app", cfg, pick=lambda n: rng.randrange(2))
        result = EpochCoordinator(prog_app, ex, sequencers=1).run_epoch(0, [(0, r) for r in reqs])
        state: dict[bytes, bytes] = {}
        for pid in range(parts):
            state.update(durable.load(pid, 0)[0])
    reference = InProcessRuntime(prog_app, partitions=parts)
    expected = reference.run_epoch(reqs)
    assert _outcome(result) == _outcome(expected)
    assert dict(sorted(state.items())) == reference.snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaughtCalleeError)
        check_epoch(prog_app, {}, reference.snapshot(), expected)
