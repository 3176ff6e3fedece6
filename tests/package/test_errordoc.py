"""The error table (docs/reference/errors.md) matches the code: the page is what ``charon.cli.errordoc`` renders from
the classes, it lists every public exception, each under its kind, with the HTTP status and ``error.type`` the
client really maps back to that class; and the page's example runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from charon import client, errors
from charon.cli import errordoc
from charon.server.wire import STATUS_OF_ERROR

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "errors.md"


def test_the_page_is_generated_from_the_code() -> None:
    assert PAGE.read_text() == errordoc.render(), "regenerate it: python -m charon.cli.errordoc --write"


def test_every_public_exception_is_listed_once_under_its_kind() -> None:
    listed = [cls for classes in errordoc.ROWS.values() for cls in classes]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(errordoc.documented())
    for kind, classes in errordoc.ROWS.items():
        for cls in classes:
            assert cls.kind == kind, cls
            assert issubclass(cls, errors.TransactionAborted) == (kind == errors.ABORT), cls
    # every engine error a reply can carry has its abort class, listed
    assert set(errors.ABORTS.values()) <= set(errordoc.ROWS[errors.ABORT])
    assert all(errors.ABORTS[cls.error_name()] is cls for cls in errors.ABORTS.values())


INVOKE_PATH = [c for c in errordoc.documented() if c.__module__ in ("charon.errors", "charon.client")]


@pytest.mark.parametrize("cls", INVOKE_PATH, ids=lambda c: c.__name__)
def test_the_client_maps_each_status_and_type_back_to_its_class(cls: type[errors.CharonError]) -> None:
    """The gateway's answer for each row (its status and ``error.type``) makes the HTTP client raise that class
    (an abort: exactly that class, with the body's attributes)."""
    status, wire = errordoc.http_status(cls), errordoc.wire_name(cls)
    if not status.isdigit() and status != "5xx":
        pytest.skip(f"{cls.__name__} never crosses HTTP ({status})")
    code = 500 if status == "5xx" else int(status)
    etype = "InsufficientFunds" if cls is errors.TransactionAborted else (
        "Unavailable" if wire == "(any)" else wire)
    if cls.kind != errors.ABORT and not status.endswith("xx") and cls is not client.GatewayUnavailable:
        assert STATUS_OF_ERROR[etype] == code, cls  # the gateway answers this type with this status
    body = {"error": {"type": etype, "message": "m"}}
    if cls.kind == errors.ABORT:
        body |= {"request_id": "r1", "tid": 4, "epoch": 3, "position": 9}
    with pytest.raises(errors.CharonError) as raised:
        client._raise_error(code, body, None)
    exc = raised.value
    assert isinstance(exc, cls), (cls, type(exc))
    if cls.kind == errors.ABORT:
        assert type(exc) is cls and isinstance(exc, errors.TransactionAborted)
        assert (exc.error_type, exc.message, exc.request_id, exc.tid, exc.epoch, exc.position) == (
            etype, "m", "r1", 4, 3, 9)


def test_aborts_survive_pickling() -> None:
    import pickle

    for exc in (errors.TransactionAborted("KeyError", "k", "r", tid=1, epoch=2, position=3),
                errors.UnknownFunctionAborted("no f", "r", tid=1, epoch=2, position=3)):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert vars(back) == vars(exc)


def test_the_pages_example_runs(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(errordoc.EXAMPLE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("InsufficientFunds alice has 0 "), out.stdout
