"""The NATS JetStream log beyond the shared contract (tests/log/test_log.py): dedup after JetStream's window, and
SIGKILL of nats-server and of appending processes under load (real processes, real server, no mocks)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from natsfix import NatsServer

from charon.log.nats import COUNTS_REFRESH_S, NatsInputLog, NatsLogError, NatsOutputLog
from charon.messages import Reply, Request
from charon.serde import encode


def req(rid: str, key: str | None = None) -> Request:
    return Request(rid, "account", key or rid, "deposit", encode([1]), 0.0)


@pytest.fixture
def server(tmp_path: Path):
    srv = NatsServer(tmp_path / "nats").start()
    yield srv
    srv.kill()


def test_dedup_outlives_the_jetstream_window(server: NatsServer) -> None:
    url = f"{server.url}/w{uuid.uuid4().hex[:8]}"
    with NatsInputLog(url, 2, dedup_window_s=0.5) as log, NatsOutputLog(url, dedup_window_s=0.5) as out:
        first = log.append(req("a"))
        assert out.put(Reply("a", 1, 0, True, encode(1)))
        time.sleep(1.2)  # the server forgot the message ids: the claim index still knows them
        assert log.append(req("a"), partition=1 - first[0]) == first
        assert log.append_many([req("b"), req("a")])[1] == first
        assert log.count() == 2
        assert not out.put(Reply("a", 2, 1, False))
        assert out.count() == 1 and out.get("a").tid == 1
    # a writer that died between storing a reply and indexing it: the next writer re-indexes the tail
    with NatsOutputLog(url, dedup_window_s=0.5) as out:
        out.c.run(lambda: out.c.js.publish(out.subject, _reply_bytes("z"), stream=out.stream,
                                            headers={"Nats-Msg-Id": _h("z")}))
    time.sleep(1.2)
    with NatsOutputLog(url, dedup_window_s=0.5) as out:
        assert not out.put(Reply("z", 9, 9, True)), "the unindexed reply was found, not stored again"
        assert [r.request_id for _, r in out.read_since(0)] == ["a", "z"]


def _h(rid: str) -> str:
    from charon.log.nats import _rid_hash

    return _rid_hash(rid)


def _reply_bytes(rid: str) -> bytes:
    from charon.serde import encode_reply

    return encode_reply(Reply(rid, 1, 0, True))


def test_stale_claim_is_resolved_once(server: NatsServer) -> None:
    """An appender that claimed an id and died: a retry after the window publishes it (if it never was) or
    finds it (if it was), never twice."""
    url = f"{server.url}/c{uuid.uuid4().hex[:8]}"
    with NatsInputLog(url, 1, dedup_window_s=0.5) as log:
        kv = log.c.run(log._bucket)  # noqa: SLF001 - write the claims a crashed appender leaves
        old = f"c|0|{time.time() - 5:.6f}".encode()
        log.c.run(lambda: kv.put(f"in.{_h('lost')}", old))  # claimed, never published
        log.append(req("x"))
        log.c.run(lambda: log.c.js.publish(log._subject(0), _req_bytes("kept"), stream=log._stream(0),  # noqa: SLF001
                                           headers={"Nats-Msg-Id": _h("kept")}))
        log.c.run(lambda: kv.put(f"in.{_h('kept')}", f"c|0|{time.time() - 1:.6f}".encode()))  # published
        time.sleep(1.0)
        assert log.position("lost") is None and not log.contains("lost")
        assert log.position("kept") == (0, 1)
        assert log.append_many([req("lost"), req("kept")]) == [(0, 2), (0, 1)]
        assert log.append(req("lost")) == (0, 2)
        assert [r.request_id for r in log.read(0, 0, 3)] == ["x", "kept", "lost"]


def _req_bytes(rid: str) -> bytes:
    from charon.serde import encode_request

    return encode_request(req(rid))


# -- SIGKILL under load ----------------------------------------------------------------------------

def _appender(url: str, worker: int, n: int, batch: int, ack_path: str, gate: str | None = None,
              pause_s: float = 0.0) -> None:
    """Append ids w<worker>-<i> in batches, retrying each batch until it is taken; ack it to a file. With ``gate``,
    the second half waits until that file exists, then goes on a batch every ``pause_s``."""
    done = set(Path(ack_path).read_text().split()) if os.path.exists(ack_path) else set()
    log = NatsInputLog(url, timeout_s=2.0)
    with open(ack_path, "a") as acks:
        i = 0
        while i < n:
            if gate is not None and i >= n // 2:
                while not os.path.exists(gate):
                    time.sleep(0.01)
                time.sleep(pause_s)
            ids = [f"w{worker}-{j}" for j in range(i, min(n, i + batch))]
            i += batch
            if all(x in done for x in ids):
                continue
            while True:
                try:
                    log.append_many([req(x) for x in ids])
                    break
                except NatsLogError:
                    time.sleep(0.1)
            acks.write("".join(x + "\n" for x in ids))
            acks.flush()
            os.fsync(acks.fileno())


def _replier(url: str, n: int, ack_path: str) -> None:
    """The output-log writer: puts replies in epochs of 10, each epoch put twice (a replay), acks them."""
    done = set(Path(ack_path).read_text().split()) if os.path.exists(ack_path) else set()
    out = NatsOutputLog(url, timeout_s=2.0)
    with open(ack_path, "a") as acks:
        for e in range(n // 10):
            ids = [f"q{e}-{j}" for j in range(10)]
            if all(x in done for x in ids):
                continue
            for _ in range(2):
                while True:
                    try:
                        out.put_many([Reply(x, 1, e, True) for x in ids])
                        break
                    except NatsLogError:
                        time.sleep(0.1)
            acks.write("".join(x + "\n" for x in ids))
            acks.flush()


def test_sigkill_server_and_appenders_nothing_lost_nothing_twice(server: NatsServer, tmp_path: Path) -> None:
    url = f"{server.url}/k{uuid.uuid4().hex[:8]}"
    NatsInputLog(url, 3).close()
    ctx = mp.get_context("spawn")
    n, workers = 400, 3
    acks = [str(tmp_path / f"acks{w}") for w in range(workers)]
    racks = str(tmp_path / "racks")

    def spawn(w: int) -> mp.Process:
        p = ctx.Process(target=_appender, args=(url, w, n, 1 + 4 * (w % 2), acks[w]))
        p.start()
        return p

    procs = [spawn(w) for w in range(workers)]
    replier = ctx.Process(target=_replier, args=(url, 300, racks))
    replier.start()

    def acked() -> int:
        return sum(len(Path(a).read_text().split()) for a in acks if os.path.exists(a))

    deadline = time.monotonic() + 120
    kills = 0
    while kills < 2 and time.monotonic() < deadline:  # SIGKILL the server twice under load
        if acked() >= (kills + 1) * n * workers // 4:
            server.kill()
            time.sleep(0.5)
            server.start()
            kills += 1
        time.sleep(0.05)
    assert kills == 2
    os.kill(procs[0].pid, signal.SIGKILL)  # and an appender, mid-batch; its replacement retries the same ids
    procs[0].join()
    procs[0] = spawn(0)
    for p in [*procs, replier]:
        p.join(180)
        assert p.exitcode == 0

    log = NatsInputLog(url)
    ends = log.end_offsets()
    rows = log.read_range([0] * 3, ends)
    ids = [r.request_id for _, _, r in rows]
    want = {f"w{w}-{i}" for w in range(workers) for i in range(n)}
    assert len(ids) == len(set(ids)), "an id was appended twice"
    assert set(ids) == want, "an acknowledged id is missing"
    for p in range(3):
        assert [o for q, o, _ in rows if q == p] == list(range(ends[p])), "offsets are dense per partition"
    out = NatsOutputLog(url)
    rids = [r.request_id for _, r in out.read_since(0, limit=10**6)]
    assert len(rids) == len(set(rids)) == 300, "each reply stored once"
    log.close()
    out.close()


def test_resize_under_load_from_appenders_in_other_processes(server: NatsServer, tmp_path: Path) -> None:
    """Three appender processes (each with its own cached counts, some retrying ids) while this process resizes
    the log 2 -> 4 -> 3: every id exactly once across all partitions, the new partitions took the other
    processes' appends (they refreshed their counts), offsets stay dense."""
    url = f"{server.url}/z{uuid.uuid4().hex[:8]}"
    NatsInputLog(url, 2).close()
    ctx = mp.get_context("spawn")
    n, workers = 600, 3
    acks = [str(tmp_path / f"acks{w}") for w in range(workers)]
    gate = str(tmp_path / "grown")  # the second halves wait for the growth, then append for ~3 s (> COUNTS_REFRESH_S)
    procs = [ctx.Process(target=_appender, args=(url, w, n, 1 + 4 * (w % 2), acks[w], gate, 0.01))
             for w in range(workers)]
    for p in procs:
        p.start()

    def acked() -> int:
        return sum(len(Path(a).read_text().split()) for a in acks if os.path.exists(a))

    log = NatsInputLog(url)
    deadline = time.monotonic() + 120
    for step, count in enumerate((4, 3)):
        while acked() < (step + 1) * n * workers // 3:
            assert time.monotonic() < deadline, "the appenders made no progress"
            time.sleep(0.02)
        assert log.resize(count) == (4, count)
        Path(gate).touch()
        if count == 4:  # the paced second halves run with the grown log for longer than a handle's refresh period
            time.sleep(2 * COUNTS_REFRESH_S)
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    ends = log.end_offsets()
    rows = log.read_range([0, 0], ends)  # an offsets list from before the growth: padded
    ids = [r.request_id for _, _, r in rows]
    assert len(ids) == len(set(ids)), "an id was appended twice"
    assert set(ids) == {f"w{w}-{i}" for w in range(workers) for i in range(n)}, "an acknowledged id is missing"
    assert len(ends) == 4 and ends[2] > 0 and ends[3] > 0, "appenders in other processes used the new partitions"
    for p in range(4):
        assert [o for q, o, _ in rows if q == p] == list(range(ends[p])), "offsets are dense per partition"
    log.close()


