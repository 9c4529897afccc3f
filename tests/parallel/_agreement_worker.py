"""What each spawned rank runs for tests/parallel/test_rank_agreement.py: calls that one rank alone refuses,
or that differ by rank, each followed by a good call on every rank, under sequence and tensor parallelism.

Each rank saves, per case, the error it got (type and message, or its output if it got none), its layer's
state after the refused call, and the result of the good call that follows. The test process rebuilds the
same layers and inputs from the same seeds and does all the comparing. The cases run on a group with a short
timeout, so that ranks that fall out of step (as they would if one refused alone) fail fast instead of
hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import torch

from headwise import MultiHeadAttention

from tests.parallel.spawn import rank_session

DTYPE = torch.float64
B, S, D, H, H_KV = 2, 6, 16, 4, 2
TIMEOUT_S = 10


def build(name: str) -> tuple[MultiHeadAttention, dict[str, torch.Tensor]]:
    """The float64 layer and the inputs of one case, identical in every process."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    attn = MultiHeadAttention(D, H, H_KV, dtype=DTYPE)
    with torch.no_grad():  # biases away from their init so that the bias handling is visible
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DTYPE) * 0.3)
    inp = {"x_refused": torch.randn(B, S, D, generator=g, dtype=DTYPE),
           "x_good": torch.randn(B, S, D, generator=g, dtype=DTYPE),
           "window": torch.rand(S, S, generator=g) > 0.3}
    return attn, inp


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("layer."): t.detach().clone() for n, t in module.state_dict().items()}


def _attempt(call) -> dict:
    try:
        y = call()
    except Exception as err:  # noqa: BLE001 - recorded for the test process, which decides
        return {"error": (type(err).__name__, str(err))}
    return {"error": None, "y": y.detach()}


# Sequence parallel: (case name, what rank 1 passes instead of rank 0's call). Rank 0's call is always
# sp(x_slice, mask=window, causal=True).
SP_CASES = ["bad_width", "bad_mask_heads", "mask_shape_differs", "causal_differs", "not_a_tensor",
            "unknown_option", "trainable_differs", "grad_reduction_differs", "traced"]


def _sp_refused_call(case: str, rank: int, x: torch.Tensor, window: torch.Tensor) -> tuple[tuple, dict]:
    args, kw = (x,), {"mask": window, "causal": True}
    if rank == 0:
        return args, kw
    if case == "bad_width":  # refused by rank 1's own checks, before any exchange
        args = (torch.randn(*x.shape[:-1], D // 2, dtype=DTYPE),)
    elif case == "bad_mask_heads":  # a head axis of 3 for a 4-head layer: rank 1's own checks
        kw["mask"] = torch.ones(B, 3, S, S, dtype=torch.bool)
    elif case == "mask_shape_differs":  # valid on its own, but not the mask rank 0 passes
        kw["mask"] = torch.ones(B, 1, 1, S, dtype=torch.bool)
    elif case == "causal_differs":
        kw["causal"] = False
    elif case == "not_a_tensor":
        args = (x.tolist(),)
    elif case == "unknown_option":  # refused by Python's own argument binding, had nothing caught it
        kw["casual"] = kw.pop("causal")
    return args, kw


def _short_group():
    """A fresh group per case: ranks thrown out of step in one case do not carry it into the next."""
    import torch.distributed as dist

    dist.barrier()  # on the default group, which no case uses: a rank stuck in the last case is waited for
    return dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))


