"""The modules of headwise.checks depend on each other one way: no import cycle, function-level imports
included (read from the source with ast, so a lazy import counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import headwise.checks

PACKAGE = Path(headwise.checks.__file__).parent


def imports_within_checks(path: Path) -> set[str]:
    """The sibling modules that ``path`` imports anywhere (``from .x import``, ``from . import x``)."""
    siblings = {p.stem for p in PACKAGE.glob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out.update(n.split(".")[0] for n in names if n.split(".")[0] in siblings)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("headwise.checks."):
            out.add(node.module.split(".")[2])
    return out - {"__init__", path.stem}


def test_no_import_cycle_among_the_check_modules():
    graph = {p.stem: imports_within_checks(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert "adapters" in graph["hf_adapter"] and "properties" in graph["run"]  # the graph is really read

    def cycle_from(node, path):
        for nxt in graph.get(node, ()):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return None

    for start in graph:
        assert cycle_from(start, [start]) is None, f"import cycle: {' -> '.join(cycle_from(start, [start]))}"
