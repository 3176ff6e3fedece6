"""The package's shape: layer import directions (parsed with ``ast``), the pinned public surface, the
installed package data, and no stale references to pre-layer module paths."""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import charon

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "charon"

#: Top-level modules every layer may use: the programming model, its errors, records, encoding and config.
#: (The HTTP client, cli, testing, simulation, apps and bench are entry points above every layer.)
MODEL = {"charon.errors", "charon.serde", "charon.messages", "charon.operator", "charon.config", "charon.client_errors"}
LAYERS = ("core", "storage", "state", "log", "runtime", "server")
#: What each layer may import besides itself and MODEL (a module name or a ``layer.`` prefix).
ALLOWED = {
    "model": {"charon.core.routing", "charon.core.limits", "charon.core.schedule_spec"},
    "core": {"charon.state.store"},
    "storage": set(),
    "state": {"charon.storage."},
    "log": {"charon.core."},
    "runtime": {"charon.core.", "charon.storage.", "charon.state.", "charon.log."},
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


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (imports for the type checker, never executed)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


@functools.cache
def _parse(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per run (the layer, tier, cycle and private-import checks each walk every
    module; the trees are only read)."""
    return ast.parse(path.read_text(), str(path))


def imports_of(path: Path, typing: bool = True) -> set[str]:
    """Every ``charon`` module the file imports anywhere (function bodies included; TYPE_CHECKING blocks too
    unless ``typing`` is False)."""
    found: set[str] = set()
    tree = _parse(path)
    skip = set() if typing else _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def import_graph(typing: bool = True) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p, typing) for p in sorted(PKG.rglob("*.py"))}


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
    assert "charon.core.partition" in graph["charon.testing.simulation"]  # `from charon.core import partition`
    assert "charon.log.client" in graph["charon.server.gateway"]
    assert violations(graph) == []


def test_layer_check_rejects_wrong_directions() -> None:
    graph = {
        "charon.core.epoch": {"charon.runtime.node.storage", "charon.state.lmdbstore", "charon.errors"},
        "charon.server.gateway": {"charon.runtime.node.inprocess"},
        "charon.state.store": {"charon.core.routing"},
        "charon.log.sqlite": {"charon"},
        "charon.cli": {"charon.runtime.spark.runtime", "charon.server.gateway"},
    }
    assert violations(graph) == [
        "charon.core.epoch (core) imports charon.runtime.node.storage",
        "charon.core.epoch (core) imports charon.state.lmdbstore",
        "charon.server.gateway (server) imports charon.runtime.node.inprocess",
        "charon.state.store (state) imports charon.core.routing",
        "charon.log.sqlite (log) imports charon",
    ]


#: Import cycles that exist today (each a strongly connected set of modules), being removed by issue 21's split
#: of the runtimes and the gateway. A cycle among modules of one of these sets passes (a set may shrink); any other
#: fails, and so does an entry that no cycle needs any more (remove it).
KNOWN_CYCLES: list[frozenset[str]] = []  # none: keep it so
#: Imports of another module's private name that exist today: (importer, module, name). Others fail, and so does
#: an entry no module makes any more (remove it).
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()  # none: keep it so


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` as its strongly connected sets of modules (Tarjan; each sorted, a module
    importing itself is one): every module of a set reaches every other (a set may hold several cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [sorted(c) for c in sorted(found, key=sorted)]


def cycle_path(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest import cycle through ``members[0]`` within ``members`` (breadth first): ``[a, b, ..., a]``."""
    start, inside = members[0], set(members)
    prev: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w in inside and w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - members come from cycles()


def private_imports(paths: list[Path]) -> set[tuple[str, str, str]]:
    """``(importer, module, name)`` for every ``from charon.x import _name`` (function bodies included) where
    ``_name`` is private (one leading underscore) and ``charon.x`` is another module than the importer."""
    found: set[tuple[str, str, str]] = set()
    for path in paths:
        importer = module_name(path)
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != importer \
                    and node.module.split(".")[0] == "charon":
                found |= {(importer, node.module, a.name) for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")}
            elif isinstance(node, ast.Import):
                found |= {(importer, a.name, "") for a in node.names if a.name.split(".")[0] == "charon"
                          and any(p.startswith("_") and not p.startswith("__") for p in a.name.split("."))}
    return found


def cycle_problems(graph: dict[str, set[str]], known: list[frozenset[str]]) -> list[str]:
    found = cycles(graph)
    bad = [" -> ".join(cycle_path(graph, c)) + f"  (the cycle's modules: {', '.join(c)})"
           for c in found if not any(set(c) <= k for k in known)]
    bad += [f"KNOWN_CYCLES lists {sorted(k)}: no cycle among them any more, remove the entry"
            for k in known if not any(set(c) <= k for c in found)]
    return bad


def test_no_import_cycles() -> None:
    """No cycle among the modules' imports as they run: every import counts, function-local ones included.
    Imports under ``if TYPE_CHECKING:`` never run and are left out: an engine and the runtime it faces name each
    other's types there (``charon.runtime.node.inprocess_engine`` / ``inprocess``), which is no dependency at run
    time."""
    graph = import_graph(typing=False)
    assert graph["charon.core.epoch"]  # the parser sees edges (an empty graph has no cycle)
    problems = cycle_problems(graph, KNOWN_CYCLES)
    assert not problems, "import cycles (function-local imports included):\n  " + "\n  ".join(problems)


def test_typing_only_imports_are_told_apart() -> None:
    """The cycle check's view leaves out exactly the TYPE_CHECKING imports (the engines name their runtime's
    type there), and the layer check still sees them."""
    path = PKG / "runtime" / "node" / "inprocess_engine.py"
    assert "charon.runtime.node.inprocess" in imports_of(path)
    assert "charon.runtime.node.inprocess" not in imports_of(path, typing=False)
    assert "charon.runtime.contract" in imports_of(path, typing=False)


def test_cycle_check_finds_and_prints_cycles() -> None:
    graph = {
        "charon.a": {"charon.b", "charon.errors"}, "charon.b": {"charon.c"}, "charon.c": {"charon.a"},
        "charon.d": {"charon.d"}, "charon.e": {"charon.a"}, "charon.errors": set(),
    }
    assert cycles(graph) == [["charon.a", "charon.b", "charon.c"], ["charon.d"]]
    assert cycle_path(graph, ["charon.a", "charon.b", "charon.c"]) == ["charon.a", "charon.b", "charon.c", "charon.a"]
    assert cycle_problems(graph, [frozenset({"charon.a", "charon.b", "charon.c", "charon.x"})]) == [
        "charon.d -> charon.d  (the cycle's modules: charon.d)"]
    assert cycle_problems(graph, [frozenset({"charon.a", "charon.b"}), frozenset({"charon.d"}),
                                  frozenset({"charon.x", "charon.y"})]) == [
        "charon.a -> charon.b -> charon.c -> charon.a  (the cycle's modules: charon.a, charon.b, charon.c)",
        "KNOWN_CYCLES lists ['charon.a', 'charon.b']: no cycle among them any more, remove the entry",
        "KNOWN_CYCLES lists ['charon.x', 'charon.y']: no cycle among them any more, remove the entry",
    ]


def test_no_private_imports_across_modules() -> None:
    found = private_imports(sorted(PKG.rglob("*.py")))
    new = [f"{m} imports {n} from {src}" for m, src, n in sorted(found - KNOWN_PRIVATE)]
    gone = [f"KNOWN_PRIVATE lists {e}: no module imports it any more, remove the entry"
            for e in sorted(KNOWN_PRIVATE - found)]
    assert not new + gone, ("imports of another module's private name (make it public where it lives, or move "
                            "the code that needs it there):\n  " + "\n  ".join(new + gone))


def test_private_import_check_sees_them(tmp_path: Path) -> None:
    pkg = tmp_path / "charon"
    (pkg / "x").mkdir(parents=True)
    src = pkg / "x" / "y.py"
    src.write_text("from charon.x.z import _hidden, public, __version__\n"
                   "def f():\n    from charon.core.partition import _TOKENS\n    import charon.x._impl\n")
    (pkg / "x" / "z.py").write_text("from charon.x.z import _self_is_fine\n")
    rel = {p: p for p in (src, pkg / "x" / "z.py")}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        got = private_imports(list(rel))
    finally:
        ROOT = saved
    assert got == {("charon.x.y", "charon.x.z", "_hidden"), ("charon.x.y", "charon.core.partition", "_TOKENS"),
                   ("charon.x.y", "charon.x._impl", "")}


#: Inside the runtime layer, its parts (a package or a root module under ``charon/runtime/``) in tiers: a part may
#: import parts of a lower tier; the shared pieces (tier 2 and below) may also use each other; the engines, the
#: remote runtime and composition (tier 3) never import each other; only the factory builds engines. A part not
#: listed (a new module) is a shared piece: it may not import an engine, the remote runtime, a deployment or the
#: factory.
RUNTIME_TIERS = {
    "contract": 0,  # what every engine offers the layers above it
    "guard": 1,  # budgets, interrupts, quarantine, verdicts
    "control": 2, "effects": 2, "faults": 2, "replies": 2, "schedules": 2, "wiring": 2,  # shared services
    "node": 3, "spark": 3, "remote": 3, "deployment": 3,  # engines and composition
    "factory": 4,  # builds any engine
}
SHARED_TIER = 2
#: Imports across the runtime's parts beyond those rules that exist today: (importer, imported). Others fail, and
#: so does an entry no module makes any more (remove it).
KNOWN_RUNTIME_CROSSINGS = {("charon.runtime.spark.tasks", "charon.runtime.node.inprocess")}  # tune_gc


def runtime_part(mod: str) -> str | None:
    """The part of the runtime layer ``mod`` belongs to (``node``, ``guard``, ``contract``, ...); None outside it."""
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["charon", "runtime"] else None


def runtime_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for mod, deps in sorted(graph.items()):
        part = runtime_part(mod)
        if part is None:
            continue
        tier = RUNTIME_TIERS.get(part, SHARED_TIER)
        for dep in sorted(deps):
            other = runtime_part(dep)
            if other is None or other == part:
                continue
            dep_tier = RUNTIME_TIERS.get(other, SHARED_TIER)
            if dep_tier < tier or (dep_tier == tier <= SHARED_TIER):
                continue
            bad.append((mod, dep))
    return bad


def test_runtime_parts_import_directions() -> None:
    graph = import_graph()
    assert "charon.runtime.guard.watchdog" in graph["charon.runtime.node.inprocess"]  # the parser sees the edges
    found = set(runtime_violations(graph))
    new = [f"{m} imports {d}" for m, d in sorted(found - KNOWN_RUNTIME_CROSSINGS)]
    gone = [f"KNOWN_RUNTIME_CROSSINGS lists {e}: no module imports it any more, remove the entry"
            for e in sorted(KNOWN_RUNTIME_CROSSINGS - found)]
    assert not new + gone, ("imports against the runtime's tiers (RUNTIME_TIERS: an engine never imports another, a "
                            "shared piece never an engine):\n  " + "\n  ".join(new + gone))


def test_runtime_check_rejects_wrong_directions() -> None:
    graph = {
        "charon.runtime.guard.watchdog": {"charon.runtime.contract", "charon.runtime.control.gate"},
        "charon.runtime.control.gate": {"charon.runtime.guard.verdicts", "charon.runtime.effects"},
        "charon.runtime.node.inprocess": {"charon.runtime.node.storage", "charon.runtime.spark.runtime",
                                          "charon.runtime.newservice"},
        "charon.runtime.newservice": {"charon.runtime.faults", "charon.runtime.remote"},
        "charon.runtime.contract": {"charon.runtime.guard.verdicts"},
        "charon.runtime.factory": {"charon.runtime.spark.runtime", "charon.runtime.node.inprocess"},
    }
    assert runtime_violations(graph) == [
        ("charon.runtime.contract", "charon.runtime.guard.verdicts"),
        ("charon.runtime.guard.watchdog", "charon.runtime.control.gate"),
        ("charon.runtime.newservice", "charon.runtime.remote"),
        ("charon.runtime.node.inprocess", "charon.runtime.spark.runtime"),
    ]


def test_every_layer_documents_its_rules() -> None:
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PKG / layer / "__init__.py").read_text()))
        assert doc and "import" in doc, layer


