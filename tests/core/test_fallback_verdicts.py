"""A verdict taken in the middle of the fallback (a function stopped past its budget) is replay-exact.

Live, a run of the judged transaction reports the verdict in some round r of its chunk's fallback; a replay (a rerun
of the epoch after a crash) knows the verdict from the start. Which transactions the fallback commits, aborts or
defers depends on when each leaves the lock queues, so the replay must judge it in round r too
(``Verdict.in_round``, ``EpochCoordinator._judged_here``): judged before the fallback starts, it freed its queue
places earlier and a transaction that committed live was deferred to the next epoch (a contradicted reply). Here
every epoch runs live with overruns injected (``partition.Interrupt`` raised in the function, as the watchdog and the
simulator do), then again with the recorded verdicts and no overrun, on fresh partitions: the replies (ok, value,
error, epoch, position) and the deferrals must be the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from charon import Application, Context, Operator, Request, serde
from charon.core import partition
from charon.core.epoch import EpochCoordinator, EpochResult, FallbackJob, FallbackOutcome, Verdict, run_fallback
from charon.core.partition import PartitionUnit
from charon.runtime.node.inprocess import LocalExchange
from charon.state.store import MemoryStore
from charon.testing import check_epoch

acct = Operator("acct")
KEYS = ["c", "a0", "a1", "a2", "x", "y"]


@dataclass
class Overruns:
    """Which function starts overrun their budget: by tag, the starts (1, 2, ...) counted in the chosen phases and
    epochs (``after``: that start and every later one too)."""

    starts: dict[str, int] = field(default_factory=dict)
    after: bool = True
    dry: bool = False  # also in the dry run (else only in the fallback)
    epoch: int | None = None  # only in this epoch
    coord: EpochCoordinator | None = None
    counts: dict[str, int] = field(default_factory=dict)
    fired: int = 0

    def check(self, tag: str) -> None:
        c = self.coord
        if tag not in self.starts or c is None or c.current is None or not (c.phase == 1 or self.dry):
            return
        if self.epoch is not None and c.current.epoch != self.epoch:
            return
        n = self.counts[tag] = self.counts.get(tag, 0) + 1
        if n == self.starts[tag] or (self.after and n > self.starts[tag]):
            self.fired += 1
            raise partition.Interrupt


PLAN = Overruns()


@acct.function
async def add(ctx: Context, d: int, tag: str = "") -> int:
    PLAN.check(tag)
    v = ctx.get(default=0) + d
    ctx.put(v)
    return v


@acct.function
async def bump(ctx: Context, tag: str = "") -> int:
    """A counter whose value picks the account it calls: a re-run may step outside its known set."""
    PLAN.check(tag)
    n = ctx.get(default=0)
    ctx.put(n + 1)
    return await ctx.call(acct, f"a{n % 3}", "add", 1)


@acct.function
async def transfer(ctx: Context, to: str, amt: int, tag: str = "") -> int:
    PLAN.check(tag)
    v = ctx.get(default=0)
    ctx.put(v - amt)
    return await ctx.call(acct, to, "add", amt, tag)


app = Application("fallback_verdicts", [acct])


class OneTask(LocalExchange):
    """The whole fallback at once where the units are (as a Spark task runs it): its verdicts return with it."""

    def fallback(self, job: FallbackJob) -> FallbackOutcome:
        return run_fallback(app, LocalExchange(self.units), job)
Outcome = list[tuple[str, bool, bytes, str, int, int]]


def req(rid: str, key: str, fn: str, *args: object) -> Request:
    return Request(rid, "acct", key, fn, serde.encode(list(args)), 1.0)


def run(epochs: list[list[Request]], plan: Overruns | None, verdicts: dict[str, Verdict] | None = None,
        parts: int = 1, oracle: bool = False, exchange: type[LocalExchange] = LocalExchange,
        ) -> tuple[list[Outcome], list[list[str]], dict[str, Verdict]]:
    """Run ``epochs`` on fresh partitions, with ``plan``'s overruns (None: none) and ``verdicts`` known from the
    start (a replay): each epoch's replies and deferred request ids, and the verdicts taken."""
    global PLAN
    PLAN = plan if plan is not None else Overruns()
    stores = [MemoryStore() for _ in range(parts)]
    coord = EpochCoordinator(app, exchange([PartitionUnit(p, parts, app, s) for p, s in enumerate(stores)]))
    PLAN.coord = coord
    taken: dict[str, Verdict] = {}
    coord.on_verdict = lambda r, v, e: taken.__setitem__(r.request_id, v)
    if verdicts:
        coord.verdicts = dict(verdicts)
    replies, deferred = [], []
    try:
        for e, reqs in enumerate(epochs):
            before = {k: v for s in stores for k, v in s.data.items()}
            res: EpochResult = coord.run_epoch(e, [(0, r) for r in reqs])
            if oracle:
                check_epoch(app, before, {k: v for s in stores for k, v in s.data.items()}, res,
                            verdicts=coord.verdicts)
            replies.append(sorted((r.request_id, r.ok, r.value, r.error_type, r.epoch, r.position)
                                  for r in res.replies.values()))
            deferred.append(sorted(res.requests[t].request_id for t in res.deferred))
    finally:
        PLAN = Overruns()
    return replies, deferred, taken


