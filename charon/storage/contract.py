"""The object-store interface and its typed errors.

Keys are ``/``-separated relative names (``state/p0/manifest.json``). Every write is whole and atomic (a reader
sees the old object or the new one); ``put`` returns the new object's ETag, an opaque version string. Conditional
writes fence a stale writer: ``if_absent`` creates only (S3 ``If-None-Match: *``), ``if_match`` replaces only the
version with that ETag (S3 ``If-Match``); a failed condition raises :class:`StorageConflict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ObjectInfo", "ObjectStore", "StorageError", "StorageUnavailable", "StorageConflict", "ObjectNotFound",
           "StorageDenied"]


class StorageError(OSError):
    """An object-store operation failed."""


class StorageUnavailable(StorageError):
    """The store did not answer (down, timing out, throttling) after the bounded retries: try again later."""


class StorageDenied(StorageError):
    """The store refused the credentials or the request (a configuration error, not transient)."""


class StorageConflict(StorageError):
    """A conditional write's condition did not hold: the object exists (``if_absent``) or changed (``if_match``)."""


class ObjectNotFound(StorageError, FileNotFoundError):
    """No object under that key."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing."""

    key: str
    size: int
    etag: str


class ObjectStore(Protocol):
    """Whole-object put/get/list/delete with conditional puts (see the module docstring)."""

    url: str

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        """Store ``data`` under ``key``; the new ETag."""
        ...

    def put_file(self, key: str, path: str, *, if_absent: bool = False, if_match: str | None = None) -> str:
        """Store the local file ``path`` under ``key``; the new ETag. Unconditional: streamed, not read whole into
        memory; conditional (``if_absent``, ``if_match``): one whole request (object storage takes a condition on
        a single PUT only)."""
        ...

    def get(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and ETag (:class:`ObjectNotFound` if absent)."""
        ...

    def get_file(self, key: str, path: str) -> None:
        """Write the object to the local file ``path`` atomically (:class:`ObjectNotFound` if absent)."""
        ...

    def list(self, prefix: str) -> list[ObjectInfo]:
        """The objects whose key starts with ``prefix``, sorted by key."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object (nothing if it is absent)."""
        ...
