"""Prometheus metrics of a gateway and its runtime (prometheus-client), and the dashboard's JSON summary.

Every label set is bounded: ``outcome`` (committed, aborted), ``reason`` (the first ``MAX_REASONS`` error
types seen, then ``other``), ``partition`` (the runtime's partition count; after a rescale, requests count
against the new layout). Served at ``GET /metrics``
(token-protected) in the Prometheus text format. Metric names:

- ``charon_transactions_total{outcome, reason}`` replies the gateway delivered (reason ``""`` when committed)
- ``charon_request_latency_seconds`` gateway-measured latency (arrival to reply) of transactions
- ``charon_epochs_total``, ``charon_epoch_duration_seconds``, ``charon_epoch_size`` (transactions),
  ``charon_epoch_rounds``, ``charon_epoch_spark_jobs`` (Spark runtime), ``charon_epoch_transactions_total``,
  ``charon_fallback_transactions_total`` (share: the ratio of the two), ``charon_epoch_aborted_total``
- ``charon_partition_requests_total{partition}`` requests per partition of their target entity (load)
- gauges read at scrape time: ``charon_epoch`` (last committed), ``charon_backlog``, ``charon_deferred``,
  ``charon_paused``, ``charon_inflight``; ``charon_code_info{app, version}``
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from charon.core.routing import partition_of
from charon.messages import Reply, Request
from charon.runtime.contract import Engine
from charon.server.history import MetricsHistory, Sample

__all__ = ["GatewayMetrics", "CONTENT_TYPE_LATEST", "MAX_REASONS"]

MAX_REASONS = 20
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_EPOCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SIZE_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_ROUND_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50)


class GatewayMetrics:
    """The metrics of one gateway (its own registry); ``samples`` bounds the dashboard's latency window."""

    def __init__(self, engine: Engine, *, samples: int = 10_000, epochs_kept: int = 200,
                 history_samples: int = 900, history_bytes: int = 2 << 20) -> None:
        self.engine = engine
        self.history = MetricsHistory(history_samples, history_bytes)
        self._last_tick: float | None = None
        self._totals: dict[str, int] = {}  # replies so far by reason ("": committed), bounded like the reasons
        self._tick_totals: dict[str, int] = {}  # ... as of the last tick
        self.partitions = max(1, engine.partitions)
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.tx = Counter("charon_transactions", "Transactions answered, by outcome and abort reason.",
                          ["outcome", "reason"], registry=r)
        self.latency = Histogram("charon_request_latency_seconds", "Transaction latency seen by the gateway.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.epochs = Counter("charon_epochs", "Epochs run.", registry=r)
        self.epoch_duration = Histogram("charon_epoch_duration_seconds", "Epoch duration.",
                                        buckets=_EPOCH_BUCKETS, registry=r)
        self.epoch_size = Histogram("charon_epoch_size", "Transactions per epoch.", buckets=_SIZE_BUCKETS,
                                    registry=r)
        self.epoch_rounds = Histogram("charon_epoch_rounds", "Exchange rounds per epoch.", buckets=_ROUND_BUCKETS,
                                      registry=r)
        self.epoch_jobs = Histogram("charon_epoch_spark_jobs", "Spark jobs per epoch (Spark runtime).",
                                    buckets=_ROUND_BUCKETS, registry=r)
        self.epoch_tx = Counter("charon_epoch_transactions", "Transactions run in epochs.", registry=r)
        self.fallback = Counter("charon_fallback_transactions", "Transactions decided by the fallback.", registry=r)
        self.epoch_aborted = Counter("charon_epoch_aborted", "Transactions aborted in epochs.", registry=r)
        self.partition_load = Counter("charon_partition_requests", "Requests per target partition.",
                                      ["partition"], registry=r)
        self.g_epoch = Gauge("charon_epoch", "Last committed epoch.", registry=r)
        self.g_backlog = Gauge("charon_backlog", "Requests waiting for an epoch.", registry=r)
        self.g_admission = Gauge("charon_admission_waiting", "Requests waiting for admission after the last epoch.",
                                 registry=r)
        self.g_deferred = Gauge("charon_deferred", "Transactions deferred by the last epoch.", registry=r)
        self.g_paused = Gauge("charon_paused", "1 while no epoch may start (paused).", registry=r)
        self.g_inflight = Gauge("charon_inflight", "Requests in flight at the gateway.", registry=r)
        self.g_dead = Gauge("charon_dead_letters", "Transactions set aside by the engine (timed out past their "
                            "budget, quarantined), by error type.", ["type"], registry=r)
        self.g_stuck = Gauge("charon_engine_stuck_seconds", "How long a function has held the engine past its "
                             "budget (0: none).", registry=r)
        storage = getattr(engine, "storage_metrics", None)  # the durable node on object storage: a Collector
        if storage is not None:
            r.register(storage)
        self.code = Info("charon_code", "The deployed application and its code version.", registry=r)
        self._version = engine.version_at(0)
        self.code.info({"app": engine.app.name, "version": self._version})
        self._reasons: set[str] = set()
        self._lock = threading.Lock()
        self._last_epoch_seen = -1
        # for the dashboard: recent (time, latency) samples, per-second outcomes, recent epochs
        self._lat: collections.deque[tuple[float, float]] = collections.deque(maxlen=samples)
        self._events: collections.deque[tuple[float, bool, str]] = collections.deque(maxlen=samples)
        self._epochs: collections.deque[dict[str, float]] = collections.deque(maxlen=epochs_kept)
        self._load = [0] * self.partitions
        self._part_children: dict[int, Any] = {}  # partition -> partition_load's labelled child
        self._committed = self.tx.labels("committed", "")

    # -- fed by the gateway -------------------------------------------------------------------------------
    def observe_request(self, req: Request) -> None:
        """A request reached the runtime: count it against its target's partition."""
        n = self._runtime_partitions()
        if n != self.partitions:  # the runtime was rescaled: count against the new layout from now on
            self.partitions, self._load = n, [0] * n
        p = partition_of(req.operator, req.key, n)
        child = self._part_children.get(p)
        if child is None:  # labels() looks the child up under a lock each time: once per partition
            child = self._part_children[p] = self.partition_load.labels(str(p))
        child.inc()
        self._load[p] += 1

    def _runtime_partitions(self) -> int:
        """The engine's partition count now."""
        return max(1, self.engine.partitions)

    def observe_reply(self, rep: Reply, latency: float) -> None:
        """A reply came back after ``latency`` seconds."""
        reason = ""
        if rep.ok:
            self._committed.inc()
        else:
            reason = rep.error_type or "unknown"
            if reason not in self._reasons:
                if len(self._reasons) >= MAX_REASONS:
                    reason = "other"
                else:
                    self._reasons.add(reason)
            self.tx.labels("aborted", reason).inc()
        self.latency.observe(latency)
        now = time.time()
        self._lat.append((now, latency))
        self._totals[reason] = self._totals.get(reason, 0) + 1
        self._events.append((now, rep.ok, reason))  # reason: bounded (MAX_REASONS, then "other")

    # -- read at scrape time ------------------------------------------------------------------------------
    def _ingest_epochs(self) -> None:
        stats = list(self.engine.epoch_stats())
        with self._lock:
            for s in stats:
                e = int(s.get("epoch", -1))
                if e <= self._last_epoch_seen:
                    continue
                self._last_epoch_seen = e
                size = float(s.get("size", 0))
                self.epochs.inc()
                self.epoch_duration.observe(float(s.get("duration_ms", 0.0)) / 1000.0)
                self.epoch_size.observe(size)
                self.epoch_rounds.observe(float(s.get("rounds", 0)))
                if "spark_jobs" in s or "spark_rounds" in s:  # Spark: its resident gang's epochs run no job
                    self.epoch_jobs.observe(float(s.get("spark_jobs", 0)))
                self.epoch_tx.inc(size)
                aborted = float(s.get("aborted", 0))
                self.epoch_aborted.inc(aborted)
                self.fallback.inc(max(0.0, size - float(s.get("lockfree", 0)) - aborted))
                self.g_deferred.set(float(s.get("deferred", 0)))
                if "admission_held" in s:
                    self.g_admission.set(float(s["admission_held"]))
                self._epochs.append({"epoch": e, "t": time.time(), "duration_ms": float(s.get("duration_ms", 0.0)),
                                     "size": size, "committed": float(s.get("committed", 0)), "aborted": aborted,
                                     "rounds": float(s.get("rounds", 0)), "deferred": float(s.get("deferred", 0))})

    def _status(self) -> dict[str, Any]:
        controls = self.engine.controls
        return controls.status_now().doc() if controls is not None else {}

    def refresh(self, inflight: int) -> dict[str, Any]:
        """Update the scrape-time gauges; returns the runtime's control status."""
        self._ingest_epochs()
        st = self._status()
        self.g_epoch.set(st.get("epoch", -1))
        if st.get("backlog") is not None:  # null while the log does not answer: the gauge keeps its last value
            self.g_backlog.set(st["backlog"])
        self.g_paused.set(1 if st.get("paused") else 0)
        self.g_inflight.set(inflight)
        for kind, n in (st.get("dead_letters") or {}).items():
            self.g_dead.labels(kind).set(n)
        stuck = st.get("stuck")
        self.g_stuck.set(float(stuck["seconds"]) if stuck else 0.0)
        if "code_version" in st and st["code_version"] != self._version:
            self._version = str(st["code_version"])
            self.code.info({"app": self.engine.app.name, "version": self._version})
        return st

    def exposition(self, inflight: int) -> bytes:
        """The Prometheus text format."""
        self.refresh(inflight)
        return generate_latest(self.registry)

    def tick(self, inflight: int, now: float | None = None) -> Sample:
        """Record one history sample covering the time since the previous tick (the gateway ticks each second)."""
        try:
            st = self.refresh(inflight)  # ingests the new epochs first: their time is before ``now``
            backlog = st.get("backlog")
        except Exception:  # noqa: BLE001 - a runtime still starting or failed: the sample says "no backlog"
            backlog = None
        now = time.time() if now is None else now
        since = self._last_tick if self._last_tick is not None else now - 1.0
        self._last_tick = now
        lats = sorted(v for t, v in list(self._lat) if since < t <= now)
        totals = dict(self._totals)  # cumulative counts: exact at any rate (the sample deques are bounded)
        diff = {k: n - self._tick_totals.get(k, 0) for k, n in totals.items()}
        self._tick_totals = totals
        committed = diff.pop("", 0)
        aborts = {k: n for k, n in diff.items() if n > 0}
        durations = [e["duration_ms"] for e in list(self._epochs) if since < e["t"] <= now]

        def pct(q: float) -> float | None:
            return round(lats[min(len(lats) - 1, int(q * len(lats)))] * 1000.0, 3) if lats else None

        sample = Sample(t=round(now, 3), committed=committed, aborted=sum(aborts.values()), aborts=aborts,
                        p50_ms=pct(0.5), p99_ms=pct(0.99), epochs=len(durations),
                        epoch_ms=round(sum(durations) / len(durations), 3) if durations else None,
                        epoch_max_ms=round(max(durations), 3) if durations else None,
                        backlog=None if backlog is None else int(backlog), inflight=inflight)
        self.history.add(sample)
        return sample

    async def sample_every(self, interval: float, inflight: Callable[[], int],
                           off_loop: Callable[..., Awaitable[object]]) -> None:
        """Tick every ``interval`` seconds (off the event loop) until cancelled: the gateway's history sampler."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at = max(next_at + interval, loop.time())  # after a slow tick: no burst to catch up
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                await off_loop(self.tick, inflight())
            except RuntimeError:  # the gateway's thread pool is shutting down
                return

    def summary(self, inflight: int, window: float = 10.0) -> dict[str, Any]:
        """What the dashboard shows: throughput, latency percentiles, aborts, epochs, load, backlog, status."""
        st = self.refresh(inflight)
        now = time.time()
        lats = sorted(v for t, v in list(self._lat) if t >= now - window)
        events = [e for e in list(self._events) if e[0] >= now - window]
        aborts: dict[str, int] = {}
        for _, ok, reason in events:
            if not ok:
                aborts[reason] = aborts.get(reason, 0) + 1

        def pct(q: float) -> float | None:
            return lats[min(len(lats) - 1, int(q * len(lats)))] * 1000.0 if lats else None

        return {
            "status": st, "inflight": inflight, "window_s": window,
            "throughput": sum(1 for e in events if e[1]) / window,
            "aborts_per_s": sum(aborts.values()) / window, "aborts": aborts,
            "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)},
            "epochs": list(self._epochs)[-60:], "partition_load": list(self._load) if len(self._load) ==
            self._runtime_partitions() else [0] * self._runtime_partitions(),
            "code": {"app": self.engine.app.name, "version": self._version},
        }
