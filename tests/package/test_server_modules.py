"""The server layer's module graph (parsed with ``ast``, function-local imports included): no module imports a
private name of another module, the admin routes and the shared modules never import the gateway, and the
server's modules form no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "charon" / "server"
#: modules the gateway is built from: they must not import it (nor serve, which imports it)
BELOW_GATEWAY = ("admin", "wire", "limits", "streams", "openapi", "http", "metrics")


def server_imports(source: str) -> tuple[set[str], list[str]]:
    """(the ``charon.server`` modules ``source`` imports, the private names it imports from any module)."""
    mods: set[str] = set()
    private: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("charon.server."):
                mods.add(node.module.removeprefix("charon.server."))
            elif node.module == "charon.server":
                mods |= {a.name for a in node.names}
            private += [f"{node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Import):
            mods |= {a.name.removeprefix("charon.server.") for a in node.names if a.name.startswith("charon.server.")}
    return mods, private


def graph() -> dict[str, set[str]]:
    out = {}
    for path in sorted(SERVER.glob("*.py")):
        mods, private = server_imports(path.read_text())
        assert private == [], f"{path.name} imports private names: {private}"
        out[path.stem] = mods
    return out


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g``, if there is one."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_checks_see_what_they_check() -> None:
    mods, private = server_imports(
        "from charon.server.gateway import _Gateway, create_app\n"
        "def f():\n    from charon.server import admin\n    import charon.server.wire\n"
    )
    assert mods == {"gateway", "admin", "wire"} and private == ["charon.server.gateway._Gateway"]
    assert cycle({"admin": {"gateway"}, "gateway": {"wire", "admin"}, "wire": set()}) == ["admin", "gateway", "admin"]
    assert cycle({"gateway": {"admin", "wire"}, "admin": {"wire"}, "wire": set()}) is None


def test_no_private_imports_no_cycles_and_admin_below_the_gateway() -> None:
    g = graph()
    assert {"gateway", "admin", "wire", "limits", "openapi", "http", "serve"} <= set(g)
    assert "admin" in g["gateway"] and "gateway" in g["serve"]  # the parser sees real edges
    assert cycle(g) is None
    for m in BELOW_GATEWAY:
        assert not g[m] & {"gateway", "serve"}, f"charon.server.{m} imports {sorted(g[m] & {'gateway', 'serve'})}"
