"""Durable embedded logs on SQLite (WAL mode): the partitioned input log and the output log.

Input log (:class:`InputLog`)
    Requests are appended to one of ``partitions`` partitions; each partition numbers its entries with dense
    offsets ``0, 1, 2, ...`` that are never reused, not even after :meth:`InputLog.truncate`. The default
    partition of a request is ``zlib.crc32(key) % route`` (the key string, UTF-8; ``route`` is the routing
    count, :meth:`InputLog.resize` changes it online; physical partitions only grow). Each append is one
    SQLite write transaction (``BEGIN IMMEDIATE``), so several threads and processes can append to the same
    file; :meth:`InputLog.append_many` appends a whole batch in one transaction (group commit).

    Appends are idempotent by ``request_id``: a request whose id was ever appended is not appended again and
    the original ``(partition, offset)`` is returned. The id index is kept when entries are truncated, so a
    client retry with the same idempotency key executes once even after retention removed the request.

    With ``durable=True`` (the default) SQLite runs with ``synchronous=FULL``: an append that returned
    survives a power loss (~0.4 ms per commit on the reference machine). ``durable=False`` uses ``NORMAL``:
    still safe against process crashes, not against OS crashes.

Output log (:class:`OutputLog`)
    Replies keyed by ``request_id``; a reply is stored at most once (``INSERT OR IGNORE``), so a replayed
    epoch cannot deliver a reply twice. Each stored reply gets a sequence number ``seq`` (1, 2, ...,
    strictly increasing in commit order and never reused) that consumers use as their read position.

Both classes keep one SQLite connection per thread and re-open their connections in a child process (they
are safe to create before a ``fork``, but a connection is never shared across processes).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import msgspec

from charon.log.offsets import pad_offsets
from charon.messages import Reply, Request
from charon.serde import decode_reply, decode_request, encode_reply, encode_request

if TYPE_CHECKING:
    from charon.log.contract import InputLogLike, OutputLogLike

__all__ = ["DedupRetention", "InputLog", "OutputLog", "SQLiteFile", "log_partition_of"]

BUSY_TIMEOUT_S = 10.0
#: page cache per connection (KiB; SQLite's default is 2,000). Every thread that touches a log has its own
#: connection (the gateway's read pool, the log pump, Spark's batch thread...), so this bounds their sum;
#: reads are indexed point lookups and short ranges, the OS page cache does the rest.
CACHE_KIB = int(os.environ.get("CHARON_SQLITE_CACHE_KIB", "256"))


# _BLOB: blobs are bound as ``bytearray``, which the sqlite3 module binds as a BLOB directly; a ``bytes`` parameter
# first goes through its adapter lookup, which fails with an AttributeError made and cleared per parameter (~0.4 µs
# a row on the appends and reply writes). The stored value is the same BLOB and reads back as ``bytes``.


def write_stamp(path: str) -> tuple[tuple[int, int] | None, ...]:
    """What changes whenever the SQLite log at ``path`` is written (WAL mode: its ``-wal`` file, or the database
    file after a checkpoint): ``(mtime_ns, size)`` of each, None for one that does not exist. A reader polls it
    (a ``stat``) instead of querying the log."""
    out: list[tuple[int, int] | None] = []
    for name in (path + "-wal", path):
        try:
            st = os.stat(name)
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


def log_partition_of(key: str, partitions: int) -> int:
    """Default input-log partition of a request: crc32 of its key string mod ``partitions``."""
    return zlib.crc32(key.encode()) % partitions


class SQLiteFile:
    """Per-thread (and per-process) SQLite connections to one database file in WAL mode (the logs' and the
    stream log's, :mod:`charon.log.streams`)."""

    def __init__(self, path: str | os.PathLike[str], durable: bool) -> None:
        self.path = os.fspath(path)
        self._sync = "FULL" if durable else "NORMAL"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[tuple[threading.Thread, sqlite3.Connection]] = []  # (owner, connection)
        self._pid = os.getpid()
        self._closed = False

    def conn(self) -> sqlite3.Connection:
        if self._pid != os.getpid():  # forked: never touch the parent's connections
            with self._lock:
                self._pid = os.getpid()
                self._conns = []
                self._local = threading.local()
        c = getattr(self._local, "conn", None)
        if c is None:
            if self._closed:
                raise ValueError(f"log {self.path!r} is closed")
            c = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            c.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            mode = c.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                c.close()
                raise OSError(f"could not put {self.path!r} in WAL mode (got {mode!r})")
            c.execute(f"PRAGMA synchronous={self._sync}")
            c.execute(f"PRAGMA cache_size=-{max(16, CACHE_KIB)}")
            self._local.conn = c
            with self._lock:
                # a thread's connection outlives it (threading.local keeps no destructor hook we can use):
                # close those of finished threads, or every short-lived thread leaks a connection and its fd
                alive = []
                for owner, other in self._conns:
                    if owner.is_alive():
                        alive.append((owner, other))
                    else:
                        other.close()
                alive.append((threading.current_thread(), c))
                self._conns = alive
        return c

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (takes the database write lock up front)."""
        c = self.conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
        except BaseException:
            c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every statement inside sees the same snapshot."""
        c = self.conn()
        c.execute("BEGIN")
        try:
            yield c
        finally:
            c.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._pid == os.getpid():
                for _, c in self._conns:
                    c.close()
            self._conns = []
            self._local = threading.local()


class InputLog:
    """Durable partitioned input log of :class:`Request` s on SQLite (see the module docstring).

    ``partitions=None`` opens an existing log with its stored partition count (a new log gets 4);
    an explicit count that differs from the stored routing count raises ``ValueError``, unless
    ``resize=True``: then the log is resized to it (:meth:`resize`).

    Two counts, kept in the log's metadata: :attr:`partitions` (physical: partitions ``0..n-1`` exist and
    are consumed forever; it only grows) and :attr:`route` (appends without an explicit partition go to
    ``crc32(key) % route``; ``route <= partitions``). Offsets lists (``end_offsets``, ``read_range``,
    ``truncate``) have one entry per physical partition; a shorter list, written before the log grew, is
    padded with 0s (:func:`charon.log.offsets.pad_offsets`).
    """

    atomic_batches = True  # an ``append_many`` batch is one transaction: all of it is stored or none

    def __init__(
        self, path: str | os.PathLike[str], partitions: int | None = None, *, durable: bool = True,
        resize: bool = False,
    ) -> None:
        if partitions is not None and partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self._db = SQLiteFile(path, durable)
        self.path = self._db.path
        with self._db.write() as c:
            c.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
            c.execute(
                "CREATE TABLE IF NOT EXISTS entries (part INTEGER NOT NULL, off INTEGER NOT NULL, "
                "request_id TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (part, off)) WITHOUT ROWID"
            )
            c.execute(
                "CREATE TABLE IF NOT EXISTS ids (request_id TEXT PRIMARY KEY, part INTEGER NOT NULL, "
                "off INTEGER NOT NULL) WITHOUT ROWID"
            )
            c.execute(
                "CREATE TABLE IF NOT EXISTS parts (part INTEGER PRIMARY KEY, next INTEGER NOT NULL, "
                "low INTEGER NOT NULL)"
            )
            row = c.execute("SELECT v FROM meta WHERE k = 'partitions'").fetchone()
            if row is None:
                n = 4 if partitions is None else partitions
                c.execute("INSERT INTO meta VALUES ('partitions', ?)", (str(n),))
                c.execute("INSERT INTO meta VALUES ('route', ?)", (str(n),))
                c.executemany("INSERT INTO parts VALUES (?, 0, 0)", [(p,) for p in range(n)])
            else:
                route = self._counts(c)[1]
                if partitions is not None and partitions != route:
                    if not resize:
                        raise ValueError(
                            f"input log {self.path!r} has {route} partitions, opened with partitions={partitions}"
                        )
                    self._resize(c, partitions)

    @staticmethod
    def _counts(c: sqlite3.Connection) -> tuple[int, int]:
        rows = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('partitions', 'route')").fetchall())
        n = int(rows["partitions"])
        return n, min(n, int(rows.get("route", n)))  # a log from before resizing: route = physical

    @property
    def partitions(self) -> int:
        """The physical partition count (offsets lists have this many entries; it only grows)."""
        return self.counts()[0]

    @property
    def route(self) -> int:
        """The routing count: an append without an explicit partition goes to ``crc32(key) % route``."""
        return self.counts()[1]

    def counts(self) -> tuple[int, int]:
        """``(physical partitions, routing count)``, read together."""
        with self._db.read() as c:
            return self._counts(c)

    def resize(self, route: int) -> tuple[int, int]:
        """Route new appends over ``route`` partitions, atomically for every appender (the count is read in
        each append's write transaction). Growing beyond the physical count adds partitions (their offsets
        start at 0); shrinking only lowers the routing count: the partitions beyond it keep their entries,
        are still consumed, and get appends again when the log grows back. Request-id dedup spans the whole
        log, so where a request lands never matters for exactly-once. Returns ``(physical, route)``."""
        if route < 1:
            raise ValueError(f"partitions must be >= 1, got {route}")
        with self._db.write() as c:
            return self._resize(c, route)

    @staticmethod
    def _resize(c: sqlite3.Connection, route: int) -> tuple[int, int]:
        n = InputLog._counts(c)[0]
        if route > n:
            c.executemany("INSERT INTO parts VALUES (?, 0, 0)", [(p,) for p in range(n, route)])
            c.execute("UPDATE meta SET v = ? WHERE k = 'partitions'", (str(route),))
            n = route
        c.execute("INSERT OR REPLACE INTO meta VALUES ('route', ?)", (str(route),))
        return n, route

    # -- writing -----------------------------------------------------------------------------------

    def append(self, req: Request, partition: int | None = None) -> tuple[int, int]:
        """Append one request; returns its ``(partition, offset)`` (the existing one for a known id)."""
        return self._append([(req, partition)])[0]

    def append_many(
        self, reqs: Iterable[Request | tuple[Request, int | None]]
    ) -> list[tuple[int, int]]:
        """Append requests in one transaction (group commit); one ``(partition, offset)`` per request.

        Items are requests (default partition) or ``(request, partition)`` pairs. Requests whose id is
        already in the log, or earlier in the same batch, get the existing position and are not stored again.
        """
        items = [(r, None) if isinstance(r, Request) else (r[0], r[1]) for r in reqs]
        return self._append(items) if items else []

    def _append(self, items: Sequence[tuple[Request, int | None]]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        now = time.time()
        with self._db.write() as c:
            n, route = self._counts(c)  # in the write transaction: a resize switches every appender at once
            for _, p in items:
                if p is not None and not 0 <= p < n:
                    raise ValueError(f"partition {p} out of range [0, {n})")
            nxt = dict(c.execute("SELECT part, next FROM parts").fetchall())
            start = dict(nxt)
            fast = self._append_new(c, items, route, nxt, now)
            if fast is not None:
                return fast
            nxt = dict(start)
            new_rows: list[tuple[int, int, str, bytearray]] = []
            for req, p in items:
                part = log_partition_of(req.key, route) if p is None else p
                off = nxt[part]
                cur = c.execute(
                    "INSERT OR IGNORE INTO ids VALUES (?, ?, ?)", (req.request_id, part, off)
                )
                if cur.rowcount == 0:
                    old = c.execute(
                        "SELECT part, off FROM ids WHERE request_id = ?", (req.request_id,)
                    ).fetchone()
                    out.append((old[0], old[1]))
                    continue
                if req.ts == 0:
                    req = msgspec.structs.replace(req, ts=now)
                new_rows.append((part, off, req.request_id, bytearray(encode_request(req))))  # see _BLOB
                nxt[part] = off + 1
                out.append((part, off))
            if new_rows:
                c.executemany("INSERT INTO entries VALUES (?, ?, ?, ?)", new_rows)
                c.executemany(
                    "UPDATE parts SET next = ? WHERE part = ?",
                    [(v, p) for p, v in nxt.items() if v != start[p]],
                )
        return out

    @staticmethod
    def _append_new(c: sqlite3.Connection, items: Sequence[tuple[Request, int | None]], route: int,
                    nxt: dict[int, int], now: float) -> list[tuple[int, int]] | None:
        """The common case in one statement per table: every id new (none known, none twice in the batch).
        Inside a savepoint: if any id was not new, it is rolled back and None returned (the caller appends
        item by item, giving a known id its old position)."""
        ids: list[tuple[str, int, int]] = []
        rows: list[tuple[int, int, str, bytearray]] = []
        out: list[tuple[int, int]] = []
        touched: set[int] = set()
        for req, p in items:
            part = log_partition_of(req.key, route) if p is None else p
            off = nxt[part]
            nxt[part] = off + 1
            touched.add(part)
            if req.ts == 0:
                req = msgspec.structs.replace(req, ts=now)
            ids.append((req.request_id, part, off))
            rows.append((part, off, req.request_id, bytearray(encode_request(req))))  # see _BLOB
            out.append((part, off))
        c.execute("SAVEPOINT append_new")
        before = c.total_changes
        c.executemany("INSERT OR IGNORE INTO ids VALUES (?, ?, ?)", ids)
        if c.total_changes - before != len(ids):
            c.execute("ROLLBACK TO append_new")
            c.execute("RELEASE append_new")
            return None
        c.executemany("INSERT INTO entries VALUES (?, ?, ?, ?)", rows)
        c.executemany("UPDATE parts SET next = ? WHERE part = ?", [(nxt[p], p) for p in touched])
        c.execute("RELEASE append_new")
        return out

    def truncate(self, upto: Sequence[int]) -> None:
        """Delete the entries below ``upto[p]`` in every partition ``p`` (retention); offsets keep counting.

        Offsets at or below the current truncation point are a no-op; ``upto[p]`` beyond the end of a
        partition raises ``ValueError``. Request ids stay known (idempotency outlives retention). A shorter
        ``upto`` (from before the log grew) leaves the partitions it does not name as they are.
        """
        with self._db.write() as c:
            rows = c.execute("SELECT part, next, low FROM parts ORDER BY part").fetchall()
            upto = pad_offsets(upto, len(rows))
            for (p, nxt, low), u in zip(rows, upto, strict=True):
                if u > nxt:
                    raise ValueError(f"cannot truncate partition {p} to {u}: it ends at {nxt}")
                if u > low:
                    c.execute("DELETE FROM entries WHERE part = ? AND off < ?", (p, u))
                    c.execute("UPDATE parts SET low = ? WHERE part = ?", (u, p))

    def forget(self, request_ids: Iterable[str], truncated_prefix: str | None = None) -> list[str]:
        """Forget request ids (dedup retention): a request with a forgotten id is appended again, as new.

        Only ids whose entries were already truncated are forgotten (a request still in the log keeps its id).
        ``truncated_prefix``: also forget every id with this prefix whose entry was truncated (the runtimes'
        own records, which get no reply). Returns the ids of ``request_ids`` that were forgotten. Freed pages
        are reused, so the file stops growing once retention is in effect."""
        below = "off < (SELECT low FROM parts WHERE parts.part = ids.part)"
        out = []
        with self._db.write() as c:
            for rid in request_ids:
                if c.execute(f"DELETE FROM ids WHERE request_id = ? AND {below}", (rid,)).rowcount:
                    out.append(rid)
            if truncated_prefix:
                c.execute(
                    f"DELETE FROM ids WHERE request_id >= ? AND request_id < ? AND {below}",
                    (truncated_prefix, truncated_prefix + "\U0010ffff"),
                )
        return out

    # -- reading -----------------------------------------------------------------------------------

    def contains(self, request_id: str) -> bool:
        """Whether a request with this id was ever appended (also after truncation)."""
        c = self._db.conn()
        return c.execute("SELECT 1 FROM ids WHERE request_id = ?", (request_id,)).fetchone() is not None

    def position(self, request_id: str) -> tuple[int, int] | None:
        """The ``(partition, offset)`` a request id was appended at, or None."""
        c = self._db.conn()
        row = c.execute("SELECT part, off FROM ids WHERE request_id = ?", (request_id,)).fetchone()
        return None if row is None else (row[0], row[1])

    def end_offsets(self) -> list[int]:
        """The next offset of every partition (= number of entries ever appended to it)."""
        c = self._db.conn()
        return [r[0] for r in c.execute("SELECT next FROM parts ORDER BY part")]

    def range_bytes(self, starts: list[int], ends: list[int]) -> int:
        """The encoded size of the entries between ``starts`` and ``ends`` (per partition), in bytes."""
        c = self._db.conn()
        total = 0
        for p, (s, e) in enumerate(zip(starts, ends, strict=True)):
            if e > s:
                row = c.execute("SELECT coalesce(sum(length(data)), 0) FROM entries WHERE part = ? AND off >= ? "
                                "AND off < ?", (p, s, e)).fetchone()
                total += int(row[0])
        return total

    def start_offsets(self) -> list[int]:
        """The first retained offset of every partition (0 until :meth:`truncate`)."""
        c = self._db.conn()
        return [r[0] for r in c.execute("SELECT low FROM parts ORDER BY part")]

    def count(self) -> int:
        """Number of retained entries."""
        n: int = self._db.conn().execute("SELECT count(*) FROM entries").fetchone()[0]
        return n

    def read(self, partition: int, start: int, end: int) -> list[Request]:
        """The requests at offsets ``[start, end)`` of one partition, in offset order.

        Raises ``ValueError`` if part of the range was truncated or is not appended yet, so a range read
        either returns exactly ``end - start`` requests or fails (a replay never silently differs).
        """
        with self._db.read() as c:
            return [decode_request(d) for _, d in self._read_raw(c, partition, start, end)]

    def read_range(self, starts: Sequence[int], ends: Sequence[int]) -> list[tuple[int, int, Request]]:
        """``(partition, offset, request)`` for offsets ``[starts[p], ends[p])`` of every partition,
        ordered by (partition, offset), read from one consistent snapshot. Lists shorter than the physical
        count are padded with 0s (:func:`~charon.log.offsets.pad_offsets`)."""
        out: list[tuple[int, int, Request]] = []
        with self._db.read() as c:
            n = self._counts(c)[0]
            starts, ends = pad_offsets(starts, n), pad_offsets(ends, n)
            for p in range(n):
                out.extend((p, off, decode_request(d)) for off, d in self._read_raw(c, p, starts[p], ends[p]))
        return out

    def read_raw(self, partition: int, start: int, end: int) -> list[tuple[int, bytes]]:
        """Like :meth:`read` but ``(offset, msgpack bytes)`` pairs, for callers that decode themselves."""
        with self._db.read() as c:
            return self._read_raw(c, partition, start, end)

    def _read_raw(self, c: sqlite3.Connection, p: int, start: int, end: int) -> list[tuple[int, bytes]]:
        row = c.execute("SELECT next, low FROM parts WHERE part = ?", (p,)).fetchone()
        if row is None:
            raise ValueError(f"partition {p} out of range [0, {self._counts(c)[0]})")
        if start >= end:
            if start > end:
                raise ValueError(f"empty range: start {start} > end {end}")
            return []
        nxt, low = row
        if start < low:
            raise ValueError(f"partition {p}: offsets below {low} were truncated (asked from {start})")
        if end > nxt:
            raise ValueError(f"partition {p}: ends at {nxt}, asked up to {end}")
        rows = c.execute(
            "SELECT off, data FROM entries WHERE part = ? AND off >= ? AND off < ? ORDER BY off",
            (p, start, end),
        ).fetchall()
        return rows

    def close(self) -> None:
        """Close this object's connections (call when no other thread is using it)."""
        self._db.close()

    def __enter__(self) -> InputLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        n, route = self.counts()
        return f"InputLog({self.path!r}, partitions={n}, route={route})"


class OutputLog:
    """Durable output log of :class:`Reply` s: each ``request_id`` stored (and so delivered) once."""

    def __init__(self, path: str | os.PathLike[str], *, durable: bool = True) -> None:
        self._db = SQLiteFile(path, durable)
        self.path = self._db.path
        with self._db.write() as c:
            c.execute(
                "CREATE TABLE IF NOT EXISTS replies (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "request_id TEXT NOT NULL UNIQUE, epoch INTEGER NOT NULL, data BLOB NOT NULL)"
            )
            # epoch -> the last seq once all its replies are in: readers cut atoms at these boundaries
            c.execute("CREATE TABLE IF NOT EXISTS epochs (epoch INTEGER PRIMARY KEY, last_seq INTEGER NOT NULL)")

    def put_many(self, replies: Iterable[Reply]) -> int:
        """Store replies in one transaction; ones whose request id is already stored are ignored.

        Returns how many were new. Replies of one call get consecutive-order seqs in the given order.
        """
        rows = [(r.request_id, r.epoch, bytearray(encode_reply(r))) for r in replies]  # see _BLOB
        if not rows:
            return 0
        with self._db.write() as c:
            cur = c.executemany(
                "INSERT OR IGNORE INTO replies (request_id, epoch, data) VALUES (?, ?, ?)", rows
            )
            return cur.rowcount

    def put(self, reply: Reply) -> bool:
        """Store one reply; False if its request id was already stored."""
        return self.put_many([reply]) == 1

    def get(self, request_id: str) -> Reply | None:
        """The reply to a request, or None if there is none yet."""
        row = self._db.conn().execute(
            "SELECT data FROM replies WHERE request_id = ?", (request_id,)
        ).fetchone()
        return None if row is None else decode_reply(row[0])

    def read_since(self, seq: int, limit: int = 10000) -> list[tuple[int, Reply]]:
        """Up to ``limit`` ``(seq, reply)`` pairs with seq > ``seq``, in seq order."""
        rows = self._db.conn().execute(
            "SELECT seq, data FROM replies WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
        ).fetchall()
        return [(s, decode_reply(d)) for s, d in rows]

    def read_raw_since(self, seq: int, limit: int = 10000) -> list[tuple[int, bytes]]:
        """Like :meth:`read_since` but ``(seq, msgpack bytes)`` pairs, for callers that decode only what they
        need (each ``bytes`` is one whole msgpack object, so many can be decoded in one call)."""
        return self._db.conn().execute(
            "SELECT seq, data FROM replies WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
        ).fetchall()

    def read_between(self, start: int, end: int) -> list[tuple[int, Reply]]:
        """``(seq, reply)`` pairs with ``start < seq <= end``, in seq order."""
        rows = self._db.conn().execute(
            "SELECT seq, data FROM replies WHERE seq > ? AND seq <= ? ORDER BY seq", (start, end)
        ).fetchall()
        return [(s, decode_reply(d)) for s, d in rows]

    def version(self) -> int:
        """A number that changes when another connection committed to the log (SQLite's ``data_version``, on
        this thread's connection): a cheap check before reading, which never waits for a writer."""
        v: int = self._db.conn().execute("PRAGMA data_version").fetchone()[0]
        return v

    def last_seq(self) -> int:
        """The highest seq ever stored (0 when none), also after retention pruned that reply."""
        seq: int = self._db.conn().execute(
            "SELECT max(coalesce((SELECT max(seq) FROM replies), 0), "
            "coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'replies'), 0))"
        ).fetchone()[0]
        return seq

    def mark_epoch(self, epoch: int) -> None:
        """Record that every reply of ``epoch`` (and of the epochs before) is in the log (idempotent)."""
        with self._db.write() as c:
            last = c.execute("SELECT coalesce(max(seq), 0) FROM replies").fetchone()[0]
            c.execute("INSERT OR IGNORE INTO epochs (epoch, last_seq) VALUES (?, ?)", (epoch, last))

    def epoch_boundaries(self, after: int, upto: int | None = None) -> list[int]:
        """Seqs that end a complete epoch, greater than ``after`` (and at most ``upto``), ascending."""
        q = "SELECT DISTINCT last_seq FROM epochs WHERE last_seq > ?"
        args: tuple[int, ...] = (after,)
        if upto is not None:
            q += " AND last_seq <= ?"
            args += (upto,)
        return [r[0] for r in self._db.conn().execute(q + " ORDER BY last_seq", args).fetchall()]

    def seq_after(self, seq: int, n: int) -> int:
        """The seq of the ``n``-th reply after ``seq`` (or :meth:`last_seq` if there are fewer)."""
        if n < 1:
            return seq
        row = self._db.conn().execute(
            "SELECT seq FROM replies WHERE seq > ? ORDER BY seq LIMIT 1 OFFSET ?", (seq, n - 1)
        ).fetchone()
        return max(seq, self.last_seq()) if row is None else row[0]

    def request_ids_through(self, seq: int) -> list[str]:
        """The request ids of the replies with seq <= ``seq`` (what :meth:`prune_through` would delete)."""
        rows = self._db.conn().execute("SELECT request_id FROM replies WHERE seq <= ?", (seq,)).fetchall()
        return [r[0] for r in rows]

    def prune(self, request_ids: Iterable[str]) -> int:
        """Delete these requests' replies and the epoch boundaries below the oldest reply left (reply
        retention; seqs are never reused). Returns how many replies were deleted."""
        n = 0
        with self._db.write() as c:
            for rid in request_ids:
                n += c.execute("DELETE FROM replies WHERE request_id = ?", (rid,)).rowcount
            low = c.execute("SELECT min(seq) FROM replies").fetchone()[0]
            if low is not None:
                keep = c.execute("SELECT max(epoch) FROM epochs WHERE last_seq < ?", (low,)).fetchone()[0]
                if keep is not None:  # the newest boundary below the oldest reply stays: readers resume there
                    c.execute("DELETE FROM epochs WHERE epoch < ?", (keep,))
        return n

    def count(self) -> int:
        """Number of stored replies."""
        n: int = self._db.conn().execute("SELECT count(*) FROM replies").fetchone()[0]
        return n

    def wait_for(self, request_id: str, timeout: float, poll: float = 0.005) -> Reply | None:
        """Poll until the reply to ``request_id`` is stored or ``timeout`` seconds pass (then None)."""
        deadline = time.monotonic() + timeout
        while True:
            rep = self.get(request_id)
            if rep is not None:
                return rep
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(poll, left))

    def close(self) -> None:
        """Close this object's connections (call when no other thread is using it)."""
        self._db.close()

    def __enter__(self) -> OutputLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OutputLog({self.path!r})"


