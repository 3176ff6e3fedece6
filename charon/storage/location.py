"""Open object storage by URL: ``file:///abs/dir`` (or a plain path) or ``s3://bucket/prefix``."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from charon.storage.contract import ObjectStore
from charon.storage.metered import StorageMeter

__all__ = ["StorageUrlError", "open_storage", "check_storage_url"]


class StorageUrlError(ValueError):
    """The storage location is not a ``file://`` or ``s3://bucket/prefix`` URL."""


def check_storage_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket_or_root, prefix)`` of a storage URL, or :class:`StorageUrlError`."""
    if "://" not in url:
        return "file", os.path.abspath(url), ""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise StorageUrlError(f"a file:// storage URL names an absolute path (file:///dir), not {url!r}")
        return "file", parts.path, ""
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise StorageUrlError(f"an S3 storage URL is s3://bucket/prefix, not {url!r}")
        return "s3", parts.netloc, parts.path.strip("/")
    raise StorageUrlError(f"storage URLs are file:///dir or s3://bucket/prefix, not {url!r}")


def open_storage(url: str, *, fsync: bool = True, meter: StorageMeter | None = None,
                 retry_s: float | None = None) -> ObjectStore:
    """The object store at ``url`` (see :func:`check_storage_url`); an S3 store reports its upload bytes in flight
    to ``meter`` and retries a request for at most ``retry_s`` seconds (default
    :data:`~charon.storage.s3.DEFAULT_RETRY_S`)."""
    scheme, where, prefix = check_storage_url(url)
    if scheme == "file":
        from charon.storage.files import FileStore

        return FileStore(where, fsync=fsync)
    from charon.storage.s3 import DEFAULT_RETRY_S, S3Store

    return S3Store(where, prefix, meter=meter, retry_s=DEFAULT_RETRY_S if retry_s is None else retry_s)
