"""Rescaling the Spark runtime by key groups (:meth:`SparkRuntime.rescale`).

* Without Spark (the move only touches the durable copy): a stopped runtime rescales, reopening with another
  count rescales at open, another input-log count resizes the log, and a SIGKILL on either side of the commit point
  (``layout.json``) leaves exactly one layout; executors retire only older layouts' stores; the SQL views of
  a data directory read the state directory a rescale recorded.
* On real PySpark: 2 -> 4 -> 3 engine partitions while sixteen clients call through the real gateway over HTTP:
  every request answered exactly once, money conserved, timers registered before a move fire after it, each
  partition holds only its key groups, the run equals an in-process replay, and the pause is measured.
* On real PySpark, a driver SIGKILLed inside the move (before the commit point) while requests keep being
  appended: the restart keeps the old layout, rescales at open, rescales again online; every request
  answered once, money conserved, one layout left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from charon import Request, serde
from charon.apps import holds
from charon.config import SparkConfig
from charon.core import timers
from charon.core.routing import partition_of, store_key
from charon.runtime.spark.engine import SparkEngine
from charon.runtime.spark.layout import read_layout
from charon.runtime.spark.runtime import SparkRuntime
from charon.runtime.spark.tasks import write_bases
from charon.testing import replay_in_process

APP = "charon.apps.holds:app"
KEYS = [f"k{i}" for i in range(40)]
TOKEN = "t0ken"
DRIVER = str(Path(__file__).resolve().parents[1] / "support" / "spark_rescale_driver.py")


def _placed_right(rt: SparkRuntime) -> bool:
    """Every item of the last recorded epoch (timer index entries included) is in its key group's partition."""
    parts, durable, _ = rt.placement()
    epoch = rt.last_recorded_epoch()
    for pid in range(parts):
        state, _ = durable.load(pid, epoch)
        if not all(partition_of(*timers.placed_by(k, v), parts) == pid for k, v in state.items()):
            return False
    return True


def _money(state: dict[bytes, bytes]) -> tuple[int, int]:
    """(balances, held) over the acct entities of a snapshot."""
    balances = sum(serde.decode(v) for k, v in state.items() if k.startswith(b"acct\0") and k.endswith(b"\0"))
    held = sum(serde.decode(v)[1] for k, v in state.items() if b"\0\x01hold:" in k)
    return balances, held


def _state_dirs(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("state"))


def _seed(rt: SparkRuntime) -> dict[bytes, bytes]:
    """Accounts as a bulk load writes them (bases at epoch -1), without a Spark job."""
    rows = [("acct", k, "", serde.encode(100)) for k in KEYS] + [("acct", k, "\x01note:x", serde.encode(1))
                                                                  for k in KEYS[:5]]
    list(write_bases(rt.durable.root, rt.config.partitions, rows))
    return rt.snapshot()



class _Load:
    """Requests appended straight to a deployment's input log every 0.25 s, driver up or down (transfers and holds
    over KEYS, idempotent ids), until :attr:`stop`; :meth:`finish_after` stops them 3 s after a marker appears in
    the driver's log and lets the driver finish."""

    def __init__(self, data: Path, log: Path, seed: int, ready: Callable[[], bool]) -> None:
        self.data, self.log = data, log
        self.appended: list[str] = []
        self.stop = threading.Event()
        self._feed = threading.Thread(target=self._feeder, args=(seed, ready), daemon=True)
        self._feed.start()

    def _feeder(self, seed: int, ready: Callable[[], bool]) -> None:
        from charon.log.sqlite import InputLog

        rng = random.Random(seed)
        while not ready():
            time.sleep(0.1)
        inp = InputLog(str(self.data / "input.sqlite"))
        i = 0
        while not self.stop.is_set():
            reqs = []
            for _ in range(10):
                i += 1
                k = rng.choice(KEYS)
                if i % 8 == 0:
                    reqs.append(Request(f"h{i}", "acct", k, "hold", serde.encode([f"g{i}", 5, 0.3])))
                else:
                    reqs.append(Request(f"t{i}", "acct", k, "transfer", serde.encode([rng.choice(KEYS), 7])))
            inp.append_many(reqs)
            self.appended.extend(r.request_id for r in reqs)
            time.sleep(0.25)

    def finish_after(self, marker: str) -> threading.Thread:
        def finish() -> None:
            while marker not in (self.log.read_text() if self.log.exists() else "") and not self.stop.is_set():
                time.sleep(0.2)
            time.sleep(3.0)
            self.stop.set()
            self._feed.join()
            (self.data / "done").touch()

        t = threading.Thread(target=finish, daemon=True)
        t.start()
        return t

    def check_answered_once(self, rt: SparkRuntime) -> None:
        """Every appended request answered exactly once, and money conserved."""
        from charon.log.sqlite import OutputLog

        out = OutputLog(str(self.data / "output.sqlite"))
        got = [r.request_id for _, r in out.read_since(0, limit=1 << 30)]
        client = [rid for rid in got if not rid.startswith(timers.REQUEST_PREFIX)]
        assert len(self.appended) > 100 and sorted(client) == sorted(self.appended), "every request answered once"
        balances, held = _money(rt.snapshot())
        assert balances + held == 100 * len(KEYS), "money is conserved"

