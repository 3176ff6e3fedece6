"""Strict code updates at an epoch boundary (in-process, behind the gateway): under load every transaction
before the boundary ran v1, every one after ran v2 on migrated state; the update survives a restart."""

from __future__ import annotations

import threading
import time

import code_versions
import httpx
import pytest

from charon import InProcessRuntime
from charon.client import Client
from charon.config import GatewayConfig
from charon.errors import CharonError
from charon.server.serve import BackgroundServer

TOKEN = "c0de"
N = 40
CFG = GatewayConfig(code_refs="code_versions:v2, code_versions:v1")


def _runtime(**kw) -> InProcessRuntime:
    rt = InProcessRuntime(code_versions.v1, partitions=4, epoch_max_ms=2.0, **kw)
    rt.load("account", {f"a{i}": 100 for i in range(N)})
    return rt


def test_strict_update_with_migration_under_load() -> None:
    rt = _runtime()
    seen: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    with BackgroundServer(rt, token=TOKEN, config=CFG) as srv, Client(srv.url, token=TOKEN) as c:
        def drive(offset: int) -> None:
            i = offset
            try:
                while not stop.is_set():
                    res = c.invoke_result("account", f"a{i % N}", "deposit", 1)
                    seen.append((res.epoch, res.value[0]))
                    i += 3
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        out = c.update_code("code_versions:v2", "v2", ("account", "migrate", ["EUR"]))
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors
        e = out["from_epoch"]
        assert out["migration"]["committed"] == N and out["migration"]["epochs"][0] == e
        before = [v for ep, v in seen if ep < e]
        after = [v for ep, v in seen if ep >= e]
        assert before and after, "load ran on both sides of the boundary"
        assert set(before) == {"v1"} and set(after) == {"v2"}
        assert not any(ep == e for ep, _ in seen), "the migration epoch held nothing else"
        state = c.read_state("account")["entities"]
        assert all(v["currency"] == "EUR" for v in state.values())
        assert sum(v["balance"] for v in state.values()) == N * 100 + len(seen)
        st = c.status()
        assert st["code_version"] == "v2"
        assert 'version="v2"' in c.metrics()
        r = httpx.post(f"{srv.url}/invoke/account/a1/deposit", json={"args": [1]},
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["code_version"] == "v2" and r.json()["value"][0] == "v2"
        # only deployable refs, typed errors
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for body, status in [({"ref": "os:system", "version": "x"}, 403), ({"ref": "code_versions:v2"}, 400),
                             ({"ref": "code_versions:v2", "version": "v3", "migration": {"op": 1}}, 400)]:
            assert httpx.post(f"{srv.url}/admin/code", json=body, headers=auth).status_code == status, body


def test_update_is_recorded_and_survives_a_restart(tmp_path) -> None:
    data = str(tmp_path / "node")
    rt = _runtime(data_dir=data, fsync=False)
    with BackgroundServer(rt, token=TOKEN, config=CFG) as srv, Client(srv.url, token=TOKEN) as c:
        assert c.invoke("account", "a0", "deposit", 1)[0] == "v1"
        out = c.update_code("code_versions:v2", "v2", ("account", "migrate", ["EUR"]))
        assert c.invoke("account", "a0", "deposit", 1) == ["v2", 102]
        # the CLI: another update (v2 again under a new label; its migration finds nothing left to convert)
        from typer.testing import CliRunner

        from charon.cli import app as cli

        res = CliRunner().invoke(cli, ["deploy", "code_versions:v2", "v2b", "--migrate", "account", "migrate",
                                       '["EUR"]', "--url", srv.url, "--token", TOKEN])
        assert res.exit_code == 0, res.output
        assert '"version":"v2b"' in res.output
        assert c.status()["code_version"] == "v2b"
    rt.close()
    rt = InProcessRuntime(code_versions.v1, partitions=4, data_dir=data, fsync=False)  # started with the old ref
    try:
        assert rt.app is code_versions.v2, "the recorded update is kept"
        assert rt.version_at(out["from_epoch"] - 1) == "1" and rt.version_at(out["from_epoch"]) == "v2"
        assert rt.version_at(rt.epoch) == "v2b"
        assert rt.entities("account")["a0"] == {"balance": 102, "currency": "EUR"}
        with BackgroundServer(rt, token=TOKEN, config=CFG) as srv, Client(srv.url, token=TOKEN) as c:
            assert c.invoke("account", "a0", "deposit", 1) == ["v2", 103]
            with pytest.raises(CharonError) as err:
                c.update_code("code_versions:nosuch", "v9")
            assert err.value.status == 403
            from typer.testing import CliRunner

            from charon.cli import app as cli
            from charon.cli.exitcodes import ExitCode

            res = CliRunner().invoke(cli, ["deploy", "code_versions:nosuch", "v9", "--url", srv.url, "--token",
                                           TOKEN])
            assert res.exit_code == ExitCode.REJECTED, res.output  # a refusal, not "unavailable, retry" (3)
    finally:
        rt.close()


def test_a_migration_interrupted_by_a_crash_is_finished_at_restart(tmp_path) -> None:
    """The update was recorded (code.json) but the process died before its migration epoch was logged."""
    import msgspec

    from charon import serde
    from charon.runtime.control.codeversions import CodeVersion

    data = tmp_path / "node"
    rt = _runtime(data_dir=str(data), fsync=False)
    rt.run_epoch([])
    rt.close()
    migration = ["code-1-v2", "account", "migrate", list(serde.encode(["EUR"]))]
    entries = [CodeVersion(0, "1", None), CodeVersion(1, "v2", "code_versions:v2", migration)]
    (data / "code.json").write_bytes(msgspec.json.encode(entries))
    rt = InProcessRuntime(code_versions.v1, partitions=4, data_dir=str(data), fsync=False)
    try:
        assert rt.app is code_versions.v2
        state = rt.entities("account")
        assert len(state) == N and all(v == {"balance": 100, "currency": "EUR"} for v in state.values())
    finally:
        rt.close()
    rt = InProcessRuntime(code_versions.v1, partitions=4, data_dir=str(data), fsync=False)  # and only once
    try:
        assert all(v == {"balance": 100, "currency": "EUR"} for v in rt.entities("account").values())
    finally:
        rt.close()
