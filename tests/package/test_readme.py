"""The README's tour runs as written: bank.py, the in-process test and the run_epoch/check_epoch example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_tour_runs(tmp_path: Path) -> None:
    blocks = _python_blocks()
    bank = next(b for b in blocks if b.startswith("# bank.py"))
    (tmp_path / "bank.py").write_text(bank)
    tour = next(b for b in blocks if "asyncio.run(main())" in b and "from bank import app" in b)
    check = next(b for b in blocks if "check_epoch(" in b and "from bank import app" in b)
    for name, code in (("tour.py", tour), ("check.py", check)):
        (tmp_path / name).write_text(code)
    out = subprocess.run([sys.executable, "tour.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the values the README's comments promise
    assert out.stdout.splitlines() == ["70", "NotEnoughCredit bob has 30"], out.stdout
    out = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
