"""headwise.check on Hugging Face attention modules that call transformers' attention interface (tiny random
configs, nothing downloaded): unpatched, patched by headwise.interop.patch, and the view from layers(model).

The adapter is held to transformers' own model (it must call the module the way the model does: the same output
and the same eager weights as the module inside its model, seen by plain forward hooks); correct modules pass,
deliberately broken ones (a future key let in, a wrong scale, heads mixed before W_O, the padding mask dropped)
fail the property that names the bug."""

from __future__ import annotations

import functools
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.checks import adapt, check  # noqa: E402
from headwise.checks.hf_adapter import HFAdapter  # noqa: E402
from headwise.interop.hf.layer import is_target  # noqa: E402
from headwise.interop import layers, patch  # noqa: E402

ALL = {"permutation_equivariance", "batch_independence", "causality", "padding_invariance", "softmax_sanity",
       "head_independence", "dtype_stability"}
BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model_type -> (config sizes, attention implementation the model is built with, model class)
FAMILIES = {
    "opt": (dict(ffn_dim=32, word_embed_proj_dim=16), "sdpa", "AutoModelForCausalLM"),
    "phi3": (dict(num_key_value_heads=2), "sdpa", "AutoModelForCausalLM"),
    "gpt_neox": ({}, "sdpa", "AutoModelForCausalLM"),
    # softcap 50 and a sliding window on layer 0 (Gemma 2 runs eager only)
    "gemma2": (dict(num_key_value_heads=2, head_dim=4, query_pre_attn_scalar=4, sliding_window=3), "eager",
               "AutoModelForCausalLM"),
    "mixtral": (dict(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1), "sdpa",
                "AutoModelForCausalLM"),
    "electra": (dict(embedding_size=16), "sdpa", "AutoModel"),
    "deepseek_v3": (dict(num_key_value_heads=4, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                         q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
                         first_k_dense_replace=0, n_group=1, topk_group=1), "sdpa", "AutoModelForCausalLM"),
    "vit": (dict(image_size=8, patch_size=4, num_channels=3), "sdpa", "AutoModel"),
}
ENCODERS = {"electra", "vit"}
LOCATED = sorted(set(FAMILIES) - {"deepseek_v3"})


def _build(model_type: str, impl: str | None = None):
    sizes, default_impl, cls = FAMILIES[model_type]
    base = {k: v for k, v in BASE.items() if model_type != "vit" or k not in ("vocab_size", "pad_token_id")}
    cfg = transformers.AutoConfig.for_model(model_type, **base, **sizes)
    torch.manual_seed(0)
    model = getattr(transformers, cls).from_config(cfg, attn_implementation=impl or default_impl).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # non-trivial biases and norms
    return model


def _module(model):
    return next(m for m in model.modules() if is_target(m))


_MODELS: list = []  # the patched models of _forms' views: a view does not keep its model alive


def _forms(model_type: str):
    """The three things a user can pass: the module, the patched module, the view from layers(model)."""
    plain = _module(_build(model_type))
    patched_model = patch(_build(model_type))
    _MODELS.append(patched_model)
    return {"unpatched": plain, "patched": _module(patched_model), "view": layers(patched_model)[0][1]}


def _ran(report) -> set[str]:
    return {r.name for r in report.results if r.verdict != "skipped"}


@pytest.mark.parametrize("model_type", LOCATED)
def test_every_form_passes_every_applicable_property(model_type):
    for form, layer in _forms(model_type).items():
        report = check(layer)
        assert report.ok, f"{form}: {report}"
        assert _ran(report) == (ALL - {"causality"} if model_type in ENCODERS else ALL), f"{form}: {report}"
        if model_type not in ENCODERS:
            assert "decode" in report["causality"].detail  # prefill + decode with a DynamicCache == full pass
    if model_type == "gemma2":
        assert "sliding window 3" in report["causality"].detail


@pytest.mark.parametrize("impl", ["eager", "headwise"])
@pytest.mark.parametrize("model_type", ["opt", "phi3", "electra"])
def test_every_implementation_gets_its_own_masks(model_type, impl):
    # eager takes additive float masks, "headwise" (unpatched, by name) bool ones, as their mask functions build
    module = _module(_build(model_type, impl))
    report = check(module)
    assert report.ok, str(report)
    assert module.config._attn_implementation == impl


@pytest.mark.parametrize("model_type", ["opt", "phi3", "gpt_neox", "electra", "deepseek_v3", "gemma2", "mixtral"])
def test_every_form_gets_the_one_hugging_face_adapter(model_type):
    for form, layer in _forms(model_type).items():
        assert type(adapt(layer)) is HFAdapter, form


