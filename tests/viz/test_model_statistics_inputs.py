"""What headwise.viz.model_statistics takes: an attention_mask of one 1 or 0 per input token, and self-attention
over one sequence (an encoder-decoder model is refused whatever its two lengths; its encoder alone is drawn, equal
to float64 statistics of the unpatched eager encoder's own weights). A refused call leaves the model as it was."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.viz import model_statistics  # noqa: E402

ONE_SEQUENCE = "self-attention over one sequence"


def t5() -> torch.nn.Module:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def padded_text() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (1, 6), generator=g)
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 4:] = 0
    return ids, mask


def assert_as_it_was(model: torch.nn.Module, modules: list, run, before: torch.Tensor) -> None:
    """The model holds its own modules again, no hook of the call is left on any, and it computes as before."""
    assert [type(m) for m in model.modules()] == modules
    assert not headwise.interop.layers(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(run(), before, rtol=0, atol=0)


@pytest.mark.parametrize("decoder_length", [6, 4])
def test_an_encoder_decoder_model_is_refused_whatever_its_decoder_length(decoder_length):
    """Equal lengths included: there the decoder's self-attention and cross-attention have the encoder's shapes,
    and would be drawn as the encoder's layers, under its tokens and its padding."""
    model = t5()
    ids, mask = padded_text()
    dec = torch.randint(1, 64, (1, decoder_length), generator=torch.Generator().manual_seed(2))

    def run():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits

    with torch.no_grad():
        before = run()
    modules = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=ONE_SEQUENCE + r".*model\.get_encoder\(\)"):
        model_statistics(model, {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec})
    assert_as_it_was(model, modules, run, before)


def test_cross_attention_to_another_sequence_of_the_same_length_is_refused():
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=64,
                                  add_cross_attention=True, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    x, states = torch.randint(1, 64, (1, 6)), torch.randn(1, 6, 32)
    with pytest.raises(ValueError, match=ONE_SEQUENCE):
        model_statistics(model, {"input_ids": x, "encoder_hidden_states": states})
    assert not headwise.interop.layers(model)


def test_an_encoder_decoders_encoder_alone_equals_its_unpatched_eager_weights():
    """What the refusal points to: the encoder's statistics are float64 statistics of the unpatched eager encoder's
    own weights on the real rows, and its padding rows read nothing."""
    model = t5()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids, mask = padded_text()
    with torch.no_grad():
        out = eager.get_encoder()(input_ids=ids, attention_mask=mask, output_attentions=True)
    p = torch.stack([a[0, :, :4].double() for a in out.attentions])  # (L, h, real rows, s)
    st = model_statistics(model.get_encoder(), {"input_ids": ids, "attention_mask": mask})
    assert st.entropy.shape == (2, 4, 6)
    zeros = torch.zeros(2, 4, 2, dtype=torch.float64)
    torch.testing.assert_close(st.entropy.double(),
                               torch.cat([-(p * p.clamp_min(1e-300).log()).sum(-1), zeros], -1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.max_weight.double(), torch.cat([p.amax(-1), zeros], -1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st.key_weight.double(), p.sum(-2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", [torch.ones(6, 6, dtype=torch.bool).tril()[None, None],  # Llama takes it
                                  torch.ones(1, 5, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)],
                         ids=["4-D", "short", "long"])
def test_an_attention_mask_that_is_not_one_per_input_token_is_refused_naming_its_shape(mask):
    model = llama()
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(3))

    def run():
        return model(input_ids=ids).logits

    with torch.no_grad():
        before = run()
    modules = [type(m) for m in model.modules()]
    shape = str(tuple(mask.shape)).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=rf"attention_mask must be \(batch, positions\) = \(1, 6\).*got shape {shape}"):
        model_statistics(model, {"input_ids": ids, "attention_mask": mask})
    assert_as_it_was(model, modules, run, before)


def test_an_attention_mask_that_is_no_tensor_is_refused():
    model = llama()
    with pytest.raises(TypeError, match="attention_mask must be a .batch, positions. tensor.*got list"):
        model_statistics(model, {"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": [[1, 1, 1]]})
    assert not headwise.interop.layers(model)


class Stack(torch.nn.Module):
    """Two headwise layers on embeddings named ``x``: the inputs show no token count, the layers' calls do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.ModuleList([headwise.MultiHeadAttention(16, 4), headwise.MultiHeadAttention(16, 4)])

    def forward(self, x, attention_mask):
        for a in self.attn:
            x = x + a(x)
        return x


def test_a_mask_of_another_length_than_the_layers_positions_is_refused_and_unwraps_every_layer():
    model = Stack().eval()
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\), expected .* \(1, 8\)"):
        model_statistics(model, {"x": torch.randn(1, 8, 16), "attention_mask": torch.ones(1, 5, dtype=torch.long)})
    assert not any("attend" in a.__dict__ for a in model.attn)
    assert all(a.tracer is None for a in model.attn)


def test_a_float16_eager_models_padding_rows_weigh_every_key_as_the_unpatched_model_does():
    """docs/statistics.md: a patched float16 eager model masks with float32's minimum, which swamps the scores as
    float16's swamps the unpatched model's: a row whose every key is masked weighs each the same, its weights
    exactly the unpatched model's."""
    def build():
        m = llama()
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.q_proj.weight.mul_(60.0)  # scores that differ by about 1 between keys
        m = m.half()
        m.set_attn_implementation("eager")
        return m

    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :8] = 0  # row 0: eight padding tokens, then one real
    with torch.no_grad():
        want = build()(input_ids=ids, attention_mask=mask, output_attentions=True)
    model = build()
    headwise.interop.patch(model)
    with torch.no_grad(), headwise.trace(model, capture=("pattern",)) as t:
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    for i in range(2):
        torch.testing.assert_close(t[i].pattern[0, :, :8], want.attentions[i][0, :, :8], rtol=0, atol=0)
        torch.testing.assert_close(t[i].pattern[0, :, :8].double(), torch.full((4, 8, 9), 1 / 9, dtype=torch.float64),
                                   rtol=0, atol=1e-3)  # 1/9 in float16
