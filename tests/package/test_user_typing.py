"""The typed API as a user meets it: ``mypy --strict`` and pyright (basedpyright, strict), run in a directory outside
the repository over copies of the example applications (clean) and of a deliberately wrong application (exactly
the expected errors). Running them from there also proves that the checkers resolve the installed ``charon``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import charon
from charon.core.context import EngineContext
from charon.testing import SerialContext

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: The example applications users read, checked as a user's own modules.
EXAMPLES = ["ledger", "holds", "catalog"]
WRONG = ROOT / "tests" / "support" / "typing" / "wrong_app.py"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's project directory outside the repository: the examples, the wrong app and a strict pyright config."""
    d = tmp_path_factory.mktemp("userapp")
    assert ROOT not in d.parents
    for name in EXAMPLES:
        shutil.copy(ROOT / "charon" / "apps" / f"{name}.py", d / f"{name}.py")
    shutil.copy(WRONG, d / "wrong_app.py")
    (d / "pyrightconfig.json").write_text(json.dumps({"typeCheckingMode": "strict", "pythonVersion": "3.11"}))
    return d


def _env() -> dict[str, str]:
    """This environment without search paths: the checkers find only what is installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


def mypy(project: Path, *files: str) -> list[str]:
    """``mypy --strict`` in ``project``: its errors as ``file:line: message  [code]`` (notes left out)."""
    out = subprocess.run(
        [str(BIN / "mypy"), "--strict", "--no-error-summary", "--cache-dir", str(project / ".mypy_cache"), *files],
        cwd=project, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode in (0, 1), out.stderr
    return [line for line in out.stdout.splitlines() if ": error: " in line]


def pyright(project: Path, *files: str, severities: tuple[str, ...] = ("error",)) -> list[str]:
    """basedpyright (strict, this interpreter's packages) in ``project``: its errors (or ``severities``) as
    ``file:line: rule: message`` (the message's first line)."""
    out = subprocess.run(
        [str(BIN / "basedpyright"), "--outputjson", "--pythonpath", sys.executable, *files],
        cwd=project, env=_env(), capture_output=True, text=True, timeout=300,
    )
    report = json.loads(out.stdout)
    return [
        f"{Path(d['file']).name}:{d['range']['start']['line'] + 1}: {d.get('rule', '')}: {d['message'].splitlines()[0]}"
        for d in report["generalDiagnostics"] if d["severity"] in severities
    ]


def line_of(text: str) -> int:
    """The line number of the one line of the wrong app that contains ``text``."""
    found = [n for n, line in enumerate(WRONG.read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def test_charon_resolves_from_a_directory_outside_the_repository(project: Path) -> None:
    probe = project / "probe.py"
    probe.write_text("import charon\n\nreveal_type(charon.Context.call)\n")
    out = subprocess.run([str(BIN / "mypy"), "--strict", "--cache-dir", str(project / ".mypy_cache"), "probe.py"],
                         cwd=project, env=_env(), capture_output=True, text=True, timeout=300)
    assert "import-not-found" not in out.stdout and "Cannot find" not in out.stdout, out.stdout
    typed = ("def [P, R] (charon.core.context.Context, charon.operator.Operator | str, str, "  # the typed declaration
             "charon.operator.Function[P, R], *P.args, **P.kwargs) -> charon.core.context.Call[R]")
    assert typed in out.stdout, out.stdout
    assert pyright(project, "probe.py") == []  # no reportMissingImports (nor anything else)
    imported = subprocess.run([sys.executable, "-c", "import charon; print(charon.__file__)"], cwd=project,
                              env=_env(), capture_output=True, text=True, timeout=60, check=True)
    assert Path(imported.stdout.strip()) == Path(charon.__file__)


def test_the_examples_are_clean_under_mypy_strict(project: Path) -> None:
    assert mypy(project, *(f"{name}.py" for name in EXAMPLES)) == []


def test_the_examples_are_clean_under_pyright_strict(project: Path) -> None:
    assert pyright(project, *(f"{name}.py" for name in EXAMPLES), severities=("error", "warning")) == []


def test_mypy_reports_each_mistake_of_the_wrong_app(project: Path) -> None:
    ten, name, send = line_of('deposit, "ten")'), line_of("name: str ="), line_of("ctx.send(account, to, transfer")
    timer, upper, effect = line_of("ctx.send_after"), line_of("a.upper()"), line_of("ctx.effect(")
    later = line_of("pay_later, to")
    assert mypy(project, "wrong_app.py") == [
        f'wrong_app.py:{ten}: error: No overload variant of "call" of "Context" matches argument types "Operator", '
        '"str", "Function[[int, str], int]", "str"  [call-overload]',
        f'wrong_app.py:{name}: error: No overload variant of "call" of "Context" matches argument types "Operator", '
        '"str", "Function[[], int]"  [call-overload]',
        f'wrong_app.py:{send}: error: No overload variant of "send" of "Context" matches argument types "Operator", '
        '"str", "Function[[str, int], int]", "str"  [call-overload]',
        f'wrong_app.py:{timer}: error: No overload variant of "send_after" of "Context" matches argument types '
        '"float", "Operator", "str", "Function[[int, str], int]", "int", "str", "int"  [call-overload]',
        f'wrong_app.py:{upper}: error: "int" has no attribute "upper"  [attr-defined]',
        f'wrong_app.py:{later}: error: No overload variant of "send" of "Context" matches argument types "Operator", '
        '"str", "Function[[str, int, float], str]", "str", "str", "float"  [call-overload]',
        f'wrong_app.py:{effect}: error: Argument "then" to "effect" of "Context" has incompatible type '
        '"Function[[int], None]"; expected "Function[[dict[str, Any], VarArg(Any), KwArg(Any)], object] | str"  '
        '[arg-type]',
    ]


def test_pyright_reports_each_mistake_of_the_wrong_app(project: Path) -> None:
    ten, name, send = line_of('deposit, "ten")'), line_of("name: str ="), line_of("ctx.send(account, to, transfer")
    timer, upper, effect = line_of("ctx.send_after"), line_of("a.upper()"), line_of("ctx.effect(")
    later = line_of("pay_later, to")
    assert pyright(project, "wrong_app.py") == [
        f'wrong_app.py:{ten}: reportCallIssue: No overloads for "call" match the provided arguments',
        f"wrong_app.py:{ten}: reportArgumentType: Argument of type \"Literal['ten']\" cannot be assigned to parameter "
        '"amount" of type "int"',
        f'wrong_app.py:{name}: reportAssignmentType: Type "int" is not assignable to declared type "str"',
        f'wrong_app.py:{send}: reportCallIssue: No overloads for "send" match the provided arguments',
        f'wrong_app.py:{send}: reportCallIssue: Argument missing for parameter "amount"',
        f'wrong_app.py:{timer}: reportCallIssue: No overloads for "send_after" match the provided arguments',
        f"wrong_app.py:{timer}: reportCallIssue: Expected 2 positional arguments",
        f'wrong_app.py:{upper}: reportUnknownMemberType: Type of "upper" is unknown',
        f'wrong_app.py:{upper}: reportAttributeAccessIssue: Cannot access attribute "upper" for class "int"',
        f'wrong_app.py:{later}: reportCallIssue: No overloads for "send" match the provided arguments',
        f"wrong_app.py:{later}: reportArgumentType: Argument of type \"Literal['1']\" cannot be assigned to parameter "
        '"amount" of type "int"',
        f'wrong_app.py:{effect}: reportArgumentType: Argument of type "Function[(outcome: int), None]" cannot be '
        'assigned to parameter "then" of type "Function[(Outcome, ...), object] | str" in function "effect"',
    ]


def test_the_contexts_implement_the_typed_declarations_with_the_same_parameters() -> None:
    """One declaration (:class:`charon.Context`); the engine's and the oracle's contexts bind its typed methods to
    their implementations (the same function objects: no wrapper), whose positional parameters are the
    declaration's."""
    import inspect

    typed = ["call", "gather", "send", "send_at", "send_after", "effect"]
    for cls in (EngineContext, SerialContext):
        assert issubclass(cls, charon.Context)
        for name in typed:
            impl = getattr(cls, name)
            assert impl is getattr(cls, "_" + name), (cls, name)
            # after ``self``: the names and kinds (positional-only, *args, keyword-only, **kwargs) alike
            want = [(p.name, p.kind)
                    for p in list(inspect.signature(getattr(charon.Context, name)).parameters.values())[1:]]
            have = [(p.name, p.kind) for p in list(inspect.signature(impl).parameters.values())[1:]]
            assert have == want, (cls.__name__, name, have, want)
    assert EngineContext.ask is EngineContext._ask


def test_the_typed_example_runs_and_agrees_with_the_serial_oracle() -> None:
    """The typed example app (calls by Function, a gather of two and of a list, a send, a timer) runs on the engine,
    and the serial oracle (SerialContext, the same typed declarations) gives the same outcome and state."""
    from charon import InProcessRuntime, Request, serde
    from charon.apps import ledger
    from charon.testing import check_epoch

    rt = InProcessRuntime(ledger.app, partitions=3)
    seed = [Request(f"d{k}", "account", k, "deposit", serde.encode([n, "seed"])) for k, n in
            (("a", 100), ("b", 10), ("c", 1))]
    work = [Request("t", "account", "a", "transfer", serde.encode(["b", 30])),
            Request("s", "account", "a", "total", serde.encode([["b", "c"]])),
            Request("p", "account", "c", "pay_later", serde.encode(["a", 1, 60.0])),
            Request("x", "account", "b", "transfer", serde.encode(["c", 1000]))]
    for reqs in (seed, work):
        before = rt.snapshot()
        result = rt.run_epoch(reqs)
        check_epoch(ledger.app, before, rt.snapshot(), result)
    replies = {result.requests[tid].request_id: rep for tid, rep in result.replies.items()}
    assert serde.decode(replies["t"].value) == 70
    assert serde.decode(replies["s"].value) == 111  # 70 + 40 + 1: after the transfer, in the serial order
    assert serde.decode(replies["p"].value).startswith("t")  # a timer id
    assert not replies["x"].ok and replies["x"].error_type == "ValueError"
    assert {k: rt.read_state("account", k) for k in "abc"} == {"a": 70, "b": 40, "c": 1}


def test_keyword_arguments_a_checker_accepts_run() -> None:
    """A ParamSpec lets a checker accept ``ctx.call(op, key, f, amount=5)``; the runtime binds the name to ``f``'s
    parameter (calls carry positional arguments), on the engine and in the oracle alike (more cases:
    ``tests/core/test_call_keywords.py``)."""
    from charon import Application, Context, InProcessRuntime, Operator, Request, serde
    from charon.testing import check_epoch

    op = Operator("kw")

    @op.function
    async def add(ctx: Context, amount: int) -> int:
        return amount

    @op.function
    async def by_keyword(ctx: Context) -> int:
        return await ctx.call(op, "k", add, amount=5)

    app = Application("kw", [op])
    rt = InProcessRuntime(app, partitions=2)
    before = rt.snapshot()
    result = rt.run_epoch([Request("r", "kw", "a", "by_keyword", serde.encode([]))])
    check_epoch(app, before, rt.snapshot(), result)
    (reply,) = result.replies.values()
    assert reply.ok and serde.decode(reply.value) == 5


HARNESS_USER = '''
import random

from charon.apps import wallets
from charon.testing import Invocation, Snapshot, fault_seeds, from_hints, run_app


def workload(rng: random.Random) -> list[Invocation]:
    return [Invocation("wallet", f"w{rng.randrange(3)}", "credit", ("p1", 5))]


def conserved(snapshot: Snapshot) -> bool:
    total: int = sum(snapshot.entities("wallet").values())
    return total >= 0 and snapshot.get("wallet", "w0", 0) >= 0


@fault_seeds(2)
def test_it(charon_harness: object) -> None:
    run_app("charon.apps.wallets:app", workload, [conserved], seed=1)
    from_hints(wallets.app)
'''


def test_the_testing_helpers_type_check_in_a_users_project(project: Path) -> None:
    """``Invocation``, ``Snapshot``, ``fault_seeds`` are explicitly exported by ``charon.testing`` (``mypy --strict``
    refused them: "does not explicitly export"), and a snapshot's values are usable (``Any``, not ``object``)."""
    (project / "harness_user.py").write_text(HARNESS_USER)
    assert mypy(project, "harness_user.py") == []
