"""Verdicts: decisions taken on a transaction from outside the deterministic core, and the dead letters they make.

A function that overran its time budget (:mod:`charon.runtime.guard.watchdog`) or a transaction quarantined after it
stopped the engine on repeated attempts gets a :class:`~charon.core.epoch.Verdict` keyed by its request id. The
book records it *before* anything that depends on it is replied or recorded (durable mode: one fsynced line of
``verdicts.jsonl`` in the data directory), and the coordinator applies it the same way live, at recovery and on
a rerun (:attr:`charon.core.epoch.EpochCoordinator.verdicts`), so the outcome is replay-exact. The transaction
is never run again: a retry with its request id gets the same typed error. Every verdict is also a *dead
letter*: ``charon dead-letters``, ``GET /admin/dead-letters`` and the dashboard list them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from charon.core.epoch import Verdict

FILE = "verdicts.jsonl"
KEPT_IN_MEMORY = 10_000  # dead letters listed (the verdicts themselves are all kept: recovery needs them)
T = TypeVar("T")


class DeadLetter(msgspec.Struct, frozen=True):
    """One transaction the engine set aside: what it was, which error it got, when and where."""

    request_id: str
    operator: str
    function: str
    key: str
    error_type: str
    message: str
    epoch: int
    fallback: bool = False
    at: float = 0.0  # wall-clock time of the decision
    root: str = ""  # the transaction's root "operator.function" (the function above may be a callee)
    in_round: int | None = None  # the fallback round it was taken in (Verdict.in_round; None in older records)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(DeadLetter)
_START = b'{"request_id":'  # how every record line starts (the encoder keeps the fields in their declared order)
_log = logging.getLogger("charon.engine")


class CorruptRecords(RuntimeError):
    """An append-only record file has an undecodable record that was relied on (not a torn tail)."""


def load_records(path: str, decode: Callable[[bytes], T], start: bytes = b"") -> list[T]:
    """The records of the append-only, one-line-per-record file ``path``, its torn tail (anything after the last
    complete record: never relied on) cut off the file, so that the next append starts a line of its own. A line
    that does not decode but holds ``start`` (an older version appended after a torn tail without cutting it) is
    decoded from the last ``start`` that decodes to its end. A complete line that cannot be decoded at all with a
    complete record after it raises :class:`CorruptRecords`."""
    with open(path, "rb") as f:
        data = f.read()
    out: list[T] = []
    good = 0  # the offset after the last complete record
    bad: int | None = None  # an undecodable complete line after ``good``
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # a line without its newline: torn
        line = data[pos:nl]
        rec = _decode_line(line, decode, start)
        if rec is None:
            if line.strip() and bad is None:
                bad = pos
        else:
            if bad is not None:
                raise CorruptRecords(f"{path}: the record at byte {bad} cannot be decoded and records follow it (it "
                                     "was relied on); restore the file or remove that line knowingly")
            out.append(rec)
            good = nl + 1
        pos = nl + 1
    if good < len(data):
        _log.warning("%s: dropping a torn tail of %d bytes (a write cut short; never relied on)", path,
                     len(data) - good, extra={"event": "torn_record", "path": path})
        with open(path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return out


def _decode_line(line: bytes, decode: Callable[[bytes], T], start: bytes) -> T | None:
    try:
        return decode(line)
    except (msgspec.DecodeError, ValueError):
        pass
    if start:
        at = line.rfind(start)
        while at > 0:  # a record glued to a torn prefix (at 0 it was tried whole above)
            try:
                return decode(line[at:])
            except (msgspec.DecodeError, ValueError):
                at = line.rfind(start, 0, at)
    return None


def append_record(path: str, data: bytes, fsync: bool = True) -> None:
    """Append the line ``data`` (ending in a newline) to ``path`` and fsync it; a write that fails or is cut short
    is cut off the file again before the error is raised (the next append starts a line of its own)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            n = os.write(fd, data)
            if n != len(data):
                raise OSError(f"short write to {path}: {n} of {len(data)} bytes")
            if fsync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


