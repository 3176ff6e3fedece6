"""The durable single-node engine (`charon run --engine inprocess`): SIGKILL under HTTP load, clean restart,
exactly-once across restarts, and the storage's bounds (compaction, log truncation, kept stats)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from charon import serde
from charon.messages import Request
from charon.runtime.node.inprocess import InProcessRuntime
from charon.runtime.node.storage import EPOCH_MARK, NodeError, NodeStorage
from charon.server.serve import free_port

TESTS = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(TESTS))
from node_app import app as ledger  # noqa: E402

TOKEN = "t0k"
ACCOUNTS = [f"a{i}" for i in range(8)]


@pytest.fixture(autouse=True)
def _no_server_left() -> object:
    """A test that fails midway does not leave its server running (it would hold a port and a core)."""
    yield
    while Server.started:
        proc = Server.started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class Server:
    """`charon run node_app:app --engine inprocess` in its own process."""

    started: list[subprocess.Popen] = []  # every server a test started (killed after it if still running)

    def __init__(self, data_dir: Path | None, *extra: str) -> None:
        self.port = free_port()
        args = ["run", "node_app:app", "--engine", "inprocess", "--port", str(self.port), "--token", TOKEN,
                "--partitions", "4", *extra]
        if data_dir is not None:
            args += ["--data-dir", str(data_dir)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from charon.cli import main; main()", *args],
            cwd=TESTS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "COLUMNS": "300"},
        )
        Server.started.append(self.proc)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> str:
        """SIGTERM (a clean shutdown; uvicorn re-raises the signal once it has shut down); returns stderr."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode in (0, -signal.SIGTERM), err
        # the only tracebacks are the aborts' (logged with the user's frames): nothing of the engine crashed
        tracebacks = err.split("Traceback (most recent call last):")[1:]
        assert all(tb.lstrip().startswith(f'File "{TESTS}') for tb in tracebacks), err
        return err


def _invoke(client: httpx.AsyncClient, key: str, fn: str, args: list, tag: str):
    return client.post(f"/invoke/acct/{key}/{fn}", json={"args": args},
                       headers={"Idempotency-Key": tag, "Authorization": f"Bearer {TOKEN}"})


def _tag_call(tag: str) -> tuple[str, str, list]:
    w, i = (int(x) for x in tag[1:].split("-"))
    payer, payee = ACCOUNTS[(w + i) % 8], ACCOUNTS[(w + i + 3) % 8]
    if tag[0] == "f":
        return payer, "fail", [tag]
    return payer, "pay", [payee, tag]


async def _load(
    url: str, seconds: float, workers: int = 24, first_worker: int = 0
) -> tuple[dict[str, dict], set[str]]:
    """Concurrent clients with Idempotency-Keys until the server dies or ``seconds`` pass.

    Returns the acknowledged replies (tag -> body with the status) and every tag that was sent."""
    acked: dict[str, dict] = {}
    sent: set[str] = set()
    stop_at = time.monotonic() + seconds

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        i = 0
        while time.monotonic() < stop_at:
            tag = f"{'f' if i % 10 == 9 else 't'}{w}-{i}"
            key, fn, args = _tag_call(tag)
            sent.add(tag)
            try:
                r = await _invoke(client, key, fn, args, tag)
            except httpx.HTTPError:
                return  # the server is gone
            if r.status_code in (200, 409):
                acked[tag] = {**r.json(), "http": r.status_code}
            i += 1

    async with httpx.AsyncClient(base_url=url, timeout=30,
                                 limits=httpx.Limits(max_connections=workers)) as client:
        await asyncio.gather(*(worker(w, client) for w in range(first_worker, first_worker + workers)))
    return acked, sent


async def _retry_all(url: str, tags: list[str], workers: int = 16) -> dict[str, dict]:
    out: dict[str, dict] = {}
    it = iter(tags)

    async def worker(client: httpx.AsyncClient) -> None:
        for tag in it:
            key, fn, args = _tag_call(tag)
            r = await _invoke(client, key, fn, args, tag)
            assert r.status_code in (200, 409), (tag, r.status_code, r.text)
            out[tag] = {**r.json(), "http": r.status_code}

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(workers)))
    return out


def _check_ledger(data_dir: Path, acked: dict[str, dict], sent: set[str], log_url: str | None = None) -> None:
    """Every acknowledged payment is in the state once; nothing ran twice; no aborted write survived."""
    rt = InProcessRuntime(ledger, partitions=4, data_dir=str(data_dir), log_url=log_url)
    try:
        items = {a: rt.read_items("acct", a) for a in ACCOUNTS}
        totals = {a: rt.read_state("acct", a, 0) for a in ACCOUNTS}
    finally:
        rt.close()
    for tag in sent:
        payer, fn, args = _tag_call(tag)
        if fn == "fail":
            assert tag not in items[payer], tag
            continue
        payee = args[0]
        n_out, n_in = items[payer].get(tag, 0), items[payee].get("in:" + tag, 0)
        assert n_out == n_in, (tag, n_out, n_in)
        assert n_out <= 1, f"{tag} executed {n_out} times"
        if tag in acked:
            assert n_out == 1, f"acknowledged {tag} is not in the state"
    for a in ACCOUNTS:  # each account's counter = the payments it made
        made = sum(1 for k, v in items[a].items() if not k.startswith("in:") and v == 1)
        assert totals[a] == made, (a, totals[a], made)