def _hooked(model, module, batch):
    """The hidden states the model hands the module and what the module returns (plain PyTorch hooks)."""
    got = {}
    pre = module.register_forward_pre_hook(lambda m, args, kwargs: got.update(x=args[0] if args else
                                           kwargs["hidden_states"]), with_kwargs=True)
    post = module.register_forward_hook(lambda m, args, out: got.update(y=out[0], w=out[1]))
    try:
        with torch.no_grad():
            model(**batch, output_attentions=True)
    finally:
        pre.remove()
        post.remove()
    return got


@pytest.mark.parametrize("model_type", ["opt", "phi3", "gpt_neox", "gemma2", "electra", "deepseek_v3"])
def test_the_adapter_calls_the_module_as_its_model_does(model_type):
    model = _build(model_type, "eager")
    module = _module(model)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False  # right padding
    ids = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    got = _hooked(model, module, {"input_ids": ids, "attention_mask": keep.long()})
    adapter = HFAdapter(module)
    with torch.no_grad():
        y = adapter.run(got["x"], keep=keep)
        y_w, w = adapter.run_weights(got["x"], keep=keep)
    torch.testing.assert_close(y, got["y"])
    torch.testing.assert_close(y_w, got["y"])
    torch.testing.assert_close(w, got["w"])
    assert module.config._attn_implementation == "eager"  # the wrapper for the weights call is gone again
    assert "headwise_check" not in transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS


def test_latent_attention_runs_everything_but_head_independence_and_says_why():
    for form, layer in _forms("deepseek_v3").items():
        report = check(layer)
        assert report.failed == [] and not report.ok, f"{form}: {report}"
        assert _ran(report) == ALL - {"head_independence"}, f"{form}: {report}"
        why = report["head_independence"].detail
        assert "multi-head latent attention" in why and "DeepseekV3Attention" in why
        assert "scale 1/sqrt(8)" in report["softmax_sanity"].detail  # d_qk = nope 4 + rope 4, not d_v = 6


# -- broken modules ----------------------------------------------------------------------------------------
def _wrap_forward(module, change):
    """Give ``module`` a forward that calls its own with ``change(kwargs)`` (a bound method, so copies follow)."""
    original = type(module).forward

    @functools.wraps(original)
    def forward(self, hidden_states, **kwargs):
        return original(self, hidden_states, **change(kwargs))

    module.forward = types.MethodType(forward, module)
    return module


def _one_key_ahead(kwargs):
    mask = kwargs["attention_mask"]
    if mask.dtype == torch.bool:
        kwargs["attention_mask"] = mask | mask.roll(-1, dims=-1)  # query t also reads key t + 1
    else:
        kwargs["attention_mask"] = torch.maximum(mask, mask.roll(-1, dims=-1))
    return kwargs


@pytest.mark.parametrize("form", ["unpatched", "patched"])
@pytest.mark.parametrize("model_type", ["opt", "phi3", "gpt_neox"])
def test_a_module_reading_a_future_key_fails_causality(model_type, form):
    module = _wrap_forward(_forms(model_type)[form], _one_key_ahead)
    report = check(module)
    assert "causality" in report.failed, str(report)
    assert "reads a later token" in report["causality"].detail


@pytest.mark.parametrize("form", ["unpatched", "patched", "view"])
@pytest.mark.parametrize("model_type", ["opt", "phi3", "gpt_neox", "deepseek_v3"])
def test_a_wrong_scale_fails_softmax_sanity(model_type, form):
    layer = _forms(model_type)[form]
    module = layer.host if form == "view" else layer
    d_qk = 8 if model_type == "deepseek_v3" else 4
    module.scaling = 1.0 / d_qk  # the classic 1/d_head (OPT folds it into q, the others pass it on)
    report = check(layer)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "1/d_head" in report["softmax_sanity"].counterexample["summary"]


def _mixing(base: type, d_h: int) -> type:
    def call(self, z, *args, **kw):
        mixed = torch.cat([z[..., :d_h], z[..., d_h:2 * d_h] + z[..., :d_h], z[..., 2 * d_h:]], -1)
        return base.__call__(self, mixed, *args, **kw)

    return type(f"Mixing{base.__name__}", (base,), {"__call__": call})


