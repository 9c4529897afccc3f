"""Loading a surgery folder whose weights have other shapes than its config.json builds
(headwise.surgery.load_pretrained): one ValueError naming each mismatched weight with its saved and expected
shapes, on the rebuilt path and the plain-from_pretrained path, without transformers' load report, its
RuntimeError or a change to global state. Reference: the shapes the unpatched transformers class builds."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import headwise.surgery.io as surgery_io  # noqa: E402
from headwise.interop import patch  # noqa: E402
from headwise.surgery import load_pretrained, prune_heads, save_pretrained  # noqa: E402
from tests.interop.tiny_models import build  # noqa: E402

LLAMA = transformers.LlamaForCausalLM
PLANS = {"rebuilt": ({0: [1]}, False), "plain_hf": ({0: [0, 1, 2], 1: [3, 4, 5]}, True)}


def _narrower_mlp(path) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """config.json told of an MLP narrower than the saved one: a gate_proj key, its saved and expected shapes
    (the latter from the unpatched class built on the meta device from the edited config)."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    saved = (config["intermediate_size"], config["hidden_size"])
    config["intermediate_size"] -= 8
    file.write_text(json.dumps(config))
    with torch.device("meta"):
        built = LLAMA(transformers.LlamaConfig.from_pretrained(path))
    key = "model.layers.0.mlp.gate_proj.weight"
    return key, saved, tuple(built.get_parameter(key).shape)


def _global_state():
    logs = transformers.utils.logging
    return logs.get_verbosity(), logs.is_progress_bar_enabled(), torch.get_default_dtype()


@pytest.mark.parametrize("checked_first", [True, False], ids=["on-the-meta-device", "in-the-load-report"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_a_weight_of_another_shape_is_a_value_error_naming_it(tmp_path, plan, checked_first, monkeypatch, capfd,
                                                               caplog):
    drop, plain = PLANS[plan]
    assert save_pretrained(prune_heads(patch(build("llama")), drop), tmp_path) is plain
    key, saved, expected = _narrower_mlp(tmp_path)
    assert saved != expected
    if not checked_first:  # a key transformers' loader converts is seen only in its load report
        monkeypatch.setattr(surgery_io, "check_shapes", lambda *args: None)
    before = _global_state()
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ValueError) as err:
            load_pretrained(tmp_path, LLAMA)
    what = "LlamaForCausalLM built from its config.json" if plain else "the rebuilt model"
    assert re.search(rf"load_pretrained: .* does not match {what}: mismatched keys \[.*'{re.escape(key)}' saved "
                     rf"{re.escape(str(saved))}, expected {re.escape(str(expected))}", str(err.value)), err.value
    assert _global_state() == before
    if checked_first:  # refused before from_pretrained: no load report
        out = capfd.readouterr()
        assert "LOAD REPORT" not in out.err + out.out + caplog.text
