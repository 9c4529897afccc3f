"""Surgery on a model patched by :func:`headwise.interop.patch`: its own modules resized through each layer's
surgery seam (:mod:`headwise.interop.hf.surgery`), with no knowledge of families here.

1. Every changed layer's ``edit_refusal`` is asked first (and, where a family's forward reads head counts from
   the shared config, every layer must keep the same counts), so a refusal changes nothing.
2. The model is unpatched, each view's ``write_heads`` resizes its module in place, and the config's head
   counts are updated when every layer agrees and the model class then rebuilds exactly these weight shapes
   from the config (checked by building it on the meta device: :func:`rebuilds`); plain ``from_pretrained``
   then loads a saved copy.
3. The model is patched again, so its views describe the new shapes; the old views of the changed modules
   refuse every use (:class:`StaleView`), and the modules left alone get their old views back
   (:func:`reattach`), so a view or head fetched before surgery still computes, captures and edits. A plain
   module wrapping the patched model (a training module) is changed through the transformers model inside
   (:func:`patch_root`), and a PEFT wrapper's config is checked on the transformers model it wraps, adapters
   looked through.

Shapes:
    per layer: (n_heads, n_kv_heads, d_head)
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..module_calls import adapter_base, kv_prompt
from .weights import HeadWeights, as_projections

__all__ = ["is_view", "has_seam", "apply", "refusal", "prompt_refusal", "rebuilds", "config_update", "quiet",
           "patch_root", "transformers_model", "StaleView", "retire", "reattach"]


def is_view(layer: Any) -> bool:
    """Whether ``layer`` is a view of another module's weights (a patched Hugging Face module's ``.attn``)."""
    return "_hw_host" in getattr(layer, "__dict__", {})


def has_seam(layer: Any) -> bool:
    """Whether the view ``layer`` can be resized through the surgery seam (:mod:`headwise.interop.hf.surgery`)."""
    return is_view(layer) and callable(getattr(layer, "write_heads", None))


def _counts(hw: HeadWeights) -> tuple[int, int, int]:
    return hw.n_heads, hw.n_kv_heads, hw.d_head


def refusal(layers: Sequence[tuple[str, Any]], new: Mapping[int, HeadWeights], what: str) -> str:
    """Why these changes cannot be written (``""`` if they can): each changed layer's own refusal, then the
    layers whose forward reads the shared config's head counts, which must all keep the same counts."""
    for i, hw in new.items():
        name, view = layers[i]
        why = view.edit_refusal(hw.n_heads, hw.n_kv_heads)
        if why:
            return f"{what} at {name!r}: {why}"
    shared: dict[int, dict[tuple[int, int, int], str]] = {}
    for i, (name, view) in enumerate(layers):
        if view.reads_config_heads():
            counts = _counts(new[i]) if i in new else view.head_params()
            shared.setdefault(id(view.hf_config()), {}).setdefault(counts, name)
    for seen in shared.values():
        if len(seen) > 1:
            listed = ", ".join(f"{n!r} (h, h_kv, d_h) = {c}" for c, n in seen.items())
            return (f"{what}: these modules read their head counts from the model's shared config, so every layer "
                    f"must keep the same counts; this change leaves {listed}")
    return ""


# PEFT's prompt-learning methods that only prepend input embeddings: nothing they hold depends on the heads. The
# others (prefix tuning, cartridges, any newer one) hand every layer keys and values of its K/V heads.


def _kv_prompts(model: nn.Module, hosts: set[int]) -> list[tuple[str, nn.Module, str, str]]:
    """``(path, wrapper, adapter, type)`` of the PEFT adapters in ``model`` (itself or any module in it) that wrap
    one of the modules ``hosts`` (ids) and supply keys and values to its layers
    (:func:`~headwise.module_calls.kv_prompt`)."""
    found = []
    for path, m in model.named_modules():
        configs = getattr(m, "peft_config", None)
        if not isinstance(configs, Mapping) or not hosts & {id(x) for x in m.modules()}:
            continue
        for adapter, cfg in configs.items():
            if kind := kv_prompt(cfg):
                found.append((path, m, adapter, kind))
    return found


