"""What each spawned rank runs for tests/parallel/test_sequence_parallel.py, and the shared builders.

One process group per world size runs every scenario; each rank saves its raw results (its output slice,
its input-gradient slices, its parameter gradients, bytes counted around ``all_to_all_single``, error
messages) to ``rank{r}.pt``. The test process rebuilds the same layers and global inputs from the same seeds,
runs the single-process layer on the whole sequence, and does all the comparing.
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import time

import torch

from headwise import MultiHeadAttention, RotaryEmbedding
from headwise.masks import padding_mask, sliding_window_mask

from tests.parallel._tp_worker import grad_storage
from tests.parallel.spawn import rank_session

DTYPE = torch.float64
B = 2

# Phases: which global inputs the call gets. Every phase runs forward and backward.
CAUSAL = dict(name="causal", causal=True)
PADDING = dict(name="padding", causal=True, mask="padding")
WINDOW = dict(name="window", mask="window")
HEAD_BIAS = dict(name="head_bias", mask="head_bias")
PER_HEAD = dict(name="per_head", mask="per_head")
POSITIONS = dict(name="positions", causal=True, positions=True)
CROSS = dict(name="cross", cross=True, mask="kv_padding")
CROSS_CAUSAL = dict(name="cross_causal", cross=True, causal=True)
KEY_VALUE = dict(name="key_value", key_value=True, mask="kv_padding")

SCENARIOS: dict[int, list[dict]] = {
    2: [
        dict(name="mha_uneven", d_model=16, n_heads=4, n_kv_heads=4, s=7, phases=[CAUSAL, PADDING, HEAD_BIAS]),
        dict(name="gqa", d_model=32, n_heads=8, n_kv_heads=2, s=8, phases=[CAUSAL, PADDING, WINDOW, PER_HEAD]),
        dict(name="mqa_rotary", d_model=16, n_heads=4, n_kv_heads=1, s=9, rotary=True, phases=[CAUSAL, POSITIONS]),
        dict(name="gqa_ungrouped", d_model=24, n_heads=6, n_kv_heads=3, s=6, phases=[CAUSAL, PADDING]),
        dict(name="cross", d_model=16, n_heads=4, n_kv_heads=2, s=6, s_kv=5, bias=False,
             phases=[CROSS, CROSS_CAUSAL]),
        dict(name="key_value", d_model=16, n_heads=4, n_kv_heads=2, s=5, s_kv=7, kdim=12, vdim=20,
             phases=[KEY_VALUE]),
        dict(name="no_reduction", d_model=16, n_heads=4, n_kv_heads=2, s=6, grad_reduction="none",
             phases=[CAUSAL, HEAD_BIAS]),
    ],
    4: [
        dict(name="mha_uneven", d_model=16, n_heads=4, n_kv_heads=4, s=10, phases=[CAUSAL, PADDING]),
        dict(name="gqa_kv_lt_p", d_model=32, n_heads=8, n_kv_heads=2, s=8, phases=[CAUSAL, PADDING, WINDOW, PER_HEAD]),
        dict(name="mqa_rotary", d_model=32, n_heads=8, n_kv_heads=1, s=11, rotary=True, phases=[CAUSAL, POSITIONS]),
        dict(name="uneven_heads", d_model=24, n_heads=6, n_kv_heads=2, s=9, phases=[CAUSAL, HEAD_BIAS]),
        dict(name="cross", d_model=16, n_heads=4, n_kv_heads=4, s=7, s_kv=9, phases=[CROSS, CROSS_CAUSAL]),
        dict(name="mesh_sp2_tp2", d_model=32, n_heads=8, n_kv_heads=2, s=7, rotary=True, mesh=True,
             phases=[CAUSAL, PADDING, PER_HEAD, HEAD_BIAS]),
        dict(name="mesh_sp2_tp2_mqa", d_model=16, n_heads=4, n_kv_heads=1, s=6, mesh=True, phases=[CAUSAL]),
        dict(name="fewer_tokens_than_ranks", d_model=16, n_heads=4, n_kv_heads=2, s=3, rotary=True,
             phases=[CAUSAL, WINDOW]),
    ],
}
# Per-head Q/K norms (QKNormAttention, from the Hugging Face interop) on the (sp, tp) mesh: the tp shards keep
# them, and their gradients are summed over both dimensions.
if importlib.util.find_spec("transformers") is not None:
    SCENARIOS[4].append(dict(name="mesh_qk_norm", d_model=16, n_heads=4, n_kv_heads=2, s=6, rotary=True,
                             mesh=True, qk_norm=True, phases=[CAUSAL]))
# Bytes of the all-to-alls at a fixed local length, the same on 2 and 4 ranks.
BYTES = dict(name="bytes_mha", d_model=32, n_heads=8, n_kv_heads=8, s_local=4)
BYTES_MQA = dict(name="bytes_mqa", d_model=32, n_heads=8, n_kv_heads=1, s_local=4)
# On 4 ranks the ranks attend with 2, 2, 1, 1 query heads and K/V heads [0], [0, 1], [1], [1]: each rank sends
# back in the backward what it received, not what it sent.
BYTES_UNEVEN = dict(name="bytes_uneven", d_model=24, n_heads=6, n_kv_heads=2, s_local=4)
# Peak live tensor bytes of one forward and backward at a fixed local length, on 2 and 4 ranks.
PEAK = dict(name="peak_mha", d_model=64, n_heads=4, n_kv_heads=4, s_local=256)


def peak_bytes(module, x: torch.Tensor) -> int:
    """Peak bytes of live tensor storages created during one forward and backward (after a warm-up)."""
    from examples.sequence_parallel_measure import LiveBytes

    module(x, causal=True).sum().backward()
    module.zero_grad(set_to_none=True)
    x.grad = None
    with LiveBytes() as mem:
        y = module(x, causal=True)
        y.sum().backward()
        del y
    return mem.peak


def build(spec: dict) -> tuple[MultiHeadAttention, dict]:
    """The float64 layer and the global inputs of one scenario, identical in every process."""
    seed = sum(map(ord, spec["name"])) + 1000 * spec["n_heads"] + spec["n_kv_heads"]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    d, h = spec["d_model"], spec["n_heads"]
    rotary = RotaryEmbedding(d // h) if spec.get("rotary") else None
    kind, extra = MultiHeadAttention, {}
    if spec.get("qk_norm"):
        from headwise.interop.hf.qk_norm import QKNormAttention

        kind, extra = QKNormAttention, {"q_norm": torch.nn.RMSNorm(d // h, dtype=DTYPE),
                                        "k_norm": torch.nn.RMSNorm(d // h, dtype=DTYPE)}
    attn = kind(d, h, spec["n_kv_heads"], bias=spec.get("bias", True), rotary=rotary, dtype=DTYPE,
                kdim=spec.get("kdim"), vdim=spec.get("vdim"), **extra)
    with torch.no_grad():  # biases away from their init so that the bias handling is visible
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DTYPE) * 0.3)
    s, s_kv = spec["s"], spec.get("s_kv", spec["s"])
    head_mask = torch.rand(B, h, s, s, generator=g) > 0.4
    head_mask[..., 0] = True
    inp = {
        "x": torch.randn(B, s, d, generator=g, dtype=DTYPE),
        "grad_y": torch.randn(B, s, d, generator=g, dtype=DTYPE),
        "padding": padding_mask(lengths=[s - 3, s], s_kv=s),
        "window": sliding_window_mask(s, window=3),
        "head_bias": torch.randn(h, s, s, generator=g, dtype=DTYPE),
        "per_head": head_mask,
        "positions": torch.stack([torch.arange(s) + 5, torch.arange(s) * 2]),  # (b, s): per sample
    }
    if spec.get("s_kv"):
        inp["context"] = torch.randn(B, s_kv, d, generator=g, dtype=DTYPE)
        inp["key"] = torch.randn(B, s_kv, spec.get("kdim", d), generator=g, dtype=DTYPE)
        inp["value"] = torch.randn(B, s_kv, spec.get("vdim", d), generator=g, dtype=DTYPE)
        inp["kv_padding"] = padding_mask(lengths=[s_kv - 2, s_kv], s_kv=s_kv)
    return attn, inp


def call_kwargs(phase: dict, inp: dict) -> dict:
    """The keyword arguments of one phase's call; a float mask is a fresh leaf that requires grad (a learnable
    score bias), so that its gradient is checked too."""
    kw: dict = {"causal": phase.get("causal", False)}
    if phase.get("mask"):
        mask = inp[phase["mask"]]
        kw["mask"] = mask.clone().requires_grad_() if mask.is_floating_point() else mask
    if phase.get("positions"):
        kw["positions"] = inp["positions"]
    return kw


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("layer."): p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _run_scenario(spec: dict, world: int, rank: int, mesh2d) -> dict:
    from headwise.parallel import sequence_parallel

    attn, inp = build(spec)
    where = mesh2d if spec.get("mesh") else None
    sp = sequence_parallel(attn, where, grad_reduction=spec.get("grad_reduction", "sum"))
    sp_rank, sp_size = sp.rank, sp.world_size
    out: dict = {"describe": sp.plan.describe(), "heads": sp.heads, "sp_rank": sp_rank, "sp_size": sp_size,
                 "tp_rank": sp.tp_rank, "repr": repr(sp)}
    for phase in spec["phases"]:
        x = torch.tensor_split(inp["x"], sp_size, dim=1)[sp_rank].clone().requires_grad_()
        args, kv = (), {}
        if phase.get("cross"):
            c = torch.tensor_split(inp["context"], sp_size, dim=1)[sp_rank].clone().requires_grad_()
            args = (c,)
        if phase.get("key_value"):
            kv = {n: torch.tensor_split(inp[n], sp_size, dim=1)[sp_rank].clone().requires_grad_()
                  for n in ("key", "value")}
        kw = call_kwargs(phase, inp)
        shapes: list = []
        if phase is CAUSAL:  # the heads the layer attends with, for the memory closed form
            real = sp.layer.attend

            def attend(q, k, v, **options):
                shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
                return real(q, k, v, **options)

            sp.layer.attend = attend
        y = sp(x, *args, **kv, **kw)
        sp.layer.__dict__.pop("attend", None)
        grad_y = torch.tensor_split(inp["grad_y"], sp_size, dim=1)[sp_rank]
        (y * grad_y).sum().backward()
        res = {"y": y.detach(), "x_grad": x.grad, "grads": _grads(sp), "grad_storage": grad_storage(sp),
               "mask_grad": kw["mask"].grad if "mask" in kw else None, "attend_shapes": shapes}
        if args:
            res["context_grad"] = args[0].grad
        res |= {f"{n}_grad": t.grad for n, t in kv.items()}
        out[phase["name"]] = res
        sp.zero_grad(set_to_none=True)
    return out


def _count_bytes(spec: dict, world: int, rank: int) -> dict:
    """Bytes handed to all_to_all_single (to other ranks, and in all), forward and backward, one layer."""
    import torch.distributed as dist

    from headwise.parallel import sequence_parallel

    spec = dict(spec, s=spec["s_local"] * world)
    attn, inp = build(spec)
    sp = sequence_parallel(attn)
    log: list[tuple[int, int]] = []
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        splits = input_split_sizes or [input.shape[0] // world] * world
        me = dist.get_rank(group)
        log.append((sum(n for j, n in enumerate(splits) if j != me) * row, input.numel() * input.element_size()))
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        x = torch.tensor_split(inp["x"], world, dim=1)[rank].clone().requires_grad_()
        y = sp(x, causal=True)
        n_forward = len(log)
        y.sum().backward()
    finally:
        dist.all_to_all_single = real
    fwd, bwd = log[:n_forward], log[n_forward:]
    return {"calls": (len(fwd), len(bwd)), "forward_sent": sum(a for a, _ in fwd),
            "backward_sent": sum(a for a, _ in bwd), "forward_buffer": sum(b for _, b in fwd),
            "plan_bytes": sp.plan.all_to_all_bytes(batch=B, s_q=spec["s_local"], d_head=attn.d_head,
                                                   itemsize=8, sp_rank=rank)}


def sequence_parallel_of(attn: MultiHeadAttention):
    from headwise.parallel import sequence_parallel

    return sequence_parallel(attn)


def _refusals(world: int, rank: int) -> dict:
    """A wrong layout on rank 0 alone, and calls that disagree across ranks."""
    import torch.distributed as dist

    from headwise.parallel import sequence_parallel

    out: dict = {}
    if rank == 0:  # alone: had it entered a collective, the barrier below would time out
        try:
            sequence_parallel(MultiHeadAttention(8, 2, 1, dtype=DTYPE) if world == 4 else
                              MultiHeadAttention(8, 1, dtype=DTYPE))
        except ValueError as err:
            out["invalid"] = str(err)
    dist.barrier()
    sp = sequence_parallel(MultiHeadAttention(16, 4, dtype=DTYPE))
    x = torch.randn(1 if rank == 0 else 2, 3, 16, dtype=DTYPE)  # rank 0 has another batch size
    try:
        sp(x)
    except ValueError as err:
        out["mismatch"] = str(err)
    return out


# Parameters made trainable, or replaced, after sequence_parallel() built the layer.
LATE = dict(name="late_trainable", d_model=16, n_heads=4, n_kv_heads=2, s=7, phases=[CAUSAL])


def _late_trainable(world: int, rank: int) -> dict:
    """Parameter gradients after a layer built frozen and unfrozen later, and after weights loaded with
    ``load_state_dict(assign=True)`` (new Parameter objects)."""
    from headwise.parallel import sequence_parallel

    attn, inp = build(LATE)
    x = torch.tensor_split(inp["x"], world, dim=1)[rank]
    grad_y = torch.tensor_split(inp["grad_y"], world, dim=1)[rank]
    frozen = copy.deepcopy(attn).requires_grad_(False)
    unfrozen = sequence_parallel(frozen)
    unfrozen.layer.requires_grad_(True)
    loaded = sequence_parallel(MultiHeadAttention(LATE["d_model"], LATE["n_heads"], LATE["n_kv_heads"], dtype=DTYPE))
    loaded.layer.load_state_dict({n: t.clone() for n, t in attn.state_dict().items()}, assign=True)
    out = {}
    for name, sp in (("unfrozen", unfrozen), ("assigned", loaded)):
        (sp(x, causal=True) * grad_y).sum().backward()
        out[name] = _grads(sp)
    return out


# The replicated-gradient sum on its own: (n_slots, slot of rank 0, slot of rank 1) per case, on 2 ranks.
REPLICA_SUMS = [(1, 0, 0), (3, 1, 1), (2, 0, 1)]
REPLICA_SHAPES = [(64, 32), (32,), (16, 32)]


def replica_upstream(rank: int) -> list[torch.Tensor]:
    """The gradient that reaches each replicated tensor on ``rank`` (rebuilt by the test from the same seed)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=g, dtype=DTYPE) for shape in REPLICA_SHAPES]


