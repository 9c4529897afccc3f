"""'result' captures where the module applying W_O runs forward pre-hooks that set its weight (the hook-based
``torch.nn.utils.weight_norm``, an offload bringing the weight in): each head's write is z_h @ W_O^h with the W_O
that module's call applies, as plain hooks on the unpatched model see it; an offload the trace cannot follow
(accelerate's, which replaces the module's forward) is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headwise
from headwise import MultiHeadAttention

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning",
                                        "ignore:.*weight_norm.*deprecated:UserWarning")


def _heads_through(module: nn.Module, n_heads: int) -> tuple[list, list]:
    """Forward pre-hook (registered after the module's own) and post-hook on a plain W_O module: per call, the
    float64 write of each head through the weight the call applies (b, s, h, d), and the module's output."""
    writes, outputs = [], []

    def pre(m, args):
        w, _ = ref.w_o(m)  # (d, h * d_h), as set by the hooks before this one
        x = args[0].double()
        b, s, inner = x.shape
        per_head = w.double().reshape(w.shape[0], n_heads, inner // n_heads)  # (d, h, d_h)
        writes.append(torch.einsum("bshk,dhk->bshd", x.reshape(b, s, n_heads, -1), per_head))

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(lambda m, a, out: outputs.append(out))
    return writes, outputs


def _weight_norm_then_step(module: nn.Module) -> None:
    """The old hook-based weight norm on W_O, then a step on its magnitude: the stored weight is stale until the
    module's next call recomputes it in its pre-hook."""
    torch.nn.utils.weight_norm(module)
    with torch.no_grad():
        module.weight_g.mul_(torch.linspace(0.5, 3.0, module.weight_g.numel()).view_as(module.weight_g))


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2"])
def test_result_uses_the_w_o_its_module_applies_under_weight_norm(family):
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)
    h = model.config.num_attention_heads
    for m in (model, plain):
        for w_o in ref.w_o_modules(m):
            _weight_norm_then_step(w_o)
    want = [_heads_through(w_o, h) for w_o in ref.w_o_modules(plain)]
    seen = [[] for _ in want]
    for li, w_o in enumerate(ref.w_o_modules(model)):
        w_o.register_forward_hook(lambda m, a, out, li=li: seen[li].append(out))
    hooks = [len(w_o._forward_pre_hooks) for w_o in ref.w_o_modules(model)]
    with torch.no_grad():
        plain(**kw)
        with headwise.trace(model, capture=("result",)) as t:
            model(**kw)
    for li, (writes, outputs) in enumerate(want):
        result = t[li].result  # (b, s, h, d)
        torch.testing.assert_close(result.double(), writes[0])
        _, bias = ref.w_o(ref.w_o_modules(model)[li])
        total = result.sum(2) if bias is None else result.sum(2) + bias
        torch.testing.assert_close(total, seen[li][0])  # the heads' writes add up to W_O's output
        torch.testing.assert_close(seen[li][0], outputs[0])
    assert [len(w_o._forward_pre_hooks) for w_o in ref.w_o_modules(model)] == hooks  # the trace's hook is gone


def test_result_of_a_layer_whose_out_proj_recomputes_its_weight():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).double().eval()
    _weight_norm_then_step(attn.out_proj)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        with headwise.trace(attn, capture=("z", "result")) as t:
            y = attn(x, causal=True)
        w = attn.out_proj.weight  # recomputed by the call: the W_O it applied
        want = torch.einsum("bshk,dhk->bshd", t[0].z, w.view(16, 4, 4))
    torch.testing.assert_close(t[0].result, want)
    torch.testing.assert_close(t[0].result.sum(2) + attn.out_proj.bias, y)


def test_result_of_a_torch_multihead_attention_view_whose_out_proj_recomputes_its_weight():
    # a shared view of nn.MultiheadAttention applies W_O by calling the host's out_proj, whose hooks run first
    from headwise.interop.torch_mha import from_torch

    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True).double().eval()
    _weight_norm_then_step(m.out_proj)
    view = from_torch(m, share=True)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        with headwise.trace(view, capture=("z", "result")) as t:
            y = view(x)
        want = torch.einsum("bshk,dhk->bshd", t[0].z, m.out_proj.weight.view(16, 4, 4))  # the W_O it applied
    torch.testing.assert_close(t[0].result, want)
    torch.testing.assert_close(t[0].result.sum(2) + m.out_proj.bias, y)


def test_result_under_an_offload_that_brings_w_o_in_by_a_pre_hook():
    model = ref.llama("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)
    h = model.config.num_attention_heads
    for o in ref.w_o_modules(model):  # the weight lives elsewhere; the module holds a meta one between calls
        stored = o.weight.detach().clone()
        o.weight = nn.Parameter(torch.empty_like(stored, device="meta"), requires_grad=False)
        o.register_forward_pre_hook(lambda m, a, stored=stored: setattr(m, "weight", nn.Parameter(stored, False)))
        o.register_forward_hook(lambda m, a, out: setattr(m, "weight", nn.Parameter(
            torch.empty_like(m.weight, device="meta"), requires_grad=False)))
    want = [_heads_through(o, h) for o in ref.w_o_modules(plain)]
    with torch.no_grad():
        expected = plain(**kw).logits
        with headwise.trace(model, capture=("result",)) as t:
            got = model(**kw).logits
    torch.testing.assert_close(got, expected)
    for li, (writes, _) in enumerate(want):
        assert t[li].result.device.type == "cpu"
        torch.testing.assert_close(t[li].result.double(), writes[0])


def test_result_of_a_model_offloaded_by_accelerate_is_refused_before_anything_changes():
    accelerate = pytest.importorskip("accelerate")
    model = patch(ref.llama("sdpa"))
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    o = ref.w_o_modules(model)[0]
    hooks = len(o._forward_pre_hooks)
    with pytest.raises(ValueError, match=r"capture 'result' of layer 0 .*W_O's weight is on the meta device"):
        headwise.trace(model, capture=("result",)).__enter__()
    attn = model.model.layers[0].self_attn.attn
    assert attn.tracer is None and len(o._forward_pre_hooks) == hooks  # a refused trace changes nothing
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:  # the other captures still work
        model(**ref.inputs(model))
    assert t[0].z.shape == (2, 6, 6, 4)
