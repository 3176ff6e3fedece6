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