@pytest.mark.slow  # ~20 s of HTTP load and SIGKILLs
@pytest.mark.timeout(300)
def test_sigkill_under_http_load_then_clean_restart(tmp_path: Path) -> None:
    """Two SIGKILLs under concurrent HTTP load (the second while earlier keys are being retried), restart,
    then a clean stop and restart: acknowledged replies are in the state and come back identical on retry,
    and every Idempotency-Key executed exactly once."""
    data = tmp_path / "data"
    acked: dict[str, dict] = {}
    sent: set[str] = set()
    for cycle in range(2):
        srv = Server(data)

        async def load_and_kill(srv: Server, cycle: int, earlier: list[str]) -> tuple[dict, set, dict]:
            load = asyncio.ensure_future(_load(srv.url, 90.0, first_worker=100 * cycle))
            again = await _retry_all(srv.url, earlier) if earlier else {}  # retries under load
            await asyncio.sleep(3.0)
            assert not load.done()
            srv.kill()  # SIGKILL with requests in flight
            return (*await load, again)

        new_acked, new_sent, again = asyncio.run(load_and_kill(srv, cycle, sorted(sent)))
        err = srv.proc.stderr.read()  # type: ignore[union-attr]
        assert "durable in" in err
        assert cycle == 0 or "recovered by replaying" in err
        for tag, body in again.items():
            assert acked.setdefault(tag, body) == body, (tag, acked[tag], body)
        assert len(new_acked) > 50, len(new_acked)
        acked.update(new_acked)
        sent |= new_sent
    assert any(b["http"] == 409 for b in acked.values())

    # restart after SIGKILL: every acknowledged key returns its first reply; the rest runs at most once
    srv = Server(data)
    again = asyncio.run(_retry_all(srv.url, sorted(sent)))
    for tag, body in acked.items():
        assert again[tag] == body, (tag, body, again[tag])
    st = httpx.get(f"{srv.url}/state/acct/a0", headers={"Authorization": f"Bearer {TOKEN}"}).json()["value"]
    err = srv.stop()
    assert "durable in" in err and "recovered by replaying" in err

    # clean restart: same state, same replies, nothing left to replay
    srv = Server(data)
    st2 = httpx.get(f"{srv.url}/state/acct/a0", headers={"Authorization": f"Bearer {TOKEN}"}).json()["value"]
    assert st2 == st
    sample = sorted(acked)[::7]
    assert asyncio.run(_retry_all(srv.url, sample)) == {t: acked[t] for t in sample}
    for tag in sorted(acked)[1::97]:  # the status URL answers from the output log after a restart
        r = httpx.get(f"{srv.url}/requests/{tag}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert {**r.json(), "http": r.status_code} == acked[tag]
    assert "recovered by replaying" not in srv.stop()  # the clean stop checkpointed everything
    _check_ledger(data, acked, sent)


def test_ephemeral_mode_is_named_and_keeps_nothing(tmp_path: Path) -> None:
    srv = Server(None, "--ephemeral")
    try:
        r = httpx.post(f"{srv.url}/invoke/acct/a0/pay", json={"args": ["a1", "x"]},
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
    finally:
        err = srv.stop()
    assert "EPHEMERAL" in err
    assert not (TESTS / "charon-data").exists()


async def test_restart_in_process_exactly_once(tmp_path: Path) -> None:
    rt = InProcessRuntime(ledger, partitions=4, data_dir=str(tmp_path))
    assert rt.durable
    async with rt:
        first = await rt.submit("acct", "a0", "pay", ["a1", "k1"], request_id="k1")
        bad = await rt.submit("acct", "a0", "fail", ["k2"], request_id="k2")
    rt.close()
    rt = InProcessRuntime(ledger, partitions=4, data_dir=str(tmp_path))
    async with rt:
        assert await rt.submit("acct", "a0", "pay", ["a1", "k1"], request_id="k1") == first
        assert await rt.submit("acct", "a0", "fail", ["k2"], request_id="k2") == bad
    assert rt.read_items("acct", "a0") == {"k1": 1}
    rt.close()


def test_volatile_without_data_dir(tmp_path: Path) -> None:
    rt = InProcessRuntime(ledger, partitions=2)
    assert not rt.durable and rt.node is None


def test_directory_lock_and_layout(tmp_path: Path) -> None:
    rt = InProcessRuntime(ledger, partitions=4, data_dir=str(tmp_path))
    with pytest.raises(NodeError, match="in use"):
        NodeStorage(str(tmp_path), 4)
    rt.close()
    other = NodeStorage(str(tmp_path), 2)  # another count opens with the directory's; the runtime rescales it
    assert other.partitions == 4
    other.close()


def test_compaction_truncates_log_and_bounds_stats(tmp_path: Path) -> None:
    rt = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path), compact_every=2, stats_kept=5)
    rt.load("acct", {a: 0 for a in ACCOUNTS})
    for e in range(12):
        rt.run_epoch([Request(f"r{e}", "acct", ACCOUNTS[e % 8], "pay", serde.encode(["a1", f"t{e:02d}"]), 1.0)])
        rt.node.flush()  # one checkpoint per epoch
    assert len(rt.epoch_stats) == 5 and rt.epoch_stats[-1]["epoch"] == 11
    assert rt.node.input_log.start_offsets()[0] > 0  # entries before the compacted checkpoint are gone
    for pid in range(2):
        assert len([f for f in rt.node.durable.files(pid) if f.startswith("delta-")]) <= 2
    before = rt.snapshot()
    rt.close()
    rt = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path))
    assert rt.snapshot() == before and rt.epoch == 12
    with pytest.raises(RuntimeError, match="fresh"):
        rt.load("acct", {"zz": 1})
    rt.close()


