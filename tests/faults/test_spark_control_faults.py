"""Control operations on real PySpark when they cannot complete: a combined rescale whose engine part times out
changes nothing (not even the log), a code update on a paused runtime answers at once (409 ``Paused`` or applied
at the boundary), and a log-only rescale prints only the log's resize. Then the requests held meanwhile all run,
once, and money is conserved."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from natsfix import NatsServer
from typer.testing import CliRunner

from charon.cli import app as cli_app
from charon.client import Client, Paused
from charon.config import GatewayConfig, SparkConfig
from charon.errors import EngineUnavailable
from charon.runtime.spark.layout import read_layout
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "t0k"
N = 8


def test_paused_and_timed_out_control_operations(tmp_path: Path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "d"), partitions=2, log_partitions=2,
                      max_batch=200, idle_wait_ms=100)
    rt = SparkRuntime("code_versions:c1", cfg)
    gcfg = GatewayConfig(max_partitions=8, code_refs="code_versions:c1,code_versions:c2")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with BackgroundServer(rt, token=TOKEN, config=gcfg) as srv, Client(srv.url, token=TOKEN, timeout=120) as c:
        for i in range(N):
            c.invoke("acct", f"a{i}", "deposit", 100)

        # 4. a combined rescale whose engine part finds no boundary in time: nothing moves, the log neither.
        # An epoch held at the gate (entered, not left) stands for an epoch that runs longer than the timeout.
        rt.wait_idle(60)
        held = rt.last_recorded_epoch() + 1
        rt.gate.enter(held)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                rt.rescale(3, timeout=1.0, log_partitions=3)
            assert time.monotonic() - t0 < 10
        finally:
            rt.gate.leave()
        layout = read_layout(rt.ckpt)
        assert layout is not None and (layout.partitions, layout.log_partitions) == (2, 2), layout
        assert rt.input_log.counts()[1] == 2 and rt.config.partitions == 2 and rt.config.log_partitions == 2
        assert rt.log_rescales == [] and rt.rescale_pauses == []

        # 5. paused: requests wait in the log; a strict update (it must drain them) is refused at once, typed;
        # a compatible one applies at the boundary at once
        c.pause()
        rids = [c.submit("acct", f"a{i % N}", "transfer", f"a{(i * 3 + 1) % N}", 1 + i % 4) for i in range(20)]
        deadline = time.monotonic() + 30
        while c.status()["backlog"] == 0:  # the submissions reached the log
            assert time.monotonic() < deadline, c.status()
            time.sleep(0.05)
        with httpx.Client(base_url=srv.url, headers=auth, timeout=30) as h:
            t0 = time.monotonic()
            r = h.post("/admin/code", json={"ref": "code_versions:c2", "version": "c2s"})
            took = time.monotonic() - t0
            assert r.status_code == 409 and r.json()["error"]["type"] == "Paused", r.text
            assert took < 5, f"a strict update on a paused runtime took {took:.1f} s to answer"
            t0 = time.monotonic()
            r = h.post("/admin/update", json={"id": "u1", "operator": "acct", "function": "deposit", "args": [0]})
            assert r.status_code == 409 and r.json()["error"]["type"] == "Paused", r.text
            assert time.monotonic() - t0 < 5
        with pytest.raises(Paused):
            c.update_code("code_versions:c2", "c2s")
        assert rt.app_ref == "code_versions:c1"  # nothing changed
        t0 = time.monotonic()
        out = c.update_code("code_versions:c2", "c2", mode="compatible")
        assert time.monotonic() - t0 < 10 and out["mode"] == "compatible" and rt.app_ref == "code_versions:c2"
        assert c.status()["state"] == "paused"  # still paused: the update did not resume it
        c.resume()
        c.pause(after_epoch=10**9)  # a pause-after set by the user stays through a code switch's boundary
        c.update_code("code_versions:c1", "c1b", mode="compatible")
        assert c.status()["pause_after"] == 10**9, c.status()
        c.resume()

        # 6. a log-only rescale prints the log's resize only; then a combined one under load
        res = CliRunner().invoke(cli_app, ["rescale", "--url", srv.url, "--token", TOKEN, "--log-partitions", "3"])
        assert res.exit_code == 0, res.output
        printed = json.loads(res.output)
        assert set(printed) == {"log"} and printed["log"]["to"] == 3, printed
        _rescale_under_load_then_check(rt, c, srv.url, "acct", rids, log_partitions=4)


def _rescale_under_load_then_check(rt: SparkRuntime, c: Client, url: str, op: str, rids: list[str], *,
                                   log_partitions: int) -> None:
    """Rescale the engine to 3 partitions and the log to ``log_partitions`` in one call while a client submits
    transfers; then every request (``rids`` and those) is answered once and money is conserved."""
    more: list[str] = []
    stop = threading.Event()

    def drive() -> None:
        i = 0
        while not stop.is_set():
            more.append(c.submit(op, f"a{i % N}", "transfer", f"a{(i * 5 + 2) % N}", 1))
            i += 1
            time.sleep(0.02)

    t = threading.Thread(target=drive)
    t.start()
    try:
        time.sleep(0.5)
        both = c.rescale(3, log_partitions=log_partitions)
    finally:
        stop.set()
        t.join()
    assert both["to"] == 3 and both["log"]["to"] == log_partitions, both
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for rid in rids + more:
        r = httpx.get(f"{url}/requests/{rid}", params={"wait": 60}, headers=auth, timeout=90)
        assert r.status_code in (200, 409) and r.json()["status"] in ("committed", "aborted"), r.text
    rt.wait_idle(60)
    balances = [rt.read_state(op, f"a{i}", 0) for i in range(N)]
    assert sum(balances) == N * 100, balances
    counts: dict[str, int] = {}
    for _, rep in rt.output_log.read_since(0, limit=10**6):
        counts[rep.request_id] = counts.get(rep.request_id, 0) + 1
    assert all(counts.get(rid) == 1 for rid in rids + more), "each request answered exactly once"


def _timed(fn: object, *args: object, **kw: object) -> tuple[float, object]:
    t0 = time.monotonic()
    try:
        out = fn(*args, **kw)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        out = exc
    return time.monotonic() - t0, out


def test_health_and_rescale_while_the_nats_log_hangs(tmp_path: Path) -> None:
    """nats-server stopped (SIGSTOP: connections stay open, nothing answers) under a running Spark driver:
    health() and the gateway's /health answer within about ``health_timeout_s`` and say the log is down (not
    ok), also once the query failed and the supervisor waits for the log; a rescale (engine or log) is refused at
    once with a typed 503 and changes nothing. After SIGCONT the runtime recovers, a combined rescale under load
    works, money is conserved and every request is answered once."""
    nats = NatsServer(tmp_path / "nats").start()
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "d"), partitions=2, log_partitions=2,
                      log_url=f"{nats.url}/av{uuid.uuid4().hex[:6]}", max_batch=200, idle_wait_ms=100,
                      epoch_max_failures=2, restart_backoff_s=0.2, health_timeout_s=1.0)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert nats.proc is not None
    stopped = False
    try:
        with BackgroundServer(rt, token=TOKEN, config=GatewayConfig(max_partitions=8)) as srv, \
                Client(srv.url, token=TOKEN, timeout=120) as c:
            for i in range(N):
                c.invoke("account", f"a{i}", "deposit", 100)
            rids = [c.submit("account", f"a{i % N}", "transfer", f"a{(i * 3 + 1) % N}", 1 + i % 4) for i in range(20)]
            rt.wait_idle(60)
            os.kill(nats.proc.pid, signal.SIGSTOP)
            stopped = True
            # a log state probed just before the stop is reused for max_age_s (the dashboard's sampler probes
            # every second): from then on every answer must say the log is down
            time.sleep(rt.log_probe.max_age_s)
            seen: set[str] = set()
            deadline = time.monotonic() + 120
            while "recovering" not in seen:  # until the query failed on the log and the supervisor waits
                assert time.monotonic() < deadline, f"the query never failed during the outage: {rt.health()}"
                took, h = _timed(rt.health)
                assert isinstance(h, dict) and took < 2.5, (took, h)
                assert h["ok"] is False and h["log_error"], h
                seen.add(h["status"])
                with httpx.Client(base_url=srv.url, headers=auth, timeout=30) as hc:
                    took, r = _timed(hc.get, "/health")
                    assert isinstance(r, httpx.Response) and r.status_code == 503 and took < 3, (took, r)
                    took, r = _timed(hc.get, "/admin/status")  # and the dashboard's status, bounded too
                    assert isinstance(r, httpx.Response) and r.status_code == 200 and took < 3, (took, r)
                    assert r.json()["backlog"] is None and r.json()["log_error"], r.json()
                    took, r = _timed(hc.get, "/metrics")
                    assert isinstance(r, httpx.Response) and r.status_code == 200 and took < 3, (took, r)
                    for body in ({"partitions": 3}, {"log_partitions": 3}, {"partitions": 3, "log_partitions": 3}):
                        took, r = _timed(hc.post, "/admin/rescale", json=body)
                        assert isinstance(r, httpx.Response) and r.status_code == 503, (body, r)
                        assert r.json()["error"]["type"] == "Unavailable" and took < 4, (body, took, r.text)
                took, exc = _timed(rt.rescale, 3, log_partitions=3)
                assert isinstance(exc, EngineUnavailable) and took < 4, (took, exc)
                layout = read_layout(rt.ckpt)
                assert layout is not None and (layout.partitions, layout.log_partitions) == (2, 2), layout
                assert rt.config.partitions == 2 and rt.rescale_pauses == [] and rt.log_rescales == []
                time.sleep(1)
            os.kill(nats.proc.pid, signal.SIGCONT)
            stopped = False
            deadline = time.monotonic() + 120
            while not rt.health()["ok"]:
                assert time.monotonic() < deadline, rt.health()
                time.sleep(0.2)
            assert rt.health()["fatal"] is None
            _rescale_under_load_then_check(rt, c, srv.url, "account", rids, log_partitions=3)
    finally:
        if stopped:
            os.kill(nats.proc.pid, signal.SIGCONT)
        rt.close()
        nats.kill()


def test_a_checkpoint_outage_is_not_a_deterministic_failure(tmp_path: Path) -> None:
    """The checkpoint's epoch-record directory unusable for several seconds (replaced by a file: as a lost
    mount, every record write fails) while requests arrive: each epoch fails, but the supervisor counts none
    towards ``epoch_max_failures`` (it would have given up after 2), reports why, and resumes once the directory
    is back; every request is answered once and money is conserved."""
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "d"), partitions=2, max_batch=200,
                      idle_wait_ms=100, epoch_max_failures=2, restart_backoff_s=0.2)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    epochs = os.path.join(rt.ckpt, "epochs")
    away = epochs + ".away"
    with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN, timeout=120) as c:
        for i in range(N):
            c.invoke("account", f"a{i}", "deposit", 100)
        rt.wait_idle(60)
        os.rename(epochs, away)
        open(epochs, "wb").close()
        try:
            rids = [c.submit("account", f"a{i % N}", "transfer", f"a{(i * 3 + 1) % N}", 1 + i % 4)
                    for i in range(20)]
            seen: list[dict] = []
            t_end = time.monotonic() + 8
            while time.monotonic() < t_end:
                seen.append(rt.health())
                assert seen[-1]["fatal"] is None, seen[-1]
                time.sleep(0.2)
            assert any(s["status"] == "recovering" and "checkpoint directory is not writable" in (s["last_error"] or "")
                       for s in seen), seen[-3:]
        finally:
            os.remove(epochs)
            os.rename(away, epochs)
        deadline = time.monotonic() + 90
        while not rt.health()["ok"]:
            assert time.monotonic() < deadline and rt.health()["fatal"] is None, rt.health()
            time.sleep(0.2)
        for rid in rids:
            r = httpx.get(f"{srv.url}/requests/{rid}", params={"wait": 60}, headers=auth, timeout=90)
            assert r.status_code in (200, 409) and r.json()["status"] in ("committed", "aborted"), r.text
        rt.wait_idle(60)
        assert sum(rt.read_state("account", f"a{i}", 0) for i in range(N)) == N * 100
        counts: dict[str, int] = {}
        for _, rep in rt.output_log.read_since(0, limit=10**6):
            counts[rep.request_id] = counts.get(rep.request_id, 0) + 1
        assert all(counts.get(rid) == 1 for rid in rids), "each request answered exactly once"


def test_python_workers_killed_around_a_rescales_move(tmp_path: Path) -> None:
    """Task workers SIGKILLed while rescales 2 -> 4 -> 3 run under load: while the gate is held for the move,
    and again as the first epochs after it restore the new layout's stores from its bases. Spark retries the
    tasks (or the supervisor restarts the query; on the resident exchange, on a new gang); nothing is lost or run
    twice and money is conserved."""
    from test_spark_availability import _task_workers_of_this_process

    from charon import serde
    from charon.messages import Request

    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "d"), partitions=2, max_batch=200,
                      idle_wait_ms=100, restart_backoff_s=0.2)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    rt.start()
    killed: list[str] = []

    def kill_workers(why: str) -> None:
        for pid in _task_workers_of_this_process():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(why)
            except ProcessLookupError:
                pass

    try:
        for i in range(N):
            rt.input_log.append(Request(f"seed{i}", "account", f"a{i}", "deposit", serde.encode([100])))
        rt.wait_idle(120)
        stop = threading.Event()
        rids: list[str] = []

        def load() -> None:
            i = 0
            while not stop.is_set():
                rid = f"t{i}"
                rt.input_log.append(Request(rid, "account", f"a{i % N}", "transfer",
                                            serde.encode([f"a{(i * 3 + 1) % N}", 1 + i % 4])))
                rids.append(rid)
                i += 1
                time.sleep(0.01)

        def moving() -> bool:
            return rt.gate.closed_for(rt.last_recorded_epoch() + 1)

        def killer() -> None:
            while not stop.is_set():
                if moving():  # the move: the gate is closed, the state is being re-placed
                    kill_workers("move")
                    while moving() and not stop.is_set():
                        time.sleep(0.005)
                    time.sleep(0.05)
                    # the first epochs on the new layout read its bases: on the resident exchange they run on a new
                    # gang, whose task workers start a few seconds after the move (the move's kill may have left
                    # none): wait for one
                    deadline = time.monotonic() + 30
                    while not _task_workers_of_this_process() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    kill_workers("restore")
                time.sleep(0.002)

        threads = [threading.Thread(target=load), threading.Thread(target=killer)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.5)
            a = rt.rescale(4)
            time.sleep(1.5)
            b = rt.rescale(3)
            time.sleep(1.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert (a["to"], b["to"]) == (4, 3) and rt.config.partitions == 3
        assert "restore" in killed, f"no task worker was killed after a move: {killed}"
        rt.wait_idle(240)
        deadline = time.monotonic() + 120
        while any(rt.get_reply(r) is None for r in rids):
            assert time.monotonic() < deadline, rt.health()
            time.sleep(0.1)
        assert rt.health()["fatal"] is None
        assert sum(rt.read_state("account", f"a{i}", 0) for i in range(N)) == N * 100
        counts: dict[str, int] = {}
        for _, rep in rt.output_log.read_since(0, limit=10**6):
            counts[rep.request_id] = counts.get(rep.request_id, 0) + 1
        assert all(counts.get(r) == 1 for r in rids), "each request answered exactly once"
    finally:
        rt.close()


def test_a_timer_due_during_a_log_outage_fires_after_it(tmp_path: Path) -> None:
    """An idle runtime whose timer falls due while nats-server is stopped (SIGSTOP): the timer ticker's log
    calls fail during the outage; once the log is back the timer still fires (the ticker survived)."""
    from charon import serde
    from charon.messages import Request

    nats = NatsServer(tmp_path / "nats").start()
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "d"), partitions=2, idle_wait_ms=100,
                      log_url=f"{nats.url}/tm{uuid.uuid4().hex[:6]}", epoch_max_failures=2, restart_backoff_s=0.2)
    rt = SparkRuntime("charon.apps.holds:app", cfg)
    assert nats.proc is not None
    stopped = False
    try:
        rt.start()
        rt.input_log.append(Request("d0", "acct", "a", "deposit", serde.encode([100])))
        rt.input_log.append(Request("h1", "acct", "a", "hold", serde.encode(["h1", 30, 2.0])))
        rt.wait_idle(60)
        assert rt.get_reply("h1") is not None and rt.get_reply("h1").ok
        os.kill(nats.proc.pid, signal.SIGSTOP)
        stopped = True
        time.sleep(20)  # the timer is due at ~2 s: the ticker's calls to the log time out meanwhile
        os.kill(nats.proc.pid, signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 90
        while rt.read_state("acct", "a") != 100:  # released by the timer
            assert time.monotonic() < deadline, f"the timer never fired: {rt.health()}"
            time.sleep(0.5)
        rt.wait_idle(60)
        # idle now: a new timer fires only if the ticker still runs (nothing else makes an epoch come)
        rt.input_log.append(Request("h2", "acct", "a", "hold", serde.encode(["h2", 40, 1.0])))
        rt.wait_idle(60)
        deadline = time.monotonic() + 30
        while rt.read_state("acct", "a") != 100:
            assert time.monotonic() < deadline, f"a timer set after the outage never fired: {rt.health()}"
            time.sleep(0.2)
        assert rt.health()["fatal"] is None
    finally:
        if stopped:
            os.kill(nats.proc.pid, signal.SIGCONT)
        rt.close()
        nats.kill()
