"""A Hugging Face model changed by surgery, to a folder and back.

:func:`save_pretrained` runs the model's own ``save_pretrained`` (a patched model saves under its own
names) and writes ``headwise_surgery.json`` beside it: the head counts of every patched attention module. Where
the config says it all (every layer has the same counts and surgery could put them in the config: the model
class built from it has exactly the saved weight shapes, checked on the meta device), plain ``from_pretrained``
loads the folder; otherwise (different counts per layer, a config that derives the head width from the head
count, as BERT's and GPT-2's do) :func:`load_pretrained` resizes every recorded module through its view before
transformers' own ``from_pretrained`` loads the weights, refusing (``ValueError`` naming what) what it cannot
rebuild.

Shapes:
    per module: n_heads h, n_kv_heads h_kv, d_head d_h
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..module_calls import adapter_base
from . import hosts, origin
from .files import JSON_LIMIT_BYTES, aliased, read_json, safetensors_call, saved_shapes, weight_files
from .layers import read
from .probe import TooLarge, bounded, check_layers, check_loaded, check_shapes
from .weights import as_projections, zeros_like

__all__ = ["save_pretrained", "load_pretrained", "SIDECAR", "head_shapes", "shape_mismatch", "JSON_LIMIT_BYTES"]

SIDECAR = "headwise_surgery.json"
FORMAT = 2


def _class(view: Any) -> str:
    return type(view.host).__name__.removeprefix("Headwise")


def _views(model: nn.Module) -> dict[str, Any]:
    from ..interop import layers

    return {name: view for name, view in layers(model) if hosts.has_seam(view)}


@contextlib.contextmanager
def _patched(model: nn.Module):
    """``model``'s views: patched for the duration when it is not already (then unpatched again)."""
    from ..interop import patch, unpatch

    if _views(model):
        yield _views(model)
        return
    try:
        patch(model)
    except TypeError:  # nothing in it headwise patches: no head counts to record
        yield {}
        return
    try:
        yield _views(model)
    finally:
        unpatch(model)


def head_shapes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{layer name: {"class", "n_heads", "n_kv_heads", "d_head", "original_heads"}}`` for every attention module
    of ``model`` that :func:`headwise.interop.patch` takes over, named as :func:`headwise.interop.layers` names
    them (the model is patched for the reading, and unpatched again, when it is not already);
    ``original_heads`` is :func:`headwise.surgery.original_heads`'s record of the module."""
    with _patched(model) as views:
        return {name: {"class": _class(v), **dict(zip(("n_heads", "n_kv_heads", "d_head"), v.head_params())),
                       "original_heads": list(origin.of_layer(v))}
                for name, v in views.items()}


def save_pretrained(model: nn.Module, directory: str | Path, **kwargs: Any) -> bool:
    """``model.save_pretrained(directory, **kwargs)`` plus the :data:`SIDECAR` of head counts.

    Returns whether plain ``type(model).from_pretrained(directory)`` rebuilds it (else use
    :func:`load_pretrained`, which works in both cases).

    Args:
        model: the transformers model itself, patched or not; a wrapper (a PEFT model: ``merge_and_unload()``
            first) is refused with a ``TypeError`` before anything is written.
        directory: the folder to write.
        **kwargs: passed on to the model's own ``save_pretrained``.

    Shapes:
        the sidecar: {"format": 2, "plain_hf": bool, "modules": {name: {class, n_heads, n_kv_heads, d_head,
        original_heads}}}
    """
    # a wrapper's own save_pretrained (PEFT's writes only the adapter) would lose the resized attention weights
    if not isinstance(model, nn.Module) or hosts.transformers_model(model) is not model:
        inner = hosts.transformers_model(model) if isinstance(model, nn.Module) else None
        held = f" holding a {type(inner).__name__}" if inner is not None else ""
        raise TypeError(f"save_pretrained: expected the transformers model itself (a PreTrainedModel), got "
                        f"{type(model).__name__}{held}: for a PEFT model call merge_and_unload() first and save "
                        "the model it returns (else pass the transformers model inside the wrapper)")
    # an adapter left in the model is saved under its own names (q_proj.base_layer.weight, lora_A), which the
    # model's class does not have: no loader could read the folder back
    wrapped = [f"{name!r} ({type(m).__module__.split('.')[0]}.{type(m).__name__})"
               for name, m in model.named_modules()
               if adapter_base(m) is not None or isinstance(getattr(m, "original_module", None), nn.Module)]
    if wrapped:
        raise TypeError(f"save_pretrained: expected a model without adapters, got a {type(model).__name__} whose "
                        f"{', '.join(wrapped[:3])}{' ...' if len(wrapped) > 3 else ''} "
                        f"{'is' if len(wrapped) == 1 else 'are'} wrapped by an adapter (PEFT), whose weights "
                        f"{type(model).__name__} does not have: call merge_and_unload() on the PeftModel and save "
                        "the model it returns, or save the adapter alone with the PeftModel's own save_pretrained")
    shapes = head_shapes(model)
    plain = hosts.rebuilds(model)
    with hosts.quiet(messages=False):  # transformers' "Writing model shards" bar is not ours to show
        model.save_pretrained(directory, **kwargs)
    sidecar = {"format": FORMAT, "plain_hf": plain, "modules": shapes}
    (Path(directory) / SIDECAR).write_text(json.dumps(sidecar, indent=1))
    return plain


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
            raise ValueError(f"{where} must be an object with class, n_heads, n_kv_heads, d_head, got "
                             f"{type(shape).__name__}")
        if not isinstance(shape.get("class"), str):
            raise ValueError(f"{where}.class must be the attention module's class name, got {shape.get('class')!r}")
        for key in ("n_heads", "n_kv_heads", "d_head"):
            value = shape.get(key)
            if type(value) is not int or value < 1:
                raise ValueError(f"{where}.{key} must be a positive int, got {value!r}")
        h, h_kv = shape["n_heads"], shape["n_kv_heads"]
        if h_kv > h or h % h_kv:
            raise ValueError(f"load_pretrained: module {name!r}: n_heads={h!r}, n_kv_heads={h_kv!r} is not a valid "
                             "head grouping")
        heads = shape.get("original_heads")
        if heads is not None and not (isinstance(heads, list) and all(type(i) is int and i >= 0 for i in heads)
                and len(set(heads)) == len(heads) and (len(heads) == h or (heads == [] and h == 1))):
            raise ValueError(f"{where}.original_heads must list the original index of each of its {h} heads "
                             f"(distinct ints >= 0; [] for the placeholder of an emptied layer), got {heads!r}")
    return modules


