"""The meta-device probe load_pretrained builds from a folder's config.json, kept to what the saved weights can
fill: a tampered config (``num_hidden_layers=10**6``) is refused while the probe is being built, before it takes
minutes, and a config with more layers than were saved, or weights of other shapes than it builds, are refused
before ``from_pretrained`` allocates them; what transformers' load report then says went wrong is a ValueError too.

Shapes:
    saved: {checkpoint key: shape} of the folder's safetensors headers
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from . import hosts
from .files import aliased, key_prefixes

__all__ = ["PROBE_MODULES_PER_WEIGHT", "PROBE_MODULES_FLOOR", "TooLarge", "bounded", "check_layers", "check_shapes",
           "check_loaded"]

# A probe may register at most this many modules per saved weight, plus the floor: real models register one to
# two (T5 the most), so a tampered config.json (num_hidden_layers=10**6) is refused a fraction of a second into
# building on the meta device, where building every layer would take minutes.
PROBE_MODULES_PER_WEIGHT = 16
PROBE_MODULES_FLOOR = 2048


def _layer_counts(config: Any) -> str:
    """The config's layer counts in words (`` (num_hidden_layers=3)``; ``""`` where it has none), for a refusal."""
    counts = ", ".join(f"{k}={v}" for k, v in config.to_dict().items() if type(v) is int and "layer" in k)
    return f" ({counts})" if counts else ""


class TooLarge(ValueError):
    """A config.json that builds more modules than the saved weights can fill."""


# The probe's budget, per thread. torch keeps module-registration hooks in one process-wide dict that it walks
# at every registration, in any thread, so adding and removing a hook per load could change that dict under
# another thread's walk: one hook is registered once, on the first load, and does nothing outside a budget.
_BUDGET = threading.local()
_HOOK_LOCK = threading.Lock()
_hooked = False


