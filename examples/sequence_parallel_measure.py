"""Measure sequence parallelism per rank: all-to-all bytes and peak memory of the attention step vs s/P.

    python -m examples.sequence_parallel_measure                      # P = 1, 2, 4 at 512 tokens per rank
    python -m examples.sequence_parallel_measure --ranks 2 4 --tokens-per-rank 256 1024 --n-kv-heads 2

For every (P, tokens per rank) it spawns P CPU processes (gloo), builds the same float32 layer on each, and
runs one forward and backward of :func:`headwise.parallel.sequence_parallel` on the rank's slice. Per rank
it records

* the bytes handed to ``torch.distributed.all_to_all_single`` that go to *other* ranks, counted by wrapping
  that function, forward and backward, next to the closed form
  (:meth:`~headwise.parallel.sequence_plan.SequenceParallelPlan.all_to_all_bytes`);
* the peak of the bytes held by live tensor storages during the step, above what was live before it
  (weights and the input slice): every storage an operator creates is tracked through a weak reference
  to the storage itself, so autograd's saved tensors count until they are freed;
* the same peak for one process running the unsharded layer on the whole sequence (P = 1 row).

It prints a Markdown table (the one in docs/parallel.md). This is an example script, so it prints.

Shapes:
    x: (b, S, d) with S = P * tokens per rank; rank r holds (b, S / P, d).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from headwise import MultiHeadAttention


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created while active (each storage counted once, freed when its
    last reference, Python or C++, goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _layer(args: argparse.Namespace) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(args.d_model, args.n_heads, args.n_kv_heads)


def _rank(rank: int, world: int, port: int, tokens: int, args: argparse.Namespace, out_dir: str) -> None:
    from headwise.parallel import sequence_parallel

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        attn = _layer(args)
        sp = sequence_parallel(attn)
        del attn
        x = torch.randn(args.batch, tokens, args.d_model, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)
        sent: list[int] = []
        real = dist.all_to_all_single

        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            splits = input_split_sizes or [input.shape[0] // world] * world
            sent.append(sum(n for j, n in enumerate(splits) if j != rank) * row)
            return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        sp(x, causal=True).sum().backward()  # warm-up: lazy initialisations stay out of the numbers
        sp.zero_grad(set_to_none=True)
        x.grad = None
        dist.all_to_all_single = counting
        try:
            with LiveBytes() as mem:
                y = sp(x, causal=True)
                n_fwd = len(sent)
                y.sum().backward()
                del y
        finally:
            dist.all_to_all_single = real
        closed = sp.plan.all_to_all_bytes(batch=args.batch, s_q=tokens, d_head=sp.layer.d_head, itemsize=4,
                                          sp_rank=rank)
        torch.save({"forward": sum(sent[:n_fwd]), "backward": sum(sent[n_fwd:]), "closed": closed,
                    "peak": mem.peak}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _one_process_peak(args: argparse.Namespace, s: int) -> int:
    attn = _layer(args)
    x = torch.randn(args.batch, s, args.d_model, requires_grad=True)
    attn(x, causal=True).sum().backward()
    attn.zero_grad(set_to_none=True)
    x.grad = None
    with LiveBytes() as mem:
        y = attn(x, causal=True)
        y.sum().backward()
        del y
    return mem.peak


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.sequence_parallel_measure",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[512])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    mib = 2 ** 20
    print(f"d_model={args.d_model}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}, batch {args.batch}, "
          f"float32, causal, SDPA; one forward + backward; per rank (the largest over ranks)\n")
    print("| P | S | S/P | sent fwd (counted) | sent bwd (counted) | closed form | peak, SP rank | peak, 1 process on S |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens in args.tokens_per_rank:
        for world in args.ranks:
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_rank, args=(world, _free_port(), tokens, args, tmp), nprocs=world,
                                   start_method="spawn")
                res = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
            s = world * tokens
            one = _one_process_peak(args, s)
            fwd, bwd = max(r["forward"] for r in res), max(r["backward"] for r in res)
            closed = max(r["closed"]["forward"] for r in res)
            peak = max(r["peak"] for r in res)
            print(f"| {world} | {s} | {tokens} | {fwd / mib:.2f} MiB | {bwd / mib:.2f} MiB | {closed / mib:.2f} MiB "
                  f"| {peak / mib:.1f} MiB | {one / mib:.1f} MiB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