def load_pretrained(directory: str | Path, model_class: type, *, attn_implementation: str | None = None) -> nn.Module:
    """Load a folder written by :func:`save_pretrained` (or any ``save_pretrained`` folder) into ``model_class``.

    Without a sidecar, or when the sidecar says the config suffices, this is ``model_class.from_pretrained``.
    Otherwise the model is built from its config, every recorded module is resized to its head counts, and the
    saved weights are loaded strictly (tied weights re-tied). Either way each module gets back its record of
    original head indices (:func:`headwise.surgery.original_heads`). Returns the model in eval mode, unpatched.

    Args:
        directory: the folder.
        model_class: a transformers model class (e.g. ``BertModel``, ``LlamaForCausalLM``), or an ``AutoModel*``
            class (then the class it builds from the folder's ``config.json``).
        attn_implementation: ``"eager"`` or ``"sdpa"`` (default: transformers' choice).

    Shapes:
        each recorded module: (d, n_heads, n_kv_heads, d_head) as in the sidecar
    """
    if attn_implementation is not None and not isinstance(attn_implementation, (str, dict)):
        raise TypeError(f"load_pretrained: attn_implementation must be a str (\"eager\", \"sdpa\"), a dict of them "
                        f"(a composite model's parts) or None, got {type(attn_implementation).__name__} "
                        f"{attn_implementation!r}")
    directory = Path(directory)
    model_class = _concrete(model_class, directory)
    # a folder, whatever the class: transformers would take a missing one for a hub repo id
    read_json(directory / "config.json", "config")
    if (directory / "adapter_config.json").exists():  # transformers would load the adapter into the model and
        # report the adapter's weights in place of the model's (a weight of another shape would pass unseen)
        raise ValueError(f"load_pretrained: {directory} also holds a PEFT adapter (adapter_config.json): expected a "
                         "folder of the model alone; load the model from a folder without the adapter, then the "
                         "adapter with peft.PeftModel.from_pretrained(model, adapter_folder)")
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    path = directory / SIDECAR
    if not path.exists():
        return _plain(model_class, directory, extra, {})
    sidecar = read_json(path, "sidecar")
    modules = _check_sidecar(sidecar, path)
    if sidecar.get("plain_hf"):
        return _plain(model_class, directory, extra, modules, sidecar=True)
    saved = saved_shapes(weight_files(directory))
    config = model_class.config_class.from_pretrained(str(directory))
    probe = _probe(model_class, config, directory, saved)
    modules = _renamed(modules, probe)
    _resize(probe, modules, model_class.__name__)
    # on the resized probe: a per-head list inside an attention module (StableLM's q_layernorm.norms) has the
    # saved head count only once resized, where the config-sized probe would take its dropped heads for layers
    check_layers(probe, saved, model_class.__name__, config, directory)
    _check_saved(probe, modules, saved)
    check_shapes(probe, saved, directory, "the rebuilt model")

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        model_class.__init__(self, config, *args, **kwargs)
        _resize(self, modules, model_class.__name__)  # before transformers loads the weights into it

    resized = type(model_class.__name__, (model_class,), {"__init__": __init__, "__module__": model_class.__module__})
    with hosts.quiet(messages=False):
        model, info = safetensors_call(directory, lambda d: resized.from_pretrained(  # as in _plain
            d, output_loading_info=True, ignore_mismatched_sizes=True, **extra), plain=True)
    model.__class__ = model_class
    check_loaded(model, info, directory, "the rebuilt model")
    return _with_origins(model.eval(), modules)


