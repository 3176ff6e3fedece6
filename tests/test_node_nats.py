"""The durable node engine (`charon run --engine inprocess --log nats://...`) over the NATS JetStream log:
SIGKILL of nats-server and of the engine under concurrent HTTP load, restart, then every acknowledged
payment is in the state once and nothing executed twice (the ledger of tests/test_node.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from natsfix import NatsServer
from test_node import Server, _check_ledger, _invoke, _load, _retry_all, _tag_call


@pytest.mark.timeout(300)
def test_node_over_nats_survives_sigkill_of_server_and_engine(tmp_path: Path) -> None:
    nats = NatsServer(tmp_path / "nats").start()
    url = f"{nats.url}/node"
    data = tmp_path / "data"
    try:
        srv = Server(data, "--log", url)

        async def load_kill_nats_then_engine() -> tuple[dict, set]:
            load = asyncio.ensure_future(_load(srv.url, 60.0, workers=16))
            await asyncio.sleep(2.0)
            nats.kill()  # the log goes away under load: appends wait and retry
            await asyncio.sleep(1.0)
            nats.start()
            await asyncio.sleep(2.0)
            assert not load.done()
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:  # served again
                r = await _invoke(client, *_tag_call("t999-0"), "t999-0")
            assert r.status_code == 200, r.text
            probe.append("t999-0")
            srv.kill()  # then the engine, with requests in flight
            return await load

        probe: list[str] = []
        acked, sent = asyncio.run(load_kill_nats_then_engine())
        sent |= set(probe)
        err = srv.proc.stderr.read()  # type: ignore[union-attr]
        assert "logs on nats://" in err, err
        assert len(acked) > 50, len(acked)
        started = time.monotonic()
        srv = Server(data, "--log", url)
        assert time.monotonic() - started < 60
        again = asyncio.run(_retry_all(srv.url, sorted(sent)))
        for tag, body in acked.items():
            assert again[tag] == body, (tag, body, again[tag])
        assert "recovered by replaying" in srv.stop()
        _check_ledger(data, acked, sent, log_url=url)
    finally:
        nats.kill()
