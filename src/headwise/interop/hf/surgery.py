"""The surgery seam of the Hugging Face view: which head counts its module can take, and resizing it in place.

:mod:`headwise.surgery` reads a patched layer's weights through its view (``q_proj`` .. ``out_proj``), computes
new ones, and hands them back through three methods of :class:`~headwise.interop.hf.layer.HFView`, so surgery
never asks which family it is:

* :meth:`SurgerySeam.head_params`: the current ``(n_heads, n_kv_heads, d_head)``.
* :meth:`SurgerySeam.edit_refusal`: why the module cannot take given head counts (``""`` when it can); checked
  for every layer before anything is written.
* ``write_heads(weights, n_heads, n_kv_heads, heads_from)``: new projections under the module's own names (a
  fused Q/K/V in its own layout), the per-head state outside them carried with its heads
  (:meth:`SurgerySeam.head_state`: per-head Q/K norms) and the head-count attributes its forward reads. Patch
  again afterwards.

What a family's config and attributes call the head counts is in :mod:`~headwise.interop.hf.registry`; a new
projection has the kind of the one it replaces (``nn.Linear``, or transformers' ``Conv1D`` for GPT-2).

Shapes:
    h: query heads, h_kv: key/value heads, d_h: head width; weights ``{q_proj, k_proj, v_proj, out_proj:
    (weight (out, in), bias or None)}``.

Example:
    >>> import transformers
    >>> from headwise.interop import layers, patch
    >>> cfg = transformers.BertConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=1,
    ...                               intermediate_size=8, vocab_size=10)
    >>> model = patch(transformers.BertModel(cfg))  # kept: a view does not keep its model alive
    >>> attn = layers(model)[0][1]
    >>> attn.head_params(), attn.edit_refusal(2, 2)
    ((3, 3, 4), '')
    >>> attn.edit_refusal(3, 1).split(";")[0]
    'encoder.layer.0.attention.self: BertSelfAttention has one K/V head per query head (no num_key_value_groups)'
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn

from ...module_calls import adapter_base
from .locate import PROJECTIONS, is_conv1d
from .registry import Entry, entry_for

__all__ = ["SurgerySeam", "projection_like", "set_counts", "take_per_head", "carry_head_state"]


class SurgerySeam:
    """Mixin of the HF view: the registry entry of the host's family, its head counts, the checks of a resize and
    the resize itself (:meth:`write_heads`)."""

    def hf_config(self) -> Any:
        """The config the host module reads."""
        return self.host.config  # type: ignore[attr-defined]

    def surgery_entry(self) -> Entry:
        cfg = self.hf_config()
        return entry_for(getattr(cfg, "model_type", None), cfg)

    def head_params(self) -> tuple[int, int, int]:
        """``(n_heads, n_kv_heads, d_head)`` of the module now."""
        c = self.config  # type: ignore[attr-defined]
        return c.n_heads, c.n_kv_heads, c.d_head

    def kv_groups(self) -> bool:
        """Whether the module can hold fewer K/V heads than query heads: it repeats them by its
        ``num_key_value_groups`` (what transformers' own attention functions read)."""
        return isinstance(getattr(self.host, "num_key_value_groups", None), int)  # type: ignore[attr-defined]

    def reads_config_heads(self) -> bool:
        """Whether the module's forward reads its head counts from the model's shared config."""
        return self.surgery_entry().config_read

    def config_fields(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """The config field names of (h, h_kv, d_h) for this family."""
        e = self.surgery_entry()
        return e.config_heads, e.config_kv_heads, e.config_d_head

    def edit_refusal(self, n_heads: Any, n_kv_heads: Any) -> str:
        """Why this module cannot be resized to ``n_heads`` / ``n_kv_heads`` (``""`` if it can); nothing is
        changed either way."""
        host = self.host  # type: ignore[attr-defined]
        where = f"{self.__dict__.get('_hw_name') or type(host).__name__}"
        cls = type(host).__name__
        entry = self.surgery_entry()
        if entry.refuse:
            return f"{where}: surgery cannot resize {cls}: {entry.refuse}"
        for name in PROJECTIONS:
            try:
                self.resolve(name)  # type: ignore[attr-defined]
            except ValueError as e:
                return str(e)
        # a LoRA-style base_layer, or modules_to_save's original_module beside a trained copy per adapter
        wrapped = [f"{n} ({type(m).__module__.split('.')[0]}.{type(m).__name__})"
                   for n, m in self.sources()  # type: ignore[attr-defined]
                   if adapter_base(m) is not None or isinstance(getattr(m, "original_module", None), nn.Module)]
        if wrapped:
            return (f"{where}: {', '.join(wrapped)} are wrapped by an adapter (PEFT): merge_and_unload() first, so "
                    "that the resized projections keep what the adapter adds (or unload() to drop it)")
        for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"{where}: {name} must be a positive int, got {value!r}"
        if n_heads % n_kv_heads:
            return f"{where}: n_kv_heads={n_kv_heads} does not divide n_heads={n_heads}"
        if n_kv_heads != n_heads and not self.kv_groups():
            return (f"{where}: {cls} has one K/V head per query head (no num_key_value_groups); this change needs "
                    f"n_heads={n_heads} with n_kv_heads={n_kv_heads} (regroup a standalone copy instead: "
                    "headwise.interop.from_hf, then to_gqa)")
        _, unsided = self.head_state_sides(n_heads, n_kv_heads)
        if unsided:
            h_now = self.config.n_heads  # type: ignore[attr-defined]
            return (f"{where}: {cls} has per-head state outside its projections ({', '.join(unsided)}: one entry "
                    f"per head of its {h_now} query and {h_now} K/V heads) that cannot be told to follow the query "
                    f"or the K/V heads, and n_heads={n_heads} with n_kv_heads={n_kv_heads} makes their counts "
                    "differ (the registry's q_side / kv_side name the ones it knows)")
        spanning = self.spanning_params()
        if spanning:
            return (f"{where}: {cls} has parameters over the width of all its heads ({', '.join(spanning)}: a norm or "
                    "gate across heads), so its heads cannot be removed or regrouped one by one")
        h = self.config.n_heads  # type: ignore[attr-defined]
        for name in entry.per_head:
            p = getattr(host, name, None)
            if isinstance(p, torch.Tensor) and p.shape[:1] != (h,):
                return f"{where}: {cls}.{name} has shape {tuple(p.shape)}, not one entry per each of its {h} heads"
        layout = self._hw_found.layout  # type: ignore[attr-defined]
        if layout == "per_head" and n_heads != n_kv_heads:
            return (f"{where}: a head-interleaved Q/K/V ({self._hw_found.fused}) needs n_heads == n_kv_heads, got "  # type: ignore[attr-defined]
                    f"{n_heads}, {n_kv_heads}")
        return ""

    def spanning_params(self) -> list[str]:
        """The host's parameters outside its projections with a dimension of h * d_h (or h_kv * d_h, h_kv > 1):
        they mix every head's width (OLMo-2's q_norm over the whole projection, gated attention's gate)."""
        host, c = self.host, self.config  # type: ignore[attr-defined]
        own = {id(p) for _, m in self.sources() for p in m.parameters()}  # type: ignore[attr-defined]
        widths = {c.n_heads * c.d_head} | ({c.n_kv_heads * c.d_head} if c.n_kv_heads > 1 else set())
        entry = self.surgery_entry()
        carried = {n for n, _ in self.head_state()}
        return [n for n, p in host.named_parameters() if id(p) not in own and n not in entry.per_head
                and n.split(".")[0] not in entry.after_o and n not in carried
                and not any(n.startswith(c + ".") for c in carried) and widths & set(p.shape)]

    def head_state(self) -> list[tuple[str, int]]:
        """``(path, heads)`` of the host's per-head state that its projections do not hold, which surgery carries
        along head by head: every ``nn.ModuleList`` of h or h_kv modules over d_h (StableLM's
        ``q_layernorm.norms``, one LayerNorm per head) and every other parameter whose first axis has h or h_kv
        entries, with a d_h axis after it (Cohere's ``q_norm.weight`` (h, d_h)). Any of them left alone would
        give the surviving heads other heads' entries, or a count the forward cannot broadcast."""
        host, c = self.host, self.config  # type: ignore[attr-defined]
        own = {id(p) for _, m in self.sources() for p in m.parameters()}  # type: ignore[attr-defined]
        entry, counts = self.surgery_entry(), {c.n_heads, c.n_kv_heads}
        found: list[tuple[str, int]] = []
        inside: set[int] = set()
        for name, m in host.named_modules():
            if (isinstance(m, nn.ModuleList) and len(m) in counts and name.split(".")[0] not in entry.after_o
                    and not any(id(p) in own for p in m.parameters())
                    and any(c.d_head in p.shape for p in m.parameters())):
                found.append((name, len(m)))
                inside |= {id(p) for p in m.parameters()}
        for name, p in host.named_parameters():
            if (id(p) in own or id(p) in inside or name in entry.per_head or name.split(".")[0] in entry.after_o
                    or p.dim() < 2):
                continue
            if p.shape[0] in counts and c.d_head in p.shape[1:]:
                found.append((name, p.shape[0]))
        return found

    def head_state_sides(self, n_heads: int, n_kv_heads: int) -> tuple[dict[str, str], list[str]]:
        """Which heads each :meth:`head_state` entry follows: ``{path: "q" | "kv"}``, and the paths that cannot be
        told. Its count says which where h != h_kv; with h == h_kv the registry's ``q_side`` / ``kv_side`` names
        do, needed only when the change makes the counts differ (otherwise both give the same heads)."""
        c, entry = self.config, self.surgery_entry()  # type: ignore[attr-defined]
        sides: dict[str, str] = {}
        unsided: list[str] = []
        for path, n in self.head_state():
            top = path.split(".")[0]
            if c.n_heads != c.n_kv_heads:
                sides[path] = "q" if n == c.n_heads else "kv"
            elif top in entry.kv_side or top in entry.q_side:
                sides[path] = "kv" if top in entry.kv_side else "q"
            elif n_heads == n_kv_heads:
                sides[path] = "q"
            else:
                unsided.append(path)
        return sides, unsided

    def write_heads(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], n_heads: int,
                    n_kv_heads: int, heads_from: Sequence[int] | None = None) -> None:
        """Give the host module new projections holding ``weights`` (``{q_proj, k_proj, v_proj, out_proj:
        (weight (out, in), bias)}``) for ``n_heads`` / ``n_kv_heads`` heads of this layer's width: new modules of
        the same kind under the same names (a fused Q/K/V in its own layout), the per-head parameters of heads
        ``heads_from``, and the head counts set where the module and the next patch read them. Refuses
        (``ValueError``, nothing changed) what :meth:`edit_refusal` refuses.

        Shapes:
            q_proj (h * d_h, d), k_proj / v_proj (h_kv * d_h, d), out_proj (d, h * d_h)
        """
        why = self.edit_refusal(n_heads, n_kv_heads)
        if why:
            raise ValueError(f"write_heads: {why}")
        d_h, host, entry, found = self.d_head, self.host, self.surgery_entry(), self._hw_found  # type: ignore[attr-defined]
        sides, _ = self.head_state_sides(n_heads, n_kv_heads)  # read before any of the host changes
        g_old = self.config.n_heads // self.config.n_kv_heads  # type: ignore[attr-defined]
        (qw, qb), (kw, kb), (vw, vb) = (weights[p] for p in ("q_proj", "k_proj", "v_proj"))
        if (qw.shape[0], kw.shape[0], vw.shape[0]) != (n_heads * d_h, n_kv_heads * d_h, n_kv_heads * d_h):
            raise ValueError(f"write_heads: Q/K/V rows {qw.shape[0]}, {kw.shape[0]}, {vw.shape[0]} do not hold "
                             f"h={n_heads}, h_kv={n_kv_heads} heads of d_h={d_h}")
        new = {"out_proj": weights["out_proj"]}
        if found.layout == "split":
            new.update({"q_proj": (qw, qb), "k_proj": (kw, kb), "v_proj": (vw, vb)})
        elif found.layout == "kv_blocks":  # Q in its own projection, K | V as the fused one's blocks
            new["q_proj"] = (qw, qb)
            setattr(host, found.fused, projection_like(torch.cat((kw, vw)), None if kb is None else torch.cat((kb, vb)),
                                                       getattr(host, found.fused)))
        else:
            parts = (qw, kw, vw), (qb, kb, vb)
            if found.layout == "per_head":  # head-major [q_i, k_i, v_i] rows (edit_refusal: h == h_kv)
                w, b = (None if t[0] is None else torch.stack([x.unflatten(0, (n_heads, d_h)) for x in t], 1
                                                               ).flatten(0, 2) for t in parts)
            else:
                w, b = (None if t[0] is None else torch.cat(t) for t in parts)
            setattr(host, found.fused, projection_like(w, b, getattr(host, found.fused)))
        for p, (w, b) in new.items():
            where = found.where[p]
            where.replace(projection_like(w, b, where.module()))
        take_per_head(host, entry, heads_from, n_heads)
        carry_head_state(host, entry, sides, heads_from, g_old, n_heads, n_kv_heads)
        set_counts(host, entry, n_heads, n_kv_heads, d_h)
        if not any(isinstance(getattr(o, n, None), int) for o in (host, host.config) for n in entry.d_v):
            host.head_dim = d_h  # the next patch would otherwise derive it from d / h
        host.num_heads, host.num_key_value_heads = n_heads, n_kv_heads  # what the next patch reads first


def projection_like(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Module) -> nn.Module:
    """A new projection of ``like``'s kind (``nn.Linear``, or transformers' ``Conv1D`` storing ``weight.T``) holding
    copies of ``weight`` / ``bias`` (their device and dtype), with ``like``'s mode, the weight taking the
    ``requires_grad`` of ``like.weight`` and the bias that of ``like.bias`` (of ``like.weight`` where it has none).

    Shapes:
        weight (out, in), bias (out,) or None
    """
    grad = bool(getattr(getattr(like, "weight", None), "requires_grad", True))
    # a bias keeps its own flag (BitFit trains biases alone); a fused projection's bias is the fused module's
    bias_grad = bool(getattr(getattr(like, "bias", None), "requires_grad", grad))
    if is_conv1d(like):
        from transformers.pytorch_utils import Conv1D

        with torch.device("meta"):  # no allocation: the parameters are replaced at once
            new = Conv1D(weight.shape[0], weight.shape[1])
        new.weight = nn.Parameter(weight.detach().T.contiguous(), requires_grad=grad)  # (in, out)
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias_grad)
    else:
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        new.weight = nn.Parameter(weight.detach().clone(), requires_grad=grad)
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias_grad)
    return new.train(like.training)


