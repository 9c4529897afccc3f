"""The why of each goal that a run misses, written into ``RESULTS.md`` and the summary only for the goals that
run missed, and the preamble of a full run's ``RESULTS.md``.

These are explanations of mechanism (which kernels run, what differs between the two sides), not lab notes:
the measurements behind them, with their dates, are in ``docs/benchmarks.md`` and the ``RESULTS.md`` of the
run that made them.

Shapes:
    b: batch, s: sequence, d: d_model, h: heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

__all__ = ["MISS_NOTES", "PREAMBLE"]

_SPREAD = "compare the per-process range: a miss inside it is run-to-run spread of the shared machine."

MISS_NOTES: dict[str, str] = {
    "limit": "headwise runs the same kernels as the packed module: one GEMM over its packed W_Q, W_K, W_V (stored "
             "(d_in, d_out), the packed module's (d_out, d_in)), the merge is a view (SDPA's CPU output is laid "
             "out (b, s, h, d_h)), and causal runs the kernel's is_causal path. What remains is tens of "
             "microseconds of Python per call (input checks, module attribute lookups), under 0.1 % at these "
             "sizes; torch.profiler shows the same ops with the same counts and self-CPU totals on both sides "
             "(docs/benchmarks.md), so a miss here is the spread of the shared machine (compare the min columns and "
             "the per-process range).",
    "limit_bwd": "the backward differs from the packed module only in summing three input-gradient GEMMs instead "
                 "of one fused GEMM (two extra (b, s, d) additions); a miss beyond that is run-to-run spread.",
    "hf": "the Hugging Face sdpa layers run the same projection GEMMs and SDPA kernel as headwise (identical op "
          "lists and self-CPU totals in torch.profiler, docs/benchmarks.md); headwise's in-place rotary gives it a "
          "margin on the Llama rows at long sequences; at s 128 the eager layers' s x s step is under 1 % of the "
          "call, so those rows compare identical work too. There are about 25 such parity comparisons per run and "
          "the worst of them lands near 1.0 on a different row each run; " + _SPREAD + " Beating identical work "
          "by a margin this machine can resolve would need less work than the same GEMMs and kernel.",
    "peak": "the forward's FLOPs include the attention step, which runs below the GEMM peak in SDPA's CPU kernel, "
            "and the bias additions; see the GFLOP/s column of each table.",
    "memory": "without autograd headwise runs long forwards in query chunks (headwise.chunking): it holds K and V "
              "(0.50 GiB at s 16384, d 4096 in float32), the output (0.25 GiB) and one chunk's queries, context and "
              "scratch (~0.06 GiB at 1024 positions); the 'headwise one pass' rows show the unchunked floor (Q, K, V "
              "and the context alive together, 1.00 GiB), so a miss above the chunked budget is allocator or "
              "kernel scratch of this run.",
    "long": "a chunked forward runs the same projection GEMMs on row blocks and the same flash kernel per chunk; "
            "causal chunks read a fully visible key prefix and the square diagonal block in two kernel calls merged "
            "by log-sum-exp, which is the one-pass kernel's work. Compare the 'headwise one pass' column of the "
            "same table: a miss matched by one pass is run-to-run spread, not chunking.",
    "gpu": "measured only where CUDA is present; see the GPU tables for the kernel each peer ran.",
    "compile": "dynamo specialises Python ints on first sight and makes them symbolic only after seeing a second "
               "value; KVCache.length is a Python int, so the first compiled call specialises on it. After a "
               "compiled prefill (as in generation) one graph serves every decode position; decoding from an "
               "eagerly filled cache costs one extra graph (the first position), or none with "
               "torch.compile(dynamic=True).",
    "cat": "a torch.cat cache copies the whole cache (2 x context x h_kv x d_h floats) every token; here that copy "
           "is cheap next to the 4 x d^2 weights each token reads, so the preallocated cache wins by less than 2x.",
    "mha": "nn.MultiheadAttention's CPU fast path materialises the (b, h, s, s) probabilities (bmm, softmax, bmm "
           "in its profile; 100 MB per call at this shape) where headwise and the packed limit run the flash "
           "kernel. What that costs it depends on how the process's allocator serves the fresh 100 MB buffer "
           "(page faults on first touch, or a reused block), which differs from process to process "
           "(docs/benchmarks.md records the fast path anywhere from about 1.0x to 1.3x the packed limit while "
           "headwise stayed at the limit). <= 0.85 therefore holds only in processes where the fast path pays "
           ">= 18 % for its buffer; beating the limit itself would need fewer FLOPs than the same GEMMs and kernel.",
    "causal": "the causal saving comes from SDPA's CPU kernel skipping key blocks above the diagonal; it is bounded "
              "by the kernel's block sizes at this length.",
    "weights": "both materialise one (b, h, s, s) softmax per call; at b4 s128 d4096 the call is mostly projection "
               "GEMMs. nn.MHA's native path projects Q, K and V with one fused GEMM and adds the bias, the query "
               "scale and the head layout in one pass (_transform_bias_rescale_qkv); headwise adds each bias inside "
               "its GEMM and then lays out Q (scaled), K and V: about 1 % more element-wise traffic; " + _SPREAD,
    "gqa": "native grouped attention and repeated K/V do the same arithmetic; the saving is the repeat copy "
           "(small next to the attention at this size), so a miss here is run-to-run spread.",
    "hf_dec": "headwise and HF's Llama layer decode with the same three projection GEMVs (no bias), one slot copy "
              "and SDPA over the filled prefix. The worst row tends to be at the shortest context, where the fixed "
              "per-token work outside the GEMVs weighs most; " + _SPREAD + " Doing less than HF's same GEMVs would "
              "take a weight layout its GEMV kernel reads faster.",
    "decode": "headwise decodes with the same kernels as the minimal preallocated cache (one packed Q/K/V "
              "matrix-vector product, one slot copy, SDPA over the filled prefix), plus its per-token Python "
              "(input checks, the plan, four module calls). Which weights the "
              "process allocated first can decide more than the split does (docs/benchmarks.md); " + _SPREAD,
    "decode_xw": "the x @ W loop does the least a preallocated-cache decode can do in PyTorch: four addmm GEMVs over "
                 "contiguous (d_in, d_out) weights, one slot write per K/V, SDPA over the filled prefix, no module "
                 "call machinery and no input checks. headwise reads the same (d_in, d_out) layout, W_Q, W_K and W_V in "
                 "one packed product, keeps its weights and cache on huge pages (headwise.buffers; the loop's come "
                 "from the allocator as a user's would), and adds its per-token Python: input checks, the plan, module "
                 "calls, cache bookkeeping. That Python costs about 45 us per token at d 64 on one thread, and many "
                 "times more at this size, where every token streams ~100 MiB through the CPU caches first (python "
                 "-m benchmarks.cold_python: the forward's checks and plan alone go from ~5 us to ~60 us); "
                 "headwise.DecodeStep makes the checks and the plan once. " + _SPREAD,
    "decode_xw_huge": "the same loop with its weights and cache placed on huge pages as headwise's are: what is left is "
                      "headwise's per-token Python (see the row above) and this machine's spread. headwise's own steps "
                      "on its own weights and cache, written as the loop writes them (no checks, no module calls), "
                      "measured 0.976-0.995x this loop in seven separate processes, so the data layout is not what is "
                      "left; two identical copies of the loop differ by up to 3 % within one process (placement). "
                      + _SPREAD,
    "trace": "the traced forward writes every head's z_h W_O^h, a (b, s, h, d) float tensor h times the size of "
             "the output (144 MiB here), into freshly mapped memory: one bmm over the 12 heads plus the page "
             "faults of that allocation (about 60 ms of a 200 ms forward on this machine, measured with a bare "
             "torch.empty(...).fill_); the layer then sums those writes instead of running W_O again, so the "
             "traced forward does no more arithmetic than the plain one plus that bmm. What is left is the cost "
             "of producing the tensor that was asked for: both processes measured 1.51-1.59.",
    "patched": "patched and unpatched models run the same ops with the same counts (torch.profiler on GPT-2 "
               "generate: identical aten op lists); one patched GPT2Attention decode step costs no more than HF's own "
               "(tiny config, one thread, fastest of 60 rounds of 200 tokens: 112 against 115 us per layer-token) and "
               "less than HF's on Llama. The GPT-2 generate rows vary 0.99-1.11 between processes; " + _SPREAD,
    "baseline": "the new layer runs the old one's kernels (torch.profiler: the same GEMM and SDPA calls with the "
                "same shapes; with autograd SDPA gets q, k, v with the same strides). Without autograd the new "
                "layer runs one packed Q/K/V GEMM where the old ran three, writes it to fresh huge pages from "
                "32 MiB (where glibc would map 4 KiB pages), and copies a grouped layer's K/V out of it to rows "
                "of their own width for the kernel. Decoding computes with weights stored (d_in, d_out) on huge "
                "pages, and decode rows are below 1; the one consistent cost is that orientation's packed "
                "product at b4 s128 d4096, about 1.5 %. Single rounds of the same pair swing by 10 % and more "
                "here, and with about 25 rows the worst lands above 1.02 by chance; a row above 1.02 is "
                "re-measured alone (python -m benchmarks.faults) before it counts as a regression. " + _SPREAD,
}

PREAMBLE = ("Note: measured on a shared machine while other jobs were running; single rounds can be noisy, which "
            "is why every comparison is interleaved and reported as a median with min/max. After a group is built, "
            "every entry's weights and buffers are re-allocated (copied): on a virtual machine a matrix-vector "
            "product over weights allocated early in a process can run slower than over a later copy of the same "
            "weights (docs/benchmarks.md), and headwise is always built first (its peers copy its weights).")
