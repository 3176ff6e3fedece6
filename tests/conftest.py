"""What the whole suite shares: the markers each test gets from where it is and what it uses, the ``--engine``
option with its ``engine`` fixture, the one Spark session (``spark``), and fixtures modules opt in to.

The suite is organized by axis: ``core``, ``state``, ``log``, ``runtime``, ``spark``, ``server``, ``faults``,
``simulation``, ``contract`` (one behaviour, every engine), ``package``, ``bench``; the apps, drivers, helpers
and repros the tests share are in ``support`` (on ``sys.path``, see ``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from charon.core.partition import PartitionUnit

# What PartitionUnit._clear resets: all of it must be empty while the unit says its scratch is fresh.
_SCRATCH = ("buffers", "frames", "touched", "cache", "_clog", "overlay", "dead", "emits", "emitted")


def _check_fresh(unit: PartitionUnit, where: str) -> None:
    if unit._fresh:
        full = [n for n in _SCRATCH if getattr(unit, n)]
        assert not full and unit.fast_layer is None, f"{where}: p{unit.pid} says fresh, holds {full}"


@pytest.fixture
def fresh_means_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Check, wherever the engine relies on it, that a unit's ``_fresh`` flag is true only of an empty scratch:
    ``_clear`` then skips its work and an unreached partition's finalize writes nothing (a flag left set after
    something was put in the scratch would carry one epoch's writes into the next, or drop them)."""
    clear, finalize = PartitionUnit._clear, PartitionUnit._finalize

    def checked_clear(self: PartitionUnit, epoch: int) -> None:
        _check_fresh(self, "_clear")
        clear(self, epoch)

    def checked_finalize(self: PartitionUnit) -> int:
        _check_fresh(self, "_finalize")
        return finalize(self)

    monkeypatch.setattr(PartitionUnit, "_clear", checked_clear)
    monkeypatch.setattr(PartitionUnit, "_finalize", checked_finalize)
    yield


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """A test that ran ``charon run`` in this process (its ``setup_logging``) leaves no writer thread behind to
    write, later, to a stream pytest has closed."""
    yield
    logs = sys.modules.get("charon.server.logs")
    if logs is not None and logs._listener is not None:
        logs.reset_logging()


@pytest.fixture(autouse=True, scope="module")
def _lmdb_closed_after_the_module() -> Iterator[None]:
    """The LMDB environments a module's in-process deployments opened (the simulator's workers, pickled rounds)
    are closed when it ends, as their worker processes' exits would: without it the suite's one process held
    a thousand descriptors (and 16 GiB mappings) by its last modules."""
    from charon.state import lmdbstore

    before = lmdbstore.opened()
    yield
    lmdbstore.close_opened_since(before)


# -- engines ---------------------------------------------------------------------------------------------------
#: The engines a test taking the ``engine`` fixture runs against: the in-process runtime (volatile), the durable
#: single-node engine (the in-process runtime over a data directory) and the Spark runtime (real PySpark).
ENGINES = ("inprocess", "durable", "spark")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine", action="append", choices=ENGINES, default=None,
        help="run the engine-parametrized tests (the `engine` fixture) on this engine only; repeat for several "
             "(default: all of " + ", ".join(ENGINES) + ")",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``engine``: one parameter per selected engine, module-scoped (a module's deployment of an engine is made
    once and its tests grouped by engine)."""
    if "engine" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("engine") or list(ENGINES)
        metafunc.parametrize("engine", [e for e in ENGINES if e in chosen], scope="module")


# -- markers ---------------------------------------------------------------------------------------------------
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers from what a test is and uses (registered in pyproject.toml): ``spark`` (a real PySpark session:
    the ``spark`` fixture or the Spark engine, besides the modules marked so), ``nats`` (a real nats-server),
    ``s3`` (a real SeaweedFS), ``postgres`` (a real PostgreSQL), ``browser`` (headless chromium), ``simulation``
    (the simulator's seeds), ``slow`` (the benchmarks' harness tests and the simulator's thousand seeds here;
    tests over ~20 s mark themselves; see the README's fast subset)."""
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(_TESTS).parts
        axis = rel[0] if len(rel) > 1 else ""
        names = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "spark" in names or params.get("engine") == "spark":
            item.add_marker(pytest.mark.spark)
        if "nats" in item.nodeid.lower() or names & {"nats_url", "nats_server"}:
            item.add_marker(pytest.mark.nats)
        if names & {"seaweed", "s3_env"}:
            item.add_marker(pytest.mark.s3)
        if "pg_cluster" in names:
            item.add_marker(pytest.mark.postgres)
        if "browser" in names:
            item.add_marker(pytest.mark.browser)
        if axis == "simulation":
            item.add_marker(pytest.mark.simulation)
        if axis in ("simulation", "bench"):
            item.add_marker(pytest.mark.slow)
    if getattr(config.option, "dist", "no") == "loadfile":
        _longest_files_first(items)


#: Seconds per test file from a full run (relative figures; scripts/test-durations writes it from a JUnit report).
_DURATIONS = _TESTS / "durations.json"


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Under ``--dist loadfile`` (scripts/test) the workers take whole files in collection order (with
    ``--no-loadscope-reorder``; xdist's default orders them by test count, which put the long Spark files with
    few tests last): the longest files first, so that no worker runs a long file alone at the end. A file not in
    the table (new) runs first: unknown, it may be long, and a long file last is what this order avoids. Within a
    file the order is unchanged."""
    try:
        seconds: dict[str, float] = json.loads(_DURATIONS.read_text())
    except (OSError, ValueError):
        return

    def cost(item: pytest.Item) -> float:
        return -seconds.get(Path(str(item.fspath)).resolve().relative_to(_TESTS.parent).as_posix(), float("inf"))

    items.sort(key=cost)  # stable: a file's tests stay together and in their order


# -- a headless browser ---------------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium, headless, driven by Playwright: one per module (skips with a reason without either)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def shots(tmp_path: Path) -> str:
    """Where a browser test's screenshots go: ``CHARON_DASHBOARD_SCREENSHOTS`` (the docs' images), else tmp."""
    out = os.environ.get("CHARON_DASHBOARD_SCREENSHOTS") or str(tmp_path)
    os.makedirs(out, exist_ok=True)
    return out


# -- the one Spark session -------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def _spark_sessions() -> Iterator[list[Any]]:
    """The sessions the ``spark`` fixture handed out; the live one is stopped once, at the end of the run."""
    made: list[Any] = []
    yield made
    if made:
        made[-1].stop()


@pytest.fixture(scope="module")
def spark(_spark_sessions: list[Any]) -> Any:
    """The suite's one SparkSession (``local[2]``, made by the runtime's own ``make_session``), shared by every
    module that takes it: ``make_session`` returns the live session, and starts a new one in the same JVM only
    when a test stopped it (a Spark runtime's ``close`` stops the session it used). Its
    ``spark.sql.shuffle.partitions`` is 2 (a runtime conf: a module needing another value sets it)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from charon.config import SparkConfig
    from charon.runtime.spark.session import make_session

    session = make_session(SparkConfig(master="local[2]", partitions=2))
    _spark_sessions.append(session)
    return session