@pytest.mark.parametrize("model_type", ["opt", "phi3", "gpt_neox", "vit"])
def test_heads_mixed_before_w_o_fail_head_independence(model_type):
    for form, layer in _forms(model_type).items():
        module = layer.host if form == "view" else layer
        d_h = 4
        out = next(m for n, m in module.named_children() if n in ("o_proj", "out_proj", "dense"))
        # W_O's input with head 0's context leaked into head 1's (a bug between the heads and W_O): W_O is called
        # on the mixed contexts (the caller's hooks would not do: the check runs a copy without them)
        if not type(out).__name__.startswith("Mixing"):  # the forms share one module: mix once
            out.__class__ = _mixing(type(out), d_h)
        report = check(layer)
        # the attention function's output is still its weights times its values (softmax_sanity compares it there,
        # so that a module's own step after it, an output gate, is no failure): the mixing after it is
        # head_independence's to find
        assert report.failed == ["head_independence"], f"{form}: {report}"
        assert "contexts are the weights times the values" in report["softmax_sanity"].detail
        assert report["head_independence"].counterexample["changed_heads"] == [0, 1]


@pytest.mark.parametrize("model_type", ["electra", "opt"])
def test_a_dropped_padding_mask_fails_padding_invariance(model_type):
    module = _wrap_forward(_module(_build(model_type)), lambda kw: {**kw, "attention_mask": None})
    report = check(module, causal=False)  # without a mask a decoder's sdpa call would be causal on its own
    assert "padding_invariance" in report.failed, str(report)


# -- refusals ----------------------------------------------------------------------------------------------
def _bart():
    cfg = transformers.BartConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32)
    return transformers.BartModel(cfg).eval()


def test_cross_attention_is_refused_in_every_form():
    model = _bart()
    cross = model.decoder.layers[0].encoder_attn
    with pytest.raises(ValueError, match="BartAttention is cross-attention"):
        check(cross)
    patch(model)
    view = dict(layers(model))["decoder.layers.0.encoder_attn"]
    with pytest.raises(ValueError, match="BartAttention at 'decoder.layers.0.encoder_attn' is cross-attention"):
        check(view)
    assert check(model.decoder.layers[0].self_attn).ok  # the decoder's self-attention is checked


def test_a_forward_needing_an_input_the_check_cannot_build_is_refused():
    from transformers.models.opt.modeling_opt import OPTAttention

    class Gated(OPTAttention):
        def forward(self, hidden_states, gate, **kwargs):
            return super().forward(hidden_states * gate, **kwargs)

    module = _module(_build("opt"))
    module.__class__ = Gated
    with pytest.raises(TypeError, match=r"Gated.forward needs \['gate'\], which headwise.check cannot build"):
        check(module)


def test_a_module_raising_inside_the_weights_call_leaves_the_interface_as_it_was():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = _module(_build("phi3"))
    original = type(module).forward

    @functools.wraps(original)
    def forward(self, hidden_states, **kwargs):
        if self.config._attn_implementation not in ("eager", "sdpa"):  # only while the check reads weights
            raise RuntimeError("boom")
        return original(self, hidden_states, **kwargs)

    module.forward = types.MethodType(forward, module)
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "RuntimeError: boom" in report["softmax_sanity"].counterexample["summary"]
    assert "headwise_check" not in ALL_ATTENTION_FUNCTIONS
    assert module.config._attn_implementation == "sdpa"


def _folding(model_type: str):
    """A module that multiplies q by 1/sqrt(d_qk) itself and passes scaling=1 to the interface."""
    if model_type == "whisper":  # Q/K/V not located (k_proj has no bias, q_proj and v_proj do)
        cfg = transformers.WhisperConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                         decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16,
                                         max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         decoder_start_token_id=1)
        torch.manual_seed(0)
        return transformers.WhisperModel(cfg).eval().encoder.layers[0].self_attn
    cfg = transformers.EsmConfig(vocab_size=33, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=32, position_embedding_type="rotary", pad_token_id=1)
    torch.manual_seed(0)
    return transformers.EsmModel(cfg).eval().encoder.layer[0].attention.self  # rotary after the folded scale


@pytest.mark.parametrize("model_type", ["whisper", "esm"])
def test_a_scale_folded_into_q_is_the_scale_of_the_scores(model_type):
    module = _folding(model_type)
    report = check(module)
    assert report["softmax_sanity"].verdict == "pass", str(report)
    assert "scale 1/sqrt(4)" in report["softmax_sanity"].detail
    # Whisper folds self.scaling into q; ESM folds 1/sqrt(d_qk) and passes self.scaling (1) on: both become 1/d_head
    module.scaling = 1.0 / 4 if model_type == "whisper" else 0.5
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "1/d_head" in report["softmax_sanity"].counterexample["summary"]


