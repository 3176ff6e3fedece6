"""Executor-local partition state on LMDB, versioned by epoch, restored from the durable copy on demand.

One LMDB environment per partition directory (``path/p{pid}``) with two named databases: ``data`` (the
state) and ``meta`` (``epoch``: the last committed epoch, 8-byte signed big-endian; absent in a fresh env).
A commit writes the epoch's delta and the epoch marker in one write transaction, after the delta was made
durable (:mod:`charon.state.durable`), so the local copy is never ahead of the durable one.

Multi-process rules (measured, see DESIGN.md §6): never open an environment in a process that later forks;
handles are cached per ``(path, os.getpid())``; one constant ``map_size``; locking stays on;
``reader_check()`` runs on open to free reader slots of killed processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import lmdb

from charon.state.durable import DurableState, DurableStateError, durable_at

MAP_SIZE = 1 << 34  # 16 GiB of address space (sparse); must be the same in every process
_EPOCH_KEY = b"epoch"
_EPOCH = struct.Struct(">q")


class StoreError(Exception):
    """The local store cannot reach the requested version."""


class _Env:
    """An open environment and its two databases, owned by one process."""

    def __init__(self, path: str, map_size: int, sync: bool) -> None:
        self.path = path
        self.env = self._open(path, map_size, sync)
        self.data = self.env.open_db(b"data")
        self.meta = self.env.open_db(b"meta")
        self.fresh = False

    @staticmethod
    def _open(path: str, map_size: int, sync: bool) -> lmdb.Environment:
        os.makedirs(path, exist_ok=True)
        # metasync=False: one flush per commit, not two; a system crash may then undo the last commit (never
        # tear one), which leaves the local copy behind the durable one: ensure_epoch applies the missing deltas
        env = lmdb.open(path, map_size=map_size, subdir=True, max_dbs=2, lock=True, sync=sync, metasync=False,
                        readahead=False, max_readers=256)
        env.reader_check()
        return env


_ENVS: dict[tuple[str, int], _Env] = {}
_ENVS_LOCK = threading.Lock()


def _get_env(path: str, map_size: int, sync: bool) -> _Env:
    """The process's handle on the environment at ``path``; a corrupt environment is recreated empty."""
    key = (os.path.realpath(path), os.getpid())
    with _ENVS_LOCK:
        e = _ENVS.get(key)
        if e is None:
            try:
                e = _Env(path, map_size, sync)
            except lmdb.Error:
                # not an LMDB file / corrupted / version mismatch: drop it; the durable copy restores it
                shutil.rmtree(path, ignore_errors=True)
                e = _Env(path, map_size, sync)
            _ENVS[key] = e
        return e


def _drop_env(path: str) -> None:
    key = (os.path.realpath(path), os.getpid())
    with _ENVS_LOCK:
        e = _ENVS.pop(key, None)
    if e is not None:
        e.env.close()


