"""Safe SQL over state for the dashboard's SQL box (``/admin/sql``), one sandbox for both runtimes.

A query never runs inside the engine (not in its process, not in Spark's JVM): a failure of the query is
contained and typed. The runtime reads the operators the query names at one epoch boundary (the latest
committed epoch, or an earlier one the durable copy retains) from its committed-state read path, writes those
store rows once to a temporary SQLite file, and a child process (:mod:`charon.runtime.control.sqlchild`) builds one
table per operator, columns ``key``, ``item``, ``value``, ``value_json``, ``epoch`` (SQLite keeps each
``value`` with its own type; the engine's internal entries, an entity's pending timers, are left out as
``charon read`` leaves them out), and runs the query. The child limits itself first: address space
(``sql_max_memory``, ``RLIMIT_AS``), CPU time, the lowest CPU priority (``nice 19``: the engine's epochs are
never starved); it is killed at ``sql_timeout_s``. SQLite's authorizer is the check, here on an empty schema
(prepare only: the query does not run in this process) and again in the child: a single ``SELECT`` that
reads only those tables and calls only :data:`ALLOWED_FUNCTIONS`; anything else (``ATTACH``, ``PRAGMA``,
writes, DDL, recursive CTEs, ``load_extension``, other tables, unknown functions) is refused. At most
``sql_max_rows`` rows and ``sql_max_result_bytes`` bytes of JSON (:class:`SQLResultTooLarge`); an operator
larger than ``max_entities`` is refused (:class:`StateTooLarge`: use ``charon sql`` for big states); a query
that needs more memory than the sandbox has is :class:`SQLTooExpensive`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from charon.core.timers import ITEM_PREFIX
from charon.errors import CharonError, EngineUnavailable
from charon.runtime.contract import (
    SQLRejected,
    SQLResultTooLarge,
    SQLSyntaxError,
    SQLTimeout,
    SQLTooExpensive,
)

__all__ = ["ALLOWED_FUNCTIONS", "sqlite_sql", "referenced_tables", "user_rows"]


#: SQLite functions a query may call (aggregates, arithmetic, strings, JSON, conditionals).
ALLOWED_FUNCTIONS = frozenset({
    "sum", "total", "count", "avg", "min", "max", "group_concat", "string_agg", "abs", "round", "coalesce",
    "ifnull", "iif", "nullif", "lower", "upper", "length", "substr", "substring", "trim", "ltrim", "rtrim",
    "replace", "instr", "typeof", "cast", "json_extract", "json_type", "json_valid",
    "json_array_length", "json_object", "json_array", "json", "row_number", "rank", "dense_rank", "lag",
    "lead", "ntile", "like", "glob", "likely", "unlikely", "sign", "floor", "ceil", "ceiling", "pow", "power",
    "sqrt", "mod", "hex", "quote", "concat", "concat_ws",
})

_ALLOW, _DENY = sqlite3.SQLITE_OK, sqlite3.SQLITE_DENY
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sqlchild.py")
_FIRST_WORD = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?(?:\*/|$)|\()*([A-Za-z]*)", re.S)


def _authorizer(tables: set[str], read: set[str]) -> Any:
    def check(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
        if action == sqlite3.SQLITE_SELECT:
            return _ALLOW
        if action == sqlite3.SQLITE_READ:
            if db in (None, "main") and arg1 in tables:
                read.add(arg1)
                return _ALLOW
            return _DENY
        if action == sqlite3.SQLITE_FUNCTION:
            return _ALLOW if (arg2 or "").lower() in ALLOWED_FUNCTIONS else _DENY
        return _DENY  # ATTACH, PRAGMA, writes, DDL, transactions, recursive CTEs, ...

    return check


def referenced_tables(sql: str, operators: list[str]) -> set[str]:
    """Check ``sql`` under the authorizer on an empty schema and return the operators it reads.

    Prepare only (``EXPLAIN``): nothing of the query runs here, so no query can cost this process anything."""
    word = _FIRST_WORD.match(sql)
    if word is not None and word.group(1).upper() == "EXPLAIN":  # the authorizer sees only what it explains
        raise SQLRejected("only a single SELECT over the state views is allowed (found EXPLAIN)")
    con = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        for name in operators:
            q = '"' + name.replace('"', '""') + '"'
            con.execute(f"CREATE TABLE {q} (key TEXT NOT NULL, item TEXT NOT NULL, value, value_json TEXT NOT NULL, "
                        "epoch INTEGER NOT NULL)")
        read: set[str] = set()
        con.set_authorizer(_authorizer(set(operators), read))
        con.execute("EXPLAIN " + sql).fetchall()
    except sqlite3.DatabaseError as exc:
        text = str(exc)
        if "not authorized" in text or "prohibited" in text or "no such function" in text:
            raise SQLRejected(f"only a single SELECT over the state views with allowed functions is allowed "
                              f"({exc})") from None
        raise SQLSyntaxError(text) from None
    except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:  # several statements
        raise SQLRejected(f"only a single SELECT is allowed ({exc})") from None
    finally:
        con.close()
    return read


_INTERNAL_ITEM = ITEM_PREFIX.encode()


def user_rows(rows: dict[bytes, bytes]) -> Iterator[tuple[bytes, bytes]]:
    """The store rows a user sees in SQL: the entities' values and items, not the engine's own entries stored
    beside them (an entity's pending timers, items under :data:`charon.core.timers.ITEM_PREFIX`; ``charon read
    --internal`` shows those)."""
    for k, v in rows.items():
        if not k.split(b"\0", 2)[-1].startswith(_INTERNAL_ITEM):
            yield k, v


def _snapshot(path: str, rows: dict[str, dict[bytes, bytes]]) -> None:
    """The cut's user rows (:func:`user_rows`) in a SQLite file: one table ``"charon/raw"(k BLOB, v BLOB)`` (no
    operator name has a slash; the child decodes them)."""
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode=OFF")
        con.execute("PRAGMA synchronous=OFF")
        con.execute("BEGIN")
        con.execute('CREATE TABLE "charon/raw" (k BLOB NOT NULL, v BLOB NOT NULL)')
        for part in rows.values():
            con.executemany('INSERT INTO "charon/raw" VALUES (?, ?)', user_rows(part))
        con.execute("COMMIT")
    finally:
        con.close()


_ERRORS: dict[str, type[CharonError]] = {
    "SQLRejected": SQLRejected, "SQLSyntaxError": SQLSyntaxError, "SQLTimeout": SQLTimeout,
    "SQLTooExpensive": SQLTooExpensive, "SQLResultTooLarge": SQLResultTooLarge,
}


def sqlite_sql(
    sql: str, operators: list[str], rows: dict[str, dict[bytes, bytes]], epoch: int, max_rows: int,
    timeout_s: float, max_bytes: int = 4 << 20, max_memory: int = 512 << 20,
) -> dict[str, Any]:
    """Run ``sql`` in the SQL sandbox (a child process, see the module docstring) over ``rows`` (operator ->
    its store rows, one consistent cut at ``epoch``). Blocking: call it off the event loop.

    Returns ``{"epoch", "columns", "rows", "truncated", "engine": "sqlite"}``; raises :class:`SQLRejected`,
    :class:`SQLSyntaxError`, :class:`SQLTimeout`, :class:`SQLTooExpensive` or :class:`SQLResultTooLarge`."""
    fd, path = tempfile.mkstemp(prefix="charon-sql-", suffix=".sqlite")
    os.close(fd)
    try:
        _snapshot(path, rows)
        req = {"db": path, "sql": sql, "operators": operators, "functions": sorted(ALLOWED_FUNCTIONS),
               "epoch": epoch, "max_rows": max_rows, "max_bytes": max_bytes, "max_memory": max_memory,
               "timeout_s": timeout_s}
        try:
            proc = subprocess.run([sys.executable, "-I", _CHILD], input=json.dumps(req).encode(),
                                  capture_output=True, timeout=timeout_s + 5.0, check=False)
        except subprocess.TimeoutExpired:  # run() killed it
            raise SQLTimeout(f"the query ran longer than {timeout_s:g} s and was stopped") from None
        except OSError as exc:
            raise EngineUnavailable(f"cannot start the SQL sandbox: {exc}") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    try:
        out = json.loads(proc.stdout) if proc.stdout else None
    except ValueError:
        out = None
    if not isinstance(out, dict):
        code = proc.returncode
        why = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit {code}"
        raise SQLTooExpensive(f"the query's sandbox process ended ({why}): it needed more memory or CPU than "
                              "the SQL sandbox allows (sql_max_memory, sql_timeout_s)")
    if not out.get("ok"):
        raise _ERRORS.get(str(out.get("type")), SQLRejected)(str(out.get("message")))
    return {"epoch": epoch, "columns": out["columns"], "rows": out["rows"], "truncated": out["truncated"],
            "engine": "sqlite"}
