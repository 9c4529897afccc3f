"""Sequence parallelism by heads, end to end: run with

    torchrun --nproc-per-node 2 -m examples.sequence_parallel
    python -m torch.distributed.run --nproc-per-node 4 -m examples.sequence_parallel --n-kv-heads 1 --seq-len 30
    python -m torch.distributed.run --nproc-per-node 4 -m examples.sequence_parallel --tp 2

Every rank builds the same layer (same seed) and the same global input, keeps its slice of the sequence
(``torch.tensor_split``; uneven lengths are fine), and runs :func:`headwise.parallel.sequence_parallel`
(with ``--tp 2``: a 2-D ("sp", "tp") mesh, heads split over tp too). Each rank checks its output slice and
the gradients (input slice and every weight it holds) against the single-process layer on the whole
sequence, causal with a padding mask and rotary positions. Rank 0 prints the plan and the largest difference
over all ranks. CPU processes use gloo; with one CUDA device per rank it uses NCCL, through the same code.

``--timeout S`` is the process group's timeout: a collective that waits longer raises a clear error
(``--hang-rank R`` makes rank R skip the layer to show it). This is an example script, so it prints.

Shapes:
    x: (b, S, d) on every rank; rank r feeds (b, s_r, d) and gets (b, s_r, d) back.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from examples.launch import check_sizes, under_torchrun
from headwise import MultiHeadAttention, RotaryEmbedding
from headwise.masks import padding_mask
from headwise.parallel import CollectiveTimeoutError, sequence_parallel

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.sequence_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=25, help="global sequence length (need not divide)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (a 2-D (sp, tp) mesh when > 1)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before any collective gives up")
    p.add_argument("--hang-rank", type=int, default=None, help="this rank skips the layer (shows the timeout)")
    args = p.parse_args(argv)
    check_sizes(p, args, rotary=True)  # here, in one line: a bad size would fail deep inside, on every rank
    return args


def main(argv: list[str] | None = None) -> int:
    return under_torchrun(_parse(argv), "examples.sequence_parallel", _run)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)  # the same layer and inputs on every rank
    d_head = args.d_model // args.n_heads
    attn = MultiHeadAttention(args.d_model, args.n_heads, args.n_kv_heads, rotary=RotaryEmbedding(d_head),
                              device=device, dtype=dtype)
    b, s = args.batch, args.seq_len
    x = torch.randn(b, s, args.d_model, device=device, dtype=dtype)
    grad_y = torch.randn(b, s, args.d_model, device=device, dtype=dtype)
    # The first sample is padded (3 tokens, but never all of them: a fully masked row has no softmax).
    lengths = torch.tensor([max(s - 3, 1)] + [s] * (b - 1), device=device)
    mask = padding_mask(lengths=lengths, s_kv=s)  # global (b, 1, 1, S)

    group = None
    if args.tp > 1:
        if world % args.tp:
            if rank == 0:
                print(f"error: --tp {args.tp} does not divide the {world} ranks", file=sys.stderr, flush=True)
            return 2
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("sp", "tp"))
    try:
        sp = sequence_parallel(attn, group)  # an impossible layout raises here, on every rank, before any exchange
    except ValueError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(sp.plan.describe(), flush=True)
    sl = slice(*_bounds(s, sp.world_size, sp.rank))

    x_ref = x.clone().requires_grad_()
    y_ref = attn(x_ref, mask=mask, causal=True)
    (y_ref * grad_y).sum().backward()

    x_sp = x[:, sl].clone().requires_grad_()
    if args.hang_rank == rank:
        time.sleep(args.timeout + 5)  # never joins: the others' collectives time out
        return 1
    try:
        y_sp = sp(x_sp, mask=mask, causal=True)
        (y_sp * grad_y[:, sl]).sum().backward()  # the sum over ranks of these losses is the whole loss
    except CollectiveTimeoutError as err:
        print(f"rank {rank}: error: {err}", file=sys.stderr, flush=True)
        return 1
    d_forward = _max_diff(y_sp, y_ref[:, sl])
    d_grad = _max_diff(x_sp.grad, x_ref.grad[:, sl])
    if args.tp == 1:  # every weight is replicated: its gradient is the whole layer's
        full = dict(attn.named_parameters())
        d_grad = max([d_grad] + [_max_diff(p.grad, full[n.removeprefix("layer.")].grad)
                                 for n, p in sp.named_parameters()])
    worst = torch.tensor([max(d_forward, d_grad)], dtype=torch.float64, device=device)
    for r in range(world):
        if r == rank:
            print(f"rank {rank}/{world}: tokens [{sl.start}, {sl.stop}) of {s}, heads {list(sp.heads)}; max "
                  f"difference: forward {d_forward:.3g}, gradients {d_grad:.3g}", flush=True)
        dist.barrier()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max difference from the single-process result ({args.dtype}, all ranks): {worst.item():.3g}",
              flush=True)
    return 0


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; 0 for empty tensors (a rank holds no token when S < P)."""
    return (a - b).abs().max().item() if a.numel() else 0.0


def _bounds(s: int, p: int, r: int) -> tuple[int, int]:
    """[start, stop) of rank r's slice, as torch.tensor_split cuts: the first s % p ranks take one more."""
    size, extra = divmod(s, p)
    start = r * size + min(r, extra)
    return start, start + size + (1 if r < extra else 0)


if __name__ == "__main__":
    sys.exit(main())
