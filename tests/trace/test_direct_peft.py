"""direct_effects, logit_direction and final_norm on PEFT models (LoRA on lm_head and on the attention
projections): against float64 formulas from plain hooks on PEFT over the *unpatched* model, the adapters
merged by hand (``W + B A * scaling``) or by PEFT's ``merge_and_unload``."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from headwise.interop import patch  # noqa: E402
from headwise.patching import direct_effects, final_norm, logit_direction  # noqa: E402

from tests.interop.tiny_models import build, inputs  # noqa: E402

# PEFT asks transformers a deprecated question, and warns of the fan_in_fan_out it corrects itself; not ours.
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:fan_in_fan_out is set:UserWarning"),
              pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")]

TARGETS = {"llama": ["q_proj", "o_proj", "lm_head"], "gpt2": ["c_attn", "c_proj", "lm_head"]}
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}


def _lora(model, family, dropout=0.0, **kw):
    # init_lora_weights=False: B is random too, so every adapter changes what its projection applies
    cfg = peft.LoraConfig(target_modules=TARGETS[family], r=2, lora_alpha=4, lora_dropout=dropout,
                          init_lora_weights=False, fan_in_fan_out=family == "gpt2", **kw)
    torch.manual_seed(11)
    return peft.get_peft_model(model, cfg)


def _pair(family, **kw):
    """(PEFT on the unpatched model, PEFT on the patched one), the same adapters, float64."""
    base = build(family, **NO_DROPOUT.get(family, {})).double()
    plain = _lora(copy.deepcopy(base), family, **kw).double()
    ours = _lora(patch(copy.deepcopy(base)), family, **kw).double()
    ours.load_state_dict(plain.state_dict())
    return plain, ours


def _merged(wrapper):
    """A LoRA module's weight in nn.Linear order (out, in), merged by hand: W + B A * scaling."""
    w = wrapper.base_layer.weight
    w = w.T if type(wrapper.base_layer).__name__ == "Conv1D" else w
    return w + wrapper.lora_B["default"].weight @ wrapper.lora_A["default"].weight * wrapper.scaling["default"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_heads_and_the_rest_add_up_to_the_logit_difference_peft_computes(family):
    plain, ours = _pair(family)
    kw = inputs()
    pos, rows = torch.tensor([5, 3]), torch.arange(2)  # each row's last real token (row 1 is right-padded)
    good, bad = torch.tensor([7, 9]), torch.tensor([11, 4])
    direction = logit_direction(ours, good, bad)
    got = direct_effects(ours, kw, direction, norm=final_norm(ours), position=pos)

    # the reference: hooks on PEFT over the unpatched model, float64 formulas with the hand-merged weights
    inner = plain.get_base_model()
    attn = [b.attn for b in inner.transformer.h] if family == "gpt2" else [b.self_attn for b in inner.model.layers]
    w_o = [a.c_proj if family == "gpt2" else a.o_proj for a in attn]
    norm = inner.transformer.ln_f if family == "gpt2" else inner.model.norm
    seen, final = {}, []
    hooks = [m.register_forward_hook(lambda m, a, out, li=li: seen.__setitem__(li, (a[0], out)))
             for li, m in enumerate(w_o)]
    hooks.append(norm.register_forward_hook(lambda m, a, out: final.append((a[0], out))))
    with torch.no_grad():
        logits = plain(**kw).logits
    for hook in hooks:
        hook.remove()
    want_diff = logits[rows, pos, good] - logits[rows, pos, bad]
    w_u = _merged(inner.lm_head)
    torch.testing.assert_close(direction, w_u[good] - w_u[bad])

    x, y = (t[rows, pos] for t in final[-1])
    if family == "gpt2":  # LayerNorm: gamma * (r - mean r) / sigma, sigma frozen at x; then + beta
        sigma = (x.var(-1, unbiased=False) + norm.eps).sqrt()[:, None]
        frozen = lambda r: norm.weight * (r - r.mean(-1, keepdim=True)) / sigma  # noqa: E731
        beta = norm.bias
    else:  # RMSNorm: gamma * r / rms, rms frozen at x
        rms = (x.pow(2).mean(-1) + norm.variance_epsilon).sqrt()[:, None]
        frozen = lambda r: norm.weight * r / rms  # noqa: E731
        beta = torch.zeros_like(x[0])
    torch.testing.assert_close(frozen(x) + beta, y)  # the linearisation is exact for this run's own stream
    d = direction.double()
    n_heads = got.shape[2]
    heads_total = torch.zeros(2, dtype=torch.float64)
    for li in range(len(w_o)):
        z, out = (t[rows, pos] for t in seen[li])  # (b, h * d_h): W_O's input; (b, d): what the layer adds
        merged = _merged(w_o[li])  # (d, h * d_h)
        d_h = merged.shape[1] // n_heads
        want = torch.stack([(frozen(z[:, i * d_h:(i + 1) * d_h] @ merged[:, i * d_h:(i + 1) * d_h].T) * d).sum(-1)
                            for i in range(n_heads)], dim=1)  # (b, h)
        torch.testing.assert_close(got[:, li], want)
        bias = w_o[li].base_layer.bias if w_o[li].base_layer.bias is not None else torch.zeros_like(out[0])
        # the heads' parts add up to what the adapted W_O writes, less its bias
        torch.testing.assert_close(got[:, li].sum(-1), (frozen(out - bias) * d).sum(-1))
        heads_total += (frozen(bias) * d).sum(-1) - (frozen(out) * d).sum(-1)
    rest = (frozen(x) * d).sum(-1) + heads_total  # every other component: embeddings, MLPs, W_O's biases
    torch.testing.assert_close(got.sum((1, 2)) + rest + (beta * d).sum(-1), want_diff)
    assert got.abs().max() > 1e-3


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_logit_direction_is_the_merged_unembedding_in_train_mode_too(dora):
    _, ours = _pair("llama", dropout=0.5, use_dora=dora)
    ours.train()  # adapter dropout on: the direction is still the weight the eval-mode forward applies
    flags = [m.training for m in ours.modules()]
    got = logit_direction(ours, torch.tensor([7, 9]), torch.tensor([11, 4]))
    assert [m.training for m in ours.modules()] == flags
    w_u = copy.deepcopy(ours).merge_and_unload().lm_head.weight  # PEFT's own merge (DoRA's magnitude included)
    torch.testing.assert_close(got, w_u[[7, 9]] - w_u[[11, 4]])
    if not dora:
        torch.testing.assert_close(got, (_merged(ours.get_base_model().lm_head)[[7, 9]]
                                         - _merged(ours.get_base_model().lm_head)[[11, 4]]))
    one = logit_direction(ours, 7, 11)  # ints give (d,)
    torch.testing.assert_close(one, w_u[7] - w_u[11])


def test_an_output_adapter_not_linear_in_its_input_is_refused_by_name():
    class Squash(torch.nn.Module):  # an adapter (it keeps the layer it wraps as base_layer) that is not linear
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        @property
        def weight(self):  # as PEFT's tuner layers show it: the base layer's, without the adapter
            return self.base_layer.weight

        def forward(self, x):
            return self.base_layer(x) + torch.tanh(x).sum(-1, keepdim=True)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = Squash(torch.nn.Linear(8, 10, bias=False))

        def get_output_embeddings(self):
            return self.head

    with pytest.raises(ValueError, match="Squash, whose output is not linear in its input"):
        logit_direction(Model(), 1, 2)


def test_final_norm_looks_through_the_peft_wrapper():
    for family in ("llama", "gpt2"):
        _, ours = _pair(family)
        assert final_norm(ours) is final_norm(ours.get_base_model())
        prefix = peft.get_peft_model(patch(build(family)), peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                                   num_virtual_tokens=3))
        assert final_norm(prefix) is final_norm(prefix.get_base_model())
    with pytest.raises(ValueError, match="no final norm found in Sequential"):
        final_norm(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_few_rows_of_a_wide_adapted_projection_are_its_merged_rows(dropout):
    # wide enough (600 inputs) that two rows are read as input gradients rather than from 600 unit vectors
    from headwise.viz.projection import applied_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 50)).double()
    cfg = peft.LoraConfig(target_modules=["0"], r=2, lora_alpha=4, lora_dropout=dropout, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, cfg).train()
    head = wrapped.base_model.model[0]
    rows = torch.tensor([7, 3])
    got = applied_weight(head, head.base_layer.weight, head, rows=rows)
    merged = head.base_layer.weight + head.lora_B["default"].weight @ head.lora_A["default"].weight * 2.0  # W + BA*s
    torch.testing.assert_close(got, merged.detach()[rows])
    with torch.inference_mode():  # no autograd there: read from unit vectors instead, the same rows
        torch.testing.assert_close(applied_weight(head, head.base_layer.weight, head, rows=rows), merged.detach()[rows])
    assert head.training and head.lora_dropout["default"].training  # modes given back


def test_rows_of_a_projection_autograd_cannot_see_through_are_read_from_unit_vectors():
    from headwise.viz.projection import applied_weight

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 50).double().requires_grad_(False)

    def untracked(x):  # a forward that records no graph (a kernel without a backward, say)
        with torch.no_grad():
            return lin(x)

    rows = torch.tensor([3, 7])
    torch.testing.assert_close(applied_weight(untracked, lin.weight, lin, rows=rows), lin.weight[rows])
    torch.testing.assert_close(applied_weight(lin, lin.weight, lin, rows=torch.tensor(3)), lin.weight[3])
