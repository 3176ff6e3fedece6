"""A split rest (the rest of an epoch as several tasks over groups of partitions, rounds exchanged through the
driver's hub) gives the one-task rest's replies and state: first with its tasks as threads here (real pickling,
the real hub; no Spark), then on real PySpark ``local[2]`` in barrier mode."""

from __future__ import annotations

import math
import os
import random
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charon import InProcessRuntime, Request, serde
from charon.apps import ycsb
from charon.config import SparkConfig
from charon.core.epoch import EpochCoordinator
from charon.core.routing import partition_of, split_store_key
from charon.runtime.spark.exchange import SparkExchange
from charon.state.durable import DurableState

PARTS = 4


class ThreadedExchange(SparkExchange):
    """The Spark exchange with its jobs run here: a gang's tasks in threads at once, as barrier mode starts them."""

    def run_job(self, payloads):  # noqa: ANN001, ANN201
        self.tasks_seen.append(1)
        return list(self.fn(payloads))

    def run_gang(self, payloads):  # noqa: ANN001, ANN201
        self.tasks_seen.append(len(payloads))
        results: list = [None] * len(payloads)
        errors: list = []

        def task(i: int) -> None:
            try:
                results[i] = list(self.fn([payloads[i]]))[0]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=task, args=(i,)) for i in range(len(payloads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise errors[0]
        return results


def _requests(n: int, seed: int, accounts: int) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    return [(0, Request(f"r{seed}-{i}", "account", ycsb.key(rng.randrange(accounts)), "transfer",
                        serde.encode([ycsb.key(rng.randrange(accounts)), rng.choice([1, 7, 2_000_000])])))
            for i in range(n)]


def _load(cfg: SparkConfig, accounts: int) -> dict[bytes, bytes]:
    ref = InProcessRuntime(ycsb.app, partitions=PARTS)
    ref.load("account", ycsb.initial_state(accounts, balance=1_000))
    before = ref.snapshot()
    by_pid: dict[int, list] = {}
    for k, v in before.items():
        op, key, _ = split_store_key(k)
        by_pid.setdefault(partition_of(op, key, PARTS), []).append((k, v))
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(PARTS):
        durable.write_base(pid, -1, sorted(by_pid.get(pid, [])))
    return before


def _run(tmp, slots: int, chunk: int | None, epochs: int, size: int, accounts: int, **settings):
    cfg = SparkConfig(data_dir=str(tmp), partitions=PARTS, local_dir=str(tmp / "local"), master="local[2]",
                      gc_threshold=0, **settings)
    _load(cfg, accounts)
    ex = ThreadedExchange(None, "charon.apps.ycsb:app", cfg)
    ex.slots = slots
    ex.tasks_seen = []
    ex.retries = 0
    coord = EpochCoordinator(ycsb.app, ex, sequencers=1, chunk=chunk)
    coord.next_due = math.inf
    prior = None
    replies = {}
    outcomes = []
    for e in range(epochs):  # every finalize but the last rides in the next epoch's rest
        res = coord.run_epoch(e, _requests(size, e + 1, accounts), prior=prior, defer=e < epochs - 1)
        prior = res if res.finalize is not None else None
        replies.update({r.request_id: (r.ok, r.value, r.error_type, r.position) for r in res.replies.values()})
        outcomes.append((sorted(res.lockfree), sorted(res.fast), sorted(res.slow), sorted(res.deferred)))
    state: dict[bytes, bytes] = {}
    for pid in range(PARTS):
        state.update(DurableState(os.path.join(cfg.checkpoint_dir, "state")).load(pid, epochs - 1)[0])
    return ex, replies, outcomes, dict(sorted(state.items()))


@pytest.mark.parametrize(("slots", "chunk", "accounts"), [(2, None, 300), (3, 0, 300), (4, None, 40), (2, 0, 40)])
def test_a_split_rest_equals_one_task(tmp_path, slots: int, chunk: int | None, accounts: int) -> None:
    """Contended transfers (the fallback runs, some abort) over several epochs with deferred finalizes: the split
    rest (2..4 tasks) replies and writes exactly what the one-task rest does."""
    one, r1, o1, s1 = _run(tmp_path / "one", 1, chunk, 3, 400, accounts, split_rest="off")
    split, r2, o2, s2 = _run(tmp_path / "split", slots, chunk, 3, 400, accounts, split_rest="on",
                             split_rest_min_bytes=1)
    assert set(one.tasks_seen) == {1}
    assert max(split.tasks_seen) == min(slots, PARTS)
    assert split.stats["split_rests"] >= 3 and split.stats["hub_rounds"] > 0
    assert sum(len(o[1]) + len(o[2]) for o in o1) > 10  # the fallback really ran
    assert r2 == r1
    assert o2 == o1
    assert s2 == s1


def test_split_rest_groups_cover_every_partition_once() -> None:
    for parts in range(1, 9):
        for tasks in range(1, parts + 1):
            groups = SparkExchange.groups(parts, tasks)
            assert [p for g in groups for p in g] == list(range(parts))
            assert all(groups)


def test_the_split_threshold(tmp_path) -> None:
    """One task per split_rest_min_bytes, at most one per core, per partition and split_rest_tasks."""
    ex = SparkExchange(None, "charon.apps.ycsb:app", SparkConfig(data_dir=str(tmp_path), partitions=PARTS,
                                                                 split_rest="on"))
    ex.slots = 2
    mb = ex.config.split_rest_min_bytes
    assert [ex.rest_tasks_for(s) for s in (0, mb - 1, 2 * mb - 1, 2 * mb, 100 * mb)] == [1, 1, 1, 2, 2]
    ex.slots = 8
    assert ex.rest_tasks_for(100 * mb) == PARTS
    ex.config.split_rest_tasks = 3
    assert ex.rest_tasks_for(100 * mb) == 3
    ex.split_rest = False
    assert ex.rest_tasks_for(100 * mb) == 1


def test_split_rest_by_mode(tmp_path) -> None:
    """The default: off; "cluster" on a cluster only; "on" in local mode too; anything else refused."""
    def on(master: str, **kw) -> bool:
        cfg = SparkConfig(data_dir=str(tmp_path), partitions=PARTS, master=master, **kw)
        return SparkExchange(None, "charon.apps.ycsb:app", cfg).split_rest

    assert [on("local[2]"), on("spark://h:7077"), on("yarn")] == [False, False, False]
    assert [on("local[2]", split_rest="cluster"), on("spark://h:7077", split_rest="cluster")] == [False, True]
    assert [on("local[2]", split_rest="on"), on("spark://h:7077", split_rest="off")] == [True, False]
    with pytest.raises(ValueError, match="split_rest"):
        on("local[2]", split_rest="yes")


def _spark_run(spark, tmp, reqs, **settings):
    from charon.runtime.spark.runtime import SparkRuntime

    cfg = SparkConfig(master="local[2]", data_dir=str(tmp), partitions=PARTS, max_batch=1_000, compact_every=3,
                      truncate_log=False, **settings)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    rt.load("account", ycsb.initial_state(2_000, balance=500))
    initial = rt.snapshot()
    rt.input_log.append_many(reqs)  # all before the start: the same epochs (max_batch each) in every run
    rt.start()
    try:
        rt.wait_idle(900)
    finally:
        rt.stop()
    return rt, initial


@pytest.mark.spark
def test_split_rest_on_pyspark_equals_one_task_and_in_process(spark, tmp_path) -> None:
    """On PySpark local[2] (barrier mode, the driver's hub): the split rest's replies and state equal the one-task
    rest's on the same input, and the in-process runtime's replay of its epochs. The split rest is the job-per-round
    exchange's (the resident exchange refuses it); the other run is on the default, resident exchange: the same
    epochs, the same replies."""
    from charon.testing import replay_in_process

    reqs = [Request(f"s{i}", op, k, f, serde.encode(a))
            for i, (op, k, f, a) in enumerate(ycsb.workload(2_000, 5_000, zipf=0.99, seed=3, max_amount=400))]
    with pytest.raises(ValueError, match="split_rest='on' needs exchange='jobs'"):
        _spark_run(spark, tmp_path / "refused", reqs, split_rest="on")
    split, initial = _spark_run(spark, tmp_path / "split", reqs, split_rest="on", split_rest_min_bytes=1,
                                exchange="jobs")
    one, _ = _spark_run(spark, tmp_path / "one", reqs, split_rest="off")
    assert one.config.exchange == "resident"
    assert sum(s.get("spark_split_rests", 0) > 0 for s in split.epoch_stats) >= 3, "split rests ran"
    assert not any(s.get("spark_split_rests", 0) for s in one.epoch_stats)
    key = lambda r: r.request_id  # noqa: E731
    got, want = sorted(split.replies(), key=key), sorted(one.replies(), key=key)
    assert len(got) == len(reqs)
    assert any(not r.ok for r in got), "some transfers aborted"
    state = split.snapshot()
    assert state == one.snapshot()
    ip, results = replay_in_process(ycsb.app, split, initial)
    assert ip.snapshot() == state
    by_id = {r.request_id: r for res in results for r in res.replies.values()}
    assert all(by_id[r.request_id] == r for r in got)
    assert [s.get("size") for s in split.epoch_stats] == [s.get("size") for s in one.epoch_stats]
    assert got == want  # the same epochs: the very same replies (TIDs, positions, values)


def _differential_module():
    """tests/core/test_engine_differential.py's generated transactions (review3_app: calls, sends, concurrent
    branches, errors of every kind, items) and its request builder."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "core" / "test_engine_differential.py"
    spec = importlib.util.spec_from_file_location("_split_differential", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_DIFF = _differential_module()


@settings(max_examples=max(_DIFF.EXAMPLES // 5, 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(epochs=st.lists(st.lists(_DIFF.transactions(), min_size=1, max_size=15), min_size=1, max_size=3),
       parts=st.sampled_from([2, 3]), tasks=st.sampled_from([2, 3]), live=st.booleans(),
       chunk=st.sampled_from(_DIFF.CHUNKS))
def test_split_rest_equals_inprocess(epochs, parts, tasks, live, chunk, monkeypatch, tmp_path_factory) -> None:
    """Generated transactions through split rests (every rest split, its tasks in threads, finalizes deferred into
    the next epoch's rest): the in-process runtime's replies, commit paths and state."""
    from epochcmp import assert_same_outcome
    from review3_app import app

    from charon.core import partition

    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    tmp = str(tmp_path_factory.mktemp("split"))
    cfg = SparkConfig(data_dir=tmp, partitions=parts, local_dir=os.path.join(tmp, "local"), master="local[3]",
                      split_rest="on", split_rest_min_bytes=1)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(parts):
        durable.write_base(pid, -1, [])
    ex = ThreadedExchange(None, "review3_app:app", cfg)
    ex.slots = tasks
    ex.tasks_seen = []
    coord = EpochCoordinator(app, ex, sequencers=1)
    coord.next_due = math.inf
    reference = InProcessRuntime(app, partitions=parts)
    if chunk is not None:
        coord.chunk = reference.coordinator.chunk = chunk
    n = 0
    prior = None
    batches = epochs + [[]] * 2
    for epoch, batch in enumerate(batches):
        reqs = _DIFF._requests(batch, n)
        n += len(batch)
        got = coord.run_epoch(epoch, [(0, r) for r in reqs], prior=prior, defer=epoch < len(batches) - 1)
        prior = got if got.finalize is not None else None
        assert_same_outcome(got, reference.run_epoch(reqs))
    assert max(ex.tasks_seen) == min(tasks, parts)
    state: dict[bytes, bytes] = {}
    for pid in range(parts):
        state.update(durable.load(pid, len(batches) - 1)[0])
    assert dict(sorted(state.items())) == reference.snapshot()


class RetryingExchange(ThreadedExchange):
    """A gang that fails is run again whole with the same payloads, as Spark retries a barrier stage."""

    def run_gang(self, payloads):  # noqa: ANN001, ANN201
        try:
            return super().run_gang(payloads)
        except ConnectionError:
            self.retries += 1
            return super().run_gang(payloads)


def test_a_gang_that_loses_a_task_is_retried_whole_with_the_same_outcome(tmp_path, monkeypatch) -> None:
    """A task of a split rest dies after the previous epoch's finalize ran in it (its partitions' deltas written):
    the first task's link to it breaks, the gang fails and runs again whole under the same token (the tasks meet
    again at the hub); replies and state equal the one-task rest's."""
    from charon.runtime.spark import tasks

    follow = tasks._follow
    calls = {"n": 0}

    def flaky(units, links, stats):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 2:  # the second epoch (its rest carries the first one's finalize)
            raise ConnectionError("the task's worker died")
        return follow(units, links, stats)

    one, r1, o1, s1 = _run(tmp_path / "one", 1, None, 3, 400, 300, split_rest="off")
    monkeypatch.setattr(tasks, "_follow", flaky)
    cfg_kw = {"split_rest": "on", "split_rest_min_bytes": 1}
    monkeypatch.setattr(sys.modules[__name__], "ThreadedExchange", RetryingExchange)
    split, r2, o2, s2 = _run(tmp_path / "split", 2, None, 3, 400, 300, **cfg_kw)
    assert split.retries == 1
    assert (r2, o2, s2) == (r1, o1, s1)
