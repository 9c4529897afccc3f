"""Take over the attention of a Hugging Face model, in place, and give it back: :func:`patch`, :func:`unpatch`,
:func:`layers`.

:func:`patch` sets the model's attention implementation to ``"headwise"`` (transformers' own
``set_attn_implementation``; :mod:`~headwise.interop.hf.attention_function` is registered under that name) and gives
every attention module that calls the interface a headwise layer, ``module.attn``: an
:class:`~headwise.interop.hf.layer.HFView` of the module's own weights, through which every head the module
computes passes. Nothing else changes: no module is replaced, copied, renamed or re-classed, no parameter, buffer,
submodule is added, and nothing of transformers is modified; one forward pre-hook on the model checks a
``head_mask`` before anything runs (:func:`check_head_mask`).

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.

Example:
    >>> import torch, transformers
    >>> from headwise.interop import patch, unpatch, layers
    >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                                num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> ids = torch.tensor([[1, 5, 7, 3]])
    >>> before = model(ids).logits
    >>> keys = list(model.state_dict())
    >>> _ = patch(model)
    >>> [name for name, attn in layers(model)]
    ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    >>> torch.testing.assert_close(model(ids).logits, before)
    >>> list(model.state_dict()) == keys                              # nothing renamed, nothing added
    True
    >>> head = model.model.layers[0].self_attn.attn.head(3)           # a real head object of the real model
    >>> head.kv_index, head.w_q.data_ptr() == model.model.layers[0].self_attn.q_proj.weight[12:].data_ptr()
    (1, True)
    >>> type(unpatch(model).model.layers[0].self_attn).__name__, model.config._attn_implementation
    ('LlamaAttention', 'sdpa')
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..views import host_of
from .attention_function import NAME, config_rule, head_factors
from .layer import HFView, is_target, view_of

__all__ = ["patch", "unpatch", "layers", "check_impl", "restore_view", "SUPPORTED_IMPLS"]

SUPPORTED_IMPLS = ("eager", "sdpa", "headwise")


def check_impl(config: Any, where: str) -> str:
    """The attention implementation ``config`` names, if headwise can keep its conventions; raise otherwise."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_IMPLS:
        raise ValueError(
            f"{where}: attn_implementation={impl!r} is not supported (its masks are not 4-D tensors); "
            f"supported: {SUPPORTED_IMPLS}. Load the model with attn_implementation='headwise', 'sdpa' or 'eager', "
            "or call model.set_attn_implementation('headwise') before patching"
        )
    return impl


def view_on(module: nn.Module) -> HFView | None:
    """The layer :func:`patch` gave ``module`` (None if it has none)."""
    view = module.__dict__.get("attn")
    return view if isinstance(view, HFView) and host_of(view) is module else None


def restore_view(module: nn.Module, view: HFView) -> None:
    """Make ``view``, a layer :func:`patch` gave ``module`` earlier, its layer again in place of the one a later
    :func:`patch` gave it (surgery keeps the views of the modules it left alone, so that views held across it
    still run the model's forward)."""
    if view_on(module) is None or host_of(view) is not module:
        raise ValueError(f"restore_view: expected a view patch gave this {type(module).__name__} and a module "
                         "patched now")
    module.__dict__["attn"] = view


def _targets(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None, str]]:
    """``(name, module, parent, rule)`` of every module to give a (new) layer, everything checked first."""
    modules = dict(model.named_modules())
    found = []
    for name, module in modules.items():
        if not is_target(module):
            continue
        if name == "":
            raise TypeError(f"patch: {type(model).__name__} is itself an attention module; patch the model that "
                            "contains it, or convert it with from_hf")
        impl = check_impl(module.config, f"patch({type(model).__name__}) at {name!r}")
        held = view_on(module)
        if held is not None and impl == NAME:
            continue  # patched, and still computing with headwise
        taken = "attn" in module._modules or "attn" in module._parameters or "attn" in module._buffers \
            or hasattr(type(module), "attn") or ("attn" in module.__dict__ and held is None)
        if taken:
            raise TypeError(f"patch: {type(module).__name__} at {name!r} has an attribute 'attn' of its own, where "
                            "headwise puts the module's layer")
        # "headwise" already: the module's layer's rule, else the one recorded for its config (a model sharing a
        # patched model's config was switched with it), else sdpa's (the implementation's own)
        rule = impl if impl != NAME else (held.rule if held is not None else config_rule(module.config) or "sdpa")
        found.append((name, module, modules[name.rpartition(".")[0]], rule))
    return found


def _configs(model: nn.Module) -> list[Any]:
    """Every config of ``model`` (the modules', and their sub-configs), parents before their sub-configs."""
    seen: dict[int, Any] = {}

    def add(config: Any) -> None:
        if config is None or id(config) in seen or not hasattr(config, "_attn_implementation"):
            return
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", None) or {}:
            add(getattr(config, key, None))

    for module in model.modules():
        add(getattr(module, "config", None))
    return list(seen.values())


def _restore(impls: list[tuple[Any, Any]]) -> None:
    for config, impl in impls:  # parents first: a parent's setter also sets its sub-configs, which follow
        config._attn_implementation = impl


