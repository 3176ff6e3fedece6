"""The driver's checkpoint files (``layout.json``, the epoch records under ``epochs/``, the sequencer's bounds under
``bounds/`` and its marker, ``code.json``, ``verdicts.jsonl``, ``recovery.json``) on object storage too.

Without object storage (``SparkConfig.storage_url`` unset) :class:`CheckpointFiles` writes the checkpoint directory
as before. With it, every write goes to the store first (its commit point: a record is created once, with
``If-None-Match``, so a driver that lost its place cannot write over another's), then into the directory, which is a
cache: :meth:`CheckpointFiles.hydrate` (at the driver's start) takes the store's files into it, and a driver on an
empty directory resumes from them. The durable state's partitions (``state*/``) are the executors' and
:class:`~charon.state.durable.DurableState`'s; Spark's query checkpoint (``query/``, the ``jobs`` exchange only) and
the quarantine's probe files stay local.
"""

from __future__ import annotations

import contextlib
import os

from charon.storage.contract import ObjectNotFound, ObjectStore, StorageConflict
from charon.storage.files import write_file_atomic

__all__ = ["CheckpointFiles", "TOP_FILES", "MIRRORED_DIRS"]

#: the checkpoint's single files kept on object storage (by name, under the storage prefix)
TOP_FILES = ("layout.json", "code.json", "verdicts.jsonl", "recovery.json", "sequencer")
#: its directories kept there (every file in them)
MIRRORED_DIRS = ("epochs", "bounds")


class CheckpointFiles:
    """The checkpoint directory ``checkpoint`` and, when ``store`` is given, its copy there (module docstring)."""

    def __init__(self, checkpoint: str, store: ObjectStore | None = None) -> None:
        self.checkpoint = checkpoint
        self.store = store

    def key(self, path: str) -> str:
        """The object key of a file of the checkpoint directory."""
        rel = os.path.relpath(path, self.checkpoint)
        if rel.startswith(".."):
            raise ValueError(f"{path} is not under the checkpoint {self.checkpoint}")
        return rel.replace(os.sep, "/")

    def write(self, path: str, data: bytes) -> None:
        """Replace a file (on object storage first)."""
        if self.store is not None:
            self.store.put(self.key(path), data)
        write_file_atomic(path, data)

    def create(self, path: str, data: bytes) -> None:
        """Write a file that is written once (an epoch record): on object storage created only if absent; one there
        already with other bytes means another driver wrote it (:class:`StorageConflict`)."""
        if self.store is not None:
            key = self.key(path)
            try:
                self.store.put(key, data, if_absent=True)
            except StorageConflict:
                if self.store.get(key)[0] != data:
                    raise
        write_file_atomic(path, data)

    def upload(self, path: str) -> None:
        """Copy a file written in place (an appended verdict) to object storage; nothing without it."""
        if self.store is not None:
            self.store.put_file(self.key(path), path)

    def remove(self, path: str) -> None:
        """Delete a file (on object storage too; a failed delete there is left for the next one)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        if self.store is not None:
            self.store.delete(self.key(path))

    def hydrate(self) -> int:
        """Make the directory's copy of the mirrored files the store's (the store is the truth): download every one
        (replacing the cached one), delete cached records and bounds the store lacks (written locally by a driver
        that died before they reached the store: never committed). A store without ``layout.json`` (a new
        deployment, or a checkpoint directory moving onto object storage) takes the directory's files instead.
        Returns the number of files downloaded."""
        store = self.store
        if store is None:
            return 0
        os.makedirs(self.checkpoint, exist_ok=True)
        try:
            store.get("layout.json")
        except ObjectNotFound:
            self._upload_all()
            return 0
        n = 0
        for name in TOP_FILES:
            path = os.path.join(self.checkpoint, name)
            try:
                store.get_file(name, path)
                n += 1
            except ObjectNotFound:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        for d in MIRRORED_DIRS:
            local = os.path.join(self.checkpoint, d)
            os.makedirs(local, exist_ok=True)
            keys = set()
            for o in store.list(d + "/"):
                keys.add(o.key)
                store.get_file(o.key, os.path.join(self.checkpoint, *o.key.split("/")))
                n += 1
            for name in os.listdir(local):
                if f"{d}/{name}" not in keys and not name.startswith(".tmp-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(local, name))
        return n

    def _upload_all(self) -> None:
        assert self.store is not None
        for d in MIRRORED_DIRS:
            local = os.path.join(self.checkpoint, d)
            for name in sorted(os.listdir(local)) if os.path.isdir(local) else []:
                if not name.startswith(".tmp-"):
                    self.upload(os.path.join(local, name))
        for name in TOP_FILES:  # layout.json last: the store holds a deployment once it is there
            path = os.path.join(self.checkpoint, name)
            if name != "layout.json" and os.path.exists(path):
                self.upload(path)
        path = os.path.join(self.checkpoint, "layout.json")
        if os.path.exists(path):
            self.upload(path)
