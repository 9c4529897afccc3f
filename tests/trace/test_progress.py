"""The progress bar of the long sweeps and scores: shown when asked (tqdm's, or the one-line fallback without
tqdm), never with progress=False, and by default not where stderr is not a terminal (logs and tests stay clean);
the numbers do not depend on it."""

from __future__ import annotations

import sys

import pytest
import torch

import headwise
from headwise.patching import head_effects
from headwise.surgery import ablation_importance, gradient_importance
from headwise.tracing import progress as hw_progress


def model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2), headwise.MultiHeadAttention(8, 2)).eval()
    return model, torch.randn(2, 3, 8), torch.randn(2, 3, 8)


CALLS = {
    "head_effects": lambda m, a, b, p: head_effects(m, a, b, lambda y: y.sum(), batch_heads=1, progress=p),
    "ablation_importance": lambda m, a, b, p: ablation_importance(m, [a, b], lambda y: y.sum(), progress=p),
    "gradient_importance": lambda m, a, b, p: gradient_importance(m, [a, b], lambda y: y.square().sum(), progress=p),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_bar_when_asked_none_otherwise_and_the_same_numbers(name, capfd):
    model, a, b = model_and_input()
    shown = CALLS[name](model, a, b, True)
    err = capfd.readouterr().err
    steps = {"head_effects": 4, "ablation_importance": 4, "gradient_importance": 2}[name]  # forwards / batches
    assert name in err and f"0/{steps}" in err, err  # tqdm's bar on stderr, of that many steps (its redraws are timed)
    quiet = CALLS[name](model, a, b, False)
    default = CALLS[name](model, a, b, None)  # stderr is not a terminal here
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""
    torch.testing.assert_close(shown, quiet, rtol=0, atol=0)
    torch.testing.assert_close(default, quiet, rtol=0, atol=0)


def test_without_tqdm_the_fallback_line_counts_and_is_erased(monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    model, a, b = model_and_input()
    CALLS["head_effects"](model, a, b, True)
    err = capfd.readouterr().err
    assert "head_effects: 4/4" in err and err.endswith("\r\033[K")


def test_the_default_shows_on_a_terminal_only_after_a_delay(monkeypatch, capfd):
    monkeypatch.setattr(hw_progress, "_interactive", lambda: True)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with hw_progress.progress_bar(3, "quick", None) as advance:  # done before DELAY_S: nothing drawn
        advance(3)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(hw_progress, "DELAY_S", 0.0)
    with hw_progress.progress_bar(3, "slow", None) as advance:
        advance(3)
    assert "slow: 3/3" in capfd.readouterr().err
