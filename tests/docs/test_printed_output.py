"""A ```text block right after a ```python block of README.md or docs/*.md is that block's printed output:
the block runs (in a fresh namespace) and what it prints must equal the text block, so that a doc's quoted
output cannot drift from the code. Output that cannot repeat (timings) is exempted by writing
``<!-- output not checked: why -->`` between the two blocks."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
# Between a python block and its output: blank lines, or the exemption comment.
BETWEEN = re.compile(r"\s*(<!-- output not checked:[^\n]*-->\s*)?")


def _pairs() -> list[tuple[str, str, str, bool]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        blocks = list(BLOCK.finditer(text))
        for code, after in zip(blocks, blocks[1:]):
            between = BETWEEN.fullmatch(text, code.end(), after.start())
            if code.group(1) == "python" and after.group(1) == "text" and between:
                line = text.count("\n", 0, code.start()) + 1
                out.append((f"{doc.name}:{line}", code.group(2), after.group(2), between.group(1) is not None))
    return out


PAIRS = _pairs()


@pytest.mark.parametrize("where, code, expected, exempt", PAIRS, ids=[p[0] for p in PAIRS])
def test_printed_output_matches_the_text_block_after_it(where, code, expected, exempt):
    if exempt:
        pytest.skip(f"{where}: output marked as not checked")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"{where} (python block)", "exec"), {"__name__": "docs"})
    assert printed.getvalue().rstrip("\n").splitlines() == expected.rstrip("\n").splitlines()


def test_the_output_blocks_of_the_parallel_docs_are_checked():
    assert sum(where.startswith("parallel.md:") for where, *_ in PAIRS) >= 2
