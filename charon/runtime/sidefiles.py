"""An engine's files beside its checkpoint on object storage: the effects store, the output streams and the stream
readers' offsets (portals, wires), under ``files/`` of the storage location. The durable node
(:mod:`charon.runtime.node.storage`) ships them at every checkpoint, the Spark driver
(:mod:`charon.runtime.spark.runtime`) before every epoch record it writes.

They are written by other parts of the engine (the effect executor, the stream log, the portal routers: SQLite
files and small offset files in the data directory), not by the checkpoint writer, so they are shipped as
snapshots: at every checkpoint, before its epoch record (the commit point), each file that changed since it was
last shipped is uploaded whole (a SQLite file through SQLite's online backup, so a concurrent writer cannot tear
it), in one conditional request through the store's upload budget (:class:`~charon.storage.s3.ByteBudget`: a
file larger than the budget takes all of it, waiting until nothing else is in flight). The order keeps every reader
behind what it reads: the offsets first, then the effects store (its intake offset into the ``charon.effects``
stream), then the streams; and the streams hold every atom of the epochs the
record covers (an atom is appended before its epoch is handed to the writer). An engine on an empty data directory
takes them back before it opens them; the epochs it replays after the record append their atoms again
(idempotent by epoch) and what a reader did after the snapshot is done again: an effect taken in or attempted
after it is taken in (by id, once) or attempted again, as after a crash (handlers run at least once, with the
effect id as idempotency key; continuations exactly once, by request id), a portal request is submitted again
under its own id.

Each object is replaced only over the version this engine wrote or read (``If-Match``; created with
``If-None-Match``), so an engine that lost its place fails with
:class:`~charon.storage.contract.StorageConflict` instead of overwriting the newer one's files.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile

from charon.storage.contract import ObjectStore, StorageConflict

__all__ = ["PREFIX", "SQLITE_FILES", "SideFiles"]

PREFIX = "files/"
#: SQLite files shipped, in this order after the offset files (see the module docstring)
SQLITE_FILES = ("effects.sqlite", "streams.sqlite")
OFFSET_SUFFIX = ".offset"


def _signature(path: str) -> tuple[int, ...] | None:
    """What changes when the file (with its WAL) changes; None if it does not exist."""
    sig: list[int] = []
    for p in (path, path + "-wal"):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if p == path:
                return None
            continue
        sig += [st.st_mtime_ns, st.st_size, st.st_ino]
    return tuple(sig)


class SideFiles:
    """The side files of ``data_dir`` and their copies in ``store`` (see the module docstring)."""

    def __init__(self, data_dir: str, store: ObjectStore) -> None:
        self.data_dir = data_dir
        self.store = store
        self._etags: dict[str, str] = {}  # key -> the version this engine wrote or read
        self._shipped: dict[str, tuple[int, ...]] = {}  # name -> the signature shipped

    def names(self) -> list[str]:
        """The side files of the data directory, in shipping order."""
        offsets = sorted(n for n in os.listdir(self.data_dir) if n.endswith(OFFSET_SUFFIX))
        return [*offsets, *(n for n in SQLITE_FILES if os.path.exists(os.path.join(self.data_dir, n)))]

    def restore(self) -> int:
        """Before anything opens them: take the stored files the data directory lacks (a new machine); a file the
        directory has is its own newer copy (the same engine restarting). Returns the number downloaded."""
        n = 0
        for o in self.store.list(PREFIX):
            name = o.key[len(PREFIX):]
            if "/" in name or not name:
                continue
            self._etags[o.key] = o.etag
            path = os.path.join(self.data_dir, name)
            if os.path.exists(path):
                continue
            for extra in ("-wal", "-shm", "-journal"):  # never pair a downloaded database with another's log
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path + extra)
            self.store.get_file(o.key, path)
            self._shipped[name] = _signature(path) or ()
            n += 1
        return n

    def ship(self) -> int:
        """Upload every side file changed since it was last shipped (idempotent: safe to retry). Returns how
        many were uploaded."""
        n = 0
        for name in self.names():
            path = os.path.join(self.data_dir, name)
            sig = _signature(path)
            if sig is None or self._shipped.get(name) == sig:
                continue
            if name in SQLITE_FILES:
                fd, tmp = tempfile.mkstemp(prefix=".ship-", dir=self.data_dir)
                os.close(fd)
                try:
                    src = sqlite3.connect(path, timeout=30)
                    dst = sqlite3.connect(tmp)
                    try:
                        src.backup(dst)
                    finally:
                        dst.close()
                        src.close()
                    self._put(PREFIX + name, tmp)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(tmp)
            else:
                try:
                    self._put(PREFIX + name, path)
                except FileNotFoundError:  # removed by its reader meanwhile
                    continue
            self._shipped[name] = sig
            n += 1
        return n

    def _put(self, key: str, path: str) -> None:
        """Upload the file ``path`` as ``key`` over the version this engine knows: one conditional request through
        the store's upload budget (a file larger than the budget takes all of it)."""
        etag = self._etags.get(key)
        try:
            self._etags[key] = self.store.put_file(key, path, if_absent=etag is None, if_match=etag)
        except StorageConflict:  # an earlier attempt reached the store before its answer was lost: it is ours
            have, tag = self.store.get(key)
            with open(path, "rb") as f:
                if have != f.read():
                    raise
            self._etags[key] = tag
