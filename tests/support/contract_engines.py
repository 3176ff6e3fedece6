"""The contract suite's deployments (tests/contract): one engine of each kind, built by the one factory
(:func:`charon.runtime.factory.make_engine`) exactly as ``charon run`` builds it, behind a real gateway.

``inprocess`` is the volatile in-process engine (``--ephemeral``), ``durable`` the durable node over a data
directory, ``spark`` the Spark engine; it finds the suite's live session (the ``spark`` fixture) instead of
starting one, and its idle source polls every 50 ms (``CHARON_IDLE_WAIT_MS``) to keep the suite short."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from charon.config import GatewayConfig
from charon.runtime.contract import Engine
from charon.runtime.factory import EngineSpec, make_engine
from charon.server.serve import BackgroundServer


def build(engine: str, target: str, data_dir: str, request: pytest.FixtureRequest, *, partitions: int = 2,
          **spec: Any) -> Engine:
    """The ``engine`` kind running ``target`` (``module:attribute``), built by the factory."""
    if engine == "spark":
        request.getfixturevalue("spark")  # the suite's session: the engine's make_session finds it live
        with pytest.MonkeyPatch.context() as mp:  # read once, when the engine's configuration is made
            mp.setenv("CHARON_IDLE_WAIT_MS", "50")
            mp.setenv("CHARON_MASTER", "local[2]")
            return make_engine(EngineSpec("spark", target, partitions=partitions, data_dir=data_dir,
                                          log_partitions=1, **spec))
    if engine == "durable":
        return make_engine(EngineSpec("inprocess", target, partitions=partitions, data_dir=data_dir, fsync=False,
                                      **spec))
    assert engine == "inprocess", engine
    return make_engine(EngineSpec("inprocess", target, partitions=partitions, ephemeral=True, **spec))


@contextmanager
def served(engine: str, target: str, data_dir: str, request: pytest.FixtureRequest, *, token: str,
           load: dict[str, dict[str, Any]] | None = None, config: GatewayConfig | None = None,
           **spec: Any) -> Iterator[tuple[Engine, BackgroundServer]]:
    """The engine behind a started gateway (its initial state ``load``ed first: operator -> key -> value);
    stopped at the end, and an in-process engine's files closed (a Spark engine's close would stop the
    suite's shared session)."""
    eng = build(engine, target, os.path.abspath(data_dir), request, **spec)
    rt: Any = getattr(eng, "rt", eng)  # bulk loading is the runtime's, not part of the contract
    for operator, rows in (load or {}).items():
        rt.load(operator, rows)
    srv = BackgroundServer(eng, token=token, wait_timeout=0.5, config=config).start(120)
    try:
        yield eng, srv
    finally:
        srv.stop(timeout=120)
        if engine != "spark":
            eng.close()
