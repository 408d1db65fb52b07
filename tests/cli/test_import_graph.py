"""Import hygiene over all of ``mlxd``: no import cycle, no ``from x import _private``
across modules, and every import allowed by the layer table in docs/architecture.md.

The helpers read the source with ``ast`` (nothing is imported), count every import,
top-level or inside a function (a lazy import still ties two modules together), and work on
any package. The layer table and diagram are parsed from the doc, so the page and the code
cannot drift apart: an import the table does not allow fails, and so does an entry of the
table that no import uses.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"
SCOPE = "mlxd"
FRONT_ENDS = ("api/", "frontend/", "core/", "text/")  # never the engine side: no MLX
ENGINE_SIDE = ("runtime/", "engines/")


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


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
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


def unit_of(module: str, packages: set[str]) -> str:
    """The layer a module belongs to, as the doc names it: ``api/``, ``config.py``,
    ``__init__.py`` (the package's own module)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if parts[1] in packages else f"{parts[1]}.py"


def _entry_module(entry: str, package: str) -> str:
    """``api/`` -> ``pkg.api``, ``enginecore/protocol.py`` -> ``pkg.enginecore.protocol``."""
    if entry == "__init__.py":
        return package
    return ".".join([package, *entry.removesuffix("/").removesuffix(".py").split("/")])


def _allows(entry: str, target: str, package: str) -> bool:
    mod = _entry_module(entry, package)
    return target == mod or (mod != package and target.startswith(mod + "."))


def read_layers(doc: str) -> tuple[list[str], dict[str, list[str]]]:
    """(the diagram's layers, top to bottom; the table: layer -> what it may import), from
    the "Layers" section of the architecture page."""
    section = doc[doc.index("## Layers") :]
    diagram = section[section.index("```") + 3 :]
    diagram = diagram[: diagram.index("```")]
    order = [
        line.split()[0]
        for line in diagram.splitlines()
        if line[1:2].strip() and line[1:2] not in "│▼"
    ]
    table: dict[str, list[str]] = {}
    rows = section[section.index("<!-- allowed-imports") :].splitlines()[1:]
    for line in rows:
        if not line.strip():
            if table:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = [re.findall(r"`([^`]+)`", c) for c in cells]
        if len(cells) != 2 or not names[0]:
            continue  # the header and the separator
        table[names[0][0]] = names[1]
    return order, table


def layer_violations(
    graph: dict[str, set[str]], table: dict[str, list[str]], package: str, packages: set[str]
) -> tuple[list[str], list[str]]:
    """(imports the table does not allow, ``layer: entry`` the table allows but no import
    uses)."""
    used: set[tuple[str, str]] = set()
    bad = []
    for mod, targets in sorted(graph.items()):
        here = unit_of(mod, packages)
        for t in sorted(targets):
            if unit_of(t, packages) == here:
                continue
            hit = [e for e in table.get(here, []) if _allows(e, t, package)]
            if hit:
                used.update((here, e) for e in hit)
            else:
                bad.append(f"{mod} -> {t}")
    unused = [f"{u}: {e}" for u, entries in table.items() for e in entries if (u, e) not in used]
    return bad, unused


def _layers() -> tuple[dict[str, set[str]], list[str], dict[str, list[str]], set[str]]:
    graph = import_graph(SRC, SCOPE)
    order, table = read_layers(DOC.read_text())
    packages = {p.name for p in (SRC / SCOPE).iterdir() if (p / "__init__.py").is_file()}
    return graph, order, table, packages


# --------------------------------------------------------------------------------------- #


def test_mlxd_has_no_import_cycle():
    graph = import_graph(SRC, SCOPE)
    assert {"mlxd.cli.main", "mlxd.engines.llm", "mlxd.engines.tensor_parallel"} <= set(graph)
    assert cycles(graph, SCOPE) == []


def test_mlxd_imports_no_private_name_from_another_module():
    assert private_imports(SRC, "mlxd", SCOPE) == []


def test_the_doc_names_every_layer_in_its_diagram_and_its_table_in_one_order():
    graph, order, table, packages = _layers()
    assert order == list(table)
    assert sorted(order) == sorted({unit_of(m, packages) for m in graph})


def test_every_import_is_one_the_layer_table_allows_and_every_entry_is_used():
    graph, _, table, packages = _layers()
    bad, unused = layer_violations(graph, table, SCOPE, packages)
    assert bad == [], "imports docs/architecture.md's layer table does not allow"
    assert unused == [], "entries of docs/architecture.md's layer table that nothing uses"


def test_the_layers_import_downwards_only():
    _, order, table, _ = _layers()
    up = []
    for i, layer in enumerate(order):
        for entry in table[layer]:
            target = entry if entry in order else entry.split("/")[0] + "/"
            if order.index(target) <= i:
                up.append(f"{layer} -> {entry}")
    assert up == []


def test_front_ends_never_import_the_engine_side_and_nothing_below_imports_the_api():
    graph, _, table, packages = _layers()
    for layer in FRONT_ENDS:
        assert not [e for e in table[layer] if e.startswith(ENGINE_SIDE)], layer
    # of the engine core a front end takes the wire and the supervisor, not the process
    assert sorted(e for e in table["frontend/"] if e.startswith("enginecore/")) == [
        "enginecore/protocol.py",
        "enginecore/supervisor.py",
    ]
    entry_points = {"cli/", "server.py", "workers.py"}  # the processes that build the app
    assert {u for u, entries in table.items() if "api/" in entries} <= entry_points
    # the same, straight from the code
    reach = [
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in ts
        if unit_of(m, packages) in FRONT_ENDS and unit_of(t, packages) in ENGINE_SIDE
    ]
    assert reach == []


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
        "pkg.d: from pkg.a import _helper",
        "pkg.sub.e: from pkg.sub.f import _private",
    ]


def test_the_layer_checks_find_what_the_table_does_not_allow(tmp_path):
    """The table's checks on a made-up package and page: an import the table lacks, an
    entry no import uses, a module entry that allows one module and not its neighbour."""
    _write(tmp_path, "pkg/__init__.py", "")
    _write(tmp_path, "pkg/top/__init__.py", "")
    _write(tmp_path, "pkg/top/a.py", "from pkg.low.wire import X\nfrom pkg import conf\n")
    _write(tmp_path, "pkg/top/b.py", "def f():\n    from pkg.low.engine import Y\n")
    _write(tmp_path, "pkg/low/__init__.py", "")
    _write(tmp_path, "pkg/low/wire.py", "")
    _write(tmp_path, "pkg/low/engine.py", "")
    _write(tmp_path, "pkg/conf.py", "")
    doc = """## Layers

```
 top/     the top
   │
 low/     below it
 conf.py  settings
```

<!-- allowed-imports -->

| layer | may import |
| --- | --- |
| `top/` | `low/wire.py`, `conf.py` (why) |
| `low/` | `conf.py` |
| `conf.py` | |

Rules:
"""
    order, table = read_layers(doc)
    assert order == ["top/", "low/", "conf.py"] == list(table)
    assert table == {"top/": ["low/wire.py", "conf.py"], "low/": ["conf.py"], "conf.py": []}
    graph = import_graph(tmp_path, "pkg")
    bad, unused = layer_violations(graph, table, "pkg", {"top", "low"})
    assert bad == ["pkg.top.b -> pkg.low.engine"]
    assert unused == ["low/: conf.py"]
