"""Tensor parallelism by whole heads: column-parallel Q/K/V, row-parallel W_O, one all-reduce.

Heads never talk to each other inside the layer; they only mix in ``out_proj`` (W_O), and W_O is a sum over
heads: ``y = sum_h head_h(x) @ W_O[h] + b_O``. So rank ``r`` keeps the rows of ``q_proj``/``k_proj``/``v_proj``
that produce its heads (column-parallel: whole heads, never part of one), the matching input columns of
``out_proj`` (row-parallel), computes its partial sum, and one all-reduce (sum) gives every rank the full
output. ``out_proj.bias`` is replicated and added once, after the reduce.

Autograd follows the usual tensor-parallel convention: every rank holds the same input and computes the same
loss from the same (replicated) output. Then

* the all-reduce after W_O has an identity backward (each rank already holds the full output gradient);
* the input ``x`` (``context``/``key``/``value``, a mask requiring grad) passes an identity whose backward
  all-reduces the gradient, because every rank's heads contribute a part of ``dL/dx``;
* replicated K/V heads (fewer K/V heads than ranks) pass an identity whose backward sums the gradient over
  the ranks that hold the same K/V head, so every replica ends with the full gradient and stays in sync;
* per-head Q/K norms (QK-norm layers), whole on every rank and read by every rank's heads, sum theirs over
  the group.

After ``loss.backward()`` each local parameter's ``.grad`` is exactly its slice of the single-process
gradient, and ``x.grad`` is the full input gradient on every rank. The same code runs on gloo (CPU) and NCCL
(GPU): it only calls ``torch.distributed.all_reduce``.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: global query heads, h_local = h // world_size,
    h_kv: global K/V heads, kv_local: K/V heads on one rank, d: model width, d_h: head width.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import functional as hwf
from ..attention import MultiHeadAttention
from ..head import AttentionHead
from ..module_calls import bare_linear
from .autograd import ReduceFromHeads, SumOverReplicas, copy_to_group
from .plan import HeadPartition, TensorParallelPlan, plan_heads
from .shard_state import ShardState, shard_record
from .source import check_source, qk_norms
from .tensor_call import agree_on_call

__all__ = ["HeadNotLocalError", "TensorParallelAttention", "tensor_parallel"]


class HeadNotLocalError(ValueError):
    """A global head index asked of a rank that does not own it; ``owner`` is the rank that does."""

    def __init__(self, message: str, owner: int) -> None:
        super().__init__(message)
        self.owner = owner


# -- the rank-local layer ------------------------------------------------------------------------------
class TensorParallelAttention(ShardState, MultiHeadAttention):
    """The rank-local part of a :class:`MultiHeadAttention` split by whole heads; build it with
    :func:`tensor_parallel`.

    It is a :class:`MultiHeadAttention` whose ``config`` has the local head counts (``n_heads = h_local``,
    ``n_kv_heads = kv_local``, same ``d_head`` and ``scale``); ``global_config`` is the unsharded layer's.
    Its forward takes the full (replicated) input and returns the full output on every rank.
    ``new_cache`` allocates only the local K/V heads. ``head(h)`` takes a *global* head index.

    Attributes:
        plan: the :class:`TensorParallelPlan` (which heads every rank owns); partition: this rank's
        :class:`HeadPartition`; group, rank, world_size: the process group and this rank's place in it;
        check_inputs: whether each forward first checks that every rank makes the same call (default True).

    Shapes:
        x: (b, s_q, d) or (s_q, d), identical on every rank -> (b, s_q, d), identical on every rank
        mask: broadcastable to (b, h, s_q, s_kv) with the global h (per-head masks are sliced to local heads)
        weights (return_weights=True): (b, h_local, s_q, s_kv), this rank's heads only
    """

    plan: TensorParallelPlan
    partition: HeadPartition
    global_config: Any
    #: Check, in one small all-gather before the forward's all-reduce, that every rank makes the same call
    #: (shapes, dtypes and flags of every argument, the cache's length, grad mode) and that no rank refuses
    #: it alone; every rank then raises the same ``ValueError`` naming the ranks that differ. False skips the
    #: exchange: calls that differ by rank then give wrong outputs, or abort a rank, without an error.
    check_inputs: bool = True

    # -- forward -----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """Same signature and result as :meth:`MultiHeadAttention.forward`, on every rank.

        Shapes:
            x: (b, s_q, d) or (s_q, d); context: (b, s_kv, d); mask: broadcastable to (b, h, s_q, s_kv)
            -> (b, s_q, d) [, weights (b, h_local, s_q, s_kv)]
        """
        if self.check_inputs and self.world_size > 1:
            agree_on_call(self, x, context, key, value, mask, kwargs)
        # A mask that requires grad (a learnable score bias) is read by every rank's heads, as x is.
        x, context, key, value, mask = (self.copy_to_heads(t) for t in (x, context, key, value, mask))
        return super().forward(x, context, key=key, value=value, mask=self.local_mask(mask), **kwargs)

    def copy_to_heads(self, t: Any) -> Any:
        """``t`` unchanged, but its gradient is summed over the group in backward (every rank's heads read
        it); None and tensors without gradient pass as they are. For layers that call the projections
        themselves (e.g. :mod:`headwise.parallel.sequence`)."""
        return copy_to_group(t, self.group, self.world_size)

    def local_mask(self, mask: Any) -> Any:
        """The mask :meth:`forward` applies on this rank: a per-head mask with the global h cut down to this
        rank's heads; any other mask (or None) as it is. Raises ``ValueError`` for another head count.

        Shapes: (..., h, s_q, s_kv) -> (..., h_local, s_q, s_kv); a mask without a head axis unchanged"""
        # Broadcasting aligns a mask's last three dims with (h, s_q, s_kv): its head axis is dim() - 3.
        if not isinstance(mask, torch.Tensor) or mask.dim() < 3 or mask.shape[-3] == 1:
            return mask
        h = self.global_config.n_heads
        if mask.shape[-3] != h:
            raise ValueError(f"a per-head mask must have 1 or the global h={h} heads in its head axis "
                             f"(b, h, s_q, s_kv), got {tuple(mask.shape)}")
        p = self.partition
        return mask.narrow(mask.dim() - 3, p.q_heads[0], p.n_local_heads)  # (b, h_local, s_q, s_kv)

    def explain_dispatch(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """As :meth:`MultiHeadAttention.explain_dispatch`, for the call :meth:`forward` runs on this rank: a
        per-head mask with the global h is cut down to this rank's heads first, as ``forward`` does.

        Shapes: x (b, s_q, d) or (s_q, d); mask broadcastable to (b, h, s_q, s_kv), h global"""
        return super().explain_dispatch(x, mask=self.local_mask(mask), **kwargs)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's Q, K, V heads of self-attention: K/V through :meth:`project_kv` (replicas sum gradients).

        Shapes: x (b, s, d) -> (b, h_local, s, d_h), (b, kv_local, s, d_h) x2"""
        return (self.project_q(x), *self.project_kv(x))

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's query heads (normalised by ``q_norm`` where the layer has QK norms).

        Shapes: x (b, s_q, d) -> (b, h_local, s_q, d_h)"""
        return self._normed("q_norm", super().project_q(x))

    def project_kv(self, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K/V heads (keys normalised by ``k_norm`` where the layer has QK norms); replicated K/V
        heads pass their projections' trainable parameters through a sum over the replicas' gradients.

        Shapes: key (b, s_kv, kdim), value (b, s_kv, vdim) -> (b, kv_local, s_kv, d_h) each"""
        trained = [(i, n, p) for i, m in enumerate((self.k_proj, self.v_proj)) for n, p in m.named_parameters()
                   if p.requires_grad] if self.plan.kv_replicated and torch.is_grad_enabled() else []
        if not trained:
            k, v = super().project_kv(key, value)
            return self._normed("k_norm", k), v
        value = key if value is None else value
        synced = SumOverReplicas.apply(self.group, self.plan.n_kv_heads, self.partition.kv_heads[0],
                                       *(p for _, _, p in trained))
        swapped: tuple[dict, dict] = ({}, {})
        for (i, n, _), t in zip(trained, synced):
            swapped[i][n] = t
        # Through the modules, with the summed parameters in place of their own: an adapter or a hook on
        # k_proj / v_proj runs as it does without grad.
        k = torch.func.functional_call(self.k_proj, swapped[0], (key,))  # (b, s_kv, kv_local * d_h)
        v = torch.func.functional_call(self.v_proj, swapped[1], (value,))
        n = self.config.n_kv_heads
        return self._normed("k_norm", hwf.split_heads(k, n)), hwf.split_heads(v, n)  # (b, kv_local, s_kv, d_h)

    def _normed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` through the norm ``name`` if the layer has one. Every rank's heads read the same (replicated)
        norm, so its trainable parameters pass a sum of their gradients over the group, as ``x`` does.

        Shapes: (b, n, s, d_h) -> (b, n, s, d_h)"""
        norm = self._modules.get(name)
        if norm is None:
            return t
        trained = {n: p for n, p in norm.named_parameters() if p.requires_grad}
        if not trained or self.world_size == 1 or not torch.is_grad_enabled():
            return norm(t)
        synced = SumOverReplicas.apply(self.group, 1, 0, *trained.values())
        return torch.func.functional_call(norm, dict(zip(trained, synced)), (t,))

    def project_out(self, context: torch.Tensor, results: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of W_O, summed over ranks, then the bias once (``results``, this rank's heads
        only, are accepted and not used: the sum needs the all-reduce either way).

        A hook or an adapter on ``out_proj`` runs on this rank's heads (input: their columns; output: their
        partial sum plus the bias, which is taken off again before the all-reduce so that it is added once).

        Shapes: (b, h_local, s_q, d_h) -> (b, s_q, d)
        """
        out, merged = self.out_proj, hwf.merge_heads(context)  # (b, s_q, h_local * d_h)
        if bare_linear(out):
            partial = F.linear(merged, out.weight)  # (b, s_q, d), this rank's heads
        else:
            partial = out(merged) if out.bias is None else out(merged) - out.bias  # (b, s_q, d)
        y = ReduceFromHeads.apply(partial, self.group) if self.world_size > 1 else partial
        return y if out.bias is None else y + out.bias

    # -- the global view ---------------------------------------------------------------------------------
    def head(self, index: int) -> AttentionHead:
        """Global query head ``index`` as a view of this rank's weights; raises :class:`HeadNotLocalError`
        naming the owning rank when another rank holds it.

        The view's ``index`` is its local index (it slices the local weights); ``global_index`` and
        ``global_kv_index`` give its place in the unsharded layer.
        """
        h = self.global_config.n_heads
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"head index must be an int, got {type(index).__name__}")
        if not -h <= index < h:
            raise IndexError(f"head index must be in [0, {h}) (global heads), got {index}")
        index %= h
        owner = self.plan.owner_of(index)
        if owner != self.rank:
            raise HeadNotLocalError(
                f"head {index} is on rank {owner}, not on this rank {self.rank} (which holds heads "
                f"{list(self.partition.q_heads)}); call head({index}) on rank {owner}", owner)
        local = self.partition.local_index(index)
        view = AttentionHead.view(self, local)
        if "q_norm" in self._modules:  # the head applies the layer's QK norms, as the unsharded layer's head does
            from ..interop.hf.qk_norm import QKNormHead  # loaded already: the unsharded layer's class needs it

            view.__class__ = QKNormHead
            object.__setattr__(view, "q_norm", self.q_norm)
            object.__setattr__(view, "k_norm", self.k_norm)
        view.global_index = index
        view.global_kv_index = self.partition.global_kv_head_of_local(local)
        return view

    def head_mask_row(self, index: int, n: int) -> int:
        """A per-head mask may be laid out for this rank's heads or for every head of the unsharded layer."""
        if n == self.global_config.n_heads and n != self.n_heads:
            return self.partition.q_heads[index]
        return super().head_mask_row(index, n)

    def heads(self) -> list[AttentionHead]:
        """This rank's heads, in global order (see :meth:`head`)."""
        return [self.head(i) for i in self.partition.q_heads]

    def shard_record(self) -> dict[str, Any]:
        """Which heads this shard holds, for its state dict's metadata (:mod:`headwise.parallel.shard_state`)."""
        p, cfg = self.partition, self.global_config
        return shard_record(self.world_size, self.rank, cfg.n_heads, cfg.n_kv_heads, p.q_heads, p.kv_heads)

    # -- back to one layer ---------------------------------------------------------------------------------
    def unshard(self) -> MultiHeadAttention:
        """The whole layer, gathered from every rank's slices (e.g. to save one checkpoint).

        A collective: call it on every rank of the group; every rank gets the same full layer. Replicated
        K/V heads are taken from the first rank that holds them.

        Shapes:
            q_proj: (h * d_h, d); k_proj, v_proj: (h_kv * d_h, kdim / vdim); out_proj: (d, h * d_h)
        """
        cfg = self.global_config
        parts: dict[str, Any] = dict(config=cfg, rotary=copy.deepcopy(self.rotary), backend=self.backend, device="meta")
        if "q_norm" in self._modules:  # every rank holds the whole norms
            from ..interop.hf.qk_norm import QKNormAttention

            full = QKNormAttention(**parts, q_norm=copy.deepcopy(self.q_norm), k_norm=copy.deepcopy(self.k_norm))
        else:
            full = MultiHeadAttention(**parts)

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            t = t.detach().contiguous()
            if self.world_size == 1:
                return [t]
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(parts, t, group=self.group)
            return parts

        def kv(t: torch.Tensor) -> torch.Tensor:
            chunks, seen = [], set()
            for part, rank_part in zip(gather(t), self.plan.partitions):
                for j, k in enumerate(rank_part.kv_heads):
                    if k not in seen:
                        seen.add(k)
                        chunks.append(part[j * cfg.d_head:(j + 1) * cfg.d_head])
            return torch.cat(chunks)

        def put(module: nn.Linear, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
            setattr(module, name, nn.Parameter(value, requires_grad=like.requires_grad))

        put(full.q_proj, "weight", torch.cat(gather(self.q_proj.weight)), self.q_proj.weight)
        put(full.k_proj, "weight", kv(self.k_proj.weight), self.k_proj.weight)
        put(full.v_proj, "weight", kv(self.v_proj.weight), self.v_proj.weight)
        put(full.out_proj, "weight", torch.cat(gather(self.out_proj.weight), dim=1), self.out_proj.weight)
        if cfg.bias:
            put(full.q_proj, "bias", torch.cat(gather(self.q_proj.bias)), self.q_proj.bias)
            put(full.k_proj, "bias", kv(self.k_proj.bias), self.k_proj.bias)
            put(full.v_proj, "bias", kv(self.v_proj.bias), self.v_proj.bias)
        if cfg.out_bias:
            put(full.out_proj, "bias", self.out_proj.bias.detach().clone(), self.out_proj.bias)
        full.train(self.training)
        return full

    def extra_repr(self) -> str:
        p = self.partition
        norms = f", qk_norm=({self.q_norm}, {self.k_norm})" if "q_norm" in self._modules else ""
        return (f"rank={self.rank}/{self.world_size}, query heads={list(p.q_heads)}, K/V heads={list(p.kv_heads)}"
                f"{' (replicated)' if p.kv_replicated else ''}, " + super().extra_repr() + norms)


def _resolve_group(mesh_or_group: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor_parallel needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    if mesh_or_group is None:
        return dist.group.WORLD
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        DeviceMesh = ()  # type: ignore[assignment]
    if DeviceMesh and isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"tensor_parallel needs a 1-D DeviceMesh (the tensor-parallel dimension), got "
                             f"ndim={mesh_or_group.ndim}; pass mesh['tp'] for a named dimension")
        return mesh_or_group.get_group()
    if isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group
    raise TypeError(f"mesh_or_group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                    f"got {type(mesh_or_group).__name__}")


def tensor_parallel(attn: MultiHeadAttention, mesh_or_group: Any = None, *,
                    check_inputs: bool = True) -> TensorParallelAttention:
    """Split ``attn`` by whole heads over a process group; returns this rank's :class:`TensorParallelAttention`.

    Call it on every rank of the group with the same layer (same weights, e.g. built with the same seed or
    loaded from the same checkpoint). It returns a *new* module holding copies of this rank's slices
    (``attn`` is left untouched; delete it to free the full weights). The head split is checked
    (:func:`~headwise.parallel.plan.plan_heads`) before any communication: an impossible split raises
    ``ValueError`` naming the valid world sizes on every rank, without entering a collective.

    Args:
        attn: the unsharded layer (MHA, GQA or MQA; rotary, biases, kdim/vdim and per-head Q/K norms all kept);
            a layer computing more than these parts is refused (:func:`~headwise.parallel.source.check_source`).
        mesh_or_group: a ``torch.distributed`` ProcessGroup, a 1-D ``DeviceMesh``, or None for the default
            group.
        check_inputs: before each forward's all-reduce, check in one small all-gather that every rank makes
            the same call, so that a call that differs by rank raises the same ``ValueError`` on every rank
            (naming the ranks) instead of a wrong output or an aborted rank; False skips it (the
            ``check_inputs`` attribute of the layer can be changed later).

    Shapes:
        rank r keeps q_proj rows / out_proj columns ``partition.q_rows(d_h)`` (h_local * d_h of them) and
        k_proj/v_proj rows ``partition.kv_rows(d_h)`` (kv_local * d_h); out_proj.bias is replicated.

    Under ``torchrun --nproc-per-node 2`` (see :mod:`examples.tensor_parallel`)::

        dist.init_process_group("gloo")       # or "nccl": the same code path
        torch.manual_seed(0)                  # the same layer on every rank
        attn = MultiHeadAttention(d_model=64, n_heads=8, n_kv_heads=2)
        tp = tensor_parallel(attn)            # rank 0: heads 0-3, K/V head 0; rank 1: heads 4-7, K/V head 1
        y = tp(x, causal=True)                # == attn(x, causal=True) on every rank

    Example (a one-rank group, so that it runs anywhere):
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> attn = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
        >>> tp = tensor_parallel(attn)
        >>> tp.partition.q_heads, tp.new_cache(batch_size=1, max_len=8).n_kv_heads
        ((0, 1, 2, 3), 2)
        >>> x = torch.randn(2, 3, 16)
        >>> torch.testing.assert_close(tp(x, causal=True), attn(x, causal=True))
        >>> dist.destroy_process_group()
    """
    if isinstance(attn, TensorParallelAttention):
        raise TypeError("this layer is already tensor-parallel; pass the unsharded MultiHeadAttention")
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"tensor_parallel needs a headwise MultiHeadAttention, got {type(attn).__name__}")
    check_source(attn)  # a shard computes every part of the layer, or the layer is refused here
    if not isinstance(check_inputs, bool):
        raise TypeError(f"check_inputs must be a bool, got {check_inputs!r} ({type(check_inputs).__name__})")
    group = _resolve_group(mesh_or_group)
    # Only local queries of the group object before the plan is validated: no collective can be entered.
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    cfg = attn.config
    plan = plan_heads(cfg.n_heads, cfg.n_kv_heads, world_size)
    part = plan.partition(rank)
    local_cfg = cfg.replace(n_heads=part.n_local_heads, n_kv_heads=part.n_local_kv_heads, d_head=cfg.d_head,
                            scale=cfg.scale)

    # Built on the meta device, then given copies of the slices: no throw-away initialisation of the weights.
    tp = TensorParallelAttention(config=local_cfg, rotary=copy.deepcopy(attn.rotary), backend=attn.backend,
                                 device="meta")
    q_rows, kv_rows = part.q_rows(cfg.d_head), part.kv_rows(cfg.d_head)

    def take(t: torch.Tensor, index: Any) -> nn.Parameter:
        return nn.Parameter(t.detach()[index].clone(), requires_grad=t.requires_grad)

    tp.q_proj.weight = take(attn.q_proj.weight, q_rows)
    tp.k_proj.weight = take(attn.k_proj.weight, kv_rows)
    tp.v_proj.weight = take(attn.v_proj.weight, kv_rows)
    tp.out_proj.weight = take(attn.out_proj.weight, (slice(None), q_rows))
    if cfg.bias:
        tp.q_proj.bias = take(attn.q_proj.bias, q_rows)
        tp.k_proj.bias = take(attn.k_proj.bias, kv_rows)
        tp.v_proj.bias = take(attn.v_proj.bias, kv_rows)
    if cfg.out_bias:
        tp.out_proj.bias = take(attn.out_proj.bias, slice(None))
    norms = qk_norms(attn)
    if norms is not None:  # per-head norms act on every head alike: each shard holds them whole
        tp.q_norm, tp.k_norm = (copy.deepcopy(n) for n in norms)
    tp.global_config = cfg
    tp.plan, tp.partition = plan, part
    tp.group, tp.rank, tp.world_size = group, rank, world_size
    tp.check_inputs = check_inputs
    tp.train(attn.training)
    return tp