def _count_module(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    budget = getattr(_BUDGET, "value", None)
    if budget is None:
        return
    budget["count"] += 1
    if budget["count"] > budget["limit"]:
        raise TooLarge(budget["message"])


@contextlib.contextmanager
def bounded(model_class: type, config: Any, directory: Path, n_saved: int):
    """Building ``model_class(config)`` in this thread refused (``ValueError``) once it registers more modules
    than :data:`PROBE_MODULES_PER_WEIGHT` per saved weight allow: any family, any count that multiplies layers."""
    global _hooked
    limit = PROBE_MODULES_FLOOR + PROBE_MODULES_PER_WEIGHT * n_saved
    with _HOOK_LOCK:
        if not _hooked:
            register_module_module_registration_hook(_count_module)
            _hooked = True
    outer = getattr(_BUDGET, "value", None)
    _BUDGET.value = {"count": 0, "limit": limit, "message": (
        f"load_pretrained: {directory / 'config.json'}{_layer_counts(config)} builds more than {limit} modules "
        f"for {model_class.__name__}, more than the {n_saved} saved weights in {directory} can fill: refused "
        "before building it")}
    try:
        yield
    finally:
        _BUDGET.value = outer


def check_layers(probe: nn.Module, saved: dict[str, tuple[int, ...]], cls: str, config: Any, directory: Path) -> None:
    """Every entry of a layer list (``nn.ModuleList``, ``nn.Sequential``) that the config builds must have weights
    in the saved files when its siblings do: a config.json with more layers than were saved is refused before
    ``from_pretrained`` allocates them. A list none of whose entries is found (its keys converted, not renamed,
    by transformers' loader) is left to that loader's own check."""
    state = probe.state_dict(keep_vars=True)
    ignored = [re.compile(p) for p in getattr(probe, "_keys_to_ignore_on_load_missing", None) or ()]
    saved = aliased(saved, probe)
    names: dict[int, list[str]] = {}
    for key, value in state.items():  # a weight tied to a saved one is saved under that name
        names.setdefault(id(value), []).append(key)
    held = key_prefixes(k for group in names.values() if any(n in saved for n in group) for k in group)
    built = key_prefixes(k for k in state if not any(p.search(k) for p in ignored))
    for name, module in probe.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        entries = [f"{name}.{i}" if name else i for i, _ in module.named_children()]
        entries = [e for e in entries if e in built]
        missing = [e for e in entries if e not in held]
        if missing and len(missing) < len(entries):
            raise ValueError(f"load_pretrained: {directory / 'config.json'}{_layer_counts(config)} builds "
                             f"{len(entries)} entries of {cls}'s {name!r}, but the saved weights in {directory} "
                             f"have none for {missing[:3]}: config.json describes more layers than were saved")


def _mismatched(found: list[tuple[str, Any, Any]]) -> str:
    listed = "; ".join(f"{k!r} saved {tuple(a)}, expected {tuple(b)}" for k, a, b in found[:5])
    return f"mismatched keys [{listed}]" + (f" (and {len(found) - 5} more)" if len(found) > 5 else "")


def check_shapes(probe: nn.Module, saved: dict[str, tuple[int, ...]], directory: Path, what: str) -> None:
    """Every saved weight the ``probe`` has (under its name or a name transformers' loader renames it to) must
    have the probe's shape: ``ValueError`` naming the mismatched keys, saved and expected shapes, before
    ``from_pretrained`` allocates the model (and prints its load report)."""
    saved = aliased(saved, probe)
    found = [(k, saved[k], tuple(v.shape)) for k, v in probe.state_dict().items()
             if k in saved and saved[k] != tuple(v.shape)]
    if found:
        raise ValueError(f"load_pretrained: {directory} does not match {what}: {_mismatched(found)}")


def check_loaded(model: nn.Module, info: dict[str, Any], directory: Path, what: str) -> None:
    """``ValueError`` naming what transformers' load report (``output_loading_info``) says went wrong: a weight
    the saving class has and the folder lacks (:func:`_saved_by`), a checkpoint weight under the model's own
    modules that the model does not build (:func:`_own`), a weight of another shape (key, saved and expected
    shapes)."""
    missing = _saved_by(model, list(info.get("missing_keys") or ()))
    unexpected = _own(model, list(info.get("unexpected_keys") or ()))
    mismatched = sorted((str(k), a, b) for k, a, b in info.get("mismatched_keys") or ())
    wrong = ([f"missing keys {missing[:5]}"] if missing else []) + \
        ([f"unexpected keys {unexpected[:5]}"] if unexpected else []) + \
        ([_mismatched(mismatched)] if mismatched else [])
    if wrong:
        raise ValueError(f"load_pretrained: {directory} does not match {what}: {', '.join(wrong)}")


def _saved_by(model: nn.Module, keys: list[str]) -> list[str]:
    """The weights among ``keys`` (missing from the folder) that the class which saved it has (the first of its
    config's ``architectures``; ``model``'s own class when that names none transformers has): a folder without
    them is incomplete. The others are a task head only ``model``'s class has (``score`` when a causal LM's
    folder is loaded into ``...ForSequenceClassification``), newly initialised, as ``from_pretrained`` does.
    The saving class is built on the meta device, so nothing is allocated."""
    names = getattr(model.config, "architectures", None) or []
    if not keys or not names or names[0] == type(model).__name__:
        return keys
    import transformers

    saver = getattr(transformers, str(names[0]), None)
    if not (isinstance(saver, type) and issubclass(saver, nn.Module)
            and isinstance(model.config, getattr(saver, "config_class", ()))):
        return keys
    try:
        with hosts.quiet(), torch.device("meta"):
            held = saver(copy.deepcopy(model.config)).state_dict()  # building may set config fields
    except Exception:  # noqa: BLE001 - a class this config cannot build: every missing weight counts
        return keys
    prefix = f"{getattr(model, 'base_model_prefix', '') or ''}."

    def bare(key: str) -> str:  # a task model's keys and its base model's differ by the prefix
        return key[len(prefix):] if prefix != "." and key.startswith(prefix) else key

    has = {bare(k) for k in held}
    return [k for k in keys if bare(k) in has]


def _own(model: nn.Module, keys: list[str]) -> list[str]:
    """The checkpoint keys among ``keys`` that belong under ``model``'s own modules: an unexpected key of a task
    head the model does not have (``lm_head``, ``cls``: a task model's folder loaded as its base model) is
    harmless; one under the model's own modules (a layer the config does not build) is not."""
    own = {name for name, _ in model.named_children()}
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    return [k for k in keys if (k[len(prefix):] if k.startswith(prefix) else k).split(".")[0] in own]