_OTHER_MASKS = ("decoder_head_mask", "cross_attn_head_mask")


def check_head_mask(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook of the patched model: Hugging Face's ``head_mask`` is honoured (each head's probabilities
    and context scaled, :func:`~headwise.interop.hf.attention_function.head_factors`) where it means one thing, and
    refused in one line, before anything runs (so no cache has changed), where it does not: a per-layer mask must
    be ``(L, h)``, ``L`` the model's ``num_hidden_layers`` (a row that matches no layer is refused).

    It is checked against every patched module, but reaches only those the model's code hands its keyword
    arguments: a module called without them keeps its heads unscaled, as the unpatched model (which ignores
    ``head_mask``) does. GPT-2's cross-attention is one (``GPT2Block`` calls ``crossattention`` without its
    ``**kwargs``), where BERT's, as a decoder, is scaled with its layer's self-attention."""
    where = type(model).__name__
    other = [n for n in _OTHER_MASKS if kwargs.get(n) is not None]
    head_mask = kwargs.get("head_mask")
    encoder_decoder = (other or head_mask is not None) and getattr(getattr(model, "config", None),
                                                                   "is_encoder_decoder", False)
    if other and not encoder_decoder:  # a decoder's or cross-attention's mask, given to a model with neither
        raise ValueError(f"{where}: {other[0]} is for an encoder-decoder model, and {where} is not one "
                         "(config.is_encoder_decoder=False); pass head_mask of shape (h,) or (L, h), or edit heads "
                         "with headwise.trace(model, edit={(layer, head): 0.0})")
    if encoder_decoder:  # any of them on an encoder-decoder model
        raise ValueError(f"{where}: {other[0] if other else 'head_mask'} is not supported on an encoder-decoder model "
                         "(transformers 5 hands one mask to every stack); edit heads with "
                         "headwise.trace(model, edit={(layer, head): 0.0})")
    if head_mask is None:
        return
    found = layers(model)
    for _, view in found:
        head_factors(head_mask, view.host, view.n_heads)
    indices = [getattr(view.host, "layer_idx", None) for _, view in found]
    if getattr(head_mask, "dim", lambda: 0)() == 2 and len(set(indices)) != len(indices):
        # several stacks, or a layer's self- and cross-attention: name two, so the message says which
        first = {}
        for (name, _), index in zip(found, indices):
            if index in first:
                break
            first[index] = name
        raise ValueError(f"{where}: head_mask has one row per layer, but its attention modules share layer numbers "
                         f"({first[index]!r} and {name!r} both have layer_idx={index}); pass one row (h,) for every "
                         "layer, or edit heads with headwise.trace")
    if found and getattr(head_mask, "dim", lambda: 0)() == 2:
        # A row that matches no layer (a mask built for a deeper model) would be silently ignored: the mask is for
        # another model, so refuse it rather than apply the rows that happen to fit.
        # L: the config's layer count, or one past the last layer number (layers deleted, config left as it was)
        counts = {getattr(getattr(view.host, "config", None), "num_hidden_layers", None) for _, view in found}
        allowed = {max(indices) + 1} | {n for n in counts if isinstance(n, int) and len(counts) == 1}
        if head_mask.shape[0] not in allowed:
            expected = " or ".join(f"(L={n}, h={head_mask.shape[1]})" for n in sorted(allowed))
            raise ValueError(f"{where}: head_mask has one row per layer: expected {expected}, got "
                             f"{tuple(head_mask.shape)}")


def patch(model: nn.Module) -> nn.Module:
    """Make every attention module of ``model`` that calls transformers' attention interface compute with
    headwise, in place; returns ``model``.

    The model's attention implementation becomes ``"headwise"`` (``unpatch`` puts the old one back), and each such
    module gets ``module.attn``, its layer: a view of the module's current weights (never a registered submodule,
    so ``state_dict``, ``save_pretrained``, tensor-parallel plans and PEFT targets are unchanged), through which
    :func:`headwise.trace` captures and edits every head. The module keeps its class, forward, parameters,
    buffers, submodules and hooks. A ``head_mask`` given to the model scales the heads of each module the model
    hands it (transformers 5 ignores it; GPT-2 hands it no cross-attention), or is refused before anything runs
    where it is ambiguous (:func:`check_head_mask`). Outputs are the
    model's own: every module keeps the conventions of the implementation it had (eager's uniform rows for queries
    that may read nothing, or sdpa's zeros; see :mod:`~headwise.interop.hf.attention_function`).

    No data is read, so a model on the meta device can be patched before its weights arrive. Patching a patched
    model gives layers to modules that have none, and re-takes a model whose implementation was switched since;
    otherwise it changes nothing. Everything is checked before anything changes: ``TypeError`` if nothing in
    ``model`` calls the interface (naming the attention classes found), ``ValueError`` for attention
    implementations other than eager / sdpa / headwise.

    Shapes:
        per layer, as the original module: hidden_states (b, s, d) -> (b, s, d), weights (b, h, s, s_kv) or None

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.AutoConfig.for_model("phi3", vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                         num_hidden_layers=1, num_attention_heads=4, pad_token_id=0)
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        >>> ids = torch.tensor([[1, 5, 7, 3]])
        >>> before = model(ids).logits
        >>> [name for name, attn in layers(patch(model))]
        ['model.layers.0.self_attn']
        >>> torch.testing.assert_close(model(ids).logits, before)
        >>> attn = layers(model)[0][1]
        >>> attn.head(1).w_q.data_ptr() == model.model.layers[0].self_attn.qkv_proj.weight[4:].data_ptr()
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    targets = _targets(model)
    if not targets:
        if layers(model):
            return model
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        seen = f"; it has {found}, none of them calling transformers' attention interface" if found else ""
        raise TypeError(f"patch: {type(model).__name__} contains no attention module headwise can patch (it patches "
                        f"every module that calls transformers' attention interface, ALL_ATTENTION_FUNCTIONS){seen}")
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"patch: {type(model).__name__} is not a transformers PreTrainedModel, so its attention "
                        "implementation cannot be set to 'headwise'; patch the PreTrainedModel that contains it")
    views = [(module, view_of(module, parent, name=name, rule=rule)) for name, module, parent, rule in targets]
    configs = _configs(model)
    before = [(c, c._attn_implementation) for c in configs]
    try:
        model.set_attn_implementation(NAME)
        stuck = sorted({type(m).__name__ for m, _ in views if m.config._attn_implementation != NAME})
        if stuck:
            raise TypeError(f"patch: {type(model).__name__} did not switch {stuck} to "
                            f"attn_implementation={NAME!r} (transformers cannot set it dynamically for them)")
    except BaseException:
        _restore(before)
        raise
    for module, view in views:
        module.__dict__["attn"] = view
    rules: dict[int, set[str]] = {}
    for _, view in layers(model):  # every patched module, those an earlier patch gave a layer too
        rules.setdefault(id(view.host.config), set()).add(view.rule)
    for config in configs:
        # The rule every module of a config keeps is recorded on it: sdpa's skip of a causal mask follows it, and
        # so does another model built on the same config object (switched to "headwise" with it, without
        # layers). A record left by an earlier patch goes when the model ran something else since.
        found = rules.get(id(config), set())
        config_rule(config, keep=next(iter(found)) if len(found) == 1 else False)
    if not _records(model):  # the first patch: what unpatch puts back
        anchor = _anchor(model)
        anchor.__dict__["_hw_impls"] = before
        anchor.__dict__["_hw_hook"] = anchor.register_forward_pre_hook(check_head_mask, with_kwargs=True)
    return model


