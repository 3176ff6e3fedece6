"""CPU cost per request of ``spark_ycsb.py``'s lean load generator, without Spark; JSON + PNG.

``spark_ycsb.py --generator lean`` runs its open-loop generator on the same cores as the engine, so every
µs it spends per request is taken from the engine. This harness runs the generator (``_lean_generator`` of a
``spark_ycsb.py``, by default this checkout's) against a fake engine process that does what the Spark driver
does with the logs: every ``--epoch-ms`` it reads the new input-log entries (``InputLog.read_range``), writes
one reply per request (``OutputLog.put_many``), marks the epoch, and truncates the input log every 50 epochs.

Measured in the generator's process, around the ``_lean_generator`` call only (imports excluded):
CPU seconds (``time.process_time``, user + system) and, with ``perf`` installed, user-space instructions
(``perf stat -e instructions:u`` enabled and disabled around the call through a control FIFO). Instructions
do not depend on what the neighbours on the machine do; CPU time barely does. ``--variant name=ROOT``
runs the ``benchmarks/spark/spark_ycsb.py`` and ``charon`` package under ROOT (e.g. an exported older commit), so a
before/after is one command; variants alternate ``--repeat`` times.

    .venv/bin/python benchmarks/spark/generator_cost.py --rate 16000 --duration 5 --warmup 1
    git archive 2fc19ae | tar -x -C /tmp/gen-before
    .venv/bin/python benchmarks/spark/generator_cost.py --variant before=/tmp/gen-before --variant after=. --repeat 3
    .venv/bin/python benchmarks/spark/generator_cost.py --profile      # cProfile of the generator (top functions)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "spark"


def _engine(data: str, epoch_ms: float, stop: str, compact_every: int = 50) -> None:
    """Reply to every request of the input log, a batch per 'epoch', until the file ``stop`` exists."""
    from charon import serde
    from charon.log.sqlite import InputLog, OutputLog
    from charon.messages import Reply

    inp = InputLog(os.path.join(data, "input.sqlite"))
    out = OutputLog(os.path.join(data, "output.sqlite"))
    starts = inp.start_offsets()
    epoch = 0
    tid = 0
    truncate_to = list(starts)
    while not os.path.exists(stop):
        time.sleep(epoch_ms / 1000)
        ends = inp.end_offsets()
        rows = inp.read_range(starts, ends)
        replies = []
        for pos, (_, _, r) in enumerate(rows):
            tid += 1
            replies.append(Reply(r.request_id, tid, epoch, True, serde.encode(999_990), "", "", pos))
        out.put_many(replies)
        out.mark_epoch(epoch)
        epoch += 1
        if epoch % compact_every == 0:  # the runtime truncates up to a compacted epoch, behind the reads
            inp.truncate(truncate_to)
            truncate_to = list(ends)
        starts = ends


def _child(a: argparse.Namespace) -> None:
    """The generator process: import, then enable perf's counters around the ``_lean_generator`` call."""
    import importlib.util
    import inspect

    root = Path(a.root).resolve()
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("_ycsb_impl", root / "benchmarks" / "spark_ycsb.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # what _lean_generator imports, imported before the counters start (the cost we want is the loop's)
    import charon.apps.ycsb  # noqa: F401
    import charon.bench.harness  # noqa: F401
    import charon.log.sqlite
    import charon.messages  # noqa: F401

    assert Path(charon.log.sqlite.__file__).resolve().is_relative_to(root), charon.log.sqlite.__file__
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    ctl = open(a.ctl, "w") if a.ctl else None  # noqa: SIM115 - kept open across the call
    ack = open(a.ack) if a.ack else None  # noqa: SIM115

    times: list[os.times_result] = []

    def count(on: bool) -> None:
        """Start or stop perf's counters (and the profiler)."""
        times.append(os.times())
        if ctl is not None and ack is not None:
            ctl.write("enable\n" if on else "disable\n")
            ctl.flush()
            ack.readline()
        if prof is not None:
            prof.enable() if on else prof.disable()

    # a generator with an on_clock hook is counted over its open loop; an older one over the whole call
    hook = a.count == "loop" and "on_clock" in inspect.signature(mod._lean_generator).parameters
    kw = {"on_clock": count} if hook else {}
    if not hook:
        count(True)
    c0, w0 = time.process_time(), time.perf_counter()
    mod._lean_generator(a.data, a.rate, a.duration, a.warmup, a.accounts, 0.0, int(a.rate), a.result, **kw)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if not hook:
        count(False)
    res = json.loads(Path(a.result).read_text())
    res.update({"counted_user_s": times[1].user - times[0].user, "counted_sys_s": times[1].system - times[0].system,
                "call_cpu_s": cpu, "call_wall_s": wall, "process_cpu_s": time.process_time(), "counted": (
        "open loop" if hook else "whole call")})
    Path(a.result).write_text(json.dumps(res))
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _perf_instructions(path: str) -> float | None:
    """instructions:u from ``perf stat -x,`` output (None if perf could not count)."""
    for line in Path(path).read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[2].startswith("instructions"):
            try:
                return float(parts[0])
            except ValueError:
                return None
    return None


def run_one(a: argparse.Namespace, name: str, root: str) -> dict:
    """One generator run against a fresh pair of logs and a fresh fake engine."""
    from charon.log.sqlite import InputLog, OutputLog

    data = tempfile.mkdtemp(prefix="charon-gencost-")
    try:
        InputLog(os.path.join(data, "input.sqlite"), 4).close()
        OutputLog(os.path.join(data, "output.sqlite")).close()
        stop = os.path.join(data, "stop")
        eng = mp.get_context("spawn").Process(target=_engine, args=(data, a.epoch_ms, stop))
        eng.start()
        result = os.path.join(data, "result.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--root", root, "--data", data,
               "--result", result, "--rate", str(a.rate), "--duration", str(a.duration), "--warmup",
               str(a.warmup), "--accounts", str(a.accounts), "--count", a.count] + (["--profile"] if a.profile else [])
        perf_out = os.path.join(data, "perf.txt")
        use_perf = a.perf and shutil.which("perf") is not None and not a.profile
        if use_perf:
            ctl, ack = os.path.join(data, "ctl"), os.path.join(data, "ack")
            os.mkfifo(ctl)
            os.mkfifo(ack)
            cmd = ["perf", "stat", "-e", "instructions:u", "-x,", "-o", perf_out, "--delay=-1",
                   f"--control=fifo:{ctl},{ack}", "--", *cmd, "--ctl", ctl, "--ack", ack]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(root).resolve()),
                                                            os.environ.get("PYTHONPATH", "")])}
        load0 = os.getloadavg()[0]
        subprocess.run(cmd, check=True, env=env)
        Path(stop).touch()
        eng.join(30)
        res = json.loads(Path(result).read_text())
        sent = max(1, res["sent"])
        instr = _perf_instructions(perf_out) if use_perf else None
        out = {
            "variant": name, "root": root, "rate": a.rate, "duration_s": a.duration, "warmup_s": a.warmup,
            "epoch_ms": a.epoch_ms, "sent": res["sent"], "unfinished": res["unfinished"],
            "completed": res["completed"], "latency_ms": res["latency_ms"], "counted": res["counted"],
            # over what perf counted (the open loop, or the whole call for a generator without the hook)
            "cpu_us_per_request": (res["counted_user_s"] + res["counted_sys_s"]) / sent * 1e6,
            "user_us_per_request": res["counted_user_s"] / sent * 1e6,
            "system_us_per_request": res["counted_sys_s"] / sent * 1e6,
            "instructions_per_request": instr / sent if instr else None,
            # the whole _lean_generator call (schedule, loop, summary) and the whole process (imports too)
            "call_cpu_us_per_request": res["call_cpu_s"] / sent * 1e6,
            "process_cpu_us_per_request": res["process_cpu_s"] / sent * 1e6,
            "generator_cpu_s": res.get("generator_cpu_s"), "call_wall_s": res["call_wall_s"],
            "load_average": [load0, os.getloadavg()[0]],
        }
        print(f"[gencost] {name}: {out['sent']} requests at {a.rate:.0f}/s; {out['counted']}: "
              f"{out['cpu_us_per_request']:.1f} µs CPU/request (user {out['user_us_per_request']:.1f} + system "
              f"{out['system_us_per_request']:.1f})"
              + (f", {out['instructions_per_request']:,.0f} instructions/request" if instr else "")
              + f"; whole call {out['call_cpu_us_per_request']:.1f} µs, whole process "
              f"{out['process_cpu_us_per_request']:.1f} µs; p50 {res['latency_ms']['p50']:.0f} ms, "
              f"p99 {res['latency_ms']['p99']:.0f} ms, unfinished {res['unfinished']}; load {load0:.1f}", flush=True)
        return out
    finally:
        shutil.rmtree(data, ignore_errors=True)


