"""The Spark runtime's modules, split by concern (``charon/runtime/spark/``: layout, session, tasks, exchange,
engine, runtime): ``runtime.py`` holds the runtime class and nothing else of substance (no import cycle anywhere
is ``tests/package/test_layers.py``'s check)."""

from __future__ import annotations

import ast

from test_layers import PKG


def test_the_runtime_module_holds_the_runtime_class() -> None:
    tree = ast.parse((PKG / "runtime" / "spark" / "runtime.py").read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert functions == []
    assert "SparkRuntime" in classes
    assert set(classes) <= {"SparkRuntime", "RescaleIncomplete", "_Stopping"}  # and the errors it raises
