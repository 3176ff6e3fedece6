"""``charon workflows ...``: workflows over the gateway's routes (``charon/server/workflows.py``), printed as JSON:
list, show, cancel, and the version drain and migration (an operator's move of in-flight workflows)."""

from __future__ import annotations

import typer

from charon.cli.parts import TokenOpt, UrlOpt, call_gateway, print_json

workflows_app = typer.Typer(help="Workflows: list, show, cancel; versions (the drain: in-flight workflows per code "
                            "version) and migrate (move them to the deployed version).", no_args_is_help=True)


@workflows_app.command("list")
def workflows_list(name: str = typer.Argument(..., help="The workflow's name."),
                   after: str | None = typer.Option(None, "--after", help="The previous page's `next` cursor."),
                   limit: int = typer.Option(100, min=1, max=1000, help="Page size."),
                   url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """A page of workflow NAME's records in id order (`next`: the cursor of the following page)."""
    print_json(call_gateway(url, token, "workflows", name, after=after, limit=limit, timeout=70.0))


@workflows_app.command("show")
def workflows_show(name: str = typer.Argument(...), workflow_id: str = typer.Argument(..., metavar="ID"),
                   url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """One workflow's record: status, version, step, what it awaits, state, the history of its steps."""
    print_json(call_gateway(url, token, "workflow", name, workflow_id, timeout=70.0))


@workflows_app.command("cancel")
def workflows_cancel(name: str = typer.Argument(...), workflow_id: str = typer.Argument(..., metavar="ID"),
                     reason: str = typer.Option("cancelled by an operator", help="Recorded as its error."),
                     url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Cancel a workflow that has not finished (its timers cancelled; later deliveries are stale)."""
    print_json(call_gateway(url, token, "cancel_workflow", name, workflow_id, reason, timeout=70.0))


@workflows_app.command("versions")
def workflows_versions(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """The drain: how many workflows still run (running, waiting) on each code version, and the deployed one."""
    print_json(call_gateway(url, token, "workflow_versions", timeout=70.0))


@workflows_app.command("migrate")
def workflows_migrate(from_version: str = typer.Option(..., "--from", help="The code version to move off."),
                      workflow: list[str] = typer.Option([], "--workflow", help="Only this workflow (repeat; "
                                                         "default: every workflow with some on --from)."),
                      dry_run: bool = typer.Option(False, "--dry-run", help="Count, change nothing."),
                      limit: int = typer.Option(100, min=1, max=1000, help="Records per call."),
                      url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Move the in-flight workflows on --from to the deployed code version (audited; each workflow's own transaction
    decides: one finished meanwhile, or at a step the deployed code lacks, is skipped as NotMigratable). A migration
    the deployed code declares (@wf.migrates) also maps the step and the state; --dry-run forecasts the skips
    (would_skip)."""
    names = list(workflow)
    if not names:
        per_workflow = call_gateway(url, token, "workflow_versions", timeout=70.0)["workflows"]
        assert isinstance(per_workflow, dict)
        names = sorted(n for n, per in per_workflow.items() if from_version in per)
    print_json({name: call_gateway(url, token, "migrate_workflows", name, from_version, dry_run=dry_run, limit=limit,
                                   timeout=70.0)
                for name in names})
