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
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .layers import sync_llama_config, write_host
from .weights import HeadWeights

__all__ = ["save_pretrained", "load_pretrained", "SIDECAR", "head_shapes"]

SIDECAR = "headwise_surgery.json"
FORMAT = 1
FAMILIES = ("bert", "gpt2", "llama")
# The largest sidecar or weights index read (either is a few KiB for any real model).
JSON_LIMIT_BYTES = 16 * 2**20


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


def _read_json(path: Path, what: str) -> Any:
    """The JSON in ``path`` (a regular file of at most :data:`JSON_LIMIT_BYTES`), else ``ValueError`` naming it.

    The file type comes from ``stat`` before anything is opened (a FIFO would block the read)."""
    try:
        info = path.stat()
    except OSError as exc:
        raise ValueError(f"load_pretrained: cannot read the {what} {str(path)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"load_pretrained: the {what} {str(path)!r} is not a regular file")
    if info.st_size > JSON_LIMIT_BYTES:
        raise ValueError(f"load_pretrained: the {what} {str(path)!r} is {info.st_size} bytes, more than the "
                         f"{JSON_LIMIT_BYTES} it can be")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as exc:  # ValueError: JSONDecodeError, digits
        raise ValueError(f"load_pretrained: the {what} {str(path)!r} is not readable JSON: "
                         f"{type(exc).__name__}: {exc}") from None


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of ``directory``: ``model.safetensors``, or the shards its index names (each a
    regular file directly in ``directory``: an index cannot point outside the folder)."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        data = _read_json(index, "weights index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"load_pretrained: {str(index)!r}: 'weight_map' must map weight names to shard file "
                             f"names, got {type(weight_map).__name__}")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if n in ("", ".", "..") or Path(n).name != n or "\\" in n]
        if outside:
            raise ValueError(f"load_pretrained: {str(index)!r}: 'weight_map' names shard {outside[0]!r}, which is not "
                             "a file name in the folder (shards sit beside the index)")
        files = [directory / n for n in names]
    else:
        raise ValueError(f"load_pretrained: {directory} has neither model.safetensors nor "
                         "model.safetensors.index.json (save with safe_serialization, the default)")
    for f in files:
        try:
            regular = stat.S_ISREG(f.stat().st_mode)
        except OSError as exc:
            raise ValueError(f"load_pretrained: weight file {str(f)!r}: {exc.strerror or exc}") from None
        if not regular:
            raise ValueError(f"load_pretrained: weight file {str(f)!r} is not a regular file")
    return files


def _safetensors(f: Path, read: Any, *, plain: bool = False) -> Any:
    """``read(f)`` with safetensors' own errors (a damaged header, a truncated file) as one ValueError naming
    ``f``; unless ``plain`` (transformers' loader, whose other errors say what they are), so are the OSError,
    ValueError and RuntimeError of reading it."""
    foreseen = () if plain else (OSError, ValueError, RuntimeError)
    try:
        return read(str(f))
    except Exception as exc:  # safetensors' SafetensorError derives from Exception only
        if not (isinstance(exc, foreseen) or type(exc).__name__ == "SafetensorError"):
            raise
        raise ValueError(f"load_pretrained: {'the weights in' if plain else 'weight file'} {str(f)!r}: not a "
                         f"readable safetensors file: {exc}") from None


def _saved_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every saved tensor's shape, from the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    def header(path: str) -> dict[str, tuple[int, ...]]:
        with safe_open(path, "pt") as sf:
            return {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()}

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(_safetensors(f, header))
    return shapes


def _state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_safetensors(f, load_file))
    return state


