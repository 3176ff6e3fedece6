"""The isolation fault suite: one bad thing at a time against a real `charon run`, under a steady load of
unrelated transfers, with this script as the supervisor (a node that exits is started again at once).

For each scenario it reports: whether /health told the truth (a non-200 answer naming the problem while the engine
could not serve, within the watchdog interval of the fault's start for a stuck function); the unrelated transfers'
p50/p99 latency over the scenario and how many failed; the time from the fault to healthy again (``/health`` 200
and a new transfer committed) without a person; that nothing acknowledged was lost (every acknowledged transfer's
reply read back by its request id equals the acknowledged one) and that money is conserved.

    .venv/bin/python benchmarks/recovery/fault_suite.py                       # in-process durable node, every scenario
    .venv/bin/python benchmarks/recovery/fault_suite.py --only spin,sleep     # some of them
    .venv/bin/python benchmarks/recovery/fault_suite.py --engine spark        # the Spark engine (local mode)

Writes ``benchmarks/results/recovery/fault_suite-<engine>.json`` and prints a table. Scenarios:

- ``spin``: a function in an endless loop (budget 1 s).
- ``sleep``: a function blocked 30 s in ``time.sleep`` (its own budget 0.5 s; in-process: stuck, quarantined after
  ``--exit-when-stuck 2``, the node exits 75 and is restarted; Spark: the task's alarm stops it).
- ``die``: a function that kills the process running it, in every attempt (in-process: the node and the first
  restart die, the second restart quarantines it; Spark: the Python worker dies).
- ``killspin`` (issue 31): the node SIGKILLed while an endless function runs inside its budget; the restart's
  replay takes no new verdict (the epoch may have replied): it exits 75 naming the function, and the next restart's
  probe (the step outlives its deadline) quarantines it.
- ``caught`` (issue 31): a function past its budget catches the interrupt; its reply is the verdict
  (InvocationTimeout), then the node is SIGKILLed and restarted: the reply read back is the same.
- ``flood``: pause, 700 async requests of 512 KB (typed 503 past the byte bound), resume; every accepted one
  answered.
- ``sql``: the repros' hostile /admin/sql queries at once (one ran Spark's JVM out of heap, two cross joins).
- ``jvm`` (Spark): the JVM SIGKILLed under load.
- ``nats5`` / ``nats30`` / ``nats120`` (in-process on a NATS log): nats-server stopped that long, then restarted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from charon.bench.engines import free_port, node_command

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "support"  # the apps and helpers the tests share
TOKEN = "fault-suite"
H = {"Authorization": f"Bearer {TOKEN}"}
ACCOUNTS = [f"a{i}" for i in range(20)]
START = 1_000


class Node:
    """`charon run tests/support/hostile_app:app` in its own process; ``ensure()`` restarts it when it exited."""

    def __init__(self, engine: str, data_dir: Path, extra: list[str]) -> None:
        self.engine, self.data_dir, self.extra = engine, data_dir, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.exits: list[tuple[float, int, str]] = []
        self.starts = 0

    def start(self) -> None:
        args = node_command("hostile_app:app", engine=self.engine, port=self.port, token=TOKEN,
                            data_dir=str(self.data_dir), args=self.extra)
        env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "COLUMNS": "300"}
        self.proc = subprocess.Popen(args, cwd=TESTS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.starts += 1

    def ensure(self) -> None:
        """The supervisor: a node that exited is started again at once."""
        if self.proc is not None and self.proc.poll() is not None:
            err = self.proc.stderr.read() if self.proc.stderr else ""  # type: ignore[union-attr]
            self.exits.append((time.monotonic(), self.proc.returncode, err.strip().splitlines()[-1:][0] if err.strip()
                               else ""))
            self.start()

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ensure()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the node did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


class Load:
    """Unrelated transfers in a closed loop (4 workers), each with its own request id; latency and outcome kept."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.stop_ev = threading.Event()
        self.samples: list[tuple[float, float, str]] = []  # (start, latency s, "ok" | "abort" | "error")
        self.acked: dict[str, dict] = {}
        self.sent: set[str] = set()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(4)]

    def _run(self, i: int) -> None:
        import random

        rng = random.Random(i)
        client = httpx.Client(base_url=self.node.url, headers=H, timeout=40)
        while not self.stop_ev.is_set():
            a, b = rng.sample(ACCOUNTS, 2)
            rid = uuid.uuid4().hex
            t0 = time.monotonic()
            kind = "error"
            try:
                with self._lock:
                    self.sent.add(rid)
                r = client.post(f"/invoke/acc/{a}/transfer", json={"args": [b, 1]},
                                headers={"Idempotency-Key": rid})
                if r.status_code in (200, 409) and "request_id" in r.json():
                    kind = "ok" if r.status_code == 200 else "abort"
                    with self._lock:
                        self.acked[rid] = r.json()
            except (httpx.HTTPError, ValueError):
                time.sleep(0.05)
                client.close()
                client = httpx.Client(base_url=self.node.url, headers=H, timeout=40)
            with self._lock:
                self.samples.append((t0, time.monotonic() - t0, kind))
            time.sleep(0.02)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(60)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        with self._lock:
            got = [s for s in self.samples if t0 <= s[0] <= t1]
        lat = sorted(s[1] for s in got if s[2] != "error")
        q = (lambda p: round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1)) if lat else (lambda p: None)
        return {"requests": len(got), "committed": sum(1 for s in got if s[2] == "ok"),
                "errors": sum(1 for s in got if s[2] == "error"), "p50_ms": q(0.5), "p99_ms": q(0.99),
                "max_ms": q(1.0)}


