"""A Hugging Face model changed by surgery, to a folder and back.

:func:`save_pretrained` runs the model's own ``save_pretrained`` (a patched model saves under its own
names) and writes ``headwise_surgery.json`` beside it: the head counts of every attention module. Where the
config says it all (a Llama-family model whose layers all have the same counts: ``num_attention_heads`` /
``num_key_value_heads``), plain ``from_pretrained`` loads the folder; otherwise (different counts per
layer, and any pruned BERT or GPT-2: their configs derive the head width from the head count, and this
transformers has no ``pruned_heads``) :func:`load_pretrained` builds the model from its config, resizes each
recorded module, and loads the weights, refusing (``ValueError`` naming what) what it cannot rebuild.

Shapes:
    per module: n_heads h, n_kv_heads h_kv, d_head d_h
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .layers import sync_llama_config, write_host
from .weights import HeadWeights

__all__ = ["save_pretrained", "load_pretrained", "SIDECAR", "head_shapes"]

SIDECAR = "headwise_surgery.json"
FORMAT = 1


def _families() -> dict[str, tuple[type, ...]]:
    from ..interop import hf_bert, hf_gpt2, hf_llama

    return {"bert": hf_bert.classes(), "gpt2": hf_gpt2.classes(), "llama": hf_llama.classes()}


def _family(module: nn.Module) -> str | None:
    for name, classes in _families().items():
        if isinstance(module, classes):
            return name
    return None


def _shape(module: nn.Module, family: str) -> dict[str, int]:
    if family == "bert":
        sa = module.self
        return {"n_heads": sa.num_attention_heads, "n_kv_heads": sa.num_attention_heads, "d_head": sa.attention_head_size}
    if family == "gpt2":
        return {"n_heads": module.num_heads, "n_kv_heads": module.num_heads, "d_head": module.head_dim}
    d_h = module.head_dim
    return {"n_heads": module.q_proj.weight.shape[0] // d_h, "n_kv_heads": module.k_proj.weight.shape[0] // d_h,
            "d_head": d_h}


def head_shapes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{module name: {"family", "n_heads", "n_kv_heads", "d_head"}}`` for every BERT / GPT-2 / Llama-family
    attention module of ``model`` (patched or not; cross-attention included as found)."""
    out = {}
    for name, module in model.named_modules():
        family = _family(module)
        if family is not None:
            out[name] = {"family": family, **_shape(module, family)}
    return out


def _plain_loadable(model: nn.Module, shapes: dict[str, dict[str, Any]]) -> bool:
    """Whether the config alone rebuilds every recorded module's head counts."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    for s in shapes.values():
        if s["family"] == "llama":
            want = (cfg.num_attention_heads, cfg.num_key_value_heads)
        else:
            h = cfg.num_attention_heads if s["family"] == "bert" else cfg.n_head
            want = (h, h)
        if (s["n_heads"], s["n_kv_heads"]) != want:
            return False
    return True


def save_pretrained(model: nn.Module, directory: str | Path, **kwargs: Any) -> bool:
    """``model.save_pretrained(directory, **kwargs)`` plus the :data:`SIDECAR` of head counts.

    Returns whether plain ``type(model).from_pretrained(directory)`` rebuilds it (else use
    :func:`load_pretrained`, which works in both cases).

    Shapes:
        the sidecar: {"format": 1, "plain_hf": bool, "modules": {name: {family, n_heads, n_kv_heads, d_head}}}
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_pretrained: expected a Hugging Face PreTrainedModel, got {type(model).__name__}")
    shapes = head_shapes(model)
    plain = _plain_loadable(model, shapes)
    model.save_pretrained(directory, **kwargs)
    sidecar = {"format": FORMAT, "plain_hf": plain, "modules": shapes}
    (Path(directory) / SIDECAR).write_text(json.dumps(sidecar, indent=1))
    return plain


def _state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(directory / f)))
        return state
    raise ValueError(f"load_pretrained: {directory} has neither model.safetensors nor model.safetensors.index.json "
                     "(save with safe_serialization, the default)")