def judged_final(replies: list[Outcome], taken: dict[str, Verdict]) -> None:
    """A verdict is final in the run that took it: the transaction's only reply is its error."""
    got = {rid: (ok, etype) for rs in replies for rid, ok, _, etype, _, _ in rs}
    for rid, v in taken.items():
        assert got.get(rid) == (False, v.error_type), (rid, v, got.get(rid))


# A0 writes the counter c; L (bump) re-runs in the fallback on the new count and steps outside its known set onto
# a1; T is queued behind L on c and overruns in its re-run; H waits behind T on x and touches a1. Live, L's re-run
# commits before H runs (H waits for T); judged before the fallback, T frees x at once, H commits first and L
# (stepping onto what H decided) is deferred.
SCENARIO = [req("A0", "c", "add", 1), req("L", "c", "bump"), req("T", "x", "transfer", "c", 1, "T"),
            req("H", "x", "transfer", "a1", 1)]


def test_a_verdict_in_a_late_fallback_round_replays_with_the_same_replies() -> None:
    replies, deferred, taken = run([SCENARIO], Overruns({"T": 3}), oracle=True)  # its re-run's root
    v = taken["T"]
    assert v.fallback and v.in_round is not None and v.in_round > 0, v
    assert v.epoch == 0
    judged_final(replies, taken)
    by_id = {r[0]: r for r in replies[0]}
    assert by_id["L"][1] and by_id["H"][1] and deferred == [[]], (replies, deferred)
    again = run([SCENARIO], None, taken, oracle=True)
    assert again[:2] == (replies, deferred), "the replay gives every reply as the live run did"
    # the rule this replaces (judged before the fallback starts) contradicts the live replies here
    old = run([SCENARIO], None, {"T": v._replace(in_round=None)})
    assert old[1] == [["L"]] and old[0] != replies


def test_a_verdict_is_final_in_the_run_that_took_it() -> None:
    """Stopped once in its locked re-run's callee (its 4th tagged start: the cached replay of root and callee, then
    the re-run's root came first), the transaction is never re-run to an ok reply after its verdict (pinned before
    only by simulator seeds 1598/2534)."""
    replies, deferred, taken = run([SCENARIO], Overruns({"T": 4}, after=False))
    assert set(taken) == {"T"} and taken["T"].fallback
    judged_final(replies, taken)
    assert run([SCENARIO], None, taken)[:2] == (replies, deferred)


def test_a_cached_replay_stopped_past_its_budget_is_judged_in_its_round() -> None:
    """A cached replay (the fast path) stopped past its budget used to only leave the fast path: its transaction
    re-ran later, a schedule no replay could follow (here: a transaction committed live, deferred replayed). It
    is judged now, in that round, and a replay judges it there too."""
    epoch = [req("r0", "c", "bump"), req("r1", "a0", "transfer", "a1", 1, "T"), req("r2", "c", "bump"),
             req("r3", "a1", "transfer", "a2", 1), req("r4", "c", "bump")]
    replies, deferred, taken = run([epoch], Overruns({"T": 1}, after=False), oracle=True)
    assert set(taken) == {"r1"} and taken["r1"].fallback and taken["r1"].in_round is not None
    judged_final(replies, taken)
    assert run([epoch], None, taken, oracle=True)[:2] == (replies, deferred)


def workload(rng: random.Random, prefix: str, tag: str | None) -> list[Request]:
    """A few conflicting transfers, counters and adds over six keys; ``tag`` marks one transaction (None: each its own
    request id)."""
    n = rng.randint(3, 8)
    marked = rng.randrange(n)
    reqs = []
    for i in range(n):
        t = (tag if i == marked else "") if tag is not None else f"{prefix}{i}"
        fn = rng.choice(["add", "bump", "transfer", "transfer"])
        if fn == "add":
            reqs.append(req(f"{prefix}{i}", rng.choice(KEYS), "add", 1, t))
        elif fn == "bump":
            reqs.append(req(f"{prefix}{i}", "c", "bump", t))
        else:
            reqs.append(req(f"{prefix}{i}", rng.choice(KEYS), "transfer", rng.choice(KEYS), 1, t))
    return reqs


