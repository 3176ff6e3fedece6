"""Reference pages generated at build time: the CLI (from the Typer app), HTTP (the OpenAPI document) and the
configuration (from ``charon/config.py``: each setting's default and its comment), so they cannot go stale."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
CLI_PAGE = "reference/cli.md"
HTTP_PAGE = "reference/http.md"
OPENAPI_FILE = "reference/openapi.json"
CONFIG_PAGE = "reference/configuration.md"


def cli_markdown() -> str:
    """The Typer app's own documentation (``typer charon.cli utils docs``)."""
    out = subprocess.run(
        [sys.executable, "-m", "typer", "charon.cli", "utils", "docs", "--name", "charon", "--title", "CLI"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    intro = (
        "Generated from the Typer application (`charon/cli/`) when the site is built. After the set-up "
        "(`./scripts/test` or `./scripts/demo`) the command is `.venv/bin/charon` (or `charon` once "
        "`.venv/bin` is on your `PATH`, e.g. after `source .venv/bin/activate`).\n\n"
    )
    head, _, rest = out.partition("\n")
    return f"{head}\n\n{intro}{rest}"


def openapi() -> dict[str, Any]:
    """The gateway's OpenAPI document for the quickstart's bank application, with admin and effect routes."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from bank import app  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES))
    from charon.server.openapi import openapi_document

    return openapi_document(app, secured=True, effects=True)


def _schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True)


def http_markdown(doc: dict[str, Any]) -> str:
    """One section per route: parameters, the request body's schema and every answer."""
    lines = [
        "# HTTP API",
        "",
        "Generated from the gateway's OpenAPI document (`charon/server/openapi.py`) when the site is built, here "
        "for the [quickstart's bank](../quickstart.md) (`docs/examples/bank.py`): a running gateway serves its "
        "own application's document at `GET /openapi.json`. The whole document: [openapi.json](openapi.json). "
        "Routes marked *admin* need the bearer token (`Authorization: Bearer <token>`).",
        "",
    ]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            lines += [f"## `{method.upper()} {path}`", "", op.get("summary", ""), ""]
            if op.get("description"):
                lines += [op["description"], ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | schema | meaning |", "|---|---|---|---|"]
                for p in params:
                    schema = json.dumps(p.get("schema", {}), sort_keys=True).replace("|", "\\|")
                    desc = p.get("description", "").replace("|", "\\|")
                    lines.append(f"| `{p['name']}` | {p['in']} | `{schema}` | {desc} |")
                lines.append("")
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                lines += [f"Request body (`{media}`):", "", "```json", _schema_text(content.get("schema", {})),
                          "```", ""]
            lines += ["| status | answer |", "|---|---|"]
            for status, resp in op.get("responses", {}).items():
                desc = resp.get("description", "").replace("|", "\\|")
                lines.append(f"| {status} | {desc} |")
            lines.append("")
    return "\n".join(lines)


@dataclasses.dataclass
class Setting:
    name: str
    default: str
    meaning: str


def settings_of(cls_name: str) -> list[Setting]:
    """A config dataclass's fields in order, each with its default (source text) and its comment: the one on
    the field's line, else the comment lines right above it."""
    src = (ROOT / "charon" / "config.py").read_text()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            continue
        if node.target.id == "spark_conf":  # extra Spark settings: code only, no environment variable
            continue
        line = node.lineno
        text = comments.get(line, "")
        if not text:
            above = []
            i = line - 1
            while i in comments and src.splitlines()[i - 1].strip().startswith("#"):
                above.insert(0, comments[i])
                i -= 1
            text = " ".join(above)
        nxt = node.end_lineno + 1 if node.end_lineno else line + 1
        while nxt in comments and src.splitlines()[nxt - 1].strip().startswith("#") and text.endswith(":"):
            text += " " + comments[nxt]
            nxt += 1
        default = ast.get_source_segment(src, node.value) or ""
        if default.startswith("field("):
            default = "computed" if "default_factory=_default" in default else "{}"
        out.append(Setting(node.target.id, default, text))
    return out


def _table(settings: list[Setting], env_prefix: str) -> list[str]:
    rows = ["| setting | environment | default | meaning |", "|---|---|---|---|"]
    for s in settings:
        meaning = s.meaning.replace("|", "\\|")
        rows.append(f"| `{s.name}` | `{env_prefix}{s.name.upper()}` | `{s.default}` | {meaning} |")
    return rows


def config_markdown() -> str:
    notes = (ROOT / "docs" / "reference" / "_configuration-notes.md").read_text()
    lines = [
        "# Configuration",
        "",
        "Generated from `charon/config.py` when the site is built: every setting, its environment variable, its "
        "default (as written in the source) and the comment beside it.",
        "",
        "## Spark runtime (`charon.config.SparkConfig`)",
        "",
        *_table(settings_of("SparkConfig"), "CHARON_"),
        "",
        "## HTTP gateway (`charon.config.GatewayConfig`)",
        "",
        "`charon run --token` (or `CHARON_TOKEN`) and `--max-body` set the gateway's token and `max_body`; "
        "the default of `max_connections` is half the process's open-file limit, within 64..4096.",
        "",
        *_table(settings_of("GatewayConfig"), "CHARON_GATEWAY_"),
        "",
        notes,
    ]
    return "\n".join(lines)


RESULTS_PAGE = "internals/results.md"


def results_page() -> tuple[str, list[tuple[str, Path]]]:
    """``benchmarks/RESULTS.md`` with its images carried along (under ``internals/``) and its link to the
    history file, which is not on the site, named as a file of the repository."""
    bench = ROOT / "benchmarks"
    text = (bench / "RESULTS.md").read_text()
    text = text.replace("[HISTORY.md](HISTORY.md)", "`benchmarks/HISTORY.md`")
    images = []
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        images.append((f"internals/bench-img/{target}", bench / target))
        text = text.replace(f"]({target})", f"](bench-img/{target})")
    return text, images


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages (and the OpenAPI JSON) to the site."""
    from mkdocs.structure.files import File

    doc = openapi()
    for uri, content in (
        (CLI_PAGE, cli_markdown()),
        (HTTP_PAGE, http_markdown(doc)),
        (OPENAPI_FILE, json.dumps(doc, indent=2)),
        (CONFIG_PAGE, config_markdown()),
    ):
        files.append(File.generated(config, uri, content=content))
    text, images = results_page()
    files.append(File.generated(config, RESULTS_PAGE, content=text))
    for uri, src in images:
        files.append(File.generated(config, uri, abs_src_path=str(src)))
    return files
