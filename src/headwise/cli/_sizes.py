"""Shared options of the subcommands that describe one layer (``--preset`` or explicit sizes), the checks
of every size argument, and the size guards that refuse, before anything is allocated, what could not be
allocated. Standard library and torch-free headwise modules only.

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: d_model, d_h: d_head.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from . import CliError

if TYPE_CHECKING:
    from ..config import AttentionConfig

# The largest size torch can give a dimension, or a whole tensor in elements or bytes (int64).
INT64_MAX = 2 ** 63 - 1


def size(text: str) -> int:
    """argparse ``type=`` for sizes: a positive integer no larger than a tensor dimension can be."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > INT64_MAX:
        raise argparse.ArgumentTypeError(f"must be at most 2**63 - 1 = {INT64_MAX} (the largest size torch can "
                                         f"give a tensor), got {value:.3e}")
    return value


def add_layer_options(p: argparse.ArgumentParser, *, default_d_model: int | None = None,
                      default_n_heads: int | None = None) -> None:
    """``--preset NAME`` and ``--d-model/--n-heads/--n-kv-heads/--d-head`` (these override the preset's)."""
    p.add_argument("--preset", default=None, help="a published configuration (see `headwise compare --list`)")
    p.add_argument("--d-model", type=size, default=None,
                   help=f"model width{f' (default {default_d_model})' if default_d_model else ''}")
    p.add_argument("--n-heads", type=size, default=None,
                   help=f"query heads{f' (default {default_n_heads})' if default_n_heads else ''}")
    p.add_argument("--n-kv-heads", type=size, default=None, help="key/value heads (default: n_heads, MHA)")
    p.add_argument("--d-head", type=size, default=None, help="head width (default: d_model / n_heads)")
    p.set_defaults(_default_d_model=default_d_model, _default_n_heads=default_n_heads)


def layer_from_args(args: argparse.Namespace) -> tuple["AttentionConfig", int | None, str | None]:
    """(config, the preset's n_layers or None, the preset's name or None). Sizes given override the preset."""
    from ..config import AttentionConfig

    overrides = {k: getattr(args, k) for k in ("d_model", "n_heads", "n_kv_heads", "d_head")
                 if getattr(args, k) is not None}
    if args.preset is not None:
        from ..presets import get_preset

        preset = get_preset(args.preset)
        cfg = preset.config.replace(**overrides) if overrides else preset.config
        return cfg, preset.n_layers, preset.name
    d_model = overrides.pop("d_model", args._default_d_model)
    n_heads = overrides.pop("n_heads", args._default_n_heads)
    if d_model is None or n_heads is None:
        raise CliError("give --preset NAME, or at least --d-model and --n-heads")
    return AttentionConfig(d_model=d_model, n_heads=n_heads, **overrides), None, None


def layer_tensors(config: "AttentionConfig", seq: int, batch: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors one eager self-attention forward of ``config`` holds (the shape walk's)."""
    c, b, s = config, batch, seq
    return {
        "W_Q": (c.inner_dim, c.d_model), "W_K": (c.kv_dim, c.kdim), "W_V": (c.kv_dim, c.vdim),
        "W_O": (c.d_model, c.inner_dim),
        "x": (b, s, c.d_model), "Q": (b, s, c.inner_dim), "K": (b, s, c.kv_dim), "V": (b, s, c.kv_dim),
        "scores": (b, c.n_heads, s, s), "context": (b, c.n_heads, s, c.d_head), "y": (b, s, c.d_model),
    }


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def refuse_unrepresentable(config: "AttentionConfig", seq: int, batch: int, itemsize: int) -> None:
    """CliError if a tensor of the layer could not even be described by torch (more than 2**63 - 1 bytes)."""
    for name, shape in layer_tensors(config, seq, batch).items():
        nbytes = numel(shape) * itemsize
        if nbytes > INT64_MAX:
            raise CliError(f"{name} {shape} would take {nbytes:.3e} bytes, more than the 2**63 - 1 a torch tensor "
                           f"can address; choose smaller sizes")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; a value that rounds to 1024 of a unit is written in the next (never '1024.0 KiB').

    >>> human_bytes(1536), human_bytes(1023), human_bytes(2 ** 20 - 1), human_bytes(1023.6)
    ('1.5 KiB', '1023 B', '1.0 MiB', '1.0 KiB')
    """
    for unit, digits in (("B", 0), ("KiB", 1), ("MiB", 1), ("GiB", 1), ("TiB", 1), ("PiB", 1), ("EiB", 1)):
        if abs(round(n, digits)) < 1024 or unit == "EiB":
            return f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float, unit: str = "") -> str:
    """2_362_368 -> '2.36 M'; with unit 'FLOP' -> '2.36 MFLOP'; beyond 1e21, scientific notation; a value that
    rounds to 1000 of a prefix is written with the next (never '1000.00 M').

    >>> human_count(2_362_368, "FLOP"), human_count(999_999_999), human_count(999.6), human_count(996)
    ('2.36 MFLOP', '1.00 G', '1.00 k', '996')
    """
    for prefix, scale, digits in (("", 1, 0), ("k", 1e3, 2), ("M", 1e6, 2), ("G", 1e9, 2), ("T", 1e12, 2),
                                  ("P", 1e15, 2), ("E", 1e18, 2)):
        if abs(round(n / scale, digits)) < 1000:
            return f"{n / scale:.{digits}f} {prefix}{unit}".rstrip()
    return f"{float(n):.2e} {unit}".rstrip()
