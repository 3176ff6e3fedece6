"""Every code block of every documentation page is checked: Python runs (or compiles, when marked as a fragment),
shell is syntax-checked with every `.venv/bin/charon` command resolved against the CLI. A page that
gains a block no rule covers fails here."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from docblocks import EXAMPLES, FRAGMENT, LANGUAGES, ROOT, Block, blocks

from charon.cli import app

BLOCKS = blocks()


def _ids(bs: list[Block]) -> list[str]:
    return [b.id for b in bs]


def test_every_block_has_a_rule() -> None:
    assert len(BLOCKS) > 20  # the pages were found
    unknown = [f"{b.id} ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert unknown == [], f"code blocks without a checked language (one of {sorted(LANGUAGES)})"
    misplaced = [b.id for b in BLOCKS if b.fragment and b.lang != "python"]
    assert misplaced == [], f"{FRAGMENT} only marks python blocks"
    for b in BLOCKS:
        for name in b.snippets:
            assert (EXAMPLES / name).is_file(), f"{b.id} includes {name}, which is not under docs/examples"


RUN = [b for b in BLOCKS if b.lang == "python" and not b.fragment and not b.snippets]
FRAGMENTS = [b for b in BLOCKS if b.lang == "python" and b.fragment]


@pytest.mark.parametrize("block", RUN, ids=_ids(RUN))
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    """Runs as a script beside the examples (so ``from bank import app`` works), in a fresh interpreter."""
    script = tmp_path / "block.py"
    script.write_text(block.code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**_env(), "PYTHONPATH": str(EXAMPLES)})
    assert out.returncode == 0, f"{block.id}:\n{out.stderr}"


@pytest.mark.parametrize("block", FRAGMENTS, ids=_ids(FRAGMENTS))
def test_python_fragment_compiles(block: Block) -> None:
    code = compile(block.code, block.id, "exec")  # a SyntaxError fails the test
    assert code.co_filename == block.id and block.code.strip(), f"{block.id}: an empty fragment"


SHELL = [b for b in BLOCKS if b.lang == "bash"]
CLI = typer.main.get_command(app)


def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: lines joined at backslashes, split at ``;``, ``&&``, ``|``, ``&``."""
    text = code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for tok in lexer:
            if tok and set(tok) <= set(";&|"):
                if words:
                    out.append(words)
                words = []
            else:
                words.append(tok)
        if words:
            out.append(words)
    return out


def _check_charon(words: list[str]) -> None:
    """``charon SUB [SUB] --option ...``: the subcommand exists and every option is one of its own."""
    cmd: Any = CLI  # Typer's own click: groups have ``commands``
    rest = words[1:]
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        sub = cmd.commands.get(rest[0])
        assert sub is not None, f"no command {' '.join(words[: len(words) - len(rest) + 1])!r}"
        cmd, rest = sub, rest[1:]
    names = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    for w in rest:
        if w.startswith("--"):
            assert w.split("=")[0] in names, f"{' '.join(words)}: {cmd.name} has no option {w}"


@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_shell_block_is_valid(block: Block, tmp_path: Path) -> None:
    code = "\n".join((EXAMPLES / s).read_text() for s in block.snippets) if block.snippets else block.code
    script = tmp_path / "block.sh"
    script.write_text(code)
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, f"{block.id}: {out.stderr}"
    for words in _commands(code):
        while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
            words = words[1:]
        if not words:
            continue
        assert words[0] != "charon", f"{block.id}: a bare `charon` is not on PATH after the set-up: .venv/bin/charon"
        if words[0] == ".venv/bin/charon":
            _check_charon(words)


def test_the_cli_check_catches_mistakes() -> None:
    """The shell check above fails on an unknown command or option (it is not vacuous)."""
    with pytest.raises(AssertionError, match="no command"):
        _check_charon([".venv/bin/charon", "statuss"])
    with pytest.raises(AssertionError, match="no option --frobnicate"):
        _check_charon([".venv/bin/charon", "run", "bank:app", "--frobnicate"])
    _check_charon([".venv/bin/charon", "effects", "list", "--data-dir", "d"])


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | {"ROOT": str(ROOT)}
