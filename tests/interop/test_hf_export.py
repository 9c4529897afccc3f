"""torch.export of a patched decoder with dynamic batch and sequence dimensions; the peer is the unpatched model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402

from tests.interop.tiny_models import build, inputs  # noqa: E402


class Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_export_with_dynamic_batch_and_sequence(family, impl):
    plain = build(family, impl)  # GQA: 6 query heads over 2 K/V heads (qwen3: 4 over 2)
    model = Logits(patch(build(family, impl))).eval()
    example = inputs(0, b=2, s=6)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=32)
    exported = torch.export.export(model, (example["input_ids"], example["attention_mask"]),
                                   dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}), strict=False)
    for b, s in ((3, 9), (1, 4)):
        other = inputs(b + s, b=b, s=s) if b > 1 else {"input_ids": inputs(7, b=2, s=s)["input_ids"][:1],
                                                         "attention_mask": torch.ones(1, s, dtype=torch.long)}
        with torch.no_grad():
            want = plain(**other).logits
        torch.testing.assert_close(exported.module()(other["input_ids"], other["attention_mask"]), want)


def test_export_of_a_patched_t5_whose_position_bias_is_a_floating_mask():
    # T5 (sdpa) hands its position bias to attention as an additive mask; with autograd on (export's default),
    # the patched model exports as the unpatched one does, and gives its logits.
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    plain = transformers.T5ForConditionalGeneration(cfg).eval()
    patched = patch(transformers.T5ForConditionalGeneration(cfg).eval())
    patched.load_state_dict(plain.state_dict())
    kw = dict(input_ids=torch.tensor([[3, 5, 7, 9, 11, 4], [6, 8, 10, 12, 0, 0]]),
              attention_mask=torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]]),
              decoder_input_ids=torch.tensor([[0, 5, 7, 9], [0, 8, 10, 12]]), use_cache=False)
    exported = torch.export.export(patched, (), kwargs=kw, strict=False).module()
    with torch.no_grad():
        want = plain(**kw).logits
    torch.testing.assert_close(exported(**kw).logits, want)