_CRASH_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/../runtime")
from node_app import app
from test_node import epoch_requests
from charon.runtime.node.inprocess import InProcessRuntime
rt = InProcessRuntime(app, partitions=4, data_dir=sys.argv[2], compact_every=int(sys.argv[3]),
                      fsync=sys.argv[4] == "fsync")
rt.load("acct", {"a0": 0})
for e in range(8):
    rt.run_epoch(epoch_requests(e))
    rt.node.flush()
"""


def epoch_requests(e: int) -> list[Request]:
    """A fixed workload: payments between the ledger's accounts and one aborting call per epoch."""
    out = [Request(f"e{e}-{i}", "acct", ACCOUNTS[(e + i) % 8], "pay",
                   serde.encode([ACCOUNTS[(e * 3 + i + 1) % 8], f"e{e}-{i}"]), 1.0 + e) for i in range(6)]
    out.append(Request(f"e{e}-f", "acct", ACCOUNTS[e % 8], "fail", serde.encode([f"e{e}-f"]), 1.0 + e))
    return out


@pytest.mark.parametrize("point,compact_every,fsync", [
    ("logged", 2, "fsync"), ("delta0", 2, "fsync"), ("deltas", 2, "fsync"), ("record", 2, "fsync"),
    ("compacting", 5, "fsync"), ("delta0", 2, "no-fsync"),
])
def test_crash_points_recover_the_serial_outcome(
    tmp_path: Path, point: str, compact_every: int, fsync: str
) -> None:
    """SIGKILL at each step of logging and checkpointing epoch 4; recovery equals an uninterrupted run."""
    env = {**os.environ, "CHARON_CRASH_AT": f"node:{point}:4"}
    p = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(TESTS), str(tmp_path), str(compact_every), fsync],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    ref = InProcessRuntime(ledger, partitions=4)
    ref.load("acct", {"a0": 0})
    ref_replies = {}
    for e in range(5):  # epoch 4 was logged before the crash in every case
        ref_replies.update({r.request_id: r for r in ref.run_epoch(epoch_requests(e)).replies.values()})
    rt = InProcessRuntime(ledger, partitions=4, data_dir=str(tmp_path))
    try:
        assert rt.epoch == 5
        assert rt.replayed_epochs == (1 if point in ("logged", "delta0", "deltas") else 0)
        assert rt.snapshot() == ref.snapshot()
        for rid, rep in ref_replies.items():
            assert rt.get_reply(rid) == rep
        rt.run_epoch(epoch_requests(5))  # and it continues like the reference
        ref.run_epoch(epoch_requests(5))
        assert rt.snapshot() == ref.snapshot()
    finally:
        rt.close()


async def test_a_failed_log_stops_the_node_loudly(tmp_path: Path) -> None:
    """When an epoch cannot be logged, its requests fail at once and new ones are refused (no hang); a
    log that does not add up is refused at the next start."""
    rt = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path))
    assert rt.health()["status"] == "stopped" and not rt.health()["ok"]
    async with rt:
        await rt.submit("acct", "a0", "pay", ["a1", "ok"], request_id="ok")
        assert rt.health()["ok"] and rt.health()["status"] == "ok"
        # someone else wrote the next epoch's marker: logging that epoch must fail
        rt.node.input_log.append_many([(Request(f"{EPOCH_MARK}:{rt.epoch}", EPOCH_MARK, str(rt.epoch), "",
                                                serde.encode([]), 1.0), 0)])
        with pytest.raises(RuntimeError, match="runtime stopped.*already holds epoch"):
            await asyncio.wait_for(rt.submit("acct", "a0", "pay", ["a1", "x"], request_id="x"), 10)
        assert rt.failed is not None
        health = rt.health()  # what GET /health reports: the outage, not "ok"
        assert health["status"] == "failed" and not health["ok"] and "already holds epoch" in health["last_error"]
        with pytest.raises(RuntimeError, match="runtime stopped"):
            await rt.submit("acct", "a0", "pay", ["a1", "y"], request_id="y")
    rt.close()
    with pytest.raises(NodeError, match="after the last epoch marker"):
        InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path))
