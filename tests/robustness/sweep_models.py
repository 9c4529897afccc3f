"""Sweep cases that need models or processes: surgery (and its files), interop.patch, headwise.check and the
CLI (see sweep_harness for the outcomes)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import transformers
from torch import nn

import headwise
from headwise.cli import main as cli_main
from headwise.interop import from_hf, patch, to_hf, unpatch
from headwise.surgery import load_pretrained, prune_heads, save_pretrained, to_gqa, to_mha
from tests.interop.tiny_models import build as tiny
from tests.interop.tiny_models import inputs, output
from tests.reference import reference_mha
from tests.robustness.sweep_core import layer, xs
from tests.robustness.sweep_harness import Case, Setup, close
from tests.robustness.sweep_tools import z_edit_reference

CASES: list[Case] = []
ROOT = Path(__file__).resolve().parents[2]


def refuse(id, build, xfail=None):
    CASES.append(Case(id, build, works=False, xfail=xfail))


def works(id, build, xfail=None):
    CASES.append(Case(id, build, works=True, xfail=xfail))


# -- surgery on layers and models ---------------------------------------------------------------------------
def on_layer(fn, **kw):
    def build(tmp):
        a = layer(**kw)
        return Setup(lambda: fn(a), [a])
    return build


def on_model(fn, family="llama", patched=True):
    def build(tmp):
        m = tiny(family)
        if patched:
            patch(m)
        return Setup(lambda: fn(m), [m])
    return build


for name, fn in {
    "prune [99]": lambda a: prune_heads(a, [99]), "prune [-1]": lambda a: prune_heads(a, [-1]),
    "prune ['0']": lambda a: prune_heads(a, ["0"]), "prune [0.0]": lambda a: prune_heads(a, [0.0]),
    "prune [0, 0]": lambda a: prune_heads(a, [0, 0]), "prune {5: [0]}": lambda a: prune_heads(a, {5: [0]}),
    "prune {'nope': [0]}": lambda a: prune_heads(a, {"nope": [0]}), "prune regroup 'yes'": lambda a: prune_heads(a, [0], regroup="yes"),
    "prune 'abc'": lambda a: prune_heads(a, "abc"), "to_gqa 3": lambda a: to_gqa(a, 3), "to_gqa 0": lambda a: to_gqa(a, 0),
    "to_gqa '2'": lambda a: to_gqa(a, "2"), "to_gqa 2.0": lambda a: to_gqa(a, 2.0),
    "to_gqa groups 'random'": lambda a: to_gqa(a, 2, groups="random"),
    "to_gqa groups unequal": lambda a: to_gqa(a, 2, groups=[[0, 1, 2], [3]]),
    "to_gqa groups float": lambda a: to_gqa(a, 2, groups=[[0.0, 1.0], [2.0, 3.0]]),
    "to_gqa groups missing head": lambda a: to_gqa(a, 2, groups=[[0, 1], [2, 2]]),
    "to_gqa layers [5]": lambda a: to_gqa(a, 2, layers=[5]), "to_mha layers 'x'": lambda a: to_mha(a, layers="x"),
}.items():
    refuse(f"surgery.{name}", on_layer(fn, n_kv_heads=None),
           None if name == "to_gqa groups float" else None)
refuse("surgery.prune of 5", lambda tmp: Setup(lambda: prune_heads(5, [0])))
refuse("surgery.prune of nn.Linear", lambda tmp: Setup(lambda: prune_heads(nn.Linear(2, 2), [0])))
refuse("surgery.to_gqa of patched GPT-2", on_model(lambda m: to_gqa(m, 1), "gpt2"))
refuse("surgery.prune patched llama head 9", on_model(lambda m: prune_heads(m, {0: [9]})))
refuse("surgery.prune patched view", on_model(lambda m: prune_heads(m.model.layers[0].self_attn.attn, [0])))


def _same_copy(fn, **kw):
    def build(tmp):
        a, x = layer(**kw), xs()
        return Setup(lambda: fn(a), [], lambda c: (_not_same(c, a), close(c(x), reference_mha(a, x)[0])))
    return build


def _not_same(c, a):
    assert c is not a, "returned the input object, not the copy the docs promise"


works("surgery.prune [] ok copy", _same_copy(lambda a: prune_heads(a, [])), None)
works("surgery.to_mha of MHA ok copy", _same_copy(to_mha, n_kv_heads=None),
      None)


def _prune_ok(tmp):
    a, x = layer(), xs()
    return Setup(lambda: prune_heads(a, [1])(x), [], lambda y: close(y, z_edit_reference(a, x, [1, 0, 1, 1])))


works("surgery.prune ok equals zero ablation", _prune_ok)


# -- surgery files: a saved tiny Llama, tampered --------------------------------------------------------------
_SAVED: dict[str, Path] = {}


def saved(tmp: Path) -> Path:
    """A copy (in tmp) of one pruned tiny Llama folder written by save_pretrained."""
    if "llama" not in _SAVED:
        import tempfile
        src = Path(tempfile.mkdtemp(prefix="sweep-llama-"))
        model = patch(tiny("llama"))
        prune_heads(model, {0: [0, 1, 2]})
        save_pretrained(model, src)
        _SAVED["llama"] = src
    dst = tmp / "saved"
    shutil.copytree(_SAVED["llama"], dst)
    return dst


def tampered(edit):
    def build(tmp):
        d = saved(tmp)
        edit(d)
        return Setup(lambda: load_pretrained(d, transformers.LlamaForCausalLM), [d])
    return build


def sidecar(change):
    def edit(d):
        p = d / "headwise_surgery.json"
        data = json.loads(p.read_text())
        change(data)
        p.write_text(json.dumps(data))
    return edit


def first(data):
    return data["modules"][next(iter(data["modules"]))]


IO_XFAIL = None
for name, edit, bad in [
    ("sidecar not json", lambda d: (d / "headwise_surgery.json").write_text("{"), False),
    ("sidecar a list", lambda d: (d / "headwise_surgery.json").write_text("[]"), False),
    ("sidecar format 3", sidecar(lambda s: s.update(format=3)), False),
    ("sidecar format 1", sidecar(lambda s: s.update(format=1)), False),
    ("sidecar module 5", sidecar(lambda s: s["modules"].update({next(iter(s["modules"])): 5})), True),
    ("sidecar without d_head", sidecar(lambda s: first(s).pop("d_head")), True),
    ("sidecar n_heads '3'", sidecar(lambda s: first(s).update(n_heads="3")), False),
    ("sidecar n_heads 2**40", sidecar(lambda s: first(s).update(n_heads=2**40, n_kv_heads=1)), True),
    ("sidecar unknown module", sidecar(lambda s: s["modules"].update({"model.nope": first(s)})), False),
    ("weights garbage", lambda d: (d / "model.safetensors").write_bytes(b"garbage"), True),
    ("weights a directory", lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()), True),
    ("weights missing", lambda d: (d / "model.safetensors").unlink(), False),
    ("index names a shard outside", lambda d: ((d / "model.safetensors").rename(d.parent / "outside.safetensors"),
      (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))), True),
]:
    refuse(f"surgery.load {name}", tampered(edit), IO_XFAIL if bad else None)
refuse("surgery.load model_class int", lambda tmp: Setup(lambda: load_pretrained(tmp, int), [tmp]))
refuse("surgery.save of a bare layer", lambda tmp: Setup(lambda: save_pretrained(layer(), tmp), [tmp]))


# -- interop.patch ------------------------------------------------------------------------------------------
refuse("interop.patch 5", lambda tmp: Setup(lambda: patch(5)))
refuse("interop.patch nn.Linear", lambda tmp: Setup(lambda: patch(nn.Linear(2, 2))))
refuse("interop.patch an attention module", on_model(lambda m: patch(m.model.layers[0].self_attn), patched=False))
refuse("interop.patch flash attention", on_model(lambda m: (m.config.__setattr__("_attn_implementation", "flash_attention_2"),
                                                              patch(m)), patched=False))
refuse("interop.unpatch 5", lambda tmp: Setup(lambda: unpatch(5)))
refuse("interop.from_hf nn.Linear", lambda tmp: Setup(lambda: from_hf(nn.Linear(2, 2))))
refuse("interop.to_hf 5", on_model(lambda m: to_hf(5, m.model.layers[0].self_attn), patched=False))


def _patch_twice(tmp):
    m = tiny("llama")
    batch = inputs()
    ref = output(m, batch)
    return Setup(lambda: output(patch(patch(m)), batch), [], lambda y: close(y, ref.double()))


works("interop.patch ok twice", _patch_twice)


def _peft(tmp):
    import peft
    m = peft.get_peft_model(tiny("llama"), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=2))
    batch = inputs()
    ref = output(m, batch)
    return Setup(lambda: output(patch(m), batch), [], lambda y: close(y, ref.double()))


works("interop.patch after PEFT", _peft)


def _gemma2(tmp):  # runs eager: a query that may read nothing averages every value there, where sdpa gives zeros
    import torch
    cfg = transformers.AutoConfig.for_model("gemma2", vocab_size=40, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, query_pre_attn_scalar=256, pad_token_id=0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]]),
             "attention_mask": torch.tensor([[1] * 4, [0, 0, 1, 1]])}
    ref = m(**batch).logits.detach()  # every position, the padded ones too
    return Setup(lambda: patch(m)(**batch).logits.detach(), [], lambda y: close(y, ref.double()))


works("interop.patch gemma2 padded rows", _gemma2)


def _head_mask(shape):
    def build(tmp):
        import torch
        m = patch(tiny("llama"))
        return Setup(lambda: m(**inputs(), head_mask=torch.ones(shape)), [m])
    return build


refuse("interop.head_mask (3,) for 6 heads", _head_mask((3,)))
refuse("interop.head_mask (1, 6) for 2 layers", _head_mask((1, 6)))


def _meta_check(tmp):
    import torch
    with torch.device("meta"):
        m = tiny("llama")
    return Setup(lambda: headwise.check(m.model.layers[0].self_attn), [])


refuse("check meta module", _meta_check)


# -- headwise.check -----------------------------------------------------------------------------------------
C = headwise.check
for name, fn in {"check 5": lambda: C(5), "check d_model 0": lambda: C(layer(), d_model=0),
                 "check batch 0": lambda: C(layer(), batch=0), "check seq_len 1": lambda: C(layer(), seq_len=1),
                 "check property 'nope'": lambda: C(layer(), properties=["nope"]),
                 "check d_model 8 for 16": lambda: C(layer(), d_model=8)}.items():
    refuse(f"check.{name}", lambda tmp, fn=fn: Setup(fn))
for family in ("gpt2", "llama"):
    def build(tmp, family=family):
        m = patch(tiny(family))
        attn = m.transformer.h[0].attn if family == "gpt2" else m.model.layers[0].self_attn
        d = m.config.hidden_size if family == "llama" else m.config.n_embd
        return Setup(lambda: C(attn, d_model=d), [m], lambda rep: _ok(rep))
    works(f"check.ok patched {family} attention", build,
          None)


def _sliding(tmp):
    """A Mistral layer whose causal mask is a sliding window of 3 (8 tokens: the window and its cache slide)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=3)
    m = MistralForCausalLM(cfg).eval()
    return Setup(lambda: C(m.model.layers[0].self_attn, seq_len=8), [m], lambda rep: _ok(rep))


