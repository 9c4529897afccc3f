"""Which heads each rank owns when a layer is split by whole heads: pure arithmetic, no process groups.

A layer with ``n_heads`` query heads and ``n_kv_heads`` K/V heads is split over ``world_size`` ranks so
that rank ``r`` owns the contiguous query heads ``r * h_local .. (r + 1) * h_local - 1`` (``h_local =
n_heads // world_size``) and every K/V head those query heads read. Two cases work:

* ``n_kv_heads % world_size == 0``: the K/V heads are *partitioned*; rank ``r`` owns K/V heads
  ``r * kv_local .. (r + 1) * kv_local - 1`` and no K/V head lives on two ranks.
* ``n_kv_heads < world_size`` and ``world_size % n_kv_heads == 0``: the K/V heads are *replicated*; all the
  query heads of a rank fall in one K/V group, so each rank holds a copy of that one K/V head, and
  ``world_size // n_kv_heads`` ranks hold each K/V head.

Any other split would cut a K/V group across ranks unevenly (a rank would need parts of two groups); it
raises, listing the world sizes that work.

Shapes:
    h: query heads, h_kv: key/value heads, g = h // h_kv: query heads per K/V head,
    h_local = h // world_size, kv_local: K/V heads held by one rank, d_h: head width.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..config import AttentionConfig

__all__ = ["HeadPartition", "TensorParallelPlan", "head_config", "plan_heads", "split_summary", "valid_world_sizes"]


def check_count(name: str, value: object) -> int:
    """``value`` if it is a positive int (a count of ranks); raises naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_index(name: str, value: object) -> int:
    """``value`` if it is an int (not a bool, whose ``True == 1`` would pass as head 1); raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return value


def head_config(n_heads: int, n_kv_heads: int | None = None) -> AttentionConfig:
    """The head counts as an :class:`~headwise.AttentionConfig` (head width 1: only the heads matter to a
    plan), so that the counts' checks and the MHA/GQA/MQA rule (``kind``, ``group_size``, ``kv_head_of``)
    are the layer's own.

    Example:
        >>> cfg = head_config(8, 2)
        >>> cfg.kind, cfg.group_size, cfg.kv_head_of(5)
        ('GQA', 4, 1)
    """
    return AttentionConfig(d_model=1, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=1)


def _split_ok(n_heads: int, n_kv_heads: int, world_size: int) -> bool:
    return n_heads % world_size == 0 and (n_kv_heads % world_size == 0 or world_size % n_kv_heads == 0)


# Miller-Rabin with these bases is exact below 3.3e24, far above the 2**63 - 1 a head count can reach.
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _factor(n: int) -> int:
    """A factor 1 < f < n of a composite ``n`` with no prime factor below 41 (Pollard's rho)."""
    for c in itertools.count(1):
        x = y = 2
        d = 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = math.gcd(x - y, n)
        if d != n:
            return d
    raise AssertionError("unreachable")


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n``, sorted, from its prime factors: trial division up to sqrt(n) would take minutes
    for the head counts torch allows (up to 2**63 - 1), factoring takes milliseconds."""
    exponents: dict[int, int] = {}
    for p in _SMALL_PRIMES:
        while n % p == 0:
            exponents[p] = exponents.get(p, 0) + 1
            n //= p
    todo = [n] if n > 1 else []
    while todo:
        m = todo.pop()
        if _is_prime(m):
            exponents[m] = exponents.get(m, 0) + 1
        else:
            f = _factor(m)
            todo += [f, m // f]
    divisors = [1]
    for p, e in exponents.items():
        divisors = [d * p ** k for d in divisors for k in range(e + 1)]
    return sorted(divisors)


def valid_world_sizes(n_heads: int, n_kv_heads: int | None = None) -> list[int]:
    """Every world size over which a layer with these head counts splits by whole heads.

    Shapes:
        h = n_heads, h_kv = n_kv_heads -> sorted list of world sizes w with h % w == 0 and either
        h_kv % w == 0 (K/V heads partitioned) or w % h_kv == 0 (K/V heads replicated)

    Example:
        >>> valid_world_sizes(8, 2)      # 4 and 8 replicate the 2 K/V heads
        [1, 2, 4, 8]
        >>> valid_world_sizes(6, 2)      # 3 ranks would each need parts of two K/V groups
        [1, 2, 6]
    """
    cfg = head_config(n_heads, n_kv_heads)
    return [w for w in _divisors(cfg.n_heads) if _split_ok(cfg.n_heads, cfg.n_kv_heads, w)]


def split_summary(n_heads: int, n_kv_heads: int | None, world_size: int) -> str:
    """The first line of :meth:`TensorParallelPlan.describe`, from the counts alone: no list of every head, so
    that it answers at once for any head count. Raises as :func:`plan_heads` does for a split that cannot work.

    Example:
        >>> split_summary(8, 2, 2)
        '8 query heads, 2 K/V heads (GQA, group size 4) over 2 ranks: 4 query heads per rank; K/V heads partitioned: 1 per rank, none shared'
    """
    cfg = head_config(n_heads, n_kv_heads)
    world_size = check_count("world_size", world_size)
    if not _split_ok(cfg.n_heads, cfg.n_kv_heads, world_size):
        plan_heads(cfg.n_heads, cfg.n_kv_heads, world_size)  # raises, naming the world sizes that work
    h_local = cfg.n_heads // world_size
    head = (f"{cfg.n_heads} query head{'s' if cfg.n_heads > 1 else ''}, {cfg.n_kv_heads} K/V "
            f"head{'s' if cfg.n_kv_heads > 1 else ''} ({cfg.kind}, group size {cfg.group_size}) over "
            f"{world_size} rank{'s' if world_size > 1 else ''}: {h_local} query "
            f"head{'s' if h_local > 1 else ''} per rank; ")
    if cfg.n_kv_heads < world_size:
        return head + f"K/V heads replicated: each K/V head is held by {world_size // cfg.n_kv_heads} ranks"
    return head + f"K/V heads partitioned: {cfg.n_kv_heads // world_size} per rank, none shared"


@dataclass(frozen=True)
class HeadPartition:
    """The heads one rank owns: global query heads, global K/V heads, and how local indices map to them.

    Local query head ``j`` is global head ``q_heads[j] = rank * h_local + j``; it reads local K/V head
    ``j // local_group_size``, which is global K/V head ``kv_heads[j // local_group_size]`` and always
    equals ``q_heads[j] // group_size`` (the unsharded GQA rule).

    Shapes:
        q rows of the packed Q projection: ``q_rows(d_h)``, a slice of length h_local * d_h;
        K/V rows: ``kv_rows(d_h)``, a slice of length kv_local * d_h.

    Example:
        >>> p = plan_heads(n_heads=8, n_kv_heads=2, world_size=4).partition(3)
        >>> p.q_heads, p.kv_heads, p.kv_replicated
        ((6, 7), (1,), True)
        >>> p.q_rows(d_head=16), p.kv_rows(d_head=16)
        (slice(96, 128, None), slice(16, 32, None))
    """

    rank: int
    world_size: int
    n_heads: int
    n_kv_heads: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_replicated: bool

    @property
    def n_local_heads(self) -> int:
        """Query heads on this rank (h_local)."""
        return len(self.q_heads)

    @property
    def n_local_kv_heads(self) -> int:
        """K/V heads held on this rank (kv_local; 1 when replicated)."""
        return len(self.kv_heads)

    @property
    def group_size(self) -> int:
        """Query heads per K/V head in the unsharded layer (g)."""
        return head_config(self.n_heads, self.n_kv_heads).group_size

    @property
    def local_group_size(self) -> int:
        """Query heads per K/V head in the rank-local layer."""
        return self.n_local_heads // self.n_local_kv_heads

    def owns(self, head: int) -> bool:
        """True if global query head ``head`` lives on this rank."""
        return check_index("query head", head) in self.q_heads

    def local_index(self, head: int) -> int:
        """The local index of global query head ``head`` (raises if another rank owns it)."""
        check_index("query head", head)
        if not self.owns(head):
            owner = head // self.n_local_heads if 0 <= head < self.n_heads else None
            where = f"rank {owner} owns it" if owner is not None else f"heads are 0..{self.n_heads - 1}"
            raise ValueError(f"query head {head} is not on rank {self.rank} (local heads {list(self.q_heads)}); "
                             f"{where}")
        return head - self.q_heads[0]

    def global_kv_head_of_local(self, j: int) -> int:
        """The global K/V head read by local query head ``j``."""
        check_index("local head index", j)
        if not 0 <= j < self.n_local_heads:
            raise IndexError(f"local head index must be in [0, {self.n_local_heads}), got {j}")
        return self.kv_heads[j // self.local_group_size]

    def q_rows(self, d_head: int) -> slice:
        """Rows of the packed ``q_proj.weight`` (and columns of ``out_proj.weight``) this rank holds."""
        return slice(self.q_heads[0] * d_head, (self.q_heads[-1] + 1) * d_head)

    def kv_rows(self, d_head: int) -> slice:
        """Rows of the packed ``k_proj.weight`` / ``v_proj.weight`` this rank holds."""
        return slice(self.kv_heads[0] * d_head, (self.kv_heads[-1] + 1) * d_head)


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a layer splits by whole heads over ``world_size`` ranks; build it with :func:`plan_heads`.

    ``kv_replicated`` is True when there are fewer K/V heads than ranks: each K/V head is then held by
    ``kv_replicas`` ranks (``world_size // n_kv_heads``), whose copies must stay identical (their gradients
    are summed across the replicas, see :mod:`headwise.parallel.tensor`).

    Shapes:
        h = n_heads, h_kv = n_kv_heads; partitions[r] is rank r's :class:`HeadPartition`.

    Example:
        >>> plan = plan_heads(n_heads=8, n_kv_heads=2, world_size=4)
        >>> plan.kv_replicated, plan.kv_replicas, plan.owner_of(5)
        (True, 2, 2)
        >>> print(plan.describe())
        8 query heads, 2 K/V heads (GQA, group size 4) over 4 ranks: 2 query heads per rank; K/V heads replicated: each K/V head is held by 2 ranks
          rank 0: query heads [0, 1], K/V heads [0]
          rank 1: query heads [2, 3], K/V heads [0]
          rank 2: query heads [4, 5], K/V heads [1]
          rank 3: query heads [6, 7], K/V heads [1]
    """

    n_heads: int
    n_kv_heads: int
    world_size: int
    partitions: tuple[HeadPartition, ...]

    @property
    def kv_replicated(self) -> bool:
        """True when some K/V head is held by more than one rank (n_kv_heads < world_size)."""
        return self.n_kv_heads < self.world_size

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each K/V head (1 when K/V heads are partitioned)."""
        return max(1, self.world_size // self.n_kv_heads)

    @property
    def n_local_heads(self) -> int:
        return self.n_heads // self.world_size

    @property
    def n_local_kv_heads(self) -> int:
        return self.partitions[0].n_local_kv_heads

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"`` (:attr:`headwise.AttentionConfig.kind`)."""
        return head_config(self.n_heads, self.n_kv_heads).kind

    def partition(self, rank: int) -> HeadPartition:
        """Rank ``rank``'s heads."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return self.partitions[rank]

    def owner_of(self, head: int) -> int:
        """The rank that owns global query head ``head``."""
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < self.n_heads:
            raise IndexError(f"head index must be an int in [0, {self.n_heads}), got {head!r}")
        return head // self.n_local_heads

    def ranks_holding_kv(self, kv_head: int) -> list[int]:
        """Every rank holding global K/V head ``kv_head`` (several when replicated)."""
        check_index("K/V head index", kv_head)
        if not 0 <= kv_head < self.n_kv_heads:
            raise IndexError(f"K/V head index must be in [0, {self.n_kv_heads}), got {kv_head}")
        return [p.rank for p in self.partitions if kv_head in p.kv_heads]

    def describe(self) -> str:
        """A human-readable account of the split, one line per rank."""
        lines = [split_summary(self.n_heads, self.n_kv_heads, self.world_size)] + [f"  rank {p.rank}: query heads {list(p.q_heads)}, K/V heads {list(p.kv_heads)}"
                          for p in self.partitions]
        return "\n".join(lines)


def plan_heads(n_heads: int, n_kv_heads: int | None, world_size: int) -> TensorParallelPlan:
    """Split ``n_heads`` query heads and ``n_kv_heads`` K/V heads over ``world_size`` ranks by whole heads.

    Raises ``ValueError`` naming the valid world sizes when the split is impossible (``n_heads`` not
    divisible by ``world_size``, or K/V groups that would straddle ranks).

    Shapes:
        rank r: query heads [r * h_local, (r + 1) * h_local); K/V heads {q // g for q in its query heads}

    Example:
        >>> plan = plan_heads(n_heads=8, n_kv_heads=8, world_size=2)
        >>> plan.partition(1).q_heads, plan.partition(1).kv_heads, plan.kv_replicated
        ((4, 5, 6, 7), (4, 5, 6, 7), False)
        >>> plan_heads(n_heads=6, n_kv_heads=2, world_size=4)
        Traceback (most recent call last):
            ...
        ValueError: cannot split n_heads=6 over world_size=4 ranks by whole heads (6 % 4 != 0); valid world sizes for n_heads=6, n_kv_heads=2: [1, 2, 6]
    """
    cfg = head_config(n_heads, n_kv_heads)
    n_heads, n_kv_heads = cfg.n_heads, cfg.n_kv_heads
    world_size = check_count("world_size", world_size)
    if not _split_ok(n_heads, n_kv_heads, world_size):
        valid = valid_world_sizes(n_heads, n_kv_heads)  # only for the message: the split itself needs no list
        sizes = f"valid world sizes for n_heads={n_heads}, n_kv_heads={n_kv_heads}: {valid}"
        if n_heads % world_size:
            raise ValueError(f"cannot split n_heads={n_heads} over world_size={world_size} ranks by whole heads "
                             f"({n_heads} % {world_size} != 0); {sizes}")
        raise ValueError(
            f"cannot split n_kv_heads={n_kv_heads} over world_size={world_size} ranks: neither partitioned "
            f"({n_kv_heads} % {world_size} != 0) nor replicated ({world_size} % {n_kv_heads} != 0), so a rank "
            f"would need parts of two K/V groups; {sizes}"
        )
    h_local = n_heads // world_size
    replicated = n_kv_heads < world_size
    parts = []
    for r in range(world_size):
        q = tuple(range(r * h_local, (r + 1) * h_local))
        # The K/V heads a rank needs are exactly those its query heads read; contiguous by construction.
        kv = tuple(sorted({cfg.kv_head_of(h) for h in q}))
        parts.append(HeadPartition(rank=r, world_size=world_size, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                   q_heads=q, kv_heads=kv, kv_replicated=replicated))
    return TensorParallelPlan(n_heads=n_heads, n_kv_heads=n_kv_heads, world_size=world_size,
                              partitions=tuple(parts))
