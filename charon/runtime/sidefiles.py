"""An engine's files beside its checkpoint on object storage: the effects store, the output streams and the stream
readers' offsets (portals, wires), under ``files/`` of the storage location. The durable node
(:mod:`charon.runtime.node.storage`) ships them at every checkpoint, the Spark driver
(:mod:`charon.runtime.spark.runtime`) before every epoch record it writes.

They are written by other parts of the engine (the effect executor, the stream log, the portal routers: SQLite files
and small offset files in the data directory), not by the checkpoint writer, so they are shipped as snapshots (the
streams incrementally, below): at every checkpoint, before its epoch record (the commit point), each file that
changed since it was last shipped is uploaded whole (a SQLite file through SQLite's online backup, so a concurrent
writer cannot tear it), in one conditional request through the store's upload budget
(:class:`~charon.storage.s3.ByteBudget`: a file larger than the budget takes all of it, waiting until nothing else
is in flight). The order keeps every reader behind what it reads: the offsets first, then the effects store (its
intake offset into the ``charon.effects`` stream), then the streams; and the streams stored hold every atom of the
epochs the record covers (an atom is appended before its epoch is handed to the writer). An engine on an empty data
directory takes them back before it opens them; the epochs it replays after the record append their atoms again
(idempotent by epoch) and what a reader did after the snapshot is done again: an effect taken in or attempted after
it is taken in (by id, once) or attempted again, as after a crash (handlers run at least once, with the effect id as
idempotency key; continuations exactly once, by request id), a portal request is submitted again under its own id.

The output streams grow at every epoch that emits, so they are shipped incrementally: a ship uploads the atoms of
the epochs after the last one stored as one *segment* (:class:`~charon.log.streams.EpochAtoms`, msgpack) under
``files/streams/<first epoch>-<last epoch>.atoms``, created once (``If-None-Match``); the whole file (a snapshot,
``files/streams.sqlite``) goes up only once the segments since the last snapshot number ``snapshot_segments`` (a
restore reads at most that many), or hold as many bytes as the snapshot itself (at least ``snapshot_bytes``: a
snapshot's bytes are spread over that many epochs' or bytes' worth of atoms), or when the pending atoms alone exceed
``snapshot_bytes`` (a segment is held in memory whole; the durable node, shipping per checkpoint, may have many);
after a snapshot the segments it covers are deleted. A restore takes the snapshot, then puts the segments' atoms in
epoch order (in a file built aside, renamed into place when whole), at their offsets
(:meth:`~charon.log.streams.StreamLog.put_atoms`, idempotent by epoch: a segment a snapshot covers, left by a crash
before its deletion, adds nothing). Where the stored atoms end is learnt from the listing at
:meth:`SideFiles.restore`; when it is unknown (the data directory kept, no segment stored) the next ship is a
snapshot.

Each object is replaced only over the version this engine wrote or read (``If-Match``; created with
``If-None-Match``), so an engine that lost its place fails with
:class:`~charon.storage.contract.StorageConflict` instead of overwriting the newer one's files.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from charon.log.streams import EpochAtoms, StreamLog
from charon.storage.contract import ObjectInfo, ObjectStore, StorageConflict

__all__ = ["PREFIX", "SEGMENTS", "SNAPSHOT_BYTES", "SNAPSHOT_SEGMENTS", "SQLITE_FILES", "SideFiles"]

PREFIX = "files/"
#: SQLite files shipped, in this order after the offset files (see the module docstring)
SQLITE_FILES = ("effects.sqlite", "streams.sqlite")
STREAMS = "streams.sqlite"
OFFSET_SUFFIX = ".offset"
#: the streams' segments: ``<first epoch>-<last epoch>.atoms`` (20 digits each, so the keys sort by epoch)
SEGMENTS = PREFIX + "streams/"
SNAPSHOT_SEGMENTS = 1000
SNAPSHOT_BYTES = 16 << 20
_SEGMENT = re.compile(r"(\d{20})-(\d{20})\.atoms")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[EpochAtoms])


@dataclass(frozen=True)
class _Segment:
    """A stored segment of the streams' atoms."""

    key: str
    first: int
    last: int
    size: int


def _segment_key(first: int, last: int) -> str:
    return f"{SEGMENTS}{first:020d}-{last:020d}.atoms"


