"""kvmesh's packages import each other without cycles and only as docs/ARCHITECTURE.md allows.

Every ``import`` in every module of ``src/kvmesh`` (function-level and ``TYPE_CHECKING`` imports
included) becomes an edge ``kvmesh.<package> -> kvmesh.<other>``; the allowed edges are the
"depends on" column of the architecture's package table.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvmesh"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
SHARED_MODULES = {"errors"}
"""Top-level modules every package may import (the one exception tree)."""


def packages() -> set[str]:
    return {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}


def _imported(module: Path, tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Dotted names ``module`` imports, relative imports resolved, with their line numbers."""
    parts = module.relative_to(SRC.parent).with_suffix("").parts
    package = parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join((*anchor, base)) if base else ".".join(anchor)
            yield base, node.lineno
            for alias in node.names:  # ``from kvmesh import core`` names a package
                yield f"{base}.{alias.name}", node.lineno


def import_graph() -> dict[str, dict[str, list[str]]]:
    """``{package: {dependency: ["path:line", ...]}}`` over kvmesh's packages."""
    known = packages()
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in known}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if len(rel.parts) < 2:
            continue  # kvmesh/cli.py and friends compose the packages from above
        source = rel.parts[0]
        for name, line in _imported(path, ast.parse(path.read_text(), str(path))):
            dotted = name.split(".")
            if dotted[0] != "kvmesh":
                continue
            if len(dotted) == 1:
                target = "core"  # the top-level package re-exports core's names
            elif dotted[1] in known:
                target = dotted[1]
            else:
                assert dotted[1] in SHARED_MODULES or not (SRC / f"{dotted[1]}.py").is_file(), (
                    f"{rel}:{line} imports top-level module kvmesh.{dotted[1]}"
                )
                continue
            sites = graph[source].setdefault(target, []) if target != source else None
            if sites is not None and f"{rel}:{line}" not in sites:
                sites.append(f"{rel}:{line}")
    return graph


def documented_dependencies() -> dict[str, set[str]]:
    """The package table of ARCHITECTURE.md: ``{package: allowed dependencies}``."""
    rows: dict[str, set[str]] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        match = re.match(r"\|\s*`kvmesh\.(\w+)`\s*\|.*\|\s*([^|]*?)\s*\|\s*$", line)
        if match is None:
            continue
        column = re.sub(r"\([^)]*\)", "", match.group(2))
        names = {n.strip().strip("`") for n in column.split(",")} - {"", "—"}
        rows[match.group(1)] = names
    return rows


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_table_names_every_package_and_only_packages():
    table = documented_dependencies()
    assert packages() <= set(table), f"packages missing from the table: {packages() - set(table)}"
    for package, deps in table.items():
        assert deps <= set(table), f"{package} depends on unknown packages {deps - set(table)}"
    assert _cycle(table) is None, f"the documented dependencies form a cycle: {_cycle(table)}"


def test_packages_import_only_what_the_architecture_allows():
    table = documented_dependencies()
    graph = import_graph()
    extra = {
        f"{package} -> {dep}": sites
        for package, deps in graph.items()
        for dep, sites in deps.items()
        if dep not in table.get(package, set())
    }
    assert not extra, f"undocumented package dependencies: {extra}"


def test_the_package_graph_is_acyclic():
    graph = {package: set(deps) for package, deps in import_graph().items()}
    assert graph["sim"] >= {"engine", "router", "workload"}  # the parser sees real imports
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
