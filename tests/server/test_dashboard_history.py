"""The dashboard's server side: the metrics history (a ring buffer bounded by count and bytes, one sample a second,
``GET /admin/metrics/history?since=``) and the code history (``GET /admin/code/history``), over real HTTP."""

from __future__ import annotations

import random
import time

import code_versions
import httpx
import msgspec
import pytest

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.client import Client
from charon.config import GatewayConfig
from charon.server.history import MetricsHistory, Sample
from charon.server.serve import BackgroundServer

TOKEN = "h1story"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _sample(t: float, aborts: dict[str, int] | None = None) -> Sample:
    return Sample(t=t, committed=1, aborted=sum((aborts or {}).values()), aborts=aborts or {}, p50_ms=1.0,
                  p99_ms=2.0, epochs=1, epoch_ms=1.0, epoch_max_ms=1.0, backlog=0, inflight=0)


def test_history_keeps_the_newest_samples_within_count_and_bytes() -> None:
    h = MetricsHistory(max_samples=5, max_bytes=1 << 20)
    for i in range(12):
        h.add(_sample(float(i)))
    assert [s.t for s in h.since(None)] == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert [s.t for s in h.since(9.0)] == [10.0, 11.0]
    one = len(msgspec.json.encode(_sample(0.0)))
    big = {f"Error{i}": i for i in range(20)}  # a sample with many abort types is larger
    hb = MetricsHistory(max_samples=1000, max_bytes=one * 10)
    for i in range(30):
        hb.add(_sample(float(i), big if i % 2 else None))
    assert 0 < hb.bytes <= one * 10
    assert sum(len(msgspec.json.encode(s)) for s in hb.since(None)) == hb.bytes
    assert hb.since(None)[-1].t == 29.0 and len(hb) < 10
    with pytest.raises(ValueError):
        MetricsHistory(max_samples=0)


def test_history_route_grows_under_load_and_answers_since() -> None:
    n = 20
    rt = InProcessRuntime(ycsb.app, partitions=2, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(n, 1))  # balance 1: a second transfer out of one account aborts
    cfg = GatewayConfig(metrics_history_samples=4)
    with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN) as c, \
            httpx.Client(base_url=srv.url, headers=AUTH) as http:
        rng = random.Random(1)
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            c.submit("account", ycsb.key(rng.randrange(n)), "transfer", ycsb.key(rng.randrange(n)), 1)
        time.sleep(1.2)
        doc = http.get("/admin/metrics/history").json()
        samples = doc["samples"]
        assert doc["max_samples"] == 4 and len(samples) == 4, "bounded by metrics_history_samples"
        assert doc["bytes"] == sum(len(msgspec.json.encode(s)) for s in samples)
        ts = [s["t"] for s in samples]
        assert ts == sorted(ts) and all(0.5 < b - a < 2.0 for a, b in zip(ts, ts[1:], strict=False)), ts
        busy = [s for s in samples if s["committed"]]
        assert busy and all(s["p50_ms"] is not None and s["p99_ms"] >= s["p50_ms"] for s in busy)
        aborts = {k: v for s in samples for k, v in s["aborts"].items()}
        assert set(aborts) == {"NotEnoughCredit"} and sum(s["aborted"] for s in samples) == \
            sum(sum(s["aborts"].values()) for s in samples)
        assert any(s["epochs"] > 0 and s["epoch_ms"] is not None for s in samples)
        assert all(s["backlog"] is not None for s in samples)
        newer = http.get("/admin/metrics/history", params={"since": ts[-2]}).json()["samples"]
        assert [s["t"] for s in newer][0] == ts[-1]
        for bad in ({"since": "soon"}, {"since": "nan"}, {"from": "1"}):
            r = http.get("/admin/metrics/history", params=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", bad
        r = httpx.get(srv.url + "/admin/metrics/history")
        assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
    rt.close()


def test_code_history_lists_each_version_once_with_its_epoch() -> None:
    rt = InProcessRuntime(code_versions.v1, partitions=2, epoch_max_ms=2.0)
    rt.load("account", {f"a{i}": 100 for i in range(4)})
    cfg = GatewayConfig(code_refs="code_versions:v2")
    try:
        with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN) as c, \
                httpx.Client(base_url=srv.url, headers=AUTH) as http:
            first = http.get("/admin/code/history").json()
            assert first["current"] == "1" and [v["version"] for v in first["versions"]] == ["1"]
            upd = c.update_code("code_versions:v2", "v2", ("account", "migrate", ["EUR"]))
            doc = http.get("/admin/code/history").json()
            assert doc["current"] == "v2"
            assert [(v["version"], v["ref"]) for v in doc["versions"]] == [("1", None), ("v2", "code_versions:v2")]
            assert doc["versions"][1]["from_epoch"] == upd["from_epoch"]
            assert doc["versions"][1]["migration"] == "account.migrate"
            assert httpx.get(srv.url + "/admin/code/history").status_code == 401
    finally:
        rt.close()