def summarize_runs(results: list[dict]) -> dict[str, dict]:
    """Per variant: means over its runs of the per-request figures, and what perf counted."""
    keys = ("cpu_us_per_request", "user_us_per_request", "system_us_per_request", "instructions_per_request",
            "call_cpu_us_per_request", "process_cpu_us_per_request")
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["variant"] == name]
        out[name] = {k: statistics.mean(r[k] or 0.0 for r in runs) for k in keys}
        out[name].update(counted=runs[0]["counted"], runs=len(runs),
                         p99_ms=statistics.mean(r["latency_ms"]["p99"] for r in runs))
    return out


def plot(summary: dict[str, dict], rate: float, epoch_ms: float, path: Path) -> None:
    """Bars by variant: CPU µs per request (what perf counted, and the whole call) and instructions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    xs = range(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    counted = [summary[n]["cpu_us_per_request"] for n in names]
    call = [summary[n]["call_cpu_us_per_request"] for n in names]
    ax1.bar([x - 0.2 for x in xs], counted, 0.4, label="counted", color="tab:blue")
    ax1.bar([x + 0.2 for x in xs], call, 0.4, label="whole call", color="tab:gray")
    ax1.set_ylabel("generator CPU µs / request")
    ax1.legend(fontsize=8)
    ins = [summary[n]["instructions_per_request"] / 1000 for n in names]
    ax2.bar(xs, ins, color="tab:orange")
    ax2.set_ylabel("k instructions:u / request (counted)")
    for ax, pos, vals in ((ax1, [x - 0.2 for x in xs], counted), (ax1, [x + 0.2 for x in xs], call),
                          (ax2, list(xs), ins)):
        for x, v in zip(pos, vals, strict=True):
            ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=8)
    labels = [f"{n}\n({summary[n]['counted']})" for n in names]
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), labels, fontsize=8)
    fig.suptitle(f"lean YCSB-T generator at {rate:.0f}/s against a fake engine ({epoch_ms:.0f} ms epochs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=16_000.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--accounts", type=int, default=10_000)
    ap.add_argument("--epoch-ms", type=float, default=200.0, help="the fake engine's reply batch interval")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ROOT",
                    help="a checkout whose benchmarks/spark/spark_ycsb.py and charon/ to run (default: this one)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--count", choices=("loop", "call"), default="loop",
                    help="what perf counts: the open loop (a generator with an on_clock hook; others: the whole call) "
                         "or the whole _lean_generator call (schedule and summary too) for every variant")
    ap.add_argument("--no-perf", dest="perf", action="store_false", help="do not count instructions with perf")
    ap.add_argument("--profile", action="store_true", help="print the generator's cProfile (no perf counts)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--label", default="")
    # the generator process (started by run_one)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ctl", help=argparse.SUPPRESS)
    ap.add_argument("--ack", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    variants = [v.split("=", 1) for v in a.variant] or [["current", str(REPO)]]
    results = [run_one(a, name, root) for _ in range(a.repeat) for name, root in variants]
    if a.profile:
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"generator_cost{'_' + a.label if a.label else ''}"
    summary = summarize_runs(results)
    (out / f"{name}.json").write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary,
                                                  "runs": results, "when": time.time()}, indent=1))
    plot(summary, a.rate, a.epoch_ms, out / f"{name}.png")
    for n, v in summary.items():
        print(f"[gencost] {n} ({v['counted']}, mean of {v['runs']}): {v['cpu_us_per_request']:.1f} µs CPU, "
              f"{v['instructions_per_request']:,.0f} instructions per request; whole call "
              f"{v['call_cpu_us_per_request']:.1f} µs", flush=True)
    print(f"wrote {out / name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
