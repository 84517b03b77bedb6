"""The package's imports: no cycle, no layer importing a layer below it (docs/design.md, "Layers").

Reads every .py file of dtensor_ring/, passes/ (installed as ``dtensor_ring.passes``) and bench/
with ``ast``, nothing imported: every ``import`` statement counts, at module level or inside a
function (a function-local import that only dodges a cycle is still a cycle). bench/'s scripts
import each other by bare name (bench/ is their sys.path entry).

* Cycles: over the imports as written plus the package ``__init__`` each one runs (importing
  ``a.b.c`` from outside ``a.b`` runs ``a/b/__init__.py``).
* Layers: over the imports as written. ``LAYERS`` is docs/design.md's layer table, top to
  bottom; a module may import its own layer and the ones above it. Every module must be in some layer (the table lists the tree), and
  ``test_design_table_lists_these_layers`` keeps the table and ``LAYERS`` the same.

The checkers take a plain graph, so ``test_checks_catch_*`` plant an upward import and a
function-level cycle in a small package written to a temporary folder and see them reported.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"

# docs/design.md's "Layers" table, in its order: (layer, the paths of its "where" column). A path
# ending in "/" is a folder; a file inside a folder of another layer belongs to the file's layer.
LAYERS = [
    ("validation", ["dtensor_ring/validation.py"]),
    ("layouts", ["dtensor_ring/layouts/"]),
    ("documents", ["dtensor_ring/documents.py"]),
    ("merge", ["dtensor_ring/merge/"]),
    ("kernels", ["dtensor_ring/kernels/"]),
    ("communication", ["dtensor_ring/comm/", "dtensor_ring/hybrid/comm.py"]),
    ("schedules", ["dtensor_ring/schedules/"]),
    ("hybrid (2-D meshes)", ["dtensor_ring/hybrid/"]),
    ("agreement", ["dtensor_ring/consistency.py"]),
    ("ops", ["dtensor_ring/call.py", "dtensor_ring/ops.py", "dtensor_ring/hybrid/ops.py"]),
    ("modelled time", ["dtensor_ring/timeline.py", "dtensor_ring/hybrid/cost.py"]),
    ("entry points", ["dtensor_ring/attention.py", "dtensor_ring/sharding.py",
                      "dtensor_ring/loss.py"]),
    ("dtensor", ["dtensor_ring/dtensor/"]),
    ("training", ["dtensor_ring/checkpointing.py", "dtensor_ring/flops.py"]),
    ("passes", ["passes/"]),
    ("package front", ["dtensor_ring/__init__.py", "dtensor_ring/installation.py"]),
    ("models, tools", ["dtensor_ring/models/", "dtensor_ring/hf.py", "dtensor_ring/tools/",
                       "dtensor_ring/__main__.py"]),
    ("benchmarks", ["bench/"]),
]

# Folder -> the package its files are imported as; bench/ holds scripts (no package).
SOURCES = {"dtensor_ring": "dtensor_ring", "passes": "dtensor_ring.passes", "bench": None}


class Module:
    def __init__(self, name: str, path: str, is_package: bool):
        self.name, self.path, self.is_package = name, path, is_package


def find_modules(root: Path, sources: dict) -> dict:
    """Module name -> Module for every .py file under ``root``/folder of ``sources``."""
    modules = {}
    for folder, package in sources.items():
        for file in sorted((root / folder).rglob("*.py")):
            parts = list(file.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if package is None:  # scripts: imported by their bare names
                name = ".".join([folder, *parts])
            else:
                name = ".".join([package, *parts])
            modules[name] = Module(name, file.relative_to(root).as_posix(), is_package)
    return modules


def _known(name: str, modules: dict):
    """The innermost module of ``modules`` that ``name`` (a module or an attribute path) is in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node, module: Module, modules: dict, scripts: str | None):
    """The modules of ``modules`` that one import statement of ``module`` imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.name.split(".")
            if not module.is_package:
                package = package[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join([*package, *([node.module] if node.module else [])])
        names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in base
    found = []
    for name in names:
        if scripts is not None and f"{scripts}.{name.split('.')[0]}" in modules:
            name = f"{scripts}.{name}"  # a script's sibling, by its bare name
        target = _known(name, modules)
        if target is not None and target != module.name:
            found.append(target)
    return found


def import_graph(root: Path, sources: dict) -> tuple[dict, dict]:
    """(modules, edges): edges[a][b] = the line of a's first import of b, in a function or not."""
    modules = find_modules(root, sources)
    edges = {name: {} for name in modules}
    for module in modules.values():
        top = module.name.split(".")[0]
        scripts = top if sources.get(top, "") is None else None
        tree = ast.parse((root / module.path).read_text(), module.path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, modules, scripts):
                    edges[module.name].setdefault(target, node.lineno)
    return modules, edges


