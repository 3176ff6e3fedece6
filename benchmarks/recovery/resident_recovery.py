"""Recovery of the resident Spark mode under load: the time from a SIGKILL to the first new commit, and that nothing
acknowledged is lost and no reply changes by the replay (issue 32). JSON + PNG.

One ``charon run charon.apps.ycsb:app --engine spark`` on ``local[2]`` (``CHARON_MASTER``; its gateway process
beside the driver, the defaults otherwise: ``restart_backoff_s`` 1 s) serves a steady load of YCSB-T transfers
through HTTP (``--rate`` per second over ``--clients`` keep-alive connections, each with its own
``Idempotency-Key``; a transfer whose connection fails is retried with the same key until answered, as a client
would). This script is the process supervisor. In turn, ``--settle`` seconds apart:

- ``worker``: SIGKILL the Python worker of a gang task (its pid from ``/health``'s ``gang``);
- ``jvm``: SIGKILL Spark's JVM (the driver's ``java`` child);
- ``driver``: SIGKILL the whole ``charon run`` process group (driver, JVM, Python workers, gateway) and start
  ``charon run`` again at once on the same data directory and port.

Per fault: ``recovery_s``, from the kill to the first acknowledged reply of an epoch the old gang could not have
run, answered after ``/health`` first names a new gang (its epoch after every one recorded then: a dead JVM's
Python workers go on serving the driver's sockets until the driver notices, and the old gang may reply early to an
epoch it cannot record; ``old_gang_commits_after_kill`` counts the answers before the new gang);
``new_gang_s``, to that ``/health``; ``first_sent_after_s``, to the first acknowledged reply of a transfer sent
after the kill; ``longest_answer_gap_s``, the longest stretch without an answer. The issue's bounds: worker <= 3 s,
JVM <= 20 s, driver <= 30 s. At the end: every acknowledged reply read back by its id is the same (tid, epoch,
status, value), money is conserved, and, the node stopped, the in-process runtime replaying the recorded epochs
gives the same replies as the output log and the same state (``charon.testing.replay_in_process``).

    .venv/bin/python benchmarks/recovery/resident_recovery.py                 # quiet machine: the figures
    .venv/bin/python benchmarks/recovery/resident_recovery.py --quick         # a smoke (written to a temp dir)
    .venv/bin/python benchmarks/recovery/resident_recovery.py --only worker,jvm

Writes ``benchmarks/results/recovery/resident_recovery.json`` and ``.png`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from charon.bench.engines import ConnectionPool, HttpConnection, node_command, seed_accounts, transfer_request

OUT = Path(__file__).resolve().parents[1] / "results" / "recovery"
APP = "charon.apps.ycsb:app"
TOKEN = "recovery"
H = {"Authorization": f"Bearer {TOKEN}"}
START = 1_000  # each account's balance
BOUNDS_S = {"worker": 3.0, "jvm": 20.0, "driver": 30.0}  # the targets
SCENARIOS = ("worker", "jvm", "driver")


class Node:
    """``charon run`` in its own session on a fixed port and data directory; :meth:`kill` SIGKILLs its group."""

    def __init__(self, workdir: Path, port: int, extra: list[str]) -> None:
        self.workdir, self.port, self.extra = workdir, port, extra
        self.data = workdir / "data"
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        cmd = node_command(APP, engine="spark", port=self.port, token=TOKEN, data_dir=str(self.data), args=self.extra)
        env = {**os.environ, "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
               "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
               "CHARON_MASTER": os.environ.get("CHARON_MASTER", "local[2]"),
               "CHARON_TRUNCATE_LOG": "false"}  # the whole history stays: the replay check reruns it
        self.starts += 1
        log = open(self.workdir / f"node-{self.starts}.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    def wait_healthy(self, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"charon run exited with {self.proc.returncode} (see {self.workdir})")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return dict(r.json())
            time.sleep(0.2)
        raise TimeoutError("the node did not become healthy")

    def health(self) -> dict[str, Any]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return dict(httpx.get(self.url + "/health", timeout=5).json())
        return {}

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.kill()

    def java_pids(self) -> list[int]:
        import psutil

        assert self.proc is not None
        return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True) if "java" in p.name()]


def last_record(data: Path) -> int:
    """The newest epoch record in the node's checkpoint (``-1``: none)."""
    from charon.config import SparkConfig

    d = Path(SparkConfig(data_dir=str(data)).checkpoint_dir) / "epochs"
    try:
        return max((int(n.split(".")[0]) for n in os.listdir(d) if n.endswith(".msgpack")), default=-1)
    except FileNotFoundError:
        return -1


