"""The package's modules import each other without a cycle (issue 24: "no module imports a module above it").

Every `alignkit/**/*.py` is parsed with `ast` (nothing is imported, so the test costs well under a second) and
every import statement counts: module level, inside functions, and under `if TYPE_CHECKING:` too, since a
function-local import of a module above is exactly how the old cycle (config ↔ stage registry) hid. An edge
goes to the module named; `from package import name` goes to `package.name` when that is a module, else to
the package's `__init__`. Importing `a.b.c` also runs the `__init__` of `a.b` (and `a`) first, so an import
from outside a package counts as an import of each of its packages too: `alignkit.config`'s `__init__` must
stay below the stages even though a stage only names `alignkit.config.schema`. Within a package those are
already initialising, so they add nothing there.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "alignkit"
ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's name maps to its `__init__.py`)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that `name` (at `path`) imports anywhere in its body."""
    package = name if _is_package(path) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    own_packages = _packages_of(name) | ({name} if _is_package(path) else set())
    resolved = set()
    for target in targets:
        # `import alignkit.data.loader` or a name inside a module: the longest prefix that is a package module.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            resolved |= {target, *(_packages_of(target) - own_packages)}
    resolved.discard(name)
    return resolved


def _packages_of(name: str) -> set[str]:
    """The packages whose `__init__` runs before module `name`: `a.b.c` -> {`a`, `a.b`}."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest closed path through the component's first module, to show how the circle closes."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    next_frontier.append(child)
        frontier = next_frontier
    return component


def describe(graph: dict[str, set[str]], components: list[list[str]]) -> str:
    lines = []
    for component in components:
        lines.append(f"{len(component)} modules import each other in a circle: {', '.join(component)}")
        lines.append("  e.g. " + " -> ".join(one_cycle(graph, component)))
    return "\n".join(lines)


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    """The walker resolves relative imports at every level and counts imports inside functions."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .sub import high\n")
    (pkg / "sub" / "__init__.py").write_text("from .high import thing\n")
    (pkg / "sub" / "high.py").write_text("from ..low import f\nthing = 1\n")
    graph = import_graph(tmp_path)
    low, sub, high = f"{PACKAGE}.low", f"{PACKAGE}.sub", f"{PACKAGE}.sub.high"
    assert graph[low] == {high, sub}  # importing sub.high runs sub/__init__.py first
    assert graph[sub] == {high}
    assert graph[high] == {low}  # `alignkit` and `alignkit.sub` are already initialising
    found = cycles(graph)
    assert found == [[low, sub, high]]
    assert one_cycle(graph, found[0]) == [low, high, low]


def test_a_package_init_above_its_importers_is_a_cycle(tmp_path):
    """`from pkg.schema import X` runs `pkg/__init__.py`: if that imports a module above the importer, it is a
    cycle at run time although no module names the importer's own module."""
    pkg = tmp_path / PACKAGE
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("from .schema import X\nfrom .parse import parse\n")
    (pkg / "config" / "schema.py").write_text("X = 1\n")
    (pkg / "config" / "parse.py").write_text("from ..stage import run\n")
    (pkg / "stage.py").write_text("from .config.schema import X\n")
    found = cycles(import_graph(tmp_path))
    assert found == [[f"{PACKAGE}.config", f"{PACKAGE}.config.parse", f"{PACKAGE}.stage"]]


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30, "the walker found too few modules; is ROOT the repository?"
    found = cycles(graph)
    assert not found, "import cycle(s) in the package:\n" + describe(graph, found)
