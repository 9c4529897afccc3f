"""Attention configurations of published models, each with the source that states its numbers.

Every :class:`Preset` records the fields as its source names them (``cited``), the URL of that source
(a paper, a model card or a ``config.json``), and the :class:`~headwise.AttentionConfig` built from them.
Look a preset up by its exact name with :func:`get_preset`; a near miss gets a "did you mean" error.

Shapes:
    d = d_model, h = n_heads, h_kv = n_kv_heads, d_h = d_head (see :class:`~headwise.AttentionConfig`).

Example:
    >>> p = get_preset("llama-3-8b")
    >>> p.config.kind, p.config.d_head, p.n_layers, p.rope_theta
    ('GQA', 128, 32, 500000.0)
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .config import AttentionConfig

__all__ = ["Preset", "PRESETS", "get_preset", "preset_names", "UnknownPresetError"]


@dataclass(frozen=True)
class Preset:
    """One published model's attention: its config, depth, RoPE base and where the numbers come from.

    Shapes:
        config: one layer, (d, h, h_kv, d_h); the model stacks ``n_layers`` such layers.
    """

    name: str
    title: str
    config: AttentionConfig
    n_layers: int
    citation: str
    cited: Mapping[str, Any] = field(default_factory=dict)
    rope_theta: float | None = None
    max_positions: int | None = None
    sliding_window: int | None = None

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {"name": self.name, "title": self.title, "n_layers": self.n_layers, "rope_theta": self.rope_theta,
                "max_positions": self.max_positions, "sliding_window": self.sliding_window,
                "citation": self.citation, "cited": dict(self.cited),
                "config": c.to_dict() | {"kind": c.kind}}


def _config(d_model: int, n_heads: int, n_kv_heads: int | None, d_head: int | None, *, bias: bool) -> AttentionConfig:
    """The config of cited numbers; a cited ``d_head`` that is ``d_model / n_heads``, or ``n_kv_heads`` equal to
    ``n_heads`` (MHA), is left to the default, so that a preset overridden with other ``n_heads`` or ``d_model``
    rescales it, as for a preset that cites none (an MHA preset stays MHA; a GQA preset keeps its K/V heads)."""
    if d_head is not None and d_head * n_heads == d_model:
        d_head = None
    if n_kv_heads == n_heads:
        n_kv_heads = None
    return AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, bias=bias)


def _hf(name: str, title: str, url: str, cited: dict[str, Any], *, bias: bool) -> Preset:
    """A preset from Hugging Face ``config.json`` field names."""
    n_heads = cited.get("num_attention_heads", cited.get("n_head"))
    d_model = cited.get("hidden_size", cited.get("n_embd"))
    cfg = _config(d_model, n_heads, cited.get("num_key_value_heads"), cited.get("head_dim"), bias=bias)
    return Preset(name=name, title=title, config=cfg,
                  n_layers=cited.get("num_hidden_layers", cited.get("n_layer")), citation=url,
                  cited=MappingProxyType(dict(cited)), rope_theta=cited.get("rope_theta"),
                  max_positions=cited.get("max_position_embeddings", cited.get("n_positions")),
                  sliding_window=cited.get("sliding_window"))


_LIST = [
    _hf("gpt2-small", "GPT-2 small (124M)", "https://huggingface.co/openai-community/gpt2/blob/main/config.json",
        {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024}, bias=True),
    _hf("gpt2-xl", "GPT-2 XL (1.5B)", "https://huggingface.co/openai-community/gpt2-xl/blob/main/config.json",
        {"n_embd": 1600, "n_head": 25, "n_layer": 48, "n_positions": 1024}, bias=True),
    Preset(
        name="gpt3-175b", title="GPT-3 175B",
        config=_config(12288, 96, None, 128, bias=True), n_layers=96,
        citation="https://arxiv.org/abs/2005.14165 (Brown et al. 2020, Language Models are Few-Shot Learners, "
                 "Table 2.1)",
        cited=MappingProxyType({"n_params": "175.0B", "n_layers": 96, "d_model": 12288, "n_heads": 96,
                                "d_head": 128, "n_ctx": 2048}),
        max_positions=2048,
    ),
    _hf("bert-base", "BERT base, uncased (110M)",
        "https://huggingface.co/google-bert/bert-base-uncased/blob/main/config.json",
        {"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12, "max_position_embeddings": 512},
        bias=True),
    _hf("all-minilm-l6-v2", "sentence-transformers all-MiniLM-L6-v2 (22M)",
        "https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2/blob/main/config.json",
        {"hidden_size": 384, "num_attention_heads": 12, "num_hidden_layers": 6, "max_position_embeddings": 512},
        bias=True),
    _hf("llama-2-7b", "Llama 2 7B", "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json",
        {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
         "max_position_embeddings": 4096, "rope_theta": 10000.0}, bias=False),
    _hf("llama-2-70b", "Llama 2 70B", "https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json",
        {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80,
         "max_position_embeddings": 4096, "rope_theta": 10000.0}, bias=False),
    _hf("llama-3-8b", "Meta Llama 3 8B", "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
        {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
         "max_position_embeddings": 8192, "rope_theta": 500000.0}, bias=False),
    _hf("llama-3-70b", "Meta Llama 3 70B",
        "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
        {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80,
         "max_position_embeddings": 8192, "rope_theta": 500000.0}, bias=False),
    _hf("mistral-7b", "Mistral 7B v0.1", "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json",
        {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
         "max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096}, bias=False),
]

#: Every preset, by name (read-only).
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _LIST})


class UnknownPresetError(KeyError, ValueError):
    """No preset has this name; the message lists the closest names (a ``KeyError`` and a ``ValueError``).

    Shapes:
        none
    """

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


def preset_names() -> list[str]:
    """All preset names, in the order they are listed.

    Shapes:
        none

    Example:
        >>> "gpt2-small" in preset_names()
        True
    """
    return list(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called exactly ``name``; otherwise :class:`UnknownPresetError` naming the close matches.

    Shapes:
        returns a :class:`Preset` whose ``config`` describes one layer (d, h, h_kv, d_h).

    Example:
        >>> get_preset("gpt3-175b").config.d_head
        128
        >>> get_preset("llama3-8b")
        Traceback (most recent call last):
        ...
        headwise.presets.UnknownPresetError: unknown preset 'llama3-8b'; did you mean: llama-3-8b, llama-3-70b, llama-2-7b, llama-2-70b?
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a str, got {type(name).__name__}")
    if name in PRESETS:
        return PRESETS[name]
    lowered = {n.lower(): n for n in PRESETS}
    close = [lowered[n] for n in difflib.get_close_matches(name.lower(), list(lowered), n=4, cutoff=0.5)]
    hint = f"did you mean: {', '.join(close)}?" if close else f"known presets: {', '.join(PRESETS)}"
    raise UnknownPresetError(f"unknown preset {name!r}; {hint}")
