"""Code versions and admin updates, shared by every controllable engine.

* :class:`CodeHistory`: the deployed code versions, oldest first (``code.json`` in a durable engine's directory):
  which version an epoch (or a transaction, after a compatible update) ran with.
* :class:`RecordedCode`: the code book (:class:`charon.core.context.CodeBook`) of shipped code-history entries,
  for processes that do not own the history (Spark's executors): workflow version pinning.
* :func:`admin_requests` / :func:`update_outcome`: the requests of a run-alone admin update (request ids
  ``__charon_admin:<id>:<key>``, so an update id runs once) and its typed outcome.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable, Sequence

import msgspec

from charon.messages import Reply, Request
from charon.operator import Application
from charon.runtime.contract import UpdateOutcome

__all__ = ["ADMIN_PREFIX", "CodeHistory", "CodeVersion", "RecordedCode", "admin_requests", "code_entries",
           "load_app_ref", "migration_of", "update_outcome"]

_log = logging.getLogger("charon.code")

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


CodeEntry = tuple[int, str, str | None, int | None]  # (from epoch, version, ref, first TID): what tasks receive


def code_entries(history: CodeHistory) -> tuple[CodeEntry, ...]:
    """The history's entries as shipped to the processes that run partitions (picklable, comparable)."""
    return tuple((v.from_epoch, v.version, v.ref, v.first_tid) for v in history.versions)


class RecordedCode:
    """The code book (:class:`charon.core.context.CodeBook`) of shipped history ``entries``: labels as the owner's
    :meth:`CodeHistory.label`, applications imported with ``load`` by :meth:`preload` only (before an epoch runs,
    never inside a step, where a budget's interrupt could land in the import). Nothing else is consulted, so a
    replay or a relaunched process gets the same answers."""

    def __init__(self, entries: Sequence[CodeEntry], load: Callable[[str], Application]) -> None:
        self.entries = tuple(entries)
        self.history = CodeHistory(None, CodeVersion(0, "1", None))
        self.history.versions = [CodeVersion(e, v, r, None, t) for e, v, r, t in self.entries]
        self.load = load
        self.apps: dict[str, Application] = {}

    def preload(self) -> RecordedCode:
        """Import every entry's application (a failure is logged: a workflow pinned to it fails its next step
        with ``VersionUnavailable``); returns this book."""
        for _, version, ref, _ in self.entries:
            if ref is not None and ref not in self.apps:
                try:
                    self.apps[ref] = self.load(ref)
                except Exception as exc:  # noqa: BLE001 - its pinned steps fail, typed
                    _log.warning("code version %s (%s) cannot be imported: %s: %s", version, ref,
                                 type(exc).__name__, exc)
        return self

    def label_of(self, epoch: int, tid: int) -> str:
        """The code version transaction ``tid`` of ``epoch`` runs with."""
        return self.history.label(epoch, tid)

    def application_of(self, label: str) -> Application | None:
        """The preloaded application of the newest entry labelled ``label`` (None: none, or not importable)."""
        for _, version, ref, _ in reversed(self.entries):
            if version == label:
                return None if ref is None else self.apps.get(ref)
        return None


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
