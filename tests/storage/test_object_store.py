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


def test_conditional_file_puts_fence_like_puts(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "effects.sqlite"
    src.write_bytes(b"one")
    v1 = store.put_file("files/effects.sqlite", str(src), if_absent=True)
    with pytest.raises(StorageConflict):
        store.put_file("files/effects.sqlite", str(src), if_absent=True)
    src.write_bytes(b"two")
    v2 = store.put_file("files/effects.sqlite", str(src), if_match=v1)
    src.write_bytes(b"stale")
    with pytest.raises(StorageConflict):  # a writer still holding v1 is fenced
        store.put_file("files/effects.sqlite", str(src), if_match=v1)
    assert store.get("files/effects.sqlite") == (b"two", v2)


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
    assert 60 <= peak <= 100  # the 150-byte upload took the whole budget (alone); nothing ever exceeded 100


def test_a_whole_file_over_the_budget_waits_for_it(s3_env: SeaweedS3, tmp_path: Path) -> None:
    """A side file larger than the upload budget (a 2 MiB effects store, a 1 MiB budget) waits while another upload
    is in flight (the server stopped under it), then takes the whole budget: the bytes in flight, as the store
    reports them to its meter, never exceed the budget."""
    import os
    import signal
    import sqlite3

    from charon.runtime.sidefiles import SideFiles
    from charon.storage.metered import Metered, StorageMeter

    budget = 1 << 20
    meter = StorageMeter()
    store = Metered(S3Store(s3_env.bucket, f"budget-{uuid.uuid4().hex[:8]}", max_inflight_bytes=budget,
                            meter=meter), meter)
    data = tmp_path / "data"
    data.mkdir()
    db = sqlite3.connect(data / "effects.sqlite")
    db.execute("CREATE TABLE t (b BLOB)")
    db.executemany("INSERT INTO t VALUES (?)", [(os.urandom(64 << 10),) for _ in range(32)])  # 2 MiB
    db.commit()
    db.close()
    side = SideFiles(str(data), store)
    other = 600 << 10
    done: dict[str, float] = {}

    def run(name: str, op) -> None:  # noqa: ANN001
        op()
        done[name] = time.monotonic()

    os.killpg(s3_env.proc.pid, signal.SIGSTOP)  # the server takes requests and answers none
    try:
        a = threading.Thread(target=run, args=("other", lambda: store.put("other", b"x" * other)))
        a.start()
        deadline = time.monotonic() + 10
        while meter.inflight_up != other:  # the other upload is in flight (its request sent, unanswered)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b = threading.Thread(target=run, args=("side", side.ship))
        b.start()
        time.sleep(1.5)
        assert not done  # the side file waits for the budget ...
        assert meter.inflight_up == meter.peak_inflight_up == other  # ... instead of going up beside the other
    finally:
        os.killpg(s3_env.proc.pid, signal.SIGCONT)
    a.join(60)
    b.join(60)
    assert set(done) == {"other", "side"} and done["other"] <= done["side"]
    snap = meter.snapshot()
    assert snap["inflight_up"] == 0 and snap["peak_inflight_up"] == budget  # it took the whole budget, no more
    restored = tmp_path / "restored"
    restored.mkdir()
    assert SideFiles(str(restored), store).restore() == 1
    assert sqlite3.connect(restored / "effects.sqlite").execute("SELECT count(*) FROM t").fetchone() == (32,)


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
