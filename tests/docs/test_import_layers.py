"""Import layers of megarl (issue 40, "the floor plan"): the import graph read from the source, its
cycles held to an explicit list, which is empty: no cycle between modules or rooms.

Every module under megarl/ is parsed with `ast` (nothing is imported); every `import megarl.x` and
`from megarl.x import y` counts, at module level and inside functions alike (a function-local import
that reaches back up is still a dependency; TYPE_CHECKING imports count too). `from megarl.x import y`
points at the module megarl.x.y when that is a module, else at megarl.x.

A *room* is a direct subpackage of megarl (megarl/step/, megarl/config/, ...) or a module loose in
megarl/ (megarl/trainer.py is the room "trainer"); external packages are not rooms. Two cycle lists:

- KNOWN_MODULE_CYCLES: every elementary cycle between modules, each written from its smallest module;
- KNOWN_ROOM_CYCLES: a cycle between rooms is recorded by its edges: every import edge "a -> b"
  between two rooms that reach each other, that is every edge lying on some cycle (elementary room
  cycles can be many: when this test was written 14 rooms formed one tangle of 198 of them, 40
  edges). A new edge that closes a cycle adds a line; an import removed so that an edge lies on no
  cycle any more removes one.

The test asserts that the cycles found are exactly the listed ones: a new cycle fails it, and a
broken one fails it until its line is deleted, so the lists only shrink. Issue 40 wanted both empty, and they are.

Function-local imports (issue 40, item 4): with no cycle left, a local import is never needed to break one; it
stays inside a function only to defer an optional dependency (vllm, sglang, transformer_engine, wandb, ...), a heavy
one that the module's common path runs without (torch for the config check, Megatron, transformers), or a module
chosen at run time (the rollout engines), and says which in a `# deferred: ...` comment on its line or on a comment
line above its group of imports. `test_function_local_imports_say_what_they_defer` holds every one of them to that;
an import that defers nothing belongs in the module's top-level imports.

`python tests/docs/test_import_layers.py` (or pytest -s) prints the room layering found: the rooms
by layer, each importing only rooms of lower layers, the tangles (strongly connected rooms) as one
entry.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megarl"

# None left: issue 40's floor plan wants the list empty; a new cycle fails the test.
KNOWN_MODULE_CYCLES: set[tuple[str, ...]] = set()

# The room edges on a cycle, one "a -> b" a line (within the tangles `describe` prints as {...}). None
# left: the rooms form layers that import downward only (`python tests/docs/test_import_layers.py`).
_ROOM_EDGES_ON_CYCLES = """
"""
KNOWN_ROOM_CYCLES = {tuple(line.split(" -> ")) for line in _ROOM_EDGES_ON_CYCLES.split("\n") if line.strip()}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, set[str]]:
    """module -> the megarl modules it imports (itself left out)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}

    def known(name: str) -> str:
        while name not in paths and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {}
    for module, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names if a.name.startswith("megarl."))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != "megarl" and not source.startswith("megarl."):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in paths else known(source))
        targets.discard(module)
        graph[module] = targets
    return graph


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {room(m): set() for m in graph}
    for module, targets in graph.items():
        rooms[room(module)].update(room(t) for t in targets if room(t) != room(module))
    return rooms


