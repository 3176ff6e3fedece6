"""Who may call which gateway route: bearer tokens with scopes (issue 31).

Scopes:

- ``invoke``: invoke *public* functions (``POST /invoke``, ``POST /batch``) and poll replies
  (``GET /requests/{id}``);
- ``read``: state reads (``/state``, ``/timers``, ``/streams``, ``/admin/state``), the invocation inspector
  (``/admin/requests``), ``/admin/sql``, the dashboard's reads (``/admin/status``, ``/admin/summary``,
  ``/admin/metrics/history``, ``/admin/code/history``, ``/admin/effects``) and ``/metrics``;
- ``admin``: what changes the deployment: pause/resume, rescale, code updates, admin (bulk) updates, dead
  letters, effect retry/abandon, bulk operations (``/admin/bulk/...``);
- ``effects``: effect workers (``charon effects work --url``): submit effect continuations (request ids
  ``fx.<...>.done``, internal functions included) and poll them. Only this scope may use ``fx.`` request ids;
- ``promises``: resolve and reject durable promises (``POST /promises/{id}/resolve|reject``): what a webhook, an
  approver or an agent holds. Listing them needs ``read``; cancelling them and managing schedules, ``admin``.

:data:`ROUTE_SCOPES` gives every route its scopes (any one of them suffices); a route missing from it cannot be
built (``create_app`` raises), and ``tests/server/test_auth.py`` calls every route of the real table with each
scope. ``/health``, ``/openapi.json`` and the dashboard's static files are open.

Tokens come from (both may be given):

- the single ``--token`` / ``CHARON_TOKEN``: one token with every scope, named ``default`` (what a deployment
  had before scopes; it keeps working unchanged);
- a tokens file, ``--tokens-file`` / ``CHARON_TOKENS_FILE`` (TOML)::

      [[token]]
      name = "shop-frontend"
      secret = "a long random string"          # or: sha256 = "<hex digest of the secret>"
      scopes = ["invoke"]

  Names are unique; secrets are at least 16 characters; scopes among :data:`SCOPES`. The file is read again
  when it changes (checked at most once a second): removing a token revokes it without a restart. A file that
  no longer parses revokes every token of the file (fail closed; an error is logged each time it is read) until
  it is fixed: write it atomically (a rename).

A presented token is hashed (SHA-256) and compared with every known token's hash with
:func:`hmac.compare_digest`, all of them each time: the time taken does not depend on which token (or how
much of one) matched. 401 ``Unauthorized`` for a missing or unknown token, 403 ``Forbidden`` for a token
without the route's scope.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from charon.core.context import EFFECT_ID_PREFIX
from charon.server.wire import HTTPError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["SCOPES", "ALL_SCOPES", "ROUTE_SCOPES", "OPEN_ROUTES", "Principal", "ANONYMOUS", "Tokens",
           "TokensFileError", "load_tokens_file", "is_effect_continuation", "scoped_route_app"]

_log = logging.getLogger("charon.server")

SCOPES = ("invoke", "read", "admin", "effects", "promises")
ALL_SCOPES = frozenset(SCOPES)
INVOKE, READ, ADMIN, EFFECTS, PROMISES = SCOPES
#: routes anyone may call (no token asked)
OPEN_ROUTES = frozenset({"health", "openapi", "dashboard", "dashboard_asset"})
#: the scopes each route (by its name) accepts: a token with any one of them may call it
ROUTE_SCOPES: dict[str, frozenset[str]] = {
    "invoke": frozenset({INVOKE}),  # a client's request id is never an engine's (fx. ids: ReservedRequestId)
    "effect_continue": frozenset({EFFECTS}),  # effect workers' continuations (internal functions allowed)
    "batch": frozenset({INVOKE}),
    "request_status": frozenset({INVOKE, EFFECTS}),
    "state": frozenset({READ}),
    "timers": frozenset({READ}),
    "stream": frozenset({READ}),
    "admin_status": frozenset({READ}),
    "admin_summary": frozenset({READ}),
    "admin_metrics_history": frozenset({READ}),
    "admin_code_history": frozenset({READ}),
    "admin_state": frozenset({READ}),
    "admin_sql": frozenset({READ}),
    "admin_requests": frozenset({READ}),
    "admin_request": frozenset({READ}),
    "admin_effects": frozenset({READ}),
    "admin_limits": frozenset({READ}),
    "metrics": frozenset({READ}),
    "admin_dead_letters": frozenset({ADMIN}),
    "admin_pause": frozenset({ADMIN}),
    "admin_resume": frozenset({ADMIN}),
    "admin_rescale": frozenset({ADMIN}),
    "admin_update": frozenset({ADMIN}),
    "admin_code": frozenset({ADMIN}),
    "admin_effect_action": frozenset({ADMIN}),
    # durable promises and schedules (charon.server.promises, charon.server.schedules)
    "promises": frozenset({READ}),
    "promise": frozenset({READ}),
    "promise_settle": frozenset({PROMISES}),  # resolve and reject: what a webhook or an approver holds
    "promise_cancel": frozenset({ADMIN}),
    # workflows (charon.server.workflows): started like an invocation, read like state, cancelled by an operator
    "workflows": frozenset({READ}),
    "workflow": frozenset({READ}),
    "workflow_tree": frozenset({READ}),
    "workflow_start": frozenset({INVOKE}),
    "workflow_cancel": frozenset({ADMIN}),
    "admin_workflow_versions": frozenset({READ}),  # the drain: in-flight workflows per code version
    "admin_workflow_migrate": frozenset({ADMIN}),  # an operator's move of in-flight workflows (audited)
    "schedules": frozenset({READ}),
    "schedule": frozenset({READ}),
    "schedule_create": frozenset({ADMIN}),
    "schedule_action": frozenset({ADMIN}),
    "schedule_delete": frozenset({ADMIN}),
    "admin_limits_change": frozenset({ADMIN}),
    "admin_bulk": frozenset({ADMIN}),  # bulk cancels, pauses, deletes, retries (charon.server.bulk)
}
_NAME = re.compile(r"^[A-Za-z0-9._:@+-]{1,100}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
MIN_SECRET_CHARS = 16
RELOAD_CHECK_S = 1.0  # the tokens file's stat is looked at most this often


def is_effect_continuation(request_id: str | None) -> bool:
    """Whether ``request_id`` is an effect continuation's (``fx.<effect id>.done``, :mod:`charon.runtime.effects`)."""
    return request_id is not None and request_id.startswith(EFFECT_ID_PREFIX) and request_id.endswith(".done")


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the token's name and its scopes."""

    name: str
    scopes: frozenset[str]

    def has(self, scope: str) -> bool:
        return scope in self.scopes


