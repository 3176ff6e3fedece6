"""The opt-in determinism check, on every engine (the ``engine`` fixture), over HTTP: where functions run (the
engine's own thread, or Spark's Python workers) every step runs twice; a function using ``random.random()``
aborts with NonDeterministicFunction naming it and its state write, and commits nothing; deterministic ones
(a recursion through another entity, iterating a set of strings) commit as without the check.

(It replaces the Spark twin of ``tests/core/test_determinism_check.py``, which keeps the check's own tests.)"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from contract_engines import served

from charon.client import Client
from charon.errors import TransactionAborted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "repros"))  # mistakes_app
TOKEN = "d3t"


@pytest.fixture(scope="module")
def client(engine: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    data_dir = str(tmp_path_factory.mktemp(f"determinism-{engine}"))
    with served(engine, "mistakes_app:app", data_dir, request, token=TOKEN, determinism_check=True) as (_, srv), \
            Client(srv.url, token=TOKEN, timeout=120) as c:
        yield c


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
