"""Gradient checkpointing recomputes a layer in the backward, outside the trace (without its edits) or inside it (a
second call): a trace refuses it before recording or changing anything, and where no recompute runs (eval mode,
no autograd, a checkpointed part holding no traced layer) its captures and gradients are those of the same model
without checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import headwise
from headwise import MultiHeadAttention

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402

EDIT = {(0, 1): "zero", (1, 4, "v"): 0.5}
REFUSED = r"LlamaForCausalLM has gradient checkpointing on in training mode.*gradient_checkpointing_disable\(\)"


def checkpointing(model, reentrant=False):
    """Transformers' gradient checkpointing on (named activation checkpointing where the old name is deprecated)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def state(model):
    """What a trace changes on a model: every module's mode, forward hooks and tracer."""
    return [(name, m.training, len(m._forward_pre_hooks), len(m._forward_hooks), m.__dict__.get("tracer"))
            for name, m in model.named_modules()]


def loss_of(out):
    return (out.logits[:, :, 7] - out.logits[:, :, 11]).square().sum()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("capture", [(), ("pattern",), ("z",)])
def test_a_trace_of_a_model_checkpointing_in_training_mode_is_refused_and_changes_nothing(reentrant, capture):
    model = checkpointing(patch(ref.llama("sdpa")), reentrant).train()
    before = state(model)
    with pytest.raises(ValueError, match=REFUSED):
        with headwise.trace(model, capture=capture, edit=EDIT):
            raise AssertionError("the trace was entered")
    assert state(model) == before
    assert all(layer.tracer is None for _, layer in headwise.interop.layers(model))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_peft_model_checkpointing_in_training_mode_is_refused_and_changes_nothing():
    peft = pytest.importorskip("peft")
    base = patch(ref.llama("sdpa"))
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=2,
                                                      init_lora_weights=False)).train()
    checkpointing(model.base_model.model)
    before = state(model)
    with pytest.raises(ValueError, match=r"PeftModel has gradient checkpointing on in training mode \(in "
                                         r"\['base_model\.model\.model'"):
        with headwise.trace(model, capture=("z",), edit=EDIT):
            raise AssertionError("the trace was entered")
    assert state(model) == before


def test_checkpointing_turned_on_inside_the_trace_refuses_the_call_before_it_runs():
    model = checkpointing(patch(ref.llama("sdpa")))  # in eval mode: nothing is recomputed, so tracing is allowed
    kw = ref.inputs(model)
    with headwise.trace(model, capture=("z",), edit=EDIT) as t:
        model.train()
        with pytest.raises(ValueError, match=REFUSED):
            model(**kw)
        assert [len(t[i].calls) for i in range(2)] == [0, 0]
    assert all(layer.tracer is None for _, layer in headwise.interop.layers(model))


@pytest.mark.parametrize("inside", [True, False])
def test_without_a_recompute_checkpointing_leaves_captures_and_gradients_as_without_it(inside):
    """Eval mode (transformers then never checkpoints): the backward inside or after the trace gives the gradients
    of the model without checkpointing, edits included; under no_grad in training mode, its captures."""
    reference = patch(ref.llama("sdpa"))
    model = checkpointing(copy.deepcopy(reference))
    kw = {**ref.inputs(model), "use_cache": False}
    runs = []
    for m in (reference, model):
        with headwise.trace(m, capture=("z", "pattern"), edit=EDIT) as t:
            loss = loss_of(m(**kw))
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        runs.append((t, [p.grad for p in m.parameters()]))
    (want, want_grads), (got, got_grads) = runs
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    for li in range(2):
        assert len(got[li].calls) == 1
        torch.testing.assert_close(got[li].z, want[li].z)
        torch.testing.assert_close(got[li].pattern, want[li].pattern)
    reference.train(), model.train()  # the tiny Llama has no dropout: training mode computes the same
    captured = []
    for m in (reference, model):
        with torch.no_grad(), headwise.trace(m, capture=("z",), edit=EDIT) as t:
            m(**kw)
        captured.append(t)
    for li in range(2):
        torch.testing.assert_close(captured[1][li].z, captured[0][li].z)


class Checkpointed(nn.Module):
    """A layer recomputed in the backward by torch's own checkpoint, not by a transformers flag."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(d_model=16, n_heads=4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.attn, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_traced_layer_recomputed_in_a_backward_is_refused_and_records_nothing(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    plain = copy.deepcopy(model.attn)
    x = torch.randn(2, 5, 16, requires_grad=True)
    edit = {(0, 1): "zero"}
    with headwise.trace(plain, capture=("z",), edit=edit) as want:
        y_want = plain(x)
    with headwise.trace(model, capture=("z",), edit=edit) as t:
        y = model(x)
        with pytest.raises(ValueError, match=r"layer 0 \(attn\) was called while autograd runs a backward.*"
                                             r"checkpoint"):
            y.square().sum().backward()
        assert len(t[0].calls) == 1  # the forward's call only
    torch.testing.assert_close(y, y_want)  # the forward itself is traced and edited
    torch.testing.assert_close(t[0].z, want[0].z)
    assert model.attn.tracer is None


def test_a_checkpointing_flag_counts_only_around_a_traced_layer():
    """A flag on a part holding no traced layer never recomputes one (traced as without it); on a module around
    one it is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(MultiHeadAttention(d_model=16, n_heads=4), nn.Linear(16, 16)).train()
    reference = copy.deepcopy(model)
    model[1].gradient_checkpointing = True
    x = torch.randn(2, 5, 16)
    runs = []
    for m in (reference, model):
        with headwise.trace(m, capture=("z",), edit={(0, 2): "zero"}) as t:
            m(x).sum().backward()
        runs.append((t[0].z, m[0].q_proj.weight.grad))
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want)
    model.gradient_checkpointing = True
    with pytest.raises(ValueError, match=r"Sequential has gradient checkpointing on in training mode \(in "
                                         r"\['Sequential'\]\)"):
        headwise.trace(model, capture=("z",)).__enter__()
    assert model[0].tracer is None
    with torch.no_grad(), headwise.trace(model, capture=("z",), edit={(0, 2): "zero"}) as t:  # nothing recomputed
        model(x)
    torch.testing.assert_close(t[0].z, runs[0][0])


def test_a_traced_layer_called_without_autograd_from_a_backward_hook_is_no_recompute():
    # checkpoints recompute with autograd on; a no-grad call from a hook during the backward is a plain call
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    probe = torch.randn(1, 3, 16)
    with torch.no_grad():
        want = attn(probe)
    seen = []
    x = torch.randn(2, 5, 16, requires_grad=True)
    with headwise.trace(attn, capture=("z",)) as t:
        y = attn(x)

        def hook(grad):
            with torch.no_grad():
                seen.append(attn(probe))

        y.register_hook(hook)
        y.sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], want)
    assert len(t[0].calls) == 2  # the forward and the hook's call
