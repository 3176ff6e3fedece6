"""Each rule of the fallback's lock queues (``charon.core.epoch._Queues``), one test per invariant.

The generated workloads (tests/core/test_lock_queues.py, tests/core/test_lock_queues_adversarial.py) check the outcome
against the serial oracle; these pin the rules themselves, so that breaking one fails a test that names it:
TID order per entity, readers share, a higher holder blocks a lower re-queued transaction, the three checks of
:meth:`_Queues.clear` for a run that stepped outside its known set, re-queues growing the set in TID order,
deferral releasing without an outcome, and candidates chaining only behind candidates.
"""

from __future__ import annotations

from charon.core.epoch import _Queues, _within

A, B, C = ("op", "a"), ("op", "b"), ("op", "c")
R, W = False, True


def _q(**sets: dict) -> _Queues:
    return _Queues({int(t[1:]): dict(s) for t, s in sets.items()})


def test_writers_on_one_entity_run_in_tid_order() -> None:
    q = _q(t1={A: W}, t2={A: W}, t3={A: W})
    assert q.grant({1, 2, 3}, set()) == ([], [1])
    dirty = q.resolve(1, {A: W}, 0, True, set())
    assert q.grant(dirty | {3}, set()) == ([], [2])
    assert q.grant(q.resolve(2, {A: W}, 1, True, set()), set()) == ([], [3])


def test_readers_share_and_a_writer_waits_for_them() -> None:
    q = _q(t1={A: R}, t2={A: R}, t3={A: W}, t4={A: R})
    assert q.grant({1, 2, 3, 4}, set()) == ([], [1, 2])
    dirty = q.resolve(1, {A: R}, 0, True, set())
    assert q.grant(dirty, set()) == ([], []), "the writer waits for every lower reader"
    assert q.grant(q.resolve(2, {A: R}, 0, True, set()), set()) == ([], [3])
    assert q.grant({4}, set()) == ([], []), "a reader behind a writer waits for it"
    assert q.grant(q.resolve(3, {A: W}, 1, True, set()), set()) == ([], [4])


def test_disjoint_sets_run_together() -> None:
    q = _q(t1={A: W}, t2={B: W}, t3={A: W, B: R})
    assert q.grant({1, 2, 3}, set()) == ([], [1, 2])


def test_a_higher_holder_blocks_a_lower_transaction_requeued_onto_its_entity() -> None:
    q = _q(t1={A: W}, t2={B: W})
    assert q.grant({1, 2}, set()) == ([], [1, 2])
    touched = {A: W, B: R}  # 1's re-run stepped onto b, which 2 holds (writing)
    assert not _within(touched, q.K[1])
    assert not q.clear(1, touched, 0), "a higher holder of b started before 1's read"
    assert q.settled_below(1, touched)
    dirty = q.requeue(1, touched, set())
    assert q.queues[B] == [1, 2] and q.K[1] == {A: W, B: R}
    assert q.grant(dirty, set()) == ([], []), "1 waits while 2 holds b"
    assert not q.clear(2, {B: W}, 0), "1 is lower, queued on b and conflicting: 2 runs after it"
    dirty = q.requeue(2, None, set())
    assert q.grant(dirty | {1}, set()) == ([], [1])


def test_clear_refuses_an_entity_a_higher_outcome_wrote() -> None:
    q = _q(t1={A: R}, t2={A: R, B: W})
    assert q.grant({1, 2}, set()) == ([], [1, 2])
    q.resolve(2, {A: R, B: W}, 0, True, set())
    assert not q.clear(1, {A: R, B: R}, 5), "1 read b after a higher outcome wrote it"
    assert not q.settled_below(1, {A: R, B: R}), "so 1 moves to the next epoch"
    assert q.clear(1, {A: R}, 5), "reads shared with a higher outcome are fine"


def test_clear_refuses_writing_what_a_higher_outcome_read_even_an_abort() -> None:
    q = _q(t1={A: W}, t2={B: R}, t3={C: R})
    q.grant({1, 2, 3}, set())
    q.resolve(2, {B: R}, 0, False, set())  # an abort's outcome depends on what it read too
    assert not q.clear(1, {A: W, B: W}, 0)
    assert q.clear(1, {A: W, B: R}, 0), "reading what a higher outcome read is fine"
    q.resolve(3, {C: R}, 0, True, set())
    assert not q.clear(1, {A: W, C: W}, 0)


