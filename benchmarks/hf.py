"""Hugging Face models patched by headwise (``headwise.interop.patch``) against the same models unpatched,
random weights: a BERT-shaped encoder's forward, a Llama-shaped decoder's forward and greedy generation, and
the same two for small models of the families of :data:`FAMILIES`.

Both sides read the same weight tensors (:func:`sharing_weights`) on identical inputs, so the ratio measures what
patching adds.

Shapes:
    b: batch, s: sequence, d: hidden size, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import partial
from typing import Callable

import torch

from .cases import Sizes
from .timing import Entry, Group

__all__ = ["bert_model", "llama_model", "family_model", "sharing_weights", "FAMILIES", "GENERATE_ROUNDS", "hf_groups"]

#: A generate group runs this many times the suite's rounds: one greedy generation is one timed block, whose time
#: varies by 10-15 % round to round on a shared VM, and the median's spread shrinks as the rounds' square root.
GENERATE_ROUNDS = 6


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


def family_model(model_type: str, d: int, h: int, layers: int, inter: int, vocab: int) -> torch.nn.Module:
    """A random-weight causal LM of ``model_type`` (a key of :data:`FAMILIES`), built with
    ``AutoConfig.for_model`` at these sizes, in its family's attention implementation."""
    import transformers

    extra, impl = FAMILIES[model_type][1:]
    cfg = transformers.AutoConfig.for_model(
        model_type, hidden_size=d, num_attention_heads=h, num_hidden_layers=layers, intermediate_size=inter,
        vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=impl,
        **extra(d, h, inter))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


#: Issue 27's families beyond BERT and Llama: model type -> (name, config beyond the common sizes given
#: (d, h, intermediate), attention implementation).
FAMILIES: dict[str, tuple[str, Callable[[int, int, int], dict], str]] = {
    "gpt2": ("GPT-2", lambda d, h, i: {"n_inner": i}, "sdpa"),
    "gemma2": ("Gemma 2", lambda d, h, i: {"num_key_value_heads": h // 2, "head_dim": d // h}, "eager"),
    "phi3": ("Phi-3", lambda d, h, i: {}, "sdpa"),
    "gpt_neox": ("GPT-NeoX", lambda d, h, i: {}, "sdpa"),
    "opt": ("OPT", lambda d, h, i: {"ffn_dim": i, "word_embed_proj_dim": d}, "sdpa"),
    "mixtral": ("Mixtral", lambda d, h, i: {"num_key_value_heads": h // 2, "num_local_experts": 4,
                                            "num_experts_per_tok": 2}, "sdpa"),
    "deepseek_v3": ("DeepSeek-V3", lambda d, h, i: {
        "q_lora_rank": d // 2, "kv_lora_rank": d // 2, "qk_nope_head_dim": d // h, "qk_rope_head_dim": d // h // 2,
        "v_head_dim": d // h, "moe_intermediate_size": i // 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}, "sdpa"),
}


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _generate(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def sharing_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose modules are its own and whose parameters and buffers are ``model``'s tensors.

    Patching the copy leaves ``model`` unpatched, and the two read the same weight memory, so their ratio
    measures the code patching adds, not where a second copy of the weights happened to land."""
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _group(name: str, build: Callable[[], torch.nn.Module], generate: bool, sz: Sizes) -> Group:
    """``build()``'s model patched (a copy sharing its weights) against itself unpatched: a forward at
    ``sz.hf_batch`` or a greedy generation of ``sz.generate``; where ``patch`` refuses the model, only the
    unpatched entry, said in a note."""
    from headwise.interop import patch

    plain = build()
    try:
        patched, notes = patch(sharing_weights(plain)), []
    except (TypeError, ValueError) as exc:
        patched, notes = None, [f"headwise.interop.patch refused it: {str(exc).split(';')[0]}"]
    vocab = plain.config.vocab_size
    if generate:
        prompt, n = sz.generate
        ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(2))
        run, key, title = partial(_generate, n=n), f"patched {name} generate", f"{n} tokens from {prompt}"
    else:
        b, s = sz.hf_batch
        ids = torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(1))
        run, key, title = _forward, f"patched {name} forward", f"b{b} s{s}"
    number = 1 if generate or patched is None else None
    es = [Entry(f"HF {name} (unpatched)", partial(run, plain, ids), number=number,
                note=plain.config._attn_implementation)]
    if patched is not None:
        es.insert(0, Entry("headwise (patched)", partial(run, patched, ids), number=number))
    # the greedy tokens must be identical
    rounds = 1 if patched is None else GENERATE_ROUNDS * sz.rounds if generate else sz.rounds
    return Group(key, f"{key} {title}", es, base=es[-1].name, rounds=rounds, block_s=sz.block_s,
                 tol=(0.0, 0.0) if generate else (1e-4, 1e-4), notes=notes)


def hf_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """The patched-vs-unpatched factories by case: ``patched`` (BERT, Llama) and ``families`` (each of
    :data:`FAMILIES`, forward and generate); none without transformers."""
    if importlib.util.find_spec("transformers") is None:
        return {"patched": [], "families": []}
    bert, llama = partial(bert_model, *sz.bert), partial(llama_model, *sz.llama)
    families = [partial(_group, name, partial(family_model, t, *sz.family), generate, sz)
                for t, (name, *_) in FAMILIES.items() for generate in (False, True)]
    return {"patched": [partial(_group, "BERT", bert, False, sz), partial(_group, "Llama", llama, False, sz),
                        partial(_group, "Llama", llama, True, sz)], "families": families}
