"""Requests and bytes to object storage, counted: what a deployment pays for (PUT/GET/LIST/DELETE and bytes).

:class:`Metered` wraps an :class:`~charon.storage.contract.ObjectStore` and counts every request it makes by kind
(a request that fails counts too: the store was asked), the bytes uploaded (``put``, ``put_file``) and the bytes
downloaded (``get``, ``get_file``). :class:`StorageMeter` holds the counters (thread-safe) and
:class:`MeterCollector` exposes them as Prometheus counters ``charon_storage_requests_total{op}`` and
``charon_storage_bytes_total{direction}``. A retried request counts once (the retries are the client's).

The upload bytes in flight are the store's own to report (an S3 store's :class:`~charon.storage.s3.ByteBudget` holds
them, given the meter: ``open_storage(url, meter=...)``): :meth:`StorageMeter.in_flight` keeps the gauge and its
peak, exposed as ``charon_storage_upload_bytes_in_flight``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from charon.storage.contract import ObjectInfo, ObjectStore

__all__ = ["OPS", "Metered", "MeterCollector", "StorageMeter"]

#: the request kinds counted (``get`` covers ``get_file``, ``put`` covers ``put_file``)
OPS = ("put", "get", "list", "delete")


class StorageMeter:
    """Requests by kind and bytes up/down, since the meter was made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = dict.fromkeys(OPS, 0)
        self.bytes_up = 0
        self.bytes_down = 0
        self.inflight_up = 0  # upload bytes held in the store's budget now
        self.peak_inflight_up = 0  # the most ever held at once

    def count(self, op: str, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.requests[op] += 1
            self.bytes_up += up
            self.bytes_down += down

    def in_flight(self, held: int) -> None:
        """The store's budget now holds ``held`` upload bytes."""
        with self._lock:
            self.inflight_up = held
            self.peak_inflight_up = max(self.peak_inflight_up, held)

    def snapshot(self) -> dict[str, int]:
        """``{"put": n, "get": n, "list": n, "delete": n, "bytes_up": n, "bytes_down": n, "inflight_up": n,
        "peak_inflight_up": n}``."""
        with self._lock:
            return {**self.requests, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                    "inflight_up": self.inflight_up, "peak_inflight_up": self.peak_inflight_up}


class Metered:
    """``store`` with every request counted in ``meter`` (see the module docstring)."""

    def __init__(self, store: ObjectStore, meter: StorageMeter | None = None) -> None:
        self.store = store
        self.meter = meter if meter is not None else StorageMeter()
        self.url = store.url

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        self.meter.count("put", up=len(data))
        return self.store.put(key, data, if_absent=if_absent, if_match=if_match)

    def put_file(self, key: str, path: str, *, if_absent: bool = False, if_match: str | None = None) -> str:
        self.meter.count("put", up=os.path.getsize(path))
        return self.store.put_file(key, path, if_absent=if_absent, if_match=if_match)

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            data, etag = self.store.get(key)
        except BaseException:
            self.meter.count("get")
            raise
        self.meter.count("get", down=len(data))
        return data, etag

    def get_file(self, key: str, path: str) -> None:
        try:
            self.store.get_file(key, path)
        except BaseException:
            self.meter.count("get")
            raise
        self.meter.count("get", down=os.path.getsize(path))

    def list(self, prefix: str) -> list[ObjectInfo]:
        self.meter.count("list")
        return self.store.list(prefix)

    def delete(self, key: str) -> None:
        self.meter.count("delete")
        self.store.delete(key)


class MeterCollector(Collector):
    """A :class:`StorageMeter` as Prometheus counters (register it in a registry)."""

    def __init__(self, meter: StorageMeter) -> None:
        self.meter = meter

    def collect(self) -> Iterator[Metric]:
        s = self.meter.snapshot()
        req = CounterMetricFamily("charon_storage_requests", "Requests to object storage, by kind.", labels=["op"])
        for op in OPS:
            req.add_metric([op], s[op])
        yield req
        b = CounterMetricFamily("charon_storage_bytes", "Bytes to and from object storage.", labels=["direction"])
        b.add_metric(["up"], s["bytes_up"])
        b.add_metric(["down"], s["bytes_down"])
        yield b
        yield GaugeMetricFamily("charon_storage_upload_bytes_in_flight",
                                "Upload bytes in flight to object storage (held in its byte budget).",
                                value=s["inflight_up"])

    def describe(self) -> Iterator[Metric]:
        return self.collect()
