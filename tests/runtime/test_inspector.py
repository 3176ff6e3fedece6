"""The invocation inspector's store on the in-process engine: call graphs (also of transactions the fallback re-ran),
tracebacks, retention by count and by bytes, pending requests, the abort log line and its rate limit, and replies
that do not depend on whether the inspector observes."""

from __future__ import annotations

import asyncio
import logging
import os

import inspector_app
import pytest

from charon import serde
from charon.core.tracebacks import MAX_TRACEBACK_BYTES, format_traceback
from charon.messages import Request
from charon.runtime.contract import RequestQuery
from charon.runtime.control.inspector import AbortLog, InspectorSettings
from charon.runtime.node.inprocess import InProcessRuntime


def _rt(settings: InspectorSettings | None = None, partitions: int = 2) -> InProcessRuntime:
    rt = InProcessRuntime(inspector_app.app, partitions=partitions, warmup_txns=0, gc_tuning=False, inspector=settings)
    rt.load("account", {f"a{i}": 1000 for i in range(8)})
    return rt


def _transfer(rid: str, frm: str, to: str, amount: int) -> Request:
    return Request(rid, "bank", rid, "transfer", serde.encode([frm, to, amount]), 1.0)


def test_conflicting_transfers_keep_the_graph_of_the_run_that_counted() -> None:
    rt = _rt(partitions=4)
    reqs = [_transfer(f"t{i}", f"a{i % 3}", f"a{(i + 1) % 3}", 1) for i in range(60)]  # hot accounts: conflicts
    result = rt.run_epoch(reqs)
    assert result.fast or result.slow  # some ran again in the fallback
    for r in reqs:
        d = rt.inspector.detail(r.request_id)
        assert d is not None and d["status"] == "committed"
        frm, to, _ = serde.decode(r.args)
        graph = [(n["parent"], n["kind"], n["key"], n["function"]) for n in d["call_graph"]]  # type: ignore[union-attr]
        assert graph == [(None, "root", r.key, "transfer"), (0, "call", frm, "withdraw"), (0, "call", to, "deposit"),
                         (0, "send", to, "notify")]


def test_replies_are_the_same_with_the_inspector_off() -> None:
    def replies(enabled: bool) -> list[tuple[object, ...]]:
        rt = _rt(InspectorSettings(enabled=enabled), partitions=3)
        reqs = [_transfer(f"t{i}", f"a{i % 4}", f"a{(i * 3 + 1) % 8}", 400) for i in range(40)]
        res = rt.run_epoch(reqs)
        assert bool(rt.inspector.search(RequestQuery())["items"]) is enabled
        return [(r.request_id, r.tid, r.epoch, r.ok, r.value, r.error_type, r.error_message, r.position)
                for r in sorted(res.replies.values(), key=lambda r: r.tid)]

    on, off = replies(True), replies(False)
    assert on == off and any(not r[3] for r in on)  # some overdrew: aborts are part of what must not change


def test_retention_by_count() -> None:
    rt = _rt(InspectorSettings(max_records=5))
    rt.run_epoch([Request(f"d{i}", "account", f"k{i}", "deposit", serde.encode([i]), 1.0) for i in range(12)])
    page = rt.inspector.search(RequestQuery())
    assert [i["request_id"] for i in page["items"]] == [f"d{i}" for i in range(11, 6, -1)]  # type: ignore[index]
    assert rt.inspector.detail("d6") is None and rt.inspector.detail("d7") is not None
    assert page["retention"]["records"] == 5  # type: ignore[index]


def test_a_kept_request_is_found_by_its_tid_until_it_is_dropped() -> None:
    """``by_tid`` (a workflow's history names its steps' TIDs) answers the request's detail while it is kept, and
    None once the retention dropped it (the index is bounded with the records)."""
    rt = _rt(InspectorSettings(max_records=5))
    res = rt.run_epoch([Request(f"d{i}", "account", f"k{i}", "deposit", serde.encode([i]), 1.0) for i in range(8)])
    tids = {r.request_id: tid for tid, r in res.replies.items()}
    kept = rt.inspector.by_tid(tids["d7"])
    assert kept is not None and kept["request_id"] == "d7" and kept["call_graph"][0]["key"] == "k7"  # type: ignore[index]
    assert rt.inspector.by_tid(tids["d2"]) is None and rt.inspector.by_tid(-1) is None
    assert len(rt.inspector._tids) == 5


