"""Atomic output streams: the storage behind ``ctx.emit`` (one SQLite file, WAL, shared across processes).

Each epoch's committed events (:attr:`charon.core.epoch.EpochResult.events`) are appended as one *atom* per
stream, in one SQLite transaction, by :meth:`StreamLog.append_atom`. Appends are idempotent by epoch: a
runtime that replays an epoch after a crash (same input, same TIDs, so the same events) appends nothing
the second time, so every event is stored, and so delivered, exactly once.

Offsets are per stream, dense, from 0: event ``n`` of stream ``s`` has offset ``n``. An atom of stream
``s`` is the offset range ``[start, end)`` of one epoch. Readers resume by offset; :meth:`StreamLog.read`
never ends a read inside an atom (it may start inside one when asked to), so a consumer that commits the
``next_offset`` it was given has consumed whole atoms only.

Retention (a bound): at most ``retain_events`` events per stream are kept (the oldest whole atoms are
dropped first); a read from a dropped offset starts at the first retained one (``first_offset``).

Copies: :meth:`StreamLog.epoch_atoms` reads the atoms of the epochs after a given one (what an engine ships to
object storage, :mod:`charon.runtime.sidefiles`) and :meth:`StreamLog.put_atoms` stores them in another log at
the same offsets, idempotent by epoch as appends are.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from charon.core.routing import check_stream
from charon.log.sqlite import SQLiteFile

__all__ = ["DEFAULT_RETAIN_EVENTS", "MAX_READ_EVENTS", "EpochAtoms", "StreamEvent", "StreamLog", "StreamRead"]

DEFAULT_RETAIN_EVENTS = 1_000_000  # per stream
MAX_READ_EVENTS = 10_000  # a single read returns at most this many events (plus the rest of one atom)


class StreamEvent(msgspec.Struct, frozen=True):
    """One stored event: its stream, offset, the epoch whose atom holds it, and its encoded value."""

    stream: str
    offset: int
    epoch: int
    value: bytes  # charon.serde encoding (msgpack)


class EpochAtoms(msgspec.Struct, frozen=True, array_like=True):
    """One epoch's atoms as stored: ``(stream, first offset, encoded values)`` per stream (a copy of the log)."""

    epoch: int
    atoms: list[tuple[str, int, list[bytes]]]


class StreamRead(msgspec.Struct, frozen=True):
    """The result of a read: ``events`` (whole atoms, except possibly a first partial one when the read
    started inside an atom), ``next_offset`` (where to resume), ``first_offset`` (oldest retained) and
    ``end_offset`` (the stream's end when read)."""

    stream: str
    events: list[StreamEvent]
    next_offset: int
    first_offset: int
    end_offset: int


