"""Tiny random Hugging Face models (GPT-2, Llama with GQA, BERT) and what plain PyTorch hooks on the
*unpatched* model see: the independent reference of tests/test_trace.py, tests/test_patching.py and the viz
tests. No download: every model is built from a config."""

from __future__ import annotations

import copy

import torch
from torch import nn

VOCAB = 40


def gpt2(impl: str = "eager") -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_layer=2, n_positions=64, n_embd=24, n_head=4,
                                  attn_implementation=impl, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama(impl: str = "eager") -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=impl, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def bert(impl: str = "eager") -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=20, num_attention_heads=4, num_hidden_layers=2,
                                  intermediate_size=16, max_position_embeddings=64, attn_implementation=impl,
                                  pad_token_id=0)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


BUILDERS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def w_o_modules(model: nn.Module) -> list[nn.Module]:
    """The module whose *input* is the heads' concatenated context, per layer, on the unpatched model."""
    name = type(model).__name__
    if name.startswith("GPT2"):
        return [block.attn.c_proj for block in model.transformer.h]
    if name.startswith("Llama"):
        return [layer.self_attn.o_proj for layer in model.model.layers]
    return [layer.attention.output.dense for layer in model.encoder.layer]


def w_o(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_O as (d, h * d_h) in nn.Linear order, bias) of a c_proj (Conv1D, stored (in, out)) or nn.Linear."""
    if type(module).__name__ == "Conv1D":
        return module.weight.T, module.bias
    return module.weight, module.bias


def inputs(model: nn.Module, b: int = 2, s: int = 6, seed: int = 0, pad: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if pad and b > 1:
        mask[1, s - 2:] = 0  # right padding on the second row
    return {"input_ids": ids, "attention_mask": mask}


def hooked_run(model: nn.Module, kw: dict, n_heads: int, edit: dict | None = None, **extra):
    """Run the unpatched ``model`` with forward pre-hooks on every W_O module: returns (output, z per layer
    as (b, s, h, d_h), attention output per layer (b, s, d)). ``edit`` maps (layer, head) to a function of
    the head's slice (b, s, d_h) applied to W_O's input (the reference of a trace edit)."""
    zs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    handles = []
    for li, mod in enumerate(w_o_modules(model)):
        def pre(m, args, li=li):
            x = args[0]
            b, s, inner = x.shape
            z = x.reshape(b, s, n_heads, inner // n_heads)
            if edit:
                z = z.clone()
                for (l, h), fn in edit.items():
                    if l == li:
                        z[:, :, h] = fn(z[:, :, h])
            zs.append(z)
            return (z.reshape(b, s, inner),)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(lambda m, a, out: outs.append(out)))
    try:
        with torch.no_grad():
            out = model(**kw, **extra)
    finally:
        for hd in handles:
            hd.remove()
    return out, zs, outs


def twin(model: nn.Module) -> nn.Module:
    """An unpatched copy with the same weights (taken before patching the original)."""
    return copy.deepcopy(model)


def traced_twice(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict[bool, tuple]:
    """Two calls of a patched ``model`` inside one capture-and-edit trace (z captured, head 2 of layer 1 zeroed),
    eagerly (key False) and compiled whole with ``fullgraph=True`` (key True): {compiled: (trace, logits of the
    first call)}. The compiled calls must share one graph: the trace's per-call checks trace once."""
    import headwise
    from torch._dynamo.testing import CompileCounter

    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        run = torch.compile(model, backend=counter, fullgraph=True) if compiled else model
        with torch.no_grad(), headwise.trace(model, capture=("z",), edit={(1, 2): "zero"}) as t:
            logits = run(ids, attention_mask=mask).logits
            frames = counter.frame_count
            run(ids, attention_mask=mask)
            assert counter.frame_count == frames  # one graph for both calls
        runs[compiled] = t, logits
    return runs
