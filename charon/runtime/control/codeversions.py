"""Code versions and admin updates, shared by every controllable engine.

* :class:`CodeHistory`: the deployed code versions, oldest first (``code.json`` in a durable engine's directory):
  which version an epoch (or a transaction, after a compatible update) ran with.
* :class:`RecordedCode`: the code book (:class:`charon.core.context.CodeBook`) of code-history entries (the node's,
  and shipped to Spark's executors): workflow version pinning; a drained version's application is unloaded
  (``unloaded_at``, decided by :func:`charon.runtime.control.drain.plan_update` and recorded with an update).
* :func:`admin_requests` / :func:`update_outcome`: the requests of a run-alone admin update (request ids
  ``__charon_admin:<id>:<key>``, so an update id runs once) and its typed outcome.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence

import msgspec

from charon.messages import Reply, Request
from charon.operator import Application
from charon.runtime.contract import UpdateOutcome

__all__ = ["ADMIN_PREFIX", "CodeEntry", "CodeHistory", "CodeVersion", "RecordedCode", "admin_requests",
           "code_entries", "forget_module", "load_app_ref", "migration_of", "update_outcome"]

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
    # drained: the epoch of the code update from which its application is no longer loaded (no workflow was in
    # flight on it and it was no longer the current code, :func:`charon.runtime.control.drain.plan_update`)
    unloaded_at: int | None = None


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

    def updated(self, entry: CodeVersion, unload: Collection[str] = ()) -> list[CodeVersion]:
        """The versions after an update that appends ``entry`` and unloads the applications of the labels
        ``unload`` from its epoch on (copies: nothing changes here until the caller recorded and assigned them)."""
        marked = [msgspec.structs.replace(v, unloaded_at=entry.from_epoch)
                  if v.version in unload and v.unloaded_at is None else v for v in self.versions]
        return [*marked, entry]

    def encoded(self, versions: Sequence[CodeVersion] | None = None) -> bytes:
        """The JSON document of ``versions`` (default: this history's): what ``code.json`` holds."""
        return msgspec.json.encode(list(self.versions if versions is None else versions))

    def record(self, write: Callable[[str, bytes], None], versions: Sequence[CodeVersion] | None = None) -> None:
        """Write ``versions`` (default: this history's) to :attr:`path` with ``write(path, data)`` (atomic: the
        commit point of an update); a history without a path records nothing."""
        if self.path is not None:
            write(self.path, self.encoded(versions))


# (from epoch, version, ref, first TID, loaded): what tasks receive; loaded is False once the version drained
CodeEntry = tuple[int, str, str | None, int | None, bool]


def code_entries(history: CodeHistory) -> tuple[CodeEntry, ...]:
    """The history's entries as shipped to the processes that run partitions (picklable, comparable)."""
    return tuple((v.from_epoch, v.version, v.ref, v.first_tid, v.unloaded_at is None) for v in history.versions)


class RecordedCode:
    """The code book (:class:`charon.core.context.CodeBook`) of history ``entries``: labels as the owner's
    :meth:`CodeHistory.label`, applications imported with ``load`` by :meth:`preload` only (before an epoch runs,
    never inside a step, where a budget's interrupt could land in the import). Only the loaded entries' refs are
    held (a drained version's application is unloaded: :attr:`CodeVersion.unloaded_at`); ``base``: the
    application of an entry without a ref (the one the node was built with); ``prior``: the book this one
    replaces, whose applications it reuses. Nothing else is consulted, so a replay or a relaunched process gets
    the same answers."""

    def __init__(self, entries: Sequence[CodeEntry], load: Callable[[str], Application],
                 base: Application | None = None, prior: RecordedCode | None = None) -> None:
        self.entries = tuple(entries)
        self.history = CodeHistory(None, CodeVersion(0, "1", None))
        self.history.versions = [CodeVersion(e, v, r, None, t) for e, v, r, t, _ in self.entries]
        self.load = load
        self.base = base
        self.prior = prior
        self.apps: dict[str, Application] = {}

    @property
    def refs(self) -> list[str]:
        """The refs whose applications this book holds: the newest entry's of each label, if still loaded."""
        newest = {version: (ref, loaded) for _, version, ref, _, loaded in self.entries}
        return list(dict.fromkeys(ref for ref, loaded in newest.values() if loaded and ref is not None))

    def preload(self) -> RecordedCode:
        """Import every loaded entry's application (reused from the prior book if it held it; a failure is
        logged: a workflow pinned to it fails its next step with ``VersionUnavailable``); returns this book,
        which no longer refers to the prior one."""
        held = {} if self.prior is None else self.prior.apps
        self.prior = None
        for ref in self.refs:
            if ref in self.apps:
                continue
            if ref in held:
                self.apps[ref] = held[ref]
                continue
            try:
                self.apps[ref] = self.load(ref)
            except Exception as exc:  # noqa: BLE001 - its pinned steps fail, typed
                version = next(v for _, v, r, _, _ in reversed(self.entries) if r == ref)
                _log.warning("code version %s (%s) cannot be imported: %s: %s", version, ref,
                             type(exc).__name__, exc)
        return self

    def label_of(self, epoch: int, tid: int) -> str:
        """The code version transaction ``tid`` of ``epoch`` runs with."""
        return self.history.label(epoch, tid)

    def application_of(self, label: str) -> Application | None:
        """The preloaded application of the newest entry labelled ``label`` (None: none, unloaded, or not
        importable)."""
        for _, version, ref, _, loaded in reversed(self.entries):
            if version == label:
                if not loaded:
                    return None
                return self.base if ref is None else self.apps.get(ref)
        return None


def forget_module(ref: str, keep: Iterable[object]) -> None:
    """Drop ``ref``'s module from the import cache, so an unloaded version's application is freed once nothing else
    refers to it (a later import of the module, a redeploy, imports it afresh); kept if it holds one of the
    applications in ``keep`` (the ones still loaded, the running one, the one the engine was built with), or is
    Charon's own."""
    name = ref.partition(":")[0]
    module = sys.modules.get(name)
    if module is None or name.split(".")[0] == "charon":
        return
    held = {id(app) for app in keep}
    if not any(id(value) in held for value in vars(module).values()):
        sys.modules.pop(name, None)


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