def _check_sidecar(sidecar: Any, path: Path) -> dict[str, dict[str, Any]]:
    """The sidecar's ``modules``, every field checked: ``ValueError`` naming the first one that is wrong."""
    if not isinstance(sidecar, dict) or type(sidecar.get("format")) is not int or sidecar["format"] != FORMAT:
        got = sidecar.get("format") if isinstance(sidecar, dict) else type(sidecar).__name__
        raise ValueError(f"load_pretrained: {path} is not a headwise surgery sidecar of format {FORMAT} "
                         f"(got format {got!r})")
    if not isinstance(sidecar.get("plain_hf", False), bool):
        raise ValueError(f"load_pretrained: {path}: 'plain_hf' must be true or false, got {sidecar['plain_hf']!r}")
    modules = sidecar.get("modules")
    if not isinstance(modules, dict):
        raise ValueError(f"load_pretrained: {path}: 'modules' must be an object of module name -> head counts, "
                         f"got {type(modules).__name__}")
    for name, shape in modules.items():
        where = f"load_pretrained: {path}: modules[{name!r}]"
        if not isinstance(shape, dict):
            raise ValueError(f"{where} must be an object with family, n_heads, n_kv_heads, d_head, got "
                             f"{type(shape).__name__}")
        if shape.get("family") not in FAMILIES:
            raise ValueError(f"{where}.family must be one of {list(FAMILIES)}, got {shape.get('family')!r}")
        for key in ("n_heads", "n_kv_heads", "d_head"):
            value = shape.get(key)
            if type(value) is not int or value < 1:
                raise ValueError(f"{where}.{key} must be a positive int, got {value!r}")
        h, h_kv = shape["n_heads"], shape["n_kv_heads"]
        if h_kv > h or h % h_kv:
            raise ValueError(f"load_pretrained: module {name!r}: n_heads={h!r}, n_kv_heads={h_kv!r} is not a valid "
                             "head grouping")
    return modules


def _check_saved(name: str, family: str, shape: dict[str, int], saved: dict[str, tuple[int, ...]]) -> None:
    """The recorded head counts must be those of the saved weights (checked before a module is resized)."""
    h, h_kv, d_h = shape["n_heads"], shape["n_kv_heads"], shape["d_head"]
    if family == "gpt2":
        want = {f"{name}.c_attn.weight": (1, 3 * h * d_h)}  # Conv1D: (d, 3 h d_h)
    elif family == "bert":
        want = {f"{name}.self.query.weight": (0, h * d_h), f"{name}.self.key.weight": (0, h * d_h)}
    else:
        want = {f"{name}.q_proj.weight": (0, h * d_h), f"{name}.k_proj.weight": (0, h_kv * d_h)}
    for key, (dim, size) in want.items():
        got = saved.get(key)
        if got is None:
            raise ValueError(f"load_pretrained: the weights have no {key!r} for the recorded module {name!r}")
        if len(got) != 2 or got[dim] != size:
            raise ValueError(f"load_pretrained: module {name!r}: the sidecar's n_heads={h}, n_kv_heads={h_kv}, "
                             f"d_head={d_h} do not fit the saved {key!r} of shape {got}")


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
        return _plain(model_class, directory, extra)
    sidecar = _read_json(path, "sidecar")
    modules = _check_sidecar(sidecar, path)
    if sidecar.get("plain_hf"):
        return _plain(model_class, directory, extra)
    files = _weight_files(directory)
    saved = _saved_shapes(files)
    _read_json(directory / "config.json", "config")  # a regular, readable file (from_pretrained reads it again)
    config = model_class.config_class.from_pretrained(str(directory))
    n_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(n_layers, int) and n_layers > len(modules):  # before the model is built: it would allocate them
        raise ValueError(f"load_pretrained: {directory / 'config.json'} has num_hidden_layers={n_layers}, but the "
                         f"sidecar records {len(modules)} attention modules")
    model = model_class(config)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    for name, shape in modules.items():
        try:
            module = model.get_submodule(name)
        except (AttributeError, TypeError):
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
        _check_saved(name, family, shape, saved)
        if (h, h_kv) != (now["n_heads"], now["n_kv_heads"]):
            write_host(module, family, _zeros(module, family, h, h_kv, shape["d_head"]))
    sync_llama_config(model)
    _load_weights(model, _state_dict(files), directory)
    return model.eval()


def _plain(model_class: type, directory: Path, extra: dict[str, Any]) -> nn.Module:
    """``model_class.from_pretrained``, a damaged safetensors file as a ValueError naming the folder."""
    return _safetensors(directory, lambda d: model_class.from_pretrained(d, **extra), plain=True).eval()


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
