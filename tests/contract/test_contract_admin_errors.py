"""One error model for the admin API (issue 25 item 3, issue 26): the same operator mistakes raise the same class
with the same message through the engine's own :class:`~charon.runtime.contract.Controls` (and its inspector),
the blocking HTTP client and the asyncio HTTP client, on every engine (the ``engine`` fixture).

The clients find the class of each answer's ``error.type`` in one table, :data:`charon.errors.ERRORS`; the first
test checks that table against the gateway's statuses without a server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from contract_engines import served

from charon import serde
from charon.apps import ycsb
from charon.client import AsyncClient, Client, Paused, RescaleRunning
from charon.errors import (
    ERRORS,
    BadRequest,
    CharonError,
    EpochNotRetained,
    GatePaused,
    NotSupported,
    RescaleBusy,
    SQLRejected,
    SQLSyntaxError,
    wire_type,
)
from charon.runtime.contract import RequestQuery
from charon.server.wire import STATUS_OF_ERROR

TOKEN = "adm1n"
FAR = 1_000_000  # an epoch no engine reaches in a test


@pytest.mark.parametrize("etype", sorted(ERRORS))
def test_each_typed_answer_is_raised_as_its_class(etype: str) -> None:
    """The gateway answers ``etype`` with its status; the client raises exactly the table's class for it, with
    the message (a 501 NotSupported too, not a GatewayError)."""
    from charon import client

    cls = ERRORS[etype]
    assert wire_type(cls) == etype
    status = STATUS_OF_ERROR[etype]
    with pytest.raises(CharonError) as raised:
        client._raise_error(status, {"error": {"type": etype, "message": "the message"}}, None)
    assert type(raised.value) is cls and str(raised.value) == "the message"


def test_the_clients_admin_classes_are_the_engines() -> None:
    assert RescaleRunning is RescaleBusy and Paused is GatePaused


class Paths:
    """One engine behind a gateway: its controls in-process, and the two HTTP clients."""

    def __init__(self, engine: str, eng: Any, srv: Any) -> None:
        self.engine, self.eng, self.srv = engine, eng, srv
        self.controls = eng.controls
        assert self.controls is not None

    def outcome(self, fn: Callable[[], Any]) -> tuple[type, str, str, tuple[Any, ...]]:
        with pytest.raises(CharonError) as raised:
            fn()
        exc = raised.value
        return type(exc), str(exc), exc.kind, exc.args

    def three(self, inproc: Callable[[], Any], http: Callable[[Client], Any],
              ahttp: Callable[[AsyncClient], Any]) -> list[tuple[type, str, str, tuple[Any, ...]]]:
        """The outcome of the same mistake in-process, through Client and through AsyncClient."""
        with Client(self.srv.url, token=TOKEN, timeout=60, retries=0) as c:
            first, second = self.outcome(inproc), self.outcome(lambda: http(c))

        async def main() -> Any:
            async with AsyncClient(self.srv.url, token=TOKEN, timeout=60, retries=0) as ac:
                return await ahttp(ac)

        return [first, second, self.outcome(lambda: asyncio.run(main()))]

    def run(self, coro: Any) -> Any:
        return self.srv.call(coro, 120)


@pytest.fixture(scope="module")
def paths(engine: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Paths]:
    data_dir = str(tmp_path_factory.mktemp(f"admin-errors-{engine}"))
    with served(engine, "charon.apps.ycsb:app", data_dir, request, token=TOKEN,
                load={"account": ycsb.initial_state(8, 10)}) as (eng, srv):
        with Client(srv.url, token=TOKEN, timeout=120) as c:
            c.invoke("account", ycsb.key(0), "deposit", 1)  # one committed epoch at least
        yield Paths(engine, eng, srv)


SQL_CASES = [
    ("SELEC 1", SQLSyntaxError),
    ("SELECT * FROM nothing_here", SQLSyntaxError),
    ("DROP TABLE account", SQLRejected),
    ("SELECT load_extension('/tmp/x')", SQLRejected),
]


@pytest.mark.parametrize(("query", "cls"), SQL_CASES, ids=[q for q, _ in SQL_CASES])
def test_a_refused_query_is_the_same_error_on_every_path(paths: Paths, query: str, cls: type) -> None:
    got = paths.three(lambda: paths.run(paths.controls.sql(query)), lambda c: c.sql(query),
                      lambda ac: ac.sql(query))
    assert got[0][0] is cls, got
    assert got[1] == got[0] and got[2] == got[0], got


def test_an_epoch_not_retained_is_the_same_error_on_every_path(paths: Paths) -> None:
    reads = paths.three(lambda: paths.run(paths.controls.inspect("account", None, FAR, 10)),
                        lambda c: c.read_state("account", epoch=FAR, limit=9),
                        lambda ac: ac.read_state("account", epoch=FAR, limit=9))
    assert reads[0][0] is EpochNotRetained and str(FAR) in reads[0][1], reads
    assert reads[1] == reads[0] and reads[2] == reads[0], reads
    sql = paths.three(lambda: paths.run(paths.controls.sql("SELECT count(*) FROM account", FAR)),
                      lambda c: c.sql("SELECT count(*) FROM account", FAR),
                      lambda ac: ac.sql("SELECT count(*) FROM account", FAR))
    assert sql[0][0] is EpochNotRetained and sql[1] == sql[0] and sql[2] == sql[0], sql


@pytest.mark.parametrize("bad", [{"status": "exploded"}, {"cursor": "not-a-cursor"}], ids=["status", "cursor"])
def test_a_bad_inspector_filter_is_the_same_error_on_every_path(paths: Paths, bad: dict[str, str]) -> None:
    log = paths.eng.requests
    assert log is not None
    got = paths.three(lambda: log.search(RequestQuery(**bad)), lambda c: c.requests(**bad),
                      lambda ac: ac.requests(**bad))
    assert got[0][0] is BadRequest and isinstance(BadRequest(""), ValueError), got
    assert got[1] == got[0] and got[2] == got[0], got


def test_a_mistake_while_paused_is_the_same_error_on_every_path(paths: Paths) -> None:
    """Paused: an in-process engine refuses a rescale (RescaleBusy, 409 ``RescaleRunning``), Spark an admin
    update that needs epochs (GatePaused, 409 ``Paused``); nothing moves either way."""
    ctl = paths.controls
    paths.run(ctl.pause())
    try:
        if paths.engine == "spark":
            args = serde.encode([1])
            got = paths.three(
                lambda: paths.run(ctl.run_alone("u-paused", "account", "deposit", args, [ycsb.key(1)])),
                lambda c: c.admin_update("u-paused", "account", "deposit", 1, keys=[ycsb.key(1)]),
                lambda ac: ac.admin_update("u-paused", "account", "deposit", 1, keys=[ycsb.key(1)]))
            assert got[0][0] is GatePaused, got
        else:
            before = paths.eng.partitions
            got = paths.three(lambda: paths.run(ctl.rescale(3)), lambda c: c.rescale(3), lambda ac: ac.rescale(3))
            assert got[0][0] is RescaleBusy and paths.eng.partitions == before, got
        assert got[1] == got[0] and got[2] == got[0], got
        assert got[0][2] == "availability"
    finally:
        paths.run(ctl.resume())


def test_an_unsupported_log_rescale_is_the_same_error_on_every_path(paths: Paths) -> None:
    if paths.controls.log_rescalable:
        pytest.skip("this engine rescales its input log")
    got = paths.three(lambda: paths.run(paths.controls.rescale(None, log_partitions=2)),
                      lambda c: c.rescale(log_partitions=2), lambda ac: ac.rescale(log_partitions=2))
    assert got[0][0] is NotSupported and got[1] == got[0] and got[2] == got[0], got
