"""Sweeps, scores and pictures are never silently random: a model left in training mode (dropout on, as its
constructor leaves it) gives exactly the eval-mode numbers, and every module's own mode comes back after the
call (mixed modes included), also when the call fails."""

from __future__ import annotations

import pytest
import torch

from headwise.patching import attribution, direct_effects, final_norm, head_effects, logit_direction
from headwise.surgery import ablation_importance, gradient_importance

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from headwise.viz.maps import model_layers_head_maps  # noqa: E402
from tests import hf_reference as ref  # noqa: E402

DROPOUT = {"bert": dict(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3),
           "gpt2": dict(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3),
           "llama": dict(attention_dropout=0.3)}


def dropping(family):
    """The family's tiny model with heavy dropout, patched, in training mode (as from its constructor)."""
    model = ref.BUILDERS[family]("sdpa")
    cfg = model.config
    for key, value in DROPOUT[family].items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = type(model)(cfg)  # rebuilt: the dropout modules read their rates at construction
    return patch(model).train()


def metric(out):
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return hidden[..., :3].pow(2).sum() + hidden[..., 0].sum()


CALLS = {
    "head_effects": lambda m, c, x: head_effects(m, c, x, metric),
    "attribution": lambda m, c, x: attribution(m, c, x, metric),
    "ablation_importance": lambda m, c, x: ablation_importance(m, c, metric),
    "gradient_importance": lambda m, c, x: gradient_importance(m, [c, x], metric),
    "maps": lambda m, c, x: torch.stack([mp.weights for mp in model_layers_head_maps(m, c, row=1)]),
}


@pytest.mark.parametrize("family", list(DROPOUT))
@pytest.mark.parametrize("name", list(CALLS))
def test_training_mode_gives_the_eval_numbers_and_keeps_the_mode(family, name):
    model = dropping(family)
    clean = ref.inputs(model, seed=1)
    corrupted = {**clean, "input_ids": ref.inputs(model, seed=2)["input_ids"]}
    with torch.no_grad():  # dropout really is on: two plain forwards differ
        a, b = metric(model(**clean)), metric(model(**clean))
    assert not torch.equal(a, b)
    mixed = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)] or list(model.modules())
    mixed[0 if isinstance(mixed[0], torch.nn.Dropout) else -1].eval()  # a mixed model: one module already in eval
    modes = {n: m.training for n, m in model.named_modules()}
    got = CALLS[name](model, clean, corrupted)
    assert {n: m.training for n, m in model.named_modules()} == modes  # every module's own mode back
    model.eval()
    want = CALLS[name](model, clean, corrupted)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool(torch.isfinite(want).all()) and want.abs().max() > 1e-6


def test_direct_effects_in_training_mode_are_the_eval_numbers():
    model = dropping("gpt2")
    kw = ref.inputs(model, pad=False)
    direction = logit_direction(model, 7, 11)
    got = direct_effects(model, kw, direction, norm=final_norm(model))
    assert model.training
    want = direct_effects(model.eval(), kw, direction, norm=final_norm(model))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_mode_comes_back_when_the_call_fails():
    model = dropping("bert")
    kw = ref.inputs(model)
    with pytest.raises(ValueError, match="one floating number"):
        ablation_importance(model, kw, lambda out: out.last_hidden_state.sum(-1))  # not a scalar
    assert all(m.training for m in model.modules())
