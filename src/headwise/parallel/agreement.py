"""Every rank of a group makes the same call, or every rank refuses it together.

A layer split over ranks runs collectives that pair up by order: if one rank refuses a call and the others
go on, their pending collective pairs with the refusing rank's *next* call and every later result is
silently wrong. So before any real collective each rank sends, in one all-gather of a few integers, the
outcome of its own local checks and a signature of its call (shapes, dtypes, flags). Then every rank sees
the same table and decides the same way: a rank's refusal becomes every rank's error, naming that rank,
and calls that differ are refused naming the ranks that differ. Only on a refusal is a second, small
exchange made (the failing ranks' messages, so that every rank raises the same text).

Shapes:
    a signature: :data:`SIGNATURE_WIDTH` int64 numbers per tensor argument; the gathered table: (P, n).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "SIGNATURE_WIDTH", "agree", "collective", "flag", "signature"]


class CollectiveTimeoutError(RuntimeError):
    """A collective of a parallel layer did not complete within the process group's timeout."""


def collective(what: str, size: int, fn: Callable[[], Any]) -> Any:
    """``fn()``, with a timeout of the process group turned into a :class:`CollectiveTimeoutError` naming
    ``what``."""
    try:
        return fn()
    except RuntimeError as err:
        text = str(err).lower()
        if "timed out" in text or "timeout" in text:
            raise CollectiveTimeoutError(
                f"{what} over {size} ranks did not complete within the process group's timeout: another rank "
                f"stopped, hangs, or did not make the same call; the timeout is set by "
                f"init_process_group(timeout=...)") from err
        raise


# Every dtype torch names, in a fixed order, so that a dtype travels as one integer (the same on every rank
# of one torch version).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}

#: Numbers per tensor argument: kind (0 None, 1 tensor, 2 something else), dims, the first 4 sizes (-1 past
#: the last; -2 for a size that may differ by rank), dtype, on the layer's device, requires grad.
SIGNATURE_WIDTH = 9
ANY_SIZE = -2


def signature(t: object, device: torch.device, free_dim: int | None = None) -> tuple[int, ...]:
    """What the ranks must agree on about one argument, whatever it is (nothing is validated here).

    ``free_dim``: a dimension whose size may differ by rank (a sequence slice), counted from the end.

    Example:
        >>> signature(torch.ones(2, 3, 4), torch.device("cpu"), free_dim=-2)[:6]
        (1, 3, 2, -2, 4, -1)
    """
    if t is None:
        return (0,) * SIGNATURE_WIDTH
    if not isinstance(t, torch.Tensor):
        return (2,) + (0,) * (SIGNATURE_WIDTH - 1)
    sizes = list(t.shape[:4]) + [-1] * (4 - min(t.dim(), 4))
    if free_dim is not None and t.dim() >= -free_dim and t.dim() + free_dim < 4:
        sizes[t.dim() + free_dim] = ANY_SIZE
    return (1, t.dim(), *sizes, _CODE.get(t.dtype, 0), int(t.device == device), int(t.requires_grad))


def flag(value: object) -> tuple[int]:
    """A flag's signature: 0 / 1 for a bool, 2 for anything else (which the layer's checks refuse)."""
    return (int(value),) if isinstance(value, bool) else (2,)


def _show(sig: tuple[int, ...]) -> str:
    if len(sig) != SIGNATURE_WIDTH:
        return str(sig[0]) if len(sig) == 1 else str(sig)
    if sig[0] == 0:
        return "None"
    if sig[0] == 2:
        return "not a tensor"
    n = sig[1]
    sizes = ["s" if s == ANY_SIZE else str(s) for s in sig[2:2 + min(n, 4)]] + (["..."] if n > 4 else [])
    dtype = str(_DTYPES[sig[6] - 1]).removeprefix("torch.") if sig[6] else "?"
    where = "" if sig[7] else " on another device"
    grad = " requiring grad" if sig[8] else ""
    return f"({', '.join(sizes)}{',' if n == 1 else ''}) {dtype}{where}{grad}"


def agree(group: Any, size: int, device: torch.device, what: str, error: BaseException | None,
          same: dict[str, tuple[int, ...]], per_rank: dict[str, tuple[int, ...]] | None = None,
          ) -> dict[str, list[tuple[int, ...]]]:
    """One all-gather of every rank's local check outcome and call signature; every rank then raises the
    same error or returns the same table.

    Args:
        device: where the exchange runs (the layer's device: NCCL needs CUDA tensors, gloo takes CPU ones).
        error: this rank's own refusal of the call (a ``ValueError`` / ``TypeError`` from its checks), or None.
        same: name -> numbers that must be equal on every rank (the same names and widths on every rank).
        per_rank: name -> numbers that may differ by rank (e.g. sequence lengths); returned for every rank.

    Raises the error of the lowest refusing rank (its type, if a ``TypeError``; else ``ValueError``) on
    every rank, naming the ranks that refused, or a ``ValueError`` naming the first entry of ``same`` that
    differs and the ranks whose value differs from rank 0's.

    Shapes:
        -> name -> [value of rank 0, ..., value of rank P - 1] for every entry of ``per_rank``

    Example (one rank: nothing to exchange; under torchrun every rank gets every rank's lengths):
        >>> agree(None, 1, torch.device("cpu"), "demo", None, {"batch sizes": (2,)}, {"s_q": (5,)})
        {'s_q': [(5,)]}
    """
    per_rank = per_rank or {}
    names = list(same) + list(per_rank)
    values = [*same.values(), *per_rank.values()]
    row = [0 if error is None else 1] + [v for vs in values for v in vs]
    if size == 1:
        if error is not None:
            raise error
        return {name: [per_rank[name]] for name in per_rank}
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(size)]
    collective(f"{what}: the exchange of call signatures", size, lambda: dist.all_gather(parts, mine, group=group))
    rows = torch.stack(parts).tolist()  # (P, 1 + n)
    refused = [r for r in range(size) if rows[r][0]]
    if refused:
        messages: list[Any] = [None] * size
        mine_msg = None if error is None else (type(error).__name__, str(error))
        collective(f"{what}: the exchange of refusals", size,
                   lambda: dist.all_gather_object(messages, mine_msg, group=group))
        kind, text = messages[refused[0]]
        cls = TypeError if kind == "TypeError" else ValueError
        who = f"rank {refused[0]}" if len(refused) == 1 else f"ranks {refused}"
        raise cls(f"{what}: refused on {who}, so every rank of the {size} refuses the call: {text}") from error
    table: dict[str, list[tuple[int, ...]]] = {}
    start = 1
    for name, vs in zip(names, values):
        table[name] = [tuple(r[start:start + len(vs)]) for r in rows]
        start += len(vs)
    for name in same:
        got = table[name]
        differ = [r for r in range(size) if got[r] != got[0]]
        if differ:
            shown = [_show(g) for g in got]
            raise ValueError(f"{what}: the {size} ranks must make the same call; {name} differ by rank: "
                             f"[{', '.join(shown)}] (rank{'s' if len(differ) > 1 else ''} "
                             f"{', '.join(map(str, differ))} differ{'' if len(differ) > 1 else 's'} from rank 0)")
    return {name: table[name] for name in per_rank}
