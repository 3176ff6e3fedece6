"""PostgreSQL baseline: the same workloads as SQL transactions under SERIALIZABLE, retried on conflicts.

- :class:`PostgresCluster` installs PostgreSQL from Debian's packages if missing (``apt-get install -y
  postgresql``, root only), then runs a private cluster (``initdb`` + ``pg_ctl``) in a temporary directory,
  listening on 127.0.0.1 on a free port. Because the server refuses to run as root, it runs as the
  ``postgres`` user (or a ``charonpg`` user created with ``useradd``) when we are root.
- :class:`PostgresBaseline` exposes the same ``async submit(operator, key, function, args, *, request_id)``
  as Charon's runtimes, returning :class:`charon.messages.Reply`, so the same open-loop harness drives it.
  Each request is one transaction on a pooled connection, in one of two modes (``isolation``):
  ``"serializable"`` (SERIALIZABLE; serialization failures (40001) and deadlocks (40P01) are retried,
  counted in ``retries``) or ``"read_committed"`` (what a PostgreSQL user writes for these transactions:
  READ COMMITTED with ``SELECT ... FOR UPDATE`` on the rows a transaction writes, in a fixed lock order, so
  the same outcomes without serialization failures; deadlocks, which the lock order rules out, would be
  retried too). Application errors (insufficient credit, unknown item, sold out) abort with the same
  error type names as the Charon apps. Benchmarks quote Charon against the better of the two modes.
- Workloads: :class:`YcsbSql` (``account.transfer``), :class:`TpccSql` (``district.new_order`` /
  ``district.payment``), :class:`DeathstarSql` (travel: ``geo.search``, ``geo.recommend``, ``user.login``,
  ``user.reserve``). Each loads the Charon app's ``populate`` output.

Server settings are PostgreSQL's defaults (durable commits) except ``max_pred_locks_per_transaction=256``
(SERIALIZABLE NewOrders take many predicate locks) and ``max_connections=200``.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors as pgerr

from charon import serde
from charon.messages import Reply

Record = tuple[str, str, Any, "dict[str, Any] | None"]


class AppAbort(Exception):
    """An application-level abort inside a SQL transaction (rolled back, not retried)."""

    def __init__(self, error_type: str, message: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


# ---------------------------------------------------------------------------------------------- cluster


def find_bin() -> Path | None:
    """The newest installed PostgreSQL server bin directory (Debian layout), or None."""
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    if cands:
        return Path(cands[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def ensure_installed() -> Path:
    """Return the server bin directory, installing Debian's ``postgresql`` package first if needed."""
    b = find_bin()
    if b is not None:
        return b
    if os.geteuid() != 0:
        raise RuntimeError("PostgreSQL is not installed and we are not root to apt-get install it")
    subprocess.run(["apt-get", "install", "-y", "postgresql"], check=True, capture_output=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    b = find_bin()
    if b is None:
        raise RuntimeError("apt-get install postgresql did not provide initdb")
    return b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_user() -> str | None:
    """The unprivileged user to run the server as when we are root (None if we are not root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "charonpg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            pass
    subprocess.run(["useradd", "--system", "--no-create-home", "charonpg"], check=True, capture_output=True)
    return "charonpg"


class PostgresCluster:
    """A private PostgreSQL cluster in a temporary directory on 127.0.0.1; use as a context manager."""

    def __init__(self, base_dir: str | None = None, port: int | None = None,
                 settings: dict[str, str] | None = None) -> None:
        self.bin = ensure_installed()
        self.user = _server_user()
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="charon-pg-"))
        self.port = port or _free_port()
        self.settings = {"listen_addresses": "127.0.0.1", "max_connections": "200",
                         "max_pred_locks_per_transaction": "256", **(settings or {})}
        self.started = False

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=charon dbname=postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd="/")

    def start(self) -> str:
        """initdb + pg_ctl start; returns the DSN."""
        data, sock = self.dir / "data", self.dir / "sock"
        self.dir.mkdir(parents=True, exist_ok=True)
        sock.mkdir(exist_ok=True)
        if self.user:
            shutil.chown(self.dir, self.user)
            shutil.chown(sock, self.user)
        if not (data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(data), "-U", "charon", "-A", "trust", "-E", "UTF8", "--no-sync")
        opts = f"-p {self.port} -k {sock} " + " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._run("pg_ctl", "-D", str(data), "-l", str(self.dir / "server.log"), "-o", opts, "-w", "-t", "60",
                  "start")
        self.started = True
        return self.dsn

    def stop(self, remove: bool = True) -> None:
        """pg_ctl stop (fast) and remove the directory."""
        if self.started:
            try:
                self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")
            finally:
                self.started = False
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------- workloads

Handler = Callable[[psycopg.AsyncConnection, str, list], Awaitable[Any]]


class SqlWorkload:
    """Schema, loader and transaction handlers of one workload.

    ``lock_rows`` (set by :class:`PostgresBaseline` in ``read_committed`` mode): handlers first lock the rows
    they will write with ``SELECT ... FOR UPDATE`` in a fixed order (table order, then key order).
    """

    schema: str = ""
    lock_rows: bool = False

    def handlers(self) -> dict[tuple[str, str], Handler]:
        raise NotImplementedError

    def rows(self, records: Iterable[Record]) -> dict[str, list[tuple]]:
        """Rows per table (``"table(col, ...)"``) from the Charon app's population records."""
        raise NotImplementedError

    def setup(self, dsn: str, records: Iterable[Record]) -> None:
        """(Re)create the schema and bulk-load the population with COPY."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
            conn.execute(self.schema)
            for table, rows in self.rows(records).items():
                with conn.cursor() as cur, cur.copy(f"COPY {table} FROM STDIN") as cp:
                    for r in rows:
                        cp.write_row(r)
            conn.execute("ANALYZE")


class YcsbSql(SqlWorkload):
    """YCSB-T: ``account.transfer(to, amount)`` as two conditional UPDATEs."""

    schema = "CREATE TABLE account (key text PRIMARY KEY, balance bigint NOT NULL);"

    def __init__(self, operator: str = "account", function: str = "transfer") -> None:
        self.operator, self.function = operator, function

    def rows(self, records: Iterable[Record]) -> dict[str, list[tuple]]:
        return {"account (key, balance)": [(k, v) for op, k, v, _ in records if op == self.operator]}

    def handlers(self) -> dict[tuple[str, str], Handler]:
        async def transfer(conn: psycopg.AsyncConnection, key: str, args: list) -> int:
            to, amount = args[0], int(args[1])
            if self.lock_rows:  # both accounts, in key order: no deadlock, no lost update at READ COMMITTED
                await conn.execute("SELECT 1 FROM account WHERE key = ANY(%s) ORDER BY key FOR UPDATE",
                                   (sorted({key, to}),))
            cur = await conn.execute(
                "UPDATE account SET balance = balance - %s WHERE key = %s AND balance >= %s RETURNING balance",
                (amount, key, amount))
            row = await cur.fetchone()
            if row is None:
                raise AppAbort("NotEnoughCredit", f"{key} cannot pay {amount}")
            await conn.execute("INSERT INTO account AS a (key, balance) VALUES (%s, %s) "
                               "ON CONFLICT (key) DO UPDATE SET balance = a.balance + EXCLUDED.balance", (to, amount))
            return row[0]

        return {(self.operator, self.function): transfer}

    @staticmethod
    async def total(conn: psycopg.AsyncConnection) -> int:
        cur = await conn.execute("SELECT coalesce(sum(balance), 0) FROM account")
        row = await cur.fetchone()
        assert row is not None  # an aggregate: one row
        return int(row[0])


class TpccSql(SqlWorkload):
    """TPC-C NewOrder and Payment, statement for statement what the Charon call graphs do."""

    schema = """
    CREATE TABLE warehouse (w_id int PRIMARY KEY, name text, tax float8, ytd bigint);
    CREATE TABLE district (w_id int, d_id int, tax float8, ytd bigint, next_o_id int, PRIMARY KEY (w_id, d_id));
    CREATE TABLE customer (w_id int, d_id int, c_id int, first text, middle text, last text, credit text,
        discount float8, balance bigint, ytd_payment bigint, payment_cnt int, delivery_cnt int, data text,
        PRIMARY KEY (w_id, d_id, c_id));
    CREATE INDEX customer_by_name ON customer (w_id, d_id, last, first);
    CREATE TABLE history (c_w_id int, c_d_id int, c_id int, w_id int, d_id int, amount bigint, date float8,
        data text);
    CREATE TABLE item (i_id int PRIMARY KEY, name text, price int, data text);
    CREATE TABLE stock (w_id int, i_id int, quantity int, ytd int, order_cnt int, remote_cnt int, dist text,
        data text, PRIMARY KEY (w_id, i_id));
    CREATE TABLE orders (w_id int, d_id int, o_id int, c_id int, ol_cnt int, all_local bool, entry_d float8,
        carrier_id int, PRIMARY KEY (w_id, d_id, o_id));
    CREATE TABLE new_order (w_id int, d_id int, o_id int, PRIMARY KEY (w_id, d_id, o_id));
    CREATE TABLE order_line (w_id int, d_id int, o_id int, n int, i_id int, supply_w_id int, quantity int,
        amount bigint, dist_info text, delivery_d float8, PRIMARY KEY (w_id, d_id, o_id, n));
    """

    def rows(self, records: Iterable[Record]) -> dict[str, list[tuple]]:
        t: dict[str, list[tuple]] = {k: [] for k in (
            "warehouse", "district", "customer", "history", "item", "stock", "orders", "new_order", "order_line")}
        d_ytd: dict[str, int] = {}
        for op, key, v, items in records:
            ids = [int(x) for x in key.split(":")]
            if op == "warehouse":
                info = (items or {})["info"]
                t["warehouse"].append((ids[0], info["name"], info["tax"], v["ytd"]))
            elif op == "district":
                t["district"].append((*ids, v["tax"], key, v["next_o_id"]))  # D_YTD: its own record
            elif op == "district_ytd":
                d_ytd[key] = v
            elif op == "customer":
                i = (items or {})["info"]
                t["customer"].append((*ids, i["first"], i["middle"], i["last"], i["credit"], i["discount"],
                                      v["balance"], v["ytd_payment"], v["payment_cnt"], v["delivery_cnt"],
                                      v["data"]))
            elif op == "history":
                for h in (items or {}).values():
                    t["history"].append((*ids, h["w_id"], h["d_id"], h["amount"], h["date"], h["data"]))
            elif op == "item":
                t["item"].append((ids[0], v["name"], v["price"], v["data"]))
            elif op == "stock":
                t["stock"].append((*ids, v["quantity"], v["ytd"], v["order_cnt"], v["remote_cnt"], v["dist"],
                                   v["data"]))
            elif op == "order":
                t["orders"].append((*ids, v["c_id"], v["ol_cnt"], v["all_local"], v["entry_d"], v["carrier_id"]))
            elif op == "new_order":
                t["new_order"].append(tuple(ids))
            elif op == "order_line":
                t["order_line"].append((*ids, v["i_id"], v["supply_w_id"], v["quantity"], v["amount"],
                                        v["dist_info"], v["delivery_d"]))
        t["district"] = [(w, d, tax, d_ytd[key], nxt) for w, d, tax, key, nxt in t["district"]]
        return t

    def handlers(self) -> dict[tuple[str, str], Handler]:
        async def one(conn: psycopg.AsyncConnection, sql: str, params: tuple) -> tuple | None:
            cur = await conn.execute(sql, params)
            return await cur.fetchone()

        async def row_of(conn: psycopg.AsyncConnection, sql: str, params: tuple) -> tuple:
            """The row of a statement that always returns one (an update of an existing row, RETURNING)."""
            r = await one(conn, sql, params)
            assert r is not None, sql
            return r

        async def new_order(conn: psycopg.AsyncConnection, key: str, args: list) -> dict:
            w, d = (int(x) for x in key.split(":"))
            c_id, lines = int(args[0]), args[1]
            if self.lock_rows:  # district, then the stock rows in (warehouse, item) order
                await conn.execute("SELECT 1 FROM district WHERE w_id = %s AND d_id = %s FOR UPDATE", (w, d))
                pairs = sorted({(int(sw), int(i)) for i, sw, _ in lines})
                await conn.execute("SELECT 1 FROM stock WHERE (w_id, i_id) IN (SELECT * FROM unnest(%s::int[], "
                                   "%s::int[])) ORDER BY w_id, i_id FOR UPDATE",
                                   ([p[0] for p in pairs], [p[1] for p in pairs]))
            (w_tax,) = await row_of(conn, "SELECT tax FROM warehouse WHERE w_id = %s", (w,))
            d_tax, o_id = await row_of(conn, "UPDATE district SET next_o_id = next_o_id + 1 WHERE w_id = %s AND "
                                          "d_id = %s RETURNING tax, next_o_id - 1", (w, d))
            c = await one(conn, "SELECT discount, last, credit FROM customer WHERE w_id = %s AND d_id = %s AND "
                                "c_id = %s", (w, d, c_id))
            if c is None:
                raise AppAbort("UnknownCustomer", f"customer {w}:{d}:{c_id}")
            total = 0
            for n, (i_id, supply_w, qty) in enumerate(lines, start=1):
                p = await one(conn, "SELECT price FROM item WHERE i_id = %s", (i_id,))
                if p is None:
                    raise AppAbort("UnknownItem", f"item {i_id} not found")
                (dist,) = await row_of(conn, "UPDATE stock SET quantity = CASE WHEN quantity >= %s + 10 THEN "
                                          "quantity - %s ELSE quantity + 91 - %s END, ytd = ytd + %s, "
                                          "order_cnt = order_cnt + 1, remote_cnt = remote_cnt + %s "
                                          "WHERE w_id = %s AND i_id = %s RETURNING dist",
                                    (qty, qty, qty, qty, int(supply_w != w), supply_w, i_id))
                total += p[0] * qty
                await conn.execute("INSERT INTO order_line VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,NULL)",
                                   (w, d, o_id, n, i_id, supply_w, qty, p[0] * qty, dist))
            await conn.execute("INSERT INTO orders VALUES (%s,%s,%s,%s,%s,%s,%s,NULL)",
                               (w, d, o_id, c_id, len(lines), all(x[1] == w for x in lines), time.time()))
            await conn.execute("INSERT INTO new_order VALUES (%s,%s,%s)", (w, d, o_id))
            return {"o_id": o_id, "total": round(total * (1 - c[0]) * (1 + w_tax + d_tax)),
                    "c_last": c[1], "c_credit": c[2]}

        async def payment(conn: psycopg.AsyncConnection, key: str, args: list) -> dict:
            w, d = (int(x) for x in key.split(":"))
            c_w, c_d, c_id, c_last, amount = int(args[0]), int(args[1]), int(args[2]), args[3], int(args[4])
            if self.lock_rows:  # district, then warehouse (the customer row is locked by its UPDATE, last)
                await conn.execute("SELECT 1 FROM district WHERE w_id = %s AND d_id = %s FOR UPDATE", (w, d))
                await conn.execute("SELECT 1 FROM warehouse WHERE w_id = %s FOR UPDATE", (w,))
            await conn.execute("UPDATE district SET ytd = ytd + %s WHERE w_id = %s AND d_id = %s", (amount, w, d))
            (w_name,) = await row_of(conn, "UPDATE warehouse SET ytd = ytd + %s WHERE w_id = %s RETURNING name",
                                  (amount, w))
            if c_id == 0:
                cur = await conn.execute("SELECT c_id FROM customer WHERE w_id = %s AND d_id = %s AND last = %s "
                                         "ORDER BY first", (c_w, c_d, c_last))
                ids = [r[0] for r in await cur.fetchall()]
                if not ids:
                    raise AppAbort("UnknownCustomer", f"no customer named {c_last}")
                c_id = ids[(len(ids) + 1) // 2 - 1]
            row = await one(conn, "UPDATE customer SET balance = balance - %s, ytd_payment = ytd_payment + %s, "
                                  "payment_cnt = payment_cnt + 1 WHERE w_id = %s AND d_id = %s AND c_id = %s "
                                  "RETURNING balance, credit", (amount, amount, c_w, c_d, c_id))
            if row is None:
                raise AppAbort("UnknownCustomer", f"customer {c_w}:{c_d}:{c_id}")
            if row[1] == "BC":
                await conn.execute("UPDATE customer SET data = left(%s || data, 500) WHERE w_id = %s AND "
                                   "d_id = %s AND c_id = %s",
                                   (f"{c_id} {c_d} {c_w} {d} {w} {amount}|", c_w, c_d, c_id))
            await conn.execute("INSERT INTO history VALUES (%s,%s,%s,%s,%s,%s,%s,%s)",
                               (c_w, c_d, c_id, w, d, amount, time.time(), w_name))
            return {"c_id": c_id, "balance": row[0]}

        return {("district", "new_order"): new_order, ("district", "payment"): payment}

    @staticmethod
    def check(dsn: str) -> list[str]:
        """TPC-C consistency conditions 1-4 as SQL; returns the violations."""
        errors: list[str] = []
        with psycopg.connect(dsn) as conn:
            for w, wy, dy in conn.execute("SELECT w.w_id, w.ytd, sum(d.ytd) FROM warehouse w JOIN district d "
                                          "USING (w_id) GROUP BY w.w_id, w.ytd"):
                if wy != dy:
                    errors.append(f"C1 warehouse {w}: {wy} != {dy}")
            for w, d, nxt, mo, mno, nno, minno in conn.execute(
                    "SELECT d.w_id, d.d_id, d.next_o_id, (SELECT max(o_id) FROM orders o WHERE o.w_id = d.w_id "
                    "AND o.d_id = d.d_id), n.mx, n.cnt, n.mn FROM district d LEFT JOIN (SELECT w_id, d_id, "
                    "max(o_id) mx, min(o_id) mn, count(*) cnt FROM new_order GROUP BY w_id, d_id) n "
                    "USING (w_id, d_id)"):
                if nxt - 1 != mo or (mno is not None and mno != nxt - 1):
                    errors.append(f"C2 district {w}:{d}: next {nxt}, max o {mo}, max no {mno}")
                if mno is not None and mno - minno + 1 != nno:
                    errors.append(f"C3 district {w}:{d}")
            for w, d, s, c in conn.execute(
                    "SELECT o.w_id, o.d_id, o.s, l.c FROM (SELECT w_id, d_id, sum(ol_cnt) s FROM orders GROUP BY "
                    "1, 2) o JOIN (SELECT w_id, d_id, count(*) c FROM order_line GROUP BY 1, 2) l "
                    "USING (w_id, d_id)"):
                if s != c:
                    errors.append(f"C4 district {w}:{d}: {s} != {c}")
        return errors


class DeathstarSql(SqlWorkload):
    """Deathstar travel: search / recommend (bounding-box queries), login, reserve (room + seat)."""

    schema = """
    CREATE TABLE hotel (id text PRIMARY KEY, name text, lat float8, lon float8, rate float8, price int,
        capacity int, booked int);
    CREATE INDEX hotel_geo ON hotel (lat, lon);
    CREATE TABLE flight (id text PRIMARY KEY, price int, capacity int, booked int);
    CREATE TABLE users (id text PRIMARY KEY, password text, logins int, reservations int);
    CREATE TABLE reservation (kind text, id text, user_id text);
    """

    def rows(self, records: Iterable[Record]) -> dict[str, list[tuple]]:
        t: dict[str, list[tuple]] = {"hotel": [], "flight": [], "users": []}
        for op, key, v, _ in records:
            if op == "hotel":
                t["hotel"].append((key, v["name"], v["lat"], v["lon"], v["rate"], v["price"], v["capacity"],
                                   len(v["reservations"])))
            elif op == "flight":
                t["flight"].append((key, v["price"], v["capacity"], len(v["reservations"])))
            elif op == "user":
                t["users"].append((key, v["password"], v["logins"], v["reservations"]))
        return t

    def handlers(self) -> dict[tuple[str, str], Handler]:
        from charon.apps.deathstar import CELL

        async def search(conn: psycopg.AsyncConnection, key: str, args: list) -> list:
            lat, lon, k = float(args[0]), float(args[1]), int(args[2])
            r = CELL * 1.5
            while True:
                cur = await conn.execute(
                    "SELECT id, name, rate, price, capacity - booked FROM hotel WHERE lat BETWEEN %s AND %s AND "
                    "lon BETWEEN %s AND %s AND booked < capacity ORDER BY (lat - %s)^2 + (lon - %s)^2, id "
                    "LIMIT %s", (lat - r, lat + r, lon - r, lon + r, lat, lon, k))
                rows = await cur.fetchall()
                if len(rows) >= k or r > 1:
                    break
                r *= 2
            return [{"id": a, "name": b, "rate": c, "price": d, "available": e} for a, b, c, d, e in rows]

        async def recommend(conn: psycopg.AsyncConnection, key: str, args: list) -> list:
            lat, lon, req = float(args[0]), float(args[1]), args[2]
            if req == "dis":
                cur = await conn.execute("SELECT id FROM hotel ORDER BY (lat - %s)^2 + (lon - %s)^2, id LIMIT 5",
                                         (lat, lon))
            else:
                order = "rate DESC" if req == "rate" else "price"
                r = CELL * 2.5
                cur = await conn.execute(f"SELECT id FROM hotel WHERE lat BETWEEN %s AND %s AND lon BETWEEN %s "
                                         f"AND %s ORDER BY {order}, id LIMIT 5", (lat - r, lat + r, lon - r, lon + r))
            return [r[0] for r in await cur.fetchall()]

        async def login(conn: psycopg.AsyncConnection, key: str, args: list) -> bool:
            cur = await conn.execute("UPDATE users SET logins = logins + 1 WHERE id = %s AND password = %s "
                                     "RETURNING 1", (key, args[0]))
            if await cur.fetchone() is None:
                raise AppAbort("InvalidLogin", key)
            return True

        async def reserve(conn: psycopg.AsyncConnection, key: str, args: list) -> dict:
            out = {}
            if self.lock_rows:  # hotel, flight, user: the order every reserve takes them in
                await conn.execute("SELECT 1 FROM hotel WHERE id = %s FOR UPDATE", (args[0],))
                await conn.execute("SELECT 1 FROM flight WHERE id = %s FOR UPDATE", (args[1],))
                await conn.execute("SELECT 1 FROM users WHERE id = %s FOR UPDATE", (key,))
            for table, ident, name in (("hotel", args[0], "rooms_left"), ("flight", args[1], "seats_left")):
                cur = await conn.execute(f"UPDATE {table} SET booked = booked + 1 WHERE id = %s AND "
                                         f"booked < capacity RETURNING capacity - booked", (ident,))
                row = await cur.fetchone()
                if row is None:
                    raise AppAbort("SoldOut", f"{table} {ident} is full")
                out[name] = row[0]
                await conn.execute("INSERT INTO reservation VALUES (%s, %s, %s)", (table, ident, key))
            await conn.execute("UPDATE users SET reservations = reservations + 1 WHERE id = %s", (key,))
            return out

        return {("geo", "search"): search, ("geo", "recommend"): recommend, ("user", "login"): login,
                ("user", "reserve"): reserve}

    @staticmethod
    def check(dsn: str) -> list[str]:
        """Capacity never exceeded; room and seat bookings match the reservation rows and the users' counts."""
        errors: list[str] = []
        with psycopg.connect(dsn) as conn:
            for table in ("hotel", "flight"):
                for ident, booked, cap, rows in conn.execute(
                        f"SELECT t.id, t.booked, t.capacity, (SELECT count(*) FROM reservation r WHERE "
                        f"r.kind = '{table}' AND r.id = t.id) FROM {table} t"):
                    if booked > cap or booked != rows:
                        errors.append(f"{table} {ident}: booked {booked}, rows {rows}, capacity {cap}")
            sums = conn.execute("SELECT (SELECT sum(booked) FROM hotel), (SELECT sum(booked) FROM flight), "
                                "(SELECT sum(reservations) FROM users)").fetchone()
            assert sums is not None  # aggregates: one row
            h, f, u = sums
            if not h == f == u:
                errors.append(f"reservations not atomic: {h} {f} {u}")
        return errors


# ---------------------------------------------------------------------------------------------- adapter

RETRYABLE = (pgerr.SerializationFailure, pgerr.DeadlockDetected)


ISOLATION = {"serializable": psycopg.IsolationLevel.SERIALIZABLE,
             "read_committed": psycopg.IsolationLevel.READ_COMMITTED}


class PostgresBaseline:
    """Runs requests as transactions on a pool of connections, behind Charon's ``submit``.

    ``isolation``: ``"serializable"`` (retry on serialization failure) or ``"read_committed"`` (rows
    locked with ``SELECT ... FOR UPDATE`` in a fixed order; see the module docstring).
    """

    def __init__(self, dsn: str, workload: SqlWorkload, pool_size: int = 16, max_retries: int = 1000,
                 isolation: str = "serializable") -> None:
        if isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION)}, got {isolation!r}")
        self.dsn = dsn
        self.isolation = isolation
        self.workload = workload
        workload.lock_rows = isolation == "read_committed"
        self.pool_size = pool_size
        self.max_retries = max_retries
        self.retries = 0
        self._handlers = workload.handlers()
        self._pool: asyncio.Queue[psycopg.AsyncConnection] = asyncio.Queue()
        self._conns: list[psycopg.AsyncConnection] = []
        self._replies: dict[str, Reply] = {}
        self._seq = 0

    async def start(self) -> None:
        for _ in range(self.pool_size):
            conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            await conn.set_isolation_level(ISOLATION[self.isolation])
            self._conns.append(conn)
            self._pool.put_nowait(conn)

    async def stop(self) -> None:
        for conn in self._conns:
            await conn.close()
        self._conns.clear()

    async def __aenter__(self) -> PostgresBaseline:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def submit(self, operator: str, key: str, function: str, args: list, *,
                     request_id: str | None = None) -> Reply:
        """Run one request as a transaction, retrying serialization failures; a repeated id gets the first reply."""
        rid = request_id or os.urandom(16).hex()
        if rid in self._replies:
            return self._replies[rid]
        handler = self._handlers.get((operator, function))
        self._seq += 1
        seq = self._seq
        if handler is None:
            rep = Reply(rid, seq, 0, False, error_type="UnknownFunction", error_message=f"{operator}.{function}")
            self._replies[rid] = rep
            return rep
        conn = await self._pool.get()
        try:
            attempt = 0
            while True:
                try:
                    async with conn.transaction():
                        value = await handler(conn, key, args)
                    rep = Reply(rid, seq, 0, True, value=serde.encode(value))
                    break
                except AppAbort as exc:
                    rep = Reply(rid, seq, 0, False, error_type=exc.error_type, error_message=str(exc))
                    break
                except RETRYABLE:
                    attempt += 1
                    self.retries += 1
                    if attempt > self.max_retries:
                        rep = Reply(rid, seq, 0, False, error_type="SerializationFailure",
                                    error_message=f"gave up after {attempt} attempts")
                        break
                    await asyncio.sleep(random.uniform(0, 0.001 * min(attempt, 20)))
        finally:
            self._pool.put_nowait(conn)
        self._replies[rid] = rep
        return rep
