"""Durable partition state under a checkpoint location: an immutable base snapshot plus per-epoch deltas.

Layout, one directory per partition::

    root/p{pid}/manifest.json             atomically replaced; the only mutable file
    root/p{pid}/base-{epoch:012d}-{tag}.arrow   full snapshot as of ``epoch`` (sorted by key)
    root/p{pid}/delta-{epoch:012d}.arrow  the writes of one epoch (value null = delete)
    root/p{pid}/.lock                     flock serializing manifest read-modify-write

A checkpoint is the manifest: it names the base file and epoch, the delta epochs after the base, and the
last epoch recorded (``epoch``; an epoch with an empty delta only advances it, no file is written). Files
are written to a temporary name, fsynced and renamed into place, so a reader or a SIGKILL only ever sees
whole files. Compaction writes a new base, swaps the manifest, then deletes what the old manifest named.

Data files are Arrow IPC files with columns ``key: binary`` and ``value: binary`` (nullable).

All filesystem access goes through :class:`_LocalFS`. With a ``remote`` object store
(:mod:`charon.storage`, e.g. ``s3://bucket/prefix/state``) the local directory is a cache of it: every data file
is uploaded (``p{pid}/<name>``) before a manifest names it, the remote manifest is the commit point (written with
``If-Match`` on the ETag this process last wrote or read, so a stale writer is fenced with
:class:`~charon.storage.contract.StorageConflict`), :meth:`DurableState.hydrate` takes the remote manifest into an
empty or outdated cache, and a data file missing locally is downloaded when it is first read. Garbage is deleted
on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from charon.storage.contract import ObjectNotFound, ObjectStore, StorageConflict, StorageError

if TYPE_CHECKING:  # pyarrow is imported where a file is read or written: `import charon` (every CLI call) skips it
    import pyarrow as pa



def _schema() -> pa.Schema:
    """The files' Arrow schema: a key and a value, both binary."""
    import pyarrow as pa

    return pa.schema([pa.field("key", pa.binary(), nullable=False), pa.field("value", pa.binary())])

BATCH_ROWS = 65536
TMP_MAX_AGE = 3600.0  # seconds: temp files older than this are debris of a killed writer
_BASE_RE = re.compile(r"^base-(-?\d+)-([0-9a-f]+)\.arrow$")
_DELTA_RE = re.compile(r"^delta-(-?\d+)\.arrow$")
T = TypeVar("T")
_REBASES = 50  # a write that meets a co-writer's newer manifest is made again over it at most this many times


class DurableStateError(Exception):
    """The durable copy cannot provide the requested version."""


