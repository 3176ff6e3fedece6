"""``s3://bucket/prefix`` object storage over the S3 API with obstore (Rust ``object_store``).

Configured the standard way, from the environment: ``AWS_ENDPOINT_URL`` (e.g. a SeaweedFS or MinIO server; plain
``http://`` endpoints are allowed and addressed path-style), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION`` (default ``us-east-1``), and every other ``AWS_*`` variable obstore knows. Requests are retried with
exponential backoff for at most ``retry_s`` seconds (obstore retries 5xx, 429/503 SlowDown and connection errors),
then fail with :class:`StorageUnavailable`. At most ``max_inflight_bytes`` of uploads are in flight at once: an
upload larger than that takes the whole budget (it waits until nothing else is in flight, and nothing else starts
until it is done); a whole-file upload without a condition goes up in 5 MiB parts, 4 at a time (multipart), one with
a condition (``if_absent``, ``if_match``) in one request, read whole into memory (S3 takes a condition on a single
PUT only). Given a :class:`~charon.storage.metered.StorageMeter`, the budget reports what it holds to it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import obstore
from obstore import exceptions as oe
from obstore.store import S3Store as _ObS3

from charon.storage.contract import (
    ObjectInfo,
    ObjectNotFound,
    StorageConflict,
    StorageDenied,
    StorageError,
    StorageUnavailable,
)
from charon.storage.metered import StorageMeter

__all__ = ["ByteBudget", "S3Store", "DEFAULT_RETRY_S", "DEFAULT_INFLIGHT_BYTES"]

T = TypeVar("T")
DEFAULT_RETRY_S = 30.0
DEFAULT_INFLIGHT_BYTES = 64 << 20


class ByteBudget:
    """At most ``limit`` bytes held at once; a request above the limit holds all of it (it waits until nothing else
    is held). ``report`` is told what is held after every change."""

    def __init__(self, limit: int, report: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.held = 0
        self._report = report
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        n = min(n, self.limit)
        with self._cv:
            while self.held + n > self.limit:
                self._cv.wait()
            self.held += n
            if self._report is not None:
                self._report(self.held)
        try:
            yield
        finally:
            with self._cv:
                self.held -= n
                if self._report is not None:
                    self._report(self.held)
                self._cv.notify_all()


def _call(key: str, op: Callable[[], T]) -> T:
    """``op()`` with obstore's errors turned into the typed ones of :mod:`charon.storage.contract`."""
    try:
        return op()
    except (oe.NotFoundError, FileNotFoundError):  # obstore raises the builtin for a 404
        raise ObjectNotFound(key) from None
    except (oe.AlreadyExistsError, oe.PreconditionError) as exc:
        raise StorageConflict(f"{key}: {str(exc).splitlines()[0]}") from None
    except (oe.PermissionDeniedError, oe.UnauthenticatedError) as exc:
        raise StorageDenied(f"{key}: {str(exc).splitlines()[0]}") from None
    except (oe.InvalidPathError, oe.UnknownConfigurationKeyError, oe.NotSupportedError) as exc:
        raise StorageError(f"{key}: {str(exc).splitlines()[0]}") from None
    except (oe.BaseError, OSError) as exc:  # connection refused, timeouts, 5xx after the retries
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StorageUnavailable(f"{key}: {first}") from None


class S3Store:
    """Objects under ``prefix`` in ``bucket`` (see the module docstring)."""

    def __init__(self, bucket: str, prefix: str = "", *, retry_s: float = DEFAULT_RETRY_S,
                 max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES, request_timeout_s: float = 30.0,
                 meter: StorageMeter | None = None) -> None:
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        if endpoint is not None:
            config["virtual_hosted_style_request"] = False  # S3-compatible servers: path-style
        if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
            config["region"] = "us-east-1"
        client: dict[str, Any] = {"timeout": timedelta(seconds=request_timeout_s),
                                  "connect_timeout": timedelta(seconds=min(5.0, request_timeout_s))}
        if endpoint is not None and endpoint.startswith("http://"):
            client["allow_http"] = True
        retry: dict[str, Any] = {"max_retries": 1000, "retry_timeout": timedelta(seconds=retry_s),
                                 "backoff": {"init_backoff": timedelta(milliseconds=50),
                                             "max_backoff": timedelta(seconds=2), "base": 2}}
        self._store = _ObS3(bucket, prefix=self.prefix or None, config=config,  # type: ignore[arg-type]
                            client_options=client, retry_config=retry)  # type: ignore[arg-type]
        self._budget = ByteBudget(max_inflight_bytes, meter.in_flight if meter is not None else None)
        self.requests = {"put": 0, "get": 0, "list": 0, "delete": 0}
        self.bytes_put = 0
        self.bytes_got = 0

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        mode: Any = "create" if if_absent else {"e_tag": if_match} if if_match is not None else "overwrite"
        with self._budget.hold(len(data)):
            r = _call(key, lambda: obstore.put(self._store, key, data, mode=mode, use_multipart=False))
        self.requests["put"] += 1
        self.bytes_put += len(data)
        return str(r["e_tag"])

    def put_file(self, key: str, path: str, *, if_absent: bool = False, if_match: str | None = None) -> str:
        size = os.path.getsize(path)
        mode: Any = "create" if if_absent else {"e_tag": if_match} if if_match is not None else None
        with self._budget.hold(size), open(path, "rb") as f:
            if mode is None:  # streamed in parts
                r = _call(key, lambda: obstore.put(self._store, key, f, max_concurrency=4))
            else:  # conditional: one request
                r = _call(key, lambda: obstore.put(self._store, key, f, mode=mode, use_multipart=False))
        self.requests["put"] += 1
        self.bytes_put += size
        return str(r["e_tag"])

    def get(self, key: str) -> tuple[bytes, str]:
        def op() -> tuple[bytes, str]:
            r = obstore.get(self._store, key)
            return bytes(r.bytes()), str(r.meta["e_tag"])

        data, etag = _call(key, op)
        self.requests["get"] += 1
        self.bytes_got += len(data)
        return data, etag

    def get_file(self, key: str, path: str) -> None:
        d, name = os.path.split(path)
        tmp = os.path.join(d, f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")

        def op() -> int:
            n = 0
            r = obstore.get(self._store, key)
            with open(tmp, "wb") as f:
                for chunk in r.stream(min_chunk_size=1 << 20):
                    f.write(chunk)
                    n += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            return n

        try:
            n = _call(key, op)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        self.requests["get"] += 1
        self.bytes_got += n

    def list(self, prefix: str) -> list[ObjectInfo]:
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else None

        def op() -> list[ObjectInfo]:
            out = []
            for page in obstore.list(self._store, directory, chunk_size=1000):
                for m in page:
                    if m["path"].startswith(prefix):
                        out.append(ObjectInfo(m["path"], int(m["size"]), str(m["e_tag"])))
            return out

        got = _call(prefix, op)
        self.requests["list"] += 1
        return sorted(got, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFound):
            _call(key, lambda: obstore.delete(self._store, key))
        self.requests["delete"] += 1
