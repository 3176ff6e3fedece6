"""The durable node with its checkpoints on object storage (``storage_url`` / ``charon run --storage``): a node on
an empty data directory with the same location and NATS log resumes where the lost one stopped."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from natsfix import NatsServer
from node_app import app as ledger

from charon import serde
from charon.core.epoch import Verdict
from charon.messages import Request
from charon.runtime.guard.verdicts import letter
from charon.runtime.node.inprocess import InProcessRuntime
from charon.runtime.node.storage import NodeError
from charon.storage.contract import StorageConflict
from tests.support.seaweedfix import SeaweedS3

ACCOUNTS = [f"a{i}" for i in range(8)]


@pytest.fixture
def nats_url(tmp_path: Path):
    srv = NatsServer(tmp_path / "nats").start()
    yield f"{srv.url}/n{uuid.uuid4().hex[:8]}"
    srv.kill()


@pytest.fixture(params=["file", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}"
    server: SeaweedS3 = request.getfixturevalue("s3_env")
    return server.url(f"node-{uuid.uuid4().hex[:8]}")


def _pay(e: int) -> list[Request]:
    return [Request(f"r{e}-{i}", "acct", ACCOUNTS[(e + i) % 8], "pay",
                    serde.encode([ACCOUNTS[(e + i + 3) % 8], f"t{e}-{i}"]), 1.0) for i in range(3)]


def _quarantine(rt: InProcessRuntime, rid: str, epoch: int) -> Request:
    """A payment with a verdict recorded before its epoch runs (what the quarantine does to a transaction that
    killed the engine): it is refused, never run, live and on every replay."""
    rt.verdict_book.record(letter(rid, "acct", "pay", "a1", Verdict("Quarantined", "killed the engine", False), epoch))
    return Request(rid, "acct", "a1", "pay", serde.encode(["a5", f"t-{rid}"]), 1.0)


def test_a_node_on_an_empty_directory_resumes_from_object_storage(tmp_path: Path, nats_url: str,
                                                                  storage: str) -> None:
    rt = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path / "m1"), compact_every=3, log_url=nats_url,
                          storage_url=storage)
    rt.load("acct", {a: 0 for a in ACCOUNTS})
    for e in range(7):
        rt.run_epoch([*_pay(e), _quarantine(rt, "q-early", e)] if e == 2 else _pay(e))
        rt.node.flush()
    for e in range(7, 10):  # logged and run, never checkpointed: the new node replays them from the log
        rt.run_epoch([*_pay(e), _quarantine(rt, "q-late", e)] if e == 8 else _pay(e))
    before, epoch = rt.snapshot(), rt.epoch
    replies = {rid: rt.get_reply(rid) for rid in ("q-early", "q-late", "r8-0")}
    assert replies["q-late"].error_type == "Quarantined" and replies["r8-0"].ok
    assert rt.node.checkpointed_epoch < epoch - 1
    rt.node.input_log.close()  # the machine is lost: nothing more is written, its directory is gone
    rt.node.output_log.close()
    shutil.rmtree(tmp_path / "m1")
    again = InProcessRuntime(ledger, data_dir=str(tmp_path / "m2"), log_url=nats_url, storage_url=storage)
    try:
        assert again.partitions == 2  # the layout came from object storage
        assert again.replayed_epochs == 3
        # the verdicts came back before the replay: the refused payment stays refused (its tag never counted)
        assert sorted(again.verdict_book.verdicts) == ["q-early", "q-late"]
        assert (again.snapshot(), again.epoch) == (before, epoch)
        assert {rid: again.get_reply(rid) for rid in replies} == replies  # replies unchanged by the replay
        assert not any("t-q-" in str(k) for k in before)  # money conserved: the refused payment moved nothing
        again.run_epoch(_pay(10))
        again.node.flush()
    finally:
        again.close()


def test_a_stale_node_is_fenced(tmp_path: Path, nats_url: str, storage: str) -> None:
    old = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path / "old"), log_url=nats_url,
                           storage_url=storage)
    old.load("acct", {a: 0 for a in ACCOUNTS})
    old.run_epoch(_pay(0))
    old.node.flush()
    old.run_epoch(_pay(1))  # logged and run; the old node stalls before its checkpoint
    new = InProcessRuntime(ledger, data_dir=str(tmp_path / "new"), log_url=nats_url, storage_url=storage)
    try:
        assert new.replayed_epochs == 1
        new.run_epoch([*_pay(2), _quarantine(new, "q-new", 2)])
        new.node.flush()
        with pytest.raises(StorageConflict):  # its checkpoint would overwrite the new node's: refused
            old.node.flush()
        with pytest.raises(StorageConflict):  # so would its verdicts
            _quarantine(old, "q-old", 2)
        assert "q-old" not in old.verdict_book.verdicts  # never effective
        new.close()
        third = InProcessRuntime(ledger, data_dir=str(tmp_path / "third"), log_url=nats_url, storage_url=storage)
        assert (third.snapshot(), third.epoch) == (new.snapshot(), 3)
        assert sorted(third.verdict_book.verdicts) == ["q-new"]
        third.close()
    finally:
        new.close()
        old.node.input_log.close()
        old.node.output_log.close()


def test_sqlite_log_on_a_fresh_directory_is_refused(tmp_path: Path, storage: str) -> None:
    rt = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path / "m1"), storage_url=storage)
    rt.load("acct", {a: 0 for a in ACCOUNTS})
    rt.run_epoch(_pay(0))
    rt.close()
    with pytest.raises(NodeError, match="SQLite log"):
        InProcessRuntime(ledger, data_dir=str(tmp_path / "m2"), storage_url=storage)
    again = InProcessRuntime(ledger, data_dir=str(tmp_path / "m1"), storage_url=storage)  # its own directory
    try:
        assert again.epoch == 1
    finally:
        again.close()


def test_effects_and_offsets_survive_the_machine(tmp_path: Path, nats_url: str, storage: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An effect done before the loss is not run again, one requested and checkpointed, and one only logged, run
    once on the new machine; every continuation runs once; a stream reader's offset file comes back."""
    import asyncio

    from fx_storage_app import app as fx

    runs = tmp_path / "runs"
    monkeypatch.setenv("CHARON_TEST_FX_RUNS", str(runs))
    m1, m2 = str(tmp_path / "m1"), str(tmp_path / "m2")

    async def first() -> None:  # the effect of p1 requested, run and continued
        rt = InProcessRuntime(fx, partitions=2, data_dir=m1, log_url=nats_url, storage_url=storage, effects=True,
                              warmup_txns=0)
        async with rt:
            assert (await rt.submit("acct", "k1", "pay", [5], request_id="p1")).ok
            await rt.settle_effects()
        rt.close()

    asyncio.run(first())
    assert len(runs.read_text().split()) == 1
    rt = InProcessRuntime(fx, data_dir=m1, log_url=nats_url, storage_url=storage, effects=False, warmup_txns=0)
    rt.run_epoch([Request("p2", "acct", "k2", "pay", serde.encode([7]), 1.0)])
    (tmp_path / "m1" / "portals.offset").write_bytes(b"3")  # a portal router's checkpoint (see deployment.py)
    rt.node.flush()  # p2's effect requested and checkpointed, not run
    rt.run_epoch([Request("p3", "acct", "k3", "pay", serde.encode([9]), 1.0)])  # logged, never checkpointed
    rt.node.input_log.close()  # the machine is lost
    rt.node.output_log.close()
    shutil.rmtree(m1)

    async def second() -> dict:
        again = InProcessRuntime(fx, data_dir=m2, log_url=nats_url, storage_url=storage, effects=True,
                                 warmup_txns=0)
        async with again:
            await again.settle_effects()
            out = {k: again.read_state("acct", k) for k in ("k1", "k2", "k3")}
        again.close()
        return out

    state = asyncio.run(second())
    assert (tmp_path / "m2" / "portals.offset").read_bytes() == b"3"
    done = runs.read_text().split()
    assert len(done) == len(set(done)) == 3, done  # each effect's handler ran exactly once
    assert {k: (v["amount"], v["runs"], v["ok"]) for k, v in state.items()} == {
        "k1": (5, 1, True), "k2": (7, 1, True), "k3": (9, 1, True)}


