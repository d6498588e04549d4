"""The package's structure: imports run one way along the flow, no module imports itself back, and
docs/architecture.md says which package imports which, truthfully. Imports inside functions count."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "shardkit"
#: The flow, lowest first: a package may import its own modules and packages of earlier layers only.
LAYERS = (("plan",), ("families",), ("models",), ("planner", "io"), ("runtime",), ("observe", "checkpoint"),
          ("training",), ("serving",), ("cli",))
#: The most lines a module may have: a longer one does more than one job.
MAX_MODULE_LINES = 450
#: Entry points above every layer (the lazy facade imports nothing at import time; ``python -m shardkit``).
ENTRY_POINTS = {"shardkit", "shardkit.__main__", "shardkit._facade"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SOURCE.rglob("*.py")}


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES]
    return found + ([target] if len(found) < len(node.names) else [])


def imports_of(module: str) -> set[str]:
    """Every shardkit module ``module`` imports, anywhere in it (functions too, not TYPE_CHECKING blocks)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= set(_resolve(module, path.name == "__init__.py", node))
    return {m for m in found if m.split(".")[0] == "shardkit" and m in MODULES and m != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (SOURCE / parts[1]).is_dir() else module


def _layer(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES if m not in ENTRY_POINTS}
    assert packages == {p for names in LAYERS for p in names}


def test_imports_run_one_way_along_the_flow():
    wrong = []
    for module, imported in GRAPH.items():
        if module in ENTRY_POINTS:
            continue
        here = _package(module)
        for target in imported:
            there = _package(target)
            if there != here and (target in ENTRY_POINTS or _layer(there) >= _layer(here)):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the flow " + str([" -> ".join(n for n in LAYERS)]) + ":\n" + "\n".join(wrong)


def test_no_import_cycles_between_modules():
    cycles = []
    for start in GRAPH:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for target in GRAPH[node]:
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles))[:20])


def _documented_dependencies() -> dict[str, set[str]]:
    """The "imports" column of docs/architecture.md's package table."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        match = re.match(r"\|\s*`(\w+)/`\s*\|.*\|\s*([^|]*)\|\s*$", line)
        if match:
            rows[match.group(1)] = {d for d in re.findall(r"\w+", match.group(2)) if d != "none"}
    return rows


def test_architecture_doc_states_the_real_dependencies():
    actual: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        if module in ENTRY_POINTS:
            continue
        actual.setdefault(_package(module), set()).update(_package(t) for t in imported)
    actual = {package: deps - {package} for package, deps in actual.items()}
    assert _documented_dependencies() == actual


def test_no_module_is_longer_than_the_limit():
    long = {str(path.relative_to(SOURCE.parent)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"
