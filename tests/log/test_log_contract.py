"""The log contract (:mod:`charon.log.contract`) at run time: both stores (SQLite and NATS) offer every member of
it with the same parameters, and the factories hand out what it declares. (The type checker proves the same
statically, at the end of :mod:`charon.log.location`; this catches what it cannot see, e.g. a parameter renamed in
one store only, and runs without it.)"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from charon.log import contract, open_input_log, open_output_log
from charon.log.nats import NatsInputLog, NatsOutputLog
from charon.log.sqlite import InputLog, OutputLog

CASES = [(contract.InputLogLike, InputLog), (contract.InputLogLike, NatsInputLog),
         (contract.OutputLogLike, OutputLog), (contract.OutputLogLike, NatsOutputLog)]


def members(proto: type) -> dict[str, object]:
    """The members a protocol declares (its own namespace, without the machinery of ``Protocol``)."""
    return {n: v for n, v in vars(proto).items()
            if not n.startswith("_") or n in ("__enter__", "__exit__")}


def params(fn: Any) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def has(impl: type, name: str) -> bool:
    """A class member, or an attribute its ``__init__`` (or a base's) sets."""
    return hasattr(impl, name) or any(
        f"self.{name} = " in inspect.getsource(c) for c in impl.__mro__ if c.__module__.startswith("charon."))


def mismatches(proto: type, impl: type) -> list[str]:
    bad = []
    for name, declared in members(proto).items():
        if not has(impl, name):
            bad.append(f"{impl.__name__} lacks {name}")
        elif callable(declared) and params(getattr(impl, name)) != params(declared):
            bad.append(f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))} is not "
                       f"{proto.__name__}.{name}{inspect.signature(declared)}")
    return bad


@pytest.mark.parametrize(("proto", "impl"), CASES, ids=lambda c: c.__name__)
def test_both_stores_offer_the_whole_contract(proto: type, impl: type) -> None:
    assert len(members(proto)) > 15  # the check sees the members
    assert mismatches(proto, impl) == []


def test_the_check_sees_a_missing_member_or_another_signature() -> None:
    class Partial:
        path = "x"

        def put(self, reply: object, extra: int = 0) -> bool:
            return True

    bad = mismatches(contract.OutputLogLike, Partial)
    assert "Partial lacks get" in bad
    assert any(b.startswith("Partial.put(") for b in bad)


def test_the_factories_and_the_members_the_log_client_relies_on(tmp_path: Path) -> None:
    with open_input_log(tmp_path / "in.sqlite") as inp, open_output_log(tmp_path / "out.sqlite") as out:
        assert isinstance(inp, InputLog) and isinstance(out, OutputLog)
        assert inp.atomic_batches is True and NatsInputLog.atomic_batches is False
        assert isinstance(out.version(), int)
        assert NatsOutputLog.version(object.__new__(NatsOutputLog)) is None  # read on every pass