def test_retention_by_bytes() -> None:
    rt = _rt(InspectorSettings(max_bytes=10_000))
    big = "x" * 2000  # each reply carries ~2 KB
    reqs = [Request(f"n{i}", "bank", f"n{i}", "fail", serde.encode([big]), 1.0) for i in range(20)]
    rt.run_epoch(reqs)
    ret = rt.inspector.search(RequestQuery())["retention"]
    assert 0 < ret["bytes"] <= 10_000 and 1 <= ret["records"] < 5  # type: ignore[index]
    assert rt.inspector.detail("n19") is not None and rt.inspector.detail("n0") is None  # the oldest went first


def test_pending_requests_while_paused() -> None:
    async def main() -> None:
        rt = _rt()
        async with rt:
            rt.gate.pause()
            fut = rt.enqueue(Request("p1", "account", "a1", "deposit", serde.encode([1]), 5.0))
            page = rt.inspector.search(RequestQuery(status="pending"))
            assert [(i["request_id"], i["accepted_at"], i["epoch"]) for i in page["items"]] == [("p1", 5.0, None)]
            assert rt.inspector.detail("p1")["status"] == "pending"  # type: ignore[index]
            rt.gate.resume()
            await asyncio.wait_for(fut, 10)
            assert rt.inspector.detail("p1")["status"] == "committed"  # type: ignore[index]
            assert rt.inspector.search(RequestQuery(status="pending"))["items"] == []

    asyncio.run(main())


def test_an_abort_logs_one_warning_with_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    rt = _rt()
    rt.load("account", {"poor": 1})
    with caplog.at_level(logging.WARNING, logger="charon.requests"):
        rt.run_epoch([_transfer("over", "poor", "a1", 50), _transfer("fine", "a2", "a3", 5)])
    recs = [r for r in caplog.records if r.name == "charon.requests"]
    assert len(recs) == 1
    r = recs[0]
    assert r.levelno == logging.WARNING
    assert (r.request_id, r.operator, r.function, r.key, r.error_type) == (  # type: ignore[attr-defined]
        "over", "bank", "transfer", "over", "Overdrawn")
    assert "needs 50" in r.error_message  # type: ignore[attr-defined]
    assert "inspector_app.py\", line" in r.traceback and "in withdraw" in r.traceback  # type: ignore[attr-defined]
    assert "over" in r.getMessage() and "Overdrawn" in r.getMessage()


def test_aborts_are_logged_with_the_inspector_off(caplog: pytest.LogCaptureFixture) -> None:
    rt = _rt(InspectorSettings(enabled=False))
    assert not rt.coordinator.observe
    with caplog.at_level(logging.WARNING, logger="charon.requests"):
        rt.run_epoch([Request("b", "bank", "b", "fail", serde.encode(["no"]), 1.0)])
    [r] = [r for r in caplog.records if r.name == "charon.requests"]
    assert r.error_type == "ValueError" and r.traceback is None  # type: ignore[attr-defined]
    assert rt.inspector.detail("b") is None


def test_the_abort_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = AbortLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="charon.requests"):
        for i in range(25):
            log.abort(f"r{i}", "op", "fn", "k", "E", "m", None)
        assert len(caplog.records) == 10 and log.suppressed == 15
        now[0] += 0.15  # a token back
        log.abort("late", "op", "fn", "k", "E", "m", None)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[10].startswith("suppressed 15 aborts") and caplog.records[10].suppressed == 15  # type: ignore[attr-defined]
    assert "late" in msgs[11] and len(msgs) == 12 and log.suppressed == 0


def test_a_deep_traceback_is_bounded_and_keeps_where_it_was_raised() -> None:
    def ping(n: int) -> None:  # alternating frames: Python does not fold them as repeats
        if n == 0:
            raise RecursionError("bottom of the well")
        pong(n - 1)

    def pong(n: int) -> None:
        ping(n)

    try:
        ping(300)
    except RecursionError as exc:
        text = format_traceback(exc)
    assert len(text.encode()) <= MAX_TRACEBACK_BYTES
    assert "outer frame(s) left out" in text and text.endswith("RecursionError: bottom of the well\n")
    assert os.path.basename(__file__) in text and 'raise RecursionError("bottom of the well")' in text


