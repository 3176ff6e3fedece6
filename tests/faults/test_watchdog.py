"""Runaway and slow functions (issue 22): a function past its time budget is stopped, its transaction aborts with
InvocationTimeout, the decision is recorded and replay-exact, nothing else of the epoch changes, the engine never
hangs, and /health, /metrics and admin answer while a function spins or sleeps."""

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

from charon import InProcessRuntime, Request, serde
from charon.server.serve import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from hostile_app import app  # noqa: E402

TESTS = Path(__file__).resolve().parents[1] / "support"
TOKEN = "t0k"


def _req(rid: str, key: str, fn: str, *args: object) -> Request:
    return Request(rid, "acc", key, fn, serde.encode(list(args)))


async def test_a_spinning_function_aborts_with_invocation_timeout_and_others_commit() -> None:
    rt = InProcessRuntime(app, function_timeout=0.3, watchdog_interval=0.05)
    async with rt:
        await rt.submit("acc", "a", "deposit", [10])
        t0 = time.monotonic()
        spin = asyncio.ensure_future(rt.submit("acc", "k", "spin", [], request_id="spin-1"))
        others = [asyncio.ensure_future(rt.submit("acc", "a", "transfer", ["b", 1])) for _ in range(5)]
        rep = await asyncio.wait_for(spin, 10)
        assert time.monotonic() - t0 < 5
        assert not rep.ok and rep.error_type == "InvocationTimeout"
        assert "acc.spin on key 'k'" in rep.error_message
        assert [r.ok for r in await asyncio.gather(*others)] == [True] * 5
        assert rt.read_state("acc", "k") is None  # its write was never applied
        assert rt.read_state("acc", "a") == 5 and rt.read_state("acc", "b") == 5
        # never run again: a retry with its request id gets the recorded reply at once
        t1 = time.monotonic()
        again = await rt.submit("acc", "k", "spin", [], request_id="spin-1")
        assert again == rep and time.monotonic() - t1 < 0.2
        letters = rt.dead_letters()
        assert [(d["request_id"], d["function"], d["error_type"]) for d in letters] == [
            ("spin-1", "spin", "InvocationTimeout")]
        assert rt.health()["ok"] and rt.health()["timeouts"] == 1


async def test_a_callee_past_its_budget_aborts_the_whole_transaction() -> None:
    rt = InProcessRuntime(app, partitions=3, function_timeout=0.3, watchdog_interval=0.05)
    async with rt:
        rep = await asyncio.wait_for(rt.submit("acc", "x", "spin_callee", ["y"]), 10)
        assert not rep.ok and rep.error_type == "InvocationTimeout"
        assert "[raised by acc.spin on key 'y'" in rep.error_message
        assert rt.read_state("acc", "x") is None and rt.read_state("acc", "y") is None


async def test_a_function_catching_every_exception_is_still_stopped() -> None:
    """`except Exception` does not swallow the interrupt (a BaseException)."""
    from tests_support_swallow import swallow_app  # type: ignore[import-not-found]

    rt = InProcessRuntime(swallow_app, function_timeout=0.3, watchdog_interval=0.05)
    async with rt:
        rep = await asyncio.wait_for(rt.submit("s", "k", "swallow", []), 10)
        assert rep.error_type == "InvocationTimeout"


def _epoch(rt: InProcessRuntime, reqs: list[Request]) -> dict[str, tuple]:
    res = rt.run_epoch(reqs)
    return {r.request_id: (r.ok, r.value, r.error_type, r.position) for r in res.replies.values()}


@pytest.mark.parametrize("seed", range(3))
def test_the_rest_of_the_epoch_is_as_if_the_timed_out_transaction_had_raised(seed: int) -> None:
    """Same epoch twice: with a spinning transaction (stopped by the watchdog) and with one raising at once in its
    place. Every other reply (value, outcome, position) and the state are the same."""
    import random

    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(6)]
    base = [_req(f"d{i}", k, "deposit", 5) for i, k in enumerate(keys)]
    mix = [_req(f"t{i}", rng.choice(keys), "transfer", rng.choice(keys), rng.randint(1, 7)) for i in range(30)]
    where = rng.randrange(len(mix))
    outs = []
    for bad in ("spin", "boom"):
        rt = InProcessRuntime(app, partitions=3, function_timeout=0.2, watchdog_interval=0.02)
        rt.watchdog.start()
        try:
            _epoch(rt, base)
            reqs = [*mix[:where], _req("bad", "k0", bad), *mix[where:]]
            out = _epoch(rt, reqs)
            outs.append((out, rt.snapshot()))
        finally:
            rt.watchdog.stop()
    (spun, s1), (raised, s2) = outs
    assert spun.pop("bad")[2] == "InvocationTimeout" and raised.pop("bad")[2] == "RuntimeError"
    assert spun == raised
    assert s1 == s2


