"""``charon limits show|set|clear|remove``: admission limits from the command line (``/admin/limits``)."""

from __future__ import annotations

import json
from typing import cast

import typer
from rich.console import Console
from rich.table import Table

from charon.cli.parts import JsonOpt, TokenOpt, UrlOpt, call_gateway

limits_app = typer.Typer(help="Admission limits: show them with the waiting requests, change them at run time.",
                         no_args_is_help=True)
console = Console()


def _print(doc: dict[str, object], as_json: bool) -> None:
    if as_json:
        console.print_json(json.dumps(doc))
        return
    limits = cast(dict[str, dict[str, object]], doc["limits"])
    waiting_by = cast(dict[str, dict[str, int]], doc["waiting"])
    table = Table("target", "concurrency", "rate", "burst", "per", "priority", "queue", "source", "waiting")
    for target, lim in limits.items():
        waiting = sum(waiting_by.get(target, {}).values())
        table.add_row(target, *(str(lim.get(k, "")) for k in ("concurrency", "rate", "burst", "per", "priority",
                                                             "queue", "source")), str(waiting))
    console.print(table)
    console.print(f"{doc['held']} requests wait for admission (at most {doc['max_waiting']}); epoch {doc['epoch']}")


@limits_app.command("show")
def show(url: str = UrlOpt, token: str | None = TokenOpt, as_json: bool = JsonOpt) -> None:
    """The limits in force and the requests waiting per limit."""
    _print(call_gateway(url, token, "limits", timeout=60.0), as_json)


@limits_app.command("set")
def set_limit(
    target: str = typer.Argument(..., help="'operator' or 'operator/function'."),
    concurrency: int | None = typer.Option(None, help="At most this many per epoch and bucket."),
    rate: float | None = typer.Option(None, help="Requests per second and bucket (token bucket)."),
    burst: float | None = typer.Option(None, help="The bucket's size (default max(1, rate))."),
    per: str = typer.Option("all", help="'all', 'key' or 'arg:<i>[.<field>...]'."),
    priority: str = typer.Option("0", help="An integer or 'arg:<i>[.<field>...]' (higher first)."),
    queue: int = typer.Option(1000, help="Waiting requests per bucket before 429 RateLimited."),
    url: str = UrlOpt, token: str | None = TokenOpt, as_json: bool = JsonOpt,
) -> None:
    """Set a limit on a target (applied at the next epoch boundary, recorded in the log)."""
    lim: dict[str, object] = {"per": per, "queue": queue,
                              "priority": int(priority) if priority.lstrip("-").isdigit() else priority}
    for k, v in (("concurrency", concurrency), ("rate", rate), ("burst", burst)):
        if v is not None:
            lim[k] = v
    _print(call_gateway(url, token, "set_limit", target, lim, timeout=60.0), as_json)


@limits_app.command("clear")
def clear(target: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt,
          as_json: bool = JsonOpt) -> None:
    """Go back to the limit the code declares for a target (if any)."""
    _print(call_gateway(url, token, "set_limit", target, clear=True, timeout=60.0), as_json)


@limits_app.command("remove")
def remove(target: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt,
           as_json: bool = JsonOpt) -> None:
    """Lift a target's limit (the code's included) until cleared."""
    _print(call_gateway(url, token, "set_limit", target, remove=True, timeout=60.0), as_json)
