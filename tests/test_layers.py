"""The package's shape: layer import directions (parsed with ``ast``), the pinned public surface, the
installed package data, and no stale references to pre-layer module paths."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import charon

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "charon"

#: Top-level modules every layer may use: the programming model, its errors, records, encoding and config.
#: (The HTTP client, cli, testing, simulation, apps and bench are entry points above every layer.)
MODEL = {"charon.errors", "charon.serde", "charon.messages", "charon.operator", "charon.config",
         "charon.client_errors"}
LAYERS = ("core", "state", "log", "runtime", "server")
#: What each layer may import besides itself and MODEL (a module name or a ``layer.`` prefix).
ALLOWED = {
    "model": {"charon.core.routing"},
    "core": {"charon.state.store"},
    "state": set(),
    "log": {"charon.core."},
    "runtime": {"charon.core.", "charon.state.", "charon.log."},
    "server": {"charon.core.", "charon.log.", "charon.runtime.contract"},  # engines only through the contract
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(mod: str) -> str | None:
    """The layer a module belongs to; None for top-level entry points (cli, testing, apps, bench, ...)."""
    if mod in MODEL:
        return "model"
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return None


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """Every ``charon`` module the file imports anywhere (function bodies and TYPE_CHECKING included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "charon"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "charon":
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if is_module(sub) else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add(f"<relative import level {node.level}>")
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        layer = layer_of(mod)
        if layer is None:
            continue
        own = "charon." + layer + "." if layer != "model" else None
        allowed = ALLOWED[layer]
        for dep in sorted(deps):
            ok = (
                dep in MODEL
                or (own is not None and (dep + ".").startswith(own))
                or dep in allowed
                or any(a.endswith(".") and dep.startswith(a) for a in allowed)
            )
            if not ok:
                bad.append(f"{mod} ({layer}) imports {dep}")
    return bad


def test_layer_import_directions() -> None:
    graph = import_graph()
    # The parser sees real edges (so an empty graph cannot pass): a few known ones across layers.
    assert "charon.core.epoch" in graph["charon.runtime.spark.runtime"]
    assert "charon.state.store" in graph["charon.core.partition"]
    assert "charon.core.partition" in graph["charon.simulation"]  # `from charon.core import partition`
    assert "charon.log.client" in graph["charon.server.gateway"]
    assert violations(graph) == []


def test_layer_check_rejects_wrong_directions() -> None:
    graph = {
        "charon.core.epoch": {"charon.runtime.node", "charon.state.lmdbstore", "charon.errors"},
        "charon.server.gateway": {"charon.runtime.inprocess"},
        "charon.state.store": {"charon.core.routing"},
        "charon.log.sqlite": {"charon"},
        "charon.cli": {"charon.runtime.spark.runtime", "charon.server.gateway"},
    }
    assert violations(graph) == [
        "charon.core.epoch (core) imports charon.runtime.node",
        "charon.core.epoch (core) imports charon.state.lmdbstore",
        "charon.server.gateway (server) imports charon.runtime.inprocess",
        "charon.state.store (state) imports charon.core.routing",
        "charon.log.sqlite (log) imports charon",
    ]


def test_every_layer_documents_its_rules() -> None:
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PKG / layer / "__init__.py").read_text()))
        assert doc and "import" in doc, layer


PUBLIC = [
    "Application",
    "BadArguments",
    "CallGraphLimitExceeded",
    "CharonError",
    "Context",
    "Deployment",
    "EngineUnavailable",
    "Function",
    "IdempotencyConflict",
    "IllegalAwait",
    "InProcessRuntime",
    "InvalidKey",
    "InvocationTimeout",
    "LogUnavailable",
    "NonDeterministicFunction",
    "Operator",
    "PayloadTooLarge",
    "Quarantined",
    "Reply",
    "Request",
    "SerializationError",
    "Timer",
    "TransactionAborted",
    "UnawaitedCall",
    "UndeclaredPortal",
    "UnknownFunction",
    "UnknownOperator",
    "ValueTooLarge",
]


def test_public_surface_is_pinned() -> None:
    assert charon.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(charon, name) is not None
    errors = {n for n in PUBLIC if n.endswith(("Error", "Aborted", "Unavailable", "Large", "Exceeded"))}
    errors |= {"BadArguments", "IdempotencyConflict", "IllegalAwait", "InvalidKey", "InvocationTimeout",
               "NonDeterministicFunction", "Quarantined", "UnawaitedCall", "UndeclaredPortal", "UnknownFunction",
               "UnknownOperator"}
    for name in errors:
        assert issubclass(getattr(charon, name), charon.CharonError), name
    # Every engine error a reply can carry is importable from the top level.
    from charon.errors import ENGINE_ERRORS

    assert set(ENGINE_ERRORS) <= set(PUBLIC)


def test_star_import_in_a_fresh_interpreter() -> None:
    code = "from charon import *; import charon; print(sorted(n for n in charon.__all__ if n not in globals()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_no_pre_layer_aliases() -> None:
    import importlib.util

    for old in ("spark", "partition", "context", "epoch", "sequencer", "routing", "inprocess", "node", "store",
                "lmdbstore", "durable", "logclient", "gateway"):
        assert importlib.util.find_spec(f"charon.{old}") is None, old


OLD = re.compile(
    r"(?<![\w.])charon\.(spark|partition|context|epoch|sequencer|routing|inprocess|node|store|lmdbstore|durable"
    r"|logclient|gateway)\b|(?<![\w.])charon\.log\.(InputLog|OutputLog)\b|(?<![\w/])charon/(spark/|"
    r"(partition|context|epoch|sequencer|routing|inprocess|node|store|lmdbstore|durable|log|logclient|gateway)\.py)"
)
#: The Java shim's on-disk marker keeps the old module name so shims written before the move still match.
KEPT = '_SHIM_MARK = "written by charon.spark.java"'


def test_no_stale_module_paths_in_the_repo() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    stale = []
    for rel in tracked.split():
        if not rel.endswith((".py", ".md", ".sh", ".toml", ".properties")) and not rel.startswith("scripts/"):
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OLD.search(line) and KEPT not in line and rel != "tests/test_layers.py":
                stale.append(f"{rel}:{i}: {line.strip()}")
    assert stale == []


@pytest.mark.slow
def test_wheel_ships_every_layer_and_package_data(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(PKG, src / "charon", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("charon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"charon/py.typed", "charon/runtime/spark/log4j2.properties"} <= names
    for layer in (*LAYERS, "runtime/spark", "apps", "bench"):
        assert f"charon/{layer}/__init__.py" in names, layer
    shipped = {n for n in names if n.startswith("charon/") and n.endswith(".py")}
    assert shipped == {p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py")}
