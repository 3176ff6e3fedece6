"""Runtime control over the gateway's admin API, in-process (volatile and durable): pause/resume at an epoch
boundary, consistent state reads (a cut during a YCSB-T run conserves money), /metrics, typed errors."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.client import Client
from charon.errors import CharonError, EpochNotRetained
from charon.server.serve import BackgroundServer

TOKEN = "s3cret"
N_ACCOUNTS = 60
BALANCE = 100


def _runtime(**kw) -> InProcessRuntime:
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_ms=2.0, **kw)
    rt.load("account", ycsb.initial_state(N_ACCOUNTS, BALANCE))
    return rt


def _wait(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def gateway():
    rt = _runtime()
    with BackgroundServer(rt, token=TOKEN, wait_timeout=0.3) as srv, Client(srv.url, token=TOKEN) as c:
        yield rt, srv, c


def test_pause_under_load_loses_nothing_and_keeps_order(gateway) -> None:
    rt, srv, c = gateway
    for i in range(20):
        c.invoke("account", ycsb.key(i), "transfer", ycsb.key(i + 1), 1)
    st = c.pause()
    assert st["state"] in ("paused", "pausing")
    _wait(lambda: c.status()["state"] == "paused", what="paused")
    frozen = c.status()["epoch"]
    rids = [c.submit("account", ycsb.key(i % N_ACCOUNTS), "transfer", ycsb.key((i + 7) % N_ACCOUNTS), 1)
            for i in range(40)]
    _wait(lambda: c.status()["backlog"] == 40, what="the backlog")
    time.sleep(0.2)
    st = c.status()
    assert st["epoch"] == frozen and st["paused"] is True and st["backlog"] == 40
    # a waiting request is pending (202), never an error; a synchronous call turns into 202 as well
    r = httpx.get(f"{srv.url}/requests/{rids[0]}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 202 and r.json()["status"] == "pending"
    r = httpx.post(f"{srv.url}/invoke/account/a1/balance", json={"args": []},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 202
    assert c.status()["epoch"] == frozen
    st = c.resume()
    assert st["paused"] is False
    results = [c.result_of(rid, 30) for rid in rids]
    assert all(res.epoch > frozen for res in results)
    order = [(res.epoch, res.tid) for res in results]
    assert order == sorted(order), "requests waiting across the pause ran in arrival order"
    _wait(lambda: c.status()["backlog"] == 0, what="drained")
    assert sum(rt.entities("account").values()) == N_ACCOUNTS * BALANCE


def test_pause_after_epoch(gateway) -> None:
    rt, _, c = gateway
    target = c.status()["epoch"] + 3
    c.pause(after_epoch=target)
    done = threading.Event()

    def load() -> None:
        for i in range(200):
            if done.is_set():
                return
            c.submit("account", ycsb.key(i % N_ACCOUNTS), "deposit", 1)
            time.sleep(0.005)

    t = threading.Thread(target=load)
    t.start()
    try:
        _wait(lambda: c.status()["state"] == "paused", what="paused after the epoch")
        assert c.status()["epoch"] == target
        time.sleep(0.2)
        assert c.status()["epoch"] == target
    finally:
        done.set()
        t.join()
    c.resume()
    _wait(lambda: c.status()["backlog"] == 0 and c.status()["epoch"] > target, what="resumed")


def test_consistent_cut_during_ycsb_conserves_money(gateway) -> None:
    rt, _, c = gateway
    stop = threading.Event()
    errors: list[BaseException] = []

    def drive() -> None:
        rng = random.Random(3)
        try:
            while not stop.is_set():
                a, b = rng.randrange(N_ACCOUNTS), rng.randrange(N_ACCOUNTS)
                c.submit("account", ycsb.key(a), "transfer", ycsb.key(b), rng.randint(1, 30))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=drive) for _ in range(3)]
    for t in threads:
        t.start()
    epochs = []
    try:
        for _ in range(30):
            cut = c.read_state("account")
            assert cut["count"] == N_ACCOUNTS and not cut["truncated"]
            assert sum(cut["entities"].values()) == N_ACCOUNTS * BALANCE, f"cut at epoch {cut['epoch']}"
            some = c.read_state("account", [ycsb.key(i) for i in range(0, N_ACCOUNTS, 3)])
            assert some["count"] == len(range(0, N_ACCOUNTS, 3))
            epochs.append(cut["epoch"])
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert epochs == sorted(epochs) and epochs[-1] > epochs[0], "the cuts followed the running epochs"


def test_read_at_earlier_epoch_durable(tmp_path) -> None:
    rt = _runtime(data_dir=str(tmp_path / "node"), fsync=False, checkpoint_s=0.01)
    try:
        with BackgroundServer(rt, token=TOKEN, wait_timeout=5) as srv, Client(srv.url, token=TOKEN) as c:
            for _ in range(20):
                c.invoke("account", ycsb.key(0), "transfer", ycsb.key(1), 5)
            now = c.read_state("account", ["a0", "a1"])
            assert now["entities"] == {"a0": 0, "a1": 200}
            _wait(lambda: rt.node.checkpointed_epoch >= now["epoch"], what="checkpoint")
            retained = c.status()["retained_epochs"]
            assert len(retained) >= 2 and retained[-1] == now["epoch"]
            assert retained == sorted(set(retained)), f"no duplicate epochs: {retained}"
            seen = []
            for e in retained:
                cut = c.read_state("account", epoch=e)
                assert cut["epoch"] == e and sum(cut["entities"].values()) == N_ACCOUNTS * BALANCE
                pair = c.read_state("account", ["a0", "a1"], epoch=e)["entities"]
                assert pair["a0"] + pair["a1"] == 200 and pair["a0"] % 5 == 0
                seen.append(pair["a0"])
            assert seen == sorted(seen, reverse=True) and seen[-1] == 0
            missing = sorted(set(range(retained[0], retained[-1])) - set(retained))
            for bad in [now["epoch"] + 100] + missing[:1]:
                with pytest.raises(CharonError) as err:
                    c.read_state("account", epoch=bad)
                assert type(err.value) is EpochNotRetained  # the class the engine's controls raise
                r = httpx.get(f"{srv.url}/admin/state/account", params={"epoch": bad},
                              headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 410 and r.json()["error"]["type"] == "EpochNotRetained"
    finally:
        rt.close()


def test_admin_routes_need_the_token_and_reject_bad_input(gateway) -> None:
    _, srv, c = gateway
    for method, path in [("GET", "/admin/status"), ("POST", "/admin/pause"), ("POST", "/admin/resume"),
                         ("GET", "/admin/state/account"), ("GET", "/metrics"), ("GET", "/admin/summary")]:
        assert httpx.request(method, srv.url + path).status_code == 401, path
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = [
        ("POST", "/admin/pause", {"content": b"[1]", "headers": {**auth, "content-type": "application/json"}}, 400),
        ("POST", "/admin/pause", {"content": b"{", "headers": {**auth, "content-type": "application/json"}}, 400),
        ("POST", "/admin/pause", {"content": b"x", "headers": {**auth, "content-type": "text/plain"}}, 415),
        ("POST", "/admin/pause", {"json": {"after_epoch": "soon"}, "headers": auth}, 400),
        ("POST", "/admin/pause", {"json": {"what": 1}, "headers": auth}, 400),
        ("GET", "/admin/state/nosuch", {"headers": auth}, 404),
        ("GET", "/admin/state/account?epoch=x", {"headers": auth}, 400),
        ("GET", "/admin/state/account?limit=0", {"headers": auth}, 400),
        ("GET", "/admin/state/account?limit=100000000", {"headers": auth}, 400),
        ("GET", "/admin/state/account?epoch=123456", {"headers": auth}, 410),
    ]
    for method, path, kw, status in bad:
        r = httpx.request(method, srv.url + path, **kw)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["type"]
    assert c.status()["paused"] is False  # nothing above paused it
    lim = c.read_state("account", limit=5)
    assert lim["count"] == 5 and lim["truncated"] is True


def test_metrics_exposition(gateway) -> None:
    _, _, c = gateway
    for i in range(30):
        c.invoke("account", ycsb.key(i), "deposit", 1)
    with pytest.raises(CharonError):
        c.invoke("account", "a0", "transfer", "a1", 10**9)
    text = c.metrics()
    for name in ["charon_transactions_total", "charon_request_latency_seconds_bucket", "charon_epoch_duration_seconds",
                 "charon_epoch_size_bucket", "charon_epoch_rounds_bucket", "charon_fallback_transactions_total",
                 "charon_partition_requests_total", "charon_backlog", "charon_paused", "charon_deferred",
                 "charon_code_info"]:
        assert name in text, name
    assert 'charon_transactions_total{outcome="committed",reason=""} 30.0' in text
    assert 'charon_transactions_total{outcome="aborted",reason="NotEnoughCredit"} 1.0' in text
    assert "charon_paused 0.0" in text
    c.pause()
    assert "charon_paused 1.0" in c.metrics()
    c.resume()
    summary = httpx.get(c.url + "/admin/summary", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert summary["throughput"] > 0 and summary["latency_ms"]["p50"] is not None
    assert sum(summary["partition_load"]) == 31 and summary["epochs"]


def test_admin_update_runs_once_and_alone_under_load(gateway) -> None:
    rt, srv, c = gateway
    stop = threading.Event()
    client_rids: list[str] = []

    def drive() -> None:
        rng = random.Random(9)
        while not stop.is_set():
            a, b = rng.randrange(N_ACCOUNTS), rng.randrange(N_ACCOUNTS)
            client_rids.append(c.submit("account", ycsb.key(a), "transfer", ycsb.key(b), rng.randint(1, 5)))
            time.sleep(0.002)

    t = threading.Thread(target=drive)
    t.start()
    try:
        time.sleep(0.3)
        out = c.admin_update("bonus-1", "account", "deposit", 10)  # every account gets 10, alone
        again = c.admin_update("bonus-1", "account", "deposit", 10)
        some = c.admin_update("bonus-2", "account", "deposit", 1, keys=["a1", "a2"])
        time.sleep(0.3)
    finally:
        stop.set()
        t.join()
    assert out["transactions"] == out["committed"] == N_ACCOUNTS and not out["aborted"] and not out["repeated"]
    assert again["repeated"] is True and again["committed"] == N_ACCOUNTS
    assert some["committed"] == 2
    _wait(lambda: c.status()["backlog"] == 0, what="drained")
    assert sum(rt.entities("account").values()) == N_ACCOUNTS * (BALANCE + 10) + 2, "ran exactly once"
    admin_epochs = set(out["epochs"]) | set(some["epochs"])
    client_epochs = set()
    for rid in client_rids:
        try:
            client_epochs.add(c.result_of(rid, 30).epoch)
        except CharonError as exc:
            client_epochs.add(exc.epoch)  # aborted (NotEnoughCredit): it still ran in an epoch
    assert len(client_rids) > 20 and not admin_epochs & client_epochs, "no client transaction shared its epochs"
    for bad in [{"id": "x y", "operator": "account", "function": "deposit", "args": [1]},
                {"id": "u", "operator": "nosuch", "function": "deposit", "args": [1]},
                {"id": "u", "operator": "account", "function": "deposit", "args": ["x"]},
                {"id": "u", "operator": "account", "function": "deposit", "args": [1], "keys": [""]}]:
        r = httpx.post(f"{srv.url}/admin/update", json=bad, headers={"Authorization": f"Bearer {TOKEN}"})
        assert 400 <= r.status_code < 500, (bad, r.text)


def test_admin_update_is_logged_and_survives_a_restart(tmp_path) -> None:
    data = str(tmp_path / "node")
    rt = _runtime(data_dir=data, fsync=False)
    with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
        c.invoke("account", "a0", "transfer", "a1", 5)
        out = c.admin_update("grow", "account", "deposit", 3)
        assert out["committed"] == N_ACCOUNTS
    rt.close()
    rt = InProcessRuntime(ycsb.app, partitions=4, data_dir=data, fsync=False)
    try:
        assert sum(rt.entities("account").values()) == N_ACCOUNTS * (BALANCE + 3)
        with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
            again = c.admin_update("grow", "account", "deposit", 3)
            assert again["repeated"] is True
            assert sum(c.read_state("account")["entities"].values()) == N_ACCOUNTS * (BALANCE + 3)
    finally:
        rt.close()


def test_durable_pause_logs_waiting_requests_and_a_crash_loses_none(tmp_path) -> None:
    """In durable mode the requests that arrive while paused are in the input log at once (as the next
    epochs); a runtime abandoned while paused (no stop, no checkpoint of them) replays them on restart."""
    import asyncio

    from charon import serde
    from charon.messages import Request

    data = str(tmp_path / "node")

    async def paused_then_abandoned() -> int:
        rt = _runtime(data_dir=data, fsync=False)
        await rt.start()
        await rt.submit("account", "a0", "transfer", ["a1", 1])
        rt.pause()
        frozen = rt.control_status()["epoch"]
        futs = [rt.enqueue(Request(f"w{i}", "account", ycsb.key(i), "deposit", serde.encode([1])))
                for i in range(25)]
        for _ in range(500):
            if all(rt.input_log.contains(f"w{i}") for i in range(25)):
                break
            await asyncio.sleep(0.01)
        st = rt.control_status()
        assert all(rt.input_log.contains(f"w{i}") for i in range(25)), "waiting requests are durable"
        assert st["epoch"] == frozen and st["backlog"] == 25 and st["logged_waiting"] >= 1
        assert not any(f.done() for f in futs)
        rt._task.cancel()  # the process "dies" while paused
        rt.node.close()
        return frozen

    frozen = asyncio.run(paused_then_abandoned())
    rt = InProcessRuntime(ycsb.app, partitions=4, data_dir=data, fsync=False)
    try:
        assert rt.epoch - 1 > frozen and rt.replayed_epochs >= 1
        assert all(rt.get_reply(f"w{i}") is not None and rt.get_reply(f"w{i}").ok for i in range(25))
        assert sum(rt.entities("account").values()) == N_ACCOUNTS * BALANCE + 25
    finally:
        rt.close()


def test_durable_pause_resume_runs_logged_epochs_in_order(tmp_path) -> None:
    rt = _runtime(data_dir=str(tmp_path / "node"), fsync=False)
    try:
        with BackgroundServer(rt, token=TOKEN, wait_timeout=0.2) as srv, Client(srv.url, token=TOKEN) as c:
            c.invoke("account", "a0", "deposit", 1)
            c.pause()
            _wait(lambda: c.status()["state"] == "paused", what="paused")
            frozen = c.status()["epoch"]
            rids = [c.submit("account", ycsb.key(i % 5), "deposit", 1) for i in range(30)]
            _wait(lambda: c.status()["backlog"] == 30, what="backlog")
            assert c.status()["epoch"] == frozen
            c.resume()
            results = [c.result_of(r, 30) for r in rids]
            assert all(r.epoch > frozen for r in results)
            order = [(r.epoch, r.tid) for r in results]
            assert order == sorted(order)
            assert c.admin_update("after", "account", "deposit", 1)["committed"] == N_ACCOUNTS
            assert sum(c.read_state("account")["entities"].values()) == N_ACCOUNTS * (BALANCE + 1) + 31
    finally:
        rt.close()
