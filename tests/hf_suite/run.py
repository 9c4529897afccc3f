"""Run Hugging Face's own model tests with headwise patched in, per family, and tabulate the results.

    python tests/hf_suite/run.py                      # every family, every kind (the docs table)
    python tests/hf_suite/run.py --families opt phi --kinds save_load
    python tests/hf_suite/run.py --unpatched ...      # the same tests without headwise (HEADWISE_HF=off)
    python tests/hf_suite/run.py --write-docs         # also write the table into docs/interop_hf_tests.md

Each family's ``tests/models/<family>/test_modeling_<family>.py`` runs in its own pytest process (in the suite
:mod:`assemble` builds) with ``-k`` selecting the test kinds below; tests marked as needing the hub
(``hf-internal-testing``/integration tests) are deselected, never counted. Exit status 1 when any test failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from assemble import BUILD, REPO, assemble

FIRST = ["bert", "gpt2", "llama", "mistral", "qwen2", "qwen3"]
NEW = ["roberta", "distilbert", "albert", "electra", "gpt_neox", "gptj", "opt", "phi", "phi3", "gemma", "gemma2",
       "gemma3", "olmo", "olmo2", "granite", "cohere", "stablelm", "starcoder2", "smollm3", "mixtral", "qwen3_moe",
       "deepseek_v3", "t5", "bart", "whisper", "vit", "codegen"]
KINDS = {  # column -> pytest -k expression
    "eager_matches_sdpa": "test_eager_matches_sdpa",
    "attention_outputs": "test_attention_outputs",
    "batching_equivalence": "test_batching_equivalence",
    "save_load": "test_save_load",
    "generate": "test_greedy_generate or test_sample_generate or test_beam_search_generate or "
                "test_generate_continue_from_past_key_values or test_left_padding_compatibility",
    "training": "test_training",
}
# Integration tests load checkpoints from the hub: deselected (HF_HUB_OFFLINE=1 would fail them, not test us).
DESELECT = "not IntegrationTest and not integration and not slow"
# Failures explained in docs/interop_hf_tests.md: they count as failed in the table, but not in the exit status.
KNOWN: dict[str, str] = {}
DOC = REPO / "docs" / "interop_hf_tests.md"
START = "<!-- hf tests table: written by tests/hf_suite/run.py --write-docs -->"
END = "<!-- end of hf tests table -->"


def kind_of(name: str) -> str | None:
    for kind, expr in KINDS.items():
        if any(part.strip() in name for part in expr.split(" or ")):
            return kind
    return None


def run_family(tree: Path, family: str, kinds: list[str], patched: bool, timeout: int) -> dict[str, list[int]]:
    """{kind: [passed, failed, skipped]} for one family (a family whose run fails to start counts one failure)."""
    path = tree / "tests" / "models" / family / f"test_modeling_{family}.py"
    xml = BUILD / "results" / f"{family}-{'on' if patched else 'off'}.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    xml.unlink(missing_ok=True)
    expr = f"({' or '.join(KINDS[k] for k in kinds)}) and {DESELECT}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HEADWISE_HF="on" if patched else "off",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(Path(__file__).parent)]))
    cmd = [sys.executable, "-m", "pytest", "-q", str(path), "-k", expr, f"--junitxml={xml}",
           f"--timeout={timeout}", "-p", "no:randomly"]
    subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return counts_of(xml, kinds)


def counts_of(xml: Path, kinds: list[str]) -> dict[str, list[int]]:
    """{kind: [passed, failed, skipped]} from one family's junit xml (missing: one failure)."""
    counts = {k: [0, 0, 0] for k in kinds}
    if not xml.exists():
        counts[kinds[0]][1] += 1
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        kind = kind_of(case.get("name", ""))
        if kind not in counts:
            continue
        tags = {child.tag for child in case}
        column = 1 if tags & {"failure", "error"} else 2 if "skipped" in tags else 0
        counts[kind][column] += 1
    return counts


def table(results: dict[str, dict[str, list[int]]], kinds: list[str]) -> str:
    lines = ["| family | " + " | ".join(kinds) + " |", "| --- |" + " --- |" * len(kinds)]
    for family, counts in results.items():
        cells = [f"{p} / {f} / {s}" for p, f, s in (counts[k] for k in kinds)]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    totals = [[sum(r[k][i] for r in results.values()) for i in range(3)] for k in kinds]
    lines.append(f"| **all {len(results)}** | " + " | ".join(f"{p} / {f} / {s}" for p, f, s in totals) + " |")
    return "\n".join(lines)


def failures(family: str, patched: bool) -> list[str]:
    xml = BUILD / "results" / f"{family}-{'on' if patched else 'off'}.xml"
    if not xml.exists():
        return []
    return [case.get("name", "") for case in ET.parse(xml).getroot().iter("testcase")
            if {child.tag for child in case} & {"failure", "error"}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=FIRST + NEW)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--unpatched", action="store_true")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--skip-if-unavailable", action="store_true",
                        help="exit 0 with one line when the transformers sdist cannot be downloaded (CI without a registry)")
    parser.add_argument("--from-results", action="store_true",
                        help="tabulate the last run's results (build/hf_suite/results) instead of running")
    args = parser.parse_args(argv)
    try:
        tree = None if args.from_results else assemble()
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        if not args.skip_if_unavailable:
            raise
        print(f"hf-tests skipped: the transformers sdist could not be downloaded ({error})")
        return 0
    results, start = {}, time.perf_counter()
    for family in args.families:
        t = time.perf_counter()
        if tree is None:
            xml = BUILD / "results" / f"{family}-{'off' if args.unpatched else 'on'}.xml"
            results[family] = counts_of(xml, args.kinds)
        else:
            results[family] = run_family(tree, family, args.kinds, not args.unpatched, args.timeout)
        print(f"{family}: {results[family]} ({time.perf_counter() - t:.0f} s)", flush=True)
        for name in failures(family, not args.unpatched):
            print(f"  FAILED {name}", flush=True)
    text = table(results, args.kinds)
    print(text)
    print(f"{len(args.families)} families in {time.perf_counter() - start:.0f} s")
    if args.write_docs:
        doc = DOC.read_text()
        head, _, rest = doc.partition(START)
        _, _, tail = rest.partition(END)
        DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    unknown = [(f, n) for f in args.families for n in failures(f, not args.unpatched) if n not in KNOWN]
    for family, name in unknown:
        print(f"unexplained failure: {family} {name}")
    side = "off" if args.unpatched else "on"
    missing = [f for f in args.families if not (BUILD / "results" / f"{f}-{side}.xml").exists()]
    for family in missing:
        print(f"did not run: {family}")
    return 1 if unknown or missing else 0


if __name__ == "__main__":
    sys.exit(main())
