"""The sequencer across input-log growth (:meth:`Sequencer.resize`): TIDs strictly increase from epoch to
epoch through any grow sequence, and replaying from any epoch's record gives the same TIDs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charon.core.sequencer import Sequencer


def run(seq: Sequencer, n: int, arrivals: list[int]) -> list[int]:
    """One epoch over ``n`` log partitions: grow first, assign one TID per arrival (its partition), balance."""
    seq.resize(n)
    tids = [seq.assign(p % n) for p in arrivals]
    seq.end_epoch()
    return tids


epochs = st.lists(
    st.tuples(st.integers(1, 4), st.lists(st.integers(0, 63), max_size=30)), min_size=1, max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(epochs)
def test_tids_increase_across_grows_and_replay_from_any_record_agrees(plan: list[tuple[int, list[int]]]) -> None:
    n = 1
    counts = []
    for grow, _ in plan:  # physical partitions only grow: each epoch's count >= the previous one
        n += grow - 1 if grow > 1 else 0
        counts.append(n)
    seq = Sequencer(counts[0])
    records, all_tids = [], []
    for n, (_, arrivals) in zip(counts, plan, strict=True):
        tids = run(seq, n, arrivals)
        assert len(set(tids)) == len(tids)
        earlier = [t for ts in all_tids for t in ts]
        if earlier and tids:
            assert min(tids) > max(earlier), "a new TID below an earlier one"
        assert seq.first_tid() > max(tids, default=0)
        all_tids.append(tids)
        records.append(list(seq.counters))
    for e in range(len(plan) - 1):  # replay epochs e+1.. from epoch e's record
        again = Sequencer.restore(records[e])
        for k in range(e + 1, len(plan)):
            assert run(again, counts[k], plan[k][1]) == all_tids[k]
            assert again.counters == records[k]


def test_resize_rebases_and_refuses_to_shrink() -> None:
    seq = Sequencer(2, [5, 5])  # highest earlier TID: 2 + 4*2 = 10
    seq.resize(3)
    assert seq.counters == [4, 4, 4] and seq.assign(0) == 13 > 10  # ceil(10/3) = 4 -> 1 + 4*3
    with pytest.raises(ValueError):
        seq.resize(2)
    seq.resize(3)  # same count: unchanged
    assert seq.counters == [5, 4, 4]
    assert Sequencer.restore([7, 7, 7], 3.5).n == 3 and Sequencer.restore([7], 3.5).time == 3.5