def test_clear_refuses_an_entity_written_by_a_commit_decided_since_the_run_started() -> None:
    q = _q(t1={A: W}, t2={B: W})
    q.grant({1, 2}, set())
    q.resolve(1, {A: W, C: W}, 3, True, set())  # 1 committed a write to c (outside its set) in round 3
    assert not q.clear(2, {B: W, C: R}, 3), "2's run started in round 3: its read of c may predate 1's write"
    assert not q.clear(2, {B: W, C: R}, 2)
    assert q.clear(2, {B: W, C: R}, 4), "started after the write was applied: it read it"


def test_an_aborted_write_is_not_a_committed_write() -> None:
    q = _q(t1={A: W}, t2={B: W})
    q.grant({1, 2}, set())
    q.resolve(1, {A: W, C: W}, 3, False, set())  # aborted: its writes were never applied
    assert q.clear(2, {B: W, C: R}, 2)


def test_clear_refuses_an_entity_a_lower_unresolved_transaction_is_queued_on() -> None:
    q = _q(t1={A: W}, t2={B: W}, t3={C: R})
    q.grant({1, 2, 3}, set())
    assert not q.clear(2, {B: W, A: R}, 0), "1 writes a and has not run yet"
    assert q.clear(2, {B: W, C: R}, 0), "1 is not on c, and 3 (higher) only reads it"
    assert not q.clear(2, {B: W, C: W}, 0), "3 (higher) holds c and read it before 2's write"


def test_a_run_outside_its_set_onto_free_entities_commits_at_once() -> None:
    q = _q(t1={A: W}, t2={A: W})
    assert q.grant({1, 2}, set()) == ([], [1])
    touched = {A: W, C: W}
    assert not _within(touched, q.K[1])
    assert q.clear(1, touched, 0)


def test_requeue_grows_the_set_in_tid_order_and_upgrades_reads() -> None:
    q = _q(t1={A: R}, t3={B: W}, t5={B: R})
    q.grant({1, 3, 5}, set())
    q.requeue(1, {A: W, B: R}, set())
    assert q.queues[B] == [1, 3, 5]
    assert q.K[1] == {A: W, B: R}
    q.requeue(1, {B: W}, set())
    assert q.K[1][B] is True and q.queues[B] == [1, 3, 5]


def test_deferral_releases_the_locks_without_an_outcome() -> None:
    q = _q(t1={A: W}, t2={A: W})
    q.grant({1, 2}, set())
    dirty = q.resolve(1, {}, 0, False, set())
    assert 1 not in q.unresolved and q.queues[A] == [2]
    assert q.grant(dirty, set()) == ([], [2])
    assert q.clear(2, {A: W}, 0), "a deferred transaction decided nothing"


def test_candidates_chain_only_behind_candidates_starting_in_the_same_round() -> None:
    q = _q(t1={A: W}, t2={A: W}, t3={A: W})
    assert q.grant({1, 2, 3}, {1, 2, 3}) == ([1, 2, 3], [])
    q = _q(t1={A: W}, t2={A: W}, t3={A: W})
    assert q.grant({1, 2, 3}, {1, 3}) == ([1], []), "3 waits behind the non-candidate 2"
    q = _q(t1={A: W}, t2={A: W})
    assert q.grant({1}, set()) == ([], [1])
    assert q.grant({2}, {2}) == ([], []), "a candidate does not chain behind a running re-run"


def test_a_replay_behind_a_failed_chain_member_is_refused() -> None:
    q = _q(t1={A: W}, t2={A: R})
    cands = {1, 2}
    assert q.grant({1, 2}, cands) == ([1, 2], [])
    q.requeue(1, None, cands)  # 1's replay was invalid somewhere: 2 read its write in the fast layer
    assert not q.clear(2, q.K[2], None)


def test_a_fallback_that_never_decides_fails_loudly_instead_of_hanging(monkeypatch) -> None:
    """The fallback's round cap: a (deliberately broken) queue that never clears a re-run raises, it does not spin."""
    import pytest

    from charon import Application, Context, InProcessRuntime, Operator, Request, serde
    from charon.core import epoch as epoch_mod

    acct = Operator("acct")

    @acct.function
    async def bump(ctx: Context, other: str) -> int:
        v = ctx.get(default=0) + 1
        ctx.put(v)
        if other:
            await ctx.call(acct, other, "bump", "")
        return v

    app = Application("cap", [acct])
    rt = InProcessRuntime(app, partitions=2, max_invocations=4)
    monkeypatch.setattr(epoch_mod._Queues, "clear", lambda self, tid, touched, start: False)
    monkeypatch.setattr(epoch_mod._Queues, "settled_below", lambda self, tid, touched: True)
    reqs = [Request(f"r{i}", "acct", "a", "bump", serde.encode(["b"])) for i in range(3)]
    with pytest.raises(RuntimeError, match="the fallback made no progress"):
        rt.run_epoch(reqs)
