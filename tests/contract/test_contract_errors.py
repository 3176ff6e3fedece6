"""One error model (issue 25 item 3): the same aborting transactions raise the same exception class with the same
attributes through the engine's own ``invoke`` (``InProcessRuntime``, the durable node's runtime, ``SparkRuntime``),
the blocking HTTP client and the asyncio HTTP client, on every engine (the ``engine`` fixture).

Each case runs once per path under a request id of its own; for an abort the test also checks the exception's
``request_id``, ``tid``, ``epoch`` and ``position`` against the reply the engine recorded for that id. The first
engine's outcomes are kept, and every later engine in the same run must raise the same (class, error_type,
message)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from contract_engines import served

from charon.client import AsyncClient, Client
from charon.errors import (
    ABORT,
    REFUSAL,
    BadArguments,
    CallGraphLimitExceeded,
    CharonError,
    IllegalAwait,
    SerializationError,
    SerializationErrorAborted,
    TransactionAborted,
    UnknownFunction,
    UnknownFunctionAborted,
)
from charon.server.serve import BackgroundServer

TOKEN = "err0rs"

#: (case, key, function, args, the class raised, error_type of an abort or None for a refusal)
CASES: list[tuple[str, str, str, list[Any], type[CharonError], str | None]] = [
    ("application exception", "u", "withdraw", [5], TransactionAborted, "InsufficientFunds"),
    ("nested abort in a callee", "n", "pay", ["u", 5], TransactionAborted, "InsufficientFunds"),
    ("unknown function in a callee", "f", "calls_unknown", [], UnknownFunctionAborted, "UnknownFunction"),
    ("serialization error", "s", "bad_return", [], SerializationErrorAborted, "SerializationError"),
    ("call-graph limit", "d", "deep", [0], CallGraphLimitExceeded, "CallGraphLimitExceeded"),
    ("illegal await", "a", "sleeps", [], IllegalAwait, "IllegalAwait"),
    ("unknown function requested", "r", "nosuch", [], UnknownFunction, None),
    ("bad arguments", "r", "withdraw", ["ten"], BadArguments, None),
]
IDS = [c[0] for c in CASES]
#: the first engine's outcome of each case: (class, error_type, message, str)
FIRST: dict[str, tuple[type, str | None, str, str]] = {}


class Paths:
    """One engine behind a gateway, and the three ways a user invokes it."""

    def __init__(self, eng: Any, srv: BackgroundServer) -> None:
        self.eng, self.srv = eng, srv
        self.rt: Any = getattr(eng, "rt", eng)  # the engine's runtime: what a user calls in-process

    def runtime(self, key: str, fn: str, args: list[Any], rid: str) -> Any:
        return self.srv.call(self.rt.invoke("bank", key, fn, *args, request_id=rid), 120)

    def client(self, key: str, fn: str, args: list[Any], rid: str) -> Any:
        with Client(self.srv.url, token=TOKEN, timeout=120) as c:
            return c.invoke("bank", key, fn, *args, request_id=rid)

    def async_client(self, key: str, fn: str, args: list[Any], rid: str) -> Any:
        async def main() -> Any:
            async with AsyncClient(self.srv.url, token=TOKEN, timeout=120) as c:
                return await c.invoke("bank", key, fn, *args, request_id=rid)

        return asyncio.run(main())


@pytest.fixture(scope="module")
def paths(engine: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Paths]:
    data_dir = str(tmp_path_factory.mktemp(f"errors-{engine}"))
    with served(engine, "error_model_app:app", data_dir, request, token=TOKEN, load={"bank": {"u": 1}}) as (eng, srv):
        yield Paths(eng, srv)


def _raised(call: Callable[[], Any]) -> CharonError:
    try:
        value = call()
    except CharonError as exc:
        return exc
    raise AssertionError(f"no error: returned {value!r}")


@pytest.mark.parametrize("case,key,fn,args,cls,error_type", CASES, ids=IDS)
def test_every_path_raises_the_same(paths: Paths, engine: str, case: str, key: str, fn: str, args: list[Any],
                                    cls: type[CharonError], error_type: str | None) -> None:
    seen = []
    for path in (paths.runtime, paths.client, paths.async_client):
        rid = f"{engine}-{path.__name__}-{key}-{uuid.uuid4().hex[:8]}"
        exc = _raised(lambda path=path, rid=rid: path(key, fn, args, rid))  # type: ignore[misc]
        assert type(exc) is cls, (path.__name__, type(exc), exc)
        if error_type is None:  # refused before the log: nothing ran, and it is no abort
            assert not isinstance(exc, TransactionAborted) and exc.kind == REFUSAL and not exc.retryable
            assert paths.eng.get_reply(rid) is None, path.__name__
            seen.append((type(exc), None, str(exc), str(exc)))
            continue
        assert isinstance(exc, TransactionAborted) and exc.kind == ABORT and not exc.retryable
        assert exc.error_type == error_type and exc.request_id == rid, (path.__name__, exc.error_type, exc.request_id)
        reply = paths.eng.get_reply(rid)
        assert reply is not None and not reply.ok and reply.error_type == error_type
        assert (exc.tid, exc.epoch, exc.position) == (reply.tid, reply.epoch, reply.position), path.__name__
        assert exc.message == reply.error_message and exc.epoch is not None and exc.epoch >= 0
        seen.append((type(exc), exc.error_type, exc.message, str(exc)))
    assert seen[0] == seen[1] == seen[2], seen
    first = FIRST.setdefault(case, seen[0])
    assert seen[0] == first, (engine, seen[0], first)


def test_nothing_of_the_aborts_was_applied(paths: Paths) -> None:
    """Every abort above left the state as loaded (u holds 1; the other keys were never written)."""
    read = paths.rt.read_state
    assert read("bank", "u") == 1
    assert [read("bank", k) for k in ("n", "f", "s", "d", "a", "r")] == [None] * 6


def test_one_except_clause_per_question() -> None:
    """``except UnknownFunction`` catches the refusal and the abort; ``except TransactionAborted`` only aborts,
    whether the engine or the application raised; an engine abort's ``str`` is its message."""
    abort = UnknownFunctionAborted("bank.nosuch", "r1", tid=3, epoch=2, position=7)
    assert isinstance(abort, UnknownFunction) and isinstance(abort, TransactionAborted)
    assert (abort.error_type, abort.message, str(abort)) == ("UnknownFunction", "bank.nosuch", "bank.nosuch")
    assert (abort.request_id, abort.tid, abort.epoch, abort.position) == ("r1", 3, 2, 7)
    assert not isinstance(UnknownFunction("x"), TransactionAborted)
    assert issubclass(SerializationErrorAborted, SerializationError)
    app_abort = TransactionAborted("InsufficientFunds", "u has 1")
    assert str(app_abort) == "InsufficientFunds: u has 1" and app_abort.tid is None
