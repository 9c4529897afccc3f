"""What a decode step's Python costs once the weights have streamed through the CPU caches.

``python -m benchmarks.cold_python`` times the forward's per-call checks and plan of a d 2048 layer (the
Python work ``attn(x, cache=cache)`` does before any product) back to back, and right after reading
``--stream-mib`` of memory, as a decode step does when it streams the weights and the cached keys and values.
The second number is what the forward's fixed work costs per token at decode sizes; ``headwise.DecodeStep``
makes that work once instead.

Shapes:
    x: (1, 1, d) with d 2048, h 16; the stream: one float32 tensor of ``--stream-mib`` MiB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from headwise import MultiHeadAttention
from headwise.plan import plan_attention
from headwise.validation import check_forward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-mib", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    attn = MultiHeadAttention(2048, 16).eval()
    cache = attn.new_cache(1, 4096)
    x = torch.randn(1, 1, 2048)
    big = torch.randn(args.stream_mib * 2**20 // 4)

    cfg, w = attn.config, attn.q_proj.weight

    def checks_and_plan() -> float:  # what the forward runs before its first product, nothing computed
        t = time.perf_counter()
        x1 = check_forward(cfg, w.dtype, w.device, False, x, None, None, None, None, False, cache, None, False).x
        plan_attention(cfg, b=x1.shape[0], s_q=1, s_kv=cache.length + 1, dtype=x1.dtype, device=x1.device,
                       cached=True, chunk_queries=False, records_grad=torch.is_grad_enabled)
        return time.perf_counter() - t

    hot, cold = [], []
    with torch.no_grad():
        for _ in range(args.rounds):
            checks_and_plan()
            hot.append(checks_and_plan())
            big.sum()  # stream the memory through the caches, as a decode step streams its weights
            cold.append(checks_and_plan())
    print(f"checks and plan of one decode call: {statistics.median(hot) * 1e6:.1f} us back to back, "
          f"{statistics.median(cold) * 1e6:.1f} us after a {args.stream_mib} MiB stream "
          f"(medians of {args.rounds}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
