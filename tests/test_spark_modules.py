"""The Spark runtime's modules, split by concern (``charon/runtime/spark/``: layout, session, tasks, exchange,
runtime): no import cycle among the runtime layer's modules (function-local imports included), and
``runtime.py`` holds the runtime class and nothing else of substance."""

from __future__ import annotations

import ast

from test_layers import PKG, import_graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_runtime_layer() -> None:
    graph = import_graph()
    runtime = {m: {d for d in deps if d.startswith("charon.runtime.")}
               for m, deps in graph.items() if m.startswith("charon.runtime.")}
    assert "charon.runtime.spark.layout" in runtime["charon.runtime.spark.statesql"]  # the parser sees edges
    assert cycles(runtime) == []


def test_the_runtime_module_holds_the_runtime_class() -> None:
    tree = ast.parse((PKG / "runtime" / "spark" / "runtime.py").read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert functions == []
    assert "SparkRuntime" in classes
    assert set(classes) <= {"SparkRuntime", "RescaleIncomplete", "_Stopping"}  # and the errors it raises