class DedupRetention:
    """Forgets request ids and their replies together once they are older than ``window_s`` seconds.

    Call :meth:`after_truncate` after each truncation of the input log (the runtimes do it after compaction).
    Each call records a mark (now, the output log's last seq); replies up to the newest mark older than the
    window are candidates, and only those whose input-log entries are already truncated are forgotten, the
    id first (so a reply is never missing for an id the log still knows, which would make a retry wait
    forever). A retry with a forgotten id runs again, as a new request. Ids starting with
    ``runtime_prefix`` (the runtime's own records, which get no reply) are forgotten once truncated. The
    marks live in memory: after a restart, replies are kept at least one more window.
    """

    def __init__(
        self, input_log: InputLogLike, output_log: OutputLogLike, window_s: float, runtime_prefix: str,
    ) -> None:
        self.input_log = input_log
        self.output_log = output_log
        self.window_s = window_s
        self.runtime_prefix = runtime_prefix
        self._marks: deque[tuple[float, int]] = deque()

    def after_truncate(self) -> int:
        """Forget what is older than the window; returns how many replies were deleted."""
        now = time.monotonic()
        self._marks.append((now, self.output_log.last_seq()))
        cut = None
        while self._marks and self._marks[0][0] <= now - self.window_s:
            cut = self._marks.popleft()[1]
        if cut is None:
            return 0
        forgotten = self.input_log.forget(self.output_log.request_ids_through(cut), self.runtime_prefix)
        return self.output_log.prune(forgotten)
