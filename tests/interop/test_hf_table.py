"""docs/interop_hf_families.md's table is what tests/interop/hf_sweep.py finds on the installed transformers.

``HEADWISE_WRITE_TABLE=1`` re-runs every model type of transformers' auto config mapping (minutes) and writes the
table. Otherwise (CI) the table must list exactly the installed mapping's model types, its summary must count
its own rows, and a fixed sample of rows is re-run and must come out as written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tests.interop import hf_sweep  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "interop_hf_families.md"
START = "<!-- family table: written by tests/interop/test_hf_table.py (HEADWISE_WRITE_TABLE=1) -->"
END = "<!-- end of family table -->"
SAMPLE = ["bert", "gpt2", "llama", "qwen3", "phi3", "gpt_neox", "opt", "mixtral", "deepseek_v3", "vit", "roberta", "gemma2", "dory",
          "t5"]


def summary(rows: list[dict[str, str]]) -> str:
    built = [r for r in rows if not r["patch"].startswith("not run")]
    patched = [r for r in built if r["patch"].startswith("yes")]
    return (f"{len(rows)} model types in transformers {transformers.__version__}'s auto config mapping; "
            f"{len(built)} built tiny and ran; `patch` took over {len(patched)}; outputs equal to the unpatched "
            f"model (float32) for **{sum(r['equal'] == 'yes' for r in rows)}**, at padded positions too for "
            f"{sum(r['padded'] == 'yes' for r in rows)} (of {sum(not r['padded'].startswith('n/a') for r in patched)} "
            f"with token inputs and a mask); trace "
            f"{sum(r['trace'] == 'yes' for r in rows)}, result {sum(r['result'] == 'yes' for r in rows)}, heads "
            f"{sum(r['heads'] == 'yes' for r in rows)}, surgery {sum(r['surgery'] == 'yes' for r in rows)}.")


def written() -> tuple[str, list[dict[str, str]]]:
    text = DOC.read_text()
    block = text[text.index(START) + len(START):text.index(END)].strip().splitlines()
    lines = [line for line in block if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(header) == hf_sweep.COLUMNS
    rows = [dict(zip(header, (c.strip() for c in line.strip()[1:-1].split(" | ")))) for line in lines[1:]]
    count = next(line for line in block if not line.startswith("|") and line.strip())
    return count, rows


@pytest.mark.skipif(os.environ.get("HEADWISE_WRITE_TABLE") != "1", reason="writes the table: HEADWISE_WRITE_TABLE=1")
def test_write_the_table():
    rows = hf_sweep.all_rows()
    text = DOC.read_text()
    block = f"{START}\n\n{summary(rows)}\n\n{hf_sweep.markdown(rows)}\n\n{END}"
    DOC.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S))


def test_the_table_lists_every_model_type_of_the_installed_mapping_and_counts_itself():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    count, rows = written()
    assert [r["model_type"] for r in rows] == sorted(CONFIG_MAPPING_NAMES)
    assert count == summary(rows)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_a_row_of_the_table_comes_out_as_written(model_type):
    transformers.logging.set_verbosity_error()
    rows = {r["model_type"]: r for r in written()[1]}
    assert hf_sweep.row(model_type) == rows[model_type]