class LmdbStore:
    """A :class:`charon.state.store.PartitionStore` on an executor-local LMDB environment.

    ``epoch`` is read from the environment (another process may have committed). Reads use the active
    read transaction of :meth:`begin_read` (one per round), else a short one per call.
    """

    def __init__(
        self,
        path: str,
        pid: int,
        durable: DurableState | None = None,
        map_size: int = MAP_SIZE,
        *,
        sync: bool = True,
    ) -> None:
        self.path = os.path.join(path, f"p{pid}")
        self.pid = pid
        self.durable = durable
        self.map_size = map_size
        self.sync = sync
        self.bytes_read = 0
        self.bytes_written = 0
        self._rtxn: lmdb.Transaction[bytes] | None = None
        self._rtxn_pid = 0
        self._h = _get_env(self.path, map_size, sync)
        self._owner = os.getpid()

    # ---- handles ------------------------------------------------------------------------------
    @property
    def _env(self) -> _Env:
        if os.getpid() != self._owner:  # forked: never touch the parent's handle
            self._h = _get_env(self.path, self.map_size, self.sync)
            self._owner = os.getpid()
            self._rtxn = None
        return self._h

    def close(self) -> None:
        """End any read transaction and close this process's handle on the environment."""
        self.end_read()
        _drop_env(self.path)

    # ---- reads --------------------------------------------------------------------------------
    def begin_read(self) -> None:
        """Open the read transaction that ``get``/``scan``/``epoch`` use until :meth:`end_read`."""
        self.end_read()
        h = self._env
        self._rtxn = h.env.begin(db=h.data, buffers=False)

    def end_read(self) -> None:
        """Release the read transaction (do it at the end of every round: readers pin old pages)."""
        t, self._rtxn = self._rtxn, None
        if t is not None and self._owner == os.getpid():
            t.abort()

    @contextlib.contextmanager
    def reading(self) -> Iterator[LmdbStore]:
        """``with store.reading(): ...`` = one read transaction (a consistent snapshot) for the block."""
        self.begin_read()
        try:
            yield self
        finally:
            self.end_read()

    @contextlib.contextmanager
    def _txn(self) -> Iterator[lmdb.Transaction[bytes]]:
        h = self._env
        if self._rtxn is not None:
            yield self._rtxn
        else:
            with h.env.begin(db=h.data, buffers=False) as t:
                yield t

    def _local_epoch(self, txn: lmdb.Transaction[bytes]) -> int | None:
        v = txn.get(_EPOCH_KEY, db=self._env.meta)
        return None if v is None else _EPOCH.unpack(v)[0]

    @property
    def epoch(self) -> int:
        """Last epoch committed into the local copy (-1 = empty / never restored)."""
        with self._txn() as t:
            e = self._local_epoch(t)
        return -1 if e is None else e

    def get(self, key: bytes) -> bytes | None:
        t = self._rtxn
        if t is not None:  # the round's read transaction (the hot path)
            v = t.get(key)
        else:
            with self._txn() as t:
                v = t.get(key)
        if v is not None:
            self.bytes_read += len(key) + len(v)
        return v

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Items whose key starts with ``prefix``, ascending."""
        with self._txn() as t:
            cur = t.cursor()
            if not cur.set_range(prefix):
                return
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                self.bytes_read += len(k) + len(v)
                yield k, v

    # ---- writes -------------------------------------------------------------------------------
    def commit(self, epoch: int, delta: dict[bytes, bytes | None]) -> None:
        """Make ``delta`` the writes of ``epoch``: durable copy first, then one local write transaction.

        A no-op if the local copy already holds ``epoch`` (a replayed epoch). Keys must be 1..511 bytes
        (LMDB's key limit); a bad key raises ValueError before anything is written."""
        h = self._env
        with self._txn() as t:
            local = self._local_epoch(t)
        if local is not None and epoch <= local:
            return
        limit = h.env.max_key_size()
        for k in delta:
            if not 0 < len(k) <= limit:
                raise ValueError(f"LMDB keys must be 1..{limit} bytes, got {len(k)}: {k[:40]!r}...")
        d = self.durable
        if d is not None:
            m = d.manifest(self.pid)
            if m.epoch < epoch:  # else: a replayed epoch already recorded durably
                fresh_durable = m.base is None and m.epoch == -1
                if (m.epoch > local) if local is not None else not fresh_durable:
                    raise StoreError(
                        f"p{self.pid}: local copy at {local} is behind the durable copy at {m.epoch}: "
                        f"call ensure_epoch({epoch - 1}) before the epoch's reads"
                    )
                before = d.bytes_written
                d.write_delta(self.pid, epoch, delta)
                self.bytes_written += d.bytes_written - before
        with h.env.begin(write=True, db=h.data) as t:
            cur = self._local_epoch(t)
            if cur is not None and epoch <= cur:
                t.abort()  # a concurrent (stale) task committed it meanwhile
                return
            written = _apply(t, delta)
            t.put(_EPOCH_KEY, _EPOCH.pack(epoch), db=h.meta)
        self.bytes_written += written

    def _replace_all(
        self, epoch: int, items: Iterable[tuple[bytes, bytes]], expect: int | None | bool = False
    ) -> None:
        """Replace the whole local state (sorted items) and the epoch marker in one transaction."""
        h = self._env
        written = 0
        with h.env.begin(write=True, db=h.data) as t:
            if expect is not False and self._local_epoch(t) != expect:
                t.abort()  # another process moved the local copy meanwhile: leave it
                return
            t.drop(h.data, delete=False)
            cur = t.cursor()
            for k, v in items:
                cur.put(k, v, append=True)
                written += len(k) + len(v)
            t.put(_EPOCH_KEY, _EPOCH.pack(epoch), db=h.meta)
        self.bytes_written += written

    def bulk_load(self, epoch: int, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Install an initial state as of ``epoch`` (e.g. -1): durable base first, then the local copy."""
        rows = sorted(items)
        if self.durable is not None:
            before = self.durable.bytes_written
            self.durable.write_base(self.pid, epoch, rows)
            self.bytes_written += self.durable.bytes_written - before
        self._replace_all(epoch, rows)

    # ---- versioning ---------------------------------------------------------------------------
    # Two operations, one owner each: ``catch_up`` only ever moves the local copy forward (anyone may call
    # it, e.g. state reads); ``ensure_epoch`` may also roll back, and only an epoch's rounds call it (the
    # driver runs epoch N+1 only when it decided that nothing after N is committed: its crash recovery).
    def catch_up(self, epoch: int) -> int:
        """Bring the local copy forward to at least ``epoch`` from the durable copy; never backward.

        Returns the local epoch afterwards (> ``epoch`` when the copy was already ahead)."""
        self.end_read()
        while True:  # another process may move the copy meanwhile: look again after each step
            with self._txn() as t:
                cur = self._local_epoch(t)
            if cur is not None and cur >= epoch:
                return cur
            self._forward(cur, epoch)

    def ensure_epoch(self, epoch: int) -> None:
        """Make the local copy hold exactly the state as of ``epoch`` (an epoch's rounds call this, only).

        Missing or behind: apply the missing durable deltas (or reload fully if they were compacted).
        Ahead (an epoch replayed after a crash): forget the durable epochs after ``epoch`` and rebuild
        the local copy as of ``epoch``. State reads must use :meth:`catch_up` / :meth:`read_at` instead.
        """
        cur = self.catch_up(epoch)
        if cur > epoch:
            self._rewind(epoch)

    def _rewind(self, epoch: int) -> None:
        d = self.durable
        if d is None:
            raise StoreError(f"p{self.pid}: local copy ahead of {epoch}, and no durable copy")
        try:
            d.truncate_after(self.pid, epoch)
        except DurableStateError as e:
            raise StoreError(str(e)) from e
        self._reload(epoch)

    def _forward(self, cur: int | None, epoch: int) -> None:
        """Apply durable deltas (cur, epoch]; nothing if another process moved the local copy meanwhile."""
        d = self.durable
        if d is None:
            raise StoreError(f"p{self.pid}: local copy at {cur}, need {epoch}, and no durable copy")
        got = d.deltas_after(self.pid, cur, epoch) if cur is not None else None
        if got is None:
            self._reload(epoch, expect=cur)
            return
        deltas, reached = got
        if reached < epoch:
            raise StoreError(f"p{self.pid}: durable copy reaches only epoch {reached}, need {epoch}")
        h = self._env
        written = 0
        before = d.bytes_read
        with h.env.begin(write=True, db=h.data) as t:
            if self._local_epoch(t) != cur:
                t.abort()
                return  # another process moved it meanwhile
            for _, delta in deltas:
                written += _apply(t, delta)
            t.put(_EPOCH_KEY, _EPOCH.pack(epoch), db=h.meta)
        self.bytes_written += written
        self.bytes_read += d.bytes_read - before

    def read_at(self, epoch: int, keys: list[bytes]) -> dict[bytes, bytes | None]:
        """The values of ``keys`` as of exactly ``epoch`` (a consistent cut), never moving state back.

        Catches the local copy up if it is behind; if it is already ahead (a later epoch finalized but not
        yet recorded), the keys are read as of ``epoch`` from the durable copy instead."""
        self.catch_up(epoch)
        with self.reading():
            local = self.epoch
            if local == epoch:
                return {k: self.get(k) for k in keys}
        d = self.durable
        if d is None:
            raise StoreError(f"p{self.pid}: local copy at {local}, need {epoch}, and no durable copy")
        try:
            got, reached = d.read_keys(self.pid, keys, epoch)
        except DurableStateError as e:
            raise StoreError(str(e)) from e
        if reached < epoch:
            raise StoreError(f"p{self.pid}: durable copy reaches only epoch {reached}, need {epoch}")
        return got

    def _reload(self, epoch: int, expect: int | None | bool = False) -> None:
        """Replace the local copy by the durable state as of ``epoch`` (if the local epoch is still
        ``expect``, when given: a catch-up must not undo another process's progress)."""
        d = self.durable
        assert d is not None
        before = d.bytes_read
        try:
            table, reached = d.load_table(self.pid, epoch)  # merged in Arrow, sorted by key
        except DurableStateError as e:
            raise StoreError(str(e)) from e
        self.bytes_read += d.bytes_read - before
        if reached < epoch:
            raise StoreError(f"p{self.pid}: durable copy reaches only epoch {reached}, need {epoch}")
        self._replace_all(epoch, _rows(table), expect)

    def compact_durable(self, upto_epoch: int) -> bool:
        """Compact this partition's durable copy up to ``upto_epoch`` (only epochs committed for good)."""
        return self.durable.compact(self.pid, upto_epoch) if self.durable is not None else False

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """All items, ascending."""
        return self.scan(b"")


_STORES: dict[tuple[str, int, str | None, int, int | None], LmdbStore] = {}
_DURABLES: dict[tuple[str, int, int | None], DurableState] = {}


def _rows(table: Any) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) rows of a sorted Arrow table, a batch of Python objects at a time (bounded memory)."""
    for batch in table.to_batches(max_chunksize=65536):
        yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)


def _apply(t: lmdb.Transaction[bytes], delta: dict[bytes, bytes | None]) -> int:
    """Write one delta (None deletes) in key order inside ``t``; returns the bytes written."""
    written = 0
    for k in sorted(delta):
        v = delta[k]
        if v is None:
            t.delete(k)
            written += len(k)
        else:
            t.put(k, v)
            written += len(k) + len(v)
    return written


def open_store(path: str, pid: int, durable_root: str | None = None, writer: int | None = None) -> LmdbStore:
    """The calling process's cached store for partition ``pid`` under ``path`` (use this on executors).

    ``writer``: the writer generation (a resident gang's fence, :meth:`DurableState.claim`) the store writes the
    durable copy as: each generation has its own durable handle, as each task has in its own process, so a task
    of an older gang run later in this process (the seeded simulator's zombie) is fenced like one elsewhere. A
    newer generation's store retires this process's older ones of the partition (their handles stay with whoever
    holds them)."""
    me = os.getpid()
    where = (os.path.realpath(path), pid, durable_root, me)
    key = (*where, writer)
    with _ENVS_LOCK:
        s = _STORES.get(key)
    if s is None:
        durable = None
        if durable_root is not None:
            durable = _DURABLES.get((durable_root, me, writer))
            if durable is None:
                # a directory, or object storage cached beside the stores (charon.state.durable.durable_at)
                durable = _DURABLES[(durable_root, me, writer)] = durable_at(durable_root,
                                                                             os.path.join(path, "durable"))
        s = LmdbStore(path, pid, durable)
        with _ENVS_LOCK:
            s = _STORES.setdefault(key, s)
            if writer is not None:  # older generations' handles: retired (bounded by the live writers)
                for k in [k for k in _STORES if k[:4] == where and k[4] is not None and k[4] < writer]:
                    del _STORES[k]
                for d in [d for d in _DURABLES if d[:2] == (durable_root, me) and d[2] is not None
                          and d[2] < writer]:
                    del _DURABLES[d]
    return s


def opened() -> frozenset[tuple[str, int]]:
    """The environments this process holds open now (see :func:`close_opened_since`)."""
    with _ENVS_LOCK:
        return frozenset(_ENVS)


def close_opened_since(before: frozenset[tuple[str, int]]) -> int:
    """Close the stores and environments this process opened since ``before`` (:func:`opened`): what a
    worker process's exit does, for a process that hosts many short-lived deployments (a test suite); returns
    how many environments it closed."""
    me = os.getpid()
    with _ENVS_LOCK:
        keys = [k for k in _STORES if k[3] == me and (os.path.join(k[0], f"p{k[1]}"), me) not in before]
        stores = [_STORES.pop(k) for k in keys]
        envs = [_ENVS.pop(k) for k in list(_ENVS) if k not in before and k[1] == me]
    for st in stores:
        st.end_read()
    for e in envs:
        e.env.close()
    return len(envs)


def close_stores(under: str, keep_durable_root: str) -> None:
    """Close this process's cached stores under local directory ``under`` except those restored from
    ``keep_durable_root`` (the stores of a layout a rescale retired; their files are deleted next)."""
    me = os.getpid()
    prefix = os.path.realpath(under) + os.sep
    with _ENVS_LOCK:
        gone = [k for k in _STORES if k[3] == me and (k[0] + os.sep).startswith(prefix) and k[2] != keep_durable_root]
        stores = [_STORES.pop(k) for k in gone]
    for s in stores:
        s.close()
