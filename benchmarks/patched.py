"""Case "patched": a Hugging Face model patched by headwise against the same model unpatched (issue 15's
"no slowdown"), forward and greedy generation, on identical weights and inputs.

The two entries run identical weights through the same kernels (HF's sdpa layer against headwise's fused
path), so the paired ratio measures what patching adds: the headwise forward's Python and its plan.

Shapes:
    b: batch, s: sequence, d: hidden size, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import copy
from functools import partial

import torch

from .timing import Entry, Group, refresh_memory

__all__ = ["patched_groups", "llama_model", "gpt2_model", "forward_logits", "greedy", "LLAMA", "GPT2"]

#: (hidden, heads, kv heads, layers, intermediate, vocab): a small Llama-shaped decoder with GQA.
LLAMA = (1024, 16, 4, 4, 2816, 2048)
#: (n_embd, n_head, n_layer, vocab): a GPT-2-small-shaped decoder, fewer layers.
GPT2 = (768, 12, 4, 2048)
QUICK_LLAMA = (64, 4, 2, 2, 128, 128)
QUICK_GPT2 = (48, 4, 2, 128)


def llama_model(spec: tuple[int, ...]) -> torch.nn.Module:
    """A random-weight ``LlamaForCausalLM`` (sdpa) of ``spec`` = (hidden, heads, kv heads, layers, intermediate, vocab)."""
    import transformers

    d, h, h_kv, n, inter, vocab = spec
    cfg = transformers.LlamaConfig(hidden_size=d, num_attention_heads=h, num_key_value_heads=h_kv,
                                   num_hidden_layers=n, intermediate_size=inter, vocab_size=vocab,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def gpt2_model(spec: tuple[int, ...]) -> torch.nn.Module:
    import transformers

    d, h, n, vocab = spec
    cfg = transformers.GPT2Config(n_embd=d, n_head=h, n_layer=n, vocab_size=vocab, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _pair(build, spec):  # type: ignore[no-untyped-def]
    from headwise.interop import patch

    plain = build(spec)
    patched = patch(copy.deepcopy(plain))
    refresh_memory(plain, patched)
    return plain, patched


def forward_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def _forward_group(name: str, build, spec, b: int, s: int, rounds: int, block_s: float) -> Group:  # type: ignore[no-untyped-def]
    plain, patched = _pair(build, spec)
    ids = torch.randint(1, spec[-1], (b, s), generator=torch.Generator().manual_seed(1))
    es = [Entry("headwise (patched)", partial(forward_logits, patched, ids), role="headwise"),
          Entry(f"HF {name} sdpa (unpatched)", partial(forward_logits, plain, ids))]
    return Group("7 patched", f"patched {name} forward b{b} s{s}", es, rounds=rounds, block_s=block_s,
                 tol=(1e-4, 1e-4), meta={"model": name, "b": b, "s": s, "mode": "forward"})


def _generate_group(name: str, build, spec, s: int, n: int, rounds: int, block_s: float) -> Group:  # type: ignore[no-untyped-def]
    plain, patched = _pair(build, spec)
    ids = torch.randint(1, spec[-1], (1, s), generator=torch.Generator().manual_seed(2))
    es = [Entry("headwise (patched)", partial(greedy, patched, ids, n), role="headwise", number=1),
          Entry(f"HF {name} sdpa (unpatched)", partial(greedy, plain, ids, n), number=1)]
    # Greedy tokens must be identical; compared as tensors at zero tolerance.
    return Group("7 patched", f"patched {name} generate {n} tokens from {s}", es, rounds=rounds,
                 block_s=block_s, tol=(0.0, 0.0), meta={"model": name, "s": s, "new": n, "mode": "generate"})


def patched_groups(sz, *, hf: bool = True) -> list:  # type: ignore[no-untyped-def]
    """The patched-vs-unpatched groups (empty without transformers or with ``--no-hf``)."""
    from .peers import hf_available

    if not hf or hf_available() is not None:
        return []
    quick = sz.rounds < 5
    llama, gpt2 = (QUICK_LLAMA, QUICK_GPT2) if quick else (LLAMA, GPT2)
    b, s, prompt, new = (1, 8, 4, 4) if quick else (4, 256, 64, 32)
    rounds = sz.rounds
    return [partial(_forward_group, "Llama", llama_model, llama, b, s, rounds, sz.block_s),
            partial(_forward_group, "GPT-2", gpt2_model, gpt2, b, s, rounds, sz.block_s),
            # One generate is one timed call: three times the rounds, so each median is over more than 5 calls.
            partial(_generate_group, "Llama", llama_model, llama, prompt, new, 3 * rounds, sz.block_s),
            partial(_generate_group, "GPT-2", gpt2_model, gpt2, prompt, new, 3 * rounds, sz.block_s)]
