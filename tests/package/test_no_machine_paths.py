"""Scripts and benchmarks name files relative to the repository, never an absolute path of one machine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSOLUTE = re.compile(r"""["'](/work/|/home/|/root/|/Users/)""")


def test_no_script_hard_codes_a_machine_path() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}" for d in ("scripts", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if ABSOLUTE.search(line)]
    assert not found, found