def _crash_after(data_dir: Path, script: str) -> str:
    """Run ``script`` in a child against a durable runtime in ``data_dir``; it exits without a checkpoint."""
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    p = subprocess.run([sys.executable, "-c", script, str(data_dir)], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


_LIVE = """
import asyncio, os, sys
from charon import InProcessRuntime
from hostile_app import app
async def main():
    rt = InProcessRuntime(app, partitions=3, data_dir=sys.argv[1], function_timeout=0.3, watchdog_interval=0.05,
                          checkpoint_s=3600, warmup_txns=0)
    async with rt:
        await rt.submit("acc", "a", "deposit", [10], request_id="d0")
        rt.gate.pause()  # one epoch: set_one (lower TID) then spin_if_set, and a dry-run spin, and transfers
        futs = [asyncio.ensure_future(rt.submit("acc", "z", "set_one", [], request_id="s1")),
                asyncio.ensure_future(rt.submit("acc", "z", "spin_if_set", [], request_id="s2")),
                asyncio.ensure_future(rt.submit("acc", "q", "spin", [], request_id="s3"))]
        futs += [asyncio.ensure_future(rt.submit("acc", "a", "transfer", ["b", 1], request_id=f"t{i}"))
                 for i in range(4)]
        await asyncio.sleep(0.05)
        rt.gate.resume()
        reps = await asyncio.wait_for(asyncio.gather(*futs), 30)
        for r in reps:
            print(r.request_id, r.ok, r.error_type or "-", r.position, r.epoch, bytes(r.value).hex() or "-")
        sys.stdout.flush()
        os._exit(0)  # no checkpoint: the restart replays the epoch from the input log
asyncio.run(main())
"""


def test_a_timeout_decision_is_replayed_exactly_after_a_crash(tmp_path: Path) -> None:
    """A dry-run timeout (spin) and a fallback-only timeout (spin_if_set sees set_one's write only when rerun):
    recovery replays the epoch from the log with the recorded verdicts, never running either again (a replay
    that ran them would hang or answer differently), and every reply is the same."""
    live = {}
    for line in _crash_after(tmp_path, _LIVE).splitlines():
        rid, ok, et, pos, ep, val = line.split()
        live[rid] = (ok == "True", et, int(pos), int(ep), val)
    assert live["s3"][1] == "InvocationTimeout" and live["s2"][1] == "InvocationTimeout"
    assert live["s1"][0] and all(live[f"t{i}"][0] for i in range(4))
    t0 = time.monotonic()
    rt = InProcessRuntime(app, partitions=3, data_dir=str(tmp_path), function_timeout=60, warmup_txns=0)
    try:
        assert time.monotonic() - t0 < 10 and rt.replayed_epochs >= 1
        for rid, (ok, et, pos, ep, val) in live.items():
            r = rt.get_reply(rid)
            assert r is not None and (r.ok, r.error_type or "-", r.position, r.epoch, bytes(r.value).hex() or "-") == (
                ok, et, pos, ep, val), rid
        assert {d["request_id"]: d["fallback"] for d in rt.dead_letters()} == {"s2": True, "s3": False}
        assert rt.read_state("acc", "z") == 1 and rt.read_state("acc", "q") is None
        assert rt.read_state("acc", "a") == 6 and rt.read_state("acc", "b") == 4
    finally:
        rt.close()


# -- over real HTTP ----------------------------------------------------------------------------------------------
class _Server:
    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from charon.cli import main; main()", "run", "hostile_app:app", "--engine",
             "inprocess", "--port", str(self.port), "--token", TOKEN, "--data-dir", str(data_dir), "--no-fsync",
             *extra],
            cwd=TESTS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
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


H = {"Authorization": f"Bearer {TOKEN}"}


def _timed_get(client: httpx.Client, path: str) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = client.get(path, timeout=5)
    return time.perf_counter() - t0, r


