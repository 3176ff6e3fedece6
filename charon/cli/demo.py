"""``charon demo``: the YCSB-T bank deployed end to end, transfers driven through the gateway, invariants
checked (money conserved, every request answered once)."""

from __future__ import annotations

import asyncio
import importlib
import random
import secrets
import shutil
import statistics
import time
from collections import Counter
from types import ModuleType
from typing import TypedDict

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from charon.bench.harness import percentile
from charon.cli.exitcodes import ExitCode
from charon.cli.fail import fail as _fail
from charon.cli.parts import console, make_engine, spark_available
from charon.errors import TransactionAborted
from charon.runtime.contract import Engine
from charon.runtime.factory import EngineSpec

YCSB_REF = "charon.apps.ycsb:app"


class DriveStats(TypedDict):
    """What driving the demo's transfers through the gateway saw."""

    elapsed: float
    committed: int
    aborted: int
    aborts: Counter[str]
    failures: Counter[str]
    latencies: list[float]
    answered: int
    retried: int
    mismatched: int
    touched: dict[str, int | None]  # each account's balance after the run


def _ycsb() -> ModuleType:
    try:
        return importlib.import_module("charon.apps.ycsb")
    except ImportError as exc:
        raise _fail(f"the YCSB-T example app (charon.apps.ycsb) is not available: {exc}", ExitCode.APP_ERROR) from None


async def _drive(
    url: str, token: str, plan: list[tuple[str, str, str, int]], concurrency: int, progress: Progress
) -> DriveStats:
    """Send ``plan`` (request id, debtor, creditor, amount) through the gateway; then retry a sample."""
    from charon.client import AsyncClient

    task = progress.add_task("transfers", total=len(plan), committed=0, aborted=0)
    outcomes: dict[str, tuple[str, int | None]] = {}
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    aborts: Counter[str] = Counter()
    counts = {"committed": 0, "aborted": 0}
    sem = asyncio.Semaphore(concurrency)

    async with AsyncClient(url, token=token, timeout=120.0, retries=5, max_connections=concurrency) as client:

        async def one(rid: str, src: str, dst: str, amount: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    res = await client.invoke_result("account", src, "transfer", dst, amount, request_id=rid)
                    outcomes[rid] = ("committed", res.tid)
                    counts["committed"] += 1
                except TransactionAborted as exc:
                    outcomes[rid] = ("aborted", getattr(exc, "tid", None))
                    aborts[exc.error_type] += 1
                    counts["aborted"] += 1
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    failures[type(exc).__name__] += 1
                latencies.append(time.perf_counter() - t0)
                progress.update(task, advance=1, committed=counts["committed"], aborted=counts["aborted"])

        t_start = time.perf_counter()
        await asyncio.gather(*(one(*p) for p in plan))
        elapsed = time.perf_counter() - t_start

        # exactly once: resending a sample with the same request ids must return the same transactions
        sample = random.Random(len(plan)).sample(plan, min(len(plan), 100))
        mismatched = 0
        for rid, src, dst, amount in sample:
            try:
                res = await client.invoke_result("account", src, "transfer", dst, amount, request_id=rid)
                again: tuple[str, int | None] = ("committed", res.tid)
            except TransactionAborted as exc:
                again = ("aborted", getattr(exc, "tid", None))
            if again != outcomes.get(rid):
                mismatched += 1
        accounts = sorted({p[1] for p in plan} | {p[2] for p in plan})
        touched = await asyncio.gather(*(client.state("account", a) for a in accounts))
    return {
        "elapsed": elapsed,
        "committed": counts["committed"],
        "aborted": counts["aborted"],
        "aborts": aborts,
        "failures": failures,
        "latencies": sorted(latencies),
        "answered": len(outcomes),
        "retried": len(sample),
        "mismatched": mismatched,
        "touched": {a: None if v is None else int(v) for a, v in zip(accounts, touched, strict=True)},
    }


async def _serve_and_drive(
    runtime: Engine, token: str, plan: list[tuple[str, str, str, int]], concurrency: int,
    shape: tuple[int, int, int, float],
) -> DriveStats:
    """Serve the gateway and drive the workload on one event loop (no GIL hand-offs between threads)."""
    import uvicorn

    from charon.server.gateway import create_app
    from charon.server.serve import free_port

    port = free_port()
    gateway = create_app(runtime, token=token, manage_runtime=True)
    server = uvicorn.Server(
        uvicorn.Config(gateway, host="127.0.0.1", port=port, log_level="warning", lifespan="on", access_log=False)
    )
    serving = asyncio.create_task(server.serve())
    with console.status("starting the gateway (and the runtime's epochs)…"):
        while not server.started:
            if serving.done():
                serving.result()
                raise _fail("the gateway stopped during startup", ExitCode.UNAVAILABLE)
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 300
        while runtime.health().get("status") == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the engine is still starting (the Spark gang launching)
    accounts, balance, max_amount, zipf = shape
    console.print(
        f"gateway on http://127.0.0.1:{port}: {accounts} accounts × {balance}, {len(plan)} transfers "
        f"(amounts 1..{max_amount}, zipf {zipf}), {concurrency} in flight"
    )
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("committed [green]{task.fields[committed]}[/] aborted [yellow]{task.fields[aborted]}[/]"),
        TimeElapsedColumn(),
        console=console,
    )
    try:
        with progress:
            return await _drive(f"http://127.0.0.1:{port}", token, plan, concurrency, progress)
    finally:
        server.should_exit = True
        with console.status("stopping the gateway…"):
            await serving