def _probe(model_class: type, config: Any, directory: Path, saved: dict[str, tuple[int, ...]]) -> nn.Module:
    """``model_class(config)`` on the meta device, bounded by the saved weights: every check on a model that
    allocates nothing."""
    with hosts.quiet(), torch.device("meta"), bounded(model_class, config, directory, len(saved)):
        return model_class(config)


def _concrete(model_class: Any, directory: Path) -> type:
    """``model_class``, or for an ``AutoModel*`` class the transformers class it builds from ``config.json``."""
    if isinstance(model_class, type) and hasattr(model_class, "from_pretrained") and hasattr(model_class,
                                                                                              "config_class"):
        return model_class
    if not (isinstance(model_class, type) and hasattr(model_class, "from_pretrained")
            and hasattr(model_class, "from_config")):
        raise TypeError(f"load_pretrained: model_class must be a transformers model class (e.g. BertModel) or an "
                        f"AutoModel* class, got {model_class!r}")
    from transformers import AutoConfig

    read_json(directory / "config.json", "config")
    config = AutoConfig.from_pretrained(str(directory))
    try:
        bound = bounded(model_class, config, directory, len(saved_shapes(weight_files(directory))))
    except ValueError:  # no safetensors weights to bound it by: transformers' own loader says what it finds
        bound = contextlib.nullcontext()
    try:
        with hosts.quiet(), torch.device("meta"), bound:  # which class it builds; nothing is allocated
            return type(model_class.from_config(config))
    except TooLarge:
        raise
    except ValueError as exc:  # this Auto class has no model for the config's family
        raise ValueError(f"load_pretrained: {model_class.__name__} builds no model from "
                         f"{str(directory / 'config.json')!r}: {exc}") from None


