"""Heads of multi-head latent attention (DeepSeek-V2/V3) in a patched model: attn.head(i) slices, result captures
and head edits, each against the unpatched model seen through plain PyTorch hooks (its latents, its projections'
outputs, o_proj's input and output) or transformers' own rotary functions."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
import headwise.surgery  # noqa: E402
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
    model = patch(model_of("v3"))  # kept: a head (a view) does not keep its model alive
    head = layers(model)[0][1].head(1)
    with pytest.raises(TypeError, match="does not run alone: rotary, the mask and the softmax .* head.project"):
        head(torch.randn(1, 3, D))
    with pytest.raises(TypeError, match="x has dtype torch.float64 but the weights are torch.float32"):
        head.project(torch.randn(1, 3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \(b, s, d_model=16\).*got \(1, 3, 15\)"):
        head.project(torch.randn(1, 3, D - 1))


def dense64(case: str, impl: str = "sdpa") -> torch.nn.Module:
    """The case's model in float64 (exact comparisons), its MLPs dense (the MoE kernel has no float64)."""
    family, kw = CASES[case]
    return build(family, impl, **kw, first_k_dense_replace=2).double()


def test_head_w_o_assignment_writes_its_o_proj_columns():
    model = dense64("v2_bias")
    by_hand, batch = copy.deepcopy(model), inputs()
    new = torch.randn(D_V, D, dtype=torch.float64)
    with torch.no_grad():
        by_hand.model.layers[1].self_attn.o_proj.weight[:, 2 * D_V:3 * D_V] = new.T
        want = by_hand(**batch).logits
    patch(model)
    head, o = layers(model)[1][1].head(2), model.model.layers[1].self_attn.o_proj
    before = o.weight.clone()
    with pytest.raises(ValueError, match=r"w_o must have shape \(5, 16\), got \(16, 5\)"):
        head.w_o = new.T
    with pytest.raises(TypeError, match="w_o must be a torch.Tensor, got float"):
        head.w_o = 1.0
    assert torch.equal(o.weight, before)  # a refused assignment writes nothing
    head.w_o = new
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, want)


def test_importance_scores_equal_gating_o_proj_input_columns_in_the_unpatched_model():
    model = dense64("v3")
    plain, batch = copy.deepcopy(model), inputs()
    n_layers = len(plain.model.layers)

    def metric(out):  # noqa: ANN001, ANN202
        return out.logits.square().mean()

    def run(gates: torch.Tensor) -> torch.Tensor:  # each head's o_proj input columns times its gate
        def gate(li: int):  # noqa: ANN202
            return lambda m, args: ((args[0].unflatten(-1, (H, D_V)) * gates[li, :, None]).flatten(-2),)
        handles = [plain.model.layers[li].self_attn.o_proj.register_forward_pre_hook(gate(li))
                   for li in range(n_layers)]
        try:
            return metric(plain(**batch))
        finally:
            for handle in handles:
                handle.remove()

    ones = torch.ones(n_layers, H, dtype=torch.float64)
    with torch.no_grad():
        base = run(ones)
        ablated = torch.stack([torch.stack([run(ones.index_put((torch.tensor(li), torch.tensor(h)),
                                                               torch.tensor(0.0, dtype=torch.float64))) - base
                                            for h in range(H)]) for li in range(n_layers)])
    gates = ones.clone().requires_grad_(True)
    grad, = torch.autograd.grad(run(gates), gates)
    patch(model)
    torch.testing.assert_close(headwise.surgery.ablation_importance(model, batch, metric, progress=False), ablated)
    torch.testing.assert_close(headwise.surgery.gradient_importance(model, batch, metric, progress=False),
                               grad.abs())
    assert ablated.abs().min() > 0 and grad.abs().min() > 0  # every head matters