PUBLIC = [
    "Application",
    "BadArguments",
    "Call",
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
    "Limit",
    "LogUnavailable",
    "NonDeterministicFunction",
    "NotMigratable",
    "Operator",
    "Outcome",
    "InvocationCancelled",
    "Overloaded",
    "PayloadTooLarge",
    "PromiseCancelled",
    "PromiseConflict",
    "PromiseFailed",
    "PromiseRejected",
    "PromiseTimedOut",
    "Quarantined",
    "RateLimited",
    "Reply",
    "Request",
    "SerializationError",
    "Timer",
    "TransactionAborted",
    "UnawaitedCall",
    "UndeclaredPortal",
    "UnknownEffect",
    "UnknownFunction",
    "UnknownOperator",
    "UnknownPromise",
    "UnknownSchedule",
    "UnknownWorkflow",
    "ValueTooLarge",
    "VersionInUse",
    "VersionUnavailable",
    "Workflow",
    "WorkflowExists",
    "WorkflowTooLong",
    "promise_value",
]


def test_public_surface_is_pinned() -> None:
    assert charon.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(charon, name) is not None
    errors = {n for n in PUBLIC if n.endswith(("Error", "Aborted", "Unavailable", "Large", "Exceeded"))}
    errors |= {"BadArguments", "IdempotencyConflict", "IllegalAwait", "InvalidKey", "InvocationTimeout",
               "NonDeterministicFunction", "Quarantined", "UnawaitedCall", "UndeclaredPortal", "UnknownFunction",
               "UnknownOperator", "UnknownEffect", "PromiseConflict", "UnknownPromise", "UnknownSchedule",
               "UnknownWorkflow", "WorkflowExists"}
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


