"""A bounded probe of an input log, for health endpoints that must answer fast during a log outage.

A NATS log whose server is gone or stopped answers an operation only after its timeout (~11 s); a ``/health``
that asked the log directly would hang that long. :class:`LogProbe` asks on one background thread and waits at
most ``timeout_s`` for the answer: a probe still running past it means "the log did not answer" (the thread is
not started again until that call returns: at most one probe is under way per log). A fresh answer is reused
for ``max_age_s``, so a polled health endpoint costs one log call per that period.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

__all__ = ["LogProbe", "ProbeResult"]


class ProbeResult:
    """One probe's outcome: ``ends`` (the log's end offsets) when it answered, else ``error`` (why not)."""

    __slots__ = ("ends", "error", "at")

    def __init__(self, ends: list[int] | None, error: str | None, at: float) -> None:
        self.ends, self.error, self.at = ends, error, at

    @property
    def ok(self) -> bool:
        return self.error is None


class LogProbe:
    """Ask ``log.end_offsets()`` in the background; :meth:`check` answers within ``timeout_s``."""

    def __init__(self, log: Any, timeout_s: float = 1.0, max_age_s: float = 1.0) -> None:
        self.log = log
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._running: threading.Thread | None = None
        self._last: ProbeResult | None = None
        self._started = 0.0

    def _probe(self) -> None:
        try:
            ends = list(self.log.end_offsets())
            res = ProbeResult(ends, None, time.monotonic())
        except (OSError, sqlite3.Error) as exc:  # NatsLogError is an OSError; SQLite: "database is locked"
            res = ProbeResult(None, f"the log is unavailable: {type(exc).__name__}: {exc}", time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported, never raised into a health endpoint
            res = ProbeResult(None, f"the log probe failed: {type(exc).__name__}: {exc}", time.monotonic())
        with self._lock:
            self._last = res
            self._running = None
            self._done.set()

    def check(self, fresh: bool = False) -> ProbeResult:
        """The log's state, answered within ``timeout_s`` (reused for ``max_age_s`` unless ``fresh``)."""
        with self._lock:
            last = self._last
            if not fresh and last is not None and time.monotonic() - last.at < self.max_age_s:
                return last
            if self._running is None:
                self._done.clear()
                self._started = time.monotonic()
                self._running = threading.Thread(target=self._probe, name="charon-log-probe", daemon=True)
                self._running.start()
            started, done = self._started, self._done
        done.wait(max(0.0, self.timeout_s - (time.monotonic() - started)))
        with self._lock:
            if self._running is None and self._last is not None and self._last.at >= started:
                return self._last
            waited = time.monotonic() - started
        return ProbeResult(None, f"the log did not answer within {waited:.1f} s", time.monotonic())