class Load:
    """Transfers at ``rate`` per second over ``clients`` connections, in this process's own event loop thread.
    ``acked``: request id -> (sent, answered, reply document); ``sent``: request id -> first send time."""

    def __init__(self, url: str, accounts: int, rate: float, clients: int) -> None:
        self.url, self.accounts, self.rate, self.clients = url, accounts, rate, clients
        self.acked: dict[str, tuple[float, float, dict[str, Any]]] = {}
        self.sent: dict[str, float] = {}
        self.errors = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 180.0) -> None:
        self.stopping.set()
        self.thread.join(timeout)

    async def _run(self) -> None:
        pool = ConnectionPool(self.url, self.clients)
        await pool.open()
        try:
            await asyncio.gather(*(self._client(i, c) for i, c in enumerate(pool.connections)))
        finally:
            pool.close()

    async def _client(self, i: int, conn: HttpConnection) -> None:
        rng = random.Random(i)
        period = self.clients / self.rate
        nxt = time.monotonic() + rng.random() * period
        n = 0
        while not self.stopping.is_set():
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            nxt = max(nxt + period, time.monotonic() - period)
            a, b = rng.sample(range(self.accounts), 2)
            rid = f"c{i}-{n}"
            n += 1
            req = transfer_request(b"127.0.0.1", TOKEN.encode(), a, b, rng.randint(1, 20), rid.encode())
            self.sent[rid] = t0 = time.monotonic()
            while True:  # the same id until answered (a retry of an acknowledged id gets the same reply)
                try:
                    if conn.writer is None:  # the server was down at the last reconnect
                        await conn.open()
                    status, body = await asyncio.wait_for(conn.send(req), 60)
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
                    self.errors += 1
                    conn.close()
                    await asyncio.sleep(0.05)
                    continue
                if status in (200, 409):
                    doc = json.loads(body)
                    if "tid" in doc:
                        self.acked[rid] = (t0, time.monotonic(), doc)
                        break
                await asyncio.sleep(0.05)  # 202 (still running), 503 (recovering): ask again