#: Top-level modules moved into charon/cli/, charon/testing/ and charon/core/ ("the tree as a map").
MOVED = ("cliparts", "clifail", "exitcodes", "demo_cli", "effects_cli", "harness_cli", "requests_cli", "limits_cli",
         "promises_cli", "gatewayprocs", "errordoc", "harness", "simulation", "workloads", "pytest_plugin", "cron",
         "schedule_spec")
OLD = re.compile(
    r"(?<![\w.])charon\.(spark|partition|context|epoch|sequencer|routing|inprocess|node|store|lmdbstore|durable"
    r"|logclient|gateway)\b|(?<![\w.])charon\.log\.(InputLog|OutputLog)\b|(?<![\w/])charon/(spark/|"
    r"(partition|context|epoch|sequencer|routing|inprocess|node|store|lmdbstore|durable|log|logclient|gateway)\.py)"
    rf"|(?<![\w.])charon\.({'|'.join(MOVED)})\b|(?<![\w/])charon/({'|'.join(MOVED)}|cli|testing)\.py"
)
#: Runtime modules moved from ``charon/runtime/`` into ``node/``, ``guard/`` and ``control/`` (their old flat paths).
RUNTIME_MOVED = ("codeversions", "controls", "gate", "inspector", "owner", "probe", "reads", "sqlchild", "sqlstate",
                 "interrupts", "quarantine", "verdicts", "watchdog", "inprocess", "inprocess_engine")
