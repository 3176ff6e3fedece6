"""``charon requests list|show``: the invocation inspector from the command line (``GET /admin/requests``)."""

from __future__ import annotations

import datetime
from typing import Any

import msgspec
import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text
from rich.tree import Tree

from charon.cli.bulk import add_bulk_command
from charon.cli.parts import JsonOpt, TokenOpt, UrlOpt, call_gateway

requests_app = typer.Typer(help="The invocation inspector: list and search requests, show one with its call graph "
                           "and traceback.", no_args_is_help=True)
console = Console()
err_console = Console(stderr=True)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _ms(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{(b - a) * 1000:.1f}"


@requests_app.command("list")
def list_requests(
    status: str | None = typer.Option(None, help="pending, committed, aborted, deferred or quarantined."),
    operator: str | None = typer.Option(None, help="The invoked function's operator."),
    key: str | None = typer.Option(None, help="The invoked entity's key."),
    function: str | None = typer.Option(None, help="The invoked function."),
    error_type: str | None = typer.Option(None, "--error-type", help="An abort's error type, e.g. ValueError."),
    epoch_min: int | None = typer.Option(None, "--epoch-min", min=0),
    epoch_max: int | None = typer.Option(None, "--epoch-max", min=0),
    since: float | None = typer.Option(None, help="Accepted at or after (Unix seconds)."),
    until: float | None = typer.Option(None, help="Accepted at or before (Unix seconds)."),
    limit: int = typer.Option(50, min=1, max=1000, help="Requests per page."),
    cursor: str | None = typer.Option(None, help="The 'next' of the page before."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Requests the gateway's engine ran or holds, newest first, filtered; the next page's cursor at the end."""
    page: dict[str, Any] = call_gateway(url, token, "requests", status=status, operator=operator, key=key,
                                        function=function, error_type=error_type, epoch_min=epoch_min,
                                        epoch_max=epoch_max, since=since, until=until, limit=limit, cursor=cursor)
    if as_json:
        typer.echo(msgspec.json.encode(page).decode())
        return
    table = Table(Column("request id", no_wrap=True), Column("status", no_wrap=True), "function", "key", "error",
                  "epoch", Column("ms", justify="right"))
    for i in page["items"]:
        table.add_row(i["request_id"], i["status"], f'{i["operator"]}.{i["function"]}', i["key"],
                      i["error_type"] or "", "" if i["epoch"] is None else str(i["epoch"]),
                      _ms(i["accepted_at"], i["replied_at"]))
    # a pipe or a file gets every column whole (rich assumes 80 columns when stdout is not a terminal)
    if not console.is_terminal:
        console.width = max(console.width, 200)
    console.print(table)
    ret = page["retention"]
    console.print(f"{len(page['items'])} shown; the inspector keeps at most {ret['max_records']} requests and "
                  f"{ret['max_bytes']} bytes" + (f"; next page: --cursor {page['next']}" if page["next"] else ""),
                  soft_wrap=True)


@requests_app.command("show")
def show_request(
    request_id: str = typer.Argument(..., help="The request id (the Idempotency-Key, or the one a reply names)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One request: status, timings, (epoch, position), reply or error with its traceback, and its call graph."""
    d: dict[str, Any] = call_gateway(url, token, "request_detail", request_id)
    if as_json:
        typer.echo(msgspec.json.encode(d).decode())
        return
    console.print(Text(f"{d['request_id']} {d['operator']}.{d['function']} on key {d['key']!r}: {d['status']}",
                       style="bold"), soft_wrap=True)
    console.print(f"epoch {d['epoch']}, position {d['position']}; accepted {_when(d['accepted_at'])}, sequenced "
                  f"+{_ms(d['accepted_at'], d['sequenced_at'])} ms, replied +{_ms(d['accepted_at'], d['replied_at'])}"
                  " ms", soft_wrap=True)
    if d["error"] is not None:
        e = d["error"]
        console.print(Text(f"{e['type']}: {e['message']}", style="red"), soft_wrap=True)
        if e["traceback"]:
            console.print(e["traceback"].rstrip(), markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(f"reply: {msgspec.json.encode(d['reply']).decode()}", markup=False, soft_wrap=True)
    nodes = d["call_graph"]
    if nodes:
        trees: dict[int, Tree] = {}
        root: Tree | None = None
        for n in nodes:
            mark = {"ok": "ok", "raised": "RAISED", None: "-"}[n["outcome"]]
            label = f"{n['kind']} {n['operator']}.{n['function']} key={n['key']!r} [{mark}]"
            parent = trees.get(n["parent"]) if n["parent"] is not None else None
            t = Tree(Text(label)) if parent is None else parent.add(Text(label))
            trees[n["index"]] = t
            if root is None:
                root = t
        assert root is not None
        console.print(root)
        if d["truncated"]:
            console.print("(call graph truncated)")


add_bulk_command(requests_app, "invocations")
