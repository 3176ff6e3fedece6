"""The documentation site builds with `mkdocs build --strict` (broken links, anchors and API references fail),
and its generated reference pages cover the CLI, the HTTP routes and every setting."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from docblocks import ROOT

from charon.cli import app as cli_app
from charon.config import GatewayConfig, SparkConfig


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-5000:]
    return out


def test_site_builds_strictly(site: Path) -> None:
    for page in ("index.html", "quickstart/index.html", "reference/api/index.html", "internals/results/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference/api/index.html").read_text()
    for name in ("InProcessRuntime", "check_epoch", "AsyncClient", "TransactionAborted", "Context"):
        assert name in api, name


def test_api_page_documents_every_public_name(site: Path) -> None:
    """Every name of ``charon.__all__``, ``charon.client.__all__`` and the harness ``charon.testing`` re-exports has
    its own entry (an anchor) on the Python API page, and so do the client's inspector methods."""
    import re

    import charon
    import charon.client
    import charon.testing

    ids = set(re.findall(r'id="([^"]+)"', (site / "reference/api/index.html").read_text()))
    names = [*charon.__all__, *charon.client.__all__, *charon.testing._HARNESS, "Client.requests",
             "Client.request_detail"]
    # an alias kept for old imports (charon.client.RescaleRunning is charon.errors.RescaleBusy) has its class's entry
    names = [getattr(getattr(charon.client, n, None), "__name__", n) for n in names]
    missing = [n for n in names if not any(i == n or i.endswith("." + n) for i in ids)]
    assert missing == []


def test_cli_page_lists_every_command(site: Path) -> None:
    page = (site / "reference/cli/index.html").read_text()
    group = typer.main.get_command(cli_app)
    assert isinstance(group, typer.core.TyperGroup)
    for name in group.commands:
        assert f"charon {name}" in page, name


def test_http_page_lists_every_route(site: Path) -> None:
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import generated
    finally:
        sys.path.pop(0)
    page = (site / "reference/http/index.html").read_text()
    doc = generated.openapi()
    for path, ops in doc["paths"].items():
        for method in ops:
            assert f"{method.upper()} {path}" in page, (method, path)
    assert (site / "reference/openapi.json").is_file()


def test_configuration_page_has_every_setting_with_its_default(site: Path) -> None:
    page = (site / "reference/configuration/index.html").read_text()
    for cls, prefix in ((SparkConfig, "CHARON_"), (GatewayConfig, "CHARON_GATEWAY_")):
        for f in dataclasses.fields(cls):
            if f.name in ("spark_conf",):
                continue
            assert f"<code>{prefix}{f.name.upper()}</code>" in page, f.name
            if isinstance(f.default, int) and not isinstance(f.default, bool) and f.default < 1000:
                assert f"<code>{f.default}</code>" in page, f.name


@pytest.mark.parametrize(("addition", "named"), [
    ("See [the missing page](nowhere.md) and [a missing anchor](values.md#no-such-section).",
     ["nowhere.md", "no-such-section"]),
    ("::: charon.no_such_module", ["no_such_module"]),
], ids=["link-and-anchor", "api-reference"])
def test_a_broken_reference_fails_the_build(tmp_path: Path, addition: str, named: list[str]) -> None:
    """The same site in a copy with one broken link, anchor or API reference: the strict build refuses it.
    (Without ``-q``: mkdocs does not count the warnings it does not print.)"""
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("charon", "benchmarks", "mkdocs.yml"):
        (tmp_path / name).symlink_to(ROOT / name)
    page = tmp_path / "docs" / "concepts" / "limits.md"
    page.write_text(page.read_text() + f"\n{addition}\n")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    for name in named:
        assert name in run.stderr, run.stderr[-3000:]
