"""Shared options of the subcommands that describe one layer: ``--preset`` or explicit sizes, and units."""

from __future__ import annotations

import argparse

from ..config import AttentionConfig
from . import CliError


def add_layer_options(p: argparse.ArgumentParser, *, default_d_model: int | None = None,
                      default_n_heads: int | None = None) -> None:
    """``--preset NAME`` and ``--d-model/--n-heads/--n-kv-heads/--d-head`` (these override the preset's)."""
    p.add_argument("--preset", default=None, help="a published configuration (see `headwise compare --list`)")
    p.add_argument("--d-model", type=int, default=None,
                   help=f"model width{f' (default {default_d_model})' if default_d_model else ''}")
    p.add_argument("--n-heads", type=int, default=None,
                   help=f"query heads{f' (default {default_n_heads})' if default_n_heads else ''}")
    p.add_argument("--n-kv-heads", type=int, default=None, help="key/value heads (default: n_heads, MHA)")
    p.add_argument("--d-head", type=int, default=None, help="head width (default: d_model / n_heads)")
    p.set_defaults(_default_d_model=default_d_model, _default_n_heads=default_n_heads)


def layer_from_args(args: argparse.Namespace) -> tuple[AttentionConfig, int | None, str | None]:
    """(config, the preset's n_layers or None, the preset's name or None). Sizes given override the preset."""
    overrides = {k: getattr(args, k) for k in ("d_model", "n_heads", "n_kv_heads", "d_head")
                 if getattr(args, k) is not None}
    for k, v in overrides.items():
        if v <= 0:
            raise CliError(f"--{k.replace('_', '-')} must be a positive integer, got {v}")
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


def positive(name: str, value: int) -> int:
    if value <= 0:
        raise CliError(f"--{name} must be a positive integer, got {value}")
    return value


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float, unit: str = "") -> str:
    """2_362_368 -> '2.36 M'; with unit 'FLOP' -> '2.36 MFLOP'."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()
