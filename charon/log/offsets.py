"""Offsets lists of an input log whose partition count grew: the one home of the padding rule.

An input log's physical partitions only grow (:meth:`charon.log.sqlite.InputLog.resize`), so an offsets list
written before a resize (an epoch record's ``ends``, a Spark offset-log entry) can be shorter than the log's
current one. A partition missing from an older list did not exist then: its offset was 0.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["pad_offsets", "pad_pair"]


def pad_offsets(offsets: Sequence[int], n: int) -> list[int]:
    """``offsets`` padded with 0s up to ``n`` entries; ``ValueError`` if it has more than ``n``."""
    if len(offsets) > n:
        raise ValueError(f"expected at most {n} offsets, got {len(offsets)}")
    return [int(o) for o in offsets] + [0] * (n - len(offsets))


def pad_pair(a: Sequence[int], b: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two offsets lists padded to the longer one's length (to compare or zip them)."""
    n = max(len(a), len(b))
    return pad_offsets(a, n), pad_offsets(b, n)
