"""The Spark driver's side files on object storage: its effects store, output streams and stream offsets are
shipped before every epoch record, so a driver SIGKILLed and its data directory deleted resumes on a fresh one with
every acknowledged payment, each effect's continuation run once and each payment's event once in its stream (real
PySpark ``local[2]``, SeaweedFS and nats-server; ``charon run --engine spark --effects``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from natsfix import NatsServer, free_port

from charon.storage.contract import ObjectNotFound
from charon.storage.location import open_storage
from tests.support.seaweedfix import SeaweedS3

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]
CHARON = str(Path(sys.executable).parent / "charon")
SUPPORT = str(Path(__file__).parents[1] / "support")
TOKEN = "t0k"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
KEYS = [f"k{i}" for i in range(12)]


def _driver(data: Path, log_url: str, storage: str, runs: Path, out: Path, port: int,
            sleep: float = 0.0, crash_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CHARON_CRASH_AT"}
    if crash_at is not None:
        env["CHARON_CRASH_AT"] = crash_at
    env = {**env, "CHARON_TEST_FX_SLEEP": str(sleep), "CHARON_MASTER": "local[2]",
           "CHARON_LOCAL_DIR": str(data) + "-executors", "CHARON_IDLE_WAIT_MS": "200", "CHARON_TEST_FX_RUNS": str(runs),
           "PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")]),
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    with open(out, "wb") as f:
        return subprocess.Popen(
            [CHARON, "run", "fx_storage_app:app", "--engine", "spark", "--partitions", "2", "--effects",
             "--data-dir", str(data), "--log", log_url, "--storage", storage, "--port", str(port), "--token", TOKEN],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait(proc: subprocess.Popen, out: Path, cond, what: str, timeout: float = 150.0):  # noqa: ANN001, ANN202
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, f"the driver exited:\n{out.read_text(errors='replace')[-3000:]}"
        try:
            got = cond()
            if got:
                return got
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout, f"{what}:\n{out.read_text(errors='replace')[-3000:]}"
        time.sleep(0.3)


def _metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus exposition, by name with labels."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_spark_driver_on_a_fresh_directory_takes_its_side_files_back(tmp_path: Path, s3_env: SeaweedS3) -> None:
    nats = NatsServer(tmp_path / "nats").start()
    log_url = f"{nats.url}/fxspark{uuid.uuid4().hex[:6]}"
    storage = s3_env.url(f"sparkfx-{uuid.uuid4().hex[:8]}")
    runs = tmp_path / "runs"
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    url1, url2 = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    first = _driver(m1, log_url, storage, runs, tmp_path / "m1.log", int(url1.rsplit(":", 1)[1]),
                    sleep=600)  # the effects of k6..k11 never finish on this machine
    second: subprocess.Popen | None = None
    try:
        _wait(first, tmp_path / "m1.log", lambda: httpx.get(url1 + "/health", timeout=2).status_code == 200,
              "the first driver did not start")
        started = _metrics(httpx.get(url1 + "/metrics", headers=HEADERS, timeout=30).text)
        acked = {}
        with httpx.Client(base_url=url1, headers=HEADERS, timeout=60) as c:
            for i, k in enumerate(KEYS):  # each acknowledged (its epoch logged, its reply given)
                r = c.post(f"/invoke/acct/{k}/pay", json={"args": [i + 1]}, headers={"Idempotency-Key": f"p-{k}"})
                assert r.status_code == 200, r.text
                acked[k] = i + 1
        # the effects of k0..k5 are done and continued (in epochs recorded after them), k6..k11's running
        with httpx.Client(base_url=url1, headers=HEADERS, timeout=60) as c:
            _wait(first, tmp_path / "m1.log", lambda: all(
                "ok" in (c.get(f"/state/acct/{k}").json()["value"] or {}) for k in KEYS[:6]), "no effect continued")
        assert len(runs.read_text().split()) == 6
        store = open_storage(storage)

        def shipped_results() -> bool:  # the effects store on storage has k0..k5's results
            try:
                store.get_file("files/effects.sqlite", str(tmp_path / "fx.sqlite"))
            except ObjectNotFound:
                return False
            with contextlib.closing(sqlite3.connect(tmp_path / "fx.sqlite")) as db:
                done = "SELECT count(*) FROM effects WHERE status IN ('resuming', 'done')"
                return db.execute(done).fetchone()[0] == 6

        _wait(first, tmp_path / "m1.log", shipped_results, "the effects' results were not shipped")
        metrics = _metrics(httpx.get(url1 + "/metrics", headers=HEADERS, timeout=30).text)
        put, get, delete = (f'charon_storage_requests_total{{op="{op}"}}' for op in ("put", "get", "delete"))
        epochs, puts, gets, deletes = (metrics[k] - started.get(k, 0.0) for k in ("charon_epochs_total", put, get,
                                                                                  delete))
        print(f"\nthe first driver, after its start: {epochs:.0f} epochs, {puts:.0f} PUTs, {gets:.0f} GETs, "
              f"{deletes:.0f} DELETEs to storage ({puts / epochs:.2f} PUTs an epoch); at its start "
              f"{started[put]:.0f} PUTs, {started[get]:.0f} GETs")
        # per epoch its bound, recovery.json and record, and the side files it changed (the streams' segment of
        # the epoch's atom, the effects store)
        assert 3 * epochs <= puts <= 5 * epochs, (epochs, puts)
        _kill(first)  # the machine is lost: its data directory and executors' directories with it
        shipped = {o.key for o in store.list("files/")}
        assert "files/effects.sqlite" in shipped, shipped
        segments = [o for o in store.list("files/streams/") if o.key.endswith(".atoms")]
        assert segments and "files/streams.sqlite" not in shipped, shipped  # the atoms alone, no whole file yet
        assert max(o.size for o in segments) < 1000  # an epoch's few events, not the stream so far
        shutil.rmtree(m1)
        shutil.rmtree(str(m1) + "-executors")

        second = _driver(m2, log_url, storage, runs, tmp_path / "m2.log", int(url2.rsplit(":", 1)[1]))
        with httpx.Client(base_url=url2, headers=HEADERS, timeout=60) as c:

            def continued() -> dict | None:
                got = {}
                for k in KEYS:
                    r = c.get(f"/state/acct/{k}")
                    if r.status_code != 200 or "ok" not in (r.json()["value"] or {}):
                        return None
                    got[k] = r.json()["value"]
                return got

            state = _wait(second, tmp_path / "m2.log", continued, "the effects were not all continued")
            page = c.get("/streams/paid", params={"from_offset": 0, "limit": 1000}).json()
        # every acknowledged payment is there, each continuation ran exactly once
        assert {k: (v["amount"], v["runs"], v["ok"]) for k, v in state.items()} == {
            k: (a, 1, True) for k, a in acked.items()}
        # each payment's event is in the stream once (the atoms of recorded epochs came back from storage, the
        # epochs replayed after the last record appended theirs once)
        events = sorted(tuple(e["value"]) for e in page["events"])
        assert events == sorted((k, a) for k, a in acked.items()), events
        assert page["next_offset"] == page["end_offset"] == len(KEYS)
        handled = runs.read_text().split()  # the results shipped are not asked for again, the others once
        assert len(handled) == len(set(handled)) == len(KEYS), handled
    finally:
        _kill(first)
        if second is not None:
            _kill(second)
        nats.kill()


def test_a_driver_killed_between_its_atoms_upload_and_its_record_loses_and_duplicates_nothing(
        tmp_path: Path, s3_env: SeaweedS3) -> None:
    """The driver SIGKILLed after it shipped the side files of its first epoch that changed them (the paying epoch's
    atom is on storage) and before that epoch's record; its data directory deleted. A driver on a fresh directory
    takes the atom back and replays the epoch (its atom appended again: nothing); the payment's event is in its
    stream once, and the payments after it follow at the next offsets."""
    nats = NatsServer(tmp_path / "nats").start()
    log_url = f"{nats.url}/fxcrash{uuid.uuid4().hex[:6]}"
    storage = s3_env.url(f"sparkcrash-{uuid.uuid4().hex[:8]}")
    runs = tmp_path / "runs"
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    url1, url2 = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    first = _driver(m1, log_url, storage, runs, tmp_path / "m1.log", int(url1.rsplit(":", 1)[1]),
                    crash_at="after_side_files:*")
    second: subprocess.Popen | None = None
    try:
        _wait(first, tmp_path / "m1.log", lambda: httpx.get(url1 + "/health", timeout=2).status_code == 200,
              "the first driver did not start")
        with contextlib.suppress(httpx.HTTPError):  # the driver dies before the epoch's record: no reply
            httpx.post(url1 + "/invoke/acct/k0/pay", json={"args": [1]}, timeout=60,
                       headers={**HEADERS, "Idempotency-Key": "p-k0"})
        assert first.wait(60) == -signal.SIGKILL, (tmp_path / "m1.log").read_text(errors="replace")[-3000:]
        store = open_storage(storage)
        segments = [o.key for o in store.list("files/streams/")]
        assert len(segments) == 1, segments  # the paying epoch's atom, shipped before its record
        epoch = int(segments[0].rsplit("-", 1)[1].removesuffix(".atoms"))
        recorded = [o.key for o in store.list("epochs/")]
        assert f"epochs/{epoch:012d}.msgpack" not in recorded, (epoch, recorded)  # never recorded
        shutil.rmtree(m1)
        shutil.rmtree(str(m1) + "-executors")

        second = _driver(m2, log_url, storage, runs, tmp_path / "m2.log", int(url2.rsplit(":", 1)[1]))
        _wait(second, tmp_path / "m2.log", lambda: httpx.get(url2 + "/health", timeout=2).status_code == 200,
              "the second driver did not start")
        with httpx.Client(base_url=url2, headers=HEADERS, timeout=60) as c:
            for i, k in enumerate(KEYS[:4]):  # k0 again under its key: replayed, not run twice
                r = c.post(f"/invoke/acct/{k}/pay", json={"args": [i + 1]}, headers={"Idempotency-Key": f"p-{k}"})
                assert r.status_code == 200, r.text
            page = c.get("/streams/paid", params={"from_offset": 0, "limit": 1000}).json()
        assert [tuple(e["value"]) for e in page["events"]] == [(k, i + 1) for i, k in enumerate(KEYS[:4])]
        assert [e["offset"] for e in page["events"]] == [0, 1, 2, 3]
        assert page["next_offset"] == page["end_offset"] == 4
    finally:
        _kill(first)
        if second is not None:
            _kill(second)
        nats.kill()
