"""The input/output log on SQLite vs NATS JetStream: cost per request of appends (single and batched), range
reads and reply writes, measured in the same run (a real nats-server on 127.0.0.1, started here).

Wall time per request and this process's CPU time per request are both reported (the machine is shared: CPU
time and the SQLite/NATS ratio are the stable figures). Writes ``log_nats.json`` and ``log_nats.png``.

    .venv/bin/python benchmarks/log/log_nats.py --n 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from charon.log.location import open_input_log, open_output_log
from charon.messages import Reply, Request
from charon.runtime.spark.cluster import free_port
from charon.serde import encode

OUT = Path(__file__).resolve().parents[1] / "results" / "log"


def start_nats(root: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    port = free_port()
    proc = subprocess.Popen([binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(400):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"nats://127.0.0.1:{port}/bench"
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("nats-server did not start")


def timed(fn, n: int) -> dict[str, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return {"wall_us": (time.perf_counter() - w) / n * 1e6, "cpu_us": (time.process_time() - c) / n * 1e6}


def measure(in_loc: str, out_loc: str, n: int, batch: int) -> dict[str, dict[str, float]]:
    inp = open_input_log(in_loc, 4)
    out = open_output_log(out_loc)
    reqs = [Request(f"r{i}", "account", f"k{i}", "transfer", encode([f"k{i + 1}", 1]), 0.0) for i in range(n)]
    res: dict[str, dict[str, float]] = {}
    single = n // 4
    res["append (one per call)"] = timed(lambda: [inp.append(r) for r in reqs[:single]], single)
    rest = reqs[single:]
    res[f"append_many ({batch} per call)"] = timed(
        lambda: [inp.append_many(rest[i:i + batch]) for i in range(0, len(rest), batch)], len(rest))
    res["append of a known id (dedup)"] = timed(lambda: [inp.append(r) for r in reqs[:single]], single)
    ends = inp.end_offsets()
    res["read_range (all)"] = timed(lambda: inp.read_range([0] * 4, ends), n)
    reps = [Reply(f"r{i}", i, i // batch, True, encode(i)) for i in range(n)]
    res[f"output put_many ({batch} per call)"] = timed(
        lambda: [out.put_many(reps[i:i + batch]) for i in range(0, n, batch)], n)
    res["output read_since (all)"] = timed(lambda: out.read_since(0, limit=n), n)
    res["output get (by id)"] = timed(lambda: [out.get(f"r{i}") for i in range(0, n, 10)], n // 10)
    inp.close()
    out.close()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--out", default=str(OUT / "log_nats"))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="charon-lognats-"))
    proc, url = start_nats(root / "nats")
    try:
        sqlite = measure(str(root / "in.sqlite"), str(root / "out.sqlite"), args.n, args.batch)
        nats = measure(url, url, args.n, args.batch)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
    doc = {
        "what": "per-request cost of log operations, SQLite (durable=True, fsync per commit) vs NATS JetStream "
                "(nats-server 2.9 on 127.0.0.1, file storage), same run",
        "command": "python benchmarks/log/log_nats.py " + " ".join(sys.argv[1:]),
        "n": args.n, "batch": args.batch, "sqlite": sqlite, "nats": nats,
        "note": "2-core machine shared with other jobs: wall times are disturbed, cpu_us is this process only "
                "(for NATS the server's CPU is not included)",
    }
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(sqlite)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    y = range(len(ops))
    ax.barh([i + 0.2 for i in y], [sqlite[o]["wall_us"] for o in ops], 0.4, label="SQLite")
    ax.barh([i - 0.2 for i in y], [nats[o]["wall_us"] for o in ops], 0.4, label="NATS JetStream")
    ax.set_yticks(list(y), ops)
    ax.set_xscale("log")
    ax.set_xlabel("wall time per request (µs, log scale)")
    ax.legend()
    ax.set_title("Charon logs: SQLite vs NATS JetStream (same run)")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    for o in ops:
        print(f"{o:36s} sqlite {sqlite[o]['wall_us']:9.1f} us  nats {nats[o]['wall_us']:9.1f} us  "
              f"(cpu {sqlite[o]['cpu_us']:.1f} / {nats[o]['cpu_us']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
