"""The README a newcomer reads: its example runs as written and prints what its comments promise, its set-up
commands exist, and every link points to a file of the repository. (The tour moved to the documentation site,
whose examples tests/docs runs.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_example_runs(tmp_path: Path) -> None:
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(block.splitlines()) <= 35
    (tmp_path / "example.py").write_text(block)
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["70", "ValueError"], out.stdout


def test_readme_setup_commands_and_links_exist() -> None:
    text = README.read_text()
    for script in ("./scripts/demo", "./scripts/test", "./scripts/docs"):
        assert script in text and (ROOT / script).is_file(), script
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert len(links) > 15
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []


def test_the_readme_lists_every_guide() -> None:
    links = set(re.findall(r"\]\((docs/guides/[^)#]+\.md)\)", README.read_text()))
    guides = {str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md")}
    assert sorted(guides - links) == []
