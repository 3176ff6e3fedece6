"""Fixtures shared by test modules (each module opts in)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from charon.core.partition import PartitionUnit

# What PartitionUnit._clear resets: all of it must be empty while the unit says its scratch is fresh.
_SCRATCH = ("buffers", "frames", "touched", "cache", "_clog", "overlay", "dead", "emits", "emitted")


def _check_fresh(unit: PartitionUnit, where: str) -> None:
    if unit._fresh:
        full = [n for n in _SCRATCH if getattr(unit, n)]
        assert not full and unit.fast_layer is None, f"{where}: p{unit.pid} says fresh, holds {full}"


@pytest.fixture
def fresh_means_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Check, wherever the engine relies on it, that a unit's ``_fresh`` flag is true only of an empty scratch:
    ``_clear`` then skips its work and an unreached partition's finalize writes nothing (a flag left set after
    something was put in the scratch would carry one epoch's writes into the next, or drop them)."""
    clear, finalize = PartitionUnit._clear, PartitionUnit._finalize

    def checked_clear(self: PartitionUnit, epoch: int) -> None:
        _check_fresh(self, "_clear")
        clear(self, epoch)

    def checked_finalize(self: PartitionUnit) -> int:
        _check_fresh(self, "_finalize")
        return finalize(self)

    monkeypatch.setattr(PartitionUnit, "_clear", checked_clear)
    monkeypatch.setattr(PartitionUnit, "_finalize", checked_finalize)
    yield