@pytest.mark.parametrize("exchange", [LocalExchange, OneTask])
@pytest.mark.parametrize("parts", [1, 2])
def test_random_workloads_with_a_verdict_in_the_fallback_replay_exactly(parts: int, exchange: type) -> None:
    late = contradicted = 0
    for seed in [*range(300), 659, 1178, 1355, 1470, 1835]:  # (the last ones: where the old rule contradicts)
        rng = random.Random(seed)
        epoch = workload(rng, "r", "T")
        plan = Overruns({"T": rng.randint(1, 4)}, after=rng.random() < 0.5)
        replies, deferred, taken = run([epoch], plan, parts=parts, oracle=True, exchange=exchange)
        judged_final(replies, taken)
        # replayed with the same budgets (a Spark rerun keeps them): the judged step never runs again in its round
        again = Overruns(dict(plan.starts), after=plan.after)
        assert run([epoch], again, taken, parts=parts, exchange=exchange)[:2] == (replies, deferred), f"seed {seed}"
        assert again.fired == 0, f"seed {seed}"
        assert bool(plan.fired) == bool(taken), f"seed {seed}: every overrun is a verdict (a cached replay's too)"
        for rid, v in taken.items():
            if v.fallback and v.in_round:
                late += 1
                old = run([epoch], None, {rid: v._replace(in_round=None)}, parts=parts, exchange=exchange)
                contradicted += old[:2] != (replies, deferred)
    assert late >= 40, "verdicts in a fallback round after the first"
    assert contradicted >= 2, "judging before the fallback would contradict some live replies"


def test_a_verdict_taken_in_a_later_epoch_leaves_the_earlier_one_as_it_ran() -> None:
    """A transaction deferred by epoch 0 and judged in epoch 1 ran in epoch 0 (it conflicted, was deferred): a
    replay of epoch 0 must not apply the verdict there (it used to refuse it in epoch 0, or judge it in its
    fallback: its reply then came from another epoch, and the others' outcomes could change)."""
    cases = 0
    for seed in range(400):
        rng = random.Random(seed)
        dry = rng.random() < 0.5
        e0, e1 = workload(rng, "r", None), workload(rng, "z", None)
        live0 = run([e0], None)
        if not live0[1][0]:
            continue
        plan = Overruns({rid: 1 for rid in live0[1][0]}, dry=dry, epoch=1)
        replies, deferred, taken = run([e0, e1], plan, oracle=True)
        cases += any(v.epoch == 1 for rid, v in taken.items() if rid in live0[1][0])
        judged_final(replies, taken)
        assert run([e0, e1], None, taken, oracle=True)[:2] == (replies, deferred), f"seed {seed}"
    assert cases >= 10


def test_verdict_scope() -> None:
    dry, fb, legacy = Verdict("E", "m", False, None, 3), Verdict("E", "m", True, 2, 3), Verdict("E", "m", True)
    assert [dry.refuses(e) for e in (2, 3, 4)] == [False, True, True]
    assert [fb.refuses(e) for e in (2, 3, 4)] == [False, False, True]
    assert [fb.judges_fallback(e) for e in (2, 3, 4)] == [False, True, False]
    assert legacy.judges_fallback(7) and not legacy.refuses(7) and Verdict("E", "m").refuses(0)


def test_a_rerun_judging_anew_never_commits_a_transaction_beside_its_fallback_verdict() -> None:
    """A rerun of an epoch that provably replied nothing takes new verdicts: here in the dry run, on the two lower
    writers T conflicted with, so T has no conflict any more and the lock-free decision would commit it beside the
    verdict the first run took in its fallback (simulator seed 1019). It is aborted with its verdict there; a replay
    with every verdict gives the rerun's replies."""
    epoch = [req("A0", "c", "add", 1, "A"), req("L", "c", "bump", "L"), *SCENARIO[2:]]
    first = run([epoch], Overruns({"T": 3}))[2]
    assert set(first) == {"T"} and first["T"].fallback
    replies, deferred, taken = run([epoch], Overruns({"A": 1, "L": 1}, dry=True), first, oracle=True)
    assert set(taken) == {"A0", "L"} and not taken["A0"].fallback
    judged_final(replies, {**first, **taken})
    assert {r[0]: r[4:] for r in replies[0]}["T"] == (0, 3), "aborted at its place among the lock-free outcomes"
    assert run([epoch], None, {**first, **taken}, oracle=True)[:2] == (replies, deferred)