def _gpt_oss():
    # Attention sinks (a learned logit per head that takes part of every row) and YaRN rotary (cos and sin
    # times an attention_scaling): rows sum to less than 1, and the scores carry that scaling squared.
    cfg = transformers.AutoConfig.for_model("gpt_oss", **BASE, num_key_value_heads=2, head_dim=4,
                                            num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.Tensor):
                m.sinks.add_(torch.randn_like(m.sinks))  # sinks that take a real share of each row
    return model


@pytest.mark.parametrize("form", ["unpatched", "view"])
def test_attention_sinks_and_yarn_scaling_pass_and_a_wrong_scale_still_fails(form):
    model = _gpt_oss() if form == "unpatched" else patch(_gpt_oss())
    layer = _module(model) if form == "unpatched" else layers(model)[0][1]
    module = layer if form == "unpatched" else layer.host
    assert float(module.config.rope_parameters.get("factor", 1)) > 1  # YaRN in this config
    report = check(layer)
    assert report.ok, report
    assert "at most 1" in report["softmax_sanity"].detail
    module.scaling = 2 * module.scaling
    assert check(layer).failed == ["softmax_sanity"]


# -- the T5 family: its forward takes the mask as `mask=` -----------------------------------------------------
def _t5():
    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2,
                                attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.T5Model(cfg).eval()


def _t5_hooked(model, module, batch):
    """What the model hands its first block's attention (which computes its own relative bias) and gets back."""
    got = {}
    pre = module.register_forward_pre_hook(lambda m, args, kwargs: got.update(x=args[0]), with_kwargs=True)
    post = module.register_forward_hook(lambda m, args, out: got.update(y=out[0]))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        pre.remove()
        post.remove()
    return got


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_t5_attention_gets_its_mask_through_the_mask_keyword_as_its_model_does(stack):
    model = _t5()
    module = getattr(model, stack).block[0].layer[0].SelfAttention
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False  # right padding of the encoder's input; the decoder's is causal and unpadded
    ids = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    got = _t5_hooked(model, module, {"input_ids": ids, "attention_mask": keep.long(), "decoder_input_ids": ids})
    adapter = HFAdapter(module)
    assert adapter.accepts_mask and adapter.claims_causal == (stack == "decoder")
    with torch.no_grad():
        y = adapter.run(got["x"], keep=keep if stack == "encoder" else None)
    torch.testing.assert_close(y, got["y"])
    report = check(module, properties=["causality", "padding_invariance"])
    ran = {"padding_invariance"} | ({"causality"} if stack == "decoder" else set())
    assert report.failed == [] and _ran(report) == ran, str(report)
    # the same module ignoring its mask is caught
    _wrap_forward(module, lambda kw: {k: v for k, v in kw.items() if k != "mask"})
    report = check(module, properties=["causality", "padding_invariance"])
    assert report.failed == (["causality", "padding_invariance"] if stack == "decoder" else ["padding_invariance"]), \
        str(report)


def test_a_causal_module_without_a_mask_keyword_is_refused_by_the_adapter_not_as_failing_on_x():
    module = _t5().decoder.block[1].layer[0].SelfAttention
    original = type(module).forward

    def forward(self, hidden_states, **kwargs):  # a forward with no mask keyword at all
        return original(self, hidden_states)
    module.forward = types.MethodType(forward, module)
    with pytest.raises(ValueError, match=r"is causal, but its forward takes no mask \(attention_mask or mask\)") \
            as info:
        check(module)
    assert "fails on x" not in str(info.value)


def test_a_scale_folded_into_both_q_and_k_is_the_scale_of_the_scores():
    # OpenAI's privacy filter multiplies q and k each by d_qk**-0.25 (after a YaRN rotary) and passes scaling=1
    cfg = transformers.AutoConfig.for_model("openai_privacy_filter", vocab_size=32, hidden_size=16,
                                            intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=4, num_local_experts=2,
                                            num_experts_per_tok=1, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    module = transformers.AutoModel.from_config(cfg, attn_implementation="eager").eval().layers[0].self_attn
    assert module.scaling == 4 ** -0.25
    report = check(module)
    assert report.ok, str(report)
    assert "scale 1/sqrt(4)" in report["softmax_sanity"].detail
    module.scaling = 2 * 4 ** -0.25  # q and k each twice too large: scores four times 1/sqrt(d_qk)
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    cex = report["softmax_sanity"].counterexample
    torch.testing.assert_close(cex["fitted_scale"], module.scaling ** 2, rtol=1e-4, atol=0)
