"""``docs/internals/layout.md`` is generated from the tree (``scripts/layout.py``): it names every package and
module of ``charon/``, and it is not stale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _layout() -> Any:
    spec = importlib.util.spec_from_file_location("charon_layout_script", ROOT / "scripts" / "layout.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_layout_page_is_generated_from_the_tree() -> None:
    layout = _layout()
    page = (ROOT / "docs" / "internals" / "layout.md").read_text(encoding="utf-8")
    assert page == layout.render(ROOT), "docs/internals/layout.md is stale: run python scripts/layout.py"


def test_every_package_and_module_is_on_the_page() -> None:
    page = (ROOT / "docs" / "internals" / "layout.md").read_text(encoding="utf-8")
    for init in (ROOT / "charon").rglob("__init__.py"):
        pkg = init.parent
        assert f"## `{pkg.relative_to(ROOT).as_posix()}/`" in page, pkg
        for mod in pkg.glob("*.py"):
            if mod.name != "__init__.py":
                assert f"- `{mod.name}`:" in page, mod


def test_a_missing_package_makes_the_page_stale(tmp_path: Path) -> None:
    layout = _layout()
    (tmp_path / "charon" / "newpkg").mkdir(parents=True)
    (tmp_path / "charon" / "__init__.py").write_text('"""Root."""\n')
    before = layout.render(tmp_path)
    (tmp_path / "charon" / "newpkg" / "__init__.py").write_text('"""A new package. More text."""\n')
    (tmp_path / "charon" / "newpkg" / "thing.py").write_text('"""Does a thing: well. And more."""\n')
    after = layout.render(tmp_path)
    assert after != before
    assert "## `charon/newpkg/`\n\nA new package." in after
    assert "- `thing.py`: Does a thing: well." in after
