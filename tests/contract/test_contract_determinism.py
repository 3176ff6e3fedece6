"""The opt-in determinism check, on every engine (the ``engine`` fixture), over HTTP: where functions run (the
engine's own thread, or Spark's Python workers) every step runs twice; a function using ``random.random()``
aborts with NonDeterministicFunction naming it and its state write, and commits nothing; deterministic ones
(a recursion through another entity, iterating a set of strings) commit as without the check.

(It replaces the Spark twin of ``tests/core/test_determinism_check.py``, which keeps the check's own tests.)"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from charon.client import Client
from charon.errors import TransactionAborted
from charon.server.serve import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "repros"))  # mistakes_app
TOKEN = "d3t"


def _make_runtime(engine: str, data_dir: str, request: pytest.FixtureRequest) -> Any:
    if engine == "spark":
        from charon.config import SparkConfig
        from charon.runtime.spark.runtime import SparkRuntime

        cfg = SparkConfig(master="local[2]", data_dir=data_dir, partitions=2, log_partitions=1, idle_wait_ms=50,
                          determinism_check=True)
        return SparkRuntime("mistakes_app:app", cfg, spark=request.getfixturevalue("spark"))
    from mistakes_app import app

    from charon import InProcessRuntime

    durable = {"data_dir": data_dir} if engine == "durable" else {}
    return InProcessRuntime(app, partitions=2, epoch_max_ms=2.0, determinism_check=True, **durable)


@pytest.fixture(scope="module")
def client(engine: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    rt = _make_runtime(engine, str(tmp_path_factory.mktemp(f"determinism-{engine}")), request)
    srv = BackgroundServer(rt, token=TOKEN, wait_timeout=0.5).start()
    try:
        with Client(srv.url, token=TOKEN, timeout=120) as c:
            yield c
    finally:
        srv.stop(timeout=120)
        if engine != "spark":  # the files of an in-process engine (a Spark runtime's close stops the shared session)
            rt.close()


def test_a_nondeterministic_function_aborts_naming_itself_and_commits_nothing(client: Client) -> None:
    with pytest.raises(TransactionAborted) as info:
        client.invoke("acc", "k", "rnd", request_id="rnd-1")
    assert info.value.error_type == "NonDeterministicFunction"
    assert "acc.rnd on key 'k'" in str(info.value), info.value
    assert "state writes (the value of acc 'k')" in str(info.value), info.value
    cut = client.read_state("acc", ["k"])
    assert cut["entities"] == {} and not cut["items"].get("k"), cut  # nothing of rnd committed


def test_deterministic_functions_commit_as_without_the_check(client: Client) -> None:
    assert client.invoke("acc", "r", "recurse_other", 3, request_id="rec-1") == 3
    assert isinstance(client.invoke("acc", "s", "setiter", ["a", "b", "c"], request_id="set-1"), list)  # ok
