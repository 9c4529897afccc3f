"""Hugging Face models patched by headwise (``headwise.interop.patch``) against the same models unpatched:
a BERT-shaped encoder's forward, a Llama-shaped decoder's forward and greedy generation, random weights.

Both sides run identical weights through the same kernels, so the ratio measures what patching adds.

Shapes:
    b: batch, s: sequence, d: hidden size, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Callable

import torch

from .cases import Sizes
from .timing import Entry, Group

__all__ = ["bert_model", "llama_model", "hf_groups"]


def bert_model(d: int, h: int, layers: int, inter: int, vocab: int) -> torch.nn.Module:
    """A random-weight ``BertModel`` (sdpa)."""
    import transformers

    cfg = transformers.BertConfig(hidden_size=d, num_attention_heads=h, num_hidden_layers=layers,
                                  intermediate_size=inter, vocab_size=vocab, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def llama_model(d: int, h: int, h_kv: int, layers: int, inter: int, vocab: int) -> torch.nn.Module:
    """A random-weight ``LlamaForCausalLM`` (sdpa) with grouped K/V heads."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=d, num_attention_heads=h, num_key_value_heads=h_kv,
                                   num_hidden_layers=layers, intermediate_size=inter, vocab_size=vocab,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _pair(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    from headwise.interop import patch

    return model, patch(copy.deepcopy(model))


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _generate(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def _forward_group(key: str, name: str, model: torch.nn.Module, vocab: int, sz: Sizes) -> Group:
    plain, patched = _pair(model)
    b, s = sz.hf_batch
    ids = torch.randint(1, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    es = [Entry("headwise (patched)", partial(_forward, patched, ids)),
          Entry(f"HF {name} sdpa (unpatched)", partial(_forward, plain, ids))]
    return Group(key, f"{key} b{b} s{s}", es, base=es[1].name, rounds=sz.rounds, block_s=sz.block_s,
                 tol=(1e-4, 1e-4))


def _generate_group(sz: Sizes) -> Group:
    d, h, h_kv, layers, inter, vocab = sz.llama
    plain, patched = _pair(llama_model(*sz.llama))
    prompt, n = sz.generate
    ids = torch.randint(1, vocab, (1, prompt), generator=torch.Generator().manual_seed(2))
    es = [Entry("headwise (patched)", partial(_generate, patched, ids, n), number=1),
          Entry("HF Llama sdpa (unpatched)", partial(_generate, plain, ids, n), number=1)]
    # One generate per block: three times the rounds. The greedy tokens must be identical.
    return Group("patched Llama generate", f"patched Llama generate {n} tokens from {prompt}", es,
                 base=es[1].name, rounds=3 * sz.rounds, block_s=sz.block_s, tol=(0.0, 0.0))


def hf_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """The patched-vs-unpatched factories (none without transformers)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"patched": []}
    return {"patched": [
        lambda: _forward_group("patched BERT forward", "BERT", bert_model(*sz.bert), sz.bert[-1], sz),
        lambda: _forward_group("patched Llama forward", "Llama", llama_model(*sz.llama), sz.llama[-1], sz),
        partial(_generate_group, sz)]}
