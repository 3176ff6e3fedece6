"""Safe SQL over state for the dashboard's SQL box: its typed errors, and the in-process runtime's engine.

The Spark runtime checks a query on Spark's own parsed and analyzed plans
(:func:`charon.runtime.spark.statesql.safe_sql`). The in-process runtime answers the same subset with SQLite
(Python's ``sqlite3``) over one consistent cut: the operators the query names are read at one epoch boundary
(the latest committed epoch, or an earlier one the durable copy retains) into an in-memory database with one
table per operator, columns ``key``, ``item``, ``value``, ``value_json``, ``epoch`` (as Spark's
``state_frame``; SQLite keeps each ``value`` with its own type). SQLite's authorizer is the check: a single
``SELECT`` that reads only those tables and calls only :data:`ALLOWED_FUNCTIONS`; anything else (``ATTACH``,
``PRAGMA``, writes, DDL, recursive CTEs, ``load_extension``, other tables) is denied before it runs. A
progress handler bounds the time, ``fetchmany`` the rows; an operator larger than ``max_entities`` is
refused (:class:`StateTooLarge`: use the Spark runtime's SQL or ``charon sql`` for big states).
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from charon import serde
from charon.core.routing import split_store_key
from charon.errors import CharonError

__all__ = ["SQLRejected", "SQLSyntaxError", "SQLTimeout", "StateTooLarge", "ALLOWED_FUNCTIONS", "sqlite_sql"]


class SQLRejected(CharonError):
    """The query is outside the safe subset (one SELECT over the state views, allowed functions only)."""


class SQLSyntaxError(CharonError):
    """The query does not parse or does not resolve (unknown table or column)."""


class SQLTimeout(CharonError):
    """The query ran longer than its time bound and was cancelled."""


class StateTooLarge(CharonError):
    """An operator the query names holds more entities than the in-process SQL loads (``max_entities``)."""


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


def _columns(value: Any) -> tuple[Any, str]:
    text = json.dumps(value, sort_keys=True, default=repr)
    if isinstance(value, bool):
        return int(value), text
    if isinstance(value, int) and not -(1 << 63) <= value < (1 << 63):
        return text, text
    if isinstance(value, int | float | str) or value is None:
        return value, text
    return text, text


def _cell(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, float) and v != v or v in (float("inf"), float("-inf")):
        return str(v)
    return v


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


def _database(tables: dict[str, list[tuple[Any, ...]]]) -> sqlite3.Connection:
    con = sqlite3.connect(":memory:", check_same_thread=False)
    for name, rows in tables.items():
        q = '"' + name.replace('"', '""') + '"'
        con.execute(f"CREATE TABLE {q} (key TEXT NOT NULL, item TEXT NOT NULL, value, value_json TEXT NOT NULL, "
                    "epoch INTEGER NOT NULL)")
        con.executemany(f"INSERT INTO {q} VALUES (?, ?, ?, ?, ?)", rows)
    return con


def referenced_tables(sql: str, operators: list[str]) -> set[str]:
    """Check ``sql`` under the authorizer on empty tables and return the operators it reads."""
    con = _database({op: [] for op in operators})
    read: set[str] = set()
    con.set_authorizer(_authorizer(set(operators), read))
    try:
        con.execute(sql).fetchall()
    except sqlite3.DatabaseError as exc:
        if "not authorized" in str(exc) or "prohibited" in str(exc):
            raise SQLRejected(f"only a single SELECT over the state views with allowed functions is allowed "
                              f"({exc})") from None
        raise SQLSyntaxError(str(exc)) from None
    except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:  # several statements
        raise SQLRejected(f"only a single SELECT is allowed ({exc})") from None
    finally:
        con.close()
    return read


def rows_of(rows: dict[bytes, bytes], operator: str, epoch: int) -> list[tuple[Any, ...]]:
    """Table rows (key, item, value, value_json, epoch) of one operator's store rows."""
    out = []
    for k, raw in rows.items():
        op, key, item = split_store_key(k)
        if op != operator:
            continue
        value, text = _columns(serde.decode(raw))
        out.append((key, item.lstrip("\x01"), value, text, epoch))
    return out


def sqlite_sql(
    sql: str, operators: list[str], tables: dict[str, list[tuple[Any, ...]]], epoch: int, max_rows: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Run ``sql`` over ``tables`` (built by :func:`rows_of`) under the authorizer, time- and row-bounded."""
    con = _database({op: tables.get(op, []) for op in operators})
    read: set[str] = set()
    con.set_authorizer(_authorizer(set(operators), read))
    deadline = time.monotonic() + timeout_s
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        cur = con.execute(sql)
        got = cur.fetchmany(max_rows + 1)
        columns = [d[0] for d in cur.description or ()]
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            raise SQLTimeout(f"the query ran longer than {timeout_s:g} s and was cancelled") from None
        if "not authorized" in str(exc) or "prohibited" in str(exc):
            raise SQLRejected(str(exc)) from None
        raise SQLSyntaxError(str(exc)) from None
    except sqlite3.DatabaseError as exc:
        raise SQLRejected(f"the query failed: {exc}") from None
    except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:
        raise SQLRejected(f"only a single SELECT is allowed ({exc})") from None
    finally:
        con.close()
    return {"epoch": epoch, "columns": columns, "rows": [[_cell(x) for x in r] for r in got[:max_rows]],
            "truncated": len(got) > max_rows, "engine": "sqlite"}