#: every request when no token is configured (development only: ``charon run`` warns)
ANONYMOUS = Principal("anonymous", ALL_SCOPES)


class TokensFileError(ValueError):
    """The tokens file cannot be used (the message says where)."""


@dataclass(frozen=True)
class _Entry:
    digest: bytes  # sha256 of the secret
    principal: Principal


def _digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def _scopes(raw: object, where: str) -> frozenset[str]:
    if not isinstance(raw, list) or not raw or not all(isinstance(s, str) for s in raw):
        raise TokensFileError(f"{where}: scopes must be a non-empty list of {', '.join(SCOPES)}")
    unknown = sorted(set(raw) - ALL_SCOPES)
    if unknown:
        raise TokensFileError(f"{where}: unknown scopes {unknown} (have: {', '.join(SCOPES)})")
    return frozenset(raw)


def load_tokens_file(path: str) -> list[_Entry]:
    """The tokens of a TOML tokens file (see the module docstring); TokensFileError when it is not valid."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise TokensFileError(f"cannot read the tokens file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TokensFileError(f"the tokens file {path} is not valid TOML: {exc}") from None
    unknown = set(doc) - {"token"}
    if unknown:
        raise TokensFileError(f"{path}: unknown keys {sorted(unknown)} (tokens are [[token]] tables)")
    rows = doc.get("token", [])
    if not isinstance(rows, list):
        raise TokensFileError(f"{path}: tokens are [[token]] tables")
    out: list[_Entry] = []
    names: set[str] = set()
    for i, row in enumerate(rows):
        where = f"{path}: token {i + 1}"
        if not isinstance(row, dict):
            raise TokensFileError(f"{where}: not a table")
        extra = set(row) - {"name", "secret", "sha256", "scopes"}
        if extra:
            raise TokensFileError(f"{where}: unknown keys {sorted(extra)} (have: name, secret or sha256, scopes)")
        name = row.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise TokensFileError(f"{where}: name must be 1-100 characters of A-Z a-z 0-9 . _ : @ + -")
        if name in names:
            raise TokensFileError(f"{where}: the name {name!r} is used twice")
        names.add(name)
        secret, hashed = row.get("secret"), row.get("sha256")
        if (secret is None) == (hashed is None):
            raise TokensFileError(f"{where} ({name}): give one of secret or sha256")
        if secret is not None:
            if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS or secret != secret.strip():
                raise TokensFileError(f"{where} ({name}): secret must be a string of at least {MIN_SECRET_CHARS} "
                                      "characters without surrounding spaces")
            digest = _digest(secret)
        else:
            if not isinstance(hashed, str) or not _HEX64.match(hashed):
                raise TokensFileError(f"{where} ({name}): sha256 must be 64 hexadecimal digits")
            digest = bytes.fromhex(hashed)
        out.append(_Entry(digest, Principal(name, _scopes(row.get("scopes"), f"{where} ({name})"))))
    return out


class Tokens:
    """The gateway's tokens: the all-scope ``token`` (if any) and a tokens file's (if any), the file re-read when
    it changes. ``enabled`` is False when neither is given: every request is :data:`ANONYMOUS` (all scopes)."""

    def __init__(self, token: str | None = None, tokens_file: str | None = None,
                 reload_check_s: float = RELOAD_CHECK_S) -> None:
        self._fixed = [_Entry(_digest(token), Principal("default", ALL_SCOPES))] if token else []
        self.path = tokens_file
        self.enabled = bool(token) or tokens_file is not None
        self._reload_check_s = reload_check_s
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._from_file: list[_Entry] = []
        self.file_error: str | None = None  # why the file's tokens are refused now (None: they are in force)
        if tokens_file is not None:
            self._from_file = load_tokens_file(tokens_file)  # a broken file at start: refuse to start
            self._stamp = self._stat()
            self._next_check = time.monotonic() + reload_check_s
        self._entries = self._fixed + self._from_file

    @property
    def names(self) -> list[str]:
        """The names of the tokens in force (never their secrets)."""
        self._maybe_reload()
        return [e.principal.name for e in self._entries]

    def _stat(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _maybe_reload(self) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + self._reload_check_s
            stamp = self._stat()
            if stamp == self._stamp and self.file_error is None:
                return
            self._stamp = stamp
            try:
                entries = load_tokens_file(self.path)
            except TokensFileError as exc:
                if self.file_error is None or stamp is not None:
                    _log.error("the tokens file's tokens are refused until it is fixed: %s", exc,
                               extra={"event": "tokens_file_invalid"})
                self.file_error = str(exc)
                self._from_file = []
            else:
                if self.file_error is not None or [e.principal for e in entries] != \
                        [e.principal for e in self._from_file]:
                    _log.info("tokens file read: %d tokens (%s)", len(entries),
                              ", ".join(e.principal.name for e in entries),
                              extra={"event": "tokens_reloaded", "tokens": len(entries)})
                self.file_error = None
                self._from_file = entries
            self._entries = self._fixed + self._from_file

    def authenticate(self, header: str) -> Principal:
        """The principal of an ``Authorization`` header's bearer token; 401 ``Unauthorized`` otherwise."""
        if not self.enabled:
            return ANONYMOUS
        self._maybe_reload()
        scheme, _, given = header.partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            raise HTTPError("Unauthorized", "missing bearer token")
        digest = _digest(given.encode("utf-8", "surrogateescape"))
        found: Principal | None = None
        for entry in self._entries:  # every one, whichever matches: constant time in the token's content
            if hmac.compare_digest(digest, entry.digest) and found is None:
                found = entry.principal
        if found is None:
            raise HTTPError("Unauthorized", "wrong bearer token")
        return found

    def authorize(self, header: str, scopes: Iterable[str]) -> Principal:
        """:meth:`authenticate`, then 403 ``Forbidden`` unless the token has one of ``scopes``."""
        if not self.enabled:
            return ANONYMOUS
        who = self.authenticate(header)
        need = scopes if isinstance(scopes, frozenset) else frozenset(scopes)
        if who.scopes.isdisjoint(need):
            raise HTTPError("Forbidden", f"the token {who.name!r} lacks the scope this route needs "
                            f"({' or '.join(sorted(need))}; it has {', '.join(sorted(who.scopes))})")
        return who


SCOPES_KEY = "charon.scopes"  # the ASGI scope's entry naming the route's scopes (set by scoped_route_app)


def scoped_route_app(app: ASGIApp, scopes: frozenset[str]) -> ASGIApp:
    """``app`` (a route's ASGI app) with the route's scopes put in the ASGI scope, where the handler's
    ``check_auth`` finds them."""

    async def scoped(scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPES_KEY] = scopes
        await app(scope, receive, send)

    return scoped


def route_scopes(names: Iterable[str], table: Mapping[str, frozenset[str]] = ROUTE_SCOPES) -> None:
    """Raise unless every route name is in ``table`` or open (a new route must be given its scopes)."""
    missing = sorted(n for n in names if n not in table and n not in OPEN_ROUTES)
    if missing:
        raise RuntimeError(f"routes without scopes in charon.server.auth.ROUTE_SCOPES: {missing}")
