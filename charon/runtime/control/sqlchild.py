"""The SQL sandbox's child process: one ``/admin/sql`` query, run away from the engine (see
:mod:`charon.runtime.control.sqlstate`). Run as a script (``python -I sqlchild.py``), never imported by the engine: it
uses only the standard library and msgspec, so it starts in ~50 ms.

Protocol: stdin is one JSON object ``{"db", "sql", "operators", "functions", "epoch", "max_rows", "max_bytes",
"max_memory", "timeout_s"}``; ``db`` is a SQLite file the runtime wrote with one table
``"charon/raw"(k BLOB, v BLOB)`` (the store rows of one consistent cut). stdout is one JSON object:
``{"ok": true, "columns", "rows", "truncated"}`` or ``{"ok": false, "type", "message"}``.

Before it reads anything, the process limits itself: its address space to ``max_memory`` (``RLIMIT_AS``: an
allocation past it fails, this process alone), its CPU time to ``timeout_s`` + 2 s (``RLIMIT_CPU``), and its CPU
priority to the lowest (``nice 19``: the engine's epochs always run first). SQLite's own heap is capped below
that (``hard_heap_limit``, temp storage in memory: a sort cannot fill the disk), as is the length of one string
or blob; a progress handler stops the query at its deadline; the answer is cut off at ``max_bytes`` of JSON.
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import sys
import time


def _limit_self(max_memory: int, timeout_s: float) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))
    cpu = int(timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    try:
        os.nice(19)
    except OSError:
        pass


def _columns(value):
    text = json.dumps(value, sort_keys=True, default=repr)
    if isinstance(value, bool):
        return int(value), text
    if isinstance(value, int) and not -(1 << 63) <= value < (1 << 63):
        return text, text
    if isinstance(value, int | float | str) or value is None:
        return value, text
    return text, text


def _cell(v):
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return str(v)
    return v


def _build(con, operators, epoch):
    """One table per operator (key, item, value, value_json, epoch) from the raw store rows."""
    import msgspec

    dec = msgspec.msgpack.Decoder()
    for op in operators:
        q = '"' + op.replace('"', '""') + '"'
        con.execute(f"CREATE TABLE {q} (key TEXT NOT NULL, item TEXT NOT NULL, value, value_json TEXT NOT NULL, "
                    "epoch INTEGER NOT NULL)")
    wanted = set(operators)
    batch: dict[str, list] = {op: [] for op in operators}
    for k, v in con.execute('SELECT k, v FROM "charon/raw"'):
        op, key, item = bytes(k).decode().split("\0", 2)
        if op not in wanted:
            continue
        value, text = _columns(dec.decode(v))
        rows = batch[op]
        rows.append((key, item.lstrip("\x01"), value, text, epoch))
        if len(rows) >= 1000:
            con.executemany(f'INSERT INTO "{op.replace(chr(34), chr(34) * 2)}" VALUES (?, ?, ?, ?, ?)', rows)
            rows.clear()
    for op, rows in batch.items():
        if rows:
            con.executemany(f'INSERT INTO "{op.replace(chr(34), chr(34) * 2)}" VALUES (?, ?, ?, ?, ?)', rows)


def _fail(kind: str, message: str) -> dict:
    return {"ok": False, "type": kind, "message": message}


def run(req: dict) -> dict:
    timeout_s = float(req["timeout_s"])
    max_memory = int(req["max_memory"])
    deadline = time.monotonic() + timeout_s
    con = sqlite3.connect(req["db"], isolation_level=None)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute(f"PRAGMA hard_heap_limit={max(8 << 20, max_memory // 2)}")
    operators, functions = list(req["operators"]), frozenset(req["functions"])
    try:
        con.execute("BEGIN")
        _build(con, operators, int(req["epoch"]))  # the tables live in the file (the page cache is bounded)
        con.execute('DROP TABLE "charon/raw"')
        con.execute("COMMIT")
        con.execute("PRAGMA temp_store=MEMORY")  # a sort or a temp table never spills to disk: bounded by the heap
        con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max(1 << 20, max_memory // 8))  # one string or blob the query builds
    except (MemoryError, sqlite3.DataError, sqlite3.OperationalError):
        return _fail("SQLTooExpensive", f"the state does not fit the SQL sandbox's memory ({max_memory} bytes: "
                                        "sql_max_memory)")
    tables = {op.lower() for op in operators}

    def check(action, arg1, arg2, db, trigger):
        if action == sqlite3.SQLITE_SELECT:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_READ:
            ok = db in (None, "main") and (arg1 or "").lower() in tables
            return sqlite3.SQLITE_OK if ok else sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_FUNCTION:
            return sqlite3.SQLITE_OK if (arg2 or "").lower() in functions else sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_DENY

    con.set_authorizer(check)
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    max_rows, max_bytes = int(req["max_rows"]), int(req["max_bytes"])
    rows: list = []
    size = 0
    truncated = False
    try:
        cur = con.execute(req["sql"])
        columns = [d[0] for d in cur.description or ()]
        size = len(json.dumps(columns))
        while True:
            got = cur.fetchmany(100)
            if not got:
                break
            for r in got:
                if len(rows) >= max_rows:
                    truncated = True
                    break
                row = [_cell(x) for x in r]
                size += len(json.dumps(row)) + 1
                if size > max_bytes:
                    return _fail("SQLResultTooLarge", f"the answer is larger than {max_bytes} bytes "
                                                      "(sql_max_result_bytes): select fewer or smaller columns, "
                                                      "or add a LIMIT")
                rows.append(row)
            if truncated:
                break
    except sqlite3.OperationalError as exc:
        text = str(exc)
        if "interrupted" in text:
            return _fail("SQLTimeout", f"the query ran longer than {timeout_s:g} s and was cancelled")
        if "too big" in text:
            return _fail("SQLTooExpensive", f"the query builds a value larger than the SQL sandbox allows ({text})")
        if "not authorized" in text or "prohibited" in text or "no such function" in text:
            return _fail("SQLRejected", text)
        return _fail("SQLSyntaxError", text)
    except (sqlite3.DataError, OverflowError) as exc:
        return _fail("SQLTooExpensive", f"the query builds a value larger than the SQL sandbox allows ({exc})")
    except MemoryError:
        return _fail("SQLTooExpensive", f"the query needs more memory than the SQL sandbox has ({max_memory} "
                                        "bytes: sql_max_memory)")
    except sqlite3.DatabaseError as exc:
        return _fail("SQLRejected", f"the query failed: {exc}")
    except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:
        return _fail("SQLRejected", f"only a single SELECT is allowed ({exc})")
    return {"ok": True, "columns": columns, "rows": rows, "truncated": truncated}


def main() -> None:
    req = json.loads(sys.stdin.buffer.read())
    _limit_self(int(req["max_memory"]), float(req["timeout_s"]))
    try:
        out = run(req)
    except MemoryError:
        out = _fail("SQLTooExpensive", "the query needs more memory than the SQL sandbox has (sql_max_memory)")
    sys.stdout.write(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
