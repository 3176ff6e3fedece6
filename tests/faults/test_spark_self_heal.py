"""Self-healing Spark runtime (issue 22, item 4; the repro jvm_kill.py), over real HTTP on
``charon run --engine spark``: SIGKILL the JVM. /health is never 500, reports non-ok within seconds, then ok
again once the supervisor started a new Spark session and resumed the query from its checkpoint; invokes
commit again, nothing acknowledged is lost (money conserved, exactly-once counter). Where a new session cannot
be started (fault injected), the process exits non-zero with one line instead of staying alive-but-failed."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from deployproc import Deployment, Trickle

pytestmark = pytest.mark.spark


def _health(d: Deployment) -> tuple[int, dict]:
    try:
        r = httpx.get(d.url + "/health", timeout=5)
        try:
            return r.status_code, r.json()
        except ValueError:  # the old code's plain 500 page
            return r.status_code, {"text": r.text[:200]}
    except httpx.HTTPError as e:
        return 0, {"error": repr(e)}


def test_jvm_killed_heals_and_loses_nothing(tmp_path: Path) -> None:
    d = Deployment("spark", tmp_path / "data")
    stop = threading.Event()
    try:
        d.wait_ok()
        d.seed(["a", "b"], 100)
        acked: list[int] = []

        def transfers() -> None:  # money moves between a and b the whole time
            c = httpx.Client(base_url=d.url, headers={"Authorization": "Bearer s3cret"}, timeout=60)
            i = 0
            while not stop.is_set():
                src, dst = ("a", "b") if i % 2 else ("b", "a")
                try:
                    r = c.post(f"/invoke/account/{src}/transfer", json={"args": [dst, 1]},
                               headers={"Idempotency-Key": f"t{i}"})
                    if r.status_code == 200:
                        acked.append(i)
                except httpx.HTTPError:
                    pass
                i += 1
                time.sleep(0.05)
            c.close()

        mover = threading.Thread(target=transfers, daemon=True)
        mover.start()
        with Trickle(d.url, every=0.2) as trickle:
            time.sleep(3)
            java = d.java()
            assert len(java) == 1
            before = trickle.committed()
            java[0].send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            seen: list[tuple[float, int, str]] = []
            not_ok_at = ok_again_at = None
            while time.monotonic() - t_kill < 300:
                st, doc = _health(d)
                seen.append((round(time.monotonic() - t_kill, 1), st, str(doc.get("status"))))
                assert st != 500, seen[-5:]
                assert d.proc.poll() is None, f"exited {d.proc.returncode}: {d.stderr()[-2000:]}"
                if st != 200 and not_ok_at is None:
                    not_ok_at = time.monotonic() - t_kill
                    assert st == 503 and doc["status"] in ("recovering", "starting"), doc
                if st == 200 and not_ok_at is not None:
                    ok_again_at = time.monotonic() - t_kill
                    break
                time.sleep(0.2)
            assert not_ok_at is not None and not_ok_at < 5.0, seen[:20]
            assert ok_again_at is not None, seen[-10:]
            first = [t for t, _, st in trickle.samples if t > t_kill and st == 200]
            deadline = time.monotonic() + 120
            while not first and time.monotonic() < deadline:
                time.sleep(0.2)
                first = [t for t, lat, st in trickle.samples if t > t_kill and st == 200]
            assert first, "new invokes commit after the JVM was replaced"
            # kill -> the first commit of an invoke sent after the kill (its start + its latency)
            commit_s = min(t + lat for t, lat, st in trickle.samples if t > t_kill and st == 200) - t_kill
            print(f"\nJVM SIGKILL -> /health non-ok {not_ok_at:.1f} s, ok again {ok_again_at:.1f} s, "
                  f"first new commit {commit_s:.1f} s")
            time.sleep(3)
        stop.set()
        mover.join(timeout=90)
        assert trickle.committed() > before and acked
        new_java = d.java()
        assert len(new_java) == 1 and new_java[0].pid != java[0].pid
        h = httpx.get(d.url + "/health", timeout=5).json()
        assert h["status"] == "ok" and h["jvm_restarts"] == 1, h
        # nothing acknowledged lost: a consistent cut conserves the money; w counts every incr exactly once
        r = d.http.post("/admin/sql", json={"sql": "SELECT sum(value), count(*) FROM account WHERE key <> 'w'"})
        assert r.status_code == 200 and r.json()["rows"] == [[200, 2]], r.text
        w = d.http.get("/state/account/w").json()["value"]
        sent = len(trickle.samples)
        assert trickle.committed() <= w <= sent, (trickle.committed(), w, sent)
    finally:
        stop.set()
        d.stop()


def test_jvm_that_cannot_be_replaced_exits_non_zero_in_one_line(tmp_path: Path) -> None:
    d = Deployment("spark", tmp_path / "data", env={"CHARON_FAULT_AT": "session_restart"})
    try:
        d.wait_ok()
        assert d.http.post("/invoke/account/a/deposit", json={"args": [5]}).status_code == 200
        d.java()[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        statuses = set()
        while d.proc.poll() is None and time.monotonic() - t0 < 180:
            st, _ = _health(d)
            statuses.add(st)
            time.sleep(0.3)
        assert d.proc.poll() is not None, "the process must exit, not stay alive-but-failed"
        assert d.proc.returncode != 0
        assert 500 not in statuses, statuses
        err = d.stderr()
        lines = [ln for ln in err.splitlines() if "cannot recover" in ln]
        assert len(lines) == 1 and "injected fault at session_restart" in lines[0], err[-3000:]
        assert err.rstrip().splitlines()[-1] == lines[0], err[-3000:]  # the last word, one line
    finally:
        d.stop()
