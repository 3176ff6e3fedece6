"""Losing the machine (issue 33): the durable node as a real ``charon run`` process on a 3-server NATS JetStream
cluster (replicas 3) and SeaweedFS; under HTTP load its process group is SIGKILLed, the NATS server on the same
"machine" is SIGKILLed too, and its data directory is deleted. A new ``charon run`` on an empty directory with the
same log and storage location serves again: every acknowledged transfer is there exactly once with the reply it
was given, money is conserved, and the recovery time is printed."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest
from http_transfers import Call, balances, expected_balances, invoke_all, kill_mid_run
from natsfix import NatsCluster, free_port
from nodeproc import kill, start_charon, support_env

from tests.support.seaweedfix import SeaweedS3

pytestmark = pytest.mark.timeout(420)
TOKEN = "t0k"
ACCOUNTS = [f"a{i}" for i in range(8)]


def test_the_node_and_a_nats_server_lost_with_the_machine(tmp_path: Path, s3_env: SeaweedS3) -> None:
    import asyncio

    cluster = NatsCluster(tmp_path / "nats").start()
    log_url = cluster.url(f"ml{uuid.uuid4().hex[:6]}")  # ?replicas=3
    storage = s3_env.url(f"ml-{uuid.uuid4().hex[:8]}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = support_env(CHARON_COMPACT_EVERY="4")

    def node(data: Path, name: str):  # type: ignore[no-untyped-def]
        return start_charon(["run", "charon.apps.ycsb:app", "--partitions", "2", "--data-dir", str(data),
                             "--log", log_url, "--storage", storage, "--token", TOKEN],
                            port=port, log=tmp_path / f"{name}.log", env=env, group=True, timeout=180)

    first = node(tmp_path / "m1", "m1")
    second = None
    try:
        seed: dict[str, dict] = {}
        asyncio.run(invoke_all(url, [(a, "deposit", [100], f"seed-{a}") for a in ACCOUNTS], seed, TOKEN))
        assert {r["http"] for r in seed.values()} == {200}
        calls: list[Call] = [(ACCOUNTS[i % 8], "transfer", [ACCOUNTS[(i * 5 + 3) % 8], 1 + i % 9], f"t{i}")
                             for i in range(160)]
        lost_at = 0.0

        def lose_the_machine() -> None:
            nonlocal lost_at
            lost_at = time.monotonic()
            kill(first, group=True)
            cluster.servers[0].kill()  # the NATS server that ran on the same machine

        acked = kill_mid_run(url, lose_the_machine, calls, after=60, token=TOKEN)
        assert 60 <= len(acked) < len(calls), len(acked)
        shutil.rmtree(tmp_path / "m1")  # its disk is gone with it

        second = node(tmp_path / "m2", "m2")
        healthy_s = time.monotonic() - lost_at
        probe: dict[str, dict] = {}
        asyncio.run(invoke_all(url, [(ACCOUNTS[0], "deposit", [0], "after-the-loss")], probe, TOKEN))
        first_commit_s = time.monotonic() - lost_at
        print(f"\nmachine loss: /health 200 on the new machine {healthy_s:.1f} s after the kill, its first new commit "
              f"at {first_commit_s:.1f} s; {len(acked)} of {len(calls)} transfers acknowledged before the loss")
        again: dict[str, dict] = {}
        asyncio.run(invoke_all(url, calls, again, TOKEN))  # the same keys: the acknowledged ones are not run again
        changed = {tag: (reply, again[tag]) for tag, reply in acked.items() if again[tag] != reply}
        assert not changed, changed  # every reply given before the loss, unchanged by the replay
        got = balances(url, ACCOUNTS, TOKEN)
        assert sum(got.values()) == 100 * len(ACCOUNTS), got  # money conserved
        assert got == expected_balances({a: 100 for a in ACCOUNTS}, calls, again)  # each answered once, applied once
    finally:
        kill(first, group=True)
        kill(second, group=True)
        cluster.kill()
