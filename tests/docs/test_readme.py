"""Every Python block of README.md and docs/*.md runs as written (each in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(doc, i, block) for doc in DOCS
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S))]


@pytest.mark.parametrize("doc, index, block", BLOCKS, ids=[f"{d.name}[{i}]" for d, i, _ in BLOCKS])
def test_python_block_runs(doc, index, block):
    exec(compile(block, f"{doc.name}[python block {index}]", "exec"), {"__name__": "docs"})