works("check.ok mistral sliding window", _sliding)


def _ok(rep):
    assert rep.ok, f"{rep.verdict}: {rep.failed}"


# -- the CLI ------------------------------------------------------------------------------------------------
UNFORESEEN = re.compile(r"error: [A-Z]\w*(Error|Exception)\b")


def cli(argv, expect_ok=False, inside=None, unclear=None):
    """``headwise.cli.main(argv)`` in-process: a refusal is exit 2 with one stderr line, no traceback."""
    def build(tmp):
        args = [a.format(tmp=tmp) for a in argv]
        if inside:
            inside(tmp)

        def run():
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(args)
            try:
                return _verdict(code, out.getvalue(), err.getvalue())
            except ValueError as exc:
                if unclear and unclear in str(exc):  # a refusal, but one that does not say what is wrong
                    raise AssertionError(f"unclear message: {exc}") from None
                raise
        return Setup(run, [tmp], (lambda r: None) if expect_ok else None)
    return build


def _verdict(code, out, err):
    lines = err.strip().splitlines()
    if code == 0:
        return out
    if code == 2 and len(lines) == 1 and "Traceback" not in err + out and not UNFORESEEN.search(lines[0]):
        raise ValueError(lines[0])
    raise RuntimeError(f"exit {code}, stderr {err[-300:]!r}")


