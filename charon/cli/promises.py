"""``charon promises ...`` and ``charon schedules ...``: durable promises and schedules over the gateway's routes
(``charon/server/promises.py``, ``charon/server/schedules.py``), printed as JSON."""

from __future__ import annotations

import json
from typing import Any

import typer

from charon.cli.bulk import add_bulk_command
from charon.cli.parts import TokenOpt, UrlOpt, call_gateway, print_json

promises_app = typer.Typer(help="Durable promises: list, show, resolve, reject, cancel (one, or in bulk by "
                            "filter).", no_args_is_help=True)
schedules_app = typer.Typer(help="Schedules: list, show, create, pause, resume, delete (one, or in bulk by "
                             "filter).", no_args_is_help=True)
LimitOpt = typer.Option(100, min=1, max=1000, help="Page size.")
AfterOpt = typer.Option(None, "--after", help="The previous page's `next` cursor.")


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{what} is not valid JSON: {exc}") from None


@promises_app.command("list")
def promises_list(status: str | None = typer.Option(None, help="pending, resolved, rejected, timed_out, cancelled."),
                  after: str | None = AfterOpt, limit: int = LimitOpt, url: str = UrlOpt,
                  token: str | None = TokenOpt) -> None:
    """A page of promises in id order (`next`: the cursor of the following page)."""
    print_json(call_gateway(url, token, "promises", status, after=after, limit=limit))


@promises_app.command("show")
def promises_show(promise_id: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """One promise's record."""
    print_json(call_gateway(url, token, "promise", promise_id))


@promises_app.command("resolve")
def promises_resolve(promise_id: str = typer.Argument(...),
                     value_json: str = typer.Argument("null", metavar="VALUE_JSON", help="The value, as JSON."),
                     request_id: str | None = typer.Option(None, "--request-id", help="Idempotency key."),
                     url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Resolve a promise with VALUE_JSON: its continuation runs once (exit 1 PromiseConflict if settled before)."""
    print_json(call_gateway(url, token, "resolve", promise_id, _json(value_json, "VALUE_JSON"), request_id=request_id))


@promises_app.command("reject")
def promises_reject(promise_id: str = typer.Argument(...), error: str = typer.Argument("rejected"),
                    url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Reject a promise: its continuation runs once with PromiseRejected."""
    print_json(call_gateway(url, token, "reject", promise_id, error))


@promises_app.command("cancel")
def promises_cancel(promise_id: str = typer.Argument(...),
                    reason: str = typer.Option("cancelled by an operator", help="Given to the continuation."),
                    url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Cancel a pending promise: its continuation runs once with PromiseCancelled."""
    print_json(call_gateway(url, token, "cancel_promise", promise_id, reason))


@schedules_app.command("list")
def schedules_list(after: str | None = AfterOpt, limit: int = LimitOpt, url: str = UrlOpt,
                   token: str | None = TokenOpt) -> None:
    """A page of schedules in name order."""
    print_json(call_gateway(url, token, "schedules", after=after, limit=limit))


@schedules_app.command("show")
def schedules_show(name: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """One schedule's record: spec, paused, next and last slot, fired and skipped counts."""
    print_json(call_gateway(url, token, "schedule", name))


@schedules_app.command("create")
def schedules_create(name: str = typer.Argument(...), cron: str = typer.Argument(..., help="5 fields, or 6 "
                                                                                 "with seconds first (UTC)."),
                     operator: str = typer.Argument(...), key: str = typer.Argument(...),
                     function: str = typer.Argument(..., help="A public function f(ctx, firing, *args)."),
                     args_json: str = typer.Argument("[]", metavar="ARGS_JSON"),
                     catch_up: int = typer.Option(0, "--catch-up", min=0, max=100,
                                                  help="Missed slots that fire too after a downtime."),
                     url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Create a schedule at run time."""
    args = _json(args_json, "ARGS_JSON")
    if not isinstance(args, list):
        raise typer.BadParameter("ARGS_JSON must be a JSON list")
    print_json(call_gateway(url, token, "create_schedule", name, cron, operator, key, function, args,
                            catch_up=catch_up))


@schedules_app.command("pause")
def schedules_pause(name: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Stop firing until resumed."""
    print_json(call_gateway(url, token, "pause_schedule", name))


@schedules_app.command("resume")
def schedules_resume(name: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Fire again from the first slot after now."""
    print_json(call_gateway(url, token, "resume_schedule", name))


@schedules_app.command("delete")
def schedules_delete(name: str = typer.Argument(...), url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Delete a schedule."""
    print_json(call_gateway(url, token, "delete_schedule", name))


add_bulk_command(promises_app, "promises")
add_bulk_command(schedules_app, "schedules")
