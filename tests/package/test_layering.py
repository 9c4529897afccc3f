"""The package is layered: every import between two headwise modules goes down (or sideways within one
layer) in the order the README's architecture section shows, and no module imports itself back.

Every module counts on its own, inside subpackages too, and every import counts: at module level, inside
functions and under ``TYPE_CHECKING``. There is no exception list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import headwise

ROOT = Path(headwise.__file__).parent

# The README's layer order (Architecture), lowest first, by top-level unit (a module or a subpackage).
LAYERS = [
    {"config", "masks", "kv_cache", "kv_support", "module_calls", "rotary", "stored_weights"},  # leaves
    {"validation", "checkpoint"},                               # checks on the leaves
    {"plan"},                                                   # every decision, from sizes and flags
    {"functional", "dispatch"},                                 # the math; the plan in words
    {"call_plan", "chunking", "statistics", "token_step"},      # a call's plan; long forwards; statistics; one token
    {"head"},                                                   # one head
    {"attention"},                                              # the layer
    {"decoding", "presets", "walkthrough"},                     # built on the layer
    {"interop", "parallel"},                                    # the layer inside other code
    {"analysis", "tracing"},                                    # sizes and costs; every head of a model
    {"patching", "direct", "surgery", "checks", "viz"},         # built on traces
    {"cli", "__main__"},                                        # the command line
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> str:
    """``interop.hf`` for src/headwise/interop/hf.py; ``interop`` for its __init__.py."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py"}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The headwise modules ``path`` imports, each resolved to the most specific known module."""
    mod = _module(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "headwise":
                base = []
            else:
                continue
            target = base + (node.module.split(".") if node.module and node.level else
                             node.module.split(".")[1:] if node.module else [])
            for alias in node.names:  # "from .x import y": y may be a module of x
                names.add(".".join(target + [alias.name]) if ".".join(target + [alias.name]) in known
                          else ".".join(target))
        elif isinstance(node, ast.Import):
            names.update(".".join(a.name.split(".")[1:]) for a in node.names
                         if a.name.split(".")[0] == "headwise" and "." in a.name)
    resolved = set()
    for name in names - {"", mod}:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != mod:
            resolved.add(name)
    return resolved


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, set(modules)) for m, p in modules.items()}


def _unit(module: str) -> str:
    return module.split(".")[0]


def test_every_module_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert units <= set(RANK), f"modules missing from the layer order: {sorted(units - set(RANK))}"


def test_every_import_goes_down_or_sideways():
    upward = [f"{m} imports {i}" for m, imports in _graph().items() for i in imports
              if RANK[_unit(i)] > RANK[_unit(m)]]
    assert not upward, upward


def test_no_import_cycle_between_modules():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_no_module_calls_another_modules_private_names():
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("headwise")):
                offenders += [f"{module}: {alias.name}" for alias in node.names
                              if alias.name.startswith("_") and alias.name != "__version__"]
    assert not offenders, offenders


def test_no_module_replaces_its_own_class():
    swaps = [m for m, p in _modules().items() if "sys.modules[__name__].__class__" in p.read_text()]
    assert not swaps, swaps


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    # The rules above must be able to fail: a made-up pair of modules that import each other, one upward.
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = _graph()
    finally:
        ROOT = saved
    assert graph == {"a": {"b"}, "b": {"a"}}