T = "The cat sat."
for name, argv, xfail in [
    ("no arguments", [], None), ("unknown command", ["bogus"], None), ("tour seq 0", ["tour", "--seq", "0"], None),
    ("tour seq -5", ["tour", "--seq", "-5"], None), ("tour seq 1e3", ["tour", "--seq", "1e3"], None),
    ("explain n_heads 7", ["explain", "--d-model", "64", "--n-heads", "7"], None),
    ("explain dtype float17", ["explain", "--d-model", "64", "--n-heads", "8", "--dtype", "float17"], None),
    ("compare unknown preset", ["compare", "nope-preset"], None), ("compare seq x", ["compare", "--seq", "x"], None),
    ("heads text '-hello'", ["heads", "-hello"], None),
    ("heads layer 6", ["heads", T, "--layer", "6"], None), ("heads heads 3-1", ["heads", T, "--heads", "3-1"], None),
    ("heads heads a", ["heads", T, "--heads", "a"], None), ("heads max-tokens 0", ["heads", T, "--max-tokens", "0"], None),
    ("heads out .jpg", ["heads", T, "--out", "{tmp}/h.jpg"], None), ("heads model missing", ["heads", T, "--model", "{tmp}/nope"], None),
    ("heads model without config", ["heads", T, "--model", "{tmp}"], None),
    ("check no colon", ["check", "nomodule"], None), ("check missing module", ["check", "no.such.module:f"], None),
]:
    refuse(f"cli {name}", cli(argv, unclear="ignored explicit argument"), xfail)
works("cli --version", cli(["--version"], expect_ok=True), None)


def _subprocess_cli(argv_of, timeout=20):
    """``python -m headwise`` in a fresh process, for inputs that could block the test process (a FIFO)."""
    def build(tmp):
        argv = argv_of(tmp)

        def run():
            env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            try:
                p = subprocess.run([sys.executable, "-m", "headwise", *argv], capture_output=True, text=True,
                                   timeout=timeout, env=env, cwd=tmp)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"no answer within {timeout} s") from None
            return _verdict(p.returncode, p.stdout, p.stderr)
        return Setup(run, [tmp])
    return build


def _config_dir(tmp, config):
    d = tmp / "model"
    d.mkdir()
    if config == "fifo":
        os.mkfifo(d / "config.json")
    else:
        (d / "config.json").write_text(json.dumps(config))
    return ["heads", T, "--model", str(d)]


refuse("cli heads config.json a FIFO", _subprocess_cli(lambda tmp: _config_dir(tmp, "fifo"), timeout=5),
       None)
refuse("cli heads num_hidden_layers 1e9", _subprocess_cli(lambda tmp: _config_dir(tmp, {
    "model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 10**9,
    "intermediate_size": 8, "vocab_size": 10}), timeout=10))
