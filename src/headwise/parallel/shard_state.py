"""Which heads a tensor-parallel shard holds, saved in its state dict, so that a shard loads only where it belongs.

Every rank's shard has the same local config (``h / P`` query heads and the same widths), so neither the config
check of :mod:`headwise.checkpoint` nor the tensors' shapes can tell rank 0's checkpoint from rank 1's: loaded on
the wrong rank it would give a wrong output on every rank, without an error. So a shard saves, as its
``_extra_state`` (PyTorch's key for a module's own state besides parameters and buffers), one int64 tensor:

    ``(P, rank, h, h_kv, h_local, kv_local, *query heads, *K/V heads)``

A tensor rather than a dict, so that code treating every value of a state dict as a tensor (``.clone()``,
``.to()``) keeps working. Loading compares it before any weight is copied. A state dict without it (an unsharded
layer's, one saved before shards recorded it, or one built by hand) loads with the config and shape checks only.

Shapes:
    the record: (6 + h_local + kv_local,) int64
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["ShardState", "check_shard", "describe_shard", "shard_record"]

_HEADER = 6  # P, rank, h, h_kv, h_local, kv_local


def shard_record(world_size: int, rank: int, n_heads: int, n_kv_heads: int, q_heads: Sequence[int],
                 kv_heads: Sequence[int]) -> torch.Tensor:
    """The record of one shard.

    Args:
        world_size, rank: the tensor-parallel group's size and this shard's rank in it.
        n_heads, n_kv_heads: the unsharded layer's query and K/V heads.
        q_heads, kv_heads: the global query and K/V heads the shard holds.

    Example:
        >>> shard_record(2, 1, 4, 2, (2, 3), (1,)).tolist()
        [2, 1, 4, 2, 2, 1, 2, 3, 1]
    """
    values = [world_size, rank, n_heads, n_kv_heads, len(q_heads), len(kv_heads), *q_heads, *kv_heads]
    return torch.tensor(values, dtype=torch.int64)


def describe_shard(record: torch.Tensor) -> str:
    """In words, e.g. ``rank 1 of 2 (query heads [2, 3], K/V heads [1] of a layer with 4 query, 2 K/V heads)``."""
    v = record.tolist()
    q = v[_HEADER:_HEADER + v[4]]
    kv = v[_HEADER + v[4]:]
    return (f"rank {v[1]} of {v[0]} (query heads {q}, K/V heads {kv} of a layer with {v[2]} query, "
            f"{v[3]} K/V heads)")


def _valid(saved: Any) -> bool:
    if not (isinstance(saved, torch.Tensor) and saved.dtype == torch.int64 and saved.dim() == 1
            and saved.numel() >= _HEADER):
        return False
    v = saved.tolist()
    return min(v[4], v[5]) >= 0 and len(v) == _HEADER + v[4] + v[5]


def check_shard(saved: Any, expected: torch.Tensor, prefix: str = "") -> None:
    """Raise ``ValueError`` naming both shards if ``saved``, a state dict's record, is not ``expected``.

    Args:
        saved: the state dict's ``_extra_state`` for this layer (None: there is none, nothing to check).
        expected: this shard's :func:`shard_record`.
        prefix: the layer's prefix in the state dict, for the message.
    """
    if saved is None:
        return
    where = f" at {prefix[:-1]!r}" if prefix else ""
    if not _valid(saved):
        shown = f"a {tuple(saved.shape)} {saved.dtype} tensor" if isinstance(saved, torch.Tensor) else repr(saved)
        raise ValueError(f"state dict{where}: a tensor-parallel shard's _extra_state must be its record, an int64 "
                         f"tensor (P, rank, h, h_kv, h_local, kv_local, *query heads, *K/V heads), got {shown}")
    if saved.tolist() != expected.tolist():
        raise ValueError(
            f"state dict{where} holds the tensor-parallel shard of {describe_shard(saved)}, but this layer is the "
            f"shard of {describe_shard(expected)}; load on each rank the state dict that rank saved, or load a "
            f"whole layer's state dict into unshard() and split that")


class ShardState(nn.Module):
    """A module that saves its :meth:`shard_record` as its ``_extra_state`` and, on load, refuses another shard's
    (before any weight is copied) while accepting a state dict that has none."""

    def shard_record(self) -> torch.Tensor:
        """This shard's record (:func:`shard_record`)."""
        raise NotImplementedError

    def get_extra_state(self) -> torch.Tensor:
        """What ``state_dict()`` saves as ``_extra_state``: :meth:`shard_record`."""
        return self.shard_record()

    def set_extra_state(self, state: Any) -> None:
        """Check a loaded record against this shard's.

        Args:
            state: a state dict's ``_extra_state``; ``ValueError`` naming both shards if it is another's.
        """
        check_shard(state, self.shard_record())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,  # type: ignore[no-untyped-def]
                              missing_keys, *args):
        key = prefix + "_extra_state"
        check_shard(state_dict.get(key), self.shard_record(), prefix)  # before any weight is copied
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *args)
        if key not in state_dict and key in missing_keys:  # a state dict without the record loads as before
            missing_keys.remove(key)
