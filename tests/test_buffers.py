"""headwise.buffers: large fresh CPU tensors on huge pages behave as torch.empty's, and free their memory."""

from __future__ import annotations

import copy
import gc
import math
import os

import pytest
import torch

from headwise import MultiHeadAttention, buffers
from headwise.trace import head_results

from tests.reference import reference_mha


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


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


needs_thp = pytest.mark.skipif(not (_thp_available() and os.path.exists("/proc/self/smaps")),
                               reason="needs Linux transparent huge pages and /proc/self/smaps")


@needs_thp
def test_large_weights_and_caches_are_advised_and_small_ones_are_left_alone(monkeypatch):
    monkeypatch.setattr(buffers, "HUGE_BYTES", 2**20)
    attn = MultiHeadAttention(512, 8)  # W_Q, W_K, W_V packed: 3 MiB; W_O: 1 MiB
    cache = attn.new_cache(1, 512)  # 1 MiB each
    small = MultiHeadAttention(64, 4)
    assert [buffers.huge_pages_advised(t) for t in (attn.q_proj.weight, attn.v_proj.weight, attn.out_proj.weight,
                                                    cache.keys, cache.values)] == [True] * 5
    assert not any(buffers.huge_pages_advised(t) for t in (attn.q_proj.bias, small.q_proj.weight,
                                                           small.new_cache(1, 8).keys))
    assert buffers.huge_pages_advised(attn.double().q_proj.weight)  # re-packed after a conversion: advised again
    assert buffers.huge_pages_advised(copy.deepcopy(attn).k_proj.weight)


@needs_thp
def test_a_long_prompt_s_packed_qkv_lands_on_huge_pages_and_a_short_one_does_not(monkeypatch):
    """Results of one call: on fresh huge pages from MAPPED_BYTES (where glibc maps 4 KiB pages), else None."""
    monkeypatch.setattr(buffers, "HUGE_BYTES", 2**20)
    monkeypatch.setattr(buffers, "MAPPED_BYTES", 2**21)
    assert buffers.scratch_empty((2**19 - 1,), torch.float32, torch.device("cpu")) is None  # just under 2 MiB
    assert buffers.huge_pages_advised(buffers.scratch_empty((2**19,), torch.float32, torch.device("cpu")))
    attn = MultiHeadAttention(256, 4).eval()
    with torch.no_grad():
        long_q = attn.project_qkv(torch.randn(1, 1024, 256))[0]  # (1024, 768) fp32 = 3 MiB packed
        short_q = attn.project_qkv(torch.randn(1, 512, 256))[0]  # 1.5 MiB
    assert buffers.huge_pages_advised(long_q) and not buffers.huge_pages_advised(short_q)


def test_a_layer_on_huge_pages_is_an_ordinary_layer(monkeypatch, tmp_path):
    """Every size takes the mapped path: the layer and its cache compute the float64 reference, save, load,
    deep-copy and move to shared memory like any other."""
    monkeypatch.setattr(buffers, "HUGE_BYTES", 0)
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 2, dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x, causal=True), reference_mha(attn, x, causal=True)[0])
    cache = attn.new_cache(2, 8)
    steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in (4, 5)]
    torch.testing.assert_close(torch.cat(steps, 1), reference_mha(attn, x, causal=True)[0])
    torch.save(attn.state_dict(), tmp_path / "attn.pt")
    monkeypatch.setattr(buffers, "HUGE_BYTES", math.inf)
    loaded = MultiHeadAttention(32, 4, 2, dtype=torch.float64)
    loaded.load_state_dict(torch.load(tmp_path / "attn.pt"))
    twin = copy.deepcopy(attn)
    attn.share_memory()
    for other in (loaded, twin, attn):
        torch.testing.assert_close(other(x, causal=True), reference_mha(attn, x, causal=True)[0])
    assert attn.q_proj.weight.is_shared()


@needs_thp
def test_the_benchmarks_keep_each_copy_on_the_pages_its_original_had(monkeypatch):
    from benchmarks.timing import refresh_memory

    monkeypatch.setattr(buffers, "HUGE_BYTES", 2**20)
    attn = MultiHeadAttention(512, 8)
    plain = torch.nn.Linear(512, 1024)  # 2 MiB from the allocator, as a user's would be
    before = attn(torch.ones(1, 3, 512)).detach()
    refresh_memory(attn, plain)
    assert buffers.huge_pages_advised(attn.q_proj.weight) and not buffers.huge_pages_advised(plain.weight)
    torch.testing.assert_close(attn(torch.ones(1, 3, 512)), before, rtol=0, atol=0)
    refresh_memory(plain, huge_pages=True)
    assert buffers.huge_pages_advised(plain.weight)