def with_package_inits(edges: dict) -> dict:
    """``edges`` plus, for each import of a.b.c, a.b and a (the ``__init__`` files it runs), but not
    the packages the importer is itself inside (they are already running)."""
    out = {name: dict(targets) for name, targets in edges.items()}
    for name, targets in edges.items():
        for target, line in targets.items():
            parts = target.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in edges and not (name + ".").startswith(package + "."):
                    out[name].setdefault(package, line)
    return out


def find_cycle(edges: dict) -> list | None:
    """One import cycle [a, b, ..., a] of ``edges``, or None."""
    state = {}  # name -> "open" while on the path, "done" after

    def visit(name, path):
        state[name] = "open"
        path.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path)
                if cycle:
                    return cycle
        path.pop()
        state[name] = "done"
        return None

    for name in sorted(edges):
        if name not in state:
            cycle = visit(name, [])
            if cycle:
                return cycle
    return None


def layer_of(path: str, layers: list) -> int | None:
    """The index in ``layers`` of the row whose path is the longest prefix of ``path``."""
    best, best_len = None, -1
    for index, (_, paths) in enumerate(layers):
        for prefix in paths:
            matches = path.startswith(prefix) if prefix.endswith("/") else path == prefix
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def upward_imports(modules: dict, edges: dict, layers: list) -> list:
    """Every import of a module in a layer below the importer's, as text."""
    found = []
    for name, targets in edges.items():
        mine = layer_of(modules[name].path, layers)
        for target, line in targets.items():
            theirs = layer_of(modules[target].path, layers)
            if mine is not None and theirs is not None and theirs > mine:  # (unlisted: below)
                found.append(f"{modules[name].path}:{line} ({layers[mine][0]}) imports {target} "
                             f"({layers[theirs][0]}, a layer below it)")
    return found


def unlisted(modules: dict, layers: list) -> list:
    return sorted(m.path for m in modules.values() if layer_of(m.path, layers) is None)


# --- the package ------------------------------------------------------------------------------


def _package():
    return import_graph(ROOT, SOURCES)


def test_no_import_cycle():
    modules, edges = _package()
    assert len(modules) > 50 and sum(map(len, edges.values())) > 200  # the walk found the tree
    cycle = find_cycle(with_package_inits(edges))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_is_in_a_layer():
    modules, _ = _package()
    assert unlisted(modules, LAYERS) == [], "add these to docs/design.md's layer table and LAYERS"


def test_no_layer_imports_a_layer_below_it():
    modules, edges = _package()
    assert upward_imports(modules, edges, LAYERS) == []


def _design_table() -> list:
    """docs/design.md's layer table as (layer, the paths of its "where" column)."""
    section = DESIGN.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header
    table = []
    for row in rows:
        layer, where = (cell.strip() for cell in row.strip("|").split("|")[:2])
        paths = [p for p in re.findall(r"`([^`]+)`", where) if p.endswith(("/", ".py"))]
        table.append((layer, paths))
    return table


def test_design_table_lists_these_layers():
    assert _design_table() == LAYERS


# --- the checks themselves, on a planted package -------------------------------------------------


def _plant(tmp_path, files: dict):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return import_graph(tmp_path, {"pkg": "pkg"})


_LAYERED = [("low", ["pkg/low.py"]), ("sub", ["pkg/sub/"]), ("high", ["pkg/high.py"])]


def test_checks_catch_an_upward_import(tmp_path):
    files = {"pkg/__init__.py": "", "pkg/low.py": "X = 1\n", "pkg/sub/__init__.py": "",
             "pkg/sub/mid.py": "from ..low import X\n",
             "pkg/high.py": "from .sub import mid\nfrom . import low\n"}
    modules, edges = _plant(tmp_path, files)
    assert edges["pkg.high"] == {"pkg.sub.mid": 1, "pkg.low": 2}
    assert upward_imports(modules, edges, _LAYERED) == []
    assert find_cycle(with_package_inits(edges)) is None
    assert unlisted(modules, _LAYERED) == ["pkg/__init__.py"]
    # planted: the lowest layer reaches up, inside a function
    files["pkg/low.py"] = "X = 1\n\n\ndef f():\n    from .sub.mid import X\n    return X\n"
    modules, edges = _plant(tmp_path, files)
    assert upward_imports(modules, edges, _LAYERED) == [
        "pkg/low.py:5 (low) imports pkg.sub.mid (sub, a layer below it)"]
    assert find_cycle(with_package_inits(edges)) == ["pkg.low", "pkg.sub.mid", "pkg.low"]


def test_checks_catch_a_cycle_through_a_package_init(tmp_path):
    """a imports b.c; b/__init__ imports a: a cycle (importing b.c runs b/__init__) though no
    statement imports a module that imports it back directly."""
    modules, edges = _plant(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from .b.c import Y\n",
                                       "pkg/b/__init__.py": "from .. import a\n",
                                       "pkg/b/c.py": "Y = 2\n"})
    assert find_cycle(edges) is None
    assert find_cycle(with_package_inits(edges)) == ["pkg.a", "pkg.b", "pkg.a"]
