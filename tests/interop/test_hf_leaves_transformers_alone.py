"""headwise changes nothing of transformers behind the user's back: importing it, patching models, running,
tracing and unpatching them leaves every class, function and attribute of every loaded transformers module the
very object it was (only the public registries gain the name "headwise"); and no module of src/ imports a
private transformers name or reads modeling source.

The peer is transformers itself, snapshotted in a fresh process before headwise is imported.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[2] / "src" / "headwise"

SCRIPT = r'''
import json, sys, torch, transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

def tiny(model_type, impl, cls=AutoModelForCausalLM, **kw):
    base = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, n_embd=16, n_head=4, n_layer=2)
    cfg = AutoConfig.for_model(model_type, **{**base, **kw})
    return cls.from_config(cfg, attn_implementation=impl).eval()

models = [tiny("llama", "sdpa"), tiny("gpt2", "eager"), tiny("bert", "sdpa", AutoModel), tiny("qwen3", "sdpa"),
          tiny("gemma2", "eager", head_dim=4, query_pre_attn_scalar=4)]

import copy
for model in models:  # what transformers and Python cache on a class on first use, warmed through public calls
    type(model)._can_set_attn_implementation()  # cached on the class by any caller's first switch of implementation
    copy.deepcopy(model.config)  # copyreg caches __slotnames__

def snapshot():
    seen, classes = {}, {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("transformers") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            seen[f"{name}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__.startswith("transformers") and id(value) not in classes:
                classes[id(value)] = (f"{value.__module__}.{value.__qualname__}",
                                      {k: id(v) for k, v in vars(value).items()})
    return seen, classes

keep = snapshot()  # the objects stay alive (referenced by their modules), so ids stay meaningful
before, classes_before = keep
import headwise, headwise.interop
from headwise.interop import layers, patch, unpatch
if "tamper" in sys.argv:  # what the snapshot must catch: one replaced method of one transformers class
    transformers.PreTrainedConfig.validate_output_attentions = lambda self: None
ids = torch.tensor([[1, 5, 7, 3], [2, 4, 6, 8]])
mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
for model in models:
    patch(model)
    with torch.no_grad(), headwise.trace(model, capture=("z", "pattern"), edit={(0, 1): "zero"}):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    headwise.check(layers(model)[0][1])
    unpatch(model)
after, classes_after = snapshot()
changed = [k for k, v in before.items() if after.get(k) != v]
grown = [f"{classes_before[i][0]}: {sorted(set(classes_after[i][1]) - set(classes_before[i][1]))}"
         for i in classes_before if set(classes_after[i][1]) - set(classes_before[i][1])]
replaced = [f"{classes_before[i][0]}.{k}" for i in classes_before for k, v in classes_before[i][1].items()
            if classes_after[i][1].get(k) != v]
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
print(json.dumps({"changed": changed, "grown": grown, "replaced": replaced, "modules": len(before),
                  "classes": len(classes_before),
                  "registered": [sorted(AttentionInterface._global_mapping).count("headwise"),
                                 sorted(AttentionMaskInterface._global_mapping).count("headwise")]}))
'''


def run(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": str(SRC.parent)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_patching_tracing_and_unpatching_leave_every_transformers_object_as_it_was():
    report = run()
    assert report["modules"] > 1000 and report["classes"] > 500  # the snapshot really covers transformers
    assert report["changed"] == [], report["changed"][:20]  # every module attribute: the same object
    assert report["replaced"] == [], report["replaced"][:20]  # every class attribute: the same object
    assert report["grown"] == [], "\n".join(report["grown"])  # and no class gained one
    assert report["registered"] == [1, 1]  # the one change: "headwise" in the public registries


def test_the_snapshot_sees_a_replaced_method():
    report = run("tamper")
    assert report["replaced"] == ["transformers.configuration_utils.PreTrainedConfig.validate_output_attentions"]


def _transformers_names(path: Path) -> list[str]:
    """Every transformers name ``path`` imports, dotted (``transformers.x.y.Name``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "transformers"]
    return names


def test_no_module_of_src_imports_a_private_transformers_name_or_reads_source():
    imported = {str(p.relative_to(SRC)): _transformers_names(p) for p in SRC.rglob("*.py")}
    assert sum(map(len, imported.values())) > 10  # the scan sees the imports there are
    private = [f"{f}: {n}" for f, names in imported.items() for n in names
               if any(part.startswith("_") for part in n.split("."))]
    assert private == []
    readers = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "getsource" in p.read_text()]
    assert readers == []  # no module reads source text (transformers' or anyone's)


def test_the_private_import_scan_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from transformers.utils.output_capturing import _active_collector\n"
                   "import transformers.models._private\n")
    assert _transformers_names(bad) == ["transformers.utils.output_capturing._active_collector",
                                        "transformers.models._private"]
