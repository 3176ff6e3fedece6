"""``charon {requests,promises,schedules,effects} bulk ACTION --where...``: bulk operations by filter over the
gateway's ``POST /admin/bulk/{resource}/{action}`` (:mod:`charon.server.bulk`), page after page under one
operation id (``--dry-run`` counts first; ``--one-page`` stops after one call and prints its ``next``)."""

from __future__ import annotations

from typing import Any

import typer

from charon.cli.fail import request_failed
from charon.cli.parts import TokenOpt, UrlOpt, console, print_json
from charon.core.bulk import BULK_ACTIONS, MAX_BULK_LIMIT
from charon.errors import CharonError

__all__ = ["add_bulk_command"]

_HELP = {
    "invocations": "Cancel the requests waiting for admission that match (decided by the epoch that takes the "
                   "cancel; each answered InvocationCancelled).",
    "promises": "Cancel the pending promises that match (each through its own cancel: its continuation runs once "
                "with PromiseCancelled).",
    "schedules": "Pause, resume or delete the schedules that match (each through its own transaction).",
    "effects": "Retry or abandon the parked (failed) effects that match (charon run --effects beside the gateway).",
}
_KEY = {"invocations": "the invoked entity's key", "promises": "the waiting entity's key",
        "schedules": "the schedule's name", "effects": "the continuation entity's key"}


def add_bulk_command(group: typer.Typer, resource: str) -> None:
    """Register ``bulk`` on ``group`` for ``resource``."""
    actions = BULK_ACTIONS[resource]

    def bulk(
        action: str = typer.Argument(..., help=" or ".join(actions) + "."),
        operator: str | None = typer.Option(None, "--operator", help="Only this operator's."),
        function: str | None = typer.Option(None, "--function", help="Only this function's (a promise: its "
                                            "continuation; a schedule: its target; an effect: its handler)."),
        key_prefix: str | None = typer.Option(None, "--key-prefix", help=f"Only where {_KEY[resource]} starts so."),
        error_type: str | None = typer.Option(None, "--error-type", help="Effects only: the last error's type."),
        since: float | None = typer.Option(None, "--since", help="Created (appended) at or after, Unix seconds."),
        until: float | None = typer.Option(None, "--until", help="Created (appended) at or before, Unix seconds."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Count what matches; change nothing."),
        limit: int = typer.Option(100, "--limit", min=1, max=MAX_BULK_LIMIT, help="Items looked at per call."),
        one_page: bool = typer.Option(False, "--one-page", help="One call only (its `next` is printed)."),
        cursor: str | None = typer.Option(None, "--cursor", help="Start at a previous call's `next`."),
        reason: str | None = typer.Option(None, "--reason", help="Given to what is cancelled."),
        operation: str | None = typer.Option(None, "--operation", help="The operation id (repeat one that was cut "
                                             "short: nothing is sent twice)."),
        as_json: bool = typer.Option(False, "--json", help="The JSON document instead of a line."),
        url: str = UrlOpt,
        token: str | None = TokenOpt,
    ) -> None:
        if action not in actions:
            raise typer.BadParameter(f"ACTION must be {' or '.join(actions)}")
        where = {k: v for k, v in (("operator", operator), ("function", function), ("key_prefix", key_prefix),
                                   ("error_type", error_type), ("since", since), ("until", until)) if v is not None}
        doc = _run(url, token, resource, action, where, dry_run, limit, one_page, cursor, reason, operation)
        if as_json:
            print_json(doc)
            return
        verb = "would be affected" if dry_run else f"{action} done"
        console.print(f"{resource}: {doc['matched']} matched of {doc['examined']} examined, {doc['done']} {verb}"
                      + (f", skipped {doc['skipped']}" if doc["skipped"] else "")
                      + f"; operation {doc['operation']}" + (f"; next page: --cursor {doc['next']}"
                                                             if doc["next"] else ""), soft_wrap=True)

    bulk.__doc__ = _HELP[resource] + " Filters combine; one call looks at --limit items, the command follows the " \
        "pages to the end (one audited operation)."
    group.command("bulk")(bulk)


def _run(url: str, token: str | None, resource: str, action: str, where: dict[str, Any], dry_run: bool, limit: int,
         one_page: bool, cursor: str | None, reason: str | None, operation: str | None) -> dict[str, Any]:
    import httpx

    from charon.client import Client

    with Client(url, token=token, timeout=120.0, retries=2) as client:
        try:
            if one_page or cursor is not None:
                return client.bulk(resource, action, where, dry_run=dry_run, limit=limit, cursor=cursor,
                                   reason=reason, operation=operation)
            return client.bulk_all(resource, action, where, dry_run=dry_run, limit=limit, reason=reason,
                                   operation=operation)
        except (CharonError, httpx.HTTPError) as exc:
            raise request_failed(exc, url) from None
