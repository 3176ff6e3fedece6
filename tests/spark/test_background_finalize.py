"""The resident gang's background finalize (docs/internals/resident.md, "The background finalize"): a task's
DurableWriter writes its partitions' durable deltas after the round that committed the local copies, several
epochs with one manifest write; it reports only what ended, fails the task's next frame on an error, bounds its
queue; the local copy is fenced by gang as the durable one is. End to end (records held until durable, crashes
with K epochs not written, a crash mid-write): the seeded simulator (tests/faults/test_simulation*.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from charon.runtime.spark.resident import DurableWriter
from charon.state.durable import DurableState
from charon.state.lmdbstore import LmdbStore
from charon.storage.contract import StorageConflict


def test_write_deltas_writes_several_epochs_with_one_manifest_and_each_stays_readable(tmp_path: Path) -> None:
    d = DurableState(str(tmp_path / "state"))
    d.claim(0, 7)
    writes: list[str] = []
    real = d._write_local_manifest
    d._write_local_manifest = lambda pid, data: (writes.append("m"), real(pid, data))[1]  # type: ignore[method-assign]
    d.write_deltas(0, [(0, {b"a": b"1"}), (1, {}), (2, {b"b": b"2", b"a": None})])
    assert writes == ["m"]  # one manifest write for the three epochs
    m = d.manifest(0)
    assert (m.epoch, m.deltas) == (2, [0, 2])  # an empty epoch has no file, as epoch by epoch
    assert d.load(0, 0) == ({b"a": b"1"}, 0)
    assert d.load(0, 1) == ({b"a": b"1"}, 1)
    assert d.load(0, 2) == ({b"b": b"2"}, 2)
    d.write_deltas(0, [(2, {b"x": b"9"}), (3, {b"c": b"3"})])  # epoch 2 is recorded: skipped, 3 appended
    assert d.load(0, 3) == ({b"b": b"2", b"c": b"3"}, 3)
    newer = DurableState(str(tmp_path / "state"))
    newer.claim(0, 8)
    with pytest.raises(StorageConflict):  # a writer of a replaced gang is refused
        d.write_deltas(0, [(4, {b"z": b"1"})])
    assert d.manifest(0).epoch == 3 and "delta-000000000004.arrow" not in d.files(0)


def test_a_newer_gang_fences_the_local_copy(tmp_path: Path) -> None:
    old = LmdbStore(str(tmp_path / "local"), 0)
    new = LmdbStore(str(tmp_path / "local"), 0)
    old.claim(5)
    old.commit(0, {b"k": b"old"})
    new.claim(6)
    with pytest.raises(StorageConflict):  # a zombie's finalize cannot move the new gang's copy
        old.commit(1, {b"k": b"zombie"})
    with pytest.raises(StorageConflict):
        old.claim(5)
    new.commit(1, {b"k": b"new"})
    assert (new.epoch, new.get(b"k")) == (1, b"new")


class _Durable:
    """Records write_deltas calls; may fail or block."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.fail, self.gate = fail, gate

    def write_deltas(self, pid: int, items: list[tuple[int, dict]]) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise OSError("disk full")
        self.calls.append((pid, [e for e, _ in items]))


def test_the_writer_reports_only_what_ended_and_batches_what_waited() -> None:
    d = _Durable()
    w = DurableWriter(8, 1 << 20, threaded=False)
    for epoch in (3, 4, 5):
        for pid in (0, 1):
            w.stage(d, pid, epoch, {b"k": b"v"})
        w.seal()
    assert (w.durable, w.highest) == (-1, 5)  # nothing written yet: nothing reported
    w.run(items=1)  # the process dies after one partition's writes: its epochs are not reported
    assert w.durable == -1 and w.error is not None
    with pytest.raises(RuntimeError, match="died mid-write"):
        w.check()
    d2 = _Durable()
    w2 = DurableWriter(8, 1 << 20, threaded=False)
    for epoch in (3, 4, 5):
        w2.stage(d2, 0, epoch, {b"k": b"v"})
        w2.seal()
    w2.drain()
    assert d2.calls == [(0, [3, 4, 5])] and w2.durable == 5  # three epochs, one call


def test_a_failed_write_fails_the_next_frame_and_is_never_reported_durable() -> None:
    w = DurableWriter(8, 1 << 20)
    w.stage(_Durable(fail=True), 0, 1, {b"k": b"v"})
    w.seal()
    with pytest.raises(RuntimeError, match="disk full"):
        w.drain()
    assert w.durable == -1
    w.close()


def test_the_queue_is_bounded_by_epochs_and_bytes() -> None:
    gate = threading.Event()
    d = _Durable(gate=gate)
    w = DurableWriter(2, 1 << 20)
    sealed: list[int] = []

    def finalize() -> None:
        for epoch in range(6):
            w.stage(d, 0, epoch, {b"k": b"v"})
            w.seal()
            sealed.append(epoch)

    t = threading.Thread(target=finalize)
    t.start()
    time.sleep(0.3)
    # the writer holds the first epoch(s) (blocked), two more queued: the finalize of the next waits for room
    assert t.is_alive() and len(w.queue) == 2 and len(sealed) < 6
    gate.set()
    t.join(10)
    w.drain()
    assert sealed == list(range(6)) and w.durable == 5
    assert [e for _, es in d.calls for e in es] == list(range(6))
    w.close()
    big = DurableWriter(100, 10)  # bytes: a second delta past the bound waits for the first's write
    gate2 = threading.Event()
    d2 = _Durable(gate=gate2)
    big.stage(d2, 0, 0, {b"k": b"0123456789"})
    big.seal()
    t2 = threading.Thread(target=lambda: (big.stage(d2, 0, 1, {b"k": b"0123456789"}), big.seal()))
    t2.start()
    time.sleep(0.2)
    assert t2.is_alive()
    gate2.set()
    t2.join(10)
    big.drain()
    assert big.durable == 1
    big.close()


def test_an_unsynced_local_copy_is_kept_within_a_boot_and_deleted_after_another(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from charon.state import lmdbstore

    if lmdbstore._boot_id() is None:
        pytest.skip("no boot id on this system (every commit is synced there)")
    root = str(tmp_path / "local")

    def forget() -> None:  # what a new process has: no cached store of this directory
        for k in [k for k in lmdbstore._STORES if k[0].startswith(os.path.realpath(root))]:
            del lmdbstore._STORES[k]

    s = lmdbstore.open_store(root, 0)
    s.commit(0, {b"k": b"v"})
    marker = Path(root) / "p0.boot"
    assert marker.read_text() == lmdbstore._boot_id()  # written (and synced) before the first unsynced commit
    s.close()
    forget()
    assert lmdbstore.open_store(root, 0).get(b"k") == b"v"  # the same boot: a killed process lost nothing
    lmdbstore.open_store(root, 0).close()
    forget()
    monkeypatch.setattr(lmdbstore, "_boot_id", lambda: "another-boot")
    again = lmdbstore.open_store(root, 0)  # the machine restarted since: maybe half-written, so deleted
    assert (again.epoch, again.get(b"k")) == (-1, None)
    assert marker.read_text() == "another-boot"
    again.close()
    forget()
