"""Which engine (and application) a data directory belongs to.

A data directory is created by one engine for one application: ``charon run --engine inprocess`` (a durable
node: ``node.json``, ``input.sqlite``, ``state*``) and ``--engine spark`` (``checkpoint/``, its logs) keep
different layouts under the same default path (``./charon-data``), so running the other engine (or another
application) on it would serve a mix of both. :func:`claim_data_dir` records the owner at creation in
``OWNER_FILE`` (``{"engine", "app"}``) and refuses any other engine or application with :class:`DataDirOwned`
(one line naming the owner). A directory from before the file existed is attributed by its layout.
"""

from __future__ import annotations

import json
import os

from charon.errors import CharonError
from charon.storage.files import write_file_atomic

__all__ = ["OWNER_FILE", "DataDirOwned", "claim_data_dir", "data_dir_owner"]

OWNER_FILE = "charon-owner.json"


class DataDirOwned(CharonError):
    """The data directory belongs to another engine or application."""


def _legacy_engine(path: str) -> str | None:
    """The engine a directory without an owner file was made by, from its layout (None: nothing of either)."""
    if os.path.isdir(os.path.join(path, "checkpoint")):
        return "spark"
    # (not input.sqlite: a Spark deployment on SQLite logs keeps its log there too, before its checkpoint exists)
    if any(os.path.exists(os.path.join(path, f)) for f in ("node.json", "epochs")):
        return "inprocess"
    return None


def data_dir_owner(path: str) -> dict[str, str | None] | None:
    """``{"engine", "app"}`` of the directory's owner (``app`` None when unknown), or None for a fresh one."""
    try:
        with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
            doc = json.load(f)
        return {"engine": str(doc.get("engine")), "app": doc.get("app")}
    except FileNotFoundError:
        engine = _legacy_engine(path)
        return None if engine is None else {"engine": engine, "app": None}
    except (OSError, ValueError, AttributeError) as exc:
        raise DataDirOwned(f"{path}: unreadable {OWNER_FILE} ({exc}); use another --data-dir") from None


def claim_data_dir(path: str, engine: str, app: str | None = None) -> None:
    """Record ``engine`` (and ``app``) as the owner of ``path`` (created if missing), or check that they are.

    Raises :class:`DataDirOwned` naming the owner when another engine (or, both known, another application)
    owns it. ``app`` None: the application is not checked (a programmatic runtime); it is recorded by the
    first claim that names it."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    owner = data_dir_owner(path)
    if owner is not None:
        if owner["engine"] != engine:
            what = f"the {owner['engine']} engine" + (f" (application {owner['app']!r})" if owner["app"] else "")
            raise DataDirOwned(f"{path} belongs to {what}, not the {engine} engine; use another --data-dir")
        if app is not None and owner["app"] is not None and owner["app"] != app:
            raise DataDirOwned(f"{path} belongs to application {owner['app']!r} ({engine} engine), not "
                               f"{app!r}; use another --data-dir")
        if owner["app"] is not None or app is None:
            if os.path.exists(os.path.join(path, OWNER_FILE)):
                return
    write_file_atomic(os.path.join(path, OWNER_FILE), json.dumps({"engine": engine, "app": app}).encode())
