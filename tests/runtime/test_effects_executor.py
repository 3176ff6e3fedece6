"""Durable effects, the executor (issue 23 item 2) on the durable in-process node, against a real external HTTP
service in its own process: at-least-once attempts with backoff (attempts counted vs applications), each key
applied once at the service, each continuation exactly once; per-attempt timeouts on a hung service; exhausted
attempts resuming with the failure; parked failures retried or abandoned by an operator; worker partitioning."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from charon import InProcessRuntime, serde
from charon.runtime.effects import EffectExecutor, EffectStore, effect_partition, engine_resume

TESTS = Path(__file__).resolve().parents[1] / "support"  # the test apps and the external service
sys.path.insert(0, str(TESTS))
from effects_app import app  # noqa: E402
from effects_service import Service  # noqa: E402


@pytest.fixture
def service(tmp_path, monkeypatch):
    svc = Service(str(tmp_path / "service.sqlite")).start()
    monkeypatch.setenv("CHARON_TEST_SERVICE_URL", svc.url)
    yield svc
    svc.kill()


def run(coro):
    return asyncio.run(coro)


async def _node(tmp_path):
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path / "node"))
    await rt.start()
    eng = rt.engine()
    return rt, eng


def _executor(eng, tmp_path, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.05)
    return EffectExecutor(eng.app, eng.streams, engine_resume(eng.submit),
                          str(tmp_path / "node" / "effects.sqlite"), **kw)


def test_flaky_service_each_key_applied_once_each_continuation_once(tmp_path, service) -> None:
    service.control(fail_rate=0.4)

    async def go():
        rt, eng = await _node(tmp_path)
        ex = _executor(eng, tmp_path, concurrency=4, max_inflight_bytes=300)  # a few requests' bytes in flight
        await ex.start()
        try:
            ids = [(await eng.submit("acct", f"a{i}", "pay", [10 + i])).value for i in range(30)]
            await ex.settle(60)
            states = {f"a{i}": eng.read_state("acct", f"a{i}") for i in range(30)}
            return ids, states, ex.metrics, ex.store.counts()
        finally:
            await ex.stop()
            await rt.stop()
            rt.close()

    ids, states, metrics, counts = run(go())
    stats = service.stats()
    keys = [serde.decode(v) for v in ids]
    assert sorted(stats["applied"]) == sorted(keys)  # every effect applied at the service, each key once
    assert all(stats["applied"][k]["amount"] == 10 + i for i, k in enumerate(keys))
    assert sum(stats["attempts"].values()) == metrics.attempts > 30  # retried: more attempts than applications
    assert metrics.failures == metrics.attempts - 30 and metrics.resumed == 30
    assert all(s["state"] == "paid" and s["result"]["ok"] and s["runs"] == 1 for s in states.values()), states
    assert counts["done"] == 30 and counts["pending"] == counts["resuming"] == counts["failed"] == 0


def test_continuations_run_once_even_when_resubmitted(tmp_path, service) -> None:
    """A crashed executor re-submits continuations it had submitted: the engine runs each id once."""

    async def go():
        rt, eng = await _node(tmp_path)
        ex = _executor(eng, tmp_path)
        await ex.start()
        try:
            for i in range(5):
                await eng.submit("acct", f"b{i}", "pay", [1])
            await ex.settle(30)
            await ex.stop()
            # as if the executor had died after each continuation and before recording it: resume them all again
            store = ex.store
            store._write("UPDATE effects SET status = 'resuming'")
            ex2 = _executor(eng, tmp_path)
            await ex2.start()
            await ex2.settle(30)
            await ex2.stop()
            return [eng.read_state("acct", f"b{i}") for i in range(5)], ex2.metrics.resumed
        finally:
            await rt.stop()
            rt.close()

    states, resumed = run(go())
    assert resumed == 5  # submitted again ...
    assert all(s["state"] == "paid" and s["runs"] == 1 for s in states)  # ... and run once
    assert len(service.stats()["applied"]) == 5


def test_hung_service_times_out_and_exhausted_attempts_resume_with_the_failure(tmp_path, service) -> None:
    service.control(hang_next=3, hang_s=5.0)

    async def go():
        rt, eng = await _node(tmp_path)
        ex = _executor(eng, tmp_path)
        await ex.start()
        try:
            await eng.submit("acct", "h", "pay", [5, 0.3, 3])  # 3 attempts of 0.3 s each, all hang
            await ex.settle(30)
            return eng.read_state("acct", "h"), ex.store.list()
        finally:
            await ex.stop()
            await rt.stop()
            rt.close()

    state, rows = run(go())
    assert state["state"] == "failed" and state["runs"] == 1
    assert state["result"] == {"ok": False, "error_type": "Timeout", "error": "Timeout", "attempts": 3}
    assert rows[0].attempts == 3 and rows[0].outcome == "failed" and rows[0].status == "done"
    stats = service.stats()
    assert list(stats["attempts"].values()) == [3] and stats["applied"] == {}


def test_parked_failures_are_retried_or_abandoned(tmp_path, service) -> None:
    service.control(fail_rate=1.0)

    async def go():
        rt, eng = await _node(tmp_path)
        ex = _executor(eng, tmp_path, park_failed=True)
        await ex.start()
        try:
            for k in ("p1", "p2"):
                await eng.submit("acct", k, "pay", [7, 1.0, 2])
            await ex.settle(30)
            parked = ex.store.list("failed")
            assert sorted(r.key for r in parked) == ["p1", "p2"]
            assert all(r.attempts == 2 and "503" in r.last_error for r in parked), parked
            assert eng.read_state("acct", "p1")["state"] == "charging"  # nobody resumed yet
            by_key = {r.key: r.id for r in parked}
            service.control(fail_rate=0.0)
            assert ex.store.retry(by_key["p1"]) and ex.store.abandon(by_key["p2"])
            assert not ex.store.retry(by_key["p1"])  # no longer parked
            await ex.settle(30)
            return eng.read_state("acct", "p1"), eng.read_state("acct", "p2"), ex.store.counts()
        finally:
            await ex.stop()
            await rt.stop()
            rt.close()

    p1, p2, counts = run(go())
    assert p1["state"] == "paid" and p1["runs"] == p2["runs"] == 1
    assert p2["state"] == "failed" and p2["result"]["error_type"] == "EffectAbandoned"
    assert counts["done"] == 2 and counts["failed"] == 0
    assert len(service.stats()["applied"]) == 1  # the abandoned one was never applied


def test_workers_split_effects_without_overlap(tmp_path, service) -> None:
    async def go():
        rt, eng = await _node(tmp_path)
        path = str(tmp_path / "node" / "effects.sqlite")
        exs = [EffectExecutor(eng.app, eng.streams, engine_resume(eng.submit), EffectStore(path), index=i,
                              workers=3, backoff_s=0.01) for i in range(3)]
        for ex in exs:
            await ex.start()
        try:
            ids = [(await eng.submit("acct", f"w{i}", "pay", [1])).value for i in range(24)]
            for _ in range(400):
                if all(ex.store.counts()["done"] == 24 for ex in exs):
                    break
                await asyncio.sleep(0.05)
            return ids, [ex.metrics.attempts for ex in exs]
        finally:
            for ex in exs:
                await ex.stop()
            await rt.stop()
            rt.close()

    ids, attempts = run(go())
    keys = [serde.decode(v) for v in ids]
    assert sum(attempts) == 24 and len(service.stats()["applied"]) == 24
    for i in range(3):
        assert attempts[i] == sum(effect_partition(k, 3) == i for k in keys)
    with pytest.raises(ValueError):
        EffectExecutor(app, None, None, str(tmp_path / "x.sqlite"), index=3, workers=3)  # type: ignore[arg-type]
    assert os.path.exists(tmp_path / "node" / "effects.sqlite")


def test_requests_dropped_by_the_stream_retention_are_counted(tmp_path) -> None:
    from charon.core.context import EFFECT_STREAM
    from charon.log.streams import StreamLog

    log = StreamLog(str(tmp_path / "streams.sqlite"), retain_events=2)
    doc = {"handler": "charge", "args": ["x", 1], "op": "acct", "key": "x", "then": "charged", "carry": [1],
           "timeout": 1.0, "attempts": 1}
    for epoch in range(5):
        log.append_atom(epoch, [(EFFECT_STREAM, serde.encode({**doc, "id": f"fx.fxtest.{epoch}.0.1"}))])

    async def resume(*args):
        return True, ""

    async def go():
        ex = EffectExecutor(app, log, resume, str(tmp_path / "effects.sqlite"))
        await ex.start()
        await ex.stop()
        ex.intake()
        return ex

    ex = run(go())
    assert ex.lost == 3 and "dropped by the stream's retention" in ex.errors[0]
    assert {r.id for r in ex.store.list()} == {"fx.fxtest.3.0.1", "fx.fxtest.4.0.1"}
    assert "charon_effect_requests_lost_total 3.0\n" in ex.prometheus()


def test_hung_sync_handlers_time_out_without_starving_the_executor(tmp_path, service) -> None:
    """Sync handlers blocked in a hung service: their attempts time out and are retried; the executor (its store
    work, the other effects) goes on."""
    service.control(hang_next=4, hang_s=3.0)

    async def go():
        rt, eng = await _node(tmp_path)
        ex = _executor(eng, tmp_path, concurrency=2)
        await ex.start()
        try:
            for k in ("s1", "s2"):
                await eng.submit("acct", k, "pay_sync", [3, 0.3, 10])
            await eng.submit("acct", "a1", "pay", [4])  # an async one beside them
            await ex.settle(60)
            return [eng.read_state("acct", k) for k in ("s1", "s2", "a1")], ex.metrics
        finally:
            await ex.stop()
            await rt.stop()
            rt.close()

    states, metrics = run(go())
    assert all(s["state"] == "paid" and s["runs"] == 1 for s in states), states
    assert metrics.failures >= 2 and metrics.attempts == metrics.failures + 3
    assert len(service.stats()["applied"]) == 3


def test_the_executor_runs_the_handlers_of_the_application_running_now(tmp_path, service) -> None:
    """``app`` as a callable (``lambda: engine.app``): after a code update the new code's handler runs."""
    from charon import Application

    v2 = Application("fxtest", list(app.operators.values()))

    @v2.effect_handler("charge")
    async def charge_v2(idempotency_key: str, who: str, amount: int) -> dict:
        return {"applied": -amount}

    current = [app]

    async def go():
        rt, eng = await _node(tmp_path)
        ex = EffectExecutor(lambda: current[0], eng.streams, engine_resume(eng.submit), backoff_s=0.01)
        await ex.start()
        try:
            await eng.submit("acct", "u1", "pay", [5])
            await ex.settle(30)
            current[0] = v2
            await eng.submit("acct", "u2", "pay", [6])
            await ex.settle(30)
            return eng.read_state("acct", "u1"), eng.read_state("acct", "u2")
        finally:
            await ex.stop()
            await rt.stop()
            rt.close()

    u1, u2 = run(go())
    assert u1["result"]["value"]["applied"] == 1 and u2["result"]["value"] == {"applied": -6}
    assert len(service.stats()["applied"]) == 1


def test_a_new_worker_count_resumes_where_the_slowest_reader_was(tmp_path) -> None:
    store = EffectStore(str(tmp_path / "effects.sqlite"))
    assert store.offset("0/1") == 0
    store.take("0/2", [], 7)
    store.take("1/2", [], 5)
    assert store.offset("0/3") == 5 and store.offset("0/2") == 7
    store.take("0/3", [], 9)
    assert store.offset("1/3") == 5  # workers of one count start together: not where a sibling got to
    fresh = EffectStore(str(tmp_path / "fresh.sqlite"))
    fresh.take("1/2", [], 40)
    assert fresh.offset("0/2") == 0