class HealthWatch:
    """``/health`` every 50 ms: ``(time, gang token, last recorded epoch, status)`` (token None: no answer)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rows: list[tuple[float, str | None, int, str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as c:
            while not self.stopping.is_set():
                t = time.monotonic()
                try:
                    doc = c.get(self.url + "/health").json()
                    self.rows.append((t, (doc.get("gang") or {}).get("token"), int(doc.get("epoch", -1)),
                                      str(doc.get("status"))))
                except (httpx.HTTPError, ValueError, TypeError):
                    self.rows.append((t, None, -1, "unreachable"))
                time.sleep(0.05)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)

    def token_before(self, t: float) -> str | None:
        return next((tok for ts, tok, _, _ in reversed(self.rows) if ts < t and tok), None)

    def new_gang(self, t_kill: float, old: str | None) -> tuple[float, int] | None:
        """The first answer after ``t_kill`` naming another gang than ``old``: (its time, the last recorded epoch
        it reports: every epoch the old gang recorded is in it, since a new gang's exchange replaces the old one
        only after closing it)."""
        return next(((ts, e) for ts, tok, e, _ in list(self.rows) if ts >= t_kill and tok and tok != old), None)


def measure(load: Load, watch: HealthWatch, t_kill: float, old_gang: str | None, until: float) -> dict[str, Any]:
    """The recovery figures of one fault (times from ``t_kill``). The first new commit is the first acknowledged
    reply of an epoch after every epoch the old gang (or process) recorded: the old gang may commit on after the
    kill until the driver notices (a dead JVM leaves its Python workers serving the driver's sockets)."""
    acks = sorted((t1, t0, doc) for t0, t1, doc in list(load.acked.values()) if t_kill <= t1 <= until)
    switch = watch.new_gang(t_kill, old_gang)
    # an epoch after the switch's records, answered after the switch: the old gang may have replied early to an
    # epoch it could not record (the new one reruns it, with the same replies)
    new = [t1 for t1, _, doc in acks
           if switch is not None and t1 >= switch[0] and int(doc.get("epoch", -1)) > switch[1]]
    old = [t1 for t1, _, _ in acks if switch is None or t1 < switch[0]]
    after = [t1 for t1, t0, _ in acks if t0 >= t_kill]
    answered = sorted([t1 for _, t1, _ in list(load.acked.values()) if t1 <= until] + [t_kill, until])
    gaps = [b - a for a, b in zip(answered, answered[1:], strict=False) if b >= t_kill]
    return {"recovery_s": round(new[0] - t_kill, 3) if new else None,
            "new_gang_s": round(switch[0] - t_kill, 3) if switch else None,
            "old_gang_commits_after_kill": len(old),
            "first_sent_after_s": round(after[0] - t_kill, 3) if after else None,
            "longest_answer_gap_s": round(max(gaps), 3) if gaps else None}


def check(node: Node, load: Load, accounts: int) -> dict[str, Any]:
    """Every acknowledged reply read back by its id unchanged; money conserved (through HTTP)."""
    changed, lost = [], []
    with httpx.Client(base_url=node.url, headers=H, timeout=60) as c:
        for rid, (_, _, doc) in list(load.acked.items()):
            r = c.get(f"/requests/{rid}")
            if r.status_code not in (200, 409):
                lost.append(rid)
                continue
            back = r.json()
            if any(back.get(k) != doc.get(k) for k in ("tid", "epoch", "status", "value")):
                changed.append(rid)
        total = sum(c.get(f"/state/account/a{i}").json().get("value") or 0 for i in range(accounts))
    return {"acked": len(load.acked), "acked_lost": len(lost), "acked_changed": len(changed),
            "examples": (lost + changed)[:5], "money": total, "money_expected": START * accounts,
            "money_conserved": total == START * accounts}


def replay_check(data: Path, partitions: int) -> dict[str, Any]:
    """The node stopped: the in-process runtime replays the recorded epochs; the same replies and state."""
    from charon.apps import ycsb
    from charon.config import SparkConfig
    from charon.runtime.spark.runtime import SparkRuntime
    from charon.testing import replay_in_process

    rt = SparkRuntime(APP, SparkConfig(data_dir=str(data), partitions=partitions, truncate_log=False))
    try:
        replies = rt.replies()
        ip, results = replay_in_process(ycsb.app, rt, {})
        expected = {r.request_id: r for res in results for r in res.replies.values()}
        differ = [r.request_id for r in replies if expected.get(r.request_id) != r]
        return {"replies": len(replies), "unique": len({r.request_id for r in replies}),
                "replay_differs": len(differ), "examples": differ[:5], "state_equal": ip.snapshot() == rt.snapshot(),
                "epochs": rt.last_recorded_epoch() + 1}
    finally:
        rt.close()


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from charon.bench.engines import free_port

    node = Node(workdir, free_port(), ["--partitions", str(args.partitions)])  # (resolved in main)
    node.start()
    try:
        node.wait_healthy()
        seed_accounts(node.url, TOKEN, args.accounts, START)
        load = Load(node.url, args.accounts, args.rate, args.clients)
        load.start()
        watch = HealthWatch(node.url)
        watch.start()
        t_start = time.monotonic()
        faults: list[dict[str, Any]] = []
        for name in args.only.split(","):
            time.sleep(args.settle)
            h = node.health()
            epoch = last_record(node.data)
            t_kill = time.monotonic()
            gang = watch.token_before(t_kill)
            detail: dict[str, Any] = {}
            if name == "worker":
                seated = (h.get("gang") or {}).get("seated") or []
                if not seated:
                    raise RuntimeError(f"no gang in /health: {h}")
                os.kill(int(seated[-1]["pid"]), signal.SIGKILL)
                detail = {"pid": seated[-1]["pid"], "gang_tasks": len(seated)}
            elif name == "jvm":
                pids = node.java_pids()
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                detail = {"jvms": len(pids)}
            elif name == "driver":
                node.kill()
                detail = {"killed_at_s": round(time.monotonic() - t_kill, 3)}
                node.start()  # at once, as a process supervisor would
            else:
                raise ValueError(f"unknown scenario {name!r} (one of {', '.join(SCENARIOS)})")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # the first new commit, then a steady stretch after it
                m = measure(load, watch, t_kill, gang, time.monotonic())
                if m["recovery_s"] is not None and time.monotonic() > t_kill + m["recovery_s"] + args.after:
                    break
                time.sleep(0.2)
            m = measure(load, watch, t_kill, gang, time.monotonic())
            h2 = node.health()
            res = {"scenario": name, "at_s": round(t_kill - t_start, 3), "epoch_at_kill": epoch, **m, **detail,
                   "bound_s": BOUNDS_S[name], "within_bound": m["recovery_s"] is not None
                   and m["recovery_s"] <= BOUNDS_S[name], "restarts": h2.get("restarts"),
                   "jvm_restarts": h2.get("jvm_restarts"), "gang": (h2.get("gang") or {}).get("token")}
            print(f"[recovery] {name}: first new commit {m['recovery_s']} s after the kill (bound "
                  f"{BOUNDS_S[name]:g} s; a new gang at {m['new_gang_s']} s; the old one committed "
                  f"{m['old_gang_commits_after_kill']} after the kill), first reply to a transfer sent after it "
                  f"{m['first_sent_after_s']} s, longest gap in answers {m['longest_answer_gap_s']} s", flush=True)
            faults.append(res)
        load.stop()
        watch.stop()
        node.wait_healthy()
        ledger = check(node, load, args.accounts)
        timeline = sorted((round(t0 - t_start, 4), round((t1 - t0) * 1000, 1))
                          for t0, t1, _ in load.acked.values())
        node.stop()
        replay = replay_check(node.data, args.partitions)
        print(f"[recovery] acknowledged {ledger['acked']}: lost {ledger['acked_lost']}, changed "
              f"{ledger['acked_changed']}; money {'conserved' if ledger['money_conserved'] else 'NOT conserved'}; "
              f"replay: {replay['replay_differs']} replies differ, state "
              f"{'equal' if replay['state_equal'] else 'DIFFERS'}", flush=True)
        return {"faults": faults, "ledger": ledger, "replay": replay, "sent": len(load.sent),
                "client_errors": load.errors, "timeline": timeline, "node_starts": node.starts}
    finally:
        node.stop()


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    tl = doc["timeline"]
    ax.scatter([t for t, _ in tl], [ms for _, ms in tl], s=2, color="tab:orange", label="reply latency (ms)")
    ax.set_yscale("log")
    ax.set(xlabel="s since the load started", ylabel="latency of each acknowledged transfer (ms)")
    for f in doc["faults"]:
        ax.axvline(f["at_s"], color="red", linestyle="--")
        if f["recovery_s"] is not None:
            ax.axvspan(f["at_s"], f["at_s"] + f["recovery_s"], color="red", alpha=0.15)
        ax.annotate(f"{f['scenario']} killed: first new commit {f['recovery_s']} s (≤ {f['bound_s']:g})",
                    (f["at_s"], ax.get_ylim()[1] * 0.5), fontsize=8, rotation=90, va="top")
    ledger, replay = doc["ledger"], doc["replay"]
    ax.set_title(f"resident Spark (local[2]) under {doc['rate']:g} tx/s: acknowledged {ledger['acked']}, lost "
                 f"{ledger['acked_lost']}, changed {ledger['acked_changed']}; replay differs "
                 f"{replay['replay_differs']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke: low rate, short waits, written to a temp dir")
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--rate", type=float, default=None, help="transfers per second (default 300; quick 40)")
    ap.add_argument("--clients", type=int, default=None, help="connections (default 32; quick 8)")
    ap.add_argument("--accounts", type=int, default=None, help="default 1000; quick 200")
    ap.add_argument("--partitions", type=int, default=None,
                    help="engine partitions (default: what charon run gives a new deployment on local[2])")
    ap.add_argument("--settle", type=float, default=None, help="seconds of load before each fault (default 15)")
    ap.add_argument("--after", type=float, default=None, help="seconds of load after each recovery (default 10)")
    ap.add_argument("--out", default=None, help="output stem (default results/recovery/resident_recovery)")
    a = ap.parse_args(argv)
    if a.partitions is None:
        from charon.config import SparkConfig

        a.partitions = SparkConfig(master=os.environ.get("CHARON_MASTER", "local[2]")).default_partitions()
    q = a.quick
    a.rate = a.rate or (40.0 if q else 300.0)
    a.clients = a.clients or (8 if q else 32)
    a.accounts = a.accounts or (200 if q else 1000)
    a.settle = a.settle if a.settle is not None else (4.0 if q else 15.0)
    a.after = a.after if a.after is not None else (2.0 if q else 10.0)
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="charon-recovery-quick-")) / "resident_recovery"
                                      if q else OUT / "resident_recovery")
    load0 = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="charon-recovery-"))
    try:
        res = run(a, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    given = " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"command": f"benchmarks/recovery/resident_recovery.py {given}",
           "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "quick": q,
           "rate": a.rate, "clients": a.clients, "accounts": a.accounts, "partitions": a.partitions,
           "master": os.environ.get("CHARON_MASTER", "local[2]"), "cpus": os.cpu_count(),
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), **res}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, Path(f"{out}.png"))
    print(f"[recovery] wrote {out}.json and .png")
    ok = (all(f["recovery_s"] is not None for f in res["faults"]) and res["ledger"]["acked_lost"] == 0
          and res["ledger"]["acked_changed"] == 0 and res["ledger"]["money_conserved"]
          and res["replay"]["replay_differs"] == 0 and res["replay"]["state_equal"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