def sp_cases(rank: int, world: int) -> dict:
    import headwise
    from headwise.parallel import sequence_parallel

    out: dict = {}
    for case in SP_CASES:
        attn, inp = build(f"sp_{case}")
        sp = sequence_parallel(attn, _short_group())
        mine = lambda t: torch.tensor_split(t, world, dim=1)[rank]  # noqa: E731
        args, kw = _sp_refused_call(case, rank, mine(inp["x_refused"]), inp["window"])
        frozen = case == "trainable_differs" and rank == 1  # the gradient all-reduces would not pair up
        sp.layer.q_proj.weight.requires_grad_(not frozen)
        if case == "grad_reduction_differs" and rank == 1:  # its backward would not all-reduce what rank 0's does
            sp.grad_reduction = "none"
        # Rank 1 alone traces: its heads are not the layer's first ones, which the trace would take them for.
        traced = headwise.trace(sp, capture=("z",)) if case == "traced" and rank == 1 else contextlib.nullcontext()
        start = time.monotonic()
        with traced:
            res = _attempt(lambda: sp(*args, **kw))
        res["seconds"] = time.monotonic() - start
        sp.layer.q_proj.weight.requires_grad_(True)
        sp.grad_reduction = "sum"
        res["state"] = _state(sp)
        res["grads"] = [n for n, p in sp.named_parameters() if p.grad is not None]
        res["good"] = _attempt(lambda: sp(mine(inp["x_good"]), mask=inp["window"], causal=True))
        out[case] = res
    return out


# Tensor parallel: every rank's input is the whole input, so rank 1 passes another one. Rank 0's call is
# always tp(x, causal=True); "decode_differs" first prefills a cache on both ranks, then decodes one token
# on rank 0 and two on rank 1; "cache_differs" crops rank 1's cache by one position before the step (then
# rank 0's too, for the good step). "size_differs" is last: it aborted a rank when nothing checked it.
TP_CASES = ["shape_differs", "causal_differs", "bad_width", "unknown_option", "decode_differs", "cache_differs",
            "trainable_differs", "hooks_differ", "size_differs"]