def _replica_sums(rank: int) -> dict:
    """Gradients, the storage behind them, and the peak live bytes of the backward through SumOverReplicas."""
    import torch.distributed as dist

    from examples.sequence_parallel_measure import LiveBytes
    from headwise.parallel.autograd import SumOverReplicas

    out = {}
    for n_slots, *slots in REPLICA_SUMS:
        params = [torch.zeros(shape, dtype=DTYPE, requires_grad=True) for shape in REPLICA_SHAPES]
        upstream = replica_upstream(rank)
        views = SumOverReplicas.apply(dist.group.WORLD, n_slots, slots[rank], *params)
        loss = sum((v * u).sum() for v, u in zip(views, upstream))
        with LiveBytes() as mem:
            loss.backward()
        storage = [(p.grad.untyped_storage().nbytes(), p.grad.numel() * p.grad.element_size()) for p in params]
        out[(n_slots, *slots)] = {"grads": [p.grad.clone() for p in params], "peak": mem.peak, "storage": storage}
        # a bfloat16 weight beside a float32 bias: each gradient summed in (at least) its own precision
        weight = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
        bias = torch.zeros(8, dtype=torch.float32, requires_grad=True)
        w, b = SumOverReplicas.apply(dist.group.WORLD, n_slots, slots[rank], weight, bias)
        (w.float().sum() + (b * MIXED_BIAS_GRAD).sum()).backward()
        out[(n_slots, *slots)]["mixed"] = (weight.grad.clone(), bias.grad.clone())
    return out


