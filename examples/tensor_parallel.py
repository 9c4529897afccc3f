"""Tensor parallelism by whole heads, end to end: run with

    torchrun --nproc-per-node 2 -m examples.tensor_parallel
    python -m torch.distributed.run --nproc-per-node 4 -m examples.tensor_parallel --n-kv-heads 2

Every rank builds the same layer (same seed), keeps only its heads (:func:`headwise.parallel.tensor_parallel`),
and checks itself against the single-process layer: the causal forward, KV-cache decoding (prefill, then
one token at a time) and the gradient of every local parameter. Each rank prints its heads and its largest
difference; rank 0 prints the plan and the largest difference over all ranks. CPU processes use gloo; with
one CUDA device per rank it uses NCCL, through the same code.

This is an example script, so it prints (library code never does).

Shapes:
    x: (b, s, d), identical on every rank; the output (b, s, d) is identical on every rank.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from examples.launch import check_sizes, under_torchrun
from headwise import MultiHeadAttention
from headwise.parallel import tensor_parallel

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.tensor_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=12)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before any collective gives up")
    args = p.parse_args(argv)
    check_sizes(p, args)  # here, in one line: a bad size would fail deep inside, on every rank
    return args


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _in_rank_order(rank: int, world: int, text: str) -> None:
    for r in range(world):
        if r == rank:
            print(text, flush=True)
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    return under_torchrun(_parse(argv), "examples.tensor_parallel", _run)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)  # the same layer and input on every rank
    attn = MultiHeadAttention(args.d_model, args.n_heads, args.n_kv_heads, device=device, dtype=dtype)
    b, s, n_new = args.batch, args.seq_len, args.decode_steps
    x = torch.randn(b, s + n_new, args.d_model, device=device, dtype=dtype)
    grad_y = torch.randn(b, s, args.d_model, device=device, dtype=dtype)

    try:
        tp = tensor_parallel(attn)  # an impossible split raises here, on every rank, before any communication
    except ValueError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(tp.plan.describe(), flush=True)

    # Forward and backward: the same loss on every rank from the same (all-reduced) output.
    x_ref, x_tp = x[:, :s].clone().requires_grad_(), x[:, :s].clone().requires_grad_()
    y_ref = attn(x_ref, causal=True)
    (y_ref * grad_y).sum().backward()
    y_tp = tp(x_tp, causal=True)
    (y_tp * grad_y).sum().backward()
    d_forward = _max_diff(y_tp, y_ref)
    p = tp.partition
    q_rows, kv_rows = p.q_rows(attn.d_head), p.kv_rows(attn.d_head)
    pairs = [(tp.q_proj.weight.grad, attn.q_proj.weight.grad[q_rows]),
             (tp.k_proj.weight.grad, attn.k_proj.weight.grad[kv_rows]),
             (tp.v_proj.weight.grad, attn.v_proj.weight.grad[kv_rows]),
             (tp.out_proj.weight.grad, attn.out_proj.weight.grad[:, q_rows]),
             (tp.out_proj.bias.grad, attn.out_proj.bias.grad),
             (x_tp.grad, x_ref.grad)]
    d_grad = max(_max_diff(a, b_) for a, b_ in pairs)

    # Decoding: prefill s tokens, then one token at a time, against the single-process cache.
    with torch.no_grad():
        cache_ref = attn.new_cache(b, s + n_new)
        cache_tp = tp.new_cache(b, s + n_new)
        steps_ref = [attn(x[:, :s], cache=cache_ref)] + [attn(x[:, t:t + 1], cache=cache_ref)
                                                          for t in range(s, s + n_new)]
        steps_tp = [tp(x[:, :s], cache=cache_tp)] + [tp(x[:, t:t + 1], cache=cache_tp)
                                                     for t in range(s, s + n_new)]
    d_decode = max(_max_diff(a, b_) for a, b_ in zip(steps_tp, steps_ref))

    worst = max(d_forward, d_grad, d_decode)
    _in_rank_order(rank, world, (
        f"rank {rank}/{world}: query heads {list(p.q_heads)}, K/V heads {list(p.kv_heads)}"
        f"{' (replicated)' if p.kv_replicated else ''}; cache holds {cache_tp.n_kv_heads} of "
        f"{attn.n_kv_heads} K/V heads ({cache_tp.nbytes} of {cache_ref.nbytes} bytes); max difference: "
        f"forward {d_forward:.3g}, gradients {d_grad:.3g}, decoding {d_decode:.3g}"))
    total = torch.tensor([worst], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max difference from the single-process result ({args.dtype}, all ranks): {total.item():.3g}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
