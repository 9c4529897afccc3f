"""Tiny random Hugging Face models, one per supported family, shared by the interop tests (no download)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB = 40

# family -> (config class, model class, config kwargs); every family has GQA where it can and 2 layers.
FAMILIES = {
    "bert": ("BertConfig", "BertModel", dict(hidden_size=20, num_attention_heads=4, intermediate_size=16,
                                            max_position_embeddings=64, pad_token_id=0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=21, n_head=3, n_positions=64, bos_token_id=1,
                                                   eos_token_id=2, pad_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=2,
                                                      intermediate_size=32, max_position_embeddings=64)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(hidden_size=24, num_attention_heads=6,
                                                            num_key_value_heads=2, intermediate_size=32,
                                                            max_position_embeddings=64, sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=3,
                                                      intermediate_size=32, max_position_embeddings=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2,
                                                      head_dim=8, intermediate_size=32, max_position_embeddings=64)),
}
DECODERS = ["gpt2", "llama", "mistral", "qwen2", "qwen3"]
_MLA = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=7, kv_lora_rank=6,
            qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=5, intermediate_size=32, moe_intermediate_size=8,
            n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
            topk_group=1, max_position_embeddings=64)
# Multi-head latent attention (interface path; every width distinct so a wrong slice cannot line up). Not in
# FAMILIES, whose tests need adapter families.
LATENT = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _MLA),
          "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _MLA)}
# PEFT's usual LoRA targets per family.
LORA_TARGETS = {"bert": ["query", "value"], "gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"],
                "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "qwen3": ["q_proj", "v_proj"]}


def config(family: str, impl: str = "sdpa", **kw) -> transformers.PreTrainedConfig:
    cfg_cls, _, base = {**FAMILIES, **LATENT}[family]
    extra = {} if family in ("bert", "gpt2") else dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    layers = {"gpt2": "n_layer"}.get(family, "num_hidden_layers")
    return getattr(transformers, cfg_cls)(**{"vocab_size": VOCAB, "attn_implementation": impl, layers: 2, **base,
                                             **extra, **kw})


def build(family: str, impl: str = "sdpa", seed: int = 0, **kw) -> nn.Module:
    """The family's model in eval mode, with random (non-trivial) norms so QK-norm and LayerNorm matter."""
    torch.manual_seed(seed)
    model = getattr(transformers, {**FAMILIES, **LATENT}[family][1])(config(family, impl, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)  # HF inits norms to 1 and biases to 0: make the mapping visible
    return model


def inputs(seed: int = 0, b: int = 2, s: int = 6) -> dict[str, torch.Tensor]:
    """Token ids and a right-padded attention mask (row 1 has 2 padding positions)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s - 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def output(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor a user reads: logits for decoders, the last hidden state for BERT."""
    out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]
