"""The import floors of spartron/: every import points down the floor list, and no files import each other.

Read with `ast` from the source (nothing is imported): module-level imports, imports inside functions
(lazy) and `importlib.import_module("spartron...")` with a literal name all count, so a lazy import
cannot hide an upward arrow or a cycle. `import a.b.c` / `from a.b import c` is an arrow to the file of
the deepest module named (c's own file when c is a module, else a/b/__init__.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "spartron"

# Lowest first. A file may import its own floor and the floors below; one name per top-level entry
# of spartron/ (a subpackage, or a module for the root helpers and testing.py).
FLOORS: list[tuple[str, ...]] = [
    ("__init__", "configbase", "scoped", "optional", "temporaries", "face"),  # root helpers
    ("parallel",),
    ("comm",),
    ("checkpointing",),
    ("layers",),
    ("data",),  # corpora, tokenizers, token files: their errors come from configbase, never from runtime
    ("interop",),
    ("runtime",),
    ("launch",),
    ("__main__",),  # `python -m spartron`: the CLI
    ("testing",),  # the test harness sits above all
]
FLOOR_OF = {name: level for level, names in enumerate(FLOORS) for name in names}


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the tree; `from m import x` yields m.x (resolved later)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                origin = ".".join(stem + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names += [(f"{origin}.{alias.name}", node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append((node.args[0].value, node.lineno))
    return names


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[Path, dict[Path, int]]:
    """file -> {imported file: line of the first such import} over the package's own files."""
    files = module_files(root, package)
    graph: dict[Path, dict[Path, int]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[Path, int] = {}
        for name, line in _imported_names(tree, module, path.name == "__init__.py"):
            if name != package and not name.startswith(package + "."):
                continue
            # the deepest named module: `from a.b import c` is a.b.c when c is a module, else a.b
            while name not in files and "." in name:
                name = name.rsplit(".", 1)[0]
            target = files.get(name)
            if target is not None and target != path and target not in edges:
                edges[target] = line
        graph[path] = edges
    return graph


def floor_of(path: Path, root: Path = ROOT, package: str = PACKAGE) -> int | None:
    parts = path.relative_to(root / package).with_suffix("").parts
    return FLOOR_OF.get(parts[0])


def upward_imports(graph: dict[Path, dict[Path, int]], root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    out = []
    for src, edges in graph.items():
        for dst, line in edges.items():
            low, high = floor_of(src, root, package), floor_of(dst, root, package)
            if low is not None and high is not None and high > low:
                out.append(f"{src.relative_to(root)}:{line} imports {dst.relative_to(root)} "
                           f"(floor {FLOORS[high][0]} is above {FLOORS[low][0]})")
    return sorted(out)


def import_cycles(graph: dict[Path, dict[Path, int]], root: Path = ROOT) -> list[str]:
    """One line per cycle (strongly connected set of files), naming an arrow in each direction."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    components: list[list[Path]] = []

    def visit(v: Path) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_describe_cycle(graph, component, root) for component in components)


def _describe_cycle(graph: dict[Path, dict[Path, int]], component: list[Path], root: Path) -> str:
    """'a.py:3 -> b.py:7 -> a.py': the shortest loop through the component's first file, with import lines."""
    members, start = set(component), component[0]
    came_from: dict[Path, Path] = {}
    frontier = [start]
    while start not in came_from:
        frontier = [w for v in frontier for w in sorted(graph[v]) if w in members and w not in came_from
                    and not came_from.__setitem__(w, v)]
    loop = [start]
    while len(loop) == 1 or loop[-1] != start:
        loop.append(came_from[loop[-1]])
    loop.reverse()  # start -> ... -> start
    hops = [f"{a.relative_to(root)}:{graph[a][b]}" for a, b in zip(loop, loop[1:], strict=False)]
    return f"import cycle: {' -> '.join(hops)} -> {start.relative_to(root)}"


def test_every_top_level_entry_has_a_floor():
    entries = {p.name.removesuffix(".py") for p in (ROOT / PACKAGE).iterdir()
               if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert sorted(entries - set(FLOOR_OF)) == []


def test_every_import_points_down():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_the_checker_finds_upward_imports_lazy_imports_and_cycles(tmp_path):
    pkg = tmp_path / PACKAGE
    for rel, text in {
        "__init__.py": "",
        "parallel/__init__.py": "from spartron.parallel.dims import Dims\n",
        "parallel/dims.py": "def f():\n    from spartron.layers import norms\n",  # lazy and upward
        "layers/__init__.py": "",
        "layers/norms.py": "import torch\n",
        "layers/model.py": "from . import dsa\n",
        "layers/dsa.py": "import importlib\nimportlib.import_module('spartron.layers.model')\n",
        "layers/a.py": "from spartron.layers.b import x\n",
        "layers/b.py": "\n\nfrom spartron.layers.c import y\n",
        "layers/c.py": "def g():\n    import spartron.layers.a\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert upward_imports(graph, tmp_path) == [
        "spartron/parallel/dims.py:2 imports spartron/layers/norms.py (floor layers is above parallel)"]
    assert import_cycles(graph, tmp_path) == [
        "import cycle: spartron/layers/a.py:1 -> spartron/layers/b.py:3 -> spartron/layers/c.py:2 -> "
        "spartron/layers/a.py",
        "import cycle: spartron/layers/dsa.py:2 -> spartron/layers/model.py:1 -> spartron/layers/dsa.py",
    ]
