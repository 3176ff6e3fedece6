"""The output streams shipped incrementally (:mod:`charon.runtime.sidefiles`): a segment of atoms per ship, a
snapshot of the whole file now and then, on a real SeaweedFS. The bytes a ship uploads stay bounded as the stream
grows; a data directory restored from storage reads the same events at the same offsets; a crash or a lost answer
between a segment's upload and the epoch record loses nothing and duplicates nothing."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from pathlib import Path

import pytest

from charon.log.streams import StreamLog
from charon.runtime.sidefiles import SEGMENTS, SideFiles
from charon.storage.contract import ObjectStore, StorageConflict, StorageUnavailable
from charon.storage.metered import Metered, StorageMeter
from charon.storage.s3 import S3Store
from tests.support.seaweedfix import SeaweedS3

EVENT = 500  # bytes of one event's value


def _events(epoch: int) -> list[tuple[str, bytes]]:
    """Epoch ``epoch``'s atom: two events on ``a``, one on ``b`` every third epoch (deterministic)."""
    out = [("a", f"{epoch}:{i}:".encode().ljust(EVENT, b"x")) for i in range(2)]
    if epoch % 3 == 0:
        out.append(("b", f"{epoch}:b:".encode().ljust(EVENT, b"y")))
    return out


def _store(s3: SeaweedS3, prefix: str) -> tuple[Metered, StorageMeter]:
    meter = StorageMeter()
    return Metered(S3Store(s3.bucket, prefix, meter=meter), meter), meter


def _all(log: StreamLog) -> dict[str, list[tuple[int, int, bytes]]]:
    """Every retained event of every stream: (offset, epoch, value)."""
    return {s: [(e.offset, e.epoch, e.value) for e in log.read_range(s, 0, end)] for s, end in log.streams().items()}


def _restored(tmp_path: Path, store: ObjectStore, name: str) -> StreamLog:
    fresh = tmp_path / name
    fresh.mkdir()
    (fresh / "streams.sqlite.restoring").write_bytes(b"a restore killed midway")  # built aside: not taken
    side = SideFiles(str(fresh), store)
    side.restore()
    side.close()
    return StreamLog(fresh / "streams.sqlite")


def test_bytes_per_emitting_epoch_stay_bounded_as_the_stream_grows(tmp_path: Path, s3_env: SeaweedS3) -> None:
    """600 epochs each appending ~1.5 KB (the file grows to ~1 MB): a ship uploads a segment of its epoch's atom and
    now and then a snapshot, amortized to a few atoms' worth of bytes an epoch, the same late as early (shipping the
    whole file at every epoch would upload ~300 MB)."""
    store, meter = _store(s3_env, f"bounded-{uuid.uuid4().hex[:8]}")
    data = tmp_path / "data"
    data.mkdir()
    log = StreamLog(data / "streams.sqlite")
    side = SideFiles(str(data), store, snapshot_bytes=8 << 10)
    side.restore()
    per_epoch: list[tuple[int, int]] = []  # (bytes, PUTs) of each epoch's ship
    atom = 0
    for epoch in range(600):
        events = _events(epoch)
        atom = max(atom, sum(len(v) for _, v in events))
        log.append_atom(epoch, events)
        before = meter.snapshot()
        assert side.ship() == 1
        after = meter.snapshot()
        per_epoch.append((after["bytes_up"] - before["bytes_up"], after["put"] - before["put"]))
    with contextlib.closing(sqlite3.connect(data / "streams.sqlite")) as db:  # the file's bytes, WAL included
        size = db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]
    assert size > 600 * 2 * EVENT  # the stream grew (uploading it whole at every epoch: over 300 MB)
    for half in (per_epoch[:300], per_epoch[300:]):  # amortized: segments, snapshots ever rarer, the same late
        assert sum(b for b, _ in half) <= 4 * atom * len(half), [b for b, _ in half]
        assert sum(p for _, p in half) <= 1.1 * len(half)  # one PUT an epoch, a snapshot now and then
    snapshots = [b for b, _ in per_epoch if b > 2 * atom]
    assert 1 < len(snapshots) <= 10 and max(snapshots) <= size  # each about as large as the file was then
    assert len(store.list(SEGMENTS)) < 600 - 300  # the segments a snapshot covers are deleted
    got = _restored(tmp_path, store, "fresh")
    assert _all(got) == _all(log)
    assert got.last_epoch() == 599
    side.close()