def _kv_kept(view: Any, hw: HeadWeights) -> bool:
    """Whether ``hw`` leaves the K/V heads of ``view``'s layer as they are: their count and width, each query head
    reading the K/V head (old index ``heads_from[i] // g``) of the same position, and the same K/V weights."""
    h, h_kv, d_h = view.head_params()
    if (hw.n_kv_heads, hw.d_head) != (h_kv, d_h):
        return False
    src = hw.heads_from if hw.heads_from is not None else range(hw.n_heads)
    if any(s // (h // h_kv) != i // hw.group_size for i, s in enumerate(src)):
        return False
    old = [getattr(view, p).weight for p in ("k_proj", "v_proj")]  # (h_kv * d_h, d)
    old += [getattr(view, p).bias for p in ("k_proj", "v_proj")]
    new = [hw.k_w, hw.v_w, hw.k_b, hw.v_b]
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(old, new))


def prompt_refusal(model: nn.Module, layers: Sequence[tuple[str, Any]], new: Mapping[int, HeadWeights],
                   what: str) -> str:
    """Why ``new`` cannot be written under a PEFT prefix (``""`` if it can): a prefix-tuning adapter (any prompt
    learning that is not input embeddings alone) holds, for every layer, keys and values of the K/V heads it
    has now, and the model prepends them to the layer's own. A change to any layer's K/V heads (count, width, or
    which of them a query head reads) would make every later forward fail on the shapes or pair the prefix with
    other heads; query heads alone may go."""
    found = _kv_prompts(model, {id(layers[i][1].host) for i in new})
    if not found:
        return ""
    path, wrapper, adapter, kind = found[0]
    for i, hw in new.items():
        name, view = layers[i]
        if _kv_kept(view, hw):
            continue
        _, h_kv, d_h = view.head_params()
        at = f" at {path!r}" if path else ""
        return (f"{what}: {type(wrapper).__name__}{at} holds a {kind} adapter ({adapter!r}) whose prompt encoder "
                f"gives every layer keys and values for its K/V heads as they are now ({h_kv} of width {d_h} at "
                f"{name!r}); this change makes that layer's K/V heads (h_kv, d_h) = ({hw.n_kv_heads}, "
                f"{hw.d_head}), or pools or moves them, so the prefix would no longer fit. Expected a change that "
                "keeps every layer's K/V heads (prune the same number of query heads from each K/V group), or "
                f"drop the {kind} adapter first (run the surgery on get_base_model(), then train a new prefix); "
                "a prefix cannot be merged into the weights")
    return ""


@contextlib.contextmanager
def quiet(*, messages: bool = True):
    """transformers' progress bars off (and, with ``messages``, its logging at errors only: a rebuilt model's
    init warnings are not the user's) for the duration; both settings are given back afterwards."""
    try:
        from transformers.utils import logging
    except ImportError:  # pragma: no cover - a view exists only with transformers
        yield
        return
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    if messages:
        logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            logging.enable_progress_bar()
        logging.set_verbosity(level)


def _shapes(module: nn.Module, adapters: bool = False) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape; with ``adapters``, as the model without its adapter wrappers (PEFT LoRA) names them:
    ``x.base_layer.weight`` is ``x.weight`` and the adapter's own weights are left out, since they are not
    the class's weights and merging them keeps the base layer's shapes."""
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if not adapters:
        return shapes
    wrappers = [n for n, m in module.named_modules() if adapter_base(m) is not None]
    for name in sorted(wrappers, key=len, reverse=True):  # innermost first: a wrapper may wrap a wrapper
        pre = f"{name}." if name else ""
        base = pre + "base_layer."
        shapes = {(pre + k[len(base):] if k.startswith(base) else k): v for k, v in shapes.items()
                  if k.startswith(base) or not k.startswith(pre)}
    return shapes


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The outermost transformers model in ``model`` (``model`` itself, or the one a wrapper such as PEFT's
    ``PeftModel`` holds): whose class, not a forwarding ``__getattr__``, has ``set_attn_implementation``."""
    return next((m for m in model.modules() if hasattr(type(m), "set_attn_implementation")), None)


