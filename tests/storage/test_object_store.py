"""The object-store contract, one suite over both backends: ``file://`` and ``s3://`` on a real SeaweedFS."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from charon.storage.contract import ObjectNotFound, ObjectStore, StorageConflict, StorageUnavailable
from charon.storage.location import StorageUrlError, check_storage_url, open_storage
from charon.storage.s3 import ByteBudget, S3Store
from tests.support.seaweedfix import SeaweedS3


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_storage(f"file://{tmp_path / 'objects'}")
    server: SeaweedS3 = request.getfixturevalue("s3_env")
    return open_storage(server.url(f"t-{uuid.uuid4().hex[:8]}"))


def test_put_get_roundtrip_and_etags(store: ObjectStore) -> None:
    etag = store.put("state/p0/manifest.json", b'{"epoch": 1}')
    data, got = store.get("state/p0/manifest.json")
    assert (data, got) == (b'{"epoch": 1}', etag)
    etag2 = store.put("state/p0/manifest.json", b'{"epoch": 2}')
    assert etag2 != etag
    assert store.get("state/p0/manifest.json") == (b'{"epoch": 2}', etag2)


def test_missing_object_is_typed(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound):
        store.get("nothing/here")
    with pytest.raises(FileNotFoundError):  # callers that retry a vanished file catch it as one
        store.get("nothing/here")
    store.delete("nothing/here")  # deleting what is absent is no error


def test_list_by_string_prefix_sorted(store: ObjectStore) -> None:
    for key in ("a/b/2", "a/b/1", "a/bc/1", "a/c", "z"):
        store.put(key, key.encode())
    assert [o.key for o in store.list("a/b/")] == ["a/b/1", "a/b/2"]
    assert [o.key for o in store.list("a/b")] == ["a/b/1", "a/b/2", "a/bc/1"]
    listed = store.list("a/")
    assert [o.key for o in listed] == ["a/b/1", "a/b/2", "a/bc/1", "a/c"]
    assert [o.size for o in listed] == [5, 5, 6, 3]
    store.delete("a/b/1")
    assert [o.key for o in store.list("a/b/")] == ["a/b/2"]


def test_create_only_put_refuses_an_existing_object(store: ObjectStore) -> None:
    store.put("epochs/000000000007.msgpack", b"first", if_absent=True)
    with pytest.raises(StorageConflict):
        store.put("epochs/000000000007.msgpack", b"second", if_absent=True)
    assert store.get("epochs/000000000007.msgpack")[0] == b"first"


def test_if_match_fences_a_stale_writer(store: ObjectStore) -> None:
    v1 = store.put("state/p0/manifest.json", b"v1")
    stale = v1  # writer A read v1 and stalls
    v2 = store.put("state/p0/manifest.json", b"v2", if_match=v1)  # writer B moves on
    with pytest.raises(StorageConflict):
        store.put("state/p0/manifest.json", b"A's", if_match=stale)
    assert store.get("state/p0/manifest.json") == (b"v2", v2)
    v3 = store.put("state/p0/manifest.json", b"v3", if_match=v2)
    assert store.get("state/p0/manifest.json") == (b"v3", v3)


def test_concurrent_conditional_writers_one_wins(store: ObjectStore) -> None:
    base = store.put("lease", b"0")
    wins: list[int] = []

    def writer(i: int) -> None:
        try:
            store.put("lease", str(i).encode(), if_match=base)
            wins.append(i)
        except StorageConflict:
            pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get("lease")[0] == str(wins[0]).encode()


def test_files_stream_both_ways(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "big.arrow"
    payload = bytes(range(256)) * 40_000  # ~10 MB: a multipart upload on S3
    src.write_bytes(payload)
    store.put_file("state/p1/base.arrow", str(src))
    dst = tmp_path / "copy.arrow"
    store.get_file("state/p1/base.arrow", str(dst))
    assert dst.read_bytes() == payload
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(ObjectNotFound):
        store.get_file("state/p1/none.arrow", str(tmp_path / "none"))
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "s3://b/p?x=1", "file://host/dir", "gs://b"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(StorageUrlError):
        check_storage_url(url)


def test_urls() -> None:
    assert check_storage_url("s3://bucket/a/b/") == ("s3", "bucket", "a/b")
    assert check_storage_url("file:///srv/x") == ("file", "/srv/x", "")


def test_byte_budget_bounds_what_is_in_flight() -> None:
    budget = ByteBudget(100)
    peak = 0
    lock = threading.Lock()

    def use(n: int) -> None:
        nonlocal peak
        with budget.hold(n):
            with lock:
                peak = max(peak, budget.held)
            time.sleep(0.02)

    threads = [threading.Thread(target=use, args=(n,)) for n in (60, 60, 30, 150, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.held == 0
    assert 60 <= peak <= 150  # the 150-byte upload ran alone; nothing else ever exceeded 100 together


def test_s3_server_restart_keeps_objects_and_outage_is_typed(s3_env: SeaweedS3) -> None:
    store = S3Store(s3_env.bucket, f"restart-{uuid.uuid4().hex[:8]}", retry_s=2.0, request_timeout_s=2.0)
    etag = store.put("state/p0/manifest.json", b"before")
    s3_env.kill()
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            store.put("state/p0/manifest.json", b"during")
        assert time.monotonic() - started < 15  # bounded retries, not a hang
        with pytest.raises(StorageUnavailable):
            store.get("state/p0/manifest.json")
    finally:
        s3_env.start()
    deadline = time.monotonic() + 60  # a restarted SeaweedFS answers 500 until its volumes are back
    while True:
        try:
            got = store.get("state/p0/manifest.json")
            break
        except StorageUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    assert got == (b"before", etag)
    store.put("state/p0/manifest.json", b"after", if_match=etag)
    assert store.get("state/p0/manifest.json")[0] == b"after"
