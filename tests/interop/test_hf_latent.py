"""Heads of multi-head latent attention (DeepSeek-V2/V3) in a patched model: attn.head(i) slices, result captures
and head edits, each against the unpatched model seen through plain PyTorch hooks (its latents, its projections'
outputs, o_proj's input and output) or transformers' own rotary functions."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import layers, patch  # noqa: E402
from headwise.interop.hf.latent import LatentHead  # noqa: E402
from tests.interop.tiny_models import build, inputs  # noqa: E402

H, NOPE, ROPE, D_V, R_Q, R_KV, D = 4, 4, 2, 5, 7, 6, 16  # tiny_models.LATENT's widths
CASES = {
    "v3": ("deepseek_v3", {}),  # q_b_proj, interleaved rotary (V3's default rope_interleave)
    "v3_q_proj": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),  # q_proj reads x; rotate-half
    "v2_bias": ("deepseek_v2", dict(attention_bias=True)),  # complex rotary; biases on q_a, kv_a and o_proj
}
SUBMODULES = ("q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def model_of(case: str) -> torch.nn.Module:
    family, kw = CASES[case]
    return build(family, **kw)


@torch.no_grad()
def unpatched_run(model: torch.nn.Module, batch: dict, layer: int = 0) -> dict:
    """Run the unpatched model once; what one attention module and its submodules saw and returned."""
    attn = model.model.layers[layer].self_attn
    seen: dict = {}

    def before(m, args, kwargs):  # noqa: ANN001, ANN202
        seen["x"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen["pos"] = kwargs["position_embeddings"]

    handles = [attn.register_forward_pre_hook(before, with_kwargs=True),
               attn.register_forward_hook(lambda m, a, out: seen.update(out=out[0]))]
    for name in SUBMODULES:
        if getattr(attn, name, None) is not None:
            handles.append(getattr(attn, name).register_forward_hook(
                lambda m, a, out, name=name: seen.update({name: (a[0], out)})))
    try:
        seen["logits"] = model(**batch).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen


def rotate(model: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
           pos: tuple | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own rotary of the family, as its attention module applies it."""
    cfg = model.config
    if cfg.model_type == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

        return apply_rotary_emb(q, k, pos)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    fn = v3.apply_rotary_pos_emb_interleave if cfg.rope_interleave else v3.apply_rotary_pos_emb
    return fn(q, k, *pos)


