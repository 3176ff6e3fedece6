"""CPU cost of the client path over the SQLite logs, per transaction; JSON + PNG.

A :class:`~charon.log.client.LogClient` submits ``--n`` requests open-loop at ``--rate`` per second; a separate
process plays the engine: it reads the input log and writes one reply per request to the output log, in
batches every ``--epoch-ms``. Measured in the client's process: CPU seconds (``time.process_time``, every
thread, so the append and tail threads count) per transaction, which other load on the machine does not
inflate the way it inflates wall-clock time. ``--profile`` prints the client's top functions (cProfile).

    .venv/bin/python benchmarks/log/log_client_cost.py --n 20000 --rate 2000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import shutil
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "log"


def _engine(data: str, n: int, epoch_ms: float) -> None:
    """Reply to every request of the input log, a batch per 'epoch' (the engine's output log writes)."""
    from charon.log.sqlite import InputLog, OutputLog
    from charon.messages import Reply

    inp = InputLog(os.path.join(data, "input.sqlite"))
    out = OutputLog(os.path.join(data, "output.sqlite"))
    starts = [0] * inp.partitions
    done = 0
    epoch = 0
    while done < n:
        time.sleep(epoch_ms / 1000)
        ends = inp.end_offsets()
        rows = inp.read_range(starts, ends)
        starts = ends
        out.put_many([Reply(r.request_id, i, epoch, True, b"\x00", "", "", i) for i, (_, _, r) in enumerate(rows)])
        out.mark_epoch(epoch)
        epoch += 1
        done += len(rows)


async def _client(data: str, n: int, rate: float) -> dict:
    from charon.log.client import LogClient
    from charon.log.sqlite import InputLog, OutputLog

    client = LogClient(InputLog(os.path.join(data, "input.sqlite")), OutputLog(os.path.join(data, "output.sqlite")))
    lat: list[float] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        rep = await client.submit("account", f"a{i % 1000}", "deposit", [1], timeout=120)
        assert rep.ok
        lat.append(time.perf_counter() - t)

    tasks = []
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(n):
        due = w0 + i / rate
        now = time.perf_counter()
        if due > now:
            await asyncio.sleep(due - now)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    lat.sort()
    return {"n": n, "rate": rate, "cpu_s": cpu, "wall_s": wall, "cpu_us_per_tx": cpu / n * 1e6,
            "p50_ms": lat[len(lat) // 2] * 1000, "p99_ms": lat[int(len(lat) * 0.99)] * 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--rates", default="1000,4000")
    ap.add_argument("--epoch-ms", type=float, default=100.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    results = []
    for rate in [float(r) for r in a.rates.split(",")]:
        data = tempfile.mkdtemp(prefix="charon-clientcost-")
        try:
            from charon.log.sqlite import InputLog, OutputLog

            InputLog(os.path.join(data, "input.sqlite"), 4).close()
            OutputLog(os.path.join(data, "output.sqlite")).close()
            eng = mp.get_context("spawn").Process(target=_engine, args=(data, a.n, a.epoch_ms))
            eng.start()
            prof = cProfile.Profile() if a.profile else None
            if prof:
                prof.enable()
            res = asyncio.run(_client(data, a.n, rate))
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
            eng.join()
        finally:
            shutil.rmtree(data, ignore_errors=True)
        res["label"] = a.label
        results.append(res)
        print(f"rate {rate:>6.0f}/s: {res['cpu_us_per_tx']:.0f} µs CPU per tx in the client process "
              f"(p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms, wall {res['wall_s']:.1f} s)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"log_client_cost{'_' + a.label if a.label else ''}"
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar([f"{r['rate']:.0f}/s" for r in results], [r["cpu_us_per_tx"] for r in results])
        ax.set_ylabel("client CPU µs / transaction")
        ax.set_title(f"LogClient over SQLite logs {a.label}".strip())
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
    except ImportError:  # pragma: no cover - matplotlib is in the dev extra
        pass
    print(f"wrote {out / name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