def test_cli_log_options_are_checked(tmp_path: Path) -> None:
    """--engine remote needs --log; --log must be a NATS URL; an unreachable server is a clear error."""
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from charon.cli import main; main()", "run",
                               "charon.apps.ycsb:app", *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})

    p = run("--engine", "remote")
    assert p.returncode != 0 and "--engine remote needs --log" in p.stderr
    p = run("--engine", "inprocess", "--log", str(tmp_path / "x"))
    assert p.returncode != 0 and "must be a nats://" in p.stderr
    port = __import__("natsfix").free_port()  # nothing listens there
    p = run("--engine", "remote", "--log", f"nats://127.0.0.1:{port}/x")
    assert p.returncode == 3 and "is not reachable" in p.stderr and "Traceback" not in p.stderr  # UNAVAILABLE


def test_remote_gateway_answers_503_while_the_log_is_down(server: NatsServer, tmp_path: Path) -> None:
    """A gateway without an engine (``--engine remote``): while nats-server is down, invokes, status polls and
    /health answer 503 with Retry-After (a retry with the same key is safe), and it serves again after."""
    import subprocess
    import sys

    import httpx
    from natsfix import free_port
    from nodeproc import wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer t"}
    gw = subprocess.Popen([sys.executable, "-c", "from charon.cli import main; main()", "run", "charon.apps.ycsb:app",
                           "--engine", "remote", "--log", f"{server.url}/g", "--port", str(port), "--token", "t"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(gw, url)
        server.kill()
        r = httpx.post(f"{url}/invoke/account/a0/deposit", json={"args": [1]}, timeout=60,
                       headers={**auth, "Idempotency-Key": "k1"})
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
        assert httpx.get(f"{url}/requests/k1", headers=auth, timeout=60).status_code == 503
        # /health reuses a probe's answer for up to 1 s (LogProbe.max_age_s): it turns 503 within that
        deadline = time.monotonic() + 3
        while httpx.get(f"{url}/health", timeout=60).status_code != 503:
            assert time.monotonic() < deadline, "/health still says ok 3 s into the outage"
            time.sleep(0.1)
        server.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health", timeout=60).status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not recover with the log"
            time.sleep(0.5)
        assert httpx.get(f"{url}/requests/never-sent", headers=auth, timeout=60).status_code == 404
    finally:
        gw.terminate()
        _, err = gw.communicate(timeout=30)
    assert "Traceback" not in err, err


def test_a_reply_stored_by_a_failed_attempt_is_not_stored_again(server: NatsServer) -> None:
    """The server can fail after a reply's publish is acknowledged and before its index entry exists (the
    attempt then raises): the writer's retry must find that copy instead of storing a second one."""
    url = f"{server.url}/r{uuid.uuid4().hex[:8]}"
    out = NatsOutputLog(url)
    try:
        real = out._kv_create
        failed = []

        async def index_fails_once(key: str, value: bytes, kv=None):  # noqa: ANN001, ANN202
            if key.startswith("out.") and key != "out.watermark" and not failed:
                failed.append(key)
                raise NatsLogError("injected: the server went away before the index entry")
            return await real(key, value, kv)

        out._kv_create = index_fails_once
        with pytest.raises(NatsLogError):
            out.put_many([Reply("a", 1, 0, True, encode(1)), Reply("b", 2, 0, True, encode(2))])
        assert failed, "the fault was injected"
        assert out.put_many([Reply("a", 1, 0, True, encode(1)), Reply("b", 2, 0, True, encode(2))]) in (0, 1, 2)
        rids = [r.request_id for _, r in out.read_since(0, limit=100)]
        assert sorted(rids) == ["a", "b"], rids
        assert out.get("a") is not None and out.get("b") is not None
    finally:
        out.close()
