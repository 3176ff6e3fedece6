"""Client atomic batches (S-Store; issue 12 item 5): a batch is one transaction whose root calls each
invocation in order, so all commit or none; the batch id is idempotent like a request id."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from charon import Application, InProcessRuntime, Operator, Request, serde
from charon.client import Call, Client
from charon.errors import BadArguments, IdempotencyConflict, InvalidKey, TransactionAborted, UnknownFunction
from charon.operator import BATCH_OPERATOR, batch_request
from charon.server.serve import BackgroundServer
from charon.testing import check_epoch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from streams_app import app as ledger  # noqa: E402

ACCTS = [f"a{i}" for i in range(5)]
TOKEN = "batch-token"


def _batch(rng: random.Random, bid: str) -> Request:
    calls = []
    for j in range(rng.randint(1, 5)):
        src, dst = rng.sample(ACCTS, 2)
        calls.append(["acct", src, "transfer", [dst, rng.randint(1, 40), f"{bid}.{j}"]])
    op, fn, args = batch_request(calls)
    return Request(bid, op, bid, fn, serde.encode(args), 0.0)


@pytest.mark.parametrize("seed", range(40))
def test_batches_are_all_or_nothing_under_random_aborts(seed: int) -> None:
    """Random batches of transfers, many containing one that aborts on a low balance, mixed with single
    transfers: every epoch equals the serial execution (oracle), and each batch's events are all in the
    stream (it committed) or none (it aborted); money is conserved."""
    rng = random.Random(seed)
    rt = InProcessRuntime(ledger, partitions=rng.choice([1, 2, 4]))
    rt.load("acct", {a: 40 for a in ACCTS})
    outcome: dict[str, bool] = {}
    sizes: dict[str, int] = {}
    n = 0
    for _ in range(4):
        reqs = []
        for _ in range(rng.randint(1, 6)):
            n += 1
            req = _batch(rng, f"b{n}")
            sizes[req.request_id] = len(serde.decode(req.args)[0])
            reqs.append(req)
        before = rt.snapshot()
        res = rt.run_epoch(reqs)
        check_epoch(ledger, before, rt.snapshot(), res)
        for rep in res.replies.values():
            outcome[rep.request_id] = rep.ok
            if rep.ok:
                assert len(serde.decode(rep.value)) == sizes[rep.request_id]
    while rt.coordinator.deferred:
        for rep in rt.run_epoch([]).replies.values():
            outcome[rep.request_id] = rep.ok
    assert len(outcome) == n and any(outcome.values()) and not all(outcome.values())
    credits: dict[str, int] = {}
    for ev in rt.streams.read("credits", 0, 10_000).events:
        bid = serde.decode(ev.value)[0].split(".")[0]
        credits[bid] = credits.get(bid, 0) + 1
    for bid, ok in outcome.items():
        assert credits.get(bid, 0) == (sizes[bid] if ok else 0), bid
    assert sum(rt.entities("acct").values()) == 40 * len(ACCTS)


def test_batch_operator_name_is_reserved() -> None:
    with pytest.raises(ValueError, match="reserved"):
        Application("x", [Operator(BATCH_OPERATOR)])
    with pytest.raises(BadArguments):
        batch_request([["acct", "a0", "transfer"]])
    with pytest.raises(BadArguments):
        batch_request([])


@pytest.fixture()
def server() -> Any:
    runtime = InProcessRuntime(ledger, partitions=2)
    runtime.load("acct", {"a": 100, "b": 0})
    with BackgroundServer(runtime, token=TOKEN) as srv:
        yield srv
    runtime.close()


def test_batches_over_http(server: BackgroundServer) -> None:
    with Client(server.url, token=TOKEN) as c:
        calls = [Call("acct", "a", "transfer", ("b", 30, "x1")), ["acct", "b", "transfer", ["a", 5, "x2"]]]
        assert c.invoke_batch(calls, batch_id="batch-1") == [70, 25]
        assert c.invoke_batch(calls, batch_id="batch-1") == [70, 25]  # a retry gets the first reply
        assert c.state("acct", "a") == 75 and c.state("acct", "b") == 25  # ran once
        with pytest.raises(IdempotencyConflict):
            c.invoke_batch(calls[:1], batch_id="batch-1")
        with pytest.raises(IdempotencyConflict):  # a batch id is a request id
            c.invoke("acct", "a", "transfer", "b", 1, "y", request_id="batch-1")
        with pytest.raises(TransactionAborted):  # the second call aborts: the first is not applied either
            c.invoke_batch([["acct", "a", "transfer", ["b", 10, "z1"]], ["acct", "b", "transfer", ["a", 999, "z2"]]])
        assert c.state("acct", "a") == 75 and c.state("acct", "b") == 25
        tags = [e.value["tag"] for e in c.read_stream("payments", 0).events]
        assert tags == ["x1", "x2"]  # the aborted batch emitted nothing
        with pytest.raises(UnknownFunction, match="batch call 1"):
            c.invoke_batch([["acct", "a", "credit", [1, "t"]], ["acct", "a", "nope", []]])
        with pytest.raises(BadArguments, match="batch call 0"):
            c.invoke_batch([["acct", "a", "credit", ["one", "t"]]])
        with pytest.raises(InvalidKey):
            c.invoke_batch([["acct", "", "credit", [1, "t"]]])
        with pytest.raises(BadArguments):
            c.invoke_batch([])
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        r = http.post("/batch", json={"calls": [["acct", "a"]]})
        assert r.status_code == 422 and r.json()["error"]["type"] == "BadArguments"
        r = http.post("/batch", json={"calls": [["acct", "a", "credit", [1, "t"]]] * 1001})
        assert r.status_code == 422
        r = http.post("/batch", json={"args": []})
        assert r.status_code == 400
        assert http.post("/batch", json={"calls": []}, headers={"Authorization": "Bearer no"}).status_code == 401
