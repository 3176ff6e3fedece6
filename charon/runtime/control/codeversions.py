"""Code versions and admin updates, shared by every controllable engine.

* :class:`CodeHistory`: the deployed code versions, oldest first (``code.json`` in a durable engine's directory):
  which version an epoch (or a transaction, after a compatible update) ran with.
* :func:`admin_requests` / :func:`update_outcome`: the requests of a run-alone admin update (request ids
  ``__charon_admin:<id>:<key>``, so an update id runs once) and its typed outcome.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence

import msgspec

from charon.messages import Reply, Request
from charon.operator import Application
from charon.runtime.contract import UpdateOutcome

__all__ = ["ADMIN_PREFIX", "CodeHistory", "CodeVersion", "admin_requests", "load_app_ref", "migration_of",
           "update_outcome"]

ADMIN_PREFIX = "__charon_admin:"  # request ids of admin updates (the gateway reserves __charon* for runtimes)


class CodeVersion(msgspec.Struct):
    """One deployed code version: from which epoch on, its label, its module reference, its migration."""

    from_epoch: int
    version: str
    ref: str | None  # "module:attribute"; None: the application the runtime was constructed with
    migration: list[object] | None = None  # [update id, operator, function, encoded args]
    # compatible updates: the first TID on this version (a lower TID started before, on the previous one)
    first_tid: int | None = None


class CodeHistory:
    """The code versions of one engine, oldest first, kept in ``path`` (``None``: in memory only)."""

    def __init__(self, path: str | None, first: CodeVersion) -> None:
        self.path = path
        self.versions: list[CodeVersion] = [first]
        if path is not None and os.path.exists(path):
            with open(path, "rb") as f:
                self.versions = msgspec.json.decode(f.read(), type=list[CodeVersion])

    @property
    def newest(self) -> CodeVersion:
        return self.versions[-1]

    def label(self, epoch: int, tid: int | None = None) -> str:
        """The version epoch ``epoch`` ran (or runs) with; with ``tid``, the version transaction ``tid``
        (committed in ``epoch``) ran with: after a compatible update, one started before it kept the old one."""
        label = self.versions[0].version
        for v in self.versions:
            if v.from_epoch <= epoch and (tid is None or v.first_tid is None or tid >= v.first_tid):
                label = v.version
        return label

    def encoded(self, extra: Sequence[CodeVersion] = ()) -> bytes:
        """The JSON document of the versions (with ``extra`` appended): what ``code.json`` holds."""
        return msgspec.json.encode([*self.versions, *extra])

    def record(self, write: Callable[[str, bytes], None], extra: Sequence[CodeVersion] = ()) -> None:
        """Write the versions (and ``extra``) to :attr:`path` with ``write(path, data)`` (atomic: the commit
        point of an update); a history without a path records nothing."""
        if self.path is not None:
            write(self.path, self.encoded(extra))


def migration_of(entry: CodeVersion) -> tuple[str, str, str, bytes] | None:
    """A version's migration as ``(update id, operator, function, encoded args)`` (args kept as a list in JSON)."""
    if entry.migration is None:
        return None
    uid, op, fn, args = entry.migration
    raw = bytes(args) if isinstance(args, list | bytes | bytearray) else b""
    return str(uid), str(op), str(fn), raw


def load_app_ref(ref: str) -> Application:
    """Import ``module:attribute`` of an installed module (code only comes from what is deployed)."""
    mod, _, attr = ref.partition(":")
    app = getattr(importlib.import_module(mod), attr or "app", None)
    if not isinstance(app, Application):
        raise TypeError(f"{ref} is not a charon.Application")
    return app


def admin_requests(update_id: str, operator: str, function: str, args: bytes, keys: list[str]) -> list[Request]:
    """The requests of admin update ``update_id``: ``operator/key.function(args)`` for each key."""
    marker = f"{ADMIN_PREFIX}{update_id}"
    return [Request(f"{marker}:{k}", operator, k, function, args, time.time()) for k in keys]


def update_outcome(update_id: str, reqs: list[Request], replies: Sequence[Reply | None], epochs: list[int],
                   repeated: bool) -> UpdateOutcome:
    """The outcome of an admin update from its requests' replies."""
    aborted = {r.key: f"{rep.error_type}: {rep.error_message}" for r, rep in zip(reqs, replies, strict=True)
               if rep is not None and not rep.ok}
    seen = sorted({rep.epoch for rep in replies if rep is not None})
    return UpdateOutcome(id=update_id, transactions=len(reqs), committed=sum(1 for rep in replies if rep and rep.ok),
                         aborted=aborted, epochs=epochs or seen, repeated=repeated)
