"""Patched encoder-decoder models (BART, T5, Marian) compute what the unpatched ones do where the decoder's batch
and the encoder output's differ: one encoder output (batch 1) read by a batch of decoder sequences, which
transformers' eager and sdpa broadcast over the batch; a trace sees the keys and values at the decoder's batch.

Peers: the unpatched model, and the patched model given the encoder output expanded to the batch by hand."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import layers, patch  # noqa: E402

IDS = torch.tensor([[5, 9, 4, 11, 7, 1, 1]])  # one source sentence, right-padded (pad 1; T5's is 0, set below)
SOURCE_MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
DECODER_IDS = torch.tensor([[3, 5, 7, 9], [3, 6, 8, 10]])  # two continuations of it


def build(family: str, impl: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "t5":
        cfg = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                                    num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                    pad_token_id=0, eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(cfg)
    else:
        cfg_cls, model_cls = {"bart": (transformers.BartConfig, transformers.BartForConditionalGeneration),
                              "marian": (transformers.MarianConfig, transformers.MarianMTModel)}[family]
        cfg = cfg_cls(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        model = model_cls(cfg)
    model.set_attn_implementation(impl)
    return model.eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bart", "t5", "marian"])
def test_one_encoder_output_read_by_a_decoder_batch_is_broadcast_as_unpatched(family, impl):
    model = build(family, impl)
    ids = IDS.masked_fill(SOURCE_MASK == 0, 0) if family == "t5" else IDS
    with torch.no_grad():
        enc = model.get_encoder()(input_ids=ids, attention_mask=SOURCE_MASK)[0]  # (1, s, d)
        want = model(encoder_outputs=(enc,), attention_mask=SOURCE_MASK, decoder_input_ids=DECODER_IDS).logits
    assert want.shape[0] == 2  # the unpatched model broadcasts the encoder output over the decoder's batch
    patch(model)
    names = [name for name, _ in layers(model)]
    cross = next(i for i, name in enumerate(names) if name.endswith(("encoder_attn", "EncDecAttention")))
    with torch.no_grad():
        with headwise.trace(model, capture=("k", "v", "z")) as t:
            got = model(encoder_outputs=(enc,), attention_mask=SOURCE_MASK, decoder_input_ids=DECODER_IDS).logits
        with headwise.trace(model, capture=("k", "v", "z")) as by_hand:  # the encoder output expanded by hand
            model(encoder_outputs=(enc.expand(2, -1, -1),), attention_mask=SOURCE_MASK.expand(2, -1),
                  decoder_input_ids=DECODER_IDS)
    torch.testing.assert_close(got, want)
    for site in ("k", "v", "z"):  # the cross-attention's keys and values at the decoder's batch: (2, h, s, d_h)
        torch.testing.assert_close(getattr(t[cross], site), getattr(by_hand[cross], site))
    assert t[cross].k.shape == (2, 4, IDS.shape[1], 4)
