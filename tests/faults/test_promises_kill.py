"""Durable promises and schedules across SIGKILLs (issue 34 "must show"), over real processes: ``charon run`` on
the durable node is SIGKILLed while clients resolve promises, and around schedule firings; every promise's
continuation runs exactly once, each resolve retried under its request id gets one answer, a second resolve is a
typed 409; every schedule slot fires at most once, and each slot is either fired or counted as skipped."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from nodeproc import kill, start_charon, support_env

from charon import PromiseConflict
from charon.client import Client, GatewayError
from charon.server.serve import free_port

N = 30
TOKEN = "promise-kill-test-token"


def _env() -> dict[str, str]:
    return support_env(CHARON_TOKEN=TOKEN)


def _start(target: str, data: Path, port: int, partitions: int = 2) -> subprocess.Popen[bytes]:
    return start_charon(["run", target, "--data-dir", str(data), "--partitions", str(partitions)], port=port,
                        env=_env(), log=data.parent / f"node-{time.time():.3f}.log")


def _resolve_all(url: str, pids: list[str], answers: dict[int, dict]) -> None:
    """Resolve each promise under a request id of its own, retrying through kills until each has an answer."""
    with Client(url, token=TOKEN, timeout=10, retries=1) as c:
        for i, pid in enumerate(pids):
            while i not in answers:
                try:
                    answers[i] = c.resolve(pid, {"n": i}, request_id=f"resolve-{i}")
                except (GatewayError, httpx.HTTPError, OSError):
                    time.sleep(0.2)


def test_a_promise_is_resolved_exactly_once_while_the_engine_is_killed_around_the_resolves(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    node = _start("promises_app:app", data, port)
    try:
        with Client(url, token=TOKEN, timeout=30, retries=5) as c:
            pids = [c.invoke("orders", f"o{i}", "place", 3600.0, request_id=f"place-{i}") for i in range(N)]
        answers: dict[int, dict] = {}
        resolver = threading.Thread(target=_resolve_all, args=(url, pids, answers), daemon=True)
        resolver.start()
        for _ in range(3):  # kill the engine while the resolves are under way, then restart it
            while len(answers) < 3 + len(answers) // 2 and resolver.is_alive():
                time.sleep(0.01)
            time.sleep(0.05)
            kill(node)
            time.sleep(0.3)
            node = _start("promises_app:app", data, port)
        resolver.join(timeout=120)
        assert len(answers) == N, "every resolve answered (retried through the kills)"
        assert all(a["status"] == "resolved" for a in answers.values())
        with Client(url, token=TOKEN, timeout=30, retries=5) as c:
            deadline = time.monotonic() + 60
            while True:
                states = [c.state("orders", f"o{i}") for i in range(N)]
                if all(s["runs"] >= 1 for s in states) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert [s["runs"] for s in states] == [1] * N, "each continuation ran exactly once"
            assert [s["outcome"]["value"]["n"] for s in states] == list(range(N))
            again = c.resolve(pids[0], {"n": 0}, request_id="resolve-0")  # a retry: the same answer
            assert again == answers[0]
            with pytest.raises(PromiseConflict):  # a second resolve: a typed 409, no second continuation
                c.resolve(pids[0], "other")
            r = httpx.post(f"{url}/promises/{pids[1]}/resolve", json={"value": 1},
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            assert r.status_code == 409 and r.json()["error"]["type"] == "PromiseConflict"
            assert c.state("orders", "o0")["runs"] == 1
            listed = c.promises("resolved", limit=1000)["promises"]
            assert sorted(p["id"] for p in listed) == sorted(pids)
        cli = subprocess.run([sys.executable, "-m", "charon.cli", "promises", "show", pids[2], "--url", url],
                             env=_env(), capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and json.loads(cli.stdout)["status"] == "resolved", cli.stderr
        cli = subprocess.run([sys.executable, "-m", "charon.cli", "promises", "resolve", pids[2], "7", "--url", url],
                             env=_env(), capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1 and "PromiseConflict" in cli.stderr, (cli.returncode, cli.stderr)
    finally:
        kill(node)


def _record(url: str) -> dict:
    with Client(url, token=TOKEN, timeout=10, retries=5) as c:
        return c.schedule("heartbeat")


def _slots(url: str) -> list[float]:
    with Client(url, token=TOKEN, timeout=10, retries=5) as c:
        return (c.state("ticks", "every-second") or {"slots": []})["slots"]


def test_a_schedule_fires_each_slot_at_most_once_across_kills(tmp_path: Path) -> None:
    """Each restart also rescales the node (2 -> 3 -> 4 -> 2 partitions): the schedule's entity moves between
    partitions, and its slots still fire at most once, each fired or counted as skipped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    node = _start("schedules_app:app", data, port)
    try:
        # killed right after a firing, then down past catch_up, then briefly; restarted on another partition count
        for down, parts in ((0.0, 3), (4.2, 4), (0.5, 2)):
            seen = len(_slots(url))
            deadline = time.monotonic() + 30
            while len(_slots(url)) < seen + 2:  # wait for two more firings
                assert time.monotonic() < deadline, "the schedule does not fire"
                time.sleep(0.05)
            kill(node)  # just after a firing committed
            time.sleep(down)
            node = _start("schedules_app:app", data, port, partitions=parts)
            with Client(url, token=TOKEN, timeout=10, retries=5) as c:
                assert c.status()["partitions"] == parts, c.status()
        deadline = time.monotonic() + 30
        while len(_slots(url)) < seen + 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with Client(url, token=TOKEN, timeout=10, retries=5) as c:  # a schedule created at run time, paused
            c.create_schedule("other", "* * * * * *", "ticks", "other", "count", ["x"])
            c.pause_schedule("heartbeat")
        time.sleep(0.5)  # a firing registered by the last tick runs in the next epoch
        rec = _record(url)
        slots = _slots(url)
        assert slots == sorted(slots) and len(set(slots)) == len(slots), "no slot fired twice"
        assert all(s == int(s) for s in slots), "whole-second slots"
        span = int(slots[-1] - slots[0]) + 1
        assert rec["fired"] == len(slots), rec
        # every slot from the first to the last was fired or counted as skipped; at most catch_up=2 missed slots
        # before each tick's current one fired, so the 4.2 s downtime skipped some
        assert rec["fired"] + rec["skipped"] == span and rec["skipped"] >= 1, (rec, span)
        assert rec["paused"] and rec["next_slot"] is None
        time.sleep(2.5)
        assert _slots(url) == slots, "paused: nothing fires"
        with Client(url, token=TOKEN, timeout=10, retries=5) as c:
            assert c.state("ticks", "other")["label"] == "x"
            names = [s["name"] for s in c.schedules()["schedules"]]
            assert names == ["heartbeat", "other"]
            c.delete_schedule("other")
            assert [s["name"] for s in c.schedules()["schedules"]] == ["heartbeat"]
    finally:
        kill(node)