def test_q_and_k_edits_replace_the_d_nope_plus_d_rope_wide_slice_handed_to_attention(monkeypatch):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    model = dense64("v3", "eager")  # the family's own eager_attention_forward, wrapped below
    plain, batch = copy.deepcopy(model), inputs()
    real = batch["attention_mask"].bool()  # (b, s)
    eager = v3.eager_attention_forward
    seen: list = []

    def run(edit=None):  # noqa: ANN001, ANN202 - edit(query, key) in place, on layer 0's call
        def wrapped(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN202
            query, key = query.clone(), key.clone()  # (b, h, s, d_nope + d_rope), after rotary
            if module.layer_idx == 0:
                seen.append((query.clone(), key.clone()))
                if edit is not None:
                    edit(query, key)
            return eager(module, query, key, value, *args, **kwargs)
        monkeypatch.setattr(v3, "eager_attention_forward", wrapped)
        try:
            with torch.no_grad():
                return plain(**batch).logits
        finally:
            monkeypatch.setattr(v3, "eager_attention_forward", eager)

    run()
    q0, k0 = seen[0]
    mean_q, mean_k = q0[:, 2][real].mean(0), k0[:, 1][real].mean(0)  # over the real tokens, by hand
    t_q, t_k = torch.randn(NOPE + ROPE, dtype=torch.float64), torch.randn(NOPE + ROPE, dtype=torch.float64)

    def by_hand(head_q: int, value_q: torch.Tensor, head_k: int, value_k: torch.Tensor) -> torch.Tensor:
        def edit(query, key):  # noqa: ANN001, ANN202
            query[:, head_q], key[:, head_k] = value_q, value_k
        return run(edit)

    want_tensor, want_mean = by_hand(2, t_q, 1, t_k), by_hand(2, mean_q, 1, mean_k)
    patch(model)
    with torch.no_grad(), headwise.trace(model, capture={0: ("q", "k")}) as ref:
        model(**batch)
    assert ref[0].q.shape[-1] == ref[0].k.shape[-1] == NOPE + ROPE  # wider than v (D_V)
    for edits, want in (({(0, 2, "q"): t_q, (0, 1, "k"): t_k}, want_tensor),
                        ({(0, 2, "q"): ("mean", ref), (0, 1, "k"): ("mean", ref)}, want_mean)):
        with torch.no_grad(), headwise.trace(model, edit=edits):
            torch.testing.assert_close(model(**batch).logits, want)
    with pytest.raises(ValueError, match=r"replacement \(5,\) does not broadcast to this call's \(2, 6, 6\): "
                                         r"expected .* with n = 6"):
        with torch.no_grad(), headwise.trace(model, edit={(0, 2, "q"): torch.zeros(D_V)}):
            model(**batch)


def test_packing_latent_heads_is_refused_naming_them():
    model = patch(model_of("v3"))
    heads = layers(model)[0][1].heads()
    with pytest.raises(TypeError, match=r"from_heads needs a non-empty sequence of AttentionHead, got LatentHead at "
                                        r"position 0: heads of multi-head latent attention \(LatentHead\) cannot be "
                                        "packed"):
        headwise.MultiHeadAttention.from_heads(heads, out_proj=torch.nn.Linear(H * D_V, D))


def mistral4(original_max_position_embeddings: int) -> torch.nn.Module:
    """A tiny Mistral 4 (MLA whose queries are scaled by position past ``original_max_position_embeddings``)."""
    cfg = transformers.Mistral4Config(vocab_size=40, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=H, num_key_value_heads=H, q_lora_rank=R_Q,
                                      kv_lora_rank=R_KV, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
                                      v_head_dim=D_V, n_routed_experts=2, moe_intermediate_size=8,
                                      num_experts_per_tok=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    cfg.rope_parameters["original_max_position_embeddings"] = original_max_position_embeddings
    torch.manual_seed(0)
    return transformers.Mistral4Model(cfg).eval()


def test_mistral4_project_applies_the_llama4_query_scale_at_each_position():
    from transformers.models.mistral4 import modeling_mistral4 as m4

    model, s = mistral4(2), 7  # positions 2.. scale their queries (1 + 0.1 log 2 at 2 and 3, ...)
    attn = model.layers[0].self_attn
    seen: list = []
    attn.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["hidden_states"], kw["position_embeddings"])),
                                   with_kwargs=True)
    patch(model)
    ids = torch.randint(3, 40, (2, s), generator=torch.Generator().manual_seed(0))
    rotate = m4.apply_rotary_pos_emb_interleave if model.config.rope_interleave else m4.apply_rotary_pos_emb
    heads = layers(model)[0][1].heads()
    for positions in (None, torch.arange(5, 5 + s).expand(2, s)):
        seen.clear()
        with torch.no_grad(), headwise.trace(model, capture={0: ("q",)}) as t:
            model(ids, position_ids=positions)
        x, (cos, sin) = seen[0]
        with torch.no_grad():
            q = torch.stack([head.project(x, positions)[0] for head in heads], 1)  # (b, h, s, d_nope + d_rope)
            q_rope, _ = rotate(q[..., NOPE:], q[:, :1, :, NOPE:], cos, sin)
        torch.testing.assert_close(t[0].q, torch.cat([q[..., :NOPE], q_rope], -1))
    with pytest.raises(ValueError, match=r"positions must have shape \(s_q=7,\) or \(b=2, s_q=7\), got \(6,\)"):
        heads[0].project(x, torch.arange(6))
