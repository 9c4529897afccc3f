"""headwise.viz.models: what `headwise heads` reads from a checkpoint's config.json before anything loads. The
parameter bound is checked against the parameter count of the model transformers builds from the same config
(it must never exceed it), for families whose layouts differ (factorised embeddings, shared layers, latent
attention, experts, heads removed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headwise.viz import models


def write(path: Path, config: dict, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    for name, text in files.items():
        (path / name).write_text(text)
    return path


@pytest.mark.parametrize("config,counts", [
    ({"model_type": "opt", "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 32},
     (3, 4, 32)),
    ({"model_type": "gpt2", "n_layer": 2, "n_head": 3, "n_positions": 64}, (2, 3, 64)),
    ({"model_type": "mpt", "n_layers": 5, "n_heads": 2, "max_seq_len": 128}, (5, 2, 128)),
    ({"model_type": "t5gemma_like", "num_layers": 4, "num_heads": 8}, (4, 8, None)),
    ({"model_type": "wrapped", "text_config": {"num_hidden_layers": 6, "num_attention_heads": 2,
                                               "max_position_embeddings": 16}}, (6, 2, 16)),
])
def test_layer_and_head_counts_under_their_usual_names(tmp_path, config, counts) -> None:
    info = models.model_info(str(write(tmp_path / "m", config)))
    assert (info.family, (info.n_layers, info.n_heads, info.max_positions)) == (config["model_type"], counts)
    assert info.layer_heads is None and not info.surgery and info.min_tokens == 1


def test_a_surgery_sidecar_gives_each_layers_heads(tmp_path) -> None:
    sidecar = {"format": 2, "plain_hf": False, "modules": {
        "h.0.attn": {"class": "GPT2Attention", "n_heads": 3, "n_kv_heads": 3, "d_head": 4},
        "h.1.attn": {"class": "GPT2Attention", "n_heads": 1, "n_kv_heads": 1, "d_head": 4}}}
    path = write(tmp_path / "m", {"model_type": "gpt2", "n_layer": 2, "n_head": 4},
                 **{models.SIDECAR: json.dumps(sidecar)})
    info = models.model_info(str(path))
    assert info.layer_heads == (3, 1) and info.surgery
    assert info.heads_of(0) == (3, 3) and info.heads_of(None) == (1, 3)


def test_the_sidecar_name_is_surgerys() -> None:
    pytest.importorskip("transformers")
    from headwise.surgery.io import SIDECAR

    assert models.SIDECAR == SIDECAR


@pytest.mark.parametrize("config,message", [
    ({"num_hidden_layers": 2, "num_attention_heads": 2}, "has no model_type"),
    ({"model_type": "bart", "num_hidden_layers": 2, "encoder_attention_heads": 2, "is_encoder_decoder": True},
     "is an encoder-decoder model"),
    ({"model_type": "clip", "text_config": {}, "vision_config": {}}, "takes more than text (vision_config)"),
    ({"model_type": "opt", "num_hidden_layers": 2}, "does not say how many layers and heads"),
])
def test_models_it_cannot_draw_are_refused_from_the_config(tmp_path, config, message) -> None:
    with pytest.raises(ValueError) as e:
        models.model_info(str(write(tmp_path / "m", config)))
    assert message in str(e.value) and "\n" not in str(e.value)


FAMILY_CONFIGS = {  # every layout the bound must stay under
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=8),
    "albert": dict(hidden_size=32, embedding_size=8, intermediate_size=64, num_hidden_layers=6,
                   num_attention_heads=4, num_hidden_groups=1),
    "electra": dict(hidden_size=32, embedding_size=8, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4),
    "deepseek_v3": dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=7, kv_lora_rank=6,
                        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=5, intermediate_size=32,
                        moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, num_hidden_layers=2),
    "gemma2": dict(hidden_size=24, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, head_dim=4,
                   num_key_value_heads=1),
    "mixtral": dict(hidden_size=16, intermediate_size=4, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, num_local_experts=2),
    "gpt_neox": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4),
}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_the_parameter_bound_never_exceeds_the_model(tmp_path, family) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model(family, vocab_size=50, **FAMILY_CONFIGS[family])
    cfg.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    info = models.model_info(str(tmp_path / "m"))
    n = sum(p.numel() for p in AutoModel.from_config(cfg).parameters())
    assert 0 < info.min_parameters <= n, (info.min_parameters, n)


def test_the_parameter_bound_holds_after_heads_are_removed(tmp_path) -> None:
    pytest.importorskip("transformers")
    from headwise.interop import patch
    from headwise.surgery import prune_heads, save_pretrained
    from tests.interop.tiny_models import build

    model = build("gpt2")
    prune_heads(patch(model), {0: [0, 1], 1: [1, 2]})  # one head left in each layer
    save_pretrained(model, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    info = models.model_info(str(tmp_path / "m"))
    assert info.layer_heads == (1, 1)
    assert info.min_parameters <= sum(p.numel() for p in model.parameters())
