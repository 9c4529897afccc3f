"""Which heads each rank attends to under sequence parallelism, and what the all-to-alls move: pure arithmetic.

Under sequence parallelism (DeepSpeed-Ulysses style) every one of ``sp`` ranks holds a slice of the sequence
outside attention. For attention one all-to-all swaps the sharding from sequence to heads: rank ``r`` then
holds the whole sequence for a contiguous block of query heads, and the K/V heads those query heads read;
a second all-to-all swaps the attention output back. Heads never talk to each other, so nothing else moves.

This module goes further than Ulysses' divisibility rules:

* the query heads need not divide by ``sp``: ranks ``0 .. h % sp - 1`` take one head more
  (``ceil(h / sp)``), the others ``floor(h / sp)``; any ``1 <= sp <= h`` works;
* the K/V heads are *partitioned* when every rank's query heads read K/V heads no other rank reads, and
  *replicated* otherwise (fewer K/V heads than ranks, or counts that do not divide): a K/V head read by the
  query heads of several ranks is sent to each of them.

Composed with tensor parallelism (``tp`` ranks split the layer by whole heads first,
:func:`~headwise.parallel.plan.plan_heads`), the ``sp`` ranks of one tensor-parallel shard split that
shard's ``h / tp`` query heads the same way. An impossible layout raises ``ValueError`` naming the valid
ones, before any process group is touched.

Shapes:
    h: query heads, h_kv: K/V heads (of the layer, or of one tensor-parallel shard), g = h // h_kv,
    sp: sequence-parallel ranks, tp: tensor-parallel ranks, b: batch, s_q / s_kv: local (per-rank, padded)
    query / key lengths, d_h: head width.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import check_count, head_config, plan_heads, valid_world_sizes

__all__ = ["SequenceParallelPlan", "SequenceRank", "plan_sequence_parallel", "valid_sequence_layouts"]


def valid_sequence_layouts(n_heads: int, n_kv_heads: int | None, world_size: int) -> list[tuple[int, int]]:
    """Every ``(sp, tp)`` with ``sp * tp == world_size`` over which a layer splits (sequence by heads).

    ``tp`` must split the layer by whole heads (:func:`~headwise.parallel.plan.valid_world_sizes`) and every
    one of the ``sp`` ranks of a shard needs at least one of its ``h / tp`` query heads.

    Example:
        >>> valid_sequence_layouts(8, 2, 8)     # (1, 8) is tensor parallelism alone
        [(1, 8), (2, 4), (4, 2), (8, 1)]
        >>> valid_sequence_layouts(4, 1, 8)     # 8 ranks but 4 heads: no layout
        []
    """
    world_size = check_count("world_size", world_size)
    tps = valid_world_sizes(n_heads, n_kv_heads)
    return [(world_size // tp, tp) for tp in sorted(tps, reverse=True)
            if world_size % tp == 0 and world_size // tp <= n_heads // tp]


@dataclass(frozen=True)
class SequenceRank:
    """One sequence-parallel rank's heads during attention (indices within its tensor-parallel shard).

    ``kv_index[j]`` is the position in ``kv_heads`` of the K/V head that local query head ``j`` reads;
    ``grouped`` says whether that is the plain GQA rule ``j // (len(q_heads) // len(kv_heads))`` (then the
    kernel reads the K/V heads as they are), otherwise K/V heads are repeated per query head locally.

    Example:
        >>> plan_sequence_parallel(12, 4, sp=6).rank(1)       # query heads 2, 3 straddle K/V groups 0 and 1
        SequenceRank(rank=1, q_heads=(2, 3), kv_heads=(0, 1), kv_index=(0, 1), grouped=True)
    """

    rank: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_index: tuple[int, ...]
    grouped: bool


@dataclass(frozen=True)
class SequenceParallelPlan:
    """How attention is split when the sequence is sharded over ``sp`` ranks (and heads over ``tp``).

    Build it with :func:`plan_sequence_parallel`. ``n_heads`` / ``n_kv_heads`` are the whole layer's;
    ``shard_heads`` / ``shard_kv_heads`` those of one tensor-parallel shard (the same when ``tp == 1``).

    Example:
        >>> plan = plan_sequence_parallel(n_heads=8, n_kv_heads=2, sp=4)
        >>> print(plan.describe())
        sequence parallel over 4 ranks (tp 1): 8 query heads, 2 K/V heads (GQA); 2 query heads per rank during attention; K/V heads replicated (a K/V head goes to every rank whose query heads read it)
          sp rank 0: query heads [0, 1], K/V heads [0]
          sp rank 1: query heads [2, 3], K/V heads [0]
          sp rank 2: query heads [4, 5], K/V heads [1]
          sp rank 3: query heads [6, 7], K/V heads [1]
        >>> plan.all_to_all_bytes(batch=1, s_q=1024, d_head=64, itemsize=2)["forward"]   # per rank, per layer
        2359296
    """

    n_heads: int
    n_kv_heads: int
    sp: int
    tp: int
    ranks: tuple[SequenceRank, ...]

    @property
    def shard_heads(self) -> int:
        return self.n_heads // self.tp

    @property
    def shard_kv_heads(self) -> int:
        return self.n_kv_heads // self.tp if self.n_kv_heads >= self.tp else 1

    @property
    def even(self) -> bool:
        """True when every rank attends to the same number of query heads."""
        return self.shard_heads % self.sp == 0

    @property
    def kv_replicated(self) -> bool:
        """True when some K/V head is sent to more than one rank."""
        held = [k for r in self.ranks for k in r.kv_heads]
        return len(held) != len(set(held))

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"`` (:attr:`headwise.AttentionConfig.kind`)."""
        return head_config(self.n_heads, self.n_kv_heads).kind

    def rank(self, r: int) -> SequenceRank:
        """Sequence-parallel rank ``r``'s heads."""
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.sp:
            raise ValueError(f"sp rank must be an int in [0, {self.sp}), got {r!r}")
        return self.ranks[r]

    def global_q_heads(self, sp_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The whole layer's indices of the query heads rank (sp_rank, tp_rank) attends to."""
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp rank must be an int in [0, {self.tp}), got {tp_rank!r}")
        base = tp_rank * self.shard_heads
        return tuple(base + i for i in self.rank(sp_rank).q_heads)

    def all_to_all_bytes(self, *, batch: int, s_q: int, d_head: int, itemsize: int, s_kv: int | None = None,
                         sp_rank: int = 0) -> dict[str, int]:
        """Bytes rank ``sp_rank`` sends to *other* ranks in one layer's all-to-alls (its own part stays).

        ``s_q`` / ``s_kv`` are the local lengths after padding (``ceil(S / sp)``). ``q``, ``k``, ``v`` and
        ``out`` are the forward's all-to-alls; ``backward`` runs each of them the other way, so a rank sends
        there what it received in the forward: the same as ``forward`` only when every rank attends with as
        many query and K/V heads.

        Shapes:
            q: sum over other ranks j of |q_heads_j| * b * s_q * d_h; k and v: |kv_heads_j| * b * s_kv * d_h
            each; out: |q_heads_r| * (sp - 1) * b * s_q * d_h; all times itemsize. backward: |q_heads_r| *
            (sp - 1) * b * s_q * d_h for Q, |kv_heads_r| * (sp - 1) * b * s_kv * d_h for K and V each, and
            the sum over other ranks j of |q_heads_j| * b * s_q * d_h for the output

        Example:
            >>> p = plan_sequence_parallel(8, 8, sp=2)
            >>> p.all_to_all_bytes(batch=1, s_q=4, d_head=2, itemsize=4)
            {'q': 128, 'k': 128, 'v': 128, 'out': 128, 'forward': 512, 'backward': 512}
            >>> p = plan_sequence_parallel(6, 2, sp=4)    # rank 1 reads K/V heads 0 and 1, rank 0 only 0
            >>> [(n["forward"], n["backward"]) for n in (p.all_to_all_bytes(batch=1, s_q=4, d_head=2, itemsize=4,
            ...                                                             sp_rank=r) for r in (0, 1))]
            [(576, 512), (512, 704)]
        """
        batch, s_q = check_count("batch", batch), check_count("s_q", s_q)
        d_head, itemsize = check_count("d_head", d_head), check_count("itemsize", itemsize)
        s_kv = s_q if s_kv is None else check_count("s_kv", s_kv)
        me = self.rank(sp_rank)
        others = [r for r in self.ranks if r.rank != sp_rank]
        row_q, row_kv = batch * s_q * d_head * itemsize, batch * s_kv * d_head * itemsize
        q = sum(len(r.q_heads) for r in others) * row_q
        kv = sum(len(r.kv_heads) for r in others) * row_kv
        out = len(me.q_heads) * (self.sp - 1) * row_q
        # Backward: the gradients of what this rank received: its own heads of every other rank's slice for
        # Q, K and V, and every other rank's heads of its own slice for the output.
        back = out + 2 * len(me.kv_heads) * (self.sp - 1) * row_kv + q
        return {"q": q, "k": kv, "v": kv, "out": out, "forward": q + 2 * kv + out, "backward": back}

    def describe(self) -> str:
        """A human-readable account of the split, one line per sequence-parallel rank."""
        sizes = sorted({len(r.q_heads) for r in self.ranks}, reverse=True)
        per = " or ".join(map(str, sizes))
        head = (f"sequence parallel over {self.sp} rank{'s' if self.sp > 1 else ''} (tp {self.tp}): "
                f"{self.n_heads} query heads, {self.n_kv_heads} K/V head{'s' if self.n_kv_heads > 1 else ''} "
                f"({self.kind})")
        if self.tp > 1:
            head += f", {self.shard_heads} query / {self.shard_kv_heads} K/V heads per tp shard"
        head += f"; {per} query head{'s' if sizes[0] > 1 else ''} per rank during attention"
        if not self.even:
            head += " (uneven: the first ranks take one more)"
        head += ("; K/V heads replicated (a K/V head goes to every rank whose query heads read it)"
                 if self.kv_replicated else "; K/V heads partitioned, none sent twice")
        lines = [head]
        for r in self.ranks:
            note = "" if r.grouped else " (K/V repeated per query head locally)"
            lines.append(f"  sp rank {r.rank}: query heads {list(r.q_heads)}, K/V heads {list(r.kv_heads)}{note}")
        if self.tp > 1:
            lines.append("  (indices within each tp shard; shard t holds query heads "
                         f"[t * {self.shard_heads}, (t + 1) * {self.shard_heads}))")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def plan_sequence_parallel(n_heads: int, n_kv_heads: int | None = None, *, sp: int,
                           tp: int = 1) -> SequenceParallelPlan:
    """Split attention over ``sp`` sequence-parallel ranks (within each of ``tp`` tensor-parallel shards).

    Raises ``ValueError`` naming the valid ``(sp, tp)`` layouts for ``sp * tp`` ranks when the layout is
    impossible (``tp`` cannot split the heads, or a rank would get no query head).

    Shapes:
        rank r of a shard with h' query heads: ceil or floor(h' / sp) contiguous query heads; K/V heads
        {q // g' for q in them} with g' = h' / h_kv'

    Example:
        >>> plan_sequence_parallel(6, 2, sp=4).rank(0)    # 6 heads over 4 ranks: 2, 2, 1, 1
        SequenceRank(rank=0, q_heads=(0, 1), kv_heads=(0,), kv_index=(0, 0), grouped=True)
        >>> plan_sequence_parallel(6, 2, sp=2, tp=3)
        Traceback (most recent call last):
            ...
        ValueError: cannot split the heads over tp=3 ranks (cannot split n_kv_heads=2 over world_size=3 ranks: neither partitioned (2 % 3 != 0) nor replicated (3 % 2 != 0), so a rank would need parts of two K/V groups; valid world sizes for n_heads=6, n_kv_heads=2: [1, 2, 6]); valid (sp, tp) layouts for 6 ranks with n_heads=6, n_kv_heads=2: [(1, 6), (3, 2), (6, 1)]
    """
    cfg = head_config(n_heads, n_kv_heads)
    n_heads, n_kv_heads = cfg.n_heads, cfg.n_kv_heads
    sp, tp = check_count("sp", sp), check_count("tp", tp)
    valid = valid_sequence_layouts(n_heads, n_kv_heads, sp * tp)
    layouts = (f"valid (sp, tp) layouts for {sp * tp} ranks with n_heads={n_heads}, n_kv_heads={n_kv_heads}: "
               f"{valid}" if valid else f"no (sp, tp) layout of {sp * tp} ranks works: sp * tp must be at most "
               f"n_heads={n_heads}")
    if tp > 1:
        try:
            plan_heads(n_heads, n_kv_heads, tp)
        except ValueError as err:
            raise ValueError(f"cannot split the heads over tp={tp} ranks ({err}); {layouts}") from None
    h, h_kv = n_heads // tp, max(1, n_kv_heads // tp)
    if sp > h:
        what = "the layer has" if tp == 1 else "a shard has"
        where = f"sp={sp} ranks" + (f" in each of tp={tp} shards" if tp > 1 else "")
        raise ValueError(f"cannot run sequence parallelism over {where}: {what} "
                         f"{h} query heads, fewer than sp={sp}, so a rank would attend to no head; {layouts}")
    shard = head_config(h, h_kv)
    ranks, start = [], 0
    for r in range(sp):
        n = h // sp + (1 if r < h % sp else 0)
        q = tuple(range(start, start + n))
        start += n
        kv = tuple(range(shard.kv_head_of(q[0]), shard.kv_head_of(q[-1]) + 1))  # the heads its queries read
        index = tuple(shard.kv_head_of(i) - kv[0] for i in q)
        # Grouped: the rank's own heads follow the same rule, so the kernel reads its K/V heads as they are.
        grouped = n % len(kv) == 0 and index == tuple(map(head_config(n, len(kv)).kv_head_of, range(n)))
        ranks.append(SequenceRank(rank=r, q_heads=q, kv_heads=kv, kv_index=index, grouped=grouped))
    return SequenceParallelPlan(n_heads=n_heads, n_kv_heads=n_kv_heads, sp=sp, tp=tp, ranks=tuple(ranks))