def _tp_refused_call(case: str, rank: int, x: torch.Tensor) -> tuple[tuple, dict]:
    args, kw = (x,), {"causal": True}
    if rank == 0:
        return args, kw
    if case == "shape_differs":  # as many numbers, another shape: the all-reduce alone would not notice
        args = (x.reshape(3, B * S // 3, D),)
    elif case == "causal_differs":
        kw["causal"] = False
    elif case == "bad_width":  # refused by rank 1's own checks
        args = (x[..., :D // 2],)
    elif case == "unknown_option":
        kw = {"casual": True}
    elif case == "size_differs":
        args = (torch.cat([x, x[:, :1]], dim=1),)
    return args, kw


def _snapshot(module: torch.nn.Module, cache) -> dict:
    out = {"state": _state(module), "grads": [n for n, p in module.named_parameters() if p.grad is not None]}
    if cache is not None:
        out |= {"cache_length": cache.length, "keys": cache.keys.clone(), "values": cache.values.clone()}
    return out


def tp_cases(rank: int, world: int) -> dict:
    from headwise.parallel import tensor_parallel

    out: dict = {}
    for case in TP_CASES:
        attn, inp = build(f"tp_{case}")
        tp = tensor_parallel(attn, _short_group())
        cache = None
        x, x_good = inp["x_refused"], inp["x_good"]
        res: dict = {}
        if case in ("decode_differs", "cache_differs"):
            cache = tp.new_cache(B, S + 2)
            with torch.no_grad():
                res["prefill"] = _attempt(lambda: tp(x_good[:, :S - 1], cache=cache))
            step = x_good[:, S - 1:] if rank == 0 or case == "cache_differs" else x[:, :2]
            if case == "cache_differs" and rank == 1:
                cache.crop(S - 2)
            before = _snapshot(tp, cache)
            with torch.no_grad():
                res |= _attempt(lambda: tp(step, cache=cache))
            res |= {"before": before, "after": _snapshot(tp, cache)}
            if case == "cache_differs" and rank == 0:
                cache.crop(S - 2)
            with torch.no_grad():
                res["good"] = _attempt(lambda: tp(x_good[:, S - 1:], cache=cache))
        else:
            args, kw = _tp_refused_call(case, rank, x)
            # Rank 1 freezes K/V while rank 0 trains them: had the split replicated K/V heads, only rank 0
            # would enter the backward's sum over replicas; the call check refuses it whatever the split.
            frozen = case == "trainable_differs" and rank == 1
            tp.k_proj.requires_grad_(not frozen)
            tp.v_proj.requires_grad_(not frozen)
            # A hook on rank 0's q_proj keeps its no-grad call in one pass, while rank 1 runs its queries in
            # chunks of 2 (an all-reduce each); the good call below (with grad: never chunked) keeps the hook.
            hooked = case == "hooks_differ"
            if hooked:
                tp.chunk_queries = 2
                if rank == 0:
                    tp.q_proj.register_forward_hook(lambda module, args, output: None)
            before = _snapshot(tp, None)
            with torch.no_grad() if hooked else contextlib.nullcontext():
                res |= _attempt(lambda: tp(*args, **kw))
            res |= {"before": before, "after": _snapshot(tp, None)}
            tp.requires_grad_(True)
            res["good"] = _attempt(lambda: tp(x_good, causal=True))
        out[case] = res
    return out


def tp_exchanges(rank: int, world: int) -> dict:
    """How many all-gathers a forward makes with check_inputs on and off, and its outputs both ways."""
    import torch.distributed as dist

    from headwise.parallel import tensor_parallel

    attn, inp = build("tp_exchanges")
    tp = tensor_parallel(attn, _short_group(), check_inputs=False)
    real, calls = dist.all_gather, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    out: dict = {}
    dist.all_gather = counting
    try:
        for on in (False, True):
            tp.check_inputs = on
            calls.clear()
            y = tp(inp["x_good"], causal=True)
            out[on] = {"all_gathers": len(calls), "y": y.detach()}
    finally:
        dist.all_gather = real
    return out


# Sequence parallel on a 2 x 2 ("sp", "tp") mesh: rank r is (sp r // 2, tp r % 2). "bad_width": rank 3 alone
# passes a slice of the wrong width; "slices_differ": rank 1 (the tp partner of rank 0) passes a shorter
# slice than rank 0, with the rest of the sequence on rank 3.
MESH_CASES = ["bad_width", "slices_differ"]


def mesh_cases(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from headwise.parallel import sequence_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))
    out: dict = {}
    for case in MESH_CASES:
        attn, inp = build(f"mesh_{case}")
        sp = sequence_parallel(attn, mesh)
        mine = torch.tensor_split(inp["x_refused"], 2, dim=1)[sp.rank]
        if case == "bad_width" and rank == 3:
            mine = mine[..., :D // 2]
        elif case == "slices_differ" and rank in (1, 3):  # a sequence of S, cut elsewhere than by ranks 0, 2
            mine = inp["x_refused"][:, :S // 2 - 1] if rank == 1 else inp["x_refused"][:, S // 2 - 1:]
        before = _snapshot(sp, None)
        res = _attempt(lambda: sp(mine, mask=inp["window"], causal=True))
        res |= {"before": before, "after": _snapshot(sp, None), "sp_rank": sp.rank, "tp_rank": sp.tp_rank}
        half = torch.tensor_split(inp["x_good"], 2, dim=1)[sp.rank]
        res["good"] = _attempt(lambda: sp(half, mask=inp["window"], causal=True))
        out[case] = res
    return out


def run_mesh_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of one of the 4 ranks of the mesh cases."""

    def cases(results: dict) -> None:
        results["mesh"] = mesh_cases(rank)

    rank_session(rank, world, port, out_dir, 2 * TIMEOUT_S, cases)


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of one spawned rank (torch.multiprocessing.spawn passes ``rank`` first)."""

    def cases(results: dict) -> None:
        results["sp"] = sp_cases(rank, world)
        results["tp_exchanges"] = tp_exchanges(rank, world)
        results["tp"] = tp_cases(rank, world)

    rank_session(rank, world, port, out_dir, 60, cases)
