"""One comparison of two runs of the same epoch (tests that run an epoch two ways and expect one outcome)."""

from __future__ import annotations

from typing import Any


def assert_same_outcome(got: Any, want: Any) -> None:
    """The two :class:`~charon.core.epoch.EpochResult` s replied the same (status, value, error type and place in
    the serial order per TID) and committed the same transactions by the same paths."""
    assert {t: (r.ok, r.value, r.error_type, r.position) for t, r in got.replies.items()} == {
        t: (r.ok, r.value, r.error_type, r.position) for t, r in want.replies.items()}
    assert (got.lockfree, got.fast, got.slow, got.deferred) == (want.lockfree, want.fast, want.slow, want.deferred)
