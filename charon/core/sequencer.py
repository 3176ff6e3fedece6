"""Sequencing (Styx §5): TID = sid + lc·n, counters balanced to their maximum at every epoch end.

An epoch's sequencer count ``n`` is the number of input-log partitions it reads (the length of its end
offsets). When the log grows from ``n`` to ``m`` partitions, :meth:`Sequencer.resize` rebases the counters at
that epoch's start so every new TID exceeds every earlier one; the count never goes down (the log's physical
partitions only grow, :meth:`charon.log.sqlite.InputLog.resize`)."""

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

    @classmethod
    def restore(cls, counters: list[int], time: float = 0.0) -> Sequencer:
        """The sequencer as an epoch record left it: ``n`` is the number of recorded counters."""
        return cls(len(counters), counters, time)

    def resize(self, m: int) -> None:
        """Grow to ``m`` sequencers at an epoch start (counters balanced): with ``M`` the highest counter, the
        largest earlier TID is at most ``M·n``; every counter becomes ``ceil(M·n/m)``, so the smallest new TID,
        ``1 + ceil(M·n/m)·m``, exceeds it. ``m == n`` changes nothing; ``m < n`` raises ``ValueError``."""
        if m < self.n:
            raise ValueError(f"the sequencer count cannot shrink ({self.n} -> {m})")
        if m == self.n:
            return
        top = max(self.counters) * self.n
        self.counters = [-(-top // m)] * m
        self.n = m

    def first_tid(self) -> int:
        """A lower bound of every TID assigned from now on (at an epoch boundary; also after a resize)."""
        return max(self.counters) * self.n + 1

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