def load_pretrained(directory: str | Path, model_class: type, *, attn_implementation: str | None = None) -> nn.Module:
    """Load a folder written by :func:`save_pretrained` (or any ``save_pretrained`` folder) into ``model_class``.

    Without a sidecar, or when the sidecar says the config suffices, this is ``model_class.from_pretrained``.
    Otherwise the model is built from its config, every recorded module is resized to its head counts, and the
    saved weights are loaded strictly (tied weights re-tied). Returns the model in eval mode, unpatched.

    Args:
        directory: the folder.
        model_class: a transformers model class (e.g. ``BertModel``, ``LlamaForCausalLM``).
        attn_implementation: ``"eager"`` or ``"sdpa"`` (default: transformers' choice).

    Shapes:
        each recorded module: (d, n_heads, n_kv_heads, d_head) as in the sidecar
    """
    directory = Path(directory)
    if not (isinstance(model_class, type) and hasattr(model_class, "from_pretrained")
            and hasattr(model_class, "config_class")):
        raise TypeError(f"load_pretrained: model_class must be a transformers model class, got {model_class!r}")
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    path = directory / SIDECAR
    if not path.exists():
        return model_class.from_pretrained(str(directory), **extra).eval()
    sidecar = json.loads(path.read_text())
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT or not isinstance(sidecar.get("modules"), dict):
        raise ValueError(f"load_pretrained: {path} is not a headwise surgery sidecar of format {FORMAT} "
                         f"(got format {sidecar.get('format') if isinstance(sidecar, dict) else type(sidecar).__name__})")
    if sidecar.get("plain_hf"):
        return model_class.from_pretrained(str(directory), **extra).eval()
    config = model_class.config_class.from_pretrained(str(directory))
    model = model_class(config)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    for name, shape in sidecar["modules"].items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"load_pretrained: the sidecar names module {name!r}, which {model_class.__name__} "
                             "built from this config does not have") from None
        family = _family(module)
        if family != shape.get("family"):
            raise ValueError(f"load_pretrained: module {name!r} is a {type(module).__name__} ({family}); the sidecar "
                             f"recorded a {shape.get('family')} attention module")
        now = _shape(module, family)
        if now["d_head"] != shape["d_head"]:
            raise ValueError(f"load_pretrained: module {name!r} has d_head={now['d_head']} from the config; the "
                             f"sidecar recorded d_head={shape['d_head']}: head widths cannot be rebuilt")
        h, h_kv = shape["n_heads"], shape["n_kv_heads"]
        if not (isinstance(h, int) and isinstance(h_kv, int) and 1 <= h_kv <= h and h % h_kv == 0):
            raise ValueError(f"load_pretrained: module {name!r}: n_heads={h!r}, n_kv_heads={h_kv!r} is not a valid "
                             "head grouping")
        if (h, h_kv) != (now["n_heads"], now["n_kv_heads"]):
            write_host(module, family, _zeros(module, family, h, h_kv, shape["d_head"]))
    sync_llama_config(model)
    _load_weights(model, _state_dict(directory), directory)
    return model.eval()


def _zeros(module: nn.Module, family: str, h: int, h_kv: int, d_h: int) -> HeadWeights:
    if family == "bert":
        q, o = module.self.query, module.output.dense
        d, k_in, v_in, bias, out_bias = q.weight.shape[1], q.weight.shape[1], q.weight.shape[1], q.bias is not None, \
            o.bias is not None
    elif family == "gpt2":
        d = module.embed_dim
        k_in = v_in = d
        bias = out_bias = True
    else:
        d, k_in, v_in = module.q_proj.weight.shape[1], module.k_proj.weight.shape[1], module.v_proj.weight.shape[1]
        bias, out_bias = module.q_proj.bias is not None, module.o_proj.bias is not None

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape)

    return HeadWeights(z(h * d_h, d), z(h * d_h) if bias else None, z(h_kv * d_h, k_in), z(h_kv * d_h) if bias else None,
                       z(h_kv * d_h, v_in), z(h_kv * d_h) if bias else None, z(d, h * d_h), z(d) if out_bias else None,
                       h, h_kv, d_h)


def _load_weights(model: nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise ValueError(f"load_pretrained: the weights in {directory} do not fit the rebuilt model: {e}") from None
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
    if untied or unexpected:
        raise ValueError(f"load_pretrained: {directory} does not match the rebuilt model: missing {untied[:5]}"
                         f"{'...' if len(untied) > 5 else ''}, unexpected {list(unexpected)[:5]}")
