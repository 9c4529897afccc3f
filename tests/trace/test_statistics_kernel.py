"""The statistics kernel (headwise/statistics/kernel.py) in Triton's CPU interpreter, against float64 statistics
of the materialised pattern (tests/trace/stats_reference.py): the same source the GPU compiles, run on CPU
tensors at small shapes (float32 and float16; the interpreter has no bfloat16 arithmetic, so bfloat16 is
checked on a GPU only, tests/gpu/test_cuda_statistics.py). Skipped with a one-line reason without triton.

Triton decides at import whether its own library runs interpreted, so these tests run in a child process that
has ``TRITON_INTERPRET=1`` from its start (:func:`test_the_kernel_in_triton_s_interpreter`); in any other
process they skip, saying so.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from headwise import plan as hwp
from headwise.statistics import KernelFallbackWarning, attend_with_statistics
from tests.trace.stats_reference import close, reference_statistics
from tests.trace.test_statistics import CASES, _qkv

pytest.importorskip("triton", reason="the statistics kernel needs triton (the dev extra installs it on Linux x86_64)")


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # set before triton was imported: a child process
ROOT = Path(__file__).resolve().parents[2]


def test_the_kernel_in_triton_s_interpreter():
    if INTERPRETER:
        pytest.skip("this is the child process")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-n", "0", str(Path(__file__).relative_to(ROOT)), "-k", "not interpreter"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]


@pytest.fixture(scope="module")
def kernel():
    """The kernel module, built for the interpreter (in the child process only)."""
    if not INTERPRETER:
        pytest.skip("runs in a child process with TRITON_INTERPRET=1 (test_the_kernel_in_triton_s_interpreter)")
    from headwise.statistics import kernel as module

    assert module.INTERPRETED
    return module


def _float32(kw: dict) -> dict:
    return {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_equals_float64_of_the_pattern(kernel, case):
    b, h, h_kv, s_q, s_kv, kw = CASES[case]
    q, k, v = (t.float() for t in _qkv(b, h, h_kv, s_q, s_kv, d=16))
    kw = _float32(kw)
    z, got = kernel.kernel_statistics(q, k, v, scale=0.25, **kw)
    want_z, want = reference_statistics(q, k, v, scale=0.25, **kw)
    close(got, want, rtol=1e-4, atol=1e-5)  # float32 scores: tests/TOLERANCES.md
    torch.testing.assert_close(z.double(), want_z, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d_h, d_v", [(24, 40), (64, 16)])
def test_head_widths_that_are_not_powers_of_two_and_values_of_another_width(kernel, d_h, d_v):
    q, k, v = (t.float() for t in _qkv(1, 4, 2, 19, 23, d=d_h, d_v=d_v))
    z, got = kernel.kernel_statistics(q, k, v, scale=d_h ** -0.5, causal=True)
    want_z, want = reference_statistics(q, k, v, scale=d_h ** -0.5, causal=True)
    close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(z.double(), want_z, rtol=1e-4, atol=1e-5)


def test_float16_inputs_keep_float32_statistics(kernel):
    q, k, v = (t.half() for t in _qkv(2, 4, 2, 21, 21, d=16))
    z, got = kernel.kernel_statistics(q, k, v, scale=0.25, causal=True)
    want_z, want = reference_statistics(q, k, v, scale=0.25, causal=True)
    assert z.dtype == torch.float16 and got["entropy"].dtype == torch.float32
    close(got, want, rtol=2e-3, atol=2e-3)  # float16 probabilities into the value product: tests/TOLERANCES.md
    torch.testing.assert_close(z.double(), want_z, rtol=2e-2, atol=2e-2)


def test_strided_inputs_as_transformers_hands_them_over(kernel):
    # (b, s, h, d_h) buffers seen through a transpose: the kernel reads them by their strides
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 17, 4, 16, generator=g).transpose(1, 2)
    k = torch.randn(2, 17, 2, 16, generator=g).transpose(1, 2)
    v = torch.randn(2, 17, 2, 16, generator=g).transpose(1, 2)
    z, got = kernel.kernel_statistics(q, k, v, scale=0.25, causal=True)
    want_z, want = reference_statistics(q, k, v, scale=0.25, causal=True)
    close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(z.double(), want_z, rtol=1e-4, atol=1e-5)


def _kernel_plan(b: int, h: int, h_kv: int, s: int, d: int) -> hwp.Plan:
    plan = hwp.plan_attention(h=h, h_kv=h_kv, d_h=d, scale=d ** -0.5, b=b, s_q=s, s_kv=s, dtype=torch.float32,
                              device=torch.device("cpu"), causal=True, statistics=hwp.STATISTICS)
    return plan._replace(statistics_via=hwp.Statistics.KERNEL)  # what a CUDA plan says, run on CPU tensors


def test_a_kernel_plan_runs_the_kernel(kernel, monkeypatch):
    calls = []
    real = kernel.kernel_statistics
    monkeypatch.setattr(kernel, "kernel_statistics", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (t.float() for t in _qkv(1, 4, 2, 13, 13, d=16))
    z, weights, got = attend_with_statistics(_kernel_plan(1, 4, 2, 13, 16), q, k, v)
    assert calls and weights is None
    _, want = reference_statistics(q, k, v, scale=0.25, causal=True)
    close(got, want, rtol=1e-4, atol=1e-5)


def test_a_kernel_failure_warns_and_the_chunks_compute_the_same(kernel):
    q, k, v = (t.float() for t in _qkv(16384, 4, 4, 1, 1, d=16))  # b * h = 65536: beyond the kernel's grid
    with pytest.warns(KernelFallbackWarning, match="at most 65535"):
        _, _, got = attend_with_statistics(_kernel_plan(16384, 4, 4, 1, 16), q, k, v)
    assert torch.equal(got["entropy"], torch.zeros(16384, 4, 1)) and torch.equal(got["lse"].isfinite(),
                                                                                 torch.ones(16384, 4, 1).bool())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isclose(float(got["key_weight"].sum()), 16384 * 4, rel_tol=1e-6)
