"""Sweep cases of a researcher's day (see sweep_harness for the outcomes): model inputs as users have them (a
tokenizer's BatchEncoding, any Mapping), models left in training mode, metrics of the wrong kind, progress
arguments, original head numbers after surgery, AutoModel* reloads, galleries and token labels, and the
CLI's negative layers. Each case that should work is checked against an independent reference: the dict
form of the same inputs, the eval-mode model, hooks on the unchanged model, or the formula."""

from __future__ import annotations

import copy
import types

import torch
import transformers
from torch import nn

import headwise
from headwise.patching import attribution, head_effects
from headwise.surgery import (ablation_importance, gradient_importance, load_pretrained, original_heads, prune_heads,
                              save_pretrained)
from headwise.viz.maps import head_gallery, model_head_maps, model_layers_head_maps
from headwise.viz.png import save_png
from tests.interop.tiny_models import build as tiny
from tests.interop.tiny_models import inputs, output
from tests.robustness.sweep_harness import Case, Setup, close
from tests.robustness.sweep_models import cli

CASES: list[Case] = []


def refuse(id, build, xfail=None):
    CASES.append(Case(id, build, works=False, xfail=xfail))


def works(id, build, xfail=None):
    CASES.append(Case(id, build, works=True, xfail=xfail))


def metric(out):
    """A few output channels (a LayerNorm'd output's mean square alone would hardly move)."""
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return hidden[..., :3].pow(2).sum() + hidden[..., 0].sum()


def pair(model):
    clean = inputs(seed=1)
    return clean, {**clean, "input_ids": inputs(seed=2)["input_ids"]}


SWEEPS = {
    "head_effects": lambda m, c, x: head_effects(m, c, x, metric),
    "attribution": lambda m, c, x: attribution(m, c, x, metric),
    "ablation_importance": lambda m, c, x: ablation_importance(m, c, metric),
    "gradient_importance": lambda m, c, x: gradient_importance(m, [c, x], metric),
}


# -- inputs as users have them ------------------------------------------------------------------------------
def _as(wrap, name, family):
    def build(tmp):
        model = headwise.interop.patch(tiny(family))
        clean, bad = pair(model)
        want = SWEEPS[name](model, clean, bad)
        return Setup(lambda: SWEEPS[name](model, wrap(clean), wrap(bad)), [model],
                     lambda got: torch.testing.assert_close(got, want, rtol=0, atol=0))
    return build


for name, family in [("head_effects", "bert"), ("attribution", "llama"), ("ablation_importance", "gpt2"),
                     ("gradient_importance", "qwen3")]:
    works(f"inputs BatchEncoding {name} {family}", _as(transformers.BatchEncoding, name, family))
    works(f"inputs MappingProxy {name} {family}", _as(types.MappingProxyType, name, family))


def _masked_metric(tmp):
    """metric(output, inputs) gets the run's inputs: the same as a closure over the corrupted mask."""
    model = headwise.interop.patch(tiny("bert"))
    clean, bad = pair(model)

    def pooled(out, kw):
        mask = kw["attention_mask"][..., None].float()
        return ((out.last_hidden_state * mask).sum(1) / mask.sum(1))[:, :3].pow(2).sum()

    want = head_effects(model, clean, bad, lambda out: pooled(out, bad))
    return Setup(lambda: head_effects(model, transformers.BatchEncoding(clean), transformers.BatchEncoding(bad),
                                      pooled), [model], lambda got: torch.testing.assert_close(got, want))


works("inputs metric of the inputs", _masked_metric)


def _refused(call, family="bert"):
    def build(tmp):
        model = headwise.interop.patch(tiny(family))
        clean, bad = pair(model)
        return Setup(lambda: call(model, clean, bad), [model])
    return build


for name, call in {
    "head_effects inputs a str": lambda m, c, x: head_effects(m, "a text", "a text", metric),
    "head_effects mapping with int keys": lambda m, c, x: head_effects(m, {0: c["input_ids"]}, {0: x["input_ids"]},
                                                                       metric),
    "head_effects metric of 3 arguments": lambda m, c, x: head_effects(m, c, x, lambda o, i, j: metric(o)),
    "head_effects metric 5": lambda m, c, x: head_effects(m, c, x, 5),
    "head_effects progress 'yes'": lambda m, c, x: head_effects(m, c, x, metric, progress="yes"),
    "gradient_importance metric a float": lambda m, c, x: gradient_importance(m, c,
                                                                              lambda o: float(metric(o).detach())),
    "gradient_importance metric detached": lambda m, c, x: gradient_importance(m, c, lambda o: metric(o).detach()),
    "gradient_importance progress 1": lambda m, c, x: gradient_importance(m, c, metric, progress=1),
    "attribution metric .item()": lambda m, c, x: attribution(m, c, x, lambda o: metric(o).item()),
    "ablation_importance a batch of text": lambda m, c, x: ablation_importance(m, [c, "text"], metric),
}.items():
    refuse(f"research {name}", _refused(call))


# -- training mode ------------------------------------------------------------------------------------------
def _train_mode(name):
    def build(tmp):
        model = headwise.interop.patch(tiny("bert", hidden_dropout_prob=0.4, attention_probs_dropout_prob=0.4))
        clean, bad = pair(model)
        want = SWEEPS[name](model, clean, bad)  # in eval mode (tiny builds it so)
        model.train()

        def check(got):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert all(m.training for m in model.modules()), "the training mode was not given back"
        return Setup(lambda: SWEEPS[name](model, clean, bad), [], check)
    return build


