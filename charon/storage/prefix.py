"""A view of an object store under a key prefix (``state/`` of a deployment's storage, say)."""

from __future__ import annotations

import contextlib

from charon.storage.contract import ObjectInfo, ObjectStore, StorageError

__all__ = ["Prefixed", "delete_prefix"]


class Prefixed:
    """``store``'s objects whose keys start with ``prefix`` (which ends with ``/``), keys relative to it."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.url = store.url.rstrip("/") + "/" + self.prefix

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        return self.store.put(self.prefix + key, data, if_absent=if_absent, if_match=if_match)

    def put_file(self, key: str, path: str, *, if_absent: bool = False, if_match: str | None = None) -> str:
        return self.store.put_file(self.prefix + key, path, if_absent=if_absent, if_match=if_match)

    def get(self, key: str) -> tuple[bytes, str]:
        return self.store.get(self.prefix + key)

    def get_file(self, key: str, path: str) -> None:
        self.store.get_file(self.prefix + key, path)

    def list(self, prefix: str) -> list[ObjectInfo]:
        n = len(self.prefix)
        return [ObjectInfo(o.key[n:], o.size, o.etag) for o in self.store.list(self.prefix + prefix)]

    def delete(self, key: str) -> None:
        self.store.delete(self.prefix + key)


def delete_prefix(store: ObjectStore, prefix: str) -> int:
    """Delete every object under ``prefix`` (best effort: what fails stays for a later collection); how many went."""
    n = 0
    with contextlib.suppress(StorageError):
        for o in store.list(prefix):
            with contextlib.suppress(StorageError):
                store.delete(o.key)
                n += 1
    return n
