"""Differential tests of the engine's hot paths against the serial oracle (adversarial review of the
frame-is-message / lazy call-graph cache / carried-finalize changes).

Plans (see review3_app.py) mix calls created early and awaited late with reads/writes/sends between, gathers,
re-entrant calls, ctx.random()/now() decisions, unencodable values, bad call targets and aborts in callees.
Each epoch is checked against a serial execution in the reported order (charon.testing.check_epoch), in the
in-process runtime (live coroutines and journal replay), through pickled Spark rounds, and across a rescale.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from epochcmp import assert_same_outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from review3_app import app  # tests/support is on sys.path

from charon import InProcessRuntime, Request, serde
from charon.core import partition
from charon.testing import check_epoch

pytestmark = pytest.mark.usefixtures("fresh_means_empty")  # see conftest.py

EXAMPLES = int(os.environ.get("CHARON_DIFF_EXAMPLES", "150"))
BAD = ["unencodable", "badkey", "badargs", "badret", "fail"]
CHUNKS = [0, 1, 2, 5, None]  # transactions per chunk of an epoch (None: the default, more than these epochs hold)


@st.composite
def plans(draw, pool: str, depth: int, path: str = "", sent: bool = False, bad: str = "fail"):
    """``sent``: the plan of a sent invocation (no unencodable return: see test_unencodable_return_of_a_send).
    ``bad``: the one kind of error this transaction may raise (concurrent branches may each raise; which one the
    client sees is not defined by the serial order, only the error's type is compared)."""
    bad_steps = [] if sent and bad == "badret" else [bad]
    steps = []
    n_early = 0
    for i in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["get", "put", "item", "call", "early", "early", "await", "gather", "send",
                                     "rand", "bad", "dyn", "cond"]))
        if kind in ("call", "early", "send", "dyn", "cond") and depth <= 0:
            kind = "put"
        if kind == "put":
            steps.append(["put", draw(st.integers(1, 4))])
        elif kind == "item":
            steps.append(["item", f"i{draw(st.integers(0, 2))}", draw(st.integers(0, 3))])
        elif kind in ("call", "dyn", "cond"):  # sequential: the same pool (may be re-entrant on the caller)
            key = f"{pool}-{draw(st.integers(0, 2))}"
            sub_plan = draw(plans(pool, depth - 1, f"{path}{i}.", bad=bad))
            steps.append([kind, draw(st.sampled_from("ab")), key, sub_plan])
        elif kind in ("early", "send"):  # may run concurrently with siblings: its own pool
            sub = f"{kind[0]}{path}{i}"
            key = f"{sub}-{draw(st.integers(0, 1))}"
            sub_plan = draw(plans(sub, depth - 1, f"{path}{i}.", sent=kind == "send", bad=bad))
            steps.append([kind, draw(st.sampled_from("ab")), key, sub_plan])
            n_early += kind == "early"
        elif kind == "bad":
            if bad_steps and draw(st.integers(0, 5)) == 0:
                steps.append(bad_steps)
        else:
            steps.append([kind])
    if n_early and draw(st.booleans()):
        steps.append([draw(st.sampled_from(["await", "gather"]))])
    return steps


@st.composite
def transactions(draw):
    bad = draw(st.sampled_from(BAD))
    return draw(st.sampled_from("ab")), f"r-{draw(st.integers(0, 2))}", draw(plans("r", draw(st.integers(0, 3)),
                                                                                   bad=bad))


def _requests(batch, start: int) -> list[Request]:
    return [Request(f"q{start + i}", op, key, "node", serde.encode([plan]), ts=1000.0 + start + i)
            for i, (op, key, plan) in enumerate(batch)]


def _run_checked(rt: InProcessRuntime, reqs: list[Request]) -> None:
    before = rt.snapshot()
    result = rt.run_epoch(reqs)
    check_epoch(app, before, rt.snapshot(), result)


