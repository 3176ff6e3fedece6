"""The Spark runtime over the NATS JetStream log, end to end on real PySpark: the driver runs here, the HTTP
gateway is another process (`charon run --engine remote --log nats://...`) that only talks to nats-server.
Also: nats-server SIGKILLed and restarted while requests flow, and the gateway SIGKILLed and replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from natsfix import NatsServer, free_port

from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime

pytestmark = pytest.mark.spark
TOKEN = "t0k"
CHARON = str(Path(sys.executable).parent / "charon")
N = 10  # accounts


class RemoteGateway:
    def __init__(self, log_url: str, logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(logdir / f"gateway-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [CHARON, "run", "charon.apps.ycsb:app", "--engine", "remote", "--log", log_url, "--port",
             str(self.port), "--token", TOKEN],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, "the remote gateway exited during start-up"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the remote gateway did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


async def _invoke_all(url: str, calls: list[tuple[str, str, list, str]]) -> dict[str, dict]:
    """POST every call with its Idempotency-Key, retrying transport errors and 503s with the same key."""
    out: dict[str, dict] = {}
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def one(client: httpx.AsyncClient, key: str, fn: str, args: list, tag: str) -> None:
        for _ in range(120):
            try:
                r = await client.post(f"/invoke/account/{key}/{fn}", json={"args": args},
                                      headers={**headers, "Idempotency-Key": tag})
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            if r.status_code in (200, 409):
                out[tag] = {**r.json(), "http": r.status_code}
                return
            assert r.status_code in (202, 503), (tag, r.status_code, r.text)
            await asyncio.sleep(0.5)
        raise AssertionError(f"{tag} was never answered")

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        try:  # bounded: a runtime that stopped answering fails here, with what was answered, not at the test timeout
            await asyncio.wait_for(asyncio.gather(*(one(client, *c) for c in calls)), 300)
        except TimeoutError:
            raise AssertionError(f"{len(calls) - len(out)} of {len(calls)} calls unanswered after 300 s") from None
    return out


Call = tuple[str, str, list, str]  # key, function, args, idempotency key


def _check_exactly_once(rt: SparkRuntime, transfers: list[Call], replies: dict[str, dict]) -> None:
    """Each acknowledged transfer executed exactly once and the refused ones not at all (the balances equal the
    acknowledged transfers applied to the seed deposits), and each request has exactly one reply in the log."""
    balances = {f"a{i}": rt.read_state("account", f"a{i}", 0) for i in range(N)}
    assert sum(balances.values()) == 100 * N, balances  # money conserved
    want = {f"a{i}": 100 for i in range(N)}
    for key, _, args, tag in transfers:
        if replies[tag]["http"] == 200:
            want[key] -= args[1]
            want[args[0]] += args[1]
    assert balances == want, (balances, want)
    counts: dict[str, int] = {}
    for _, rep in rt.output_log.read_since(0, limit=10**6):
        counts[rep.request_id] = counts.get(rep.request_id, 0) + 1
    assert all(counts.get(t) == 1 for t in replies), "each request answered exactly once"


def _nats_and_driver(tmp_path: Path, **cfg: int | float) -> tuple[NatsServer, str, SparkRuntime]:
    """A started nats-server, a fresh deployment's log URL on it, and a (not yet started) Spark driver using it."""
    nats = NatsServer(tmp_path / "nats").start()
    log_url = f"{nats.url}/ycsb{uuid.uuid4().hex[:6]}"
    config = SparkConfig(master="local[2]", data_dir=str(tmp_path / "driver"), partitions=2, log_url=log_url,
                         max_batch=200, idle_wait_ms=200, **cfg)  # type: ignore[arg-type]
    return nats, log_url, SparkRuntime("charon.apps.ycsb:app", config)


