"""Sequence parallelism by heads (DeepSpeed-Ulysses style): one all-to-all swaps sequence sharding for heads.

Outside attention every rank of the sequence-parallel group holds a slice of the sequence, ``(b, s_r, d)``
with ``sum_r s_r = S``. Each rank projects its slice to Q, K, V (the weights are replicated), rotates them at
their *global* positions, and one all-to-all per tensor sends every rank the whole sequence of the heads it
attends to (:mod:`headwise.parallel.sequence_plan`). Heads never talk, so attention then runs exactly as in one
process, on the global sequence, with the global mask; a last all-to-all sends each rank its slice of every
head's output back, and W_O runs on the slice.

Conventions (the same on every rank):

* ``x`` (and ``context`` / ``key`` / ``value``) is this rank's contiguous slice of the sequence, rank order
  = sequence order, any lengths (e.g. ``torch.tensor_split(x, P, dim=1)[rank]``). The lengths are exchanged
  (one tiny all-gather per call, :func:`~headwise.parallel.agreement.agree`) with every rank's call
  signature and the outcome of its own checks: a call refused on one rank, or calls that differ, raise the
  same error on every rank before any other collective. Uneven slices are padded for the all-to-alls and
  unpadded before attention, so padding is never attended to.
* ``mask`` is the *global* mask, identical on every rank: broadcastable to ``(b, h, S_q, S_kv)`` (a padding
  mask ``(b, 1, 1, S_kv)``, a sliding-window mask ``(S_q, S_kv)``, a per-head bias ``(h, S_q, S_kv)`` ...).
  Each rank keeps the rows of its heads; a mask that requires grad has its gradient summed as the weights'.
  ``causal`` is over global positions, as in one process.
* ``positions`` (rotary layers) are global: ``(S_q,)`` or ``(b, S_q)``, default ``arange(S_q)``.
* The weights are replicated, so every rank's gradient holds only its tokens' part. With
  ``grad_reduction="sum"`` (default) each call passes the parameters that require grad through an identity
  whose backward sums their gradients over the group (as DDP does, without averaging): after
  ``loss.backward()`` with ``loss`` the sum of the ranks' losses, every rank holds the single-process gradient.
  ``"none"`` leaves the per-rank parts, for a data-parallel wrapper whose group already spans the
  sequence-parallel ranks.
* With a 2-D ``DeviceMesh`` named ``("sp", "tp")`` the layer is first split by heads over ``tp``
  (:func:`~headwise.parallel.tensor.tensor_parallel`), then each shard's heads over ``sp``.

Only ``torch.distributed.all_to_all_single``, ``all_gather`` and ``all_reduce`` are called, on tensors on the
layer's device: gloo on CPU and NCCL on GPU run the same lines. A collective that exceeds the process group's
timeout raises :class:`~headwise.parallel.agreement.CollectiveTimeoutError` naming the step.

Shapes:
    b: batch, s_r: this rank's slice, S_q / S_kv: global query / key lengths, s_max = max_r s_r,
    h: query heads, h_r: heads this rank attends to, h_kv: K/V heads, d: d_model, d_h: d_head, P: ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..masks import validate_mask
from ..validation import check_forward, check_positions
from .agreement import agree, flag, signature
from .autograd import AllToAll, SumOverReplicas, copy_to_group
from .sequence_plan import SequenceParallelPlan, SequenceRank, plan_sequence_parallel
from .tensor import TensorParallelAttention, tensor_parallel

__all__ = ["SequenceParallelAttention", "sequence_parallel", "GRAD_REDUCTIONS"]

GRAD_REDUCTIONS = ("sum", "none")


class _Run(nn.Module):
    """Runs ``fn()``: :func:`torch.func.functional_call` on it swaps ``layer``'s parameters for the summed
    views for the duration of one call, whatever methods of the layer ``fn`` calls."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, fn: Any) -> Any:
        return fn()