COMMON = settings(max_examples=EXAMPLES, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@COMMON
@given(epochs=st.lists(st.lists(transactions(), min_size=1, max_size=20), min_size=1, max_size=3),
       partitions=st.sampled_from([1, 2, 3]), live=st.booleans(), chunk=st.sampled_from(CHUNKS))
def test_inprocess_equals_serial(epochs, partitions, live, chunk, monkeypatch):
    """Every epoch equals the serial execution in its reported order, live coroutines or journal replay, whole or
    in chunks."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt = InProcessRuntime(app, partitions=partitions)
    if chunk is not None:
        rt.coordinator.chunk = chunk
    n = 0
    for batch in epochs:
        _run_checked(rt, _requests(batch, n))
        n += len(batch)
    while rt.coordinator.deferred:
        _run_checked(rt, [])


@COMMON
@given(epochs=st.lists(st.lists(transactions(), min_size=1, max_size=15), min_size=2, max_size=4),
       at=st.integers(1, 3), sizes=st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 4, 5])))
def test_rescale_between_epochs_equals_serial(epochs, at, sizes):
    """A rescale (key group -> partition map changes) between epochs: later epochs still equal the oracle."""
    rt = InProcessRuntime(app, partitions=sizes[0])
    n = 0
    for i, batch in enumerate(epochs):
        if i == at:
            asyncio.run(rt.rescale(sizes[1]))
        _run_checked(rt, _requests(batch, n))
        n += len(batch)
    while rt.coordinator.deferred:
        _run_checked(rt, [])


@pytest.mark.parametrize("plan, error", [
    ([["unencodable"]], "SerializationError"),
    ([["put", 1], ["badret"]], "SerializationError"),
    ([["badkey"]], "InvalidKey"),
    ([["badargs"]], "BadArguments"),
    ([["call", "b", "x-0", [["put", 2], ["unencodable"]]]], "SerializationError"),
    ([["early", "b", "x-1", [["put", 1]]], ["put", 3], ["send", "a", "y-0", [["put", 1]]], ["unencodable"]],
     "SerializationError"),
])
@pytest.mark.parametrize("live", [False, True])
def test_typed_errors_abort_only_their_transaction(plan, error, live, monkeypatch):
    """A typed error raised in a function (or its callee) aborts that transaction with that type; its
    neighbours in the epoch commit; a contended epoch (cached fallback) gives the same."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt = InProcessRuntime(app, partitions=2)
    reqs = [Request("bad", "a", "r-0", "node", serde.encode([plan]))]
    reqs += [Request(f"ok{i}", "a", "r-0", "node", serde.encode([[["put", 1], ["call", "b", "x-0", [["put", 1]]]]]))
             for i in range(4)]
    before = rt.snapshot()
    result = rt.run_epoch(reqs)
    check_epoch(app, before, rt.snapshot(), result)
    by_req = {r.request_id: result.replies[t] for t, r in result.requests.items()}
    assert by_req["bad"].ok is False and by_req["bad"].error_type == error, by_req["bad"]
    assert all(by_req[f"ok{i}"].ok for i in range(4))


def _pickled_coordinator(tmp: str, parts: int, one_task: bool):
    from charon.config import SparkConfig
    from charon.core.epoch import EpochCoordinator
    from charon.runtime.spark.exchange import SparkExchange
    from charon.state.durable import DurableState

    class LocalJobExchange(SparkExchange):
        """The Spark exchange with its job run here (payloads and results pickled as on Spark)."""

        def run_job(self, payloads):  # noqa: ANN001, ANN202
            return list(self.fn(payloads))

    cfg = SparkConfig(data_dir=tmp, partitions=parts, local_dir=os.path.join(tmp, "local"),
                      single_task_rest=one_task, single_task_fallback=one_task)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(parts):
        durable.write_base(pid, -1, [])
    return EpochCoordinator(app, LocalJobExchange(None, "review3_app:app", cfg), sequencers=1), durable


@settings(max_examples=max(EXAMPLES // 5, 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(epochs=st.lists(st.lists(transactions(), min_size=1, max_size=15), min_size=1, max_size=3),
       parts=st.sampled_from([1, 2, 3]), live=st.booleans(), one_task=st.booleans(), chunk=st.sampled_from(CHUNKS))
def test_pickled_rounds_equal_inprocess(epochs, parts, live, one_task, chunk, monkeypatch, tmp_path_factory):
    """The Spark task function through pickled rounds (frames, journals, cache pickled; ``kg`` dropped) gives
    the in-process runtime's replies, commit paths and state, whole epochs or in chunks (one task runs them all)."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    tmp = str(tmp_path_factory.mktemp("pickled"))
    coord, durable = _pickled_coordinator(tmp, parts, one_task)
    reference = InProcessRuntime(app, partitions=parts)
    if chunk is not None:
        coord.chunk = reference.coordinator.chunk = chunk
    n = 0
    epoch = 0
    for batch in epochs + [[]] * 3:
        reqs = _requests(batch, n)
        n += len(batch)
        got = coord.run_epoch(epoch, [(0, r) for r in reqs])
        want = reference.run_epoch(reqs)
        assert_same_outcome(got, want)
        epoch += 1
    state: dict[bytes, bytes] = {}
    for pid in range(parts):
        state.update(durable.load(pid, epoch - 1)[0])
    assert dict(sorted(state.items())) == reference.snapshot()


def test_unencodable_return_of_a_send():
    """A sent function returning an int too big for msgpack: its return value goes nowhere, so it is not encoded
    and the transaction commits, as in the serial oracle (the engine used to abort it with SerializationError)."""
    rt = InProcessRuntime(app, partitions=1)
    _run_checked(rt, [Request("q", "a", "r-0", "node", serde.encode([[["send", "a", "s0-0", [["badret"]]]]]))])


@pytest.mark.parametrize("live", [False, True])
def test_gather_of_many_with_an_early_call_awaited_last(live, monkeypatch):
    """One gather of 300 calls (some on the same entity as others: they run one after another there), then a
    call created before the gather and awaited after it, with a send and a write in between; contended by a
    second transaction on the same root (so the call-graph-cached fallback replays it)."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    many = [["early", "b", f"g{i}-0", [["put", 1], ["get"]]] for i in range(300)]
    plan = [["early", "a", "late-0", [["put", 5]]], ["put", 1], *many[:150], ["send", "a", "s-0", [["put", 2]]]]
    plan = [*plan, *many[150:], ["gather"]]  # the gather awaits the late call too: it is in the same list
    rt = InProcessRuntime(app, partitions=3)
    reqs = _requests([("a", "r-0", plan), ("a", "r-0", [["put", 2], ["call", "b", "g7-0", [["get"]]]]),
                      ("a", "r-0", plan)], 0)
    _run_checked(rt, reqs)
    while rt.coordinator.deferred:
        _run_checked(rt, [])
    assert rt.read_state("b", "g299-0") == 2 and rt.read_state("a", "late-0") == 10


def test_unhashable_call_target_is_a_typed_error():
    """One-line reproduction: ``await ctx.call(["a"], "k", "node", [])`` (plan step ["listop"])."""
    rt = InProcessRuntime(app, partitions=1)
    result = rt.run_epoch([Request("q", "a", "r-0", "node", serde.encode([[["listop"]]]))])
    (rep,) = result.replies.values()
    assert not rep.ok and rep.error_type in ("UnknownOperator", "UnknownFunction", "InvalidKey"), rep