def _started_and_seeded(rt: SparkRuntime, log_url: str, tmp_path: Path) -> RemoteGateway:
    """Start the driver and a remote gateway; deposit 100 into each of the N accounts through the gateway."""
    rt.start()
    gw = RemoteGateway(log_url, tmp_path)
    seed = asyncio.run(_invoke_all(gw.url, [(f"a{i}", "deposit", [100], f"seed{i}") for i in range(N)]))
    assert all(b["http"] == 200 for b in seed.values())
    return gw


@pytest.mark.timeout(600)
def test_spark_driver_and_remote_gateway_over_nats(tmp_path: Path) -> None:
    nats, log_url, rt = _nats_and_driver(tmp_path)
    gw: RemoteGateway | None = None
    try:
        gw = _started_and_seeded(rt, log_url, tmp_path)
        transfers = [(f"a{i % N}", "transfer", [f"a{(i * 7 + 3) % N}", 1 + i % 5], f"t{i}") for i in range(80)]
        first = asyncio.run(_invoke_all(gw.url, transfers[:40]))

        async def during_outage() -> dict[str, dict]:
            task = asyncio.ensure_future(_invoke_all(gw.url, transfers[40:]))
            await asyncio.sleep(0.3)
            nats.kill()  # the log goes away with requests in flight, then comes back
            await asyncio.sleep(1.5)
            nats.start()
            return await task

        second = asyncio.run(during_outage())
        replies = {**first, **second}
        assert len(replies) == 80
        gw.kill()  # a gateway dies; a new one answers every key from the NATS output log, identically
        gw = RemoteGateway(log_url, tmp_path)
        again = asyncio.run(_invoke_all(gw.url, transfers))
        assert again == replies
        r = httpx.get(f"{gw.url}/requests/t5", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code in (200, 409) and {**r.json(), "http": r.status_code} == replies["t5"]
        assert httpx.get(f"{gw.url}/state/account/a0", headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30).status_code == 503  # state is served by the driver, not a remote gateway

        rt.wait_idle(120)
        assert len([t for t in replies if replies[t]["http"] == 200]) > 40
        _check_exactly_once(rt, transfers, replies)
    finally:
        if gw is not None:
            gw.kill()
        rt.close()
        nats.kill()


@pytest.mark.timeout(600)
def test_a_long_log_outage_is_not_a_deterministic_failure(tmp_path: Path) -> None:
    """nats-server gone for longer than every NATS timeout, several times, while requests flow: the driver
    reports it (health not ok, the error names the log) and resumes when the log is back; it never gives up as if
    an epoch had failed deterministically (``epoch_max_failures``), and nothing acknowledged is lost or run twice."""
    nats, log_url, rt = _nats_and_driver(tmp_path, epoch_max_failures=2, restart_backoff_s=0.2)
    gw: RemoteGateway | None = None
    try:
        gw = _started_and_seeded(rt, log_url, tmp_path)
        transfers = [(f"a{i % N}", "transfer", [f"a{(i * 3 + 1) % N}", 1 + i % 4], f"t{i}") for i in range(60)]
        seen_down: list[dict] = []

        async def outages() -> dict[str, dict]:
            task = asyncio.ensure_future(_invoke_all(gw.url, transfers))
            for _ in range(2):
                await asyncio.sleep(0.5)
                nats.kill()
                for _ in range(25):  # 25 s: longer than any NATS operation's timeout (10-31 s), failing epochs
                    await asyncio.sleep(1)
                    seen_down.append(rt.health())
                nats.start()
            return await asyncio.wait_for(task, 400)

        replies = asyncio.run(outages())
        assert len(replies) == 60
        h = rt.health()
        assert h["fatal"] is None and h["status"] in ("ok", "recovering"), h
        assert any(not s["ok"] for s in seen_down), "the outage was never reported by health()"
        rt.wait_idle(180)
        deadline = time.monotonic() + 60  # the supervisor polls the log (at most every 5 s), then restarts
        while not rt.health()["ok"]:
            assert time.monotonic() < deadline, rt.health()
            time.sleep(0.2)
        _check_exactly_once(rt, transfers, replies)
    finally:
        if gw is not None:
            gw.kill()
        rt.close()
        nats.kill()
