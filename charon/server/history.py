"""The dashboard's metrics over time: a ring buffer of one sample per second, bounded by count and by bytes.

A sample is a flat JSON object (:class:`Sample`): the second it covers, committed and aborted replies, aborts by
error type, latency p50/p99 (ms), epochs run and their mean/max duration (ms), the backlog and in-flight requests.
``GET /admin/metrics/history?since=T`` answers the samples newer than ``T`` (Unix seconds), so a reloaded page
redraws its charts from the server's memory. The oldest samples go first when either bound is reached
(``metrics_history_samples``, ``metrics_history_bytes``).
"""

from __future__ import annotations

import collections
import threading

import msgspec

__all__ = ["MetricsHistory", "Sample"]


class Sample(msgspec.Struct, kw_only=True):
    """One second of a gateway's metrics."""

    t: float  # the end of the second it covers (Unix seconds)
    committed: int
    aborted: int
    aborts: dict[str, int]  # by error type (bounded by the metrics' MAX_REASONS, then "other")
    p50_ms: float | None
    p99_ms: float | None
    epochs: int
    epoch_ms: float | None  # mean duration of the epochs ingested in that second
    epoch_max_ms: float | None
    backlog: int | None  # None: the log did not answer
    inflight: int


class MetricsHistory:
    """The newest samples, oldest first: at most ``max_samples`` and ``max_bytes`` (their JSON size)."""

    def __init__(self, max_samples: int = 900, max_bytes: int = 2 << 20) -> None:
        if max_samples < 1 or max_bytes < 256:
            raise ValueError("metrics history: max_samples >= 1 and max_bytes >= 256")
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self._items: collections.deque[tuple[Sample, int]] = collections.deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()

    def add(self, sample: Sample) -> None:
        """Append one sample, dropping the oldest ones beyond either bound."""
        size = len(self._encoder.encode(sample))
        with self._lock:
            self._items.append((sample, size))
            self._bytes += size
            while self._items and (len(self._items) > self.max_samples or self._bytes > self.max_bytes):
                _, gone = self._items.popleft()
                self._bytes -= gone

    def since(self, t: float | None) -> list[Sample]:
        """The samples newer than ``t`` (all when None), oldest first."""
        with self._lock:
            items = list(self._items)
        return [s for s, _ in items if t is None or s.t > t]

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