def test_a_quarantine_verdict_shows_as_quarantined() -> None:
    from charon.core.epoch import Verdict

    rt = _rt()
    rt.coordinator.verdicts["q1"] = Verdict("Quarantined", "it killed its worker")  # as a probe records it
    rt.run_epoch([Request("q1", "account", "a1", "deposit", serde.encode([1]), 1.0),
                  Request("q2", "account", "a2", "deposit", serde.encode([1]), 1.0)])
    q = rt.inspector.search(RequestQuery(status="quarantined"))["items"]
    assert [(i["request_id"], i["error_type"]) for i in q] == [("q1", "Quarantined")]  # type: ignore[index]
    assert rt.inspector.detail("q2")["status"] == "committed"  # type: ignore[index]


_CRASHING_NODE = """
import asyncio, logging, os, sys
import inspector_app
logging.basicConfig()  # the application's logging setup: charon's loggers print nothing without one
from charon.runtime.node.inprocess import InProcessRuntime

async def main():
    rt = InProcessRuntime(inspector_app.app, partitions=2, warmup_txns=0, gc_tuning=False, data_dir=sys.argv[1],
                          checkpoint_s=3600)
    async with rt:
        reply = await rt.submit("bank", "t", "fail", ["before the crash"], request_id="f1")
        print("replied", reply.error_type, flush=True)
        os.environ["CHARON_CRASH_AT"] = "node:deltas:*"  # killed at its next checkpoint, after the reply was printed
        rt.node.flush()
        await asyncio.sleep(30)

asyncio.run(main())
"""


