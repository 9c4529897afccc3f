"""Shared test set-up: deterministic seeds, one intra-op thread per xdist worker, hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Two xdist workers on two cores: one thread each avoids oversubscription (and keeps timings sane).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# transformers' own test files (tests/hf_suite/upstream) run in their own session (make hf-tests), not in this one.
collect_ignore = ["hf_suite"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
