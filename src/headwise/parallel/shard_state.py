"""Which heads a tensor-parallel shard holds, saved with its state dict, so that a shard loads only where it belongs.

Every rank's shard has the same local config (``h / P`` query heads and the same widths), so neither the config
check of :mod:`headwise.checkpoint` nor the tensors' shapes can tell rank 0's checkpoint from rank 1's: loaded on
the wrong rank it would give a wrong output on every rank, without an error. So a shard records which heads it
holds where :mod:`headwise.checkpoint` records the config, in the state dict's metadata
(``state_dict._metadata[prefix]["headwise_shard"]``), as plain ints and lists::

    {"world_size": P, "rank": r, "n_heads": h, "n_kv_heads": h_kv, "q_heads": [...], "kv_heads": [...]}

Not as a key: the state dict keeps exactly the layer's own tensors (the projections', and the norms' of a
Q/K-norm shard), so it loads into a layer of the same kind and the shard's local config (which ignores the
record), and casting or
averaging its tensors (a bfloat16 copy, an EMA) cannot damage the record. ``torch.load(weights_only=True)``
accepts it. Loading compares it before any weight is copied. A state dict without it (a plain layer's, or one
rebuilt as a plain dict) loads with the config and shape checks only.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

__all__ = ["SHARD_KEY", "ShardState", "check_shard", "describe_shard", "shard_record"]

SHARD_KEY = "headwise_shard"
_INTS = ("world_size", "rank", "n_heads", "n_kv_heads")
_LISTS = ("q_heads", "kv_heads")


def shard_record(world_size: int, rank: int, n_heads: int, n_kv_heads: int, q_heads: Sequence[int],
                 kv_heads: Sequence[int]) -> dict[str, Any]:
    """The record of one shard.

    Args:
        world_size: the tensor-parallel group's size.
        rank: this shard's rank in that group.
        n_heads: the unsharded layer's query heads.
        n_kv_heads: the unsharded layer's K/V heads.
        q_heads: the global query heads the shard holds.
        kv_heads: the global K/V heads the shard holds.

    Example:
        >>> shard_record(2, 1, 4, 2, (2, 3), (1,))["q_heads"]
        [2, 3]
    """
    return {"world_size": int(world_size), "rank": int(rank), "n_heads": int(n_heads), "n_kv_heads": int(n_kv_heads),
            "q_heads": [int(i) for i in q_heads], "kv_heads": [int(i) for i in kv_heads]}


def describe_shard(record: dict[str, Any]) -> str:
    """In words, e.g. ``rank 1 of 2 (query heads [2, 3], K/V heads [1] of a layer with 4 query, 2 K/V heads)``.

    Args:
        record: a :func:`shard_record`.
    """
    r = record
    return (f"rank {r['rank']} of {r['world_size']} (query heads {list(r['q_heads'])}, K/V heads "
            f"{list(r['kv_heads'])} of a layer with {r['n_heads']} query, {r['n_kv_heads']} K/V heads)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _valid(saved: Any) -> bool:
    return (isinstance(saved, dict) and set(saved) == set(_INTS + _LISTS) and all(_is_int(saved[k]) for k in _INTS)
            and all(isinstance(saved[k], (list, tuple)) and all(map(_is_int, saved[k])) for k in _LISTS))


def check_shard(local_metadata: Any, expected: dict[str, Any], prefix: str = "") -> None:
    """Raise ``ValueError`` naming both shards if the record in ``local_metadata`` is not ``expected``.

    Args:
        local_metadata: the state dict's metadata for this layer; without a record there is nothing to check.
        expected: this shard's :func:`shard_record`.
        prefix: the layer's prefix in the state dict, for the message.
    """
    saved = local_metadata.get(SHARD_KEY) if isinstance(local_metadata, dict) else None
    if saved is None:
        return
    where = f" at {prefix[:-1]!r}" if prefix else ""
    if not _valid(saved):
        raise ValueError(f"state dict{where}: a tensor-parallel shard's {SHARD_KEY!r} metadata must be a dict of "
                         f"ints {list(_INTS)} and lists of ints {list(_LISTS)}, got {saved!r}")
    if {**saved, **{k: list(saved[k]) for k in _LISTS}} != expected:
        raise ValueError(
            f"state dict{where} holds the tensor-parallel shard of {describe_shard(saved)}, but this layer is the "
            f"shard of {describe_shard(expected)}; load on each rank the state dict that rank saved, or load a "
            f"whole layer's state dict into unshard() and split that")


class ShardState(nn.Module):
    """A module that records its :meth:`shard_record` in its state dict's metadata and, on load, refuses
    another shard's (before any weight is copied) while accepting a state dict that has none."""

    def shard_record(self) -> dict[str, Any]:
        """This shard's record (:func:`shard_record`)."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        meta = getattr(destination, "_metadata", None)
        if meta is not None:
            meta.setdefault(prefix[:-1], {})[SHARD_KEY] = self.shard_record()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):  # type: ignore[no-untyped-def]
        check_shard(local_metadata, self.shard_record(), prefix)  # before any weight is copied
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)