class _LocalFS:
    """Local-filesystem backend: the one place that knows how paths are read, written and locked."""

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    @staticmethod
    def join(*parts: str) -> str:
        return os.path.join(*parts)

    @staticmethod
    def makedirs(path: str) -> None:
        os.makedirs(path, exist_ok=True)

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(path)

    @staticmethod
    def listdir(path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    @staticmethod
    def remove(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    @staticmethod
    def mtime(path: str) -> float:
        return os.stat(path).st_mtime

    @staticmethod
    def size(path: str) -> int:
        return os.stat(path).st_size

    @staticmethod
    def read_bytes(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    @staticmethod
    def open_arrow(path: str) -> pa.NativeFile:
        import pyarrow as pa
        return pa.memory_map(path, "r")

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object], sync_dir: bool = True) -> int:
        """Write a file under a temporary name, fsync it, rename it over ``path``; returns its size.

        ``sync_dir=False`` leaves the rename to be made durable by a later write in the same directory
        (the manifest's), saving one fsync."""
        d, name = os.path.split(path)
        tmp = os.path.join(d, f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        size = self.write_in_place(tmp, write)
        try:
            os.replace(tmp, path)
        except BaseException:
            self.remove(tmp)
            raise
        if sync_dir:
            self.sync_dir(d)
        return size

    def write_in_place(self, path: str, write: Callable[[BinaryIO], object]) -> int:
        """Write a file straight to ``path`` and fsync it; returns its size (a failed write removes it). Only for a
        file no reader opens until a later (atomic) write names it: a crash may leave it partial."""
        try:
            with open(path, "wb") as f:
                write(f)
                f.flush()
                size = f.tell()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            self.remove(path)
            raise
        return size

    def sync_dir(self, path: str) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def lock(self, path: str) -> Iterator[None]:
        """An exclusive inter-process lock (flock) on a lock file."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


@dataclass
class Manifest:
    """The current checkpoint of one partition."""

    base: str | None = None  # base file name, None = empty base
    base_epoch: int = -1
    deltas: list[int] = field(default_factory=list)  # ascending epochs > base_epoch with a delta file
    epoch: int = -1  # last epoch recorded (>= base_epoch and >= every delta)
    # the fence of the writer generation that owns the partition (object storage, :meth:`DurableState.claim`):
    # a writer of an older one is refused; 0 = never claimed (written only if nonzero: older manifests read the same)
    fence: int = 0

    def to_json(self) -> bytes:
        doc: dict[str, object] = {"version": 1, "base": self.base, "base_epoch": self.base_epoch,
                                  "deltas": self.deltas, "epoch": self.epoch}
        if self.fence:
            doc["fence"] = self.fence
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, b: bytes) -> Manifest:
        d = json.loads(b)
        return cls(d["base"], int(d["base_epoch"]), [int(e) for e in d["deltas"]], int(d["epoch"]),
                   int(d.get("fence", 0)))


def _write_table(f: BinaryIO, rows: Iterable[tuple[bytes, bytes | None]], meta: dict[str, str]) -> bool:
    """Stream rows into an Arrow IPC file; returns whether keys came strictly ascending."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    schema = _schema().with_metadata({k: v.encode() for k, v in meta.items()})
    ascending = True
    prev: bytes | None = None
    keys: list[bytes] = []
    values: list[bytes | None] = []
    with ipc.new_file(f, schema) as w:
        for k, v in rows:
            if prev is not None and k <= prev:
                ascending = False
            prev = k
            keys.append(k)
            values.append(v)
            if len(keys) >= BATCH_ROWS:
                w.write_batch(pa.record_batch([pa.array(keys, pa.binary()), pa.array(values, pa.binary())],
                                              schema=schema))
                keys, values = [], []
        w.write_batch(pa.record_batch([pa.array(keys, pa.binary()), pa.array(values, pa.binary())],
                                      schema=schema))
    return ascending


def _bisect(keys: pa.ChunkedArray, key: bytes, *, right: bool, start: int = 0, end: int | None = None) -> int:
    """The first index of the sorted ``keys`` (in ``[start, end)``) holding a key above ``key`` (``right``) or at
    or above it."""
    lo, hi = start, len(keys) if end is None else end
    while lo < hi:
        mid = (lo + hi) // 2
        k = keys[mid].as_py()
        if k < key or (right and k == key):
            lo = mid + 1
        else:
            hi = mid
    return lo


class DurableState:
    """Base snapshot + per-epoch deltas for every partition under ``root`` (a local directory for now)."""

    def __init__(self, root: str, *, fsync: bool = True, remote: ObjectStore | None = None,
                 follow: bool = False) -> None:
        # pyarrow is loaded here, when a process opens durable state, never first inside an epoch (where an
        # interrupt could land in the import); `import charon` alone (a CLI call) does not load it
        import pyarrow.ipc  # noqa: F401

        self.root = root
        self.fs = _LocalFS(fsync=fsync)
        self.fs.makedirs(root)
        self.remote = remote
        #: ``follow`` (object storage only): other processes write the partitions too (a Spark driver, whose
        #: executors write the deltas): reads take the remote manifest when the cached one is older than the epoch
        #: read, and a write that meets a newer manifest (a compaction against new deltas) is made again over it
        self.follow = follow
        self._etags: dict[int, str | None] = {}  # pid -> ETag of the remote manifest this process knows
        self._fences: dict[int, int] = {}  # pid -> the fence this process writes it under (see claim)
        self.bytes_written = 0
        self.bytes_read = 0

    # ---- the remote copy ----------------------------------------------------------------------
    def _key(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _ship(self, path: str) -> None:
        """Upload a data file just written locally (before any manifest names it)."""
        if self.remote is not None:
            self.remote.put_file(self._key(path), path)

    def _fetch(self, path: str) -> None:
        """Download a data file the local cache lacks (:class:`FileNotFoundError` if the remote has none either)."""
        if self.remote is not None and not self.fs.exists(path):
            self.fs.makedirs(os.path.dirname(path))
            self.remote.get_file(self._key(path), path)

    def _remove(self, path: str) -> None:
        self.fs.remove(path)
        if self.remote is not None:
            with contextlib.suppress(StorageError):  # left for the next collection
                self.remote.delete(self._key(path))

    def hydrate(self, pid: int) -> Manifest:
        """Make the local cache's manifest the remote one (the remote is the truth); a partition the remote
        lacks but the cache has (a local directory moved onto object storage) is uploaded. Data files come
        later, as they are read. Returns the manifest."""
        if self.remote is None:
            return self.manifest(pid)
        with self._locked(pid):
            try:
                data, etag = self.remote.get(f"p{pid}/manifest.json")
            except ObjectNotFound:
                m = self.manifest(pid)
                self._etags[pid] = None
                if m.epoch >= 0 or m.base is not None:
                    names = ([m.base] if m.base is not None else []) + [self._delta_name(e) for e in m.deltas]
                    for name in names:
                        self._ship(self._path(pid, name))
                    self._commit(pid, lambda _: m)
                return m
            self._etags[pid] = etag
            m = Manifest.from_json(data)
            if self.manifest(pid) != m:
                self._write_local_manifest(pid, data)
            return m

    # ---- paths and manifest -------------------------------------------------------------------
    def _dir(self, pid: int) -> str:
        return self.fs.join(self.root, f"p{pid}")

    def _path(self, pid: int, name: str) -> str:
        return self.fs.join(self._dir(pid), name)

    @staticmethod
    def _delta_name(epoch: int) -> str:
        return f"delta-{epoch:012d}.arrow"

    def manifest(self, pid: int) -> Manifest:
        """The partition's current manifest (an empty one if none was written)."""
        try:
            return Manifest.from_json(self.fs.read_bytes(self._path(pid, "manifest.json")))
        except FileNotFoundError:
            return Manifest()

    def _write_local_manifest(self, pid: int, data: bytes) -> None:
        self.bytes_written += self.fs.write_atomic(self._path(pid, "manifest.json"), lambda f: f.write(data))

    def _pull(self, pid: int) -> Manifest:
        """Take the remote manifest (and its ETag) into the cache; the remote is the truth (a partition it lacks is
        empty, whatever the cache held). Call with the partition's lock held."""
        assert self.remote is not None
        try:
            data, etag = self.remote.get(f"p{pid}/manifest.json")
        except ObjectNotFound:
            self._etags[pid] = None
            self.fs.remove(self._path(pid, "manifest.json"))
            return Manifest()
        self._etags[pid] = etag
        m = Manifest.from_json(data)
        if self.manifest(pid) != m:
            self._write_local_manifest(pid, data)
        return m

    def refresh(self, pid: int, upto: int | None = None) -> None:
        """A follower's read (see ``follow``): take the remote manifest if the cached one is older than ``upto``
        (None or -1: always)."""
        if self.remote is None or not self.follow:
            return
        if upto is not None and upto >= 0 and self.manifest(pid).epoch >= upto:
            return  # (-1: the bulk load's bases, written by other processes at epoch -1)
        with self._locked(pid):
            self._pull(pid)

    def holds(self, pid: int, fence: int) -> bool:
        """Whether this process already claimed the partition as the writer generation ``fence`` (:meth:`claim`
        would change nothing)."""
        return self._fences.get(pid) == fence

    def claim(self, pid: int, fence: int) -> Manifest:
        """Write the partition from now on as the writer generation ``fence`` (object storage: a Spark gang's, larger
        for every new gang). The remote manifest is taken into the cache and, if an older generation wrote it,
        rewritten under ``fence``: from then on a writer of an older generation (a zombie task of a lost gang) is
        refused with :class:`~charon.storage.contract.StorageConflict` at its next write, and so is this one if
        a newer generation claims it (raised here at once if one already has). On a local directory the same,
        with the partition's file lock as the commit point."""
        if self._fences.get(pid) == fence:
            return self.manifest(pid)
        with self._locked(pid):
            m = self._pull(pid) if self.remote is not None else self.manifest(pid)
            self._check_fence(pid, m, fence)
            self._fences[pid] = fence
            if m.fence < fence:
                m = self._commit(pid, lambda cur: dataclasses.replace(cur)) or m
            return m

    def _commit(self, pid: int, change: Callable[[Manifest], Manifest | None], current: Manifest | None = None
                ) -> Manifest | None:
        """Replace the partition's manifest by ``change(current)`` (None: leave it); with object storage first
        there, the commit point, with ``If-Match`` on the ETag this process knows. A conflict: the writer is stale
        and :class:`~charon.storage.contract.StorageConflict` raised, except (a) its own write whose answer was lost
        (the same bytes there), (b) under a fence (:meth:`claim`), a manifest of the same or an older fence: a
        co-writer's (the driver's compaction) or an unclaimed one, ``change`` applied again over it, (c) an unfenced
        follower (``follow``: the driver), which applies it again over whatever is there. Call with the partition's
        lock; ``current``: on a directory, the manifest the caller read under it (not read again)."""
        remote = self.remote
        fence = self._fences.get(pid)
        if remote is None:
            cur = self.manifest(pid) if current is None else current
            self._check_fence(pid, cur)
            m = change(cur)
            if m is not None:
                m.fence = cur.fence if fence is None else fence
                self._write_local_manifest(pid, m.to_json())
            return m
        if pid not in self._etags:
            if fence is None and not self.follow:
                raise DurableStateError(f"p{pid}: hydrate() the partition before writing it")
            self._pull(pid)
        cur = self.manifest(pid)
        for _ in range(_REBASES):
            m = change(cur)
            if m is None:
                return None
            m.fence = cur.fence if fence is None else fence
            data = m.to_json()
            known = self._etags[pid]
            try:
                self._etags[pid] = remote.put(f"p{pid}/manifest.json", data, if_absent=known is None,
                                              if_match=known)
            except StorageConflict:
                try:
                    have_data, etag = remote.get(f"p{pid}/manifest.json")
                except ObjectNotFound:
                    have_data, etag = b"", None
                if have_data == data:  # our own write, its answer lost and the request retried
                    self._etags[pid] = etag
                    self._write_local_manifest(pid, data)
                    return m
                have = Manifest.from_json(have_data) if have_data else Manifest()
                if not (have.fence <= fence if fence is not None else self.follow):
                    raise StorageConflict(f"p{pid}: the manifest was written by another writer (fence "
                                          f"{have.fence}; this one {fence if fence is not None else 'unfenced'})"
                                          ) from None
                self._etags[pid] = etag
                if have_data:
                    self._write_local_manifest(pid, have_data)
                else:
                    self.fs.remove(self._path(pid, "manifest.json"))
                cur = have
                continue
            self._write_local_manifest(pid, data)
            return m
        raise StorageConflict(f"p{pid}: the manifest kept changing under this writer ({_REBASES} attempts)")

    def _check_fence(self, pid: int, cur: Manifest, fence: int | None = None) -> None:
        """Raise :class:`~charon.storage.contract.StorageConflict` if a newer writer generation than ``fence`` (by
        default this process's) claimed the partition (``cur``: its manifest, read under the lock)."""
        fence = self._fences.get(pid) if fence is None else fence
        if fence is not None and cur.fence > fence:
            raise StorageConflict(f"p{pid}: claimed by a newer writer (fence {cur.fence}, this one {fence})")

    @contextlib.contextmanager
    def _locked(self, pid: int) -> Iterator[None]:
        self.fs.makedirs(self._dir(pid))
        with self.fs.lock(self._path(pid, ".lock")):
            yield

    def latest_epoch(self, pid: int) -> int:
        """The last epoch recorded durably for the partition (-1 if none)."""
        return self.manifest(pid).epoch

    def recorded_epoch(self, pid: int) -> int:
        """The last epoch recorded for the partition as its writers left it: on object storage the remote manifest,
        read now (the local cache may be behind the executors' writes), else :meth:`latest_epoch`."""
        if self.remote is None:
            return self.latest_epoch(pid)
        try:
            data, _ = self.remote.get(f"p{pid}/manifest.json")
        except ObjectNotFound:
            return -1
        return Manifest.from_json(data).epoch

    # ---- writing ------------------------------------------------------------------------------
    def write_delta(self, pid: int, epoch: int, delta: dict[bytes, bytes | None]) -> None:
        """Record the writes of ``epoch`` (None deletes). A no-op if ``epoch`` is already recorded.

        On a directory the manifest is read once under the partition's lock (and once before it when a file is
        written outside it); under a fence (:meth:`claim`) the delta is written under the lock, after the fence
        held, straight to its name: no reader opens a delta its manifest does not list, and a listed one is
        never written again."""
        if self.remote is not None:
            if self.manifest(pid).epoch >= epoch:
                return
            self.fs.makedirs(self._dir(pid))
            self._write_delta_remote(pid, epoch, delta)
            return
        fenced = pid in self._fences
        if delta and not fenced:
            if self.manifest(pid).epoch >= epoch:
                return  # a replayed epoch: its file is not written again
            self.fs.makedirs(self._dir(pid))
            self._write_delta_file(pid, epoch, delta)
        with self._locked(pid):
            m = self.manifest(pid)
            if m.epoch >= epoch:
                return
            if delta and fenced:  # under the lock, after the fence held: a refused writer leaves no file behind
                self._check_fence(pid, m)
                self._write_delta_file(pid, epoch, delta, unlisted=True)
            if delta:
                m.deltas.append(epoch)
            m.epoch = epoch
            self._commit(pid, lambda _: m, current=m)

    def _write_delta_file(self, pid: int, epoch: int, delta: dict[bytes, bytes | None], *,
                          unlisted: bool = False) -> None:
        """The delta file of ``epoch``: under a temporary name renamed into place, or (``unlisted``: the caller
        holds the partition's lock and its manifest does not list the epoch) straight to its name, fsynced."""
        rows = sorted(delta.items())
        meta = {"charon": "delta", "pid": str(pid), "epoch": str(epoch)}
        path = self._path(pid, self._delta_name(epoch))
        if unlisted:
            self.bytes_written += self.fs.write_in_place(path, lambda f: _write_table(f, rows, meta))
            return
        self.bytes_written += self.fs.write_atomic(path, lambda f: _write_table(f, rows, meta), sync_dir=False)

    def _write_delta_remote(self, pid: int, epoch: int, delta: dict[bytes, bytes | None]) -> None:
        """As :meth:`write_delta` on object storage: the delta is uploaded (created once, see
        :meth:`_upload_delta`), the manifest committed (fenced), and only then the file written into the cache, so
        a refused (stale) writer leaves nothing behind in a cache it may share with the partition's new writer."""
        if pid not in self._etags and pid not in self._fences and not self.follow:
            raise DurableStateError(f"p{pid}: hydrate() the partition before writing it")
        name = self._delta_name(epoch)
        data = b""
        if delta:
            buf = io.BytesIO()
            _write_table(buf, sorted(delta.items()), {"charon": "delta", "pid": str(pid), "epoch": str(epoch)})
            data = buf.getvalue()
            self._upload_delta(pid, epoch, name, data)

        def change(m: Manifest) -> Manifest | None:
            if m.epoch >= epoch:
                return None
            return Manifest(m.base, m.base_epoch, m.deltas + ([epoch] if delta else []), epoch, m.fence)

        with self._locked(pid):
            if self._commit(pid, change) is not None and delta:
                self.bytes_written += self.fs.write_atomic(self._path(pid, name), lambda f: f.write(data))

    def _upload_delta(self, pid: int, epoch: int, name: str, data: bytes) -> None:
        """Create the delta's object; one already there (an earlier attempt's, one a truncation's delete missed, or
        a stale writer's never named by a manifest) is replaced, unless the writer is fenced out or the manifest
        already names that epoch's delta (then it is left as it is and the manifest's commit decides)."""
        assert self.remote is not None
        key = f"p{pid}/{name}"
        try:
            self.remote.put(key, data, if_absent=True)
            return
        except StorageConflict:
            pass
        fence = self._fences.get(pid)
        if fence is not None or self.follow:
            try:
                have = Manifest.from_json(self.remote.get(f"p{pid}/manifest.json")[0])
            except ObjectNotFound:
                have = Manifest()
            if fence is not None and have.fence > fence:
                raise StorageConflict(f"p{pid}: claimed by a newer writer (fence {have.fence}, this one {fence})")
            if epoch <= have.epoch:
                return
        self.remote.put(key, data)

    def write_base(self, pid: int, epoch: int, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Install a full snapshot as of ``epoch`` (the bulk load uses -1 or 0); drops deltas ≤ epoch."""
        self._swap_base(pid, epoch, self._write_base_file(pid, epoch, items), check=None)

    def _write_base_file(self, pid: int, epoch: int, rows: Iterable[tuple[bytes, bytes]]) -> str:
        self.fs.makedirs(self._dir(pid))
        name = f"base-{epoch:012d}-{uuid.uuid4().hex[:12]}.arrow"
        meta = {"charon": "base", "pid": str(pid), "epoch": str(epoch)}
        path = self._path(pid, name)
        self.bytes_written += self.fs.write_atomic(
            path, lambda f: _write_table(f, rows, meta), sync_dir=False
        )
        self._ship(path)
        return name

    def _write_base_table(self, pid: int, epoch: int, table: pa.Table) -> str:
        """A base file from a table sorted by key (the compaction's path: no Python object per item)."""
        import pyarrow as pa
        import pyarrow.ipc as ipc
        self.fs.makedirs(self._dir(pid))
        name = f"base-{epoch:012d}-{uuid.uuid4().hex[:12]}.arrow"
        schema = _schema().with_metadata({"charon": "base", "pid": str(pid), "epoch": str(epoch)})
        table = pa.Table.from_arrays([table.column("key"), table.column("value")], schema=schema)

        def write(f: BinaryIO) -> None:
            with ipc.new_file(f, schema) as w:
                w.write_table(table, max_chunksize=BATCH_ROWS)

        self.bytes_written += self.fs.write_atomic(self._path(pid, name), write, sync_dir=False)
        self._ship(self._path(pid, name))
        return name

    def _swap_base(self, pid: int, epoch: int, name: str, check: Callable[[Manifest], bool] | None) -> bool:
        with self._locked(pid):
            seen: list[Manifest] = []

            def change(cur: Manifest) -> Manifest | None:
                if check is not None and not check(cur):
                    return None
                seen[:] = [cur]
                return Manifest(name, epoch, [e for e in cur.deltas if e > epoch], max(cur.epoch, epoch), cur.fence)

            if self._commit(pid, change) is None:
                self._remove(self._path(pid, name))  # raced with another compaction or a truncation
                return False
            old = seen[0]
        # The new manifest is durable: what only the old one named is garbage now.
        if old.base is not None and old.base != name:
            self._remove(self._path(pid, old.base))
        for e in old.deltas:
            if e <= epoch:
                self._remove(self._path(pid, self._delta_name(e)))
        self._collect_garbage(pid)
        return True

    def _collect_garbage(self, pid: int) -> None:
        """Remove debris of killed writers: unreferenced old bases, stale deltas, old temp files."""
        m = self.manifest(pid)
        now = time.time()
        for name in self.fs.listdir(self._dir(pid)):
            path = self._path(pid, name)
            try:
                if name.startswith(".tmp-"):
                    if now - self.fs.mtime(path) > TMP_MAX_AGE:
                        self.fs.remove(path)
                elif self._is_garbage(name, m):
                    self.fs.remove(path)
            except FileNotFoundError:
                pass
        if self.remote is not None:
            with contextlib.suppress(StorageError):  # what a killed writer left in the bucket
                for o in self.remote.list(f"p{pid}/"):
                    if self._is_garbage(o.key.rsplit("/", 1)[-1], m):
                        self.remote.delete(o.key)

    @staticmethod
    def _is_garbage(name: str, m: Manifest) -> bool:
        if mb := _BASE_RE.match(name):  # bases newer than the current one may be a compaction in flight
            return name != m.base and int(mb.group(1)) <= m.base_epoch
        if md := _DELTA_RE.match(name):
            return int(md.group(1)) <= m.base_epoch
        return False

    def truncate_after(self, pid: int, epoch: int) -> None:
        """Forget every epoch after ``epoch`` (an epoch replayed after a crash will be recorded again)."""
        dropped: list[int] = []

        def change(m: Manifest) -> Manifest | None:
            if m.base_epoch > epoch:
                raise DurableStateError(
                    f"p{pid}: cannot truncate after {epoch}: compacted up to {m.base_epoch}"
                )
            if m.epoch <= epoch:
                return None
            dropped[:] = [e for e in m.deltas if e > epoch]
            return Manifest(m.base, m.base_epoch, [e for e in m.deltas if e <= epoch], epoch, m.fence)

        with self._locked(pid):
            if self._commit(pid, change) is None:
                return
        for e in sorted(dropped, reverse=True):
            self._remove(self._path(pid, self._delta_name(e)))

    # ---- reading ------------------------------------------------------------------------------
    def _read_rows(self, path: str) -> tuple[list[bytes], list[bytes | None]]:
        import pyarrow.ipc as ipc
        self._fetch(path)
        self.bytes_read += self.fs.size(path)
        with self.fs.open_arrow(path) as src:
            t = ipc.open_file(src).read_all()
        return t.column("key").to_pylist(), t.column("value").to_pylist()

    def _read_delta(self, pid: int, epoch: int) -> dict[bytes, bytes | None]:
        keys, values = self._read_rows(self._path(pid, self._delta_name(epoch)))
        return dict(zip(keys, values, strict=True))

    def _retry(self, fn: Callable[[], T], pid: int | None = None) -> T:
        # a concurrent compaction may delete files named by the manifest we read: read it again (with object
        # storage, the remote one: the compaction may have run in another process)
        for attempt in range(20):
            try:
                return fn()
            except FileNotFoundError:
                if attempt == 19:
                    raise
                if self.remote is not None and pid is not None:
                    with self._locked(pid):
                        self._pull(pid)
                time.sleep(0.005 * (attempt + 1))
        raise AssertionError("unreachable")

    def _merge(self, pid: int, m: Manifest, upto: int) -> tuple[dict[bytes, bytes], int]:
        if m.base_epoch > upto:
            raise DurableStateError(f"p{pid}: state as of {upto} was compacted into base {m.base_epoch}")
        state: dict[bytes, bytes] = {}
        if m.base is not None:
            keys, values = self._read_rows(self._path(pid, m.base))
            state = dict(zip(keys, values, strict=True))  # type: ignore[arg-type]
        for e in m.deltas:
            if e > upto:
                break
            for k, v in self._read_delta(pid, e).items():
                if v is None:
                    state.pop(k, None)
                else:
                    state[k] = v
        return state, min(upto, m.epoch)

    def _read_table(self, path: str) -> pa.Table:
        import pyarrow.ipc as ipc
        self._fetch(path)
        self.bytes_read += self.fs.size(path)
        with self.fs.open_arrow(path) as src:
            return ipc.open_file(src).read_all()

    def _merge_table(self, pid: int, m: Manifest, upto: int) -> tuple[pa.Table, int]:
        """As :meth:`_merge`, in Arrow (no Python object per item): the base and the deltas ≤ ``upto``
        concatenated, sorted by key with the newest write first, the first row per key kept, deletes dropped.
        The result is sorted by key; it may reference the memory-mapped files, which stay mapped while it lives
        (on Linux even after a later compaction deleted them)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if m.base_epoch > upto:
            raise DurableStateError(f"p{pid}: state as of {upto} was compacted into base {m.base_epoch}")
        paths = ([self._path(pid, m.base)] if m.base is not None else []) + [
            self._path(pid, self._delta_name(e)) for e in m.deltas if e <= upto]
        parts = []
        for order, path in enumerate(paths):  # order: base 0, then deltas oldest first
            t = self._read_table(path)
            parts.append(pa.table({"key": t.column("key"), "value": t.column("value"),
                                   "order": pa.repeat(pa.scalar(order, pa.int32()), t.num_rows)}))
        reached = min(upto, m.epoch)
        if not parts:
            return pa.table({"key": pa.array([], pa.binary()), "value": pa.array([], pa.binary())}), reached
        if len(parts) == 1:  # a base alone: already sorted, unique, without deletes
            t = parts[0]
        else:
            t = pa.concat_tables(parts)
            t = t.take(pc.sort_indices(t, sort_keys=[("key", "ascending"), ("order", "descending")]))
            keys = t.column("key").combine_chunks()
            first = pc.not_equal(keys.slice(1), keys.slice(0, max(0, len(keys) - 1)))  # keys are never null
            newest = pa.concat_arrays([pa.array([True] if len(keys) else [], pa.bool_()), first])
            t = t.filter(pc.and_(newest, pc.is_valid(t.column("value"))))
        t = t.select(["key", "value"]).combine_chunks()
        return t, reached

    def load_table(self, pid: int, upto_epoch: int | None = None) -> tuple[pa.Table, int]:
        """As :meth:`load`, as an Arrow table (``key``, ``value``) sorted by key: the restore path for big states."""

        def attempt() -> tuple[pa.Table, int]:
            m = self.manifest(pid)
            return self._merge_table(pid, m, m.epoch if upto_epoch is None else upto_epoch)

        self.refresh(pid, upto_epoch)
        return self._retry(attempt, pid)

    def iter_range(self, pid: int, upto_epoch: int, lo: bytes, hi: bytes,
                   window: int = 256) -> Iterator[tuple[bytes, bytes]]:
        """The state's rows ``lo <= key < hi`` as of ``upto_epoch``, in key order, lazily: every file (sorted by
        key, memory-mapped) is entered by binary search and read ``window`` rows at a time (doubling), merged
        only up to the smallest key every file was read past, so a page costs about its own rows, not the
        state's. Raises :class:`DurableStateError` if the base is already newer than ``upto_epoch``."""

        def open_files() -> list[pa.Table]:
            m = self.manifest(pid)
            if m.base_epoch > upto_epoch:
                raise DurableStateError(f"p{pid}: state as of {upto_epoch} was compacted into base {m.base_epoch}")
            paths = ([self._path(pid, m.base)] if m.base is not None else []) + [
                self._path(pid, self._delta_name(e)) for e in m.deltas if e <= upto_epoch]
            return [self._read_table(path) for path in paths]  # oldest first: a later row wins

        self.refresh(pid, upto_epoch)
        tables = self._retry(open_files, pid)  # written sorted by key; mapped, never copied (chunks stay as written)
        keys = [t.column("key") for t in tables]
        values = [t.column("value") for t in tables]
        starts = [_bisect(k, lo, right=False) for k in keys]
        ends = [_bisect(k, hi, right=False) for k in keys]
        while any(s < e for s, e in zip(starts, ends, strict=True)):
            stops = [min(s + window, e) for s, e in zip(starts, ends, strict=True)]
            more = [k[stop - 1].as_py() for k, stop, e in zip(keys, stops, ends, strict=True) if stop < e]
            cut = min(more) if more else None  # every file is read up to and including this key
            merged: dict[bytes, bytes | None] = {}
            for f, (k, v) in enumerate(zip(keys, values, strict=True)):
                stop = stops[f] if cut is None else _bisect(k, cut, right=True, start=starts[f], end=ends[f])
                merged.update(zip(k.slice(starts[f], stop - starts[f]).to_pylist(),
                                  v.slice(starts[f], stop - starts[f]).to_pylist(), strict=True))
                starts[f] = stop
            for key in sorted(merged):
                value = merged[key]
                if value is not None:
                    yield key, value
            window *= 2

    def iter_prefix(self, pid: int, upto_epoch: int, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The state's rows whose key starts with ``prefix`` (not empty) as of ``upto_epoch``, in key order
        (:meth:`iter_range`)."""
        head = prefix.rstrip(b"\xff")
        if not head:
            raise ValueError("a prefix of only 0xff bytes has no range end")
        return self.iter_range(pid, upto_epoch, prefix, head[:-1] + bytes([head[-1] + 1]))

    def load(self, pid: int, upto_epoch: int | None = None) -> tuple[dict[bytes, bytes], int]:
        """The state as of ``upto_epoch`` (default: latest): base merged with deltas ≤ upto_epoch.

        Returns ``(state, epoch_reached)``; epoch_reached < upto_epoch if less was recorded.
        Raises :class:`DurableStateError` if the base is already newer than ``upto_epoch``.
        """

        def attempt() -> tuple[dict[bytes, bytes], int]:
            m = self.manifest(pid)
            return self._merge(pid, m, m.epoch if upto_epoch is None else upto_epoch)

        self.refresh(pid, upto_epoch)
        return self._retry(attempt, pid)

    def read_keys(self, pid: int, keys: list[bytes], upto_epoch: int) -> tuple[dict[bytes, bytes | None], int]:
        """The values of ``keys`` as of ``upto_epoch`` (None = absent), and the epoch reached.

        Raises :class:`DurableStateError` if the base is already newer than ``upto_epoch``."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.ipc as ipc

        wanted = pa.array(sorted(set(keys)), pa.binary())

        def pick(path: str) -> dict[bytes, bytes | None]:
            self._fetch(path)
            self.bytes_read += self.fs.size(path)
            with self.fs.open_arrow(path) as src:
                t = ipc.open_file(src).read_all()
            t = t.filter(pc.is_in(t.column("key"), value_set=wanted))
            return dict(zip(t.column("key").to_pylist(), t.column("value").to_pylist(), strict=True))

        def attempt() -> tuple[dict[bytes, bytes | None], int]:
            m = self.manifest(pid)
            if m.base_epoch > upto_epoch:
                raise DurableStateError(f"p{pid}: state as of {upto_epoch} was compacted into base {m.base_epoch}")
            state: dict[bytes, bytes | None] = dict.fromkeys(keys)
            if m.base is not None:
                state.update(pick(self._path(pid, m.base)))
            for e in m.deltas:
                if e > upto_epoch:
                    break
                state.update(pick(self._path(pid, self._delta_name(e))))
            return state, min(upto_epoch, m.epoch)

        self.refresh(pid, upto_epoch)
        return self._retry(attempt, pid)

    def deltas_after(
        self, pid: int, epoch: int, upto: int | None = None
    ) -> tuple[list[tuple[int, dict[bytes, bytes | None]]], int] | None:
        """The deltas of epochs in (epoch, upto] in order, and the epoch they reach.

        None if they are no longer available separately (compacted into a base after ``epoch``):
        the caller must do a full :meth:`load`.
        """

        def attempt() -> tuple[list[tuple[int, dict[bytes, bytes | None]]], int] | None:
            m = self.manifest(pid)
            hi = m.epoch if upto is None else upto
            if m.base_epoch > epoch:
                return None
            out = [(e, self._read_delta(pid, e)) for e in m.deltas if epoch < e <= hi]
            return out, max(epoch, min(hi, m.epoch))

        self.refresh(pid, upto)
        return self._retry(attempt, pid)

    # ---- compaction ---------------------------------------------------------------------------
    def compact(self, pid: int, upto_epoch: int) -> bool:
        """Merge the base and the deltas ≤ upto_epoch into a new base; returns whether it did.

        Crash-safe: the new base is complete before the manifest names it, and superseded files are
        deleted only after the new manifest is durable. Only compact epochs that are committed for good
        (a replay must never need a state older than the base).
        """

        def attempt() -> tuple[Manifest, int, pa.Table] | None:
            m = self.manifest(pid)
            upto = min(upto_epoch, m.epoch)
            if upto <= m.base_epoch or not any(m.base_epoch < e <= upto for e in m.deltas):
                return None  # nothing to merge
            table, reached = self._merge_table(pid, m, upto)
            return m, reached, table

        self.refresh(pid)
        got = self._retry(attempt, pid)
        if got is None:
            with self._locked(pid):  # a compaction killed after its swap may have left superseded files
                self._collect_garbage(pid)
            return False
        m, reached, table = got
        name = self._write_base_table(pid, reached, table)
        del table

        def unchanged(cur: Manifest) -> bool:
            # no concurrent compaction or truncation touched what we merged
            return (cur.base == m.base and cur.epoch >= reached
                    and [e for e in cur.deltas if e <= reached] == [e for e in m.deltas if e <= reached])

        return self._swap_base(pid, reached, name, check=unchanged)

    def files(self, pid: int) -> list[str]:
        """Names of the data files in the partition directory (for tests and tooling)."""
        return sorted(n for n in self.fs.listdir(self._dir(pid)) if n.endswith(".arrow"))


def preload() -> None:
    """Run a tiny table through what a restore does (an Arrow IPC file written and read, merged by key), so that a
    process about to serve rounds pays the first use's costs now, not in its first round: pyarrow's compute and IPC
    modules, and the pandas it imports on its first conversion when pandas is installed (~0.25 s in all here)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.ipc as ipc

    buf = io.BytesIO()
    _write_table(buf, [(b"k", b"v"), (b"l", None)], {"charon": "preload"})
    t = ipc.open_file(pa.BufferReader(buf.getvalue())).read_all()
    t.take(pc.sort_indices(t, sort_keys=[("key", "ascending")])).filter(pc.is_valid(t.column("value")))


def is_remote_location(location: str) -> bool:
    """Whether a durable-state location names object storage (``<storage URL>/<state dir>``), not a directory."""
    return "://" in location


def durable_at(location: str, cache: str, *, fsync: bool = True) -> DurableState:
    """The durable state at ``location``: a directory (used as it is; ``cache`` unused), or on object storage
    ``<storage URL>/<state dir>`` (``s3://bucket/prefix/state``, ``file:///dir/state``), cached in the local
    directory ``cache``, its writes fenced per partition (:meth:`DurableState.claim`) and its reads taking the
    remote manifest when the cached one is older (``follow``): the executors' view of a Spark checkpoint on
    object storage."""
    if not is_remote_location(location):
        return DurableState(location, fsync=fsync)
    from charon.storage.location import open_storage
    from charon.storage.prefix import Prefixed

    url, name = location.rstrip("/").rsplit("/", 1)
    return DurableState(cache, fsync=fsync, remote=Prefixed(open_storage(url, fsync=fsync), name), follow=True)