def _anchor(model: nn.Module) -> nn.Module:
    """Where :func:`patch` keeps what :func:`unpatch` restores: the outermost transformers model in ``model``.

    Wrappers come and go around it (PEFT's ``get_peft_model`` wraps it, ``merge_and_unload`` hands it back), so
    kept there the record is found by ``unpatch`` whichever of them it is given. Its forward pre-hook also runs
    when a wrapper calls it."""
    for module in model.modules():
        if hasattr(type(module), "set_attn_implementation"):  # the class's, not a wrapper's forwarding __getattr__
            return module
    return model


def _records(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` holding a patch record, innermost first: a record is only added where no module
    below holds one, so a deeper record is a later patch and is undone before the ones above it."""
    return [m for m in model.modules() if "_hw_impls" in m.__dict__][::-1]


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every module loses its ``attn`` layer and every config gets its attention implementation
    back; returns ``model``.

    The weights never moved, so nothing is copied; edits made through ``.attn`` or its heads while patched
    are edits of the model's own weights. A model without patched modules is returned unchanged. ``model`` may be
    a wrapper of the patched model or the model a wrapper was patched through (a PEFT model, or its
    ``merge_and_unload()``): the record of the first patch is kept on the transformers model inside.

    Shapes:
        no tensor is touched
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch: model must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if view_on(module) is not None:
            del module.__dict__["attn"]
    for config in _configs(model):
        config_rule(config, keep=False)
    for holder in _records(model):  # wherever patch kept it: a wrapper's inner model, or the model itself
        _restore(holder.__dict__.pop("_hw_impls"))
        hook = holder.__dict__.pop("_hw_hook", None)
        if hook is not None:
            hook.remove()
    return model


def layers(model: nn.Module) -> list[tuple[str, HFView]]:
    """``(qualified name of the patched module, its layer)`` for every patched module, in model order (empty if
    ``model`` is not patched). Each layer's ``repr`` names the module it is a view of.

    Shapes:
        each layer: MultiHeadAttention(d, h, h_kv, d_h); ``attn.head(i)`` gives head i's (d, d_h) weights

    Example:
        >>> import transformers
        >>> cfg = transformers.BertConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=2,
        ...                               intermediate_size=8, vocab_size=10)
        >>> [name for name, attn in layers(patch(transformers.BertModel(cfg)))]
        ['encoder.layer.0.attention.self', 'encoder.layer.1.attention.self']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"layers: model must be a torch.nn.Module, got {type(model).__name__}")
    return [(name, view) for name, module in model.named_modules() if (view := view_on(module)) is not None]