def _renamed(modules: dict[str, dict[str, Any]], model: nn.Module) -> dict[str, dict[str, Any]]:
    """The sidecar's module names as ``model`` names them: a base model saved and loaded into a task class (or
    the other way round) differs by the base model's prefix (``bert.``, ``model.``)."""
    names = {name for name, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = {}
    for name, shape in modules.items():
        tries = [name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")] if prefix else [name]
        out[next((t for t in tries if t in names), name)] = shape  # unknown names: _resize says which
    return out


def _with_origins(model: nn.Module, modules: dict[str, dict[str, Any]]) -> nn.Module:
    """``model`` with each recorded module's original head indices put back on it."""
    found = dict(model.named_modules())
    for name, shape in _renamed(modules, model).items():
        heads = shape.get("original_heads")
        if name in found and heads is not None and heads != list(range(shape["n_heads"])):
            origin.record(found[name], tuple(heads))
    return model


def _resize(model: nn.Module, modules: dict[str, dict[str, Any]], cls: str) -> None:
    """Resize every recorded module of the freshly built ``model`` to its recorded counts, through its view."""
    from ..interop import patch, unpatch

    patch(model)
    try:
        views = _views(model)
        todo = []
        for name, shape in modules.items():
            view = views.get(name)
            if view is None:
                raise ValueError(f"load_pretrained: the sidecar names module {name!r}, which {cls} built from this "
                                 f"config does not have as a patched attention module (it has {list(views)[:4]}...)")
            if _class(view) != shape["class"]:
                raise ValueError(f"load_pretrained: module {name!r} is a {_class(view)}; the sidecar recorded a "
                                 f"{shape['class']}")
            h, h_kv, d_h = view.head_params()
            if d_h != shape["d_head"]:
                raise ValueError(f"load_pretrained: module {name!r} has d_head={d_h} from the config; the sidecar "
                                 f"recorded d_head={shape['d_head']}: head widths cannot be rebuilt")
            want = (shape["n_heads"], shape["n_kv_heads"])
            if want != (h, h_kv):
                why = view.edit_refusal(*want)
                if why:
                    raise ValueError(f"load_pretrained: module {name!r}: {why}")
                todo.append((view, want))
    finally:
        unpatch(model)
    for view, (h, h_kv) in todo:
        view.write_heads(as_projections(zeros_like(read(view), h, h_kv)), h, h_kv)


def _check_saved(probe: nn.Module, modules: dict[str, dict[str, Any]], saved: dict[str, tuple[int, ...]]) -> None:
    """The recorded head counts must give the saved weights' shapes (checked on the meta-device model)."""
    shapes = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
    saved = aliased(saved, probe)
    for name, shape in modules.items():
        scope = [k for k in shapes if k.startswith(name + ".")] or \
            [k for k in shapes if k.startswith(name.rpartition(".")[0] + ".")]
        found = [k for k in scope if k in saved]
        if not found:
            raise ValueError(f"load_pretrained: the weights have none of {scope[:3]} for the recorded module {name!r}")
        for key in found:
            if saved[key] != shapes[key]:
                raise ValueError(f"load_pretrained: module {name!r}: the sidecar's n_heads={shape['n_heads']}, "
                                 f"n_kv_heads={shape['n_kv_heads']}, d_head={shape['d_head']} do not fit the saved "
                                 f"{key!r} of shape {saved[key]} (they give {shapes[key]})")


def shape_mismatch(directory: str | Path, model_class: type) -> str:
    """Why plain ``model_class.from_pretrained(directory)`` cannot load the folder's safetensors weights, in
    words (``""`` when their shapes are those ``config.json`` gives, or the folder has no safetensors weights):
    the first weight of another shape, and what to do when heads were removed. Built on the meta device."""
    directory = Path(directory)
    try:
        files = weight_files(directory)
    except ValueError:  # no safetensors weights: transformers' own loader says what it finds
        return ""
    saved = saved_shapes(files)
    read_json(directory / "config.json", "config")
    config = model_class.config_class.from_pretrained(str(directory))
    with hosts.quiet(), torch.device("meta"):
        probe = model_class(config)
    saved = aliased(saved, probe)
    with _patched(probe) as views:
        attention = tuple(f"{name}." for name in views)
    for key, value in probe.state_dict().items():
        if key in saved and saved[key] != tuple(value.shape):
            shapes = (f"{key!r} has shape {saved[key]} where config.json gives {model_class.__name__} "
                      f"{tuple(value.shape)}")
            if not key.startswith(attention):
                return f"config.json in {str(directory)!r} does not describe these weights: {shapes}"
            if (directory / SIDECAR).exists():
                return (f"this checkpoint was changed by head surgery, which config.json does not describe: load "
                        f"it with headwise.surgery.load_pretrained(folder, model_class) (its {SIDECAR} records the "
                        f"heads each layer keeps); {shapes}")
            return (f"this checkpoint was changed by head surgery (heads removed or regrouped) and saved without "
                    f"the {SIDECAR} that says how many heads each layer keeps: save the changed model with "
                    f"headwise.surgery.save_pretrained and load it with headwise.surgery.load_pretrained; {shapes}")
    return ""


def _plain(model_class: type, directory: Path, extra: dict[str, Any], modules: dict[str, dict[str, Any]], *,
           sidecar: bool = False) -> nn.Module:
    """``model_class.from_pretrained`` (a weight of another shape than config.json gives, or a damaged
    safetensors file, as a ValueError naming it), with the sidecar's original head indices put back; a folder
    with a sidecar is held to what the rebuilt path checks (:func:`headwise.surgery.probe.check_loaded`)."""
    what = f"{model_class.__name__} built from its config.json"
    if not sidecar:
        why = shape_mismatch(directory, model_class)
        if why:
            raise ValueError(f"load_pretrained: {why}")
    elif (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        saved = saved_shapes(weight_files(directory))
        config = model_class.config_class.from_pretrained(str(directory))
        check_shapes(_probe(model_class, config, directory, saved), saved, directory, what)
    # ignore_mismatched_sizes: a weight of another shape the checks above could not see (a key transformers'
    # loader converts) comes back in the load report, for check_loaded to name, not as its RuntimeError
    with hosts.quiet(messages=False):
        model, info = safetensors_call(directory, lambda d: model_class.from_pretrained(
            d, output_loading_info=True, ignore_mismatched_sizes=True, **extra), plain=True)
    if sidecar:  # saved by save_pretrained, so checked as the rebuilt path checks; any other folder is transformers'
        check_loaded(model, info, directory, what)
    else:  # what it lacks is initialised, as from_pretrained does; a weight of another shape is not
        check_loaded(model, {"mismatched_keys": info.get("mismatched_keys")}, directory, what)
    return _with_origins(model.eval(), modules)
