"""Rescaling a running deployment through the admin API (``POST /admin/rescale``, ``Client.rescale``,
``charon rescale``): a durable node goes 2 -> 4 -> 3 partitions under concurrent HTTP clients (every request
answered once, money conserved), the answer carries the measured pause, ``/admin/status`` shows the layout,
bad counts are typed 4xx, a second rescale while one runs is 409. One short real-PySpark test."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.cli import app as cli_app
from charon.client import AsyncClient, BadRequest, Client, RescaleRunning, Unauthorized
from charon.config import GatewayConfig
from charon.errors import TransactionAborted
from charon.server.serve import BackgroundServer

TOKEN = "s3cret"
SOURCES = 40  # accounts the clients take money from
CLIENTS = 4  # each deposits into its own sink account (SOURCES + i)
BALANCE = 100


def _drive(url: str, i: int, stop: threading.Event, done: dict[str, int], errors: list[BaseException]) -> None:
    """One HTTP client: transfers of 1 from the sources to its own sink, each with its own request id."""
    sink = ycsb.key(SOURCES + i)
    n = 0
    try:
        with Client(url, token=TOKEN) as c:
            while not stop.is_set():
                rid = f"c{i}-{n}-{uuid.uuid4().hex[:6]}"
                try:
                    c.invoke("account", ycsb.key((n * 7 + i) % SOURCES), "transfer", sink, 1, request_id=rid)
                    done[rid] = 1
                except TransactionAborted:
                    done[rid] = 0
                n += 1
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _progress(dones: list[dict[str, int]], errors: list[BaseException], more: int = 5) -> None:
    """Wait until every client has had ``more`` further answers (the load runs across each step)."""
    start = [len(d) for d in dones]
    deadline = time.monotonic() + 60
    while any(len(d) < s + more for d, s in zip(dones, start, strict=True)) and not errors:
        assert time.monotonic() < deadline, "the clients made no progress"
        time.sleep(0.02)


def test_rescale_route_under_concurrent_clients_2_4_3(tmp_path: Path) -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2, data_dir=str(tmp_path), checkpoint_s=0.05)
    rt.load("account", ycsb.initial_state(SOURCES + CLIENTS, BALANCE))
    with BackgroundServer(rt, token=TOKEN, wait_timeout=5.0) as srv, Client(srv.url, token=TOKEN) as c:
        st = c.status()
        assert st["partitions"] == 2 and st["last_rescale"] is None
        stop, errors = threading.Event(), []
        dones: list[dict[str, int]] = [{} for _ in range(CLIENTS)]
        threads = [threading.Thread(target=_drive, args=(srv.url, i, stop, dones[i], errors)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        _progress(dones, errors)
        four = c.rescale(4)
        _progress(dones, errors)
        three = CliRunner().invoke(cli_app, ["rescale", "3", "--url", srv.url, "--token", TOKEN])
        assert three.exit_code == 0, three.output
        _progress(dones, errors)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        st = c.status()
        assert st["partitions"] == 3 and rt.partitions == 3
        last = st["last_rescale"]
        assert last["from"] == 4 and last["to"] == 3 and last["pause_s"] > 0 and last["cpu_s"] >= 0
        assert four["from"] == 2 and four["to"] == 4 and four["keys"] >= SOURCES + CLIENTS
        assert four["pause_s"] > 0 and four["wait_s"] >= 0 and four["cpu_s"] >= 0 and four["epoch"] > 0
        balances = rt.entities("account")
        assert sum(balances.values()) == (SOURCES + CLIENTS) * BALANCE, "money is conserved"
        assert sum(sum(d.values()) for d in dones) > 20
        for i, d in enumerate(dones):  # every committed transfer applied exactly once
            assert balances[ycsb.key(SOURCES + i)] == BALANCE + sum(d.values()), i
            for rid in list(d)[:: max(1, len(d) // 10)]:  # a repeat of a request id answers, runs nothing
                rep = rt.get_reply(rid)
                assert rep is not None and rep.request_id == rid
        assert [p["to"] for p in rt.rescale_pauses] == [4, 3]
    rt.close()


def test_rescale_route_errors() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(10, BALANCE))
    cfg = GatewayConfig(max_partitions=8)
    with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN) as c:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for bad in (0, -1, 9, 1 << 40, "3", True, None, 2.5):
            r = httpx.post(srv.url + "/admin/rescale", json={"partitions": bad}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", (bad, r.text)
        r = httpx.post(srv.url + "/admin/rescale", json={"partitions": 3, "x": 1}, headers=auth)
        assert r.status_code == 400
        for bad in (0, 9, "3", True, 2.5):
            r = httpx.post(srv.url + "/admin/rescale", json={"log_partitions": bad}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", (bad, r.text)
        r = httpx.post(srv.url + "/admin/rescale", json={}, headers=auth)
        assert r.status_code == 400 and "log_partitions" in r.json()["error"]["message"]
        # the in-process runtime's input log is one epoch log: no log partitions to rescale, typed, nothing moved
        r = httpx.post(srv.url + "/admin/rescale", json={"partitions": 3, "log_partitions": 2}, headers=auth)
        assert r.status_code == 501 and r.json()["error"]["type"] == "NotSupported" and rt.partitions == 2
        assert httpx.post(srv.url + "/admin/rescale", json={"log_partitions": 2}).status_code == 401
        res = CliRunner().invoke(cli_app, ["rescale", "--url", srv.url, "--token", TOKEN])
        assert res.exit_code != 0 and "--log-partitions" in res.output and rt.partitions == 2
        r = httpx.post(srv.url + "/admin/rescale", content=b"{", headers={**auth, "Content-Type": "application/json"})
        assert r.status_code == 400
        assert httpx.post(srv.url + "/admin/rescale", json={"partitions": 3}).status_code == 401
        with pytest.raises(Unauthorized):
            Client(srv.url, token="wrong").rescale(3)
        with pytest.raises(BadRequest):
            c.rescale(9)
        c.pause()
        with pytest.raises(RescaleRunning):  # in-process, paused: refused instead of waiting for the resume
            c.rescale(3)
        c.resume()
        out = c.rescale(3)  # not volatile-only: a non-durable in-process runtime rescales too
        assert out["to"] == 3 and rt.partitions == 3 and sum(rt.entities("account").values()) == 10 * BALANCE

        async def via_async() -> dict:
            async with AsyncClient(srv.url, token=TOKEN) as ac:
                with pytest.raises(BadRequest):
                    await ac.rescale(0)
                return await ac.rescale(5)

        out = asyncio.run(via_async())
        assert out["from"] == 3 and out["to"] == 5 and c.status()["partitions"] == 5
        assert "/admin/rescale" in httpx.get(srv.url + "/openapi.json").json()["paths"]


def test_second_rescale_while_one_runs_is_409(tmp_path: Path) -> None:
    """A rescale blocks until an epoch boundary; one sent meanwhile is 409 RescaleRunning."""
    rt = InProcessRuntime(ycsb.app, partitions=2, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(10, BALANCE))
    with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
        slow = threading.Event()
        original = rt.rescale

        async def held(n: int) -> float:  # the real rescale, started after the second request came
            while not slow.is_set():
                await asyncio.sleep(0.01)
            return await original(n)

        rt.rescale = held  # type: ignore[method-assign]
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(c.rescale(4)))
        t.start()
        time.sleep(0.3)
        with pytest.raises(RescaleRunning):
            Client(srv.url, token=TOKEN).rescale(3)
        slow.set()
        t.join(30)
        assert first["to"] == 4 and rt.partitions == 4


@pytest.mark.spark
def test_rescale_route_on_spark(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    from charon.config import SparkConfig
    from charon.runtime.spark.layout import read_layout
    from charon.runtime.spark.runtime import SparkRuntime

    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=100)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    rt.load("account", ycsb.initial_state(20, BALANCE))
    with BackgroundServer(rt, token=TOKEN, wait_timeout=30) as srv, Client(srv.url, token=TOKEN) as c:
        for i in range(5):
            c.invoke("account", ycsb.key(i), "transfer", ycsb.key(i + 10), 1)
        assert c.status()["partitions"] == 2
        out = c.rescale(3)
        assert out["from"] == 2 and out["to"] == 3 and out["pause_s"] > 0 and out["cpu_s"] >= 0
        assert out["wait_s"] >= 0 and out["keys"] >= 20
        st = c.status()
        assert st["partitions"] == 3 and st["last_rescale"]["to"] == 3
        for i in range(5):
            c.invoke("account", ycsb.key(i), "transfer", ycsb.key(i + 10), 1)
        both = c.rescale(2, log_partitions=2)  # one call, both kinds: status shows both (it showed only the log)
        assert both["from"] == 3 and both["to"] == 2 and both["log"]["from"] == 1 and both["log"]["to"] == 2
        st = c.status()
        assert st["last_rescale"] == both and st["partitions"] == 2
        assert st["log_partitions"] == {"route": 2, "physical": 2}
        for i in range(5):
            c.invoke("account", ycsb.key(i), "transfer", ycsb.key(i + 10), 1)
        state = c.read_state("account")
        assert sum(state["entities"].values()) == 20 * BALANCE
        assert state["entities"][ycsb.key(10)] == BALANCE + 3
    layout = read_layout(os.path.join(str(tmp_path), "checkpoint"))  # the layout survives a restart
    assert layout is not None and (layout.partitions, layout.log_partitions) == (2, 2)
