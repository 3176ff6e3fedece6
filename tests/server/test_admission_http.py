"""Admission over real processes (issue 34 item 3): `charon run` (durable node) under a burst holds its limits,
answers 429 with Retry-After past a limit's queue, is SIGKILLed while requests wait, and after the restart every
decision, before and after the kill, is the one a straight in-process replay of its input log takes."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from charon import serde
from charon.log.sqlite import InputLog, OutputLog
from charon.runtime.node.inprocess import InProcessRuntime
from charon.runtime.node.storage import EPOCH_MARK
from charon.server.serve import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "admission-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APP = """
from charon import Application, Context, Limit, Operator

lim = Operator("lim")


@lim.function(public=True, limit=Limit(concurrency=3, rate=5.0, burst=2, per="key", queue=20))
async def take(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


app = Application("admit", [lim])
"""


def _start(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp}"}
    return subprocess.Popen(
        [sys.executable, "-m", "charon.cli", "run", "admit_app:app", "--engine", "inprocess", "--port", str(port),
         "--token", TOKEN, "--data-dir", str(tmp / "data"), "--partitions", "2"],
        env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(tmp / "run.log", "ab"),  # noqa: SIM115
        start_new_session=True,
    )


def _up(proc: subprocess.Popen[bytes], url: str, tmp: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, (tmp / "run.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _client() -> httpx.Client:
    return httpx.Client(limits=httpx.Limits(max_connections=8))


def _invoke(client: httpx.Client, url: str, i: int) -> httpx.Response:
    return client.post(f"{url}/invoke/lim/k{i % 2}/take?mode=async", json={"args": [1]}, timeout=30,
                      headers={**AUTH, "Idempotency-Key": f"r{i}"})


def _answer(client: httpx.Client, url: str, i: int) -> httpx.Response:
    deadline = time.monotonic() + 60
    while True:  # a request logged before the restart: pending (202) until its epoch runs
        r = client.get(f"{url}/requests/r{i}?wait=5", headers=AUTH, timeout=30)
        if r.status_code != 202 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_limits_hold_429_and_decisions_replay_exactly_across_a_sigkill(tmp_path: Path) -> None:
    (tmp_path / "admit_app.py").write_text(APP)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tmp_path, port)
    try:
        _up(proc, url, tmp_path)
        doc = httpx.get(url + "/admin/limits", headers=AUTH, timeout=30).json()
        assert doc["limits"]["lim/take"]["concurrency"] == 3 and doc["limits"]["lim/take"]["source"] == "code"
        bad = httpx.post(url + "/admin/limits", headers=AUTH,
                         json={"target": "lim/take", "limit": {"rate": -1}})
        assert bad.status_code == 422 and bad.json()["error"]["type"] == "BadArguments"
        with concurrent.futures.ThreadPoolExecutor(8) as pool, _client() as client:
            accepted = list(pool.map(lambda i: _invoke(client, url, i), range(160)))
        assert all(a.status_code == 202 for a in accepted), [a.text[:200] for a in accepted[:3]]
        waiting = httpx.get(url + "/admin/limits", headers=AUTH, timeout=30).json()
        assert waiting["held"] > 0, waiting  # requests wait for tokens: kill the node now
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc = _start(tmp_path, port)
        _up(proc, url, tmp_path)
        with concurrent.futures.ThreadPoolExecutor(8) as pool, _client() as client:
            answers = list(pool.map(lambda i: _answer(client, url, i), range(160)))
        limited = [a for a in answers if a.status_code == 429]
        odd = {(a.status_code, a.text[:150]) for a in answers if a.status_code not in (200, 429)}
        assert limited and not odd, odd
        assert all(a.json()["error"]["type"] == "RateLimited" and int(a.headers["Retry-After"]) >= 1
                   for a in limited)
        cli = [sys.executable, "-m", "charon.cli", "limits"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CHARON_URL": url, "CHARON_TOKEN": TOKEN}
        subprocess.run([*cli, "set", "lim/take", "--concurrency", "1", "--rate", "100"], env=env, check=True,
                       capture_output=True, timeout=60)
        shown = json.loads(subprocess.run([*cli, "show", "--json"], env=env, check=True, capture_output=True,
                                          timeout=60).stdout)
        assert shown["limits"]["lim/take"]["concurrency"] == 1 and shown["limits"]["lim/take"]["source"] == "admin"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    inp = InputLog(tmp_path / "data" / "input.sqlite", durable=False)
    out = OutputLog(tmp_path / "data" / "output.sqlite", durable=False)
    epochs, batch = [], []
    for _, data in inp.read_raw(0, inp.start_offsets()[0], inp.end_offsets()[0]):
        req = serde.decode_request(data)
        if req.operator == EPOCH_MARK:
            epochs.append((req.ts, batch))
            batch = []
        else:
            batch.append(req)
    sys.path.insert(0, str(tmp_path))
    from admit_app import app  # type: ignore[import-not-found]

    replay = InProcessRuntime(app, partitions=2)
    per_epoch: dict[tuple[int, str], int] = {}
    committed_at: dict[str, list[float]] = {"k0": [], "k1": []}
    replayed = 0
    for ts, reqs in epochs:
        res = replay.run_epoch(reqs, now=ts)
        for tid, rep in res.replies.items():
            if rep.request_id.startswith("__charon"):
                continue
            live = out.get(rep.request_id)
            assert live is not None
            assert (live.ok, live.error_type, live.epoch, live.tid) == (rep.ok, rep.error_type, rep.epoch, rep.tid)
            replayed += 1
            if rep.ok:
                key = res.requests[tid].key
                per_epoch[(res.epoch, key)] = per_epoch.get((res.epoch, key), 0) + 1
                committed_at[key].append(res.time)
    assert replayed == 160
    assert max(per_epoch.values()) <= 3  # never more than N of a key in an epoch
    for times in committed_at.values():  # never above burst + rate x elapsed
        assert times and len(times) <= 2 + 5.0 * (times[-1] - times[0]) + 1