class SequenceParallelAttention(nn.Module):
    """This rank's part of a sequence-parallel attention layer; build it with :func:`sequence_parallel`.

    Its forward takes this rank's sequence slice and returns its slice of the output of the whole layer on
    the whole sequence (module doc for the conventions). ``layer`` is the module holding the weights: a copy
    of the unsharded layer, or its :class:`TensorParallelAttention` shard under a 2-D mesh.

    Attributes:
        plan: the :class:`SequenceParallelPlan`; rank, world_size: this rank's place in the sequence-parallel
        group; heads: the global query heads this rank attends to; grad_reduction: ``"sum"`` or ``"none"``;
        check_group: on a 2-D mesh, the group of all its ranks in which every call is checked (None: the
        sequence-parallel group).

    Shapes:
        x: (b, s_r, d) or (s_r, d) -> (b, s_r, d) or (s_r, d)
    """

    def __init__(self, layer: MultiHeadAttention, plan: SequenceParallelPlan, group: Any, rank: int,
                 tp_rank: int, global_config: AttentionConfig, grad_reduction: str, check_group: Any = None) -> None:
        super().__init__()
        self.layer = layer
        self.plan, self.group, self.rank, self.world_size = plan, group, rank, plan.sp
        # On a 2-D mesh the tensor-parallel all-reduce pairs ranks of other sequence-parallel groups too: the
        # call check then spans every rank of the mesh.
        self.check_group = check_group
        self.global_config, self.grad_reduction, self.tp_rank = global_config, grad_reduction, tp_rank
        self.part: SequenceRank = plan.rank(rank)
        self.heads = plan.global_q_heads(rank, tp_rank)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, mask: torch.Tensor | None = None, causal: bool = False,
                positions: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
        """This rank's slice of the layer's output on the whole sequence. A collective: every rank calls it.

        Args:
            x: this rank's slice of the queries' inputs.
            context: this rank's slice of the keys' and values' inputs (cross-attention); None: ``x``.
            key, value: separate slices of key and value inputs (widths kdim, vdim).
            mask: the global mask (bool, True = may attend, or floating, added), the same on every rank.
            causal: bottom-right causal masking over the global positions.
            positions: global rotary positions (S_q,) or (b, S_q); default ``arange(S_q)``.
            options: none is taken; a misspelt keyword is refused on every rank (``TypeError``) in the
                call check, instead of by Python on one rank while the others wait in the exchange.

        Shapes:
            x: (b, s_r, d) or (s_r, d); context: (b, s_kv_r, kdim); mask: broadcastable to (b, h, S_q, S_kv)
            -> (b, s_r, d) or (s_r, d)
        """
        # Refusing alone would leave the other ranks inside a collective that pairs with this rank's next
        # call: every check runs here, and the outcome travels with the slice lengths (one all-gather).
        error, checked = None, None
        try:
            if options:
                raise TypeError(f"forward() got unexpected keyword arguments {sorted(options)}; it takes "
                                f"['key', 'value', 'mask', 'causal', 'positions']")
            checked = self._check(x, context, key, value, mask, causal, positions)
        except (ValueError, TypeError) as err:
            error = err
        lq, lkv = self._lengths(x, context, key, value, mask, causal, positions, error)
        x, key, value, batched = checked
        summed = self._summed_parameters()
        if not summed:
            return self._attend(x, key, value, mask, causal, positions, lq, lkv, batched)
        # The weights are replicated, so each rank's backward holds only its tokens' part: the parameters
        # pass, in this call, an identity whose backward sums over the group. Chosen per call, not once at
        # construction, so that parameters unfrozen or replaced since (load_state_dict(assign=True)) are
        # summed as well.
        names = list(summed)
        views = SumOverReplicas.apply(self.group, 1, 0, *summed.values())  # one slot: every rank a replica
        return torch.func.functional_call(
            _Run(self.layer), {f"layer.{n}": t for n, t in zip(names, views)},
            (lambda: self._attend(x, key, value, mask, causal, positions, lq, lkv, batched),), strict=False)

    def _summed_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters whose gradient this call sums over the group: none unless ``grad_reduction`` is
        ``"sum"``, over more than one rank, with grad enabled."""
        if self.grad_reduction != "sum" or self.world_size == 1 or not torch.is_grad_enabled():
            return {}
        return {n: p for n, p in self.layer.named_parameters() if p.requires_grad}

    def _attend(self, x: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, mask: Any,
                causal: bool, positions: Any, lq: list[int], lkv: list[int], batched: bool) -> torch.Tensor:
        """The forward once every rank has agreed on the call (the lengths of every rank's slices known)."""
        layer = self.layer
        w = layer.q_proj.weight
        s_q, s_kv = sum(lq), sum(lkv)
        b, h = x.shape[0], self.global_config.n_heads
        if isinstance(layer, TensorParallelAttention):  # dL/dx and dL/dmask sum over the tp shards' heads
            x, key, value, mask = (layer.copy_to_heads(t) for t in (x, key, value, mask))
        if self.grad_reduction == "sum":  # each rank's heads hold a part of dL/dmask, as of a replicated weight
            mask = copy_to_group(mask, self.group, self.world_size)
        # What is left depends only on the mask's and positions' shapes and the global lengths, all the same
        # on every rank: every rank passes or every rank refuses.
        if mask is not None:
            mask = validate_mask(mask, (b, h, s_q, s_kv), w.dtype, w.device)
            if mask.shape[1] == h and h > 1:
                mask = mask.narrow(1, self.heads[0], len(self.heads))  # (b, h_r, S_q, S_kv)
        start = sum(lq[:self.rank])
        if layer.rotary is not None:
            if positions is None:
                positions = torch.arange(s_q, device=x.device)
            positions = check_positions(positions, b, s_q)[..., start:start + lq[self.rank]]  # (b or 1, s_r)
        # Project this rank's slice: (b, h', s_r, d_h) queries, (b, h_kv', s_r, d_h) keys and values.
        q, k, v = layer.project_qkv(x) if key is None else (layer.project_q(x), *layer.project_kv(key, value))
        if layer.rotary is not None:
            q, k = layer.rotate(q, k, positions)
        q = self._to_heads(q, lq, [len(r.q_heads) for r in self.plan.ranks], "the all-to-all of Q")
        kv_counts = [len(r.kv_heads) for r in self.plan.ranks]
        index = self._kv_send_index(k.device)
        if index is not None:
            k, v = k.index_select(1, index), v.index_select(1, index)  # (b, sum_j |kv_j|, s_kv_r, d_h)
        k = self._to_heads(k, lkv, kv_counts, "the all-to-all of K")  # (b, h_kv_r, S_kv, d_h)
        v = self._to_heads(v, lkv, kv_counts, "the all-to-all of V")
        if not self.part.grouped:  # uneven K/V groups on this rank: one K/V head per query head
            rows = torch.tensor(self.part.kv_index, device=k.device)
            k, v = k.index_select(1, rows), v.index_select(1, rows)  # (b, h_r, S_kv, d_h)
        z, _ = layer.attend(q, k, v, mask=mask, causal=causal)  # (b, h_r, S_q, d_h): the global sequence
        del q, k, v
        z = self._to_sequence(z, lq)  # (b, h', s_r, d_h)
        y = layer.project_out(z)  # (b, s_r, d); under tp, summed over the shards
        return y if batched else y.squeeze(0)

    # -- the exchanges -------------------------------------------------------------------------------------
    def _check(self, x: Any, context: Any, key: Any, value: Any, mask: Any, causal: Any,
               positions: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
        """Every check that needs no other rank: x, key, value batched; the mask and positions as far as
        they can be checked before the global lengths are known."""
        layer = self.layer
        if layer.tracer is not None:
            # A rank attends with some of the heads, which a trace would take for the layer's first ones.
            raise ValueError("headwise.trace does not run on a sequence-parallel layer (each rank attends with "
                             f"only heads {list(self.heads)}); trace the unsharded layer or a tensor_parallel shard")
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {self.grad_reduction!r}")
        w = layer.q_proj.weight
        x, key, value, _, _, batched = check_forward(layer.config, w.dtype, w.device, layer.rotary is not None,
                                                     x, context, key, value, None, causal, None, None, False)
        if positions is not None and layer.rotary is None:
            raise ValueError("positions= is for rotary layers; this layer has no rotary embedding")
        b, h = x.shape[0], self.global_config.n_heads
        if mask is not None:  # against its own last two sizes: the global (S_q, S_kv) are checked after
            own = tuple(mask.shape[-2:]) if isinstance(mask, torch.Tensor) else ()
            validate_mask(mask, (b, h, *(1,) * (2 - len(own)), *own), w.dtype, w.device)
        if positions is not None:
            s = positions.shape[-1] if isinstance(positions, torch.Tensor) and positions.dim() else 0
            check_positions(positions, b, s, w.device)
        return x, key, value, batched

    def _lengths(self, x: Any, context: Any, key: Any, value: Any, mask: Any, causal: Any, positions: Any,
                 error: BaseException | None) -> tuple[list[int], list[int]]:
        """Every rank's slice lengths, in one all-gather with every rank's check outcome and call signature:
        raises the same error on every rank if any rank refused the call or the calls differ."""
        device = self.layer.q_proj.weight.device
        kv = context if key is None else key
        sq = x.shape[-2] if isinstance(x, torch.Tensor) and x.dim() >= 2 else 0
        skv = kv.shape[-2] if isinstance(kv, torch.Tensor) and kv.dim() >= 2 else sq if kv is None else 0
        batch = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 3 else 1
        same = {
            "batch sizes": (batch,),
            "cross-attention (0: self, 1: context, 2: key/value)": (0 if kv is None else 1 if key is None else 2,),
            "inputs x": signature(x, device, free_dim=-2),
            "inputs context": signature(context, device, free_dim=-2),
            "inputs key": signature(key, device, free_dim=-2),
            "inputs value": signature(value, device, free_dim=-2),
            "masks": signature(mask, device),
            "positions": signature(positions, device),
            "causal flags (0: False, 1: True, 2: not a bool)": flag(causal),
            # The gradient all-reduce in backward pairs only if every rank sums the same parameters.
            "layer states (grad mode, trainable parameters as bits)": (
                int(torch.is_grad_enabled()),
                sum(1 << i for i, p in enumerate(self.layer.parameters()) if p.requires_grad)),
            # It decides whether the backward all-reduces the parameters' (and a mask's) gradients.
            f"grad_reductions ({', '.join(f'{i}: {r}' for i, r in enumerate(GRAD_REDUCTIONS))})": (
                GRAD_REDUCTIONS.index(self.grad_reduction) if self.grad_reduction in GRAD_REDUCTIONS else -1,),
        }
        if self.check_group is None:
            got = agree(self.group, self.world_size, device, "sequence_parallel", error, same,
                        {"s_q": (sq,), "s_kv": (skv,)})
            return [s for (s,) in got["s_q"]], [s for (s,) in got["s_kv"]]
        got = agree(self.check_group, dist.get_world_size(self.check_group), device, "sequence_parallel", error,
                    same, {"lengths": (self.rank, self.tp_rank, sq, skv)})
        by_rank: dict[int, set] = {}
        for sp_rank, tp_rank, a, b in got["lengths"]:
            by_rank.setdefault(sp_rank, set()).add((a, b))
        differ = [r for r in sorted(by_rank) if len(by_rank[r]) > 1]
        if differ:  # every rank sees the same table, so every rank raises this
            raise ValueError(f"sequence_parallel: the tensor-parallel shards of sp rank {differ[0]} must hold the "
                             f"same sequence slice; their (s_q, s_kv) differ: {sorted(by_rank[differ[0]])}")
        lengths = [next(iter(by_rank[r])) for r in range(self.world_size)]
        return [a for a, _ in lengths], [b for _, b in lengths]

    def _to_heads(self, t: torch.Tensor, lengths: list[int], counts: list[int], what: str) -> torch.Tensor:
        """(b, sum(counts), s_r, d_h), head blocks in rank order -> (b, counts[rank], S, d_h): the sequence
        slices of every rank, padding removed."""
        P, s_max = self.world_size, max(lengths)
        if P == 1:
            return t
        b, _, s, d = t.shape
        if s < s_max:
            t = F.pad(t, (0, 0, 0, s_max - s))  # (b, n, s_max, d_h): equal blocks for the all-to-all
        n = counts[self.rank]
        got = AllToAll.apply(t.transpose(0, 1), self.group, P, counts, [n] * P, what)  # (P * n, b, s_max, d_h)
        got = got.view(P, n, b, s_max, d).permute(2, 1, 0, 3, 4)  # (b, n, P, s_max, d_h)
        if min(lengths) == s_max:
            return got.reshape(b, n, P * s_max, d)  # (b, n, S, d_h)
        return torch.cat([got[:, :, p, :lengths[p]] for p in range(P)], dim=2)  # (b, n, S, d_h)

    def _to_sequence(self, z: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(b, h_r, S, d_h) -> (b, h', s_r, d_h): every head of this rank's slice, back from their ranks."""
        P, s_max = self.world_size, max(lengths)
        if P == 1:
            return z
        b, n, _, d = z.shape
        if min(lengths) == s_max:
            z = z.reshape(b, n, P, s_max, d)
        else:
            z = torch.stack([F.pad(part, (0, 0, 0, s_max - part.shape[2]))
                             for part in z.split(lengths, dim=2)], dim=2)  # (b, n, P, s_max, d_h)
        counts = [len(r.q_heads) for r in self.plan.ranks]
        send = z.permute(2, 1, 0, 3, 4).reshape(P * n, b, s_max, d)  # block p: this rank's heads, p's slice
        got = AllToAll.apply(send, self.group, P, [n] * P, counts, "the all-to-all of the attention output")
        return got.transpose(0, 1)[:, :, :lengths[self.rank]]  # (b, h', s_r, d_h)

    def _kv_send_index(self, device: torch.device) -> torch.Tensor | None:
        """Which local K/V heads go, in order, to the ranks (None when that is every head once, in order)."""
        order = [k for r in self.plan.ranks for k in r.kv_heads]
        if self.world_size == 1 or order == list(range(self.plan.shard_kv_heads)):
            return None
        return torch.tensor(order, device=device)

    def extra_repr(self) -> str:
        p = self.part
        return (f"sp rank={self.rank}/{self.world_size}, tp rank={self.tp_rank}/{self.plan.tp}, query heads="
                f"{list(self.heads)}, K/V heads (of the shard)={list(p.kv_heads)}"
                f"{' (replicated)' if self.plan.kv_replicated else ''}, grad_reduction={self.grad_reduction!r}")


def _groups(group_or_mesh: Any) -> tuple[Any, Any]:
    """(the sequence-parallel group, the tensor-parallel 1-D mesh or None), without any communication."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sequence_parallel needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    if group_or_mesh is None:
        return dist.group.WORLD, None
    if isinstance(group_or_mesh, dist.ProcessGroup):
        return group_or_mesh, None
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group_or_mesh, DeviceMesh):
        raise TypeError(f"group_or_mesh must be a torch.distributed ProcessGroup, a 1-D DeviceMesh, a 2-D "
                        f"DeviceMesh named ('sp', 'tp'), or None; got {type(group_or_mesh).__name__}")
    mesh = group_or_mesh
    if mesh.ndim == 1:
        return mesh.get_group(), None
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != ["sp", "tp"]:
        raise ValueError(f"sequence_parallel takes a 1-D DeviceMesh or a 2-D one with dimensions named 'sp' "
                         f"and 'tp'; got ndim={mesh.ndim}, names={names or None}")
    return mesh.get_group("sp"), mesh["tp"]


def sequence_parallel(attn: MultiHeadAttention, group_or_mesh: Any = None, *,
                      grad_reduction: str = "sum") -> SequenceParallelAttention:
    """Shard ``attn``'s sequence over a process group (heads over ``tp`` too, on a 2-D mesh).

    Call it on every rank with the same layer (same weights). It returns a new module: a copy of ``attn``
    (its tensor-parallel shard on a 2-D mesh; a :class:`TensorParallelAttention` passed in is wrapped, not
    copied). The plan (:func:`~headwise.parallel.sequence_plan.plan_sequence_parallel`) is checked before
    any communication, so an impossible layout raises ``ValueError`` naming the valid ones on every rank;
    building the module communicates nothing (except on a 2-D mesh smaller than the whole world, whose ranks
    create one process group for the call check, see :attr:`SequenceParallelAttention.check_group`).

    Args:
        attn: the layer (MHA, GQA or MQA; rotary, biases, kdim/vdim kept), or its tensor-parallel shard.
        group_or_mesh: a ProcessGroup, a 1-D DeviceMesh, a 2-D DeviceMesh named ("sp", "tp"), or None
            (the default group).
        grad_reduction: ``"sum"``: parameter gradients are summed over the sequence-parallel group in
            backward; ``"none"``: each rank keeps its tokens' part (module doc).

    Shapes:
        forward: x (b, s_r, d), this rank's slice -> (b, s_r, d), this rank's slice of the output

    Example (a one-rank group, so that it runs anywhere; under torchrun every rank passes its slice):
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> attn = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
        >>> sp = sequence_parallel(attn)
        >>> sp.heads, sp.plan.sp
        ((0, 1, 2, 3), 1)
        >>> x = torch.randn(2, 5, 16)
        >>> torch.testing.assert_close(sp(x, causal=True), attn(x, causal=True))
        >>> dist.destroy_process_group()
    """
    if isinstance(attn, SequenceParallelAttention):
        raise TypeError("this layer is already sequence-parallel; pass the unsharded MultiHeadAttention")
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"sequence_parallel needs a headwise MultiHeadAttention, got {type(attn).__name__}")
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    group, tp_mesh = _groups(group_or_mesh)
    sp_size, sp_rank = dist.get_world_size(group), dist.get_rank(group)
    if sp_rank < 0:
        raise ValueError("this process is not a member of the given process group")
    if isinstance(attn, TensorParallelAttention):
        if tp_mesh is not None:
            raise ValueError("this layer is already tensor-parallel; pass a 1-D sequence-parallel group, "
                             "or the unsharded layer with the 2-D mesh")
        cfg, tp, tp_rank = attn.global_config, attn.world_size, attn.rank
    else:
        cfg = attn.config
        tp = 1 if tp_mesh is None else tp_mesh.size()
        tp_rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
    plan = plan_sequence_parallel(cfg.n_heads, cfg.n_kv_heads, sp=sp_size, tp=tp)  # raises before any exchange
    if isinstance(attn, TensorParallelAttention):
        layer = attn
    elif tp_mesh is not None:
        layer = tensor_parallel(attn, tp_mesh)
    else:
        layer = copy.deepcopy(attn)
    check_group = _mesh_group(group_or_mesh) if tp_mesh is not None and tp > 1 else None
    return SequenceParallelAttention(layer, plan, group, sp_rank, tp_rank, cfg, grad_reduction, check_group)


def _mesh_group(mesh: Any) -> Any:
    """A group of every rank of a 2-D mesh, for the call check: the default group when the mesh is the whole
    world (nothing is created), else a new group of the mesh's ranks (created by them alone)."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)
