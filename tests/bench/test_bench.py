"""The open-loop harness, the report and the PostgreSQL baseline."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from charon.apps import tpcc, ycsb
from charon.bench import harness, report
from charon.runtime.node.inprocess import InProcessRuntime


def test_percentiles_on_known_input() -> None:
    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert harness.percentile(values, 50) == 50
    assert harness.percentile(values, 90) == 90
    assert harness.percentile(values, 99) == 99
    assert harness.percentile(values, 100) == 100
    assert harness.percentile([7.0], 99) == 7.0
    s = harness.latency_summary([1.0, 2.0, 3.0, 4.0])
    assert (s["p50"], s["p90"], s["max"], s["mean"]) == (2.0, 4.0, 4.0, 2.5)


def test_summarize_counts_only_the_measured_window() -> None:
    samples = [{"due": i / 10, "done": i / 10 + 0.010 * (i % 5 + 1), "ok": i % 4 != 0,
                "error_type": "" if i % 4 else "X"} for i in range(100)]
    samples.append({"due": 5.0, "done": None, "ok": False, "error_type": ""})
    r = harness.summarize(samples, rate=10, duration=6.0, warmup=2.0)
    assert r["measured"] == 61  # due in [2.0, 8.0): i = 20..79 plus the unfinished one
    assert r["unfinished"] == 1
    assert r["aborted"] == 15 and r["committed"] == 45
    assert r["committed_per_s"] == pytest.approx(7.5)
    assert r["abort_types"] == {"X": 15}
    assert r["latency_ms"]["max"] == pytest.approx(50.0)
    assert r["latency_ms"]["p50"] == pytest.approx(30.0)


async def test_open_loop_against_the_inprocess_runtime(tmp_path: Path) -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2)
    rt.load("account", ycsb.initial_state(50))

    def gen(rng: random.Random) -> tuple:
        return "account", ycsb.key(rng.randrange(50)), "transfer", [ycsb.key(rng.randrange(50)), 3]

    async with rt:
        r = await harness.run_open_loop(rt, gen, rate=100, duration=1.0, warmup=0.5)
    assert r["sent"] == 150 and r["measured"] == 100
    assert r["committed"] == 100 and r["unfinished"] == 0
    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]
    assert r["epochs"]["count"] > 0 and r["epochs"]["committed_total"] >= 100
    assert sum(rt.read_state("account", ycsb.key(i)) for i in range(50)) == 50 * ycsb.INITIAL_BALANCE
    r.update(experiment="ycsb", system="charon-inprocess")
    harness.save([r], tmp_path / "ycsb.json")
    md = report.write_report(tmp_path, tmp_path / "RESULTS.md", command="test")
    text = md.read_text()
    assert "| charon-inprocess | 100 |" in text and "from the paper" in text
    assert (tmp_path / "ycsb_latency_throughput.png").stat().st_size > 1000


def test_report_keeps_a_marked_section_and_precise_loop_wakes_on_time(tmp_path: Path) -> None:
    md = tmp_path / "RESULTS.md"
    kept = f"{report.KEPT_START}\n## An earlier table\n| row | figure |\n{report.KEPT_END}"
    md.write_text(f"# Benchmark results\n\nold text\n\n{kept}\n\nold tail\n")
    report.write_report(tmp_path, md, command="test")
    text = md.read_text()
    assert kept in text and "old text" not in text and "from the paper" in text

    async def lateness() -> float:  # sleeps of 0.2 ms: epoll rounds each up to 1 ms (0.8 ms late)
        loop = asyncio.get_running_loop()
        late = []
        for _ in range(41):
            due = loop.time() + 0.0002
            await asyncio.sleep(0.0002)
            late.append(loop.time() - due)
        return sorted(late)[20]

    assert harness.run(lateness()) < 0.0006  # the median: typically tens of microseconds


@pytest.fixture(scope="module")
def pg_cluster():
    from charon.bench import postgres

    try:
        cluster = postgres.PostgresCluster()
        cluster.start()
    except Exception as exc:  # only when PostgreSQL cannot be installed or started here
        pytest.skip(f"PostgreSQL unavailable: {exc!r}")
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("isolation", ["serializable", "read_committed"])
async def test_postgres_transfers_conserve_money(pg_cluster, isolation) -> None:
    from charon.bench.postgres import PostgresBaseline, YcsbSql

    sql = YcsbSql()
    sql.setup(pg_cluster.dsn, [("account", ycsb.key(i), 100, None) for i in range(10)])
    rng = random.Random(1)
    reqs = [("account", ycsb.key(rng.randrange(10)), "transfer", [ycsb.key(rng.randrange(10)), rng.randint(1, 60)])
            for _ in range(120)]
    async with PostgresBaseline(pg_cluster.dsn, sql, pool_size=8, isolation=isolation) as pg:
        replies = await asyncio.gather(*(pg.submit(*q[:3], q[3]) for q in reqs))
        again = await pg.submit(*reqs[0][:3], reqs[0][3], request_id=replies[0].request_id)
        conn = await pg._pool.get()
        total = await YcsbSql.total(conn)
        pg._pool.put_nowait(conn)
    assert total == 1000
    assert {r.error_type for r in replies if not r.ok} <= {"NotEnoughCredit"}
    assert any(r.ok for r in replies) and any(not r.ok for r in replies)  # small balances: some overdraw
    assert again == replies[0]


@pytest.mark.parametrize("isolation", ["serializable", "read_committed"])
async def test_postgres_tpcc_keeps_consistency(pg_cluster, isolation) -> None:
    from charon.bench.postgres import PostgresBaseline, TpccSql

    scale = tpcc.Scale(districts=2, customers=30, items=200)
    sql = TpccSql()
    sql.setup(pg_cluster.dsn, tpcc.populate(1, scale))
    rng = random.Random(2)
    reqs = [tpcc.next_request(rng, 1, scale) for _ in range(40)]
    reqs.append(tpcc.new_order_request(rng, 1, scale, rollback=True))
    async with PostgresBaseline(pg_cluster.dsn, sql, pool_size=8, isolation=isolation) as pg:
        replies = await asyncio.gather(*(pg.submit(*q[:3], q[3]) for q in reqs))
        retries = pg.retries
    assert replies[-1].error_type == "UnknownItem"
    assert all(r.ok for r in replies[:-1]), [r for r in replies if not r.ok]
    assert TpccSql.check(pg_cluster.dsn) == []
    if isolation == "read_committed":  # rows locked in a fixed order: no serialization failure, no deadlock
        assert retries == 0


def test_charon_bench_arguments_map_to_the_suite():
    from charon.bench import translate

    assert translate(["ycsb", "--engine", "inprocess,spark", "--rates", "500,1000", "--duration", "3"]) == [
        "--only", "ycsb", "--systems", "inprocess,spark", "--ycsb-rates", "500,1000", "--duration", "3"]
    assert translate(["--engine", "postgres"]) == ["--systems", "postgres"]
    with pytest.raises(SystemExit):
        translate(["nosuch"])


def _spark_ycsb_module():
    """benchmarks/spark/spark_ycsb.py, imported from its file (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "spark" / "spark_ycsb.py"
    spec = importlib.util.spec_from_file_location("spark_ycsb_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("zipf", [0.0, 0.99])
def test_lean_generator_sends_the_seeded_workload_and_matches_every_reply(tmp_path: Path, zipf: float) -> None:
    """spark_ycsb's lean generator against a fake engine thread (reads the input log, writes a reply per request,
    amount 10 fails): the requests are _generator's gen() draw for draw, every reply is matched once, a reply
    of another client is ignored, latencies run from the due time."""
    import json
    import threading
    import time

    from charon import serde
    from charon.log.sqlite import InputLog, OutputLog
    from charon.messages import Reply

    mod = _spark_ycsb_module()
    inp, outp = InputLog(tmp_path / "input.sqlite", 4), OutputLog(tmp_path / "output.sqlite")
    outp.put(Reply("someone-else", 0, 0, True))
    stop = threading.Event()
    seen: list = []

    def engine() -> None:
        starts = [0] * 4
        while not stop.wait(0.03):
            ends = inp.end_offsets()
            rows = inp.read_range(starts, ends)
            starts = ends
            seen.extend(r for _, _, r in rows)
            reps = [Reply(r.request_id, 1, 1, serde.decode(r.args)[1] != 10, b"", error_type=(
                "NotEnoughCredit" if serde.decode(r.args)[1] == 10 else "")) for _, _, r in rows]
            reps.append(Reply(f"other{len(seen)}", 0, 0, False, error_type="Foreign"))
            outp.put_many(reps)

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    calls: list[bool] = []
    t0 = time.time()
    try:
        mod._lean_generator(str(tmp_path), 2000.0, 0.5, 0.25, 100, zipf, 7, str(tmp_path / "r.json"),
                            on_clock=calls.append)
    finally:
        stop.set()
        t.join()
    res = json.loads((tmp_path / "r.json").read_text())
    sampler, rng = ycsb.Zipf(100, zipf), random.Random(7)
    want = []
    for _ in range(1500):  # _generator's gen(rng)
        d = rng.randrange(100)
        want.append((ycsb.key(d), [ycsb.key(sampler.sample(rng)), rng.randint(1, 10)]))
    got = sorted(seen, key=lambda r: int(r.request_id[16:], 16))
    assert [(r.key, serde.decode(r.args)) for r in got] == want
    assert all(r.operator == "account" and r.function == "transfer" and r.ts >= t0 for r in got)
    assert calls == [True, False]
    fails = sum(1 for _, (_, amount) in want[500:] if amount == 10)  # the measured window: due from 0.25 s
    assert res["sent"] == 1500 and res["measured"] == 1000 and res["unfinished"] == 0
    assert res["completed"] == 1000 and res["aborted"] == fails > 0
    assert res["abort_types"] == {"NotEnoughCredit": fails}
    assert 0 < res["latency_ms"]["p50"] <= res["latency_ms"]["max"] < 5000
    assert 0 < res["generator_loop_cpu_s"] <= res["generator_cpu_s"]
