"""The package is layered: no module imports one above it in the order the README shows, and no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import headwise

ROOT = Path(headwise.__file__).parent

# The README's layer order (Architecture), lowest first. A module may import its own layer or lower ones.
LAYERS = [
    {"config"},                                                 # leaves
    {"masks", "rotary", "kv_cache", "checkpoint", "validation", "buffers"},  # leaves over the config
    {"plan"},                                                   # planning
    {"functional", "dispatch", "projections"},                  # the math; the plan in words
    {"chunking"},                                               # long forwards, on tensors and callables
    {"head"},                                                   # one head
    {"attention"},                                              # the layer
    {"interop", "parallel", "analysis", "viz", "checks", "presets", "walkthrough", "trace",
     "patching", "surgery", "decoding"},                                    # built on the layer
    {"cli", "__main__"},                                        # the command line
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(path: Path) -> str:
    """The layer unit of a module: its top-level name inside the package (a subpackage counts as one)."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """Top-level headwise units this file imports (module level, inside functions and under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(ROOT).parent.parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = list(pkg[: len(pkg) - (node.level - 1)]) if node.level > 1 else list(pkg)
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    found.add(parts[0])
                else:  # "from . import x, y"
                    found.update(alias.name for alias in node.names)
            elif node.module and node.module.split(".")[0] == "headwise":
                parts = node.module.split(".")[1:]
                found.update([parts[0]] if parts else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "headwise" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _files():
    return [p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT]


def test_every_module_has_a_layer():
    units = {_unit(p) for p in _files()}
    assert units <= set(RANK), f"modules missing from the layer order: {sorted(units - set(RANK))}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in _files():
        unit = _unit(path)
        for imported in _imports(path) - {unit}:
            if imported in RANK and RANK[imported] > RANK[unit]:
                upward.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not upward, upward


def test_no_import_cycles_between_top_level_units():
    graph: dict[str, set[str]] = {}
    for path in _files():
        unit = _unit(path)
        graph.setdefault(unit, set()).update(i for i in _imports(path) - {unit} if i in RANK)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [])


def test_no_module_calls_another_modules_private_names():
    offenders = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("headwise")):
                offenders += [f"{path.relative_to(ROOT)}: {alias.name}" for alias in node.names
                              if alias.name.startswith("_") and alias.name != "__version__"]
    assert not offenders, offenders