def set_counts(host: nn.Module, entry: Entry, n_heads: int, n_kv_heads: int, d_head: int) -> None:
    """Set the head-count attributes ``host`` has (as ints) among the registry's names."""
    for names, value in ((entry.set_heads, n_heads), (entry.set_kv_heads, n_kv_heads),
                         (entry.set_groups, n_heads // n_kv_heads), (entry.set_inner, n_heads * d_head),
                         (entry.set_kv_inner, n_kv_heads * d_head)):
        for name in names:
            if isinstance(getattr(host, name, None), int) and not isinstance(getattr(host, name), bool):
                setattr(host, name, value)


def take_per_head(host: nn.Module, entry: Entry, heads_from: Sequence[int] | None, n_heads: int) -> None:
    """Give ``host``'s per-query-head parameters (the registry's ``per_head``) the rows of the heads kept
    (``heads_from[i]``: the old index of new head i), or zeros of the new size without ``heads_from``."""
    for name in entry.per_head:
        p = getattr(host, name, None)
        if not isinstance(p, nn.Parameter):
            continue
        if heads_from is None:  # no heads to take them from (a model rebuilt before its weights load): zeros
            value = p.detach().new_zeros((n_heads, *p.shape[1:]))
        else:
            index = torch.tensor(list(heads_from), dtype=torch.long, device=p.device)
            value = p.detach().index_select(0, index).clone()
        setattr(host, name, nn.Parameter(value, requires_grad=p.requires_grad))


def carry_head_state(host: nn.Module, entry: Entry, sides: dict[str, str], heads_from: Sequence[int] | None,
                     g_old: int, n_heads: int, n_kv_heads: int) -> None:
    """Resize ``host``'s per-head state (``sides``: :meth:`SurgerySeam.head_state_sides`) as the projections
    were: a query head's entry goes with it (``heads_from[i]``: the old index of new head i); new K/V head j
    gets the mean of the entries of the old K/V heads its query heads read (a copy when they read one, as the
    K/V weights are). Without ``heads_from`` (a model rebuilt before its weights load) every entry is head 0's.
    A ``ModuleList``'s owner has its int head count (StableLM's ``num_heads``) set to the new length."""
    g_new = n_heads // n_kv_heads
    for path, side in sides.items():
        n = n_heads if side == "q" else n_kv_heads
        if heads_from is None:
            sources = [[0]] * n
        elif side == "q":
            sources = [[i] for i in heads_from]
        else:  # the K/V heads the new group's members read (as surgery.weights pooled / copied W_K, W_V)
            sources = [[heads_from[i] // g_old for i in range(j * g_new, (j + 1) * g_new)] for j in range(n)]
        owner_path, _, attr = path.rpartition(".")
        owner = host.get_submodule(owner_path)
        old = getattr(owner, attr)
        if isinstance(old, nn.ModuleList):
            setattr(owner, attr, nn.ModuleList([_mean_module([old[i] for i in src]) for src in sources]))
            if owner is not host:
                for name in entry.set_heads + entry.set_kv_heads:
                    if getattr(owner, name, None) == len(old) and not isinstance(getattr(owner, name), bool):
                        setattr(owner, name, n)
        else:
            p = old.detach()
            value = torch.stack([p[list(src)].mean(0) if len(set(src)) > 1 else p[src[0]] for src in sources]).clone()
            setattr(owner, attr, nn.Parameter(value, requires_grad=old.requires_grad))


def _mean_module(modules: list[nn.Module]) -> nn.Module:
    """A copy of ``modules[0]`` whose parameters are the mean of theirs (a plain copy when all are one)."""
    new = copy.deepcopy(modules[0])
    if len({id(m) for m in modules}) > 1:
        with torch.no_grad():
            for name, p in new.named_parameters():
                p.copy_(torch.stack([m.get_parameter(name).detach() for m in modules]).mean(0))
    return new