def rebuilds(model: nn.Module, fields: Mapping[str, int] | None = None, *, adapters: bool = False) -> bool:
    """Whether ``type(model)`` built from ``model.config`` (with ``fields`` set on a copy) has exactly the
    weight shapes of ``model``: what plain ``from_pretrained`` of a saved copy needs. Built on the meta
    device, so nothing is allocated. With ``adapters``, ``model``'s adapter wrappers are looked through
    (the shapes it has once they are merged)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    cand = copy.deepcopy(cfg)
    for name, value in (fields or {}).items():
        setattr(cand, name, value)
    try:
        if callable(getattr(cand, "validate", None)):
            cand.validate()  # what save_pretrained checks (Gemma 2: hidden_size % num_attention_heads == 0)
        with quiet(), torch.device("meta"):
            fresh = type(model)(cand)
    except Exception:  # noqa: BLE001 - a config these counts make invalid does not rebuild the model
        return False
    return _shapes(fresh) == _shapes(model, adapters)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_update(model: nn.Module, views: Sequence[Any], counts: Sequence[tuple[int, int, int]]) -> dict[str, int]:
    """The config fields (the registry's names for h, h_kv, d_h) whose new values make ``type(model)`` rebuild
    ``model``'s shapes, or ``{}`` when the layers disagree or no such fields do."""
    cfg = getattr(model, "config", None)
    if cfg is None or not counts or len(set(counts)) != 1:
        return {}
    (h, h_kv, d_h), = set(counts)
    base: dict[str, int] = {}
    d_names: list[str] = []
    for view in views:
        heads, kv, d = view.config_fields()
        base.update({n: h for n in heads if _is_count(getattr(cfg, n, None))})
        base.update({n: h_kv for n in kv if _is_count(getattr(cfg, n, None))})
        base.update({n: d_h for n in d if _is_count(getattr(cfg, n, None))})
        d_names += [n for n in d if n not in d_names]
    tries = [base] + [{**base, n: d_h} for n in d_names if n not in base]  # a config that derives d_h: say it
    return next((fields for fields in tries if rebuilds(model, fields, adapters=True)), {})


def _set(configs: Sequence[Any], fields: Mapping[str, int]) -> None:
    for cfg in configs:
        for name, value in fields.items():
            setattr(cfg, name, value)


def patch_root(model: nn.Module, layers: Sequence[tuple[str, Any]], what: str) -> nn.Module:
    """What surgery patches again after resizing: ``model`` where ``patch`` takes it (a transformers model, or a
    wrapper forwarding to one, as PEFT's), else the one transformers model inside a plain wrapper (a training
    module holding it) that holds every patched module. ``TypeError`` otherwise, before anything changes."""
    if hasattr(model, "set_attn_implementation"):
        return model
    outer: list[tuple[nn.Module, set[int]]] = []
    for m in model.modules():  # pre-order: an enclosing transformers model comes before the ones it holds
        if hasattr(type(m), "set_attn_implementation") and not any(id(m) in ids for _, ids in outer):
            outer.append((m, {id(x) for x in m.modules()}))
    hosts = {id(view.host) for _, view in layers}
    holding = [(m, ids) for m, ids in outer if hosts & ids]
    if len(holding) == 1 and hosts <= holding[0][1]:
        return holding[0][0]
    found = [type(m).__name__ for m, _ in holding] or "none"
    raise TypeError(f"{what}: expected a patched transformers model, or a module holding exactly one that holds "
                    f"every patched module; got {type(model).__name__}, whose patched modules are in these "
                    f"transformers models: {found}. Pass the patched transformers model itself")


class StaleView:
    """Mixed into a view whose module surgery resized: the view still holds the old head counts but would
    read the new weights (another head's slice, or past the end), so every use is refused instead."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name in ("host", "host_name"):  # Python's and torch's own machinery
            return object.__getattribute__(self, name)
        where = object.__getattribute__(self, "_hw_name") or object.__getattribute__(self, "_hw_host").what
        raise TypeError(f"this layer is a stale view of {where}: {object.__getattribute__(self, '_hw_stale')} "
                        "resized its module since the view was fetched, so its head counts and head slices no "
                        "longer match the weights (heads fetched from it too); expected a current view: fetch "
                        "it again with headwise.interop.layers(model) or module.attn")

    def __repr__(self) -> str:
        where = object.__getattribute__(self, "_hw_name") or object.__getattribute__(self, "_hw_host").what
        return f"<stale view of {where}, resized by {object.__getattribute__(self, '_hw_stale')}>"


_STALE: dict[type, type] = {}


def retire(view: Any, what: str) -> None:
    """Make ``view``, an old view of a module surgery resized, refuse every use (:class:`StaleView`)."""
    cls = type(view)
    if not issubclass(cls, StaleView):
        stale = _STALE.setdefault(cls, type(f"Stale{cls.__name__}", (StaleView, cls), {}))
        object.__setattr__(view, "_hw_stale", what)
        view.__class__ = stale


def apply(model: nn.Module, layers: Sequence[tuple[str, Any]], new: Mapping[int, HeadWeights], what: str) -> nn.Module:
    """Write ``new[i]`` into the module of layer ``i`` of the patched ``model`` (everything checked first);
    returns ``model``, patched again. The old views of the changed layers are retired (:func:`retire`); every
    other module gets its old view back (:func:`reattach`)."""
    from ..interop import layers as patched, patch, unpatch

    plain = [layers[i][0] for i in new if not is_view(layers[i][1])]
    if plain:
        raise TypeError(f"{what}: {plain} are not views of patched Hugging Face modules; change a model patched "
                        "by headwise.interop.patch, or a module of headwise layers, not a mix")
    seamless = [f"{layers[i][0]} ({type(layers[i][1]).__name__})" for i in new if not has_seam(layers[i][1])]
    if seamless:
        raise TypeError(f"{what}: {seamless} are views of modules surgery does not know how to resize (no "
                        "write_heads)")
    why = refusal(layers, new, what) or prompt_refusal(model, layers, new, what)
    if why:
        raise ValueError(why)
    root = patch_root(model, layers, what)
    inner = transformers_model(root) or root  # the class that from_pretrained rebuilds, inside a PEFT wrapper
    views = [view for _, view in layers]
    counts = [_counts(new[i]) if i in new else view.head_params() for i, view in enumerate(views)]
    configs = list({id(c): c for c in [getattr(inner, "config", None)] + [v.hf_config() for v in views]
                    if c is not None}.values())
    before = [view for _, view in patched(root)]
    unpatch(root)
    for i, hw in new.items():
        views[i].write_heads(as_projections(hw), hw.n_heads, hw.n_kv_heads, heads_from=hw.heads_from)
    fields = config_update(inner, views, counts)
    if not fields and any(v.reads_config_heads() for v in views):  # their forward needs the counts regardless
        h, h_kv, _ = counts[0]
        heads, kv, _ = views[0].config_fields()
        fields = {n: h for n in heads if _is_count(getattr(views[0].hf_config(), n, None))}
        fields.update({n: h_kv for n in kv if _is_count(getattr(views[0].hf_config(), n, None))})
    _set(configs, fields)
    patch(root)
    reattach(root, before, {id(views[i].host) for i in new}, what)
    return model


def _same(old: Any, now: Any) -> bool:
    """Whether ``now``, a module's view from re-patching, describes the module exactly as ``old`` did."""
    # Not the host's name: it is relative to the model patch() was given, which need not be surgery's root.
    return (type(old) is type(now) and old.host is now.host and old.config == now.config and old.rule == now.rule
            and old.source_names() == now.source_names())


def reattach(root: nn.Module, before: Sequence[Any], changed: set[int], what: str) -> None:
    """After ``root`` was unpatched and patched again: give each module surgery left alone (its id not in
    ``changed``) its view from ``before`` back in place of the new one, and retire (:func:`retire`) the old
    views of the changed modules. A view held across surgery is then the one the module's forward calls, so
    traces and edits through it (hooks, backend and heads included) still reach the model; one that no longer
    describes its module is retired rather than left computing nothing."""
    from ..interop import layers as patched
    from ..interop.hf.patch import restore_view

    now = {id(view.host): view for _, view in patched(root)}
    for old in before:
        fresh = now.get(id(old.host))
        if id(old.host) not in changed and fresh is not None and _same(old, fresh):
            restore_view(old.host, old)
        else:
            retire(old, what)