#: The durable node package's modules now (``charon.runtime.node.X`` naming anything else is the old ``node.py``'s).
NODE_MODULES = tuple(sorted(p.stem for p in (ROOT / "charon" / "runtime" / "node").glob("*.py")
                           if p.stem != "__init__"))
OLD_RUNTIME = re.compile(
    rf"(?<![\w.])charon\.runtime\.({'|'.join(RUNTIME_MOVED)})\b"
    rf"|(?<![\w/])charon/runtime/({'|'.join(RUNTIME_MOVED)}|node)\.py"
    rf"|(?<![\w.])charon\.runtime\.node\.(?!({'|'.join(NODE_MODULES)})\b)\w"
    r"|(?<![\w.])charon\.runtime\.node\.storage\.(inprocess|inprocess_engine|storage)\b"
)
#: The Java shim's on-disk marker keeps the old module name so shims written before the move still match.
KEPT = '_SHIM_MARK = "written by charon.spark.java"'
#: Where ``charon.epoch`` is the OpenTelemetry span and attribute name (issue 26), not a module path.
TRACE_NAMES = frozenset({"charon/server/tracing.py", "tests/server/test_tracing.py", "docs/guides/tracing.md",
                         "tests/server/test_tracing_spark.py",
                         "benchmarks/observability/tracing_cost.py"})


def _stale(rel: str, line: str) -> bool:
    if rel in TRACE_NAMES:
        line = re.sub(r"(?<![\w.])charon\.epoch(\.\w+)?(?![\w/])", "", line)
    return bool(OLD.search(line) or OLD_RUNTIME.search(line))


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
            if _stale(rel, line) and KEPT not in line and rel != "tests/package/test_layers.py":
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
