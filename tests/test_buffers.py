"""headwise.buffers: large fresh CPU tensors on huge pages behave as torch.empty's, and free their memory."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from headwise import buffers
from headwise.trace import head_results


def test_small_or_non_cpu_requests_are_ordinary_tensors():
    t = buffers.fresh_empty((3, 5), torch.float64, torch.device("cpu"))
    assert t.shape == (3, 5) and t.dtype == torch.float64 and t.is_contiguous()
    t.fill_(2.0)
    torch.testing.assert_close(t, torch.full((3, 5), 2.0, dtype=torch.float64))


def test_a_large_buffer_is_a_writable_contiguous_tensor_that_keeps_its_values(monkeypatch):
    monkeypatch.setattr(buffers, "HUGE_BYTES", 0)  # every size takes the mapped path
    t = buffers.fresh_empty((4, 1024, 33), torch.float32, torch.device("cpu"))
    assert t.shape == (4, 1024, 33) and t.is_contiguous()
    src = torch.randn(4, 1024, 33)
    t.copy_(src)
    torch.testing.assert_close(t.clone(), src)
    torch.testing.assert_close(t.permute(2, 0, 1).sum(0), src.sum(2))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_mapped_buffers_go_back_to_the_system_when_freed():
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    size = buffers.HUGE_BYTES + 2**20
    before = resident()
    for _ in range(12):  # 12 x 33 MiB written: kept, they would add ~400 MiB
        t = buffers.fresh_empty((size // 4,), torch.float32, torch.device("cpu"))
        t.fill_(1.0)
        del t
        gc.collect()
    assert resident() - before < 4 * size


def test_head_results_on_huge_pages_equal_the_per_head_products(monkeypatch):
    monkeypatch.setattr(buffers, "HUGE_BYTES", 0)
    z, w = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(6, 15, dtype=torch.float64)
    want = torch.stack([z[:, i] @ w[:, 5 * i:5 * i + 5].T for i in range(3)], dim=2)  # (b, s, h, d)
    with torch.no_grad():
        got = head_results(z, w)
    torch.testing.assert_close(got, want)
