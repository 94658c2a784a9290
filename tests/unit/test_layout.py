"""The code's shape, read with ast: no import cycles among the packages, no class in client_sdk/ or shard_service/
too big to read, and a stage's executor that loads no gRPC; and its file names: each module listed in
docs/architecture.md, none sharing a name with another package's module for a different job.

An import counts where it stands at module level, under `if TYPE_CHECKING:` or in a try or class body included (the
design allows no cycle, TYPE_CHECKING ones included); imports inside functions are checked on their own, since a
deferred import only hides a cycle until the function runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("client_sdk", "shard_service", "coordinator", "shardtrain")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name."""
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported(path: Path, known: set[str], in_functions: bool) -> set[str]:
    """The known modules that `path` imports at module level, or with `in_functions` inside its functions."""
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function == in_functions:
                found.update(_targets(child, path))
            visit(child, inside)
    visit(ast.parse(path.read_text(), str(path)), False)
    return {_known(name, known) for name in found} - {None, module_name(path)}


def _targets(node: ast.AST, path: Path) -> list[str]:
    """The dotted names an import statement may bring in (a module, or a name in one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def _known(name: str, known: set[str]) -> str | None:
    """The longest known module `name` lies in (a name imported from a module: that module); None for others."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules, as the path that closes it."""
    reach = {node: _reachable(graph, node) for node in graph}
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        group = {node for node in reach[start] if start in reach.get(node, ())}
        done |= group | {start}
        path = _path_back(graph, start, group) if group else None
        if path:
            cycles.append(path)
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for node in graph.get(todo.pop(), ()):
            if node not in seen:
                seen.add(node)
                todo.append(node)
    return seen


def _path_back(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str] | None:
    """The shortest path from `start` back to itself within `group` (breadth first)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for node in sorted(graph.get(path[-1], ())):
            if node == start:
                return path + [start]
            if node in group and node not in seen:
                seen.add(node)
                paths.append(path + [node])
    return None


def import_graph(in_functions: bool) -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, set(known), in_functions) for name, path in known.items()}


def test_the_cycle_finder_names_each_cycle_of_a_written_out_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle():
    cycles = find_cycles(import_graph(in_functions=False))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_no_import_cycle_through_imports_inside_functions():
    module_level, in_functions = import_graph(False), import_graph(True)
    graph = {name: module_level[name] | in_functions[name] for name in module_level}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (some through imports inside functions): " + "; ".join(
        " -> ".join(cycle) for cycle in cycles)


def test_the_graph_sees_the_imports_it_checks():
    graph = import_graph(in_functions=False)
    assert "client_sdk.transport" in graph["client_sdk.pipeline"]
    assert "shardtrain.schedule" in graph["client_sdk.pipeline"]  # `from shardtrain import schedule as schedules`


MAX_CLASS_LINES, MAX_CLASS_METHODS = 300, 25  # a class past these is two or three classes
# A class that cannot be split at once may be pinned here at its (lines, methods), to go only down until it is under
# the limits above. A wide public API is no reason: DistributedModel inherits its methods from mixins, by what they do.
PINNED: dict[str, tuple[int, int]] = {}
SIZED = ("client_sdk", "shard_service")  # the packages held to the limits


def class_sizes(package: str) -> dict[str, tuple[int, int]]:
    """(lines, methods) of every class in `package`, by file:class; a method is any def in its body, properties
    included."""
    sizes = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
                sizes[f"{path.relative_to(ROOT)}:{node.name}"] = (node.end_lineno - node.lineno + 1, len(methods))
    return sizes


@pytest.mark.parametrize("package", SIZED)
def test_no_class_in_the_sdk_or_a_shard_is_too_big_to_read(package):
    def over(name: str, size: tuple[int, int]) -> bool:
        lines, methods = PINNED.get(name, (MAX_CLASS_LINES, MAX_CLASS_METHODS))
        return size[0] > lines or size[1] > methods
    too_big = {name: size for name, size in class_sizes(package).items() if over(name, size)}
    assert not too_big, (f"classes over {MAX_CLASS_LINES} lines or {MAX_CLASS_METHODS} methods (or their pin), as "
                         f"(lines, methods): {too_big}; split them by what they do")


def test_a_pin_follows_its_class_down():
    sizes = {name: size for package in SIZED for name, size in class_sizes(package).items()}
    assert {name: sizes.get(name) for name in PINNED} == PINNED, "a pinned class shrank: lower its pin to its size"


def test_a_stages_executor_and_planned_runs_load_no_grpc():
    """They are domain code (DESIGN.md: only servicers and the SDK's RPC layer import gRPC); their sends are I/O, and
    reach the links through an object they are handed."""
    code = "import sys, shard_service.planned_run; print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", f"importing the executor loaded {loaded.stdout.strip()}"


def listed_in_architecture() -> dict[str, set[str]]:
    """The module files docs/architecture.md's "Code layout" lists, by package: `  name.py  job` under `package/`."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Code layout", 1)[1].split("```")[1]
    listed: dict[str, set[str]] = {}
    package = None
    for line in block.splitlines():
        if line and not line.startswith(" "):
            package = line.split("/")[0]
        elif package and line.startswith("  ") and line.split()[0].endswith(".py"):
            listed.setdefault(package, set()).add(line.split()[0])
    return listed


@pytest.mark.parametrize("package", PACKAGES)
def test_architecture_lists_every_module_by_its_file_name(package):
    """The layout in docs/architecture.md names every module file of the four packages, and only files that exist,
    so the page cannot drift from the tree."""
    on_disk = {path.name for path in (ROOT / package).glob("*.py") if path.name != "__init__.py"}
    listed = listed_in_architecture().get(package, set())
    assert not on_disk - listed, f"{package}/ modules missing from docs/architecture.md: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"docs/architecture.md lists gone {package}/ modules: {sorted(listed - on_disk)}"


def test_no_two_module_files_share_a_name_for_different_things():
    """DESIGN.md: a reader finds any behaviour from the file names alone. The same name in two packages is allowed
    only for the same job in each (a component's server.py, servicer.py, __main__.py)."""
    same_job = {"__init__.py", "__main__.py", "server.py", "servicer.py"}
    seen: dict[str, str] = {}
    shared = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            if path.name in seen and path.name not in same_job:
                shared.append(f"{seen[path.name]}/{path.name} and {package}/{path.name}")
            seen.setdefault(path.name, package)
    assert not shared, f"module files that share a name: {shared}"