def elementary_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each cycle once, starting at its smallest node (fine for the module graph's few cycles)."""
    found = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def edges_on_cycles(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The edges a -> b with a and b in one strongly connected component: exactly the edges on a cycle."""
    component_of = {v: i for i, c in enumerate(strongly_connected(graph)) for v in c}
    return {(a, b) for a, targets in graph.items() for b in targets if component_of[a] == component_of[b]}


def layering(graph: dict[str, set[str]]) -> list[list[str]]:
    """Layers of the rooms, lowest first: a room (or a tangle, written {a b ...}) imports only lower layers."""
    components = strongly_connected(graph)
    component_of = {v: i for i, c in enumerate(components) for v in c}
    level: dict[int, int] = {}

    def depth(i: int) -> int:
        if i not in level:  # Tarjan returns components with their dependencies first
            below = {component_of[t] for v in components[i] for t in graph[v]} - {i}
            level[i] = 1 + max((depth(j) for j in below), default=-1)
        return level[i]

    layers: dict[int, list[str]] = {}
    for i, component in enumerate(components):
        name = next(iter(component)) if len(component) == 1 else "{" + " ".join(sorted(component)) + "}"
        layers.setdefault(depth(i), []).append(name)
    return [sorted(layers[k]) for k in sorted(layers)]


def describe() -> str:
    graph = import_graph()
    rooms = room_graph(graph)
    lines = ["megarl's rooms by import layer (lowest first; {...}: rooms that import each other):"]
    lines += [f"  {n}: {', '.join(names)}" for n, names in enumerate(layering(rooms))]
    lines.append(f"room edges on cycles: {len(edges_on_cycles(rooms))}; module cycles: {len(elementary_cycles(graph))}")
    return "\n".join(lines)


def local_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside functions (methods and nested functions included) of one module."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def unexplained_local_imports() -> list[str]:
    """`path:line` of each function-local import without its `# deferred: ...` comment: on the import's first
    line, or on a comment line directly above the import or above the run of import lines it belongs to (a group
    under one comment: imports, with blank lines between them, down from the comment line)."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().split("\n")
        nodes = local_imports(path)
        import_lines = {n for node in nodes for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
        for node in nodes:
            above = node.lineno - 1  # 1-based number of the line above
            while above in import_lines or (lines[above - 1].strip() == "" and above - 1 in import_lines):
                above -= 1  # up through the imports above it, blank lines between them included
            while above >= 1 and lines[above - 1].lstrip().startswith("#") and "# deferred" not in lines[above - 1]:
                above -= 1  # a comment of several lines
            own = "# deferred" in lines[node.lineno - 1]
            group = above >= 1 and lines[above - 1].lstrip().startswith("# deferred")
            if not (own or group):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return missing


def test_the_import_graph_reads_every_module():
    graph = import_graph()
    assert "megarl.trainer" in graph and "megarl.step.step_record" in graph["megarl.trainer"]
    assert "megarl.platform.process_groups" in graph["megarl.runtime.heartbeat"], "a function-local import is missed"


def test_module_cycles_are_the_known_ones():
    print("\n" + describe())
    found = elementary_cycles(import_graph())
    new, gone = sorted(found - KNOWN_MODULE_CYCLES), sorted(KNOWN_MODULE_CYCLES - found)
    assert not new, f"new import cycles between modules (issue 40 wants none): {new}"
    assert not gone, f"these module cycles are broken: delete them from KNOWN_MODULE_CYCLES: {gone}"


def test_room_cycles_are_the_known_ones():
    found = edges_on_cycles(room_graph(import_graph()))
    new, gone = sorted(found - KNOWN_ROOM_CYCLES), sorted(KNOWN_ROOM_CYCLES - found)
    assert not new, ("imports between rooms that now lie on a cycle (issue 40 wants none; a lower room "
                     f"must not import a higher one): {[' -> '.join(e) for e in new]}")
    assert not gone, f"these room edges lie on no cycle any more: delete them from KNOWN_ROOM_CYCLES: {[' -> '.join(e) for e in gone]}"



def test_function_local_imports_say_what_they_defer():
    """Issue 40: a function-local import is there to defer an optional or heavy dependency, or a module chosen at
    run time, and says which (`import torch  # deferred: the config check runs without torch`); anything else is
    imported at module level, where a reader sees it (no cycle is left for a local import to break)."""
    missing = unexplained_local_imports()
    assert not missing, ("function-local imports without a `# deferred: <what it defers>` comment (move the import "
                         f"to the module's top-level imports when it defers nothing): {missing}")


if __name__ == "__main__":
    print(describe())
