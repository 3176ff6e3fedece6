"""A ratchet on the escape hatches of the type checker: per module of ``charon/``, the number of ``Any`` in
function signatures (parameter and return annotations) and of ``# type: ignore`` comments may only fall.

The recorded counts are in ``tests/package/typing_baseline.json``. When a change lowers a count, record the new counts
(the lower ones then become the limit) with::

    .venv/bin/python tests/package/test_typing.py --update

A module missing from the baseline (a new one) is allowed none of either.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "charon"
BASELINE = Path(__file__).resolve().parent / "typing_baseline.json"


def _any_in(node: ast.expr | None) -> int:
    """The ``Any`` (``Any``, ``typing.Any``, or inside a string annotation) in one annotation."""
    if node is None:
        return 0
    n = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Any":
            n += 1
        elif isinstance(sub, ast.Attribute) and sub.attr == "Any":
            n += 1
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            try:
                n += _any_in(ast.parse(sub.value, mode="eval").body)
            except SyntaxError:
                pass  # a string that is not an annotation (a Literal's value)
    return n


def any_in_signatures(source: str) -> int:
    """The ``Any`` in the parameter and return annotations of every function and method of ``source``."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            params += [p for p in (a.vararg, a.kwarg) if p is not None]
            n += sum(_any_in(p.annotation) for p in params) + _any_in(node.returns)
    return n


def type_ignores(source: str) -> int:
    """The ``# type: ignore`` comments of ``source`` (comments only: not the words in a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(1 for t in tokens if t.type == tokenize.COMMENT and "type: ignore" in t.string)


def measure(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """{"any_in_signatures": {module: count}, "type_ignores": {module: count}} over ``package`` (zeros left out)."""
    out: dict[str, dict[str, int]] = {"any_in_signatures": {}, "type_ignores": {}}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        source = path.read_text(encoding="utf-8")
        for kind, count in (("any_in_signatures", any_in_signatures(source)), ("type_ignores", type_ignores(source))):
            if count:
                out[kind][module] = count
    return out


def test_counters_see_what_they_count() -> None:
    src = (
        "import typing\n"
        "from typing import Any\n"
        "x: Any = 1  # type: ignore[assignment]  (a variable: not a signature)\n"
        "def f(a: Any, *rest: list[Any], k: 'dict[str, Any]' = None, **kw: typing.Any) -> tuple[Any, int]:\n"
        "    s = '# type: ignore'\n"
        "    return (a, 1)  # type: ignore\n"
        "class C:\n"
        "    async def m(self, b: int, /) -> Any | None: ...\n"
        "    def n(self, c: 'Literal[\"no Any here (\"]') -> None: ...\n"
    )
    assert any_in_signatures(src) == 6
    assert type_ignores(src) == 2


def test_any_and_type_ignores_only_fall() -> None:
    baseline = json.loads(BASELINE.read_text())
    now = measure()
    rises = [
        f"{module}: {count} {kind} (recorded: {baseline[kind].get(module, 0)})"
        for kind in ("any_in_signatures", "type_ignores")
        for module, count in sorted(now[kind].items())
        if count > baseline[kind].get(module, 0)
    ]
    assert not rises, (
        "more Any in function signatures or more '# type: ignore' than recorded (use a precise type; an ignore "
        "only where a library's stubs are wrong, with the reason):\n  " + "\n  ".join(rises)
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {sys.argv[0]} --update  (records the current counts in {BASELINE.name})")
    counts = measure()
    BASELINE.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")
    print(f"recorded {sum(counts['any_in_signatures'].values())} Any in signatures and "
          f"{sum(counts['type_ignores'].values())} type: ignore comments in {BASELINE.relative_to(ROOT)}")
