"""The store is a lower layer: it never imports the engines, the runtime or the API, and its
modules import one another without circles (checked on the source, imports inside
functions included, since a lazy import is still an arrow)."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxd.dtype_policy
import mlxd.store

STORE = Path(mlxd.store.__file__).parent
UPPER = ("mlxd.engines", "mlxd.runtime", "mlxd.api", "mlxd.server", "mlxd.cli")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"mlxd.store.{p.stem}": p for p in STORE.glob("*.py") if p.stem != "__init__"}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def test_store_imports_nothing_above_it():
    for path in sorted(STORE.glob("*.py")):
        upward = sorted(i for i in _imports(path) if i.startswith(UPPER))
        assert not upward, f"{path.name} imports {upward}"
    assert len(list(STORE.glob("*.py"))) > 5  # really scanned the package


def test_store_modules_import_no_circle():
    graph = _graph()
    assert "mlxd.store.sources" in graph["mlxd.store.pull"]  # the graph sees real arrows

    def visit(node: str, stack: tuple[str, ...]) -> None:
        assert node not in stack, "import circle: " + " -> ".join((*stack, node))
        for nxt in graph[node]:
            visit(nxt, (*stack, node))

    for module in graph:
        visit(module, ())


def test_dtype_policy_is_a_leaf():
    assert not any(i.startswith("mlxd") for i in _imports(Path(mlxd.dtype_policy.__file__)))


def test_gguf_import_dtype_follows_the_backend():
    from mlxd.dtype_policy import gguf_import_dtype, wants_float32
    from mlxd.engines import backend

    assert backend.wants_float32 is wants_float32  # one policy, one home
    assert gguf_import_dtype("auto") == ("float32" if wants_float32() else "native")
    assert gguf_import_dtype("bfloat16") == "bfloat16"
