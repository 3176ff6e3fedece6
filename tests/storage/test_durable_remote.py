"""Durable partition state on object storage: the local directory is a cache that can be thrown away."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from charon.state.durable import DurableState, DurableStateError
from charon.storage.contract import ObjectStore, StorageConflict
from charon.storage.location import open_storage
from tests.support.seaweedfix import SeaweedS3


@pytest.fixture(params=["file", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_storage(f"file://{tmp_path / 'bucket'}")
    server: SeaweedS3 = request.getfixturevalue("s3_env")
    return open_storage(server.url(f"d-{uuid.uuid4().hex[:8]}"))


def _write(d: DurableState, pid: int, epochs: range) -> dict[bytes, bytes]:
    want: dict[bytes, bytes] = {}
    for e in epochs:
        delta: dict[bytes, bytes | None] = {f"k{e % 7}".encode(): f"v{e}".encode(), f"x{e}".encode(): b"1"}
        if e % 5 == 4:
            delta[f"x{e - 1}".encode()] = None
        d.write_delta(pid, e, delta)
        for k, v in delta.items():
            if v is None:
                want.pop(k, None)
            else:
                want[k] = v
    return want


def test_a_fresh_cache_restores_every_partition(remote: ObjectStore, tmp_path: Path) -> None:
    d = DurableState(str(tmp_path / "cache1"), remote=remote)
    wants = []
    for pid in range(2):
        d.hydrate(pid)
        wants.append(_write(d, pid, range(0, 12)))
    d.compact(0, 8)
    assert d.manifest(0).base_epoch == 8
    manifests = [d.manifest(pid) for pid in range(2)]
    shutil.rmtree(tmp_path / "cache1")  # the machine is gone
    e = DurableState(str(tmp_path / "cache2"), remote=remote)
    for pid in range(2):
        assert e.hydrate(pid) == manifests[pid]
        assert e.load(pid) == (wants[pid], 11)
    assert e.read_keys(0, [b"k1", b"nope"], 11)[0] == {b"k1": wants[0][b"k1"], b"nope": None}
    # a compaction's superseded files are gone from the bucket too
    names = {o.key for o in remote.list("p0/")}
    assert names == {"p0/manifest.json", f"p0/{manifests[0].base}"} | {
        f"p0/delta-{x:012d}.arrow" for x in (9, 10, 11)}


def test_a_stale_writer_is_fenced(remote: ObjectStore, tmp_path: Path) -> None:
    old = DurableState(str(tmp_path / "old"), remote=remote)
    old.hydrate(0)
    _write(old, 0, range(0, 3))
    new = DurableState(str(tmp_path / "new"), remote=remote)  # took over on another machine
    new.hydrate(0)
    _write(new, 0, range(3, 5))
    with pytest.raises(StorageConflict):
        old.write_delta(0, 3, {b"k": b"stale"})
    assert DurableState(str(tmp_path / "third"), remote=remote).hydrate(0).epoch == 4


def test_writing_before_hydrate_is_refused(remote: ObjectStore, tmp_path: Path) -> None:
    d = DurableState(str(tmp_path / "c"), remote=remote)
    with pytest.raises(DurableStateError):
        d.write_delta(0, 0, {b"k": b"v"})


def test_a_local_directory_moves_onto_object_storage(remote: ObjectStore, tmp_path: Path) -> None:
    local = DurableState(str(tmp_path / "c"))
    want = _write(local, 0, range(0, 4))
    moved = DurableState(str(tmp_path / "c"), remote=remote)
    moved.hydrate(0)  # uploads what the directory has
    fresh = DurableState(str(tmp_path / "fresh"), remote=remote)
    fresh.hydrate(0)
    assert fresh.load(0) == (want, 3)


def test_a_writer_of_an_older_gang_is_fenced_and_leaves_nothing(remote: ObjectStore, tmp_path: Path) -> None:
    """Spark's resident gangs (DurableState.claim): a task of a lost gang that writes after a newer gang claimed its
    partition is refused, even with a cache shared with the new gang's task, and even for an epoch the new gang has
    not written yet; what it refused to write is neither named nor cached."""
    shared = str(tmp_path / "executor")  # the same machine's cache
    old = DurableState(shared, remote=remote, follow=True)
    old.claim(0, fence=10)
    want = _write(old, 0, range(0, 3))
    new = DurableState(shared, remote=remote, follow=True)  # another Python worker, a new gang
    assert new.claim(0, fence=20).epoch == 2
    with pytest.raises(StorageConflict):  # the zombie's next epoch, before the new gang wrote anything
        old.write_delta(0, 3, {b"k0": b"zombie"})
    with pytest.raises(StorageConflict):
        old.truncate_after(0, 1)
    with pytest.raises(StorageConflict):  # a gang that starts late is refused at once
        DurableState(str(tmp_path / "late"), remote=remote, follow=True).claim(0, fence=15)
    assert new.manifest(0).epoch == 2 and not (tmp_path / "executor" / "p0" / "delta-000000000003.arrow").exists()
    new.write_delta(0, 3, {b"k0": b"new"})
    want[b"k0"] = b"new"
    fresh = DurableState(str(tmp_path / "elsewhere"), remote=remote, follow=True)
    assert fresh.load(0) == (want, 3)


def _delta(d: DurableState, epoch: int) -> dict[bytes, bytes | None]:
    got = d.deltas_after(0, epoch - 1, epoch)
    assert got is not None
    return got[0][0][1]


def test_the_drivers_compaction_meets_the_executors_newer_deltas(remote: ObjectStore, tmp_path: Path) -> None:
    """The driver (a follower) compacts recorded epochs while an executor's gang writes newer ones: each makes its
    manifest write again over the other's (the same fence, or the follower's), nothing is lost."""
    reference = DurableState(str(tmp_path / "reference"))  # the same writes, no object storage
    want = _write(reference, 0, range(0, 9))
    executor = DurableState(str(tmp_path / "executor"), remote=remote, follow=True)
    executor.claim(0, fence=7)
    _write(executor, 0, range(0, 6))
    driver = DurableState(str(tmp_path / "driver"), remote=remote, follow=True)
    assert driver.load(0, 5) == reference.load(0, 5)  # its cache follows the executor's writes
    for e in range(6, 8):  # written after the driver last read the manifest
        executor.write_delta(0, e, _delta(reference, e))
    assert driver.compact(0, 4)
    m = driver.manifest(0)
    assert (m.base_epoch, m.epoch, m.fence) == (4, 7, 7)  # compacted over the newer manifest, the fence kept
    executor.write_delta(0, 8, _delta(reference, 8))  # meets the compaction's manifest: made again over it
    assert DurableState(str(tmp_path / "fresh"), remote=remote, follow=True).load(0) == (want, 8)
