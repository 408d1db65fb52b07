"""Import hygiene: no import cycle and no ``from x import _private`` across modules.

The helpers read the source with ``ast`` (nothing is imported), count every import,
top-level or inside a function (a lazy import still ties two modules together), and work on
any package. The checks are scoped to ``mlxd.cli`` for now; the rest of the package should
follow once store/pull.py <-> store/sources.py is untangled (widen ``SCOPE`` to "mlxd").
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
SCOPE = "mlxd.cli"


def module_names(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file."""
    out = {}
    for f in sorted((src / package.replace(".", "/")).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _resolve(importer: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]
               ) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import statement in the file.

    ``from pkg import sub`` where ``pkg.sub`` is a module counts as importing ``pkg.sub``.
    """
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_pkg, node)
            plain = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    out.append((sub, []))
                else:
                    plain.append(a.name)
            if plain:
                out.append((target, plain))
    return out


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports."""
    modules = module_names(src, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in imports_of(name, path, modules):
            # `import a.b.c` also runs a and a.b: the closest module of ours is the edge
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]], scope: str) -> list[list[str]]:
    """Strongly connected components of more than one module, among modules in ``scope``."""
    inside = {m for m in graph if m == scope or m.startswith(scope + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & inside):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(inside):
        if v not in index:
            visit(v)
    return found


def private_imports(src: Path, package: str, scope: str) -> list[str]:
    """``importer: from module import _name`` for modules in ``scope`` taking a private
    name from another module of ``package`` (dunders such as ``__version__`` are fine)."""
    modules = module_names(src, package)
    bad = []
    for name, path in modules.items():
        if not (name == scope or name.startswith(scope + ".")):
            continue
        for target, names in imports_of(name, path, modules):
            if target == name or not (target == package or target.startswith(package + ".")):
                continue
            for n in names:
                if n.startswith("_") and not (n.startswith("__") and n.endswith("__")):
                    bad.append(f"{name}: from {target} import {n}")
    return bad


# --------------------------------------------------------------------------------------- #


def test_cli_has_no_import_cycle():
    graph = import_graph(SRC, "mlxd")
    assert {"mlxd.cli.main", "mlxd.cli.common", "mlxd.cli.models"} <= set(graph)
    assert cycles(graph, SCOPE) == []


def test_cli_imports_no_private_name_from_another_module():
    assert private_imports(SRC, "mlxd", SCOPE) == []


def test_cli_shared_helpers_live_in_common_which_imports_no_command_module():
    graph = import_graph(SRC, "mlxd")
    assert not {m for m in graph["mlxd.cli.common"] if m.startswith("mlxd.cli")}
    for cmd in ("models", "daemon", "config_cmd", "service", "serve"):
        assert "mlxd.cli.common" in graph[f"mlxd.cli.{cmd}"], cmd


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_the_checks_find_cycles_and_private_imports(tmp_path):
    """The helpers on a made-up package: a lazy three-module cycle, a relative import,
    ``from pkg import submodule``, a private name and a harmless dunder."""
    _write(tmp_path, "pkg/__init__.py", "__version__ = '1'\n")
    _write(tmp_path, "pkg/a.py", "from pkg.b import run\n")
    _write(tmp_path, "pkg/b.py", "def run():\n    from . import c\n")
    _write(tmp_path, "pkg/c.py", "import pkg.a\nfrom pkg import __version__\n")
    _write(tmp_path, "pkg/d.py", "from pkg.a import _helper\nfrom pkg import a\n")
    _write(tmp_path, "pkg/sub/__init__.py", "")
    _write(tmp_path, "pkg/sub/e.py", "from ..d import thing\nfrom .f import _private\n")
    _write(tmp_path, "pkg/sub/f.py", "from pkg.sub.e import x\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.a"}
    assert graph["pkg.sub.e"] == {"pkg.d", "pkg.sub.f"}
    assert cycles(graph, "pkg") == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.e", "pkg.sub.f"]]
    assert cycles(graph, "pkg.sub") == [["pkg.sub.e", "pkg.sub.f"]]
    assert private_imports(tmp_path, "pkg", "pkg") == [
        "pkg.d: from pkg.a import _helper", "pkg.sub.e: from pkg.sub.f import _private"]
