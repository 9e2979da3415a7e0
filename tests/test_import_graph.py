"""The code reads in one direction: no import cycle among the project's modules, layers kept.

Every ``import`` of every module of ``kcache``, ``kcache_client`` and
``kcache_server`` counts, wherever it is written: at the top, inside a function
(an import there hides a cycle from Python, not from this test) or under
``TYPE_CHECKING``. The core imports neither the client nor the server, and the
client never imports the server (docs/design.md, section 1).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kcache": ROOT / "kcache",
    "kcache_client": ROOT / "client" / "kcache_client",
    "kcache_server": ROOT / "server" / "kcache_server",
}


def _modules() -> dict[str, Path]:
    """Every importable module of the three packages, by dotted name."""
    found: dict[str, Path] = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if "migrations" in parts:  # Alembic's scripts, loaded by path: never imported
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The project modules ``module`` imports, relative imports resolved.

    ``from pkg import name`` depends on the submodule ``pkg.name`` when there is one,
    else on ``pkg``; ``import a.b.c`` on the deepest of a.b.c, a.b, a that is a
    module. (The packages above a module run first on import, but they are its
    parents, not its dependencies.)
    """

    def deepest(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield deepest(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
                prefix = ".".join([*parts, node.module] if node.module else parts)
            else:
                prefix = node.module or ""
            for alias in node.names:
                submodule = f"{prefix}.{alias.name}"
                yield submodule if submodule in modules else deepest(prefix)


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = _modules()
    return {
        name: {target for target in _imports(name, path, modules) if target and target != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle through ``component``, for the failure message."""
    members = set(component)
    start = component[0]
    trail = [start]
    seen = {start}
    node = start
    while True:
        nxt = sorted(graph[node] & members)
        back = [n for n in nxt if n == start]
        if back and len(trail) > 1:
            return [*trail, start]
        fresh = [n for n in nxt if n not in seen]
        if not fresh:
            return [*trail, "..."]
        node = fresh[0]
        trail.append(node)
        seen.add(node)


def test_the_walk_finds_every_kind_of_import() -> None:
    """The parser sees top-level, function-local and relative imports (so the checks below can fail)."""
    graph = _graph()
    assert "kcache_server.serving.app" in graph and len(graph) > 50
    assert "kcache_server.routes" in graph["kcache_server.serving.app"]
    assert "kcache.recipe" in graph["kcache_server.recipe_checks"]
    # kcache_server.serving.cli imports the app only inside `kcache serve`'s function.
    assert "kcache_server.serving.app" in graph["kcache_server.serving.cli"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(
        " -> ".join(_path_within(graph, c)) for c in cycles
    )


def test_layers_point_one_way() -> None:
    graph = _graph()
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if (
            (module.startswith("kcache.") or module == "kcache")
            and target.split(".")[0] in ("kcache_client", "kcache_server")
        )
        or (module.split(".")[0] == "kcache_client" and target.split(".")[0] == "kcache_server")
    )
    assert wrong == []


#: The server's parts, top to bottom: a module imports its own part or the parts below it.
#: The wing that puts the server on the wire (app, CLI, fast paths, protocol, contract)
#: stands above the routes, the routes above the services (state, resolving, compiling,
#: eviction, verification...), the services above the audit, and the audit above the
#: records every part reads (settings, tables, index, errors, wire schemas).
SERVER_PARTS = ("serving", "routes", "services", "auditing", "records")
_RECORDS = frozenset(
    ("db", "errors", "index", "migrate", "models", "request_ids", "schemas", "settings", "terminal")
)


def _server_part(module: str) -> str | None:
    """Which of :data:`SERVER_PARTS` ``module`` belongs to (None: not a server module)."""
    parts = module.split(".")
    if parts[0] != "kcache_server" or len(parts) == 1:  # the package's face hands names on
        return None
    if parts[1] in ("serving", "routes", "auditing"):
        return parts[1]
    return "records" if parts[1] in _RECORDS else "services"


def test_the_server_parts_point_down() -> None:
    graph = _graph()
    placed = {m: _server_part(m) for m in graph}
    assert {p for p in placed.values() if p} == set(SERVER_PARTS)
    rank = {part: i for i, part in enumerate(SERVER_PARTS)}
    upward = sorted(
        f"{module} ({placed[module]}) -> {target} ({placed[target]})"
        for module, targets in graph.items()
        for target in targets
        if (here := placed[module]) and (there := placed.get(target)) and rank[there] < rank[here]
    )
    assert upward == [], "imports that run up the server's parts: " + "; ".join(upward)