def test_a_replayed_abort_is_recorded_again_and_not_logged_again(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    import subprocess
    import sys

    data = tmp_path / "node"
    support = os.path.dirname(inspector_app.__file__)
    # SIGKILL before the first checkpoint is written: the restart replays the abort's epoch
    env = {**os.environ, "PYTHONPATH": support}
    out = subprocess.run([sys.executable, "-c", _CRASHING_NODE, str(data)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert "replied ValueError" in out.stdout and out.returncode == -9, out.stderr
    assert "request f1 aborted" in out.stderr  # logged once, when it ran
    with caplog.at_level(logging.WARNING, logger="charon.requests"):
        rt = InProcessRuntime(inspector_app.app, partitions=2, warmup_txns=0, gc_tuning=False, data_dir=str(data))
    try:
        assert rt.replayed_epochs >= 1
        d = rt.inspector.detail("f1")
        assert d is not None and d["status"] == "aborted" and "ROOT-RAISES" in d["error"]["traceback"]  # type: ignore[index]
        assert not [r for r in caplog.records if r.name == "charon.requests"]
        assert not rt.inspector.replaying
    finally:
        rt.close()


def test_the_graph_comes_back_from_a_rest_and_a_fallback_run_elsewhere() -> None:
    """As on Spark's one-task rest and fallback: the jobs and their outcomes cross a pickle, the observations too."""
    import pickle

    from charon.core.epoch import run_fallback, run_rest
    from charon.runtime.node.inprocess import LocalExchange

    taken = {"rest": 0, "fallback": 0}

    class Elsewhere(LocalExchange):
        def rest(self, job):  # type: ignore[no-untyped-def]
            taken["rest"] += 1
            out = run_rest(inspector_app.app, LocalExchange(self.units), pickle.loads(pickle.dumps(job)))
            return pickle.loads(pickle.dumps(out))

        def fallback(self, job):  # type: ignore[no-untyped-def]
            taken["fallback"] += 1
            out = run_fallback(inspector_app.app, LocalExchange(self.units), pickle.loads(pickle.dumps(job)))
            return pickle.loads(pickle.dumps(out))

    rt = _rt(partitions=4)
    rt.coordinator.exchange = Elsewhere(rt.units)
    reqs = [_transfer(f"e{i}", f"a{i % 3}", f"a{(i + 1) % 3}", 1) for i in range(40)]
    rt.run_epoch(reqs)
    assert taken["rest"] >= 1
    for r in reqs:
        d = rt.inspector.detail(r.request_id)
        assert d is not None and d["status"] == "committed"
        assert [n["function"] for n in d["call_graph"]] == ["transfer", "withdraw", "deposit", "notify"]  # type: ignore[union-attr,index]


def test_call_graph_alone_is_the_detail_s_and_none_when_not_kept() -> None:
    """``RequestLog.call_graph`` (what tracing reads per traced reply): the detail's graph, for the inspector's
    own store and for the contract's default built on ``detail``; None for an unknown request or with it off."""
    from charon.runtime.contract import RequestLog

    rt = _rt()
    rt.run_epoch([_transfer("g1", "a1", "a2", 5)])
    d = rt.inspector.detail("g1")
    assert d is not None and len(d["call_graph"]) == 4  # type: ignore[arg-type]
    assert rt.inspector.call_graph("g1") == d["call_graph"]
    assert RequestLog.call_graph(rt.inspector, "g1") == d["call_graph"]  # the contract's default
    assert rt.inspector.call_graph("nope") is None and RequestLog.call_graph(rt.inspector, "nope") is None
    off = _rt(InspectorSettings(enabled=False))
    off.run_epoch([_transfer("g2", "a1", "a2", 5)])
    assert off.inspector.call_graph("g2") is None


def test_a_chained_traceback_shows_its_causes_as_python_prints_them() -> None:
    def lookup() -> None:
        raise KeyError("acct-7")

    def convert() -> None:
        try:
            lookup()
        except KeyError as exc:
            raise LookupError("no such account") from exc

    def handle() -> None:
        try:
            convert()
        except LookupError:
            raise ValueError("transfer refused")  # noqa: B904 - raised while handling: the implicit context

    try:
        handle()
    except ValueError as exc:
        text = format_traceback(exc)
        hidden = format_traceback(ValueError("plain").with_traceback(exc.__traceback__))
        small = format_traceback(exc, limit=600)  # room for the last exception only: the chain is said to be cut
    order = ["KeyError: 'acct-7'\n", "\nThe above exception was the direct cause of the following exception:\n",
             "LookupError: no such account\n",
             "\nDuring handling of the above exception, another exception occurred:\n",
             "ValueError: transfer refused\n"]  # as Python prints the chain: the first cause first
    at = [text.find(part) for part in order]
    assert -1 not in at and at == sorted(at), text
    assert text.count("Traceback (most recent call last)") == 3 and 'raise KeyError("acct-7")' in text
    assert hidden.count("Traceback (most recent call last)") == 1  # no chain: one block
    assert len(small.encode()) <= 600 and small.endswith("ValueError: transfer refused\n")
    assert "KeyError" not in small and small.startswith("(earlier exceptions of the chain left out)")


def test_a_long_chain_is_cut_at_max_chain() -> None:
    from charon.core.tracebacks import MAX_CHAIN

    exc: BaseException = RuntimeError("0")
    for i in range(1, 12):
        try:
            raise RuntimeError(str(i)) from exc
        except RuntimeError as e:
            exc = e
    text = format_traceback(exc)
    assert text.count("Traceback (most recent call last)") == MAX_CHAIN
    assert text.startswith("(earlier exceptions of the chain left out)") and text.endswith("RuntimeError: 11\n")


def test_a_deferred_transaction_is_listed_as_deferred_until_it_commits() -> None:
    """A transaction the fallback moves to the next epoch (keeping its TID; ``fallback_app``'s write where the dry
    run only read) is listed as deferred between the two epochs, then as committed by the epoch that ran it."""
    from fallback_app import P, app, keys_at

    e, c = keys_at(0, 1)
    rt = InProcessRuntime(app, partitions=P, warmup_txns=0, gc_tuning=False)
    first = rt.run_epoch([Request("r0", "acct", e, "setall", serde.encode([5, c]), 1.0),
                          Request("r1", "acct", e, "write_if_big", serde.encode([c]), 2.0),
                          Request("r2", "acct", e, "getv", serde.encode([]), 3.0)])
    assert first.deferred == [2] and "r1" not in {r.request_id for r in first.replies.values()}
    listed = rt.inspector.search(RequestQuery(status="deferred"))["items"]
    assert [(i["request_id"], i["status"]) for i in listed] == [("r1", "deferred")]  # type: ignore[index]
    assert rt.inspector.detail("r1")["status"] == "deferred"  # type: ignore[index]
    assert rt.inspector.detail("r2")["status"] == "committed"  # type: ignore[index]
    second = rt.run_epoch([])
    (reply,) = second.replies.values()
    assert (reply.request_id, reply.ok, reply.tid, reply.epoch) == ("r1", True, 2, 1)  # its TID, the next epoch
    assert rt.inspector.detail("r1")["status"] == "committed"  # type: ignore[index]
    assert rt.inspector.detail("r1")["epoch"] == 1  # type: ignore[index]
    assert rt.inspector.search(RequestQuery(status="deferred"))["items"] == []