def test_http_spin_and_c_level_sleep_never_take_the_node_down(tmp_path: Path) -> None:
    """charon run (durable): a spinning function is stopped at its budget while /health, /metrics and
    /admin/status answer within 100 ms and /health names the stuck function; unrelated transfers commit. A
    function blocked in C (time.sleep) past its budget and --exit-when-stuck is quarantined and the node exits
    (75) with one line; restarted, it is healthy at once and never runs it again; nothing acknowledged is lost."""
    srv = _Server(tmp_path, "--function-timeout", "1.0", "--exit-when-stuck", "1.5")
    try:
        c = httpx.Client(base_url=srv.url, headers=H, timeout=30)
        assert c.post("/invoke/acc/a/deposit", json={"args": [100]}).status_code == 200
        import threading

        out: dict[str, httpx.Response] = {}
        th = threading.Thread(target=lambda: out.setdefault(
            "spin", c.post("/invoke/acc/k/spin", json={"args": []}, headers={"Idempotency-Key": "spin-1"})))
        th.start()
        time.sleep(0.2)
        times: list[float] = []
        saw_stuck = None
        probe = httpx.Client(base_url=srv.url, headers=H)  # keep-alive: the server's time, not connection setup
        while th.is_alive():
            for path in ("/health", "/metrics", "/admin/status"):
                dt, r = _timed_get(probe, path)
                times.append(dt)
                if path == "/health" and r.status_code == 503:
                    saw_stuck = r.json()
            time.sleep(0.05)
        th.join()
        times.sort()
        # A blocked event loop would answer only after the function stopped (> 1 s). The margin of the maximum is
        # for a loaded CI machine; quiet figures are in the closing note of issue 22.
        assert len(times) >= 9 and times[len(times) // 2] < 0.1 and times[-1] < 0.5, times
        r = out["spin"]
        assert r.status_code == 409 and r.json()["error"]["type"] == "InvocationTimeout", r.text
        assert httpx.get(srv.url + "/health").status_code == 200
        acked = [c.post("/invoke/acc/a/transfer", json={"args": ["b", 1]}).status_code for _ in range(5)]
        assert acked == [200] * 5
        letters = c.get("/admin/dead-letters").json()["dead_letters"]
        assert [d["request_id"] for d in letters] == ["spin-1"]
        assert 'charon_dead_letters{type="InvocationTimeout"} 1.0' in c.get("/metrics").text

        # Blocked in C: reported within an interval of its budget (0.5 s), then quarantined, then the process exits
        # for its supervisor.
        def sleepy() -> None:
            try:
                c.post("/invoke/acc/s/sleepy", json={"args": [60]}, headers={"Idempotency-Key": "sleep-1"},
                       timeout=20)
            except httpx.HTTPError:
                pass  # the node exited under it

        t0 = time.monotonic()
        th = threading.Thread(target=sleepy)
        th.start()
        saw_stuck = None  # the spin may have been seen stuck for a moment (between its verdict and the interrupt)
        while saw_stuck is None and time.monotonic() - t0 < 5:
            dt, r = _timed_get(probe, "/health")
            assert dt < 0.5
            if r.status_code == 503:
                saw_stuck = (time.monotonic() - t0, r.json())
            time.sleep(0.02)
        assert saw_stuck is not None and saw_stuck[0] < 1.5, saw_stuck
        assert saw_stuck[1]["status"] == "stuck" and saw_stuck[1]["stuck"]["function"] == "sleepy", saw_stuck
        assert saw_stuck[1]["stuck"]["key"] == "s"
        srv.proc.wait(30)
        th.join()
        took = time.monotonic() - t0
        err = srv.proc.stderr.read()  # type: ignore[union-attr]
        assert srv.proc.returncode == 75, err
        assert "acc.sleepy on key 's'" in err and "quarantined" in err and "Traceback" not in err, err
        assert took < 10, took
    finally:
        srv.close()
    srv = _Server(tmp_path, "--function-timeout", "1.0")  # healthy at once: the replay never runs sleepy
    try:
        c = httpx.Client(base_url=srv.url, headers=H, timeout=30)
        r = c.post("/invoke/acc/s/sleepy", json={"args": [60]}, headers={"Idempotency-Key": "sleep-1"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "Quarantined", r.text
        assert c.get("/state/acc/a").json()["value"] == 95 and c.get("/state/acc/b").json()["value"] == 5
        assert {d["request_id"]: d["error_type"] for d in c.get("/admin/dead-letters").json()["dead_letters"]} == {
            "spin-1": "InvocationTimeout", "sleep-1": "Quarantined"}
        assert c.post("/invoke/acc/a/transfer", json={"args": ["b", 1]}).status_code == 200
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.close()


def test_a_transaction_that_kills_the_process_is_quarantined_not_a_crash_loop(tmp_path: Path) -> None:
    """`die` kills the node in its epoch, and again when the restart replays that epoch; the next restart probes
    the epoch in a forked child, quarantines `die` (recorded) and replays without it: healthy, the transfers
    acknowledged before are kept, `die`'s client gets the typed Quarantined reply."""
    srv = _Server(tmp_path)
    c = httpx.Client(base_url=srv.url, headers=H, timeout=30)
    assert c.post("/invoke/acc/a/deposit", json={"args": [50]}).status_code == 200
    with pytest.raises(httpx.HTTPError):
        c.post("/invoke/acc/x/die", json={"args": []}, headers={"Idempotency-Key": "die-1"})
    assert srv.proc.wait(30) == 3
    # the first restart replays the logged epoch and dies again
    port = free_port()
    p = subprocess.run([sys.executable, "-c", "from charon.cli import main; main()", "run", "hostile_app:app",
                        "--port", str(port), "--token", TOKEN, "--data-dir", str(tmp_path), "--no-fsync"],
                       cwd=TESTS, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 3, p.stderr
    srv = _Server(tmp_path)
    try:
        c = httpx.Client(base_url=srv.url, headers=H, timeout=30)
        r = c.post("/invoke/acc/x/die", json={"args": []}, headers={"Idempotency-Key": "die-1"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "Quarantined", r.text
        assert "acc.die on key 'x'" in r.json()["error"]["message"]
        assert c.get("/state/acc/a").json()["value"] == 50
        assert c.get("/state/acc/x").json().get("value") is None
        assert [d["request_id"] for d in c.get("/admin/dead-letters").json()["dead_letters"]] == ["die-1"]
        assert c.post("/invoke/acc/a/transfer", json={"args": ["b", 5]}).status_code == 200
    finally:
        srv.close()
