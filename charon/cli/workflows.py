"""``charon workflows ...``: workflows over the gateway's routes (``charon/server/workflows.py``), printed as JSON:
list, show, cancel, and the version drain and migration (an operator's move of in-flight workflows)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.text import Text
from rich.tree import Tree

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


def _when(t: object) -> str:
    """Unix seconds as a UTC time (``-`` when not a number)."""
    if isinstance(t, bool) or not isinstance(t, int | float):
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _next(entry: Mapping[str, object]) -> str:
    """What a step led to: what it awaited next, how it finished, or a migration."""
    step: Any = entry
    if step.get("awaits"):
        a = step["awaits"]
        return f"awaits {a['kind']} " + (a["id"] if "id" in a else ", ".join(a.get("ids", [])))
    if step.get("finished"):
        return f"finished {step['finished']}"
    if step.get("migrated"):
        return "migrated {} -> {}".format(*step["migrated"])
    return ""


def draw_tree(tree: Mapping[str, object]) -> Tree:
    """A workflow's tree (``GET /workflows/{name}/{id}/tree``) as a rich Tree."""
    doc: Any = tree  # a JSON document
    root = Tree(Text(f"workflow {doc['workflow']} {doc['id']!r}: {doc['status']} at step {doc['step']!r} "
                     f"(version {doc['version']}, epoch {doc['epoch']})", style="bold"))
    if doc.get("error"):
        root.add(Text(f"error: {doc['error']}", style="red"))
    if doc.get("omitted"):
        root.add(Text(f"({doc['omitted']} earlier steps not shown)"))
    for s in doc["steps"]:
        mark = "ok" if s.get("ok", True) else "after a failed outcome"
        label = f"step {s['step']} seq={s['seq']} attempt={s.get('attempt', '-')} tid={s.get('tid')} [{mark}]"
        node = root.add(Text(f"{label} {_next(s)}".rstrip()))
        graph = s.get("call_graph")
        if graph is None:
            node.add(Text(f"call graph {s.get('note', 'not kept')}", style="dim"))
            continue
        nodes: dict[int, Tree] = {}
        for n in graph:
            parent = nodes.get(n["parent"], node) if n["parent"] is not None else node
            outcome = {"ok": "ok", "raised": "RAISED"}.get(n["outcome"], "-")
            nodes[n["index"]] = parent.add(Text(f"{n['kind']} {n['operator']}.{n['function']} key={n['key']!r} "
                                                f"[{outcome}]"))
        if s.get("truncated"):
            node.add(Text("(call graph truncated)", style="dim"))
    for a in doc["awaiting"]:
        label = f"awaiting {a['kind']} {a['id']}"
        if a.get("promise"):
            p = a["promise"]
            label += f": {p['status']}, deadline {_when(p['deadline'])}"
        elif a.get("effect"):
            e = a["effect"]
            label += f": {e['status']}, attempts {e['attempts']}/{e['max_attempts']}"
            if e.get("last_error"):
                label += f", last error {e['last_error']}"
        elif a["kind"] == "timer":
            label += f": due {_when(a.get('due'))}"
        if a.get("note"):
            label += f" ({a['note']})"
        root.add(Text(label, style="yellow"))
    return root


@workflows_app.command("show")
def workflows_show(name: str = typer.Argument(...), workflow_id: str = typer.Argument(..., metavar="ID"),
                   tree: bool = typer.Option(False, "--tree", help="Draw it as one tree: its steps with their call "
                                             "graphs, and what it awaits now."),
                   steps: int = typer.Option(50, min=1, max=200, help="With --tree: the newest steps shown."),
                   url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """One workflow's record: status, version, step, what it awaits, state, the history of its steps (--tree: the
    same drawn as one tree, each step with its transaction's call graph while the inspector keeps it)."""
    if tree:
        doc = call_gateway(url, token, "workflow_tree", name, workflow_id, steps=steps, timeout=70.0)
        Console(soft_wrap=True).print(draw_tree(doc))
        return
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
