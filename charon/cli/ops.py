"""Commands over a deployment: ``invoke``, ``state``, ``read`` and ``sql`` read and call it; ``status``,
``dead-letters``, ``pause``, ``resume``, ``rescale``, ``update``, ``deploy`` and ``metrics`` operate it (the
running node's gateway at ``--url``; ``sql`` also reads a data directory itself)."""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from charon.cli.exitcodes import ExitCode
from charon.cli.fail import fail as _fail
from charon.cli.fail import request_failed as _request_failed
from charon.cli.parts import TokenOpt, UrlOpt, console, err_console, print_json
from charon.errors import CharonError


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _client(url: str, token: str | None) -> Any:
    from charon.client import Client

    return Client(url, token=token, timeout=30.0, retries=2)


def invoke(
    operator: str = typer.Argument(..., help="Operator name."),
    key: str = typer.Argument(..., help="Entity key."),
    function: str = typer.Argument(..., help="Function name."),
    args_json: str = typer.Argument("[]", metavar="ARGS_JSON", help="JSON list of positional arguments."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
    request_id: str | None = typer.Option(None, "--request-id", help="Idempotency key."),
) -> None:
    """Invoke FUNCTION(*ARGS_JSON) on entity KEY of OPERATOR as one transaction; print the value as JSON.

    Example: `charon invoke account alice deposit '[100]'`.

    Exit status: 0 committed, 1 aborted (the error type and message go to stderr), 3 the gateway or engine is
    unavailable, 4 the request was rejected (see docs/reference/exit-codes.md).
    """
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise _fail(f"ARGS_JSON is not valid JSON: {exc}", ExitCode.USAGE) from None
    if not isinstance(args, list):
        raise _fail("ARGS_JSON must be a JSON list, e.g. '[\"bob\", 10]'", ExitCode.USAGE)
    value = _admin(url, token, lambda c: c.invoke(operator, key, function, *args, request_id=request_id))
    print_json(value)


def state(
    operator: str = typer.Argument(..., help="Operator name."),
    key: str = typer.Argument(..., help="Entity key."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Print the committed state of OPERATOR/KEY as JSON (an admin read)."""
    print_json(_admin(url, token, lambda c: c.state(operator, key)))


def _admin(url: str, token: str | None, call: Any) -> Any:
    """``call(client)`` on a client of the gateway at ``url``; a failure as one line and its exit code."""
    import httpx

    with _client(url, token) as client:
        try:
            return call(client)
        except (CharonError, httpx.HTTPError) as exc:
            raise _request_failed(exc, url) from None


def status(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print the runtime's control status (running/pausing/paused, last committed epoch, backlog, partitions;
    on Spark the input log's ``log_partitions``: routing count and physical count) as JSON."""
    print_json(_admin(url, token, lambda c: c.status()))


def dead_letters(url: str = UrlOpt, token: str | None = TokenOpt,
                 limit: int = typer.Option(100, min=1, max=10_000, help="How many, newest first.")) -> None:
    """List the transactions the engine set aside (timed out past their budget, or quarantined after stopping
    the engine), newest first, as JSON: request id, function, key, error, epoch."""
    print_json(_admin(url, token, lambda c: c.dead_letters(limit)))


def pause(
    after_epoch: int | None = typer.Option(None, "--after-epoch", min=-1, help="Pause once this epoch is done."),
    wait: bool = typer.Option(True, help="Wait until no epoch runs any more."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Start no new epoch (requests keep being accepted and wait); prints the status."""

    def go(c: Any) -> Any:
        st = c.pause(after_epoch)
        deadline = time.monotonic() + 60
        while wait and after_epoch is None and st["state"] != "paused" and time.monotonic() < deadline:
            time.sleep(0.05)
            st = c.status()
        return st

    print_json(_admin(url, token, go))


def resume(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Let epochs start again (waiting requests run in arrival order); prints the status."""
    print_json(_admin(url, token, lambda c: c.resume()))


def rescale(
    partitions: int | None = typer.Argument(None, min=1, help="The new number of engine partitions."),
    log_partitions: int | None = typer.Option(
        None, "--log-partitions", min=1, help="The new number of input-log partitions (Spark; no pause)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Change the running deployment's engine partition count at an epoch boundary and/or its input log's
    partition count; prints the measured pause (from, to, epoch, keys, wait_s, pause_s, cpu_s, log), or only
    ``{"log": ...}`` when only the log was resized."""
    if partitions is None and log_partitions is None:
        raise typer.BadParameter("give PARTITIONS, --log-partitions or both")
    print_json(_admin(url, token, lambda c: c.rescale(partitions, log_partitions=log_partitions)))


def read_state(
    operator: str = typer.Argument(..., help="Operator name."),
    keys: list[str] = typer.Argument(None, help="Entity keys (default: every entity, up to --limit)."),
    epoch: int | None = typer.Option(None, help="An earlier epoch still retained (default: the latest)."),
    limit: int | None = typer.Option(None, min=1, help="Most entities to return (a page; at most max_scan)."),
    after: str | None = typer.Option(None, help="Page on: the entities whose key sorts after this one (the "
                                     "previous page's next; give its --epoch too for the same cut)."),
    prefix: str | None = typer.Option(None, help="Only the entities whose key starts with this."),
    internal: bool = typer.Option(False, "--internal", help="Also show the engine's internal items (the "
                                  "entities' pending timers), hidden by default."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Print OPERATOR's entities as of one committed epoch (one consistent cut) as JSON, with that epoch and
    ``next``, the --after of the following page (null on the last)."""
    cut = _admin(url, token, lambda c: c.read_state(operator, keys or None, epoch=epoch, limit=limit, after=after,
                                                    prefix=prefix))
    print_json(cut if internal else hide_internal(cut))


def hide_internal(cut: dict[str, object]) -> dict[str, object]:
    """``cut`` (an admin read) without the engine's internal items (timers, stored beside an entity's items
    under :data:`charon.core.timers.ITEM_PREFIX`); an entity that had nothing else is left out."""
    from charon.core.timers import ITEM_PREFIX

    items: dict[str, dict[str, object]] = {}
    hidden: set[str] = set()
    raw_items, raw_entities = cut.get("items"), cut.get("entities")
    all_items = raw_items if isinstance(raw_items, dict) else {}
    all_entities = raw_entities if isinstance(raw_entities, dict) else {}
    for key, its in all_items.items():
        mine = {name: v for name, v in its.items() if not name.startswith(ITEM_PREFIX)}
        if mine:
            items[key] = mine
        if len(mine) < len(its):
            hidden.add(key)
    entities = {k: v for k, v in all_entities.items()
                if not (k in hidden and v is None and k not in items)}
    return {**cut, "entities": entities, "items": items, "count": len(entities)}


def update(
    update_id: str = typer.Argument(..., metavar="ID", help="Update id: an id runs once."),
    operator: str = typer.Argument(..., help="Operator name."),
    function: str = typer.Argument(..., help="A function of the deployed application."),
    args_json: str = typer.Argument("[]", metavar="ARGS_JSON", help="JSON list of positional arguments."),
    keys: list[str] = typer.Option(None, "--key", help="Entity keys (default: every entity of OPERATOR)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """A serializable admin update: FUNCTION on every entity, alone at an epoch boundary, once per ID."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise _fail(f"ARGS_JSON is not valid JSON: {exc}", ExitCode.USAGE) from None
    if not isinstance(args, list):
        raise _fail("ARGS_JSON must be a JSON list", ExitCode.USAGE)
    print_json(_admin(url, token, lambda c: c.admin_update(update_id, operator, function, *args, keys=keys or None)))


def deploy(
    ref: str = typer.Argument(..., metavar="MODULE:APP", help="The new code (allowed by the gateway's code_refs)."),
    version: str = typer.Argument(..., help="Its version label."),
    migrate: tuple[str, str, str] | None = typer.Option(
        None, "--migrate", metavar="OPERATOR FUNCTION ARGS_JSON",
        help="A function of the new code run on every entity of OPERATOR at the boundary."),
    compatible: bool = typer.Option(
        False, "--compatible", help="Transactions deferred before the boundary finish on the old code "
        "(in-process runtimes; no --migrate)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """A code update at one epoch boundary: strict (every partition switches to MODULE:APP once every
    transaction begun on the old code finished) or --compatible (deferred ones finish on the old code)."""
    migration = None
    if migrate is not None and migrate[0] is not None:
        try:
            args = json.loads(migrate[2])
        except json.JSONDecodeError as exc:
            raise _fail(f"ARGS_JSON is not valid JSON: {exc}", ExitCode.USAGE) from None
        if not isinstance(args, list):
            raise _fail("ARGS_JSON must be a JSON list", ExitCode.USAGE)
        migration = (migrate[0], migrate[1], args)
    if compatible and migration is not None:
        raise _fail("a --compatible update has no --migrate", ExitCode.USAGE)
    mode = "compatible" if compatible else "strict"
    print_json(_admin(url, token, lambda c: c.update_code(ref, version, migration, mode)))


def metrics(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print the Prometheus metrics (/metrics)."""
    typer.echo(_admin(url, token, lambda c: c.metrics()), nl=False)


def sql(
    query: str = typer.Argument(..., help='e.g. "SELECT sum(value) FROM account"'),
    url: str | None = typer.Option(None, "--url", show_default=False,
                                   help="Ask the running node at URL instead (its POST /admin/sql: one safe SELECT "
                                   "in its SQL sandbox, answered in well under a second; no local Spark)."),
    token: str | None = TokenOpt,
    data_dir: str = typer.Option("charon-data", "--data-dir", envvar="CHARON_DATA_DIR",
                                 help="The deployment's data directory (either runtime; it may be running)."),
    epoch: int | None = typer.Option(None, help="An earlier retained epoch (default: the newest)."),
    limit: int = typer.Option(1000, min=1, help="Most rows to print."),
    master: str = typer.Option("local[2]", envvar="CHARON_MASTER", help="Spark master of the reading session."),
) -> None:
    """Run SQL over the durable state at one consistent epoch: one view per operator with the columns key, item,
    value, value_json, epoch. Locally a Spark session of its own reads --data-dir (a JVM start, ~40 s; its
    progress on stderr); with --url the running node answers (see `charon.runtime.spark.statesql`)."""
    if url is not None:
        doc = _admin(url, token, lambda c: c.sql(query, epoch))
        rows = doc.get("rows") or []
        _print_rows(list(doc.get("columns") or []), rows[:limit], f"epoch {doc.get('epoch')}")
        if doc.get("truncated") or len(rows) > limit:
            err_console.print("charon sql: the result was truncated (the node's sql_max_rows or --limit)")
        return
    with _stage("reading the data directory's layout"):
        try:
            from charon.runtime.spark.statesql import layout_of, register_views
        except ImportError as exc:
            raise _fail(f"SQL over state needs PySpark: {exc}", ExitCode.UNAVAILABLE) from None
        try:
            layout = layout_of(data_dir)
        except (FileNotFoundError, ValueError, KeyError) as exc:
            raise _fail(str(exc), ExitCode.FAILED) from None
    import tempfile

    from charon.config import SparkConfig
    from charon.runtime.spark.session import make_session

    scratch = tempfile.mkdtemp(prefix="charon-sql-")  # the reading session's own log, never the deployment's
    try:
        with _stage("starting Spark (JVM warm-up ~40 s)"):
            spark = make_session(SparkConfig(master=master, data_dir=scratch, app_name="charon-sql"))
        try:
            with _stage(f"running the query at epoch {layout.epoch if epoch is None else epoch}"):
                register_views(spark, layout, epoch)
                df = spark.sql(query)
                rows = df.limit(limit).collect()
        except CharonError as exc:
            raise _fail(f"{type(exc).__name__}: {exc}", ExitCode.REJECTED) from None
        except Exception as exc:  # noqa: BLE001 - Spark's analysis/parse errors, shown to the user
            raise _fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}",
                        ExitCode.REJECTED) from None
        finally:
            with _stage("stopping Spark"):
                spark.stop()
        _print_rows(list(df.columns), [list(r) for r in rows], f"epoch {layout.epoch if epoch is None else epoch}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _stage(text: str) -> Iterator[None]:
    """A stage of a long command on stderr (stdout stays the result): a spinner on a terminal, else a line."""
    if err_console.is_terminal:
        with err_console.status(f"{text}…"):
            yield
    else:
        err_console.print(f"charon: {text}…", markup=False, highlight=False, soft_wrap=True)
        yield


def _print_rows(columns: list[str], rows: list[list[object]], title: str) -> None:
    table = Table(*columns, title=title)
    for r in rows:
        table.add_row(*[Text(v if isinstance(v, str) else json.dumps(v, default=str)) for v in r])
    console.print(table)