def demo(
    engine: str = typer.Option("auto", help="auto (spark when available), spark or inprocess."),
    accounts: int = typer.Option(1000, min=2, help="Number of accounts."),
    transactions: int = typer.Option(3000, min=1, help="Number of transfers."),
    concurrency: int = typer.Option(64, min=1, help="Transfers in flight at once."),
    balance: int = typer.Option(100, min=0, help="Initial balance of every account."),
    max_amount: int = typer.Option(30, min=1, help="Largest transfer amount."),
    zipf: float = typer.Option(0.0, min=0.0, help="Zipf coefficient of the creditors (0 = uniform)."),
    partitions: int | None = typer.Option(None, min=1, show_default=False,
                                          help="Number of partitions (default: as charon run chooses them)."),
    seed: int = typer.Option(7, help="Workload seed."),
    keep_data: bool = typer.Option(False, "--keep-data", help="Keep the temporary data directory (logs, state, "
                                   "Spark log) after a passing run too."),
) -> None:
    """Deploy the YCSB-T bank end to end, drive transfers through the gateway and check the invariants."""
    import tempfile

    if engine == "auto":
        engine = "spark" if spark_available() else "inprocess"
        if engine == "inprocess":
            console.print(
                "[yellow]note:[/] the Spark runtime is not available here; running on the in-process runtime "
                "(same engine core, in-memory exchange)."
            )
    ycsb = _ycsb()
    token = secrets.token_urlsafe(16)
    initial = ycsb.initial_state(accounts, balance)
    plan = [
        (f"demo-{seed}-{i}", key, args[0], args[1])
        for i, (_, key, _, args) in enumerate(
            ycsb.workload(accounts, transactions, zipf=zipf, seed=seed, max_amount=max_amount)
        )
    ]
    data_dir = tempfile.mkdtemp(prefix="charon-demo-")
    spark_log = None
    runtime: Engine | None = None
    parts = partitions
    try:
        with console.status(f"starting the {engine} runtime…"):
            runtime = make_engine(EngineSpec(engine, YCSB_REF, partitions, data_dir))
            parts = runtime.partitions
            spark_log = runtime.log_file
            if spark_log is not None:
                console.print(f"Spark log: {spark_log}")
        with console.status(f"loading {accounts} accounts…"):
            runtime.load("account", initial)  # before the first epoch
        stats = asyncio.run(_serve_and_drive(runtime, token, plan, concurrency, (accounts, balance, max_amount, zipf)))
        replies_missing = sum(1 for p in plan if runtime.get_reply(p[0]) is None)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except Exception:  # noqa: BLE001 - the one place a traceback is shown: something failed
        console.print_exception()
        raise _fail("the demo failed" + (f"; Spark's own output is in {spark_log}" if spark_log else "")
                    + (f" (data kept in {data_dir})" if data_dir else ""), ExitCode.FAILED) from None
    finally:
        if runtime is not None:
            with console.status("stopping…"):
                runtime.close()

    expected_total = sum(initial.values())
    final_total = expected_total + sum(int(v or 0) - initial.get(k, 0) for k, v in stats["touched"].items())
    conserved = final_total == expected_total
    once = (
        stats["answered"] == transactions
        and not stats["failures"]
        and stats["mismatched"] == 0
        and replies_missing == 0
    )
    lat = stats["latencies"]
    table = Table(title=f"charon demo: YCSB-T transfers on {engine}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_row("engine / partitions", f"{engine} / {parts}")
    table.add_row("accounts × initial balance", f"{accounts} × {balance}")
    table.add_row("transfers sent (in flight)", f"{transactions} ({concurrency})")
    table.add_row("committed", str(stats["committed"]))
    aborts = ", ".join(f"{k} {v}" for k, v in stats["aborts"].most_common()) or "none"
    table.add_row("aborted (typed)", f"{stats['aborted']} ({aborts})")
    if stats["failures"]:
        table.add_row("failed requests", ", ".join(f"{k} {v}" for k, v in stats["failures"].items()))
    table.add_row("duration", f"{stats['elapsed']:.2f} s")
    table.add_row("throughput", f"{transactions / stats['elapsed']:.0f} tx/s")
    table.add_row(
        "latency p50 / p95 / p99",
        " / ".join(f"{percentile(lat, q) * 1000:.1f}" for q in (50, 95, 99)) + " ms",
    )
    if lat:
        table.add_row("latency mean", f"{statistics.fmean(lat) * 1000:.1f} ms")
    table.add_row("total balance before → after", f"{expected_total} → {final_total}")
    table.add_row("balance conserved", "[green]✓[/]" if conserved else "[red]✗[/]")
    table.add_row(
        "every request answered once",
        ("[green]✓[/]" if once else "[red]✗[/]")
        + f" ({stats['answered']}/{transactions} answered; {stats['retried']} resent with the same id, "
        f"{stats['mismatched']} got a different reply; {replies_missing} without a reply)",
    )
    console.print(table)
    if not (conserved and once):
        if data_dir:
            console.print(f"the demo's data (logs, state, Spark log) is kept in {data_dir}")
        raise typer.Exit(ExitCode.FAILED)
    if data_dir and keep_data:
        console.print(f"the demo's data is kept in {data_dir}")
    elif data_dir:
        shutil.rmtree(data_dir, ignore_errors=True)  # a passing demo leaves nothing behind
