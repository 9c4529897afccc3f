"""PEFT LoRA on a patched model equals LoRA on the unpatched one: targets found by their usual names, the
same outputs, gradients and optimizer step, and the same merged model. The peer is PEFT on plain transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from headwise.interop import layers, patch, unpatch  # noqa: E402

from tests.interop.tiny_models import FAMILIES, LORA_TARGETS, build, inputs, output  # noqa: E402

# PEFT asks transformers a deprecated question; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

NO_DROPOUT = {"bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}


def lora(model: torch.nn.Module, family: str, targets: list[str] | None = None) -> torch.nn.Module:
    # init_lora_weights=False: B is random too, so the adapter changes outputs and both A and B get gradients.
    cfg = peft.LoraConfig(target_modules=targets or LORA_TARGETS[family], r=2, lora_alpha=4, lora_dropout=0.0,
                          init_lora_weights=False, fan_in_fan_out=family == "gpt2")
    torch.manual_seed(11)
    return peft.get_peft_model(model, cfg)


def loss_of(model: torch.nn.Module, family: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    if family == "bert":
        out = model(**batch).last_hidden_state
        return out, out.pow(2).mean()
    out = model(**batch, labels=batch["input_ids"])
    return out.logits, out.loss


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_on_a_patched_model_equals_lora_on_the_plain_one(family):
    base = build(family, **NO_DROPOUT.get(family, {}))
    plain = lora(copy.deepcopy(base), family)
    ours = lora(patch(copy.deepcopy(base)), family)
    assert len(layers(ours)) == 2  # still patched, under PEFT's prefixes
    attn = layers(ours)[0][1]
    wrapped = attn.host.c_attn if family == "gpt2" else attn.q_proj
    assert isinstance(wrapped, peft.tuners.lora.LoraLayer)  # the headwise forward runs the LoRA module
    trainable = [n for n, p in plain.named_parameters() if p.requires_grad]
    assert trainable and trainable == [n for n, p in ours.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable)

    batch = inputs(4)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (plain, ours)]
    for model in (plain, ours):
        model.train()
    (want, want_loss), (got, got_loss) = loss_of(plain, family, batch), loss_of(ours, family, batch)
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        assert not torch.allclose(want, loss_of(base.train(), family, batch)[0])  # the adapter is active
    want_loss.backward()
    got_loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    for n, p in ours.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
            torch.testing.assert_close(p.grad, grads[n], msg=n)
    for opt in opts:
        opt.step()
    for model in (plain, ours):
        model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_of(ours, family, batch)[0], loss_of(plain, family, batch)[0])

    merged_plain, merged_ours = plain.merge_and_unload(), ours.merge_and_unload()
    assert len(layers(merged_ours)) == 2
    unpatch(merged_ours)
    assert not any(type(m).__name__.startswith("Headwise") for m in merged_ours.modules())
    want_state = merged_plain.state_dict()
    assert list(merged_ours.state_dict()) == list(want_state)
    for k, v in merged_ours.state_dict().items():
        torch.testing.assert_close(v, want_state[k], msg=k)
    with torch.no_grad():
        torch.testing.assert_close(loss_of(merged_ours, family, batch)[0], loss_of(merged_plain, family, batch)[0])


def _left_padded() -> dict[str, torch.Tensor]:
    batch = inputs(5)
    batch["attention_mask"] = batch["attention_mask"].flip(1)  # eager and sdpa differ on rows that read nothing
    return batch


@pytest.mark.parametrize("order", ["patch_peft_model_unpatch_merged", "patch_then_peft_unpatch_peft_model"])
def test_unpatch_restores_the_model_whichever_peft_wrapper_it_is_given(order):
    base = build("llama", impl="eager")
    plain = lora(copy.deepcopy(base), "llama")
    batch = _left_padded()
    if order == "patch_peft_model_unpatch_merged":
        ours = patch(lora(copy.deepcopy(base), "llama"))
        model, want = unpatch(ours.merge_and_unload()), plain.merge_and_unload()
    else:
        inner = patch(copy.deepcopy(base))
        model, want = unpatch(lora(inner, "llama")), plain
    assert layers(model) == []
    assert {c._attn_implementation for c in (m.config for m in model.modules() if hasattr(m, "config"))} == {"eager"}
    torch.testing.assert_close(output(model, batch), output(want, batch))
    bad = torch.ones(3, 1)  # an unpatched model ignores head_mask; the patch's check must be gone with it
    torch.testing.assert_close(output(model, {**batch, "head_mask": bad}), output(want, {**batch, "head_mask": bad}))


def test_a_gpt2_layer_called_alone_applies_a_lora_or_refuses_it_on_the_fused_qkv():
    # attn(x) projects Q/K/V with row views of c_attn's base weight, so a LoRA (or a hook) on c_attn, which only the
    # module's forward calls, is refused rather than dropped; c_proj is called as a module, so its LoRA applies.
    base = build("gpt2", **NO_DROPOUT["gpt2"])
    x = torch.randn(2, 5, 21, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bare = base.transformer.h[0].attn(x)[0]
    for targets in (["c_attn"], ["attn.c_proj"], ["c_attn", "attn.c_proj"]):
        plain = lora(copy.deepcopy(base), "gpt2", targets).base_model.model.transformer.h[0].attn
        ours = lora(patch(copy.deepcopy(base)), "gpt2", targets).base_model.model.transformer.h[0].attn
        with torch.no_grad():
            want = plain(x)[0]
            assert not torch.allclose(want, bare)  # the adapter is active
            torch.testing.assert_close(ours(x)[0], want)  # the patched module's forward runs it
            if "c_attn" in targets:
                with pytest.raises(TypeError, match=r"transformer\.h\.0\.attn: its fused c_attn is wrapped by an "
                                                    r"adapter \(peft\.tuners\.lora\.layer\.Linear\)"):
                    ours.attn(x, causal=True)
            else:
                torch.testing.assert_close(ours.attn(x, causal=True), want)
    model = patch(copy.deepcopy(base))
    module = model.transformer.h[0].attn
    handle = module.c_attn.register_forward_hook(lambda mod, args, out: 2 * out)
    with pytest.raises(TypeError, match="its fused c_attn has forward hooks"), torch.no_grad():
        module.attn(x, causal=True)
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(module.attn(x, causal=True), bare)


def _causal_mha(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)  # torch: True = not allowed
    return m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]


@pytest.mark.parametrize("family,target,where", [("gpt2", "attn.c_proj", r"transformer\.h\.0\.attn's c_proj"),
                                                 ("llama", "o_proj", r"model\.layers\.0\.self_attn's o_proj")])
def test_to_torch_of_a_patched_layer_refuses_a_lora_on_w_o(family, target, where):
    # to_torch copies out_proj's weight, and a LoRA's delta is not in it: GPT-2's c_proj (a Conv1D the layer calls
    # through a transposed view) and Llama's o_proj (an nn.Linear) are refused alike, naming module and adapter.
    from headwise.interop import from_hf, to_torch

    base = build(family, **NO_DROPOUT.get(family, {}))
    model = lora(patch(copy.deepcopy(base)), family, [target])
    attn = layers(model)[0][1]
    module = attn.host
    x = torch.randn(2, 5, attn.d_model, generator=torch.Generator().manual_seed(0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"out_proj={where}, a peft\.tuners\.lora\.layer\.Linear \(an adapter, whose "
                                         r"delta is not in the weight to_torch copies\).*merge_and_unload\(\)"):
        to_torch(attn)
    assert model.state_dict().keys() == state.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert layers(model)[0][1] is attn and isinstance(module.get_submodule(target.split(".")[-1]),
                                                      peft.tuners.lora.LoraLayer)  # the adapter is still there
    with pytest.raises(ValueError, match=r"wrapped by an adapter \(PEFT\).*merge_and_unload\(\) first"):
        from_hf(module)  # the standalone copy refuses it as well
    if family == "gpt2":  # the layer run alone still applies the adapter: the refusal is to_torch's own
        plain = lora(copy.deepcopy(base), family, [target]).base_model.model.transformer.h[0].attn
        with torch.no_grad():
            torch.testing.assert_close(attn(x, causal=True), plain(x)[0])


def test_to_torch_of_a_patched_gpt2_layer_without_adapters_equals_the_unpatched_module():
    from headwise.interop import to_torch

    base = build("gpt2", **NO_DROPOUT["gpt2"])
    x = torch.randn(2, 5, 21, generator=torch.Generator().manual_seed(0))
    model = patch(copy.deepcopy(base))  # held: a view does not keep its model alive
    m = to_torch(layers(model)[0][1]).eval()
    with torch.no_grad():
        torch.testing.assert_close(_causal_mha(m, x), base.transformer.h[0].attn(x)[0])
    c_proj = model.transformer.h[0].attn.c_proj  # a forward set on the Conv1D the view calls is refused too
    c_proj.forward = lambda inp: 2 * type(c_proj).forward(c_proj, inp)
    with pytest.raises(ValueError, match=r"out_proj=transformer\.h\.0\.attn's c_proj, a transformers\.pytorch_utils"
                                         r"\.Conv1D with a forward set on the instance"):
        to_torch(layers(model)[0][1])