class StreamLog:
    """Durable, idempotent storage of atomic output streams (see the module docstring)."""

    def __init__(
        self, path: str | os.PathLike[str], *, durable: bool = True, retain_events: int = DEFAULT_RETAIN_EVENTS
    ) -> None:
        if retain_events < 1:
            raise ValueError("retain_events must be at least 1")
        self._db = SQLiteFile(path, durable)
        self.path = self._db.path
        self.retain_events = retain_events
        self._cv = threading.Condition()  # wakes waiters of this process at once (others poll)
        self._listeners: list[Callable[[frozenset[str]], object]] = []  # see add_listener
        with self._db.write() as c:
            c.execute("CREATE TABLE IF NOT EXISTS epochs (epoch INTEGER PRIMARY KEY)")
            c.execute(
                "CREATE TABLE IF NOT EXISTS atoms (stream TEXT NOT NULL, epoch INTEGER NOT NULL, "
                "start INTEGER NOT NULL, end INTEGER NOT NULL, PRIMARY KEY (stream, end)) WITHOUT ROWID"
            )
            c.execute(
                "CREATE TABLE IF NOT EXISTS events (stream TEXT NOT NULL, offset INTEGER NOT NULL, "
                "epoch INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (stream, offset)) WITHOUT ROWID"
            )
            c.execute("CREATE INDEX IF NOT EXISTS atoms_by_epoch ON atoms (epoch)")  # epoch_atoms, without a scan

    # -- writing -------------------------------------------------------------------------------------
    def append_atom(self, epoch: int, events: Sequence[tuple[str, bytes]]) -> bool:
        """Append epoch ``epoch``'s events ((stream, encoded value), in atom order) as one atom per stream.

        Idempotent: False (nothing written) if an epoch >= ``epoch`` was appended already. Epochs without
        events need no call.
        """
        if not events:
            return False
        with self._db.write() as c:
            if not self._claim(c, epoch):
                return False
            by_stream: dict[str, list[bytes]] = {}
            for stream, value in events:
                by_stream.setdefault(stream, []).append(value)
            for stream, values in by_stream.items():
                self._insert(c, stream, epoch, self._end(c, stream), values)
        with self._cv:
            self._cv.notify_all()
        appended = frozenset(s for s, _ in events)
        for listener in list(self._listeners):
            listener(appended)
        return True

    def put_atoms(self, copy: EpochAtoms) -> bool:
        """Store an epoch's atoms at the offsets they have in the log they were read from (:meth:`epoch_atoms`):
        restoring a copy. Idempotent as :meth:`append_atom` is (False if an epoch >= ``copy.epoch`` is stored);
        an atom may start after its stream's end (older events were dropped by retention before the copy), never
        before it."""
        with self._db.write() as c:
            if not self._claim(c, copy.epoch):
                return False
            for stream, start, values in copy.atoms:
                check_stream(stream)
                if start < self._end(c, stream):
                    raise ValueError(f"epoch {copy.epoch}'s atom of {stream!r} starts at {start}, inside the log")
                self._insert(c, stream, copy.epoch, start, values)
        with self._cv:
            self._cv.notify_all()
        return True

    @staticmethod
    def _claim(c: sqlite3.Connection, epoch: int) -> bool:
        """Record ``epoch`` as appended, unless an epoch >= it is already (False)."""
        if epoch <= c.execute("SELECT coalesce(max(epoch), -1) FROM epochs").fetchone()[0]:
            return False
        c.execute("INSERT INTO epochs (epoch) VALUES (?)", (epoch,))
        return True

    def _insert(self, c: sqlite3.Connection, stream: str, epoch: int, start: int, values: Sequence[bytes]) -> None:
        """One atom: ``values`` at offsets from ``start``, then the retention trim."""
        c.executemany("INSERT INTO events (stream, offset, epoch, data) VALUES (?, ?, ?, ?)",
                      [(stream, start + i, epoch, v) for i, v in enumerate(values)])
        end = start + len(values)
        c.execute("INSERT INTO atoms (stream, epoch, start, end) VALUES (?, ?, ?, ?)", (stream, epoch, start, end))
        self._trim(c, stream, start, end)

    def add_listener(self, listener: Callable[[frozenset[str]], object]) -> None:
        """Call ``listener(streams)`` after each append by this process, with the streams it appended to (on the
        appending thread: it must be quick and not raise; e.g. ``loop.call_soon_threadsafe``)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[frozenset[str]], object]) -> None:
        """Stop calling ``listener`` (see :meth:`add_listener`)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _trim(self, c: sqlite3.Connection, stream: str, start: int, end: int) -> None:
        """Keep the newest whole atoms holding at most ``retain_events`` events, and at least the newest atom
        (``[start, end)``). Index lookups only: an atom starts where the one before it ends."""
        low = end - self.retain_events
        first = self._first(c, stream)
        if first >= low:
            return
        cut = c.execute("SELECT min(end) FROM atoms WHERE stream = ? AND end >= ?", (stream, low)).fetchone()[0]
        keep = min(cut, start)
        if keep > first:
            c.execute("DELETE FROM events WHERE stream = ? AND offset < ?", (stream, keep))
            c.execute("DELETE FROM atoms WHERE stream = ? AND end <= ?", (stream, keep))

    # -- reading -------------------------------------------------------------------------------------
    @staticmethod
    def _end(c: sqlite3.Connection, stream: str) -> int:
        row = c.execute("SELECT max(end) FROM atoms WHERE stream = ?", (stream,)).fetchone()
        return row[0] if row[0] is not None else 0

    @staticmethod
    def _first(c: sqlite3.Connection, stream: str) -> int:
        row = c.execute("SELECT start FROM atoms WHERE stream = ? ORDER BY end LIMIT 1", (stream,)).fetchone()
        return row[0] if row is not None else 0

    def end_offset(self, stream: str) -> int:
        """The offset the next event of ``stream`` will get (its number of events ever appended)."""
        return self._end(self._db.conn(), stream)

    def last_epoch(self) -> int:
        """The newest epoch appended (-1 if none)."""
        epoch: int = self._db.conn().execute("SELECT coalesce(max(epoch), -1) FROM epochs").fetchone()[0]
        return epoch

    def streams(self) -> dict[str, int]:
        """Every stream with events, and its end offset."""
        rows = self._db.conn().execute("SELECT stream, max(end) FROM atoms GROUP BY stream ORDER BY stream")
        return {s: e for s, e in rows.fetchall()}

    def atom_ends(self, stream: str, after: int, upto: int | None = None) -> list[int]:
        """End offsets of the atoms of ``stream`` ending after ``after`` (and at most ``upto``), ascending."""
        q, args = "SELECT end FROM atoms WHERE stream = ? AND end > ?", [stream, after]
        if upto is not None:
            q += " AND end <= ?"
            args.append(upto)
        return [r[0] for r in self._db.conn().execute(q + " ORDER BY end", args).fetchall()]

    def epoch_atoms(self, after: int, max_bytes: int) -> list[EpochAtoms] | None:
        """The retained atoms of the epochs after ``after``, in epoch order (the streams of one epoch by name);
        None if their values hold more than ``max_bytes`` bytes (read no further). One read transaction."""
        out: list[EpochAtoms] = []
        size = 0
        with self._db.read() as c:
            rows = c.execute("SELECT epoch, stream, start, end FROM atoms WHERE epoch > ? ORDER BY epoch, stream",
                             (after,))
            for epoch, stream, start, end in rows.fetchall():
                values = [r[0] for r in c.execute(
                    "SELECT data FROM events WHERE stream = ? AND offset >= ? AND offset < ? ORDER BY offset",
                    (stream, start, end)).fetchall()]
                size += sum(len(v) for v in values)
                if size > max_bytes:
                    return None
                if not out or out[-1].epoch != epoch:
                    out.append(EpochAtoms(epoch, []))
                out[-1].atoms.append((stream, start, values))
        return out

    def read(self, stream: str, from_offset: int = 0, max_events: int = 1000) -> StreamRead:
        """Events of ``stream`` from ``from_offset``: whole atoms up to about ``max_events`` (at least the
        first atom, whatever its size; at most :data:`MAX_READ_EVENTS` besides it)."""
        check_stream(stream)
        if from_offset < 0:
            raise ValueError("from_offset must be >= 0")
        max_events = max(1, min(max_events, MAX_READ_EVENTS))
        with self._db.read() as c:
            first, end = self._first(c, stream), self._end(c, stream)
            start = max(from_offset, first)
            if start >= end:
                return StreamRead(stream, [], max(start, from_offset), first, end)
            ends = [r[0] for r in c.execute(
                "SELECT end FROM atoms WHERE stream = ? AND end > ? ORDER BY end LIMIT ?",
                (stream, start, max_events + 1),
            ).fetchall()]
            stop = ends[0]
            for e in ends[1:]:
                if e - start > max_events:
                    break
                stop = e
            rows = c.execute(
                "SELECT offset, epoch, data FROM events WHERE stream = ? AND offset >= ? AND offset < ? "
                "ORDER BY offset", (stream, start, stop),
            ).fetchall()
        return StreamRead(stream, [StreamEvent(stream, o, e, d) for o, e, d in rows], stop, first, end)

    def read_range(self, stream: str, start: int, end: int) -> list[StreamEvent]:
        """Events with ``start <= offset < end`` (what a Spark micro-batch covers)."""
        rows = self._db.conn().execute(
            "SELECT offset, epoch, data FROM events WHERE stream = ? AND offset >= ? AND offset < ? ORDER BY offset",
            (stream, start, end),
        ).fetchall()
        return [StreamEvent(stream, o, e, d) for o, e, d in rows]

    def wait(self, stream: str, offset: int, timeout: float, poll: float = 0.01) -> bool:
        """Block until ``stream`` has an event at ``offset`` or beyond (True) or ``timeout`` passes (False).

        Appends by this process wake the waiter at once; another process's appends are polled for."""
        deadline = time.monotonic() + timeout
        while True:
            if self.end_offset(stream) > offset:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cv:
                self._cv.wait(min(poll, left))

    def close(self) -> None:
        """Close this object's connections."""
        self._db.close()

    def __enter__(self) -> StreamLog:
        return self

    def __exit__(self, *exc: sqlite3.Connection) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StreamLog({self.path!r})"