def test_a_fresh_directory_reads_the_same_events_at_the_same_offsets(tmp_path: Path, s3_env: SeaweedS3) -> None:
    """Epochs with and without events, a retention that drops old atoms, snapshots and segments on storage: a
    restored log has every retained event at its offset, and the engine appends after it where the original did."""
    store, _ = _store(s3_env, f"restore-{uuid.uuid4().hex[:8]}")
    data = tmp_path / "data"
    data.mkdir()
    log = StreamLog(data / "streams.sqlite", retain_events=40)
    side = SideFiles(str(data), store, snapshot_segments=7)
    side.restore()
    for epoch in range(0, 90, 2):  # odd epochs emit nothing
        log.append_atom(epoch, _events(epoch))
        if epoch % 6 == 0:  # ships cover one or several epochs (the durable node ships per checkpoint)
            side.ship()
    side.ship()
    keys = [o.key for o in store.list("files/")]
    assert "files/streams.sqlite" in keys and any(k.startswith(SEGMENTS) for k in keys), keys
    got = _restored(tmp_path, store, "fresh")
    want = _all(log)
    have = _all(got)
    assert want["b"] and want["a"][0][0] > 0  # retention dropped the oldest atoms of ``a``
    for stream, events in want.items():  # the restored log keeps at least what the original retained
        assert have[stream][-len(events):] == events
        assert got.end_offset(stream) == log.end_offset(stream)
    got.append_atom(90, _events(90))
    log.append_atom(90, _events(90))
    assert got.read_range("a", log.end_offset("a") - 2, log.end_offset("a")) == log.read_range(
        "a", log.end_offset("a") - 2, log.end_offset("a"))
    side.close()


class _LosesAnswers:
    """A store whose next ``lose`` PUTs reach the server and then fail as an outage would (the answer lost)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.url = store.url
        self.lose = 0

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        etag = self.store.put(key, data, if_absent=if_absent, if_match=if_match)
        if self.lose:
            self.lose -= 1
            raise StorageUnavailable(f"{key}: the answer was lost")
        return etag

    def __getattr__(self, name: str):  # noqa: ANN204 - the rest of the store as is
        return getattr(self.store, name)


def test_a_crash_between_a_segment_and_the_record_loses_and_duplicates_nothing(tmp_path: Path,
                                                                                s3_env: SeaweedS3) -> None:
    """A ship whose answer is lost is retried (the segment it stored is its own); an engine killed after a ship and
    before its record replays the epoch (its atom is appended again: nothing) and ships nothing twice, on its own
    directory and on a fresh one; an engine that lost its place and ships another atom for a stored epoch is
    refused."""
    store, meter = _store(s3_env, f"crash-{uuid.uuid4().hex[:8]}")
    lossy = _LosesAnswers(store)
    data = tmp_path / "data"
    data.mkdir()
    log = StreamLog(data / "streams.sqlite")
    side = SideFiles(str(data), lossy)  # type: ignore[arg-type]
    side.restore()
    for epoch in range(5):
        log.append_atom(epoch, _events(epoch))
        side.ship()
    log.append_atom(5, _events(5))
    lossy.lose = 1
    with pytest.raises(StorageUnavailable):
        side.ship()
    assert side.ship() == 1  # the retry finds its own segment
    # killed after the ship of epoch 6, before its record: the same directory restarts and replays epoch 6
    log.append_atom(6, _events(6))
    side.ship()
    side.close()
    again = SideFiles(str(data), store)
    again.restore()
    puts = meter.snapshot()["put"]
    assert not log.append_atom(6, _events(6))  # the replay's atom is appended once
    assert again.ship() == 0 and meter.snapshot()["put"] == puts  # nothing shipped twice
    # the machine is lost instead: a fresh directory has epoch 6's atom; the replay adds nothing
    fresh = _restored(tmp_path, store, "fresh")
    assert not fresh.append_atom(6, _events(6))
    assert _all(fresh) == _all(log)
    assert [e.epoch for e in fresh.read_range("a", 0, 100)] == [e for e in range(7) for _ in range(2)]
    # an engine that lost its place (it took the stored atoms up to epoch 6, then another engine went on) ships
    # another atom for epoch 7 over the stored one: refused, not overwriting it
    other = tmp_path / "other"
    other.mkdir()
    stale = StreamLog(other / "streams.sqlite")
    for epoch in range(7):
        stale.append_atom(epoch, _events(epoch))
    stale_side = SideFiles(str(other), store)
    stale_side.restore()
    log.append_atom(7, _events(7))
    assert again.ship() == 1
    stale.append_atom(7, [("a", b"something else")])
    with pytest.raises(StorageConflict):
        stale_side.ship()
    assert _all(_restored(tmp_path, store, "after")) == _all(log)
    again.close()
    stale_side.close()
