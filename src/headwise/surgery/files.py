"""Reading a ``save_pretrained`` folder without trusting it: its JSON files (regular files of bounded size,
checked by type before they are opened, so a FIFO cannot block), its safetensors files (only those in the
folder) and their tensor shapes (from the headers: nothing is loaded).

Shapes:
    saved shapes: {weight name: shape}
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["JSON_LIMIT_BYTES", "read_json", "weight_files", "safetensors_call", "saved_shapes", "aliased",
           "key_prefixes"]

# The largest sidecar or weights index read (either is a few KiB for any real model).
JSON_LIMIT_BYTES = 16 * 2**20


def read_json(path: Path, what: str) -> Any:
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


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of ``directory``: ``model.safetensors``, or the shards its index names (each a
    regular file directly in ``directory``: an index cannot point outside the folder)."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        data = read_json(index, "weights index")
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


def safetensors_call(f: Path, read: Any, *, plain: bool = False) -> Any:
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


def saved_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every saved tensor's shape, from the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    def header(path: str) -> dict[str, tuple[int, ...]]:
        with safe_open(path, "pt") as sf:
            return {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()}

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(safetensors_call(f, header))
    return shapes


def aliased(saved: dict[str, tuple[int, ...]], model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``saved`` under ``model``'s key names too: the names transformers' loader gives a checkpoint's keys
    (a family saved in its original layout: NemotronH's ``backbone.`` is the model's ``model.``), and a checkpoint
    of a task model seen by its base model (keys without the ``bert.`` / ``model.`` prefix), or a base model's
    seen by a task model (keys with it)."""
    rename = _loaded_name(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = dict(saved)
    for key, shape in saved.items():
        for name in dict.fromkeys((key, rename(key))):
            out.setdefault(name, shape)
            if prefix:
                out.setdefault(name.removeprefix(f"{prefix}."), shape)
                out.setdefault(f"{prefix}.{name}", shape)
    return out


def _loaded_name(model: nn.Module) -> Any:
    """key -> the name transformers' loader renames a checkpoint key to for ``model`` (the key itself where it
    renames nothing). Renamings only: a converter (experts fused, a qkv split) changes the shape as well, so its
    output name would pair a saved shape with a weight of another shape."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # pragma: no cover - transformers 5 has both; without it there is nothing to rename
        return lambda key: key
    if not hasattr(model, "config"):
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, [])[0]


def key_prefixes(keys: Any) -> set[str]:
    """Every dotted prefix of every weight name (``a.b.c`` gives ``a``, ``a.b``, ``a.b.c``)."""
    out: set[str] = set()
    for key in keys:
        parts = key.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out