class VerdictBook:
    """The verdicts by request id (the dict the coordinator reads) and the dead letters, durable under
    ``data_dir`` when given. Thread-safe: a watchdog thread records while the engine thread reads."""

    def __init__(self, data_dir: str | None = None, *, fsync: bool = True,
                 on_write: Callable[[str], None] | None = None) -> None:
        self.path = os.path.join(data_dir, FILE) if data_dir is not None else None
        self.fsync = fsync
        self.on_write = on_write  # called with the file's path after each append (e.g. copied to object storage)
        self.verdicts: dict[str, Verdict] = {}
        self.letters: deque[DeadLetter] = deque(maxlen=KEPT_IN_MEMORY)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}  # by error type, for metrics
        self._reserved: dict[str, DeadLetter] = {}  # durable, not effective yet (see reserve)
        if self.path is not None and os.path.exists(self.path):
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        last: dict[str, DeadLetter] = {}  # the last record of a request id is its verdict (see Watchdog._give_up)
        for d in load_records(self.path, _dec.decode, _START):  # a torn tail is cut off here, before any append
            last.pop(d.request_id, None)
            last[d.request_id] = d
        for d in last.values():
            self._keep(d)

    def _keep(self, d: DeadLetter) -> None:
        self.verdicts[d.request_id] = Verdict(d.error_type, d.message, d.fallback, d.in_round, d.epoch)
        self.letters.append(d)
        self.counts[d.error_type] = self.counts.get(d.error_type, 0) + 1

    def _write(self, letter: DeadLetter) -> None:
        if self.path is not None:
            append_record(self.path, _enc.encode(letter) + b"\n", self.fsync)
            if self.on_write is not None:
                self.on_write(self.path)

    def record(self, letter: DeadLetter) -> None:
        """Make the verdict durable (fsynced before this returns, in durable mode), then effective."""
        with self._lock:
            self._write(letter)
            self._keep(letter)

    def reserve(self, letter: DeadLetter) -> bool:
        """From the watchdog's thread, before it interrupts a step: make the verdict durable, not yet effective
        (the engine makes it effective in its own thread with :meth:`settle`, where the step ends; a recovery
        loads it with the rest, so a crash in between replays the transaction refused). False if the request
        already has a verdict or a reserved one."""
        with self._lock:
            if letter.request_id in self.verdicts or letter.request_id in self._reserved:
                return False
            self._write(letter)
            self._reserved[letter.request_id] = letter
            return True

    def settle(self, letter: DeadLetter) -> Verdict:
        """In the engine thread, where a judged step ended: the request's verdict, effective from now on: the one
        it has, else the one reserved for it (waiting for a reservation being written), else ``letter``, recorded.
        A reservation naming another fallback round than ``letter`` (the round the step ends in, known here) is
        recorded again with that round first (the last record of a request id is its verdict)."""
        with self._lock:
            rid = letter.request_id
            have = self.verdicts.get(rid)
            if have is not None:
                return have
            reserved = self._reserved.pop(rid, None)
            if reserved is None or reserved.in_round != letter.in_round:  # (the watchdog may have read a later round)
                if reserved is not None:
                    letter = msgspec.structs.replace(reserved, in_round=letter.in_round)
                self._write(letter)
                reserved = letter
            self._keep(reserved)
            return self.verdicts[rid]

    def reserved(self, request_id: str) -> bool:
        """Whether the request has a verdict, effective or reserved."""
        with self._lock:
            return request_id in self.verdicts or request_id in self._reserved

    def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The newest dead letters first, as plain dicts."""
        with self._lock:
            newest = list(self.letters)[-limit:][::-1]
        return [msgspec.structs.asdict(d) for d in newest]


def letter(request_id: str, operator: str, function: str, key: str, verdict: Verdict, epoch: int,
           root: str = "") -> DeadLetter:
    return DeadLetter(request_id, operator, function, key, verdict.error_type, verdict.message, epoch,
                      verdict.fallback, time.time(), root, verdict.in_round)
