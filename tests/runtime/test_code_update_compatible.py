"""Compatible code updates (issue 11 item 4, in-process): transactions sequenced from the boundary epoch run
the new code while the ones deferred before it finish on the version they started with; each reply's
``code_version`` says which, and no transaction mixes versions."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time

import code_versions
import httpx
import pytest

from charon import InProcessRuntime, Request, serde
from charon.client import Client
from charon.config import GatewayConfig
from charon.errors import CharonError
from charon.server.serve import BackgroundServer

TOKEN = "c0mpat"
KEYS = [f"a{i}" for i in range(6)]
CFG = GatewayConfig(code_refs="code_versions:c2,code_versions:c1")


def _batch(rng: random.Random, tag: str, n: int) -> list[Request]:
    out = []
    for i in range(n):
        k = rng.choice(KEYS)
        if rng.random() < 0.6:
            fn, args = "route", ["a"]
        else:
            fn, args = "transfer", [rng.choice(KEYS), rng.randint(1, 5)]
        out.append(Request(f"{tag}-{i}", "acct", k, fn, serde.encode(args), float(i)))
    return out


def _deferring_runtime(**kw) -> tuple[InProcessRuntime, list[Request]]:
    """A runtime holding transactions deferred by a contended epoch (the seed is searched, not assumed)."""
    for seed in range(50):
        rt = InProcessRuntime(code_versions.c1, partitions=4, **kw)
        rt.load("acct", {k: 100 for k in KEYS})
        reqs = _batch(random.Random(seed), "old", 40)
        rt.run_epoch(reqs)
        if rt.coordinator.deferred:
            return rt, reqs
        rt.close()
        if "data_dir" in kw:
            shutil.rmtree(kw["data_dir"])
    pytest.fail("no contended epoch defers a transaction any more: change the workload")


def test_deferred_transactions_finish_on_the_old_code() -> None:
    rt, old = _deferring_runtime()
    try:
        deferred = {tid for tid, _ in rt.coordinator.deferred}
        out = asyncio.run(rt.update_code("code_versions:c2", "c2", mode="compatible"))
        e = out["from_epoch"]
        assert out["mode"] == "compatible" and out["kept_deferred"] == len(deferred)
        assert rt.coordinator.previous is not None, "the old code is kept for the deferred transactions"
        new = _batch(random.Random(7), "new", 40)
        rt.run_epoch(new)
        rt.drain()
        assert rt.coordinator.previous is None and all(u.previous is None for u in rt.units), "old code dropped"
        finished_late = 0
        for r in old + new:
            rep = rt.get_reply(r.request_id)
            assert rep is not None
            label = rt.version_at(rep.epoch, rep.tid)
            if rep.tid in deferred:
                assert rep.epoch >= e
                finished_late += 1
            if rep.ok:
                value = serde.decode(rep.value)
                assert value == [label, label], f"{r.request_id} ran {value}, reported {label}"
            assert label == ("c1" if r in old else "c2"), r.request_id
        assert finished_late == len(deferred)
    finally:
        rt.close()


def test_a_second_update_first_finishes_the_oldest_code() -> None:
    """Two compatible updates in a row: the transactions still deferred on c1 finish (on c1) before the second
    boundary, so at most two versions run side by side."""
    rt, old = _deferring_runtime()
    try:
        deferred = {tid for tid, _ in rt.coordinator.deferred}
        first = asyncio.run(rt.update_code("code_versions:c2", "c2", mode="compatible"))
        second = asyncio.run(rt.update_code("code_versions:c1", "c1-again", mode="compatible"))
        assert deferred and second["from_epoch"] > first["from_epoch"]
        for r in old:
            rep = rt.get_reply(r.request_id)
            assert rep is not None and rep.epoch < second["from_epoch"], "finished before the second boundary"
            assert rt.version_at(rep.epoch, rep.tid) == "c1"
            if rep.ok:
                assert serde.decode(rep.value) == ["c1", "c1"]
        assert rt.version_at(second["from_epoch"]) == "c1-again"
    finally:
        rt.close()


def test_a_restart_keeps_the_old_code_for_the_deferred(tmp_path) -> None:
    """Durable: the update is recorded with its first TID; after a restart the new code runs new
    transactions and the transactions still deferred from before the boundary finish on the old one."""
    data = str(tmp_path / "node")
    rt, old = _deferring_runtime(data_dir=data, fsync=False)
    deferred = {tid for tid, _ in rt.coordinator.deferred}
    out = asyncio.run(rt.update_code("code_versions:c2", "c2", mode="compatible"))
    assert out["kept_deferred"] == len(deferred) > 0
    rt.close()
    rt = InProcessRuntime(code_versions.c1, partitions=4, data_dir=data, fsync=False)  # the old ref at start
    try:
        assert rt.app is code_versions.c2 and {t for t, _ in rt.coordinator.deferred} == deferred
        assert rt.coordinator.previous is not None and rt.coordinator.previous[1] is code_versions.c1
        new = _batch(random.Random(3), "after", 10)
        rt.run_epoch(new)
        rt.drain()
        assert rt.coordinator.previous is None
        for r in old + new:
            rep = rt.get_reply(r.request_id)
            assert rep is not None
            want = "c1" if r in old else "c2"
            assert rt.version_at(rep.epoch, rep.tid) == want
            if rep.ok:
                assert serde.decode(rep.value) == [want, want], r.request_id
    finally:
        rt.close()


def test_compatible_update_under_load_through_the_gateway() -> None:
    """Clients keep submitting contended transactions while compatible updates alternate c1 -> c2 -> c1 ...
    until one boundary held deferred transactions; every reply names the code it ran, those deferred at a
    boundary finished on the old code."""
    rt, _ = _deferring_runtime(epoch_max_ms=20.0)  # holds transactions deferred by a contended epoch
    auth = {"Authorization": f"Bearer {TOKEN}"}
    rids: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    with BackgroundServer(rt, token=TOKEN, config=CFG) as srv, Client(srv.url, token=TOKEN) as c:
        def drive(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():  # the lock-queue fallback resolves route-only epochs without deferring
                    if rng.random() < 0.6:
                        rids.append(c.submit("acct", rng.choice(KEYS), "route", "a"))
                    else:
                        rids.append(c.submit("acct", rng.choice(KEYS), "transfer", rng.choice(KEYS), rng.randint(1, 5)))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        # the boundary holds the deferred transactions (the lock-queue fallback rarely defers under the gateway's
        # light load, so the contended epoch is made first); clients keep submitting across it
        updates = [c.update_code("code_versions:c2", "c2", mode="compatible")]
        threads = [threading.Thread(target=drive, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            for n in range(1, 60):
                if updates[-1]["kept_deferred"]:
                    break
                label = ("c2", "c1")[n % 2]
                updates.append(c.update_code(f"code_versions:{label}", label, mode="compatible"))
                time.sleep(0.05)
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        kept = [u for u in updates if u["kept_deferred"]]
        if not kept:  # the deferred-on-old-code rule itself is pinned deterministically by the tests above
            pytest.skip("no boundary held a deferred transaction in this run (the lock-queue fallback rarely "
                        "defers under the gateway's load)")
        replies = []
        with httpx.Client(base_url=srv.url, headers=auth, timeout=30) as h:
            for rid in rids:
                r = h.get(f"/requests/{rid}", params={"wait": 10})
                assert r.status_code == 200, r.text
                replies.append(r.json())
        assert all(d["value"] == [d["code_version"]] * 2 for d in replies), "each reply names the code it ran"
        u = updates[-1]
        assert u is kept[-1], "the last update held deferred transactions"
        e, new, old = u["from_epoch"], u["version"], "c1" if u["version"] == "c2" else "c2"
        after = [d for d in replies if d["epoch"] >= e]
        assert any(d["code_version"] == old for d in after), "a deferred transaction finished on the old code"
        assert any(d["code_version"] == new for d in after)
        assert c.status()["code_version"] == updates[-1]["version"]
        # typed errors: a bad mode, a migration with a compatible update
        for body in [{"ref": "code_versions:c2", "version": "x", "mode": "lazy"},
                     {"ref": "code_versions:c2", "version": "x", "mode": "compatible",
                      "migration": {"operator": "acct", "function": "deposit", "args": [1]}}]:
            assert httpx.post(f"{srv.url}/admin/code", json=body, headers=auth).status_code == 400, body
        with pytest.raises(CharonError):
            c.update_code("code_versions:c2", "c3", mode="eventual")
        # the CLI
        from typer.testing import CliRunner

        from charon.cli import app as cli

        res = CliRunner().invoke(cli, ["deploy", "code_versions:c1", "c1b", "--compatible", "--url", srv.url,
                                       "--token", TOKEN])
        assert res.exit_code == 0, res.output
        assert '"mode":"compatible"' in res.output and c.status()["code_version"] == "c1b"
        res = CliRunner().invoke(cli, ["deploy", "code_versions:c1", "c1c", "--compatible", "--migrate", "acct",
                                       "deposit", "[1]", "--url", srv.url, "--token", TOKEN])
        assert res.exit_code != 0 and c.status()["code_version"] == "c1b"
