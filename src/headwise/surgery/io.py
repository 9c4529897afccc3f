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
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import hosts
from .layers import read
from .weights import as_projections, zeros_like

__all__ = ["save_pretrained", "load_pretrained", "SIDECAR", "head_shapes"]

SIDECAR = "headwise_surgery.json"
FORMAT = 2
# The largest sidecar or weights index read (either is a few KiB for any real model).
JSON_LIMIT_BYTES = 16 * 2**20


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
    """``{layer name: {"class", "n_heads", "n_kv_heads", "d_head"}}`` for every attention module of ``model``
    that :func:`headwise.interop.patch` takes over, named as :func:`headwise.interop.layers` names them (the model
    is patched for the reading, and unpatched again, when it is not already)."""
    with _patched(model) as views:
        return {name: {"class": _class(v), **dict(zip(("n_heads", "n_kv_heads", "d_head"), v.head_params()))}
                for name, v in views.items()}


def save_pretrained(model: nn.Module, directory: str | Path, **kwargs: Any) -> bool:
    """``model.save_pretrained(directory, **kwargs)`` plus the :data:`SIDECAR` of head counts.

    Returns whether plain ``type(model).from_pretrained(directory)`` rebuilds it (else use
    :func:`load_pretrained`, which works in both cases).

    Shapes:
        the sidecar: {"format": 2, "plain_hf": bool, "modules": {name: {class, n_heads, n_kv_heads, d_head}}}
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_pretrained: expected a Hugging Face PreTrainedModel, got {type(model).__name__}")
    shapes = head_shapes(model)
    plain = hosts.rebuilds(model)
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
    return modules


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
    saved = _saved_shapes(_weight_files(directory))
    _read_json(directory / "config.json", "config")  # a regular, readable file (from_pretrained reads it again)
    config = model_class.config_class.from_pretrained(str(directory))
    n_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(n_layers, int) and n_layers > len(modules):  # before the model is built: it would allocate them
        raise ValueError(f"load_pretrained: {directory / 'config.json'} has num_hidden_layers={n_layers}, but the "
                         f"sidecar records {len(modules)} attention modules")
    with hosts.quiet(), torch.device("meta"):  # every check on a model that allocates nothing
        probe = model_class(config)
    _resize(probe, modules, model_class.__name__)
    _check_saved(probe, modules, saved)

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        model_class.__init__(self, config, *args, **kwargs)
        _resize(self, modules, model_class.__name__)  # before transformers loads the weights into it

    resized = type(model_class.__name__, (model_class,), {"__init__": __init__, "__module__": model_class.__module__})
    model, info = _safetensors(directory, lambda d: resized.from_pretrained(d, output_loading_info=True, **extra),
                               plain=True)
    model.__class__ = model_class
    wrong = {k: list(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(wrong.values()):
        raise ValueError(f"load_pretrained: {directory} does not match the rebuilt model: "
                         + ", ".join(f"{k.replace('_', ' ')} {v[:5]}" for k, v in wrong.items() if v))
    return model.eval()


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


def _plain(model_class: type, directory: Path, extra: dict[str, Any]) -> nn.Module:
    """``model_class.from_pretrained``, a damaged safetensors file as a ValueError naming the folder."""
    return _safetensors(directory, lambda d: model_class.from_pretrained(d, **extra), plain=True).eval()