class HealthWatch:
    """/health at 20 Hz: (time, status code, status, latency)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.rows: list[tuple[float, int, str, float]] = []
        self.stop_ev = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        c = httpx.Client(base_url=self.node.url, timeout=5)
        while not self.stop_ev.is_set():
            t0 = time.monotonic()
            try:
                r = c.get("/health")
                self.rows.append((t0, r.status_code, str(r.json().get("status")), time.monotonic() - t0))
            except (httpx.HTTPError, ValueError):
                self.rows.append((t0, 0, "unreachable", time.monotonic() - t0))
                c.close()
                c = httpx.Client(base_url=self.node.url, timeout=5)
                time.sleep(0.05)
            time.sleep(0.05)

    def after(self, t0: float) -> list[tuple[float, int, str, float]]:
        return [r for r in self.rows if r[0] >= t0]


def _fire(node: Node, fn: str, args: list, key: str = "x") -> None:
    """Invoke a hostile function without waiting for it (its own thread; its outcome is read later by id)."""
    def go() -> None:
        try:
            httpx.post(f"{node.url}/invoke/acc/{key}/{fn}", json={"args": args},
                       headers={**H, "Idempotency-Key": f"fault-{fn}"}, timeout=60)
        except httpx.HTTPError:
            pass

    threading.Thread(target=go, daemon=True).start()


def healed_after(node: Node, load: Load, health: HealthWatch, t_fault: float, disrupts: bool,
                 timeout: float = 240) -> float:
    """Seconds from the fault until /health answers 200 and a transfer started after that committed (for a fault
    that makes the node unable to serve, ``disrupts``: after /health first said so)."""
    deadline = time.monotonic() + timeout
    while disrupts and not any(r[1] != 200 for r in health.after(t_fault)) and time.monotonic() < deadline - 180:
        node.ensure()
        time.sleep(0.05)
    while time.monotonic() < deadline:
        node.ensure()
        ok_rows = [r for r in health.after(t_fault) if r[1] == 200]
        bad_rows = [r for r in health.after(t_fault) if r[1] != 200]
        last_bad = max((r[0] for r in bad_rows), default=t_fault)
        good_after = [r for r in ok_rows if r[0] > last_bad]
        if good_after:
            t_ok = good_after[0][0]
            with load._lock:
                commits = [s for s in load.samples if s[0] >= t_ok and s[2] == "ok"]
            if commits:
                return round(min(s[0] + s[1] for s in commits) - t_fault, 2)
        time.sleep(0.1)
    return float("nan")


def check_ledger(node: Node, load: Load) -> dict[str, Any]:
    """Nothing acknowledged lost (each acknowledged reply read back by its id is the same) and money conserved."""
    c = httpx.Client(base_url=node.url, headers=H, timeout=30)
    lost = 0
    for rid, rep in list(load.acked.items()):
        r = c.get(f"/requests/{rid}")
        if r.status_code != 200 and r.status_code != 409:
            lost += 1
            continue
        doc = r.json()
        if doc.get("tid") != rep.get("tid") or doc.get("status") != rep.get("status"):
            lost += 1
    total = 0
    for a in ACCOUNTS:
        total += c.get(f"/state/acc/{a}").json().get("value") or 0
    return {"acked": len(load.acked), "acked_lost_or_changed": lost, "money": total,
            "money_conserved": total == START * len(ACCOUNTS)}


def scenario(engine: str, name: str, workdir: Path, nats: Any = None) -> dict[str, Any]:
    data = workdir / name
    shutil.rmtree(data, ignore_errors=True)
    extra = ["--function-timeout", "1.0"]
    if engine == "inprocess":
        extra += ["--exit-when-stuck", "2", "--no-fsync"]
    if nats is not None:
        extra += ["--log", nats.url + f"/fault{name}"]
    node = Node(engine, data, extra)
    node.start()
    node.wait_healthy()
    c = httpx.Client(base_url=node.url, headers=H, timeout=30)
    for a in ACCOUNTS:
        assert c.post(f"/invoke/acc/{a}/deposit", json={"args": [START]}).status_code == 200
    health = HealthWatch(node)
    health.t.start()
    load = Load(node)
    load.start()
    time.sleep(3)  # a steady state before the fault
    t_fault = time.monotonic()
    detail: dict[str, Any] = {}
    if name == "spin":
        _fire(node, "spin", [])
    elif name == "sleep":
        _fire(node, "sleepy", [30.0])
    elif name == "die":
        _fire(node, "die", [])
    elif name == "killspin":
        _fire(node, "spin", [], key="ks")
        time.sleep(0.5)  # inside its 1 s budget
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
    elif name == "caught":
        _fire(node, "caught", [5.0], key="cx")
        r = httpx.Client(base_url=node.url, headers=H, timeout=30)
        deadline = time.monotonic() + 30
        first = None
        while time.monotonic() < deadline and first is None:
            got = r.get("/requests/fault-caught")
            if got.status_code in (200, 409):
                first = got.json()
            time.sleep(0.1)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        detail = {"caught_reply": (first or {}).get("error", {}).get("type")}
    elif name == "flood":
        assert c.post("/admin/pause", json={}).status_code == 200
        codes: dict[int, int] = {}
        accepted = []
        for i in range(700):  # 700 x 512 KB: past the gateway's default in-flight bound (256 MiB)
            r = c.post(f"/invoke/acc/f{i % 7}/blob?mode=async", json={"args": ["x" * 512_000]},
                       headers={"Idempotency-Key": f"flood-{i}"})
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            if r.status_code == 202:
                accepted.append(f"flood-{i}")
        time.sleep(1)
        assert c.post("/admin/resume", json={}).status_code == 200
        deadline = time.monotonic() + 120
        answered = 0
        while time.monotonic() < deadline:
            answered = sum(1 for rid in accepted if c.get(f"/requests/{rid}").status_code in (200, 409))
            if answered == len(accepted):
                break
            time.sleep(0.5)
        detail = {"flood_codes": codes, "accepted": len(accepted), "accepted_answered": answered}
    elif name == "jvm":  # Spark: SIGKILL the JVM under load
        import psutil

        java = [p for p in psutil.Process(node.proc.pid).children(recursive=True) if "java" in p.name()]
        for p in java:
            p.kill()
        detail = {"jvms_killed": len(java)}
    elif name == "sql":  # the repros' hostile queries: one that ran the JVM out of heap, two concurrent cross joins
        e = "key"
        for _ in range(9):
            e = f"replace({e},'a','aaaaaaaaaa')"
        queries = [f"SELECT length({e}) FROM acc WHERE key = 'a1'"] + [
            "SELECT count(*) FROM acc a, acc b, acc c, acc d, acc e, acc f"] * 2
        answers: list[Any] = []

        def ask(q: str) -> None:
            try:
                r = httpx.post(f"{node.url}/admin/sql", json={"sql": q}, headers=H, timeout=120)
                answers.append((r.status_code, r.json().get("error", {}).get("type")))
            except (httpx.HTTPError, ValueError) as exc:
                answers.append((0, type(exc).__name__))

        ts = [threading.Thread(target=ask, args=(q,)) for q in queries]
        for t in ts:
            t.start()
        for t in ts:
            t.join(150)
        detail = {"sql_answers": answers}
    elif name.startswith("nats"):
        secs = float(name[4:])
        nats.kill()
        time.sleep(secs)
        nats.start()
    disrupts = (name in ("die", "jvm", "killspin", "caught") or name.startswith("nats")
                or (name == "sleep" and engine == "inprocess"))
    healed = healed_after(node, load, health, t_fault, disrupts)
    time.sleep(2)
    t_end = time.monotonic()
    load.stop()
    health.stop_ev.set()
    health.t.join(10)
    rows = health.after(t_fault)
    non_ok = [r for r in rows if r[1] != 200]
    first_bad = round(non_ok[0][0] - t_fault, 2) if non_ok else None
    out = {
        "engine": engine, "scenario": name, "healed_s": healed,
        "health_first_non_200_s": first_bad,
        "health_statuses": sorted({r[2] for r in rows}),
        "health_500": sum(1 for r in rows if r[1] == 500),
        "health_p99_ms": round(sorted(r[3] for r in rows)[int(0.99 * (len(rows) - 1))] * 1000, 1) if rows else None,
        "unrelated": load.window(t_fault, t_end), "restarts": node.starts - 1,
        "exits": [(round(t - t_fault, 2), code, line) for t, code, line in node.exits],
        **detail,
    }
    node.wait_healthy()
    fc = httpx.Client(base_url=node.url, headers=H, timeout=30)
    if name in ("spin", "sleep", "die", "killspin", "caught"):
        fid = {"sleep": "sleepy", "killspin": "spin"}.get(name, name)
        r = fc.get(f"/requests/fault-{fid}")
        out["fault_reply"] = r.json().get("error", {}).get("type") if r.status_code == 409 else r.status_code
        out["dead_letters"] = [d["error_type"] for d in fc.get("/admin/dead-letters").json()["dead_letters"]]
    out.update(check_ledger(node, load))
    node.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="inprocess", choices=["inprocess", "spark"])
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    names = ["spin", "sleep", "die", "killspin", "caught", "flood", "sql"] + (
        ["nats5", "nats30", "nats120"] if args.engine == "inprocess" else ["jvm"])
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="charon-faults-") as tmp:
        nats = None
        if any(n.startswith("nats") for n in names):
            sys.path.insert(0, str(TESTS))
            from natsfix import NatsServer

            nats = NatsServer(Path(tmp) / "nats").start()
        try:
            for n in names:
                print(f"[fault-suite] {args.engine} {n} ...", file=sys.stderr, flush=True)
                res = scenario(args.engine, n, Path(tmp), nats if n.startswith("nats") else None)
                print(json.dumps(res), file=sys.stderr, flush=True)
                results.append(res)
        finally:
            if nats is not None:
                nats.stop()
    doc = {"engine": args.engine, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "results": results}
    out = ROOT / "benchmarks" / "results" / "recovery" / f"fault_suite-{args.engine}.json"
    if not args.only:
        out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'scenario':<10} {'healed s':>9} {'health!=200 at s':>17} {'unrelated p50/p99 ms':>21} {'lost':>5} money")
    for r in results:
        u = r["unrelated"]
        print(f"{r['scenario']:<10} {r['healed_s']:>9} {str(r['health_first_non_200_s']):>17} "
              f"{str(u['p50_ms']) + '/' + str(u['p99_ms']):>21} {r['acked_lost_or_changed']:>5} "
              f"{'ok' if r['money_conserved'] else 'NOT CONSERVED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
