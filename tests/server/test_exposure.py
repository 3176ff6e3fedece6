"""Exposure and credentials over real HTTP (issue 31 item 7): internal functions (continuations, helpers) cannot be
invoked by clients (404 as for a missing function, nothing logged, absent from OpenAPI), and every route asks for
its scope (a table-driven test over the gateway's real route table), with tokens from a tokens file that is
re-read (revocation without a restart) beside the all-scope ``--token``."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from charon import InProcessRuntime
from charon.client import Client, Forbidden, Unauthorized
from charon.runtime.effects import EffectExecutor, engine_resume
from charon.server.auth import OPEN_ROUTES, ROUTE_SCOPES, SCOPES, Tokens, TokensFileError
from charon.server.serve import BackgroundServer, free_port

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))
from exposure_app import app  # noqa: E402

LEGACY = "legacy-all-scope-token"
SECRETS = {scope: f"secret-of-the-{scope}-token" for scope in SCOPES}  # one token per scope
WRONG = "not-a-token-anybody-has"


def tokens_toml(secrets: dict[str, str]) -> str:
    return "".join(f'[[token]]\nname = "{s}-client"\nsecret = "{v}"\nscopes = ["{s}"]\n\n' for s, v in secrets.items())


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def auth(secret: str | None) -> dict[str, str]:
    return {} if secret is None else {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("exposure")
    tokens = tmp / "tokens.toml"
    tokens.write_text(tokens_toml(SECRETS))
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp / "node"))
    eng = rt.engine()
    ex = EffectExecutor(app, lambda: eng.streams, engine_resume(eng.submit))  # its routes exist beside it
    try:
        with BackgroundServer(rt, token=LEGACY, tokens_file=str(tokens), effects=ex) as srv:
            yield srv, eng
    finally:
        rt.close()


def call(srv: BackgroundServer, method: str, path: str, secret: str | None, **kw: Any) -> httpx.Response:
    return httpx.request(method, srv.url + path, headers={**auth(secret), **kw.pop("headers", {})}, timeout=30.0,
                         **kw)


# -- internal functions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [SECRETS["invoke"], LEGACY], ids=["invoke-scope", "all-scope"])
@pytest.mark.parametrize("query", ["", "?mode=sync"], ids=["direct-lane", "asgi-route"])
@pytest.mark.parametrize("target", [("order", "o-forged", "on_checked", [True]),
                                    ("customer", "c-rich", "refund", [1_000_000]),
                                    ("item", "sku-x", "reserve", [1])],
                         ids=lambda t: f"{t[0]}.{t[2]}")
def test_an_internal_function_is_404_like_a_missing_one_and_nothing_is_logged(gateway: Any, secret: str, query: str,
                                                                              target: tuple[Any, ...]) -> None:
    srv, eng = gateway
    op, key, fn, args = target
    rid = f"forged-{op}-{fn}-{secret[:6]}-{len(query)}"
    r = call(srv, "POST", f"/invoke/{op}/{key}/{fn}{query}", secret, json={"args": args},
             headers={"Idempotency-Key": rid})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "UnknownFunction"
    missing = call(srv, "POST", f"/invoke/{op}/{key}/no_such_fn{query}", secret, json={"args": args}).json()["error"]
    assert err == {"type": missing["type"], "message": missing["message"].replace("no_such_fn", fn)}  # the same
    assert fn not in err["message"].split("(have:")[1]  # the public functions only
    # nothing reached the log: neither the gateway nor the runtime knows the id, and no state changed
    assert call(srv, "GET", f"/requests/{rid}", secret).status_code == 404
    assert eng.input_log is not None and not eng.input_log.contains(rid)
    assert call(srv, "GET", f"/state/{op}/{key}", SECRETS["read"]).json()["value"] is None


def test_without_tokens_internal_functions_are_still_404() -> None:
    rt = InProcessRuntime(app, partitions=1)
    try:
        with BackgroundServer(rt) as srv:
            r = call(srv, "POST", "/invoke/customer/c/refund", None, json={"args": [5]})
            assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownFunction", r.text
            assert call(srv, "POST", "/invoke/customer/c/deposit", None, json={"args": [5]}).status_code == 200
    finally:
        rt.close()


def test_a_batch_or_nested_batch_naming_an_internal_function_is_404(gateway: Any) -> None:
    srv, eng = gateway
    calls = [["customer", "c-b", "deposit", [5]], ["customer", "c-b", "refund", [1000]]]
    r = call(srv, "POST", "/batch", SECRETS["invoke"], json={"calls": calls}, headers={"Idempotency-Key": "fb-1"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownFunction", r.text
    assert "batch call 1" in r.json()["error"]["message"]
    r = call(srv, "POST", "/invoke/charon.batch/nb-1/run", SECRETS["invoke"], json={"args": [calls]},
             headers={"Idempotency-Key": "nb-1"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownFunction", r.text
    for rid in ("fb-1", "nb-1"):
        assert not eng.input_log.contains(rid)
    assert call(srv, "GET", "/state/customer/c-b", SECRETS["read"]).json()["value"] is None


def test_internal_functions_run_when_functions_call_them(gateway: Any) -> None:
    srv, _ = gateway
    with Client(srv.url, token=SECRETS["invoke"]) as c:
        c.invoke("customer", "ann", "deposit", 10)
        c.invoke("item", "pen", "restock", 2)
        assert c.invoke("order", "o-ann", "place", "ann", "pen", 7) == "checking"
        assert c.invoke("order", "o-bob", "place", "bob", "pen", 7) == "checking"  # bob has no money
        deadline = time.monotonic() + 20
        while (c.invoke("order", "o-ann", "status"), c.invoke("order", "o-bob", "status")) != ("confirmed", "unpaid"):
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_in_process_invoke_is_trusted() -> None:
    import asyncio

    async def main() -> Any:
        rt = InProcessRuntime(app, partitions=1)
        async with rt:
            await rt.invoke("customer", "c", "refund", 3)  # the operator's own code: no gateway in between
            return rt.engine().read_state("customer", "c")

    assert asyncio.run(main()) == 3


def test_openapi_lists_public_functions_only(gateway: Any) -> None:
    srv, _ = gateway
    doc = httpx.get(srv.url + "/openapi.json").json()
    invokes = sorted(p for p in doc["paths"] if p.startswith("/invoke/"))
    assert invokes == ["/invoke/customer/{key}/deposit", "/invoke/item/{key}/restock", "/invoke/order/{key}/place",
                       "/invoke/order/{key}/status", "/invoke/{operator}/{key}/{function}"]
    text = httpx.get(srv.url + "/openapi.json").text
    for name in ("on_checked", "refund", "reserve", "check"):  # no path, schema or example names them
        assert f"/{name}\"" not in text and f"\"{name}\"" not in text and f".{name}" not in text, name


# -- scopes ------------------------------------------------------------------------------------------------------
PARAMS = {"operator": "order", "key": "k1", "function": "place", "request_id": "no-such-request", "stream": "s1",
          "effect_id": "no-such-effect", "action": "retry", "name": "dashboard.js", "promise_id": "pr.x.1.0.1",
          "resource": "promises", "wid": "w1"}


def _routes(srv: BackgroundServer) -> list[Route]:
    starlette_app = srv.app.app.app  # InvokeLane -> StrictPath -> Starlette
    return [r for r in starlette_app.routes if isinstance(r, Route)]


def test_every_route_has_scopes(gateway: Any) -> None:
    srv, _ = gateway
    names = {r.name for r in _routes(srv)}
    assert names - OPEN_ROUTES <= set(ROUTE_SCOPES), names - OPEN_ROUTES - set(ROUTE_SCOPES)
    assert set(ROUTE_SCOPES) <= names  # the table names real routes (the effect ones exist beside an executor)
    for scopes in ROUTE_SCOPES.values():
        assert scopes and scopes <= set(SCOPES)


def _cases(srv: BackgroundServer) -> list[tuple[str, str, str]]:
    out = []
    for r in _routes(srv):
        method = sorted(m for m in (r.methods or {"GET"}) if m != "HEAD")[0]
        path = r.path_format.format(**{k: v for k, v in PARAMS.items() if "{" + k + "}" in r.path_format})
        out.append((r.name, method, path))
        if r.name == "invoke":
            out.append((r.name, method, path + "?mode=sync"))  # past the direct lane, through the router
    return out


def test_each_scope_is_allowed_or_refused_on_each_route(gateway: Any) -> None:
    """For each route of the real table and each token: no token or an unknown one 401, a token without one of the
    route's scopes 403 ``Forbidden``, one with it gets past authentication (whatever the route then answers: the
    bodies are refused with 415 right after, so nothing is changed)."""
    srv, _ = gateway
    checked = 0
    for name, method, path in _cases(srv):
        body = {"content": b"x", "headers": {"Content-Type": "text/plain"}} if method == "POST" else {}
        if name in OPEN_ROUTES:
            assert call(srv, method, path, None, **body).status_code not in (401, 403), path
            continue
        for secret in (None, WRONG):
            r = call(srv, method, path, secret, **body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized", (path, r.text)
        for scope, secret in [*SECRETS.items(), ("all", LEGACY)]:
            allowed = scope == "all" or scope in ROUTE_SCOPES[name]
            if name == "invoke" and scope == "effects":
                allowed = False  # effect workers submit continuations only (fx. request ids): tested below
            r = call(srv, method, path, secret, **body)
            if allowed:
                assert r.status_code not in (401, 403), (scope, method, path, r.text)
            else:
                assert r.status_code == 403 and r.json()["error"]["type"] == "Forbidden", (scope, path, r.text)
                assert scope in r.json()["error"]["message"] or scope == "effects", r.text
            checked += 1
    assert checked >= 5 * (len(ROUTE_SCOPES) - 1)


def test_effect_continuations_need_the_effects_scope(gateway: Any) -> None:
    """A continuation id is refused on /invoke whatever the token (ReservedRequestId); its own route,
    /effects/continue, takes only a token with the effects scope, and may run an internal function."""
    srv, eng = gateway
    rid = "fx.exposure.77.1.0.done"
    for who, status, etype in (("invoke", 400, "ReservedRequestId"), ("effects", 403, "Forbidden")):
        r = call(srv, "POST", "/invoke/order/o-fx/on_checked", SECRETS[who], json={"args": [True]},
                 headers={"Idempotency-Key": rid})
        assert r.status_code == status and r.json()["error"]["type"] == etype, r.text
    r = call(srv, "POST", "/effects/continue/order/o-fx/on_checked", SECRETS["invoke"], json={"args": [True]},
             headers={"Idempotency-Key": rid})
    assert r.status_code == 403 and "effects" in r.json()["error"]["message"], r.text
    assert not eng.input_log.contains(rid)
    r = call(srv, "POST", "/invoke/order/o-fx/place", SECRETS["effects"], json={"args": ["a", "b", 1]})
    assert r.status_code == 403, r.text  # an effects token is not a client's
    r = call(srv, "POST", "/effects/continue/order/o-fx/on_checked", SECRETS["effects"], json={"args": [True]},
             headers={"Idempotency-Key": rid})
    assert r.status_code == 200 and r.json()["value"] == "confirmed", r.text
    assert call(srv, "GET", f"/requests/{rid}", SECRETS["effects"]).status_code == 200


def test_the_clients_raise_typed_errors(gateway: Any) -> None:
    srv, _ = gateway
    with Client(srv.url, token=SECRETS["read"]) as c, pytest.raises(Forbidden):
        c.invoke("order", "o1", "status")
    with Client(srv.url, token=SECRETS["invoke"]) as c, pytest.raises(Forbidden):
        c.status()
    with Client(srv.url, token=WRONG) as c, pytest.raises(Unauthorized):
        c.invoke("order", "o1", "status")


# -- revocation ----------------------------------------------------------------------------------------------------
def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_tokens_are_revoked_without_a_restart(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    a, b = "first-client-secret-1234", "second-client-secret-5678"
    write_atomically(tokens, tokens_toml({"invoke": a}))
    rt = InProcessRuntime(app, partitions=1)
    try:
        with BackgroundServer(rt, token=LEGACY, tokens_file=str(tokens)) as srv:
            def status(secret: str) -> int:
                return call(srv, "POST", "/invoke/order/o/status", secret, json={"args": []}).status_code

            assert status(a) == 200 and status(b) == 401
            digest = hashlib.sha256(b.encode()).hexdigest()  # a file may hold digests instead of secrets
            write_atomically(tokens, tokens_toml({"read": "unused-secret-000000"})
                             + f'[[token]]\nname = "second"\nsha256 = "{digest}"\nscopes = ["invoke"]\n')
            _until(lambda: status(a) == 401)  # revoked
            assert status(b) == 200  # added
            write_atomically(tokens, "[[token]\nbroken")  # fail closed: the file's tokens stop
            _until(lambda: status(b) == 401)
            assert status(LEGACY) == 200  # the all-scope token is not the file's
            write_atomically(tokens, tokens_toml({"invoke": a}))
            _until(lambda: status(a) == 200)
    finally:
        rt.close()


@pytest.mark.parametrize("text, needle", [
    ('[[token]]\nname = "a"\nsecret = "short"\nscopes = ["invoke"]\n', "at least 16"),
    ('[[token]]\nname = "a"\nsecret = "long-enough-secret-1"\nscopes = ["root"]\n', "unknown scopes"),
    ('[[token]]\nname = "a"\nsecret = "long-enough-secret-1"\nscopes = ["read"]\n' * 2, "used twice"),
    ('[[token]]\nname = "a"\nscopes = ["read"]\n', "one of secret or sha256"),
])
def test_a_bad_tokens_file_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TokensFileError, match=needle):
        Tokens(None, str(path))


# -- charon run ----------------------------------------------------------------------------------------------------
def test_charon_run_warns_about_an_app_without_public_functions_and_refuses_a_bad_tokens_file(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{SUPPORT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    (tmp_path / "bad.toml").write_text("[[token]]\nname = 'x'\n")
    bad = subprocess.run([sys.executable, "-m", "charon.cli", "run", "exposure_app:app", "--ephemeral", "--port",
                          str(free_port()), "--tokens-file", str(tmp_path / "bad.toml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "one of secret or sha256" in bad.stderr, bad.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "charon.cli", "run", "exposure_app:no_public", "--ephemeral",
                             "--port", str(port), "--token", LEGACY], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _until(lambda: _healthy(f"http://127.0.0.1:{port}") or proc.poll() is not None, 30)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert "nopublic has no public function" in err, err


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


def test_a_bulk_operations_item_ids_cannot_be_taken_by_a_client(gateway: Any) -> None:
    """A bulk operation's transactions run under ids derived from its Idempotency-Key (``__charon.bulk:...``). A
    client holding a token who knows (or guesses) the key and computes such an id cannot take it: every route
    taking an Idempotency-Key refuses it with 400 ``ReservedRequestId`` before anything reaches the log, whatever
    the token's scopes; the operation repeated under its key then finds its own transaction, not a client's."""
    srv, eng = gateway
    op = "ops-cancel-2026-11-29"
    body = {"where": {"function": "place"}, "dry_run": True}
    r = call(srv, "POST", "/admin/bulk/invocations/cancel", SECRETS["admin"], json=body,
             headers={"Idempotency-Key": op})
    assert r.status_code == 200 and r.json()["operation"] == op, r.text
    first = r.json()
    digest = hashlib.blake2b("\0".join((op, "invocations", "match", "")).encode(), digest_size=16).hexdigest()
    rid = f"__charon.bulk:{digest}"
    assert eng.input_log.contains(rid), "the derived id is not the one the operation used (update this test)"
    taken = 0
    for secret in (SECRETS["invoke"], LEGACY):
        for method, path, kw in (
                ("POST", "/invoke/order/o-bulk/place", {"json": {"args": ["a", "b", 1]}}),
                ("POST", "/invoke/order/o-bulk/place?mode=sync", {"json": {"args": ["a", "b", 1]}}),
                ("POST", "/admin/bulk/invocations/cancel", {"json": body})):
            r = call(srv, method, path, secret, headers={"Idempotency-Key": rid}, **kw)
            if method == "POST" and path.startswith("/admin") and secret != LEGACY:
                assert r.status_code == 403, r.text  # an invoke token has no admin scope at all
                continue
            assert r.status_code == 400 and r.json()["error"]["type"] == "ReservedRequestId", (path, r.text)
            taken += 1
    assert taken == 5
    r = call(srv, "POST", "/batch", SECRETS["invoke"], headers={"Idempotency-Key": rid},
             json={"calls": [{"operator": "order", "key": "o-bulk", "function": "place", "args": ["a", "b", 1]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "ReservedRequestId", r.text
    again = call(srv, "POST", "/admin/bulk/invocations/cancel", SECRETS["admin"], json=body,
                 headers={"Idempotency-Key": op})
    assert again.status_code == 200 and again.json()["matched"] == first["matched"], again.text