def _segments(store: ObjectStore) -> list[_Segment]:
    """The stored segments, by first epoch (an object not named as one is not one)."""
    out = []
    for o in store.list(SEGMENTS):
        m = _SEGMENT.fullmatch(o.key[len(SEGMENTS):])
        if m is not None:
            out.append(_Segment(o.key, int(m[1]), int(m[2]), o.size))
    return sorted(out, key=lambda g: (g.first, g.last))


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

    def __init__(self, data_dir: str, store: ObjectStore, *, snapshot_segments: int = SNAPSHOT_SEGMENTS,
                 snapshot_bytes: int = SNAPSHOT_BYTES) -> None:
        if snapshot_segments < 1 or snapshot_bytes < 1:
            raise ValueError("snapshot_segments and snapshot_bytes must be at least 1")
        self.data_dir = data_dir
        self.store = store
        self.snapshot_segments = snapshot_segments
        self.snapshot_bytes = snapshot_bytes
        self._etags: dict[str, str] = {}  # key -> the version this engine wrote or read
        self._shipped: dict[str, tuple[int, ...]] = {}  # name -> the signature shipped
        self._stored_upto: int | None = None  # the last epoch whose atoms are stored (None: unknown)
        self._segments: list[_Segment] = []  # stored since the last snapshot (or not known to be covered by it)
        self._snapshot_size = 0
        self._streams: StreamLog | None = None  # opened at the first ship

    def names(self) -> list[str]:
        """The side files of the data directory, in shipping order."""
        offsets = sorted(n for n in os.listdir(self.data_dir) if n.endswith(OFFSET_SUFFIX))
        return [*offsets, *(n for n in SQLITE_FILES if os.path.exists(os.path.join(self.data_dir, n)))]

    def restore(self) -> int:
        """Before anything opens them: take the stored files the data directory lacks (a new machine); a file the
        directory has is its own newer copy (the same engine restarting). Returns the number downloaded."""
        n = 0
        snapshot: ObjectInfo | None = None
        for o in self.store.list(PREFIX):
            name = o.key[len(PREFIX):]
            if "/" in name or not name:
                continue
            self._etags[o.key] = o.etag
            if name == STREAMS:
                snapshot = o
                continue
            path = os.path.join(self.data_dir, name)
            if os.path.exists(path):
                continue
            self._take(o.key, path)
            self._shipped[name] = _signature(path) or ()
            n += 1
        return n + self._restore_streams(snapshot)

    def _restore_streams(self, snapshot: ObjectInfo | None) -> int:
        """The streams: the snapshot, then the segments' atoms after it, built aside and renamed into place (a
        crash meanwhile leaves no partial file that a restart would take for its own). Returns 1 if restored."""
        path = os.path.join(self.data_dir, STREAMS)
        self._segments = _segments(self.store)
        self._snapshot_size = snapshot.size if snapshot is not None else 0
        if os.path.exists(path):  # its own newer copy: what is stored is known up to the last segment only
            self._stored_upto = self._segments[-1].last if self._segments else None
            return 0
        if snapshot is None and not self._segments:  # nothing stored, nothing here
            self._stored_upto = -1
            return 0
        aside = path + ".restoring"
        for extra in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(aside + extra)
        if snapshot is not None:
            self._take(snapshot.key, aside)
        with StreamLog(aside, durable=False) as log:
            covered = log.last_epoch()
            for seg in self._segments:
                if seg.last > covered:
                    for copy in _decoder.decode(self.store.get(seg.key)[0]):
                        log.put_atoms(copy)
            self._stored_upto = log.last_epoch()
        with contextlib.closing(sqlite3.connect(aside)) as db:  # its WAL into the file, which stands alone
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for extra in ("-wal", "-shm", "-journal"):  # never pair the restored database with another's log
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + extra)
        os.replace(aside, path)
        for extra in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(aside + extra)
        self._segments = [g for g in self._segments if g.last > covered]
        self._shipped[STREAMS] = _signature(path) or ()
        return 1

    def _take(self, key: str, path: str) -> None:
        """Download ``key`` to ``path``, never paired with another database's log."""
        for extra in ("-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + extra)
        self.store.get_file(key, path)

    def ship(self) -> int:
        """Upload every side file changed since it was last shipped (idempotent: safe to retry). Returns how
        many were uploaded (a segment of the streams counts as their upload)."""
        n = 0
        for name in self.names():
            path = os.path.join(self.data_dir, name)
            sig = _signature(path)
            if sig is None or self._shipped.get(name) == sig:
                continue
            if name == STREAMS:
                n += self._ship_streams(path)
            elif name in SQLITE_FILES:
                with self._backup(path) as tmp:
                    self._put(PREFIX + name, tmp)
                n += 1
            else:
                try:
                    self._put(PREFIX + name, path)
                except FileNotFoundError:  # removed by its reader meanwhile
                    continue
                n += 1
            self._shipped[name] = sig
        return n

    def close(self) -> None:
        """Close the streams' connection (opened at the first ship)."""
        if self._streams is not None:
            self._streams.close()
            self._streams = None

    def _ship_streams(self, path: str) -> bool:
        """Store the atoms of the epochs after the last stored one: as one segment, or as a snapshot when one is
        due (see the module docstring). True if something was uploaded."""
        if self._streams is None:
            self._streams = StreamLog(path, durable=False)
        if self._stored_upto is not None:
            pending = self._streams.epoch_atoms(self._stored_upto, self.snapshot_bytes)
            if pending == []:
                return False
            if pending is not None:  # else more than a segment may hold
                data = _encoder.encode(pending)
                held = sum(g.size for g in self._segments) + len(data)
                if len(self._segments) < self.snapshot_segments and held <= max(self.snapshot_bytes,
                                                                                 self._snapshot_size):
                    seg = _Segment(_segment_key(pending[0].epoch, pending[-1].epoch), pending[0].epoch,
                                   pending[-1].epoch, len(data))
                    self._put_segment(seg.key, data)
                    self._segments.append(seg)
                    self._stored_upto = seg.last
                    return True
        with self._backup(path) as tmp:
            with contextlib.closing(sqlite3.connect(tmp)) as db:
                last: int = db.execute("SELECT coalesce(max(epoch), -1) FROM epochs").fetchone()[0]
            self._put(PREFIX + STREAMS, tmp)
            self._snapshot_size = os.path.getsize(tmp)
        self._stored_upto = last
        for g in self._segments:  # covered by the snapshot: a restore would skip their atoms
            if g.last <= last:
                self.store.delete(g.key)
        self._segments = [g for g in self._segments if g.last > last]
        return True

    def _put_segment(self, key: str, data: bytes) -> None:
        """Create the segment ``key`` (once: an earlier attempt whose answer was lost stored the same bytes)."""
        try:
            self.store.put(key, data, if_absent=True)
        except StorageConflict:
            if self.store.get(key)[0] != data:
                raise

    @contextlib.contextmanager
    def _backup(self, path: str) -> Iterator[str]:
        """A consistent copy of the SQLite file ``path`` (SQLite's online backup: a concurrent writer cannot tear
        it), removed afterwards."""
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
            yield tmp
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

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
