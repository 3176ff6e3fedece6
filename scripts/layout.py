"""Write ``docs/internals/layout.md`` from the tree: every package of ``charon/`` with the first sentence of its
docstring, and each of its modules with the first sentence of theirs. ``tests/package/test_layout_doc.py`` fails
when the page is stale.

    .venv/bin/python scripts/layout.py           # rewrite the page
    .venv/bin/python scripts/layout.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "internals" / "layout.md"
HEAD = """# Layout

Generated from the tree by `python scripts/layout.py` (do not edit by hand: `tests/package/test_layout_doc.py`
fails when this page is stale). Each package of `charon/` with the first sentence of its docstring, then each of
its modules with the first sentence of theirs. The layers and what each may import: `tests/package/test_layers.py`;
the architecture: [architecture.md](architecture.md).
"""


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line, roles and markup kept."""
    if not doc:
        return "(no docstring)"
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = " ".join(line.strip() for line in para.splitlines())
    m = re.search(r"(?<![.:`(]\w)(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text[: m.start() + 1] if m else text


def docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def render(root: Path = ROOT) -> str:
    out = [HEAD]
    pkg_root = root / "charon"
    packages = sorted(p.parent for p in pkg_root.rglob("__init__.py") if "__pycache__" not in p.parts)
    for pkg in packages:
        rel = pkg.relative_to(root).as_posix()
        out.append(f"\n## `{rel}/`\n\n{first_sentence(docstring(pkg / '__init__.py'))}")
        mods = sorted(m for m in pkg.glob("*.py") if m.name != "__init__.py")
        subs = sorted(s.name for s in pkg.iterdir() if (s / "__init__.py").is_file())
        if mods:
            out.append("")
        for m in mods:
            out.append(f"- `{m.name}`: {first_sentence(docstring(m))}")
        if subs:
            out.append("\nPackages: " + ", ".join(f"`{s}/`" for s in subs) + ".")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/layout.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
