#!/usr/bin/env bash
# Everything that needs a GPU, in one run (docs/gpu.md): the CUDA tests, which SDPA kernel each plan gets, and
# python -m benchmarks --device cuda. Run from the repository root on a CUDA machine that has PyTorch; a
# transformers wheel in .whl/ (docs/gpu.md says how to fetch it) is installed beside the machine's packages.
# Output goes to $OUT (default: gpu-out/).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hw-site .whl/*.whl \
    && export PYTHONPATH=/tmp/hw-site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/kernels.txt"
import torch
from headwise import MultiHeadAttention
# Which kernel PyTorch picks under headwise's plan, for the shapes the benchmarks run (explain_dispatch asks
# PyTorch's own selector with the plan's kernel restriction and grouping applied).
for dtype in (torch.bfloat16, torch.float32):
    for h_kv in (32, 8):
        attn = MultiHeadAttention(4096, 32, h_kv, bias=False, device="cuda", dtype=dtype)
        cache = attn.new_cache(16, 2048)
        with torch.no_grad():
            attn(torch.randn(16, 1024, 4096, device="cuda", dtype=dtype), cache=cache)
        cases = {"forward b8 s4096 causal": dict(x=torch.randn(8, 4096, 4096, device="cuda", dtype=dtype), causal=True),
                 "decode b16 ctx 1024": dict(x=torch.randn(16, 1, 4096, device="cuda", dtype=dtype), cache=cache),
                 "masked b2 s512": dict(x=torch.randn(2, 512, 4096, device="cuda", dtype=dtype),
                                        mask=torch.rand(2, 1, 512, 512, device="cuda") > 0.5)}
        for name, kw in cases.items():
            x = kw.pop("x")
            with torch.no_grad():
                info = attn.explain_dispatch(x, **kw)
            print(f"{str(dtype):15} h32/{h_kv:<3} {name:26} kernel={info.kernel:10} grouping={info.plan.grouping.name:7} "
                  f"avoid_cudnn={info.plan.avoid_cudnn} read={info.plan.cache_read.name} chunk={info.query_chunk}")
PY
if [ -n "${DIAG:-}" ]; then timeout "${DIAG_TIMEOUT:-60}" python3 -m benchmarks.decode_kernels 2>&1 | tee "$OUT/decode-kernels.txt"; fi
# The tests, a file at a time (each under its own limit, so one slow compile cannot take the others' time).
for f in ${TESTS:-tests/gpu/test_cuda.py tests/gpu/test_cuda_hf.py tests/gpu/test_cuda_statistics.py}; do
  timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -m cuda "$f" -p no:randomly ${TEST_K:+-k "$TEST_K"} 2>&1 \
    | tee -a "$OUT/gpu-tests.txt"
done
timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks --device cuda --out "$OUT/RESULTS-cuda.md" ${BENCH_ONLY:+--only $BENCH_ONLY} 2>&1 \
  | tee "$OUT/gpu-bench.txt"