def plus(t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return t if bias is None else t + bias


@pytest.mark.parametrize("case", list(CASES))
def test_head_slices_applied_to_the_modules_latents_give_its_per_head_q_k_v(case):
    model, batch = model_of(case), inputs()
    seen = unpatched_run(model, batch)
    x = seen["x"]
    b, s = x.shape[:2]
    q_up = "q_proj" if "q_proj" in seen else "q_b_proj"
    q_lat = x if q_up == "q_proj" else seen["q_a_layernorm"][1]
    kv_lat = seen["kv_a_layernorm"][1]
    q_ref = seen[q_up][1].view(b, s, H, NOPE + ROPE)  # the module's own per-head split, before rotary
    kv_ref = seen["kv_b_proj"][1].view(b, s, H, NOPE + D_V)
    k_rope_ref = seen["kv_a_proj_with_mqa"][1][..., R_KV:]  # the one shared rope key, before rotary
    heads = layers(patch(model))[0][1].heads()
    assert all(isinstance(head, LatentHead) for head in heads) and len(heads) == H
    with torch.no_grad():
        for i, head in enumerate(heads):
            torch.testing.assert_close(head.q_latent(x), q_lat)
            torch.testing.assert_close(head.kv_latent(x), kv_lat)
            torch.testing.assert_close(plus(q_lat @ head.w_q_nope, head.b_q_nope), q_ref[:, :, i, :NOPE])
            torch.testing.assert_close(plus(q_lat @ head.w_q_rope, head.b_q_rope), q_ref[:, :, i, NOPE:])
            torch.testing.assert_close(plus(kv_lat @ head.w_k_nope, head.b_k_nope), kv_ref[:, :, i, :NOPE])
            torch.testing.assert_close(plus(kv_lat @ head.w_v, head.b_v), kv_ref[:, :, i, NOPE:])
            torch.testing.assert_close(plus(x @ head.w_k_rope, head.b_k_rope), k_rope_ref)
    assert (heads[0].b_k_rope is not None) == (case == "v2_bias")
    assert heads[0].inputs["w_q_nope"] == ("x" if q_up == "q_proj" else "q_a_layernorm(q_a_proj(x))")
    assert heads[0].inputs["w_v"].startswith("kv_a_layernorm(") and heads[0].inputs["w_k_rope"] == "x"


@pytest.mark.parametrize("case", list(CASES))
def test_head_projections_after_the_familys_rotary_are_what_attention_is_handed(case):
    model, batch = model_of(case), inputs()
    seen = unpatched_run(model, batch)
    patch(model)
    with torch.no_grad(), headwise.trace(model, capture={0: ("q", "k", "v")}) as t:
        model(**batch)
    with torch.no_grad():
        q, k, v = (torch.stack(parts, 1) for parts in zip(*(head.project(seen["x"])
                                                             for head in layers(model)[0][1].heads())))
        q_rot, k_rot = rotate(model, q[..., NOPE:], k[:, :1, :, NOPE:], seen["pos"])  # (b, h | 1, s, d_rope)
    torch.testing.assert_close(t[0].v, v)
    torch.testing.assert_close(t[0].q[..., :NOPE], q[..., :NOPE])
    torch.testing.assert_close(t[0].k[..., :NOPE], k[..., :NOPE])
    torch.testing.assert_close(t[0].q[..., NOPE:], q_rot)
    torch.testing.assert_close(t[0].k[..., NOPE:], k_rot.expand(-1, H, -1, -1))  # one rope key for every head


@pytest.mark.parametrize("case", list(CASES))
def test_results_are_each_heads_context_through_its_o_proj_columns_and_sum_to_the_output(case):
    model, batch = model_of(case), inputs()
    seen = unpatched_run(model, batch)
    z_in, _ = seen["o_proj"]  # (b, s, h * d_v): every head's context, as o_proj reads it
    o = model.model.layers[0].self_attn.o_proj
    patch(model)
    with torch.no_grad(), headwise.trace(model, capture={0: ("z", "result")}) as t:
        model(**batch)
    result = t[0].result
    assert result.shape == (*z_in.shape[:2], H, D)
    torch.testing.assert_close(result.sum(2) + (0 if o.bias is None else o.bias), seen["out"])
    heads = layers(model)[0][1].heads()
    with torch.no_grad():
        for i, head in enumerate(heads):
            z_h = z_in[..., i * D_V:(i + 1) * D_V]
            torch.testing.assert_close(result[:, :, i], z_h @ o.weight[:, i * D_V:(i + 1) * D_V].T)
            torch.testing.assert_close(z_h @ head.w_o, result[:, :, i])
    assert (o.bias is not None) == (case == "v2_bias")


@pytest.mark.parametrize("case", list(CASES))
def test_zeroing_a_head_in_a_trace_equals_zeroing_its_o_proj_input_columns(case):
    model, batch = model_of(case), inputs()
    edits = {0: 1, 1: 3}  # layer -> head

    def zero(head: int):  # noqa: ANN202
        def hook(m, args):  # noqa: ANN001, ANN202
            z = args[0].clone()
            z[..., head * D_V:(head + 1) * D_V] = 0
            return (z,)
        return hook

    handles = [model.model.layers[li].self_attn.o_proj.register_forward_pre_hook(zero(hi)) for li, hi in edits.items()]
    try:
        with torch.no_grad():
            want = model(**batch).logits
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        plain = model(**batch).logits
    patch(model)
    with torch.no_grad(), headwise.trace(model, edit={(li, hi): "zero" for li, hi in edits.items()}):
        got = model(**batch).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, plain)  # the edit matters