def test_stopped_runtime_rescales_and_reopening_rescales(tmp_path: Path) -> None:
    rt = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=2))
    before = _seed(rt)
    assert len(before) == len(KEYS) + 5
    info = rt.rescale(4)
    assert info["from"] == 2 and info["to"] == 4 and info["keys"] == len(before) and info["epoch"] == -1
    assert rt.config.partitions == 4 and rt.config.n_log_partitions == 2, "the input log keeps its count"
    assert rt.snapshot() == before and _placed_right(rt)
    ckpt = tmp_path / "checkpoint"
    layout = read_layout(str(ckpt))
    assert layout is not None and (layout.partitions, layout.log_partitions) == (4, 2)
    assert _state_dirs(ckpt) == sorted(["state", layout.state]), "the old layout goes at the next start"
    from charon.runtime.spark.statesql import layout_of

    assert layout_of(str(tmp_path)).root == str(ckpt / layout.state), "the SQL view reads the layout in force"
    again = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=4))
    assert again.rescale_pauses == [] and again.snapshot() == before
    assert _state_dirs(ckpt) == [layout.state]
    three = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=3))  # another count: rescaled
    assert three.config.partitions == 3 and [p["to"] for p in three.rescale_pauses] == [3]
    assert three.snapshot() == before and _placed_right(three) and len(_state_dirs(ckpt)) == 2
    five = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=3, log_partitions=5))
    assert five.input_log.counts() == (5, 5) and read_layout(str(ckpt)).log_partitions == 5, "the log is resized"
    assert five.rescale(log_partitions=3)["log"] == {**five.log_rescales[-1], "from": 5, "to": 3, "physical": 5}
    assert five.input_log.counts() == (5, 3) and read_layout(str(ckpt)).log_partitions == 3
    kept_log = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=3))  # no count: the recorded one
    assert kept_log.config.n_log_partitions == 3 and kept_log.input_log.counts() == (5, 3)
    assert kept_log.snapshot() == before
    with pytest.raises(ValueError):
        three.rescale(0)
    from charon.runtime.factory import EngineSpec, make_engine

    kept = make_engine(EngineSpec("spark", APP, data_dir=str(tmp_path)))  # `charon run` without --partitions
    assert isinstance(kept, SparkEngine)
    assert kept.partitions == 3 and kept.rt.rescale_pauses == [] and kept.rt.snapshot() == before


_CRASH = """
import sys
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
rt = SparkRuntime("charon.apps.holds:app", SparkConfig(data_dir=sys.argv[1], partitions=2))
rt.rescale(int(sys.argv[2]))
"""


@pytest.mark.parametrize("point", ["relayout", "relayout_committed"])
def test_sigkill_inside_the_move_leaves_one_layout(tmp_path: Path, point: str) -> None:
    before = _seed(SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=2)))
    env = dict(os.environ, CHARON_CRASH_AT=f"{point}:*")
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path), "4"], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    ckpt = tmp_path / "checkpoint"
    layout = read_layout(str(ckpt))
    assert layout is not None
    committed = point == "relayout_committed"
    assert layout.partitions == (4 if committed else 2) and (layout.state != "state") == committed
    assert len(_state_dirs(ckpt)) == 2, "killed before the other layout's directory was removed"
    rt = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=layout.partitions))  # as recorded
    assert _state_dirs(ckpt) == [layout.state], "the leftover of the other layout is removed"
    assert rt.snapshot() == before and _placed_right(rt)
    moved = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=3))
    assert moved.snapshot() == before and _placed_right(moved)


