"""The watchdog's soundness (issue 31): a reply is final. The reproductions of ../shared/repros (r1, r2, r5, r6, r7,
r8) as regression tests over the real runtime and real processes; each failed at 383fc5d.

* a judged step fails with its verdict whatever it does next (catching the interrupt changes nothing), and a
  crash then a replay gives the same reply and state (r6);
* an interrupt never escapes the engine: not through formatting the user's exception (r1, r8), not over HTTP
  (the node keeps answering, /health stays truthful);
* an interrupt never lands in a library holding a lock (r7);
* a replay takes no new verdict: it exits for the supervisor instead (r2);
* the budget bounds a transaction's total, not only one step (r5).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import httpx
import pytest

from charon import InProcessRuntime, Request, serde
from charon.core.partition import Interrupt
from charon.server.serve import free_port

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))
from soundness_app import app, handler, log  # noqa: E402

DRIVER = SUPPORT / "soundness_driver.py"
TOKEN = "t0k"


def _req(rid: str, key: str, fn: str, *args: object) -> Request:
    return Request(rid, "acc", key, fn, serde.encode(list(args)))


def _phase(*args: str, timeout: float = 120) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=timeout,
                       env=env, check=False)
    docs = []
    for line in p.stdout.splitlines():
        try:
            docs.append(json.loads(line))
        except ValueError:
            pass
    return p.returncode, docs, p.stderr


# -- r1, r8: an interrupt never escapes the engine ---------------------------------------------------------------
async def test_r1_an_exception_with_a_slow_message_never_takes_the_engine_down() -> None:
    rt = InProcessRuntime(app, partitions=1, function_timeout=0.3, watchdog_interval=0.05, warmup_txns=0)
    async with rt:
        rep = await asyncio.wait_for(rt.submit("acc", "a", "slow_str_boom", []), 10)
        assert not rep.ok and rep.error_type == "InvocationTimeout", rep
        assert rt._task is not None and not rt._task.done()
        assert rt.health()["status"] == "ok"
        ok = await asyncio.wait_for(rt.submit("acc", "b", "inc", [1]), 10)
        assert ok.ok and serde.decode(ok.value) == 1


@pytest.mark.parametrize("seed", [7, 8])
def test_r8_work_about_the_budget_then_raise_never_escapes(seed: int) -> None:
    """The natural form of r1: a function that works about its budget and then raises (200 runs at 383fc5d: 2
    escaped). Each run's outcome is either its own ValueError or the verdict; no Interrupt leaves run_epoch."""
    rng = random.Random(seed)
    budget = 0.03
    rt = InProcessRuntime(app, partitions=1, function_timeout=budget, watchdog_interval=0.005, warmup_txns=0)
    rt.watchdog.start()
    seen: dict[str, int] = {}
    try:
        for i in range(150):
            spin = budget + rng.uniform(-0.005, 0.01)
            try:
                res = rt.run_epoch([_req(f"r{i}", "k", "work_then_raise", spin)])
            except Interrupt:  # pragma: no cover - the defect
                pytest.fail(f"an Interrupt escaped the engine at run {i} (seed {seed}: "
                            f"pytest tests/faults/test_watchdog_soundness.py -k 'r8 and {seed}')")
            r = next(iter(res.replies.values()))
            seen[r.error_type] = seen.get(r.error_type, 0) + 1
    finally:
        rt.watchdog.stop()
    assert set(seen) <= {"ValueError", "InvocationTimeout"}, seen
    assert seen.get("InvocationTimeout", 0) > 0 and seen.get("ValueError", 0) > 0, seen


# -- r7: never inside a library's lock ---------------------------------------------------------------------------
def _lock_free() -> bool:
    """Whether another thread can take the handler's lock now (a few tries: on a loaded machine a thread may
    wait long for its turn; a leaked lock stays held by the engine thread whatever the wait)."""
    got: list[bool] = []

    def probe() -> None:
        ok = handler.lock.acquire(timeout=2.0)  # type: ignore[union-attr]
        if ok:
            handler.lock.release()  # type: ignore[union-attr]
        got.append(ok)

    for _ in range(3):
        th = threading.Thread(target=probe)
        th.start()
        th.join()
        if got[-1]:
            return True
    return False


def _holder() -> str:
    """Who holds the handler's lock, and where that thread is (the failure's report)."""
    lock = repr(handler.lock)
    stacks = []
    for ident, frame in sys._current_frames().items():
        if f"owner={ident} " in lock:
            stacks.append("".join(traceback.format_stack(frame)))
    return f"{lock}; the owner's stack: {stacks or 'gone (the thread ended)'}"