# A real process: one spinning transaction times out (its verdict recorded, its reply out), then the process is
# SIGKILLed without a checkpoint; its directory is deleted.
_SPIN = """
import asyncio, os, signal, sys
from charon import InProcessRuntime
from hostile_app import app
async def main():
    rt = InProcessRuntime(app, partitions=2, data_dir=sys.argv[1], log_url=sys.argv[2], storage_url=sys.argv[3],
                          function_timeout=0.3, watchdog_interval=0.05, checkpoint_s=3600, warmup_txns=0)
    async with rt:
        r = await asyncio.wait_for(rt.submit("acc", "k", "spin", [], request_id="s1"), 30)
        print(r.request_id, r.error_type, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""

# On a new machine: recovery replays the logged epoch (a spin without its verdict would run forever: no budget
# applies to a replay) with the verdict taken from object storage.
_CHECK = """
import sys
from charon import InProcessRuntime
from hostile_app import app
rt = InProcessRuntime(app, partitions=2, data_dir=sys.argv[1], log_url=sys.argv[2], storage_url=sys.argv[3],
                      function_timeout=0.3, warmup_txns=0)
print(sorted(rt.verdict_book.verdicts), rt.replayed_epochs, rt.get_reply("s1").error_type, flush=True)
rt.close()
"""


def test_a_verdict_survives_a_sigkilled_machine(tmp_path: Path, nats_url: str, storage: str) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "support"),
                                                        str(Path(__file__).parents[2])])}

    def child(script: str, data: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, str(data), nats_url, storage], env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    p = child(_SPIN, tmp_path / "m1")
    assert p.returncode == -signal.SIGKILL and p.stdout.split() == ["s1", "InvocationTimeout"], p.stdout + p.stderr
    shutil.rmtree(tmp_path / "m1")
    p = child(_CHECK, tmp_path / "m2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.split() == ["['s1']", "1", "InvocationTimeout"], p.stdout + p.stderr



# The outage test's first machine (a real process, SIGKILLed at the end: nothing checkpointed, so the new machine
# replays every epoch): deposits, then (once the parent has stopped the storage and says "go") a spinning
# transaction and more deposits; /health printed until the verdict is seen waiting, then every reply.
_OUTAGE = """
import asyncio, json, os, signal, sys, time
from charon import InProcessRuntime
from hostile_app import app
async def main():
    rt = InProcessRuntime(app, partitions=2, data_dir=sys.argv[1], log_url=sys.argv[2], storage_url=sys.argv[3],
                          function_timeout=0.3, watchdog_interval=0.05, checkpoint_s=3600, warmup_txns=0)
    async with rt:
        subs = [await rt.submit("acc", f"a{i}", "deposit", [10 + i], request_id=f"d{i}") for i in range(3)]
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # storage is down now
        futs = [asyncio.ensure_future(rt.submit("acc", "k", "spin", [], request_id="s1"))]
        futs += [asyncio.ensure_future(rt.submit("acc", f"a{i}", "deposit", [1], request_id=f"e{i}"))
                 for i in range(3)]
        t0 = time.monotonic()
        while True:
            h = rt.health()
            print("health", json.dumps({**h, "spin_done": futs[0].done()}), flush=True)
            if h.get("log_wait", {}).get("what") == "storing a verdict" or time.monotonic() - t0 > 60:
                break
            await asyncio.sleep(0.2)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # storage is back
        subs += [await asyncio.wait_for(f, 120) for f in futs]
        t0 = time.monotonic()
        while not rt.health()["ok"] and time.monotonic() - t0 < 60:  # a write still in its back-off: healed soon
            await asyncio.sleep(0.2)
        print("health", json.dumps(rt.health()), flush=True)
        print("replies", json.dumps({r.request_id: [r.ok, r.error_type, r.value.hex()] for r in subs}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""


def test_a_verdict_recorded_during_a_storage_outage_lands_after_it(tmp_path: Path, nats_url: str,
                                                                   s3_env: SeaweedS3) -> None:
    """SeaweedFS down while a budget timeout's verdict is being recorded: /health says so (not ok, naming what
    waits), the transaction is not refused before its verdict is stored, the verdict lands once storage is back,
    nothing acknowledged is lost, and a new machine (an empty directory; the first one SIGKILLed before any
    checkpoint) replays every epoch to the same replies, the verdict taken from storage."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from hostile_app import app as hostile

    storage = s3_env.url(f"outage-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "support"),
                                                        str(Path(__file__).parents[2])])}
    child = subprocess.Popen([sys.executable, "-c", _OUTAGE, str(tmp_path / "m1"), nats_url, storage], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        s3_env.kill()  # storage is down from here
        child.stdin.write("go\n")
        child.stdin.flush()
        seen = []
        while True:
            line = child.stdout.readline()
            assert line.startswith("health "), line + (child.stderr.read() if child.stderr else "")
            seen.append(json.loads(line.split(" ", 1)[1]))
            if "log_wait" in seen[-1]:
                break
        s3_env.start()
        child.stdin.write("back\n")
        child.stdin.flush()
        after = json.loads(child.stdout.readline().split(" ", 1)[1])
        line = child.stdout.readline()
        assert line.startswith("replies "), line + (child.stderr.read() if child.stderr else "")
        replies = json.loads(line.split(" ", 1)[1])
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if s3_env.proc is None or s3_env.proc.poll() is not None:
            s3_env.start()
    wait = seen[-1]
    assert not wait["ok"] and wait["log_wait"]["what"] == "storing a verdict", wait  # /health names the wait
    assert not any(h["spin_done"] for h in seen)  # the verdict is not effective before it is stored
    assert after["ok"] and "log_wait" not in after, after
    assert replies["s1"][:2] == [False, "InvocationTimeout"], replies
    assert all(replies[f"e{i}"][0] and replies[f"d{i}"][0] for i in range(3)), replies
    assert '"s1"' in open_storage_text(storage, "verdicts.jsonl")  # the verdict landed

    again = InProcessRuntime(hostile, partitions=2, data_dir=str(tmp_path / "m2"), log_url=nats_url,
                             storage_url=storage, function_timeout=0.3, warmup_txns=0)
    try:
        assert sorted(again.verdict_book.verdicts) == ["s1"]
        assert again.replayed_epochs >= 2  # nothing was checkpointed: every epoch replayed
        for rid, want in replies.items():  # replies unchanged by the replay
            r = again.get_reply(rid)
            assert r is not None and [r.ok, r.error_type, r.value.hex()] == want, (rid, r, want)
        assert [again.read_state("acc", f"a{i}") for i in range(3)] == [11, 12, 13]  # nothing lost, once each
    finally:
        again.close()


def open_storage_text(url: str, key: str) -> str:
    from charon.storage.location import open_storage

    return open_storage(url).get(key)[0].decode(errors="replace")