MIXED_BIAS_GRAD = 1 + 1e-3  # not a bfloat16 number: rounding the bias's sum to bfloat16 would show


def _timeout(rank: int) -> dict:
    """Rank 1 never joins rank 0's call on a group with a 2 s timeout: rank 0 gets a clear error."""
    import torch.distributed as dist

    from headwise.parallel import CollectiveTimeoutError, sequence_parallel

    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    sp = sequence_parallel(MultiHeadAttention(16, 4, dtype=DTYPE), short)
    out: dict = {}
    if rank == 0:
        start = time.monotonic()
        try:
            sp(torch.randn(2, 3, 16, dtype=DTYPE))
        except CollectiveTimeoutError as err:
            out["timeout"] = str(err)
        out["timeout_s"] = time.monotonic() - start
    dist.barrier()
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of one spawned rank (torch.multiprocessing.spawn passes ``rank`` first)."""

    def cases(results: dict) -> None:
        mesh2d = None
        if world == 4:
            from torch.distributed.device_mesh import init_device_mesh

            mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))
        for spec in SCENARIOS[world]:
            results[spec["name"]] = _run_scenario(spec, world, rank, mesh2d)
        for spec in (BYTES, BYTES_MQA, BYTES_UNEVEN):
            results[spec["name"]] = _count_bytes(spec, world, rank)
        attn, inp = build(dict(PEAK, s=PEAK["s_local"] * world))
        x = torch.tensor_split(inp["x"], world, dim=1)[rank].clone().requires_grad_()
        results["peak"] = peak_bytes(sequence_parallel_of(attn), x)
        results["refusals"] = _refusals(world, rank)
        if world == 2:
            results["timeout"] = _timeout(rank)
            results["late_trainable"] = _late_trainable(world, rank)
            results["replica_sums"] = _replica_sums(rank)

    rank_session(rank, world, port, out_dir, 30, cases)
