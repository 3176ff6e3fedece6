"""``file://`` object storage: a local directory, each object one file written atomically (temporary file, fsync,
rename, directory fsync). ETags name a file's version (inode, modification time, size); conditional puts hold an
``flock`` on ``<root>/.lock``, so they fence writers in other processes too."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

from charon.storage.contract import ObjectInfo, ObjectNotFound, StorageConflict

__all__ = ["FileStore", "write_file_atomic"]

_TMP = ".tmp-"


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: str, write: Callable[[BinaryIO], object], fsync: bool) -> str:
    d, name = os.path.split(path)
    tmp = os.path.join(d, f"{_TMP}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return tmp


def write_file_atomic(path: str, data: bytes, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temporary file, fsync, rename, directory fsync)."""
    tmp = _write_tmp(path, lambda f: f.write(data), fsync)
    os.replace(tmp, path)
    if fsync:
        _sync_dir(os.path.dirname(path) or ".")


class FileStore:
    """Objects as files under ``root`` (created if missing)."""

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        self.fsync = fsync
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or p.startswith(_TMP) for p in parts):
            raise ValueError(f"bad object key {key!r}")
        return os.path.join(self.root, *parts)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _store(self, key: str, write: Callable[[BinaryIO], object], if_absent: bool, if_match: str | None) -> str:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = _write_tmp(path, write, self.fsync)
        try:
            if if_absent:
                try:
                    os.link(tmp, path)  # atomic create-only
                except FileExistsError:
                    raise StorageConflict(f"{key} exists") from None
            elif if_match is not None:
                with self._locked():
                    try:
                        have = _etag(os.stat(path))
                    except FileNotFoundError:
                        raise StorageConflict(f"{key} is gone (expected version {if_match})") from None
                    if have != if_match:
                        raise StorageConflict(f"{key} changed (version {have}, expected {if_match})")
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if self.fsync:
            _sync_dir(os.path.dirname(path))
        return _etag(os.stat(path))

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        return self._store(key, lambda f: f.write(data), if_absent, if_match)

    def put_file(self, key: str, path: str, *, if_absent: bool = False, if_match: str | None = None) -> str:
        def copy(f: BinaryIO) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        return self._store(key, copy, if_absent, if_match)

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(), _etag(os.fstat(f.fileno()))
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def get_file(self, key: str, path: str) -> None:
        try:
            src = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        with src:
            tmp = _write_tmp(path, lambda f: shutil.copyfileobj(src, f, 1 << 20), self.fsync)
        os.replace(tmp, path)

    def list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        for d, dirs, names in os.walk(self.root):
            rel = os.path.relpath(d, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if not (base.startswith(prefix) or prefix.startswith(base)):
                dirs.clear()
                continue
            for n in names:
                key = base + n
                if n.startswith(_TMP) or key == ".lock" or not key.startswith(prefix):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(os.path.join(d, n))
                    out.append(ObjectInfo(key, st.st_size, _etag(st)))
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(key))
