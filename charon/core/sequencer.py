"""Sequencing (Styx §5): TID = sid + lc·n, counters balanced to their maximum at every epoch end."""

from __future__ import annotations


class Sequencer:
    """One counter per input-log partition; TIDs are a pure function of the log and epoch boundaries."""

    def __init__(self, n: int, counters: list[int] | None = None, time: float = 0.0) -> None:
        if n < 1:
            raise ValueError("need at least one sequencer")
        self.n = n
        self.counters = list(counters) if counters is not None else [0] * n
        if len(self.counters) != n:
            raise ValueError("one counter per sequencer")
        self.time = time  # the last epoch's deterministic time (see advance)

    def advance(self, now: float | None) -> float:
        """Decide the epoch's time: the runtime's logged time ``now``, never going back (None: unchanged).

        Like the TIDs it is a pure function of what the runtime logged, so a replayed epoch gets the same
        time; timers (:mod:`charon.core.timers`) fire by it. Runtimes record it with the counters."""
        if now is not None and now > self.time:
            self.time = now
        return self.time

    def assign(self, partition: int) -> int:
        """The next TID of the sequencer of input-log ``partition`` (0-based; its sid is partition+1)."""
        lc = self.counters[partition]
        self.counters[partition] = lc + 1
        return partition + 1 + lc * self.n

    def end_epoch(self) -> None:
        """Balance the sequences: every counter becomes the maximum."""
        m = max(self.counters)
        self.counters = [m] * self.n
