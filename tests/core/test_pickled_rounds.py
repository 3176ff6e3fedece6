"""Contended YCSB-T epochs through the Spark task function (no Spark: its ``run_job`` runs here), where every
round pickles the messages, the scratch (suspended frames with their journals) and the call-graph cache: the
same replies and state as the in-process runtime, round by round and in one task, live or replayed.

The in-process runtime never pickles a frame or a cached invocation, so this is what checks that a frame (a
message made the invocation's frame, carrying its journal) and a cached dry-run invocation survive pickling.
"""

from __future__ import annotations

import os
import random
import uuid

import pytest
from epochcmp import assert_same_outcome

from charon import InProcessRuntime, Request, serde
from charon.apps import ycsb
from charon.config import SparkConfig
from charon.core import partition
from charon.core.epoch import EpochCoordinator
from charon.core.routing import partition_of, store_key
from charon.runtime.spark.exchange import SparkExchange
from charon.state.durable import DurableState

pytestmark = pytest.mark.usefixtures("fresh_means_empty")  # see conftest.py

N_ACCOUNTS = 40  # few accounts: most epochs conflict, so the cached fallback and the locked re-runs both run


class LocalJobExchange(SparkExchange):
    """The Spark exchange with its job run in this process (payloads and results pickled as on Spark)."""

    def run_job(self, payloads):  # noqa: ANN001, ANN201
        return list(self.fn(payloads))


def _batches(epochs: int, size: int) -> list[list[Request]]:
    rng = random.Random(7)
    out = []
    for _ in range(epochs):
        b = []
        for _ in range(size):
            a, c = rng.randrange(N_ACCOUNTS), rng.randrange(N_ACCOUNTS)
            amount = rng.choice([1, 5, 2_000_000])  # some transfers raise NotEnoughCredit
            b.append(Request(uuid.uuid4().hex, "account", ycsb.key(a), "transfer",
                             serde.encode([ycsb.key(c), amount])))
        out.append(b)
    return out


@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
@pytest.mark.parametrize("one_task", [False, True], ids=["round-by-round", "one-task"])
def test_pickled_rounds_match_in_process(tmp_path, monkeypatch, live, one_task):
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    parts = 3
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=parts, local_dir=str(tmp_path / "local"),
                      single_task_rest=one_task, single_task_fallback=one_task)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    initial = ycsb.initial_state(N_ACCOUNTS, balance=1_000)
    by_pid: dict[int, list] = {}
    for k, v in initial.items():
        by_pid.setdefault(partition_of("account", k, parts), []).append((store_key("account", k), serde.encode(v)))
    for pid in range(parts):
        durable.write_base(pid, -1, sorted(by_pid.get(pid, [])))
    reference = InProcessRuntime(ycsb.app, partitions=parts)
    reference.load("account", initial)
    coord = EpochCoordinator(ycsb.app, LocalJobExchange(None, "charon.apps.ycsb:app", cfg), sequencers=1)
    fallback = 0
    for epoch, batch in enumerate(_batches(4, 60)):
        got = coord.run_epoch(epoch, [(0, r) for r in batch])
        want = reference.run_epoch(batch)
        assert_same_outcome(got, want)
        fallback += len(got.fast) + len(got.slow)
    state: dict[bytes, bytes] = {}
    for pid in range(parts):
        state.update(durable.load(pid, len(_batches(4, 60)) - 1)[0])
    assert dict(sorted(state.items())) == reference.snapshot()
    assert fallback > 20  # the fallback really ran (cached replays and locked re-runs)
