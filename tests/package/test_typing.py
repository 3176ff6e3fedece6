"""A ratchet on the escape hatches of the type checker: per module of ``charon/``, the number of ``Any`` in
function signatures (parameter and return annotations), of bare generics there (``list``, ``dict``, ``tuple``,
``Callable``... without arguments: an ``Any`` by another name) and of ``# type: ignore`` comments may only fall.

The recorded counts are in ``tests/package/typing_baseline.json``. A count above its record fails; so does a count
below it that was not recorded (the slack would let the next change spend it again). Record the current counts
(the lower ones then become the limit) with::

    .venv/bin/python tests/package/test_typing.py --update

A module missing from the baseline (a new one) is allowed none of any kind.
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
KINDS = ("any_in_signatures", "bare_generics_in_signatures", "type_ignores")
#: Generic types that mean ``X[Any, ...]`` when written without arguments.
GENERICS = frozenset({
    "list", "dict", "set", "frozenset", "tuple", "type", "deque", "defaultdict", "OrderedDict", "Counter",
    "List", "Dict", "Set", "FrozenSet", "Tuple", "Type", "Deque", "DefaultDict",
    "Callable", "Iterable", "Iterator", "Generator", "AsyncIterator", "AsyncIterable", "AsyncGenerator",
    "Awaitable", "Coroutine", "Sequence", "MutableSequence", "Mapping", "MutableMapping", "Collection",
    "Container", "AbstractSet", "MutableSet", "KeysView", "ValuesView", "ItemsView", "Future", "Task", "Queue",
})


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


def _bare_in(node: ast.expr | None) -> int:
    """The generics written without their arguments (``list``, ``typing.Callable``...) in one annotation."""
    if node is None:
        return 0
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _bare_in(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return 0
    if isinstance(node, ast.Subscript):  # X[...]: X has its arguments; look inside them (a Literal's are values)
        base = node.value
        return 0 if (base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")) == "Literal" else (
            _bare_in(node.slice))
    if isinstance(node, ast.Name | ast.Attribute):
        return int((node.id if isinstance(node, ast.Name) else node.attr) in GENERICS)
    return sum(_bare_in(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr))


def _signatures(source: str) -> list[ast.expr | None]:
    """Every parameter and return annotation of every function and method of ``source``."""
    out: list[ast.expr | None] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            params += [p for p in (a.vararg, a.kwarg) if p is not None]
            out += [p.annotation for p in params] + [node.returns]
    return out


def any_in_signatures(source: str) -> int:
    """The ``Any`` in the parameter and return annotations of every function and method of ``source``."""
    return sum(_any_in(a) for a in _signatures(source))


def bare_generics_in_signatures(source: str) -> int:
    """The generics without arguments in the parameter and return annotations of ``source`` (each an implicit
    ``Any``: ``list`` is ``list[Any]``)."""
    return sum(_bare_in(a) for a in _signatures(source))


def type_ignores(source: str) -> int:
    """The ``# type: ignore`` comments of ``source`` (comments only: not the words in a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(1 for t in tokens if t.type == tokenize.COMMENT and "type: ignore" in t.string)


def measure(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """{kind: {module: count}} for each of ``KINDS`` over ``package`` (zeros left out)."""
    out: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        source = path.read_text(encoding="utf-8")
        counts = (any_in_signatures(source), bare_generics_in_signatures(source), type_ignores(source))
        for kind, count in zip(KINDS, counts, strict=True):
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
    assert bare_generics_in_signatures(src) == 0
    assert type_ignores(src) == 2


def test_bare_generics_are_counted_only_without_arguments() -> None:
    src = (
        "import typing, collections.abc as abc\n"
        "x: list = []  # a variable: not a signature\n"
        "def f(a: list, b: dict[str, list], c: 'tuple', d: typing.Callable, e: list[int]) -> abc.Iterator: ...\n"
        "async def g(a: tuple[int, ...] | None, b: Callable[..., set], c: 'dict[str, int]') -> type[int]: ...\n"
        "def h(a: int, b: 'Literal[\"list\"]') -> None: ...\n"
    )
    # f: list, list (in dict's arguments), 'tuple', typing.Callable, abc.Iterator; g: set
    assert bare_generics_in_signatures(src) == 6


def rises_and_stale(baseline: dict[str, dict[str, int]], now: dict[str, dict[str, int]]) -> tuple[list[str], list[str]]:
    """The counts above their record, and those below it (a record to lower with ``--update``)."""
    rises, stale = [], []
    for kind in KINDS:
        for module in sorted(set(now[kind]) | set(baseline.get(kind, {}))):
            count, recorded = now[kind].get(module, 0), baseline.get(kind, {}).get(module, 0)
            if count > recorded:
                rises.append(f"{module}: {count} {kind} (recorded: {recorded})")
            elif count < recorded:
                stale.append(f"{module}: {count} {kind} (recorded: {recorded})")
    return rises, stale


def test_the_ratchet_sees_rises_and_unrecorded_falls() -> None:
    base = {"any_in_signatures": {"a": 2, "b": 1}, "type_ignores": {"a": 1}}
    now = {"any_in_signatures": {"a": 3, "c": 1}, "bare_generics_in_signatures": {"a": 1},
           "type_ignores": {"a": 1}}
    assert rises_and_stale(base, now) == (
        ["a: 3 any_in_signatures (recorded: 2)", "c: 1 any_in_signatures (recorded: 0)",
         "a: 1 bare_generics_in_signatures (recorded: 0)"],
        ["b: 0 any_in_signatures (recorded: 1)"],
    )


def test_any_and_type_ignores_only_fall() -> None:
    rises, stale = rises_and_stale(json.loads(BASELINE.read_text()), measure())
    assert not rises, (
        "more Any (or bare generics) in function signatures or more '# type: ignore' than recorded (use a precise "
        "type; an ignore only where a library's stubs are wrong, with the reason):\n  " + "\n  ".join(rises)
    )
    assert not stale, (
        "fewer than recorded (good): record the lower counts with "
        "`.venv/bin/python tests/package/test_typing.py --update` so that they become the limit:\n  "
        + "\n  ".join(stale)
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {sys.argv[0]} --update  (records the current counts in {BASELINE.name})")
    counts = measure()
    BASELINE.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")
    print(f"recorded {sum(counts['any_in_signatures'].values())} Any and "
          f"{sum(counts['bare_generics_in_signatures'].values())} bare generics in signatures and "
          f"{sum(counts['type_ignores'].values())} type: ignore comments in {BASELINE.relative_to(ROOT)}")