def test_r7_an_interrupt_never_lands_in_a_library_holding_a_lock() -> None:
    """300 transactions logging in a loop through a handler with a lock, each stopped past a 0.02 s budget: the
    handler's lock is free after every epoch (at 383fc5d it leaked within 300)."""
    rt = InProcessRuntime(app, partitions=1, function_timeout=0.02, watchdog_interval=0.005, warmup_txns=0)
    rt.watchdog.start()
    outcomes: dict[str, int] = {}
    captured = log.handlers[:]  # pytest (9) attaches its capture handlers here too: they would hold every line
    log.handlers[:] = [handler]
    try:
        for b in range(12):
            res = rt.run_epoch([_req(f"r{b}-{i}", f"k{i}", "chatty", 10**9) for i in range(25)])
            for r in res.replies.values():
                outcomes[r.error_type] = outcomes.get(r.error_type, 0) + 1
            assert _lock_free(), f"the handler's lock leaked after epoch {b}: {_holder()}"
    finally:
        rt.watchdog.stop()
        log.handlers[:] = captured
    assert outcomes == {"InvocationTimeout": 300}, outcomes
    assert rt.watchdog.delivered >= 300 and rt.watchdog.deferred > 0, (rt.watchdog.delivered, rt.watchdog.deferred)


# -- r6: a caught interrupt changes nothing -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bare", "base", "finally"])
def test_r6_a_caught_interrupt_gives_the_reply_a_replay_gives(tmp_path: Path, kind: str) -> None:
    rc, docs, err = _phase("caught", str(tmp_path), kind)
    assert rc == 0 and docs, err
    live = docs[0]
    assert live["reply"]["error_type"] == "InvocationTimeout", live  # the verdict, whatever the function did
    assert live["state"] is None
    rc, docs, err = _phase("recover", str(tmp_path), "0.3")
    assert rc == 0 and docs, err
    after = docs[0]
    assert after["replies"]["req-1"] == live["reply"], (live, after)
    assert after["state"]["k"] is None
    assert after["dead_letters"] == [["req-1", "InvocationTimeout"]]


# -- r2: a replay takes no new verdict ------------------------------------------------------------------------------
def test_r2_a_replay_past_its_budget_exits_and_never_reverts_an_answered_transaction(tmp_path: Path) -> None:
    rc, docs, err = _phase("slow", str(tmp_path))
    assert rc == 0 and docs[0]["reply"]["ok"] and docs[0]["state"] == 42, (docs, err)
    live = docs[0]["reply"]
    # a restart with a lower budget (or a slower replay): the replayed step runs past it
    rc, docs, err = _phase("recover", str(tmp_path), "0.3", "0.3")
    assert rc == 75, (rc, docs, err)
    assert "FATAL: replaying epoch 0, acc.slow on key 'k'" in err and "no verdict can be taken" in err, err
    # the original settings: the transaction stands as it was answered
    rc, docs, err = _phase("recover", str(tmp_path), "10")
    assert rc == 0, err
    assert docs[0]["replies"]["req-1"] == live and docs[0]["state"]["k"] == 42
    assert docs[0]["dead_letters"] == []


# -- r5: the budget bounds the transaction ---------------------------------------------------------------------------
async def test_r5_a_transaction_of_many_short_steps_is_bounded_in_total() -> None:
    rt = InProcessRuntime(app, partitions=2, function_timeout=0.3, watchdog_interval=0.02, warmup_txns=0)
    async with rt:
        t0 = time.monotonic()
        hog = asyncio.ensure_future(rt.submit("acc", "h", "hog", [24, 0.25]))
        await asyncio.sleep(0.1)
        q = await asyncio.wait_for(rt.submit("acc", "q", "quick", []), 10)
        waited = time.monotonic() - t0
        rep = await asyncio.wait_for(hog, 10)
    assert q.ok
    assert not rep.ok and rep.error_type == "InvocationTimeout" and "total time budget" in rep.error_message, rep
    assert waited < 2.0, waited  # 6 s at 383fc5d: 24 steps of 0.25 s under a 0.3 s budget


# -- over real HTTP: the node keeps answering ------------------------------------------------------------------------
class _Server:
    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from charon.cli import main; main()", "run", "soundness_app:app", "--engine",
             "inprocess", "--port", str(self.port), "--token", TOKEN, "--data-dir", str(data_dir), "--no-fsync",
             *extra],
            cwd=SUPPORT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "COLUMNS": "300"})
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def test_r1_over_http_the_node_answers_after_a_slow_exception_message(tmp_path: Path) -> None:
    srv = _Server(tmp_path, "--function-timeout", "0.3")
    try:
        c = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=15)
        assert c.post("/invoke/acc/a/inc", json={"args": [1]}).status_code == 200
        r = c.post("/invoke/acc/b/slow_str_boom", json={"args": []})
        assert r.status_code == 409 and r.json()["error"]["type"] == "InvocationTimeout", r.text
        r = c.post("/invoke/acc/a/inc", json={"args": [1]})
        assert r.status_code == 200 and r.json()["value"] == 2, r.text  # 202 forever at 383fc5d
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        srv.close()


def test_logging_from_the_gateway_never_blocks_while_functions_are_interrupted(tmp_path: Path) -> None:
    """r7 over the real node: functions logging in a loop are stopped one after another while other requests
    keep being answered (a leaked logging lock would block the gateway's own logging)."""
    srv = _Server(tmp_path, "--function-timeout", "0.05")
    try:
        c = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=15)
        for i in range(20):
            r = c.post(f"/invoke/acc/c{i}/chatty", json={"args": [10**9]})
            assert r.status_code == 409 and r.json()["error"]["type"] == "InvocationTimeout", r.text
            assert c.post("/invoke/acc/a/inc", json={"args": [1]}).status_code == 200
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        srv.close()