for name in SWEEPS:
    works(f"train mode {name} equals eval", _train_mode(name))


# -- original head numbers, reloads ---------------------------------------------------------------------------
def _two_rounds(tmp):
    model = headwise.interop.patch(tiny("llama"))
    kw = inputs()
    unchanged = copy.deepcopy(model)
    with torch.no_grad(), headwise.trace(unchanged, capture=("z",)) as t:
        unchanged(**kw)
    before = t[1].z

    def run():
        prune_heads(model, {1: [1, 4]})
        prune_heads(model, {1: [0]})
        return original_heads(model)

    def check(got):
        assert got == [tuple(range(6)), (2, 3, 5)], got
        with torch.no_grad(), headwise.trace(model, capture=("z",)) as now:
            model(**kw)
        close(now[1].z, before[:, :, [2, 3, 5]].double())  # layer 0 unchanged: same input to layer 1
    return Setup(run, [], check)


works("surgery.original heads after two rounds", _two_rounds)
refuse("surgery.original_heads of 5", lambda tmp: Setup(lambda: original_heads(5)))
refuse("surgery.original_heads of nn.Linear", lambda tmp: Setup(lambda: original_heads(nn.Linear(2, 2))))


def _auto(cls, family="llama"):
    def build(tmp):
        model = headwise.interop.patch(tiny(family))
        prune_heads(model, {0: [1]})
        save_pretrained(model, tmp / "m")
        kw = inputs()
        base = model.base_model if cls is transformers.AutoModel else model

        def check(loaded):
            close(output(loaded, kw), output(base, kw).double())
            assert original_heads(headwise.interop.patch(loaded))[0] == (0, 2, 3, 4, 5)
        return Setup(lambda: load_pretrained(tmp / "m", cls), [tmp / "m"], check)
    return build


works("surgery.load AutoModel of a causal LM", _auto(transformers.AutoModel))
works("surgery.load AutoModelForCausalLM", _auto(transformers.AutoModelForCausalLM))
refuse("surgery.load AutoModelForImageClassification", _auto(transformers.AutoModelForImageClassification))


def _no_sidecar(tmp):
    model = headwise.interop.patch(tiny("bert"))
    prune_heads(model, {0: [1]})
    headwise.interop.unpatch(model).save_pretrained(tmp / "m")  # transformers' own save: no sidecar
    return Setup(lambda: load_pretrained(tmp / "m", transformers.BertModel), [tmp / "m"])


refuse("surgery.load pruned weights without a sidecar", _no_sidecar)


# -- pictures -------------------------------------------------------------------------------------------------
def _maps(call, check=None, family="gpt2"):
    def build(tmp):
        model = tiny(family)
        return Setup(lambda: call(model, inputs()), [model], check and (lambda got: check(model, got)))
    return build


def _last_layer(model, got):
    want = model_head_maps(model, inputs(), layer=1)
    torch.testing.assert_close(got.weights, want.weights, rtol=0, atol=0)
    assert got.layer == 1 and got.tokens == [str(i) for i in inputs()["input_ids"][0].tolist()]


def _gallery_rows(model, got):
    layers = model_layers_head_maps(model, inputs())
    torch.testing.assert_close(got.weights, torch.stack([layers[1].weights[2], layers[0].weights[0]]), rtol=0, atol=0)
    assert got.names == ["L1 H2", "L0 H0"]


works("viz.model_head_maps layer -1", _maps(lambda m, kw: model_head_maps(m, transformers.BatchEncoding(kw),
                                                                          layer=-1), _last_layer))
works("viz.head_gallery ok", _maps(lambda m, kw: head_gallery(m, kw, [(-1, 2), (0, 0)]), _gallery_rows))
for name, call in {
    "model_head_maps layer -3": lambda m, kw: model_head_maps(m, kw, layer=-3),
    "model_head_maps row 2": lambda m, kw: model_head_maps(m, kw, layer=0, row=2),
    "model_head_maps tokens too few": lambda m, kw: model_head_maps(m, kw, layer=0, tokens=["a"]),
    "model_head_maps inputs a str": lambda m, kw: model_head_maps(m, "a text", layer=0),
    "head_gallery pair twice": lambda m, kw: head_gallery(m, kw, [(0, 1), (-2, 1)]),
    "head_gallery head 9": lambda m, kw: head_gallery(m, kw, [(0, 9)]),
    "head_gallery pairs 'L0H1'": lambda m, kw: head_gallery(m, kw, "L0H1"),
    "head_gallery no pairs": lambda m, kw: head_gallery(m, kw, []),
}.items():
    refuse(f"viz.{name}", _maps(call))


def _mixed_picture(tmp):
    model = tiny("gpt2")
    gallery = head_gallery(model, inputs(), [(0, 1)])
    layer = model_head_maps(model, inputs(), layer=0)
    return Setup(lambda: save_png([gallery, layer], tmp / "x.png"), [tmp])


refuse("viz.save_png a gallery among layers", _mixed_picture)

# -- the CLI ------------------------------------------------------------------------------------------------
T = "The cat sat."
refuse("cli heads layer -7", cli(["heads", T, "--layer", "-7"]))


def _cli_last_layer(tmp):
    setup = cli(["heads", T, "--layer", "-1", "--json"], expect_ok=True)(tmp)
    want = cli(["heads", T, "--layer", "5", "--json"], expect_ok=True)(tmp).call()
    return Setup(setup.call, setup.watch, lambda got: _same_text(got, want))


def _same_text(got, want):
    assert got == want, "--layer -1 did not draw layer 5"


works("cli heads layer -1 is the last layer", _cli_last_layer)