def test_head_slices_are_live_views_of_the_modules_weights():
    model = patch(model_of("v2_bias"))
    host = model.model.layers[0].self_attn
    head = layers(model)[0][1].head(2)
    q_row, kv_row = 2 * (NOPE + ROPE), 2 * (NOPE + D_V)  # head 2's first row in q_b_proj / kv_b_proj
    parts = {"w_q_nope": (host.q_b_proj, q_row, NOPE), "w_q_rope": (host.q_b_proj, q_row + NOPE, ROPE),
             "w_k_nope": (host.kv_b_proj, kv_row, NOPE), "w_v": (host.kv_b_proj, kv_row + NOPE, D_V),
             "w_k_rope": (host.kv_a_proj_with_mqa, R_KV, ROPE)}
    for name, (lin, a, n) in parts.items():
        assert getattr(head, name).data_ptr() == lin.weight[a].data_ptr()  # no copy
        with torch.no_grad():
            lin.weight[a:a + n] += 1.0
        torch.testing.assert_close(getattr(head, name), lin.weight[a:a + n].T, rtol=0, atol=0)
    assert head.b_k_rope.data_ptr() == host.kv_a_proj_with_mqa.bias[R_KV].data_ptr()
    assert head.w_o.data_ptr() == host.o_proj.weight[0, 2 * D_V].data_ptr()
    new = torch.randn(R_KV, D_V)
    head.w_v = new  # writes the model's weight
    torch.testing.assert_close(host.kv_b_proj.weight[kv_row + NOPE:kv_row + NOPE + D_V], new.T, rtol=0, atol=0)
    before = host.kv_b_proj.weight.clone()
    with pytest.raises(ValueError, match=r"w_v must be a tensor of shape \(6, 5\), got \(5, 6\)"):
        head.w_v = new.T
    with pytest.raises(TypeError, match=r"w_v must be a torch.Tensor of shape \(6, 5\), got float"):
        head.w_v = 1.0
    assert torch.equal(host.kv_b_proj.weight, before)
    host.kv_b_proj = torch.nn.Linear(R_KV, H * (NOPE + D_V), bias=False)  # a replaced module is followed
    assert head.w_v.data_ptr() == host.kv_b_proj.weight[kv_row + NOPE].data_ptr()


def test_latent_heads_refuse_what_they_do_not_have():
    model = patch(model_of("v3"))
    attn = layers(model)[0][1]
    with pytest.raises(IndexError, match=r"in \[0, 4\), got 4"):
        attn.head(4)
    with pytest.raises(TypeError, match="int, got bool"):
        attn.head(True)
    with pytest.raises(AttributeError, match="use w_q_nope / w_q_rope"):
        attn.head(0).w_q
    assert attn.head(-1).index == 3
    # Q/K/V are not projections of x: the layer's q_proj (what surgery needs) stays unlocated, saying why.
    with pytest.raises(ValueError, match=r"q_proj \(and what needs it: surgery, from_hf\) is unavailable: .*latent.*"
                                         r"attn\.head\(i\) gives those rows"):
        attn.q_proj
    with pytest.raises(ValueError, match="surgery cannot resize DeepseekV3Attention: multi-head latent"):
        attn.write_heads({}, 2, 2)
    host = model.model.layers[0].self_attn
    host.kv_b_proj = torch.nn.Linear(R_KV, 3, bias=False)
    with pytest.raises(ValueError, match=r"kv_b_proj: expected an nn.Linear with weight \(36, 6\).*got \(3, 6\)"):
        attn.head(0)


def test_latent_heads_do_not_run_alone_and_project_checks_its_input():
    head = layers(patch(model_of("v3")))[0][1].head(1)
    with pytest.raises(TypeError, match="does not run alone: rotary, the mask and the softmax .* head.project"):
        head(torch.randn(1, 3, D))
    with pytest.raises(TypeError, match="x has dtype torch.float64 but the weights are torch.float32"):
        head.project(torch.randn(1, 3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \(b, s, d_model=16\).*got \(1, 3, 15\)"):
        head.project(torch.randn(1, 3, D - 1))