# -- real PySpark -------------------------------------------------------------------------------------------
def _client(url: str, seed: int, stop: threading.Event, replies: dict, errors: list) -> None:
    """One client over HTTP: transfers and 0.5 s holds with an Idempotency-Key each, until ``stop``."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=180) as http:
        i = 0
        while not stop.is_set():
            i += 1
            rid = f"c{seed}-{i}"
            k = rng.choice(KEYS)
            if rng.random() < 0.85:
                fn, args = "transfer", [rng.choice(KEYS), rng.randint(1, 30)]
            else:
                fn, args = "hold", [rid, rng.randint(1, 20), 0.5]
            r = http.post(f"/invoke/acct/{k}/{fn}", json={"args": args}, headers={"Idempotency-Key": rid})
            if r.status_code not in (200, 409) or r.json().get("request_id") != rid or rid in replies:
                errors.append((rid, r.status_code, r.text[:300]))
                return
            replies[rid] = (fn, r.json())


def _epochs_pass(rt: SparkRuntime, n: int, timeout: float = 180.0) -> None:
    first = rt.last_recorded_epoch()
    deadline = time.monotonic() + timeout
    while rt.last_recorded_epoch() < first + n:
        assert time.monotonic() < deadline, f"epochs do not advance: {rt.health()}"
        time.sleep(0.05)


@pytest.mark.spark
def test_spark_rescale_2_4_3_under_gateway_load(tmp_path: Path) -> None:
    from charon.server.serve import BackgroundServer

    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, max_batch=200, truncate_log=False,
                      compact_every=3, timer_poll_ms=20)
    rt = SparkRuntime(APP, cfg)
    replies: dict[str, tuple[str, dict]] = {}
    errors: list = []
    stop = threading.Event()
    try:
        rt.load("acct", {k: 100 for k in KEYS})
        initial = {store_key("acct", k): serde.encode(100) for k in KEYS}
        with BackgroundServer(rt, token=TOKEN) as srv:
            clients = [threading.Thread(target=_client, args=(srv.url, s, stop, replies, errors), daemon=True)
                       for s in range(16)]
            for c in clients:
                c.start()
            moves = []
            for target in (4, 3):
                _epochs_pass(rt, 4)
                moves.append(rt.rescale(target))
                assert rt.config.partitions == target and _placed_right(rt)
            _epochs_pass(rt, 4)
            stop.set()
            for c in clients:
                c.join(200)
            assert not errors, errors[:3]
            deadline = time.monotonic() + 120
            while _money(rt.snapshot())[1] > 0 or not rt.caught_up():  # the last holds' timers fire
                assert time.monotonic() < deadline, "holds were not released"
                time.sleep(0.2)
        assert len(replies) > 100
        log = {r.request_id: r for r in rt.replies()}
        assert len(rt.replies()) == len(log), "one reply per request id in the output log"
        assert all((log[rid].tid, log[rid].epoch) == (body["tid"], body["epoch"]) for rid, (_, body) in replies.items())
        epochs = sorted(m["epoch"] for m in moves)
        got = sorted(body["epoch"] for _, body in replies.values())
        assert got[0] <= epochs[0] < epochs[1] < got[-1], "both moves happened while clients were served"
        state = rt.snapshot()
        assert _money(state) == (100 * len(KEYS), 0), "money is conserved; every hold released"
        held = {b["value"]: b["epoch"] for fn, b in replies.values() if fn == "hold" and b["status"] == "committed"}
        pre = timers.REQUEST_PREFIX
        fired = {rid[len(pre):]: r.epoch for rid, r in log.items() if rid.startswith(pre)}
        assert held and set(fired) == set(held), "every hold's timer fired exactly once"
        assert any(held[t] <= m["epoch"] < fired[t] for t in held for m in moves), "a timer crossed a move"
        ip, results = replay_in_process(holds.app, rt, initial)
        assert ip.snapshot() == state, "the rescaled run equals an in-process replay of its epochs"
        assert all(log[r.request_id] == r for res in results for r in res.replies.values())
        assert [(m["from"], m["to"]) for m in moves] == [(2, 4), (4, 3)]
        assert all(m["pause_s"] > 0 and m["keys"] >= len(KEYS) for m in moves)
        print("\nmoves: " + json.dumps(moves))
        dirs = _state_dirs(tmp_path / "checkpoint")
        assert read_layout(str(tmp_path / "checkpoint")).state in dirs and len(dirs) <= 2, "old layouts are removed"
    finally:
        stop.set()
        rt.close()


def _run(data: Path, args: list[str], log: Path, crash: str | None, timeout: float = 400) -> int:
    from charon.runtime.spark.cluster import ProcessTree

    env = {k: v for k, v in os.environ.items() if k != "CHARON_CRASH_AT"}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               CHARON_LOCAL_DIR=str(data.parent / "local"))
    if crash:
        env["CHARON_CRASH_AT"] = crash
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, DRIVER, str(data), *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    tree = ProcessTree(proc)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            tree.scan()
            time.sleep(0.2)
        return proc.returncode if proc.returncode is not None else -999
    finally:
        tree.kill()


@pytest.mark.spark
def test_spark_driver_sigkill_inside_the_move_under_load(tmp_path: Path) -> None:

    data = tmp_path / "data"
    ckpt = data / "checkpoint"
    log = tmp_path / "driver.log"
    load = _Load(data, log, seed=7, ready=lambda: (data / "input.sqlite").exists())
    stop = load.stop
    try:
        rc = _run(data, ["--partitions", "2", "--load", str(len(KEYS)), "--rescale", "4"], log, "relayout:*")
        assert rc == -signal.SIGKILL, log.read_text()[-3000:]
        layout = read_layout(str(ckpt))
        assert layout is not None and (layout.partitions, layout.state) == (2, "state"), "killed before the switch"
        assert len(_state_dirs(ckpt)) == 2, "the new layout's directory was written"
        log.write_text("")
        closer = load.finish_after("rescaled")
        # reopened with 4: the leftover goes, the open rescales 2 -> 4, then 4 -> 3 online under load
        rc = _run(data, ["--partitions", "4", "--rescale", "3"], log, None)
        closer.join(60)
        text = log.read_text()
        assert rc == 0, text[-3000:]
        assert "opened at 4 partitions" in text and '"from": 4, "to": 3' in text and "idle " in text
    finally:
        stop.set()
    rt = SparkRuntime(APP, SparkConfig(data_dir=str(data), partitions=3, log_partitions=2))
    assert rt.rescale_pauses == [] and _state_dirs(ckpt) == [read_layout(str(ckpt)).state], "one layout"
    load.check_answered_once(rt)
    assert _placed_right(rt)


def test_executor_stores_of_an_older_layout_are_removed_and_a_late_task_removes_nothing(tmp_path: Path) -> None:
    from charon.runtime.spark.layout import local_root

    base, ckpt = tmp_path / "local", str(tmp_path / "checkpoint")
    assert local_root(str(base), ckpt, f"{ckpt}/state") == str(base)
    for d in ("p0", "p1"):
        (base / d).mkdir(parents=True)
    new = f"state-{time.time_ns():x}"
    assert local_root(str(base), ckpt, f"{ckpt}/{new}") == str(base / new)
    (base / new / "p0").mkdir(parents=True)
    assert sorted(p.name for p in base.iterdir()) == [new], "the first layout's stores are gone"
    assert local_root(str(base), ckpt, f"{ckpt}/state") == str(base)  # a late read of the old layout
    assert (base / new / "p0").is_dir(), "a late task of an older layout deletes nothing"
    newer = f"state-{time.time_ns() + 1:x}"
    local_root(str(base), ckpt, f"{ckpt}/{newer}")
    assert not (base / new).exists()


def test_sql_views_of_a_rescaled_node_read_its_state_directory(tmp_path: Path) -> None:
    """``charon sql --data-dir`` (statesql.layout_of) on a node data directory a rescale moved."""
    import asyncio

    from charon import InProcessRuntime
    from charon.runtime.spark.statesql import layout_of

    rt = InProcessRuntime(holds.app, partitions=2, data_dir=str(tmp_path))
    rt.load("acct", {k: 100 for k in KEYS})
    asyncio.run(rt.rescale(3))
    root = rt.node.durable.root
    rt.close()
    layout = layout_of(str(tmp_path))
    assert os.path.basename(root) != "state" and layout.root == root and layout.partitions == 3
