"""The code blocks of the documentation pages, and the rule each one is checked by."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
FRAGMENT = "<!-- fragment -->"  # put right above a ```python block that is compiled, not run
# put right above a ```bash block that tests/docs/test_shell_blocks.py cannot run against one local node, with the
# reason: `<!-- needs: spark -->` blocks run in its Spark-marked test, any other reason is listed (not run)
NEEDS = re.compile(r"^<!-- needs: (.+?) -->$")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
# languages and how they are checked: python runs (or compiles, as a marked fragment, or is an included example
# that tests/docs/test_examples.py runs); bash is syntax-checked and every `.venv/bin/charon` command in it is
# resolved against the CLI (included .sh examples run against a real node); text is output, never code
LANGUAGES = {"python", "bash", "text"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    fragment: bool
    needs: str | None = None

    @property
    def snippets(self) -> list[str]:
        """The example files this block consists of, if it is nothing but ``--8<--`` includes."""
        lines = [ln.strip() for ln in self.code.splitlines() if ln.strip()]
        found = [m.group(1) for ln in lines if (m := SNIPPET.match(ln))]
        return found if lines and len(found) == len(lines) else []

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def blocks() -> list[Block]:
    out = []
    for page in pages():
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", lines[i])
            if not m:
                i += 1
                continue
            indent, fence, lang = m.group(1), m.group(2), m.group(3)
            start = i
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j])
            prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            needs = n.group(1) if (n := NEEDS.match(prev)) else None
            out.append(Block(page.relative_to(DOCS).as_posix(), start + 1, lang, body + "\n", prev == FRAGMENT, needs))
            i = j + 1
    return out
