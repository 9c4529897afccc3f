"""What each spawned rank runs for tests/parallel/test_tensor_parallel.py, and the shared layer builders.

One process group per world size runs every scenario; each rank saves its raw results (outputs, local
gradients, cache sizes, head-view results, error messages) to ``rank{r}.pt``. The test process rebuilds the
same unsharded layers and inputs from the same seeds and does all the comparing.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from headwise import MultiHeadAttention, RotaryEmbedding
from headwise.masks import padding_mask

from tests.parallel.spawn import rank_session

DTYPE = torch.float64
B, S, S_KV, PREFILL, DECODE = 2, 6, 5, 5, 3

# world size -> scenarios; every rank runs the same list, in order.
SCENARIOS: dict[int, list[dict]] = {
    2: [
        dict(name="mha", d_model=32, n_heads=4, n_kv_heads=4, cross=True),
        dict(name="gqa", d_model=32, n_heads=8, n_kv_heads=2, per_head_mask=True),
        dict(name="mqa_rotary", d_model=32, n_heads=4, n_kv_heads=1, rotary=True, head_bias=True),
        dict(name="gqa_mesh_nobias", d_model=24, n_heads=4, n_kv_heads=2, bias=False, mesh=True),
        # headwise.surgery.prune_heads of a 6-head, 3-K/V-head layer (heads 0, 1: a whole group) -> 4 heads, 2 K/V
        dict(name="pruned_gqa", d_model=24, n_heads=4, n_kv_heads=2, d_head=4, rotary=True, pruned_from=(6, 3, [0, 1])),
    ],
    4: [
        dict(name="mha", d_model=32, n_heads=4, n_kv_heads=4, cross=True),
        dict(name="gqa_replicated", d_model=32, n_heads=8, n_kv_heads=2, per_head_mask=True),
        dict(name="mqa_rotary", d_model=32, n_heads=8, n_kv_heads=1, rotary=True, head_bias=True),
        dict(name="gqa_partitioned", d_model=48, n_heads=8, n_kv_heads=4, d_head=4),
    ],
}
# Per-head Q/K norms (the QKNormAttention of Qwen3 / Gemma 3, from the Hugging Face interop): K/V heads
# partitioned on 2 ranks, replicated on 4.
if importlib.util.find_spec("transformers") is not None:
    SCENARIOS[2].append(dict(name="qk_norm_gqa", d_model=32, n_heads=4, n_kv_heads=2, qk_norm=True, rotary=True))
    SCENARIOS[4].append(dict(name="qk_norm_mqa", d_model=32, n_heads=4, n_kv_heads=1, qk_norm=True))
# A layer that cannot be split over 4 ranks (6 % 4 != 0); only rank 0 tries.
INVALID = dict(d_model=24, n_heads=6, n_kv_heads=2)


def build(spec: dict) -> tuple[MultiHeadAttention, dict]:
    """The unsharded float64 layer and the inputs of one scenario, identical in every process."""
    seed = sum(map(ord, spec["name"])) + 1000 * spec["n_heads"] + spec["n_kv_heads"]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    d_head = spec.get("d_head") or spec["d_model"] // spec["n_heads"]
    rotary = RotaryEmbedding(d_head) if spec.get("rotary") else None
    h0, h_kv0, drop = spec.get("pruned_from", (spec["n_heads"], spec["n_kv_heads"], None))
    kind, extra = MultiHeadAttention, {}
    if spec.get("qk_norm"):
        from headwise.interop.hf.qk_norm import QKNormAttention

        kind, extra = QKNormAttention, {"q_norm": torch.nn.RMSNorm(d_head, dtype=DTYPE),
                                        "k_norm": torch.nn.RMSNorm(d_head, dtype=DTYPE)}
    attn = kind(spec["d_model"], h0, h_kv0, d_head=spec.get("d_head"), bias=spec.get("bias", True), rotary=rotary,
                dtype=DTYPE, **extra)
    with torch.no_grad():  # biases away from their init so that the bias handling is visible
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DTYPE) * 0.3)
    if drop is not None:
        from headwise.surgery import prune_heads

        attn = prune_heads(attn, drop)
    d, h = spec["d_model"], spec["n_heads"]
    x = torch.randn(B, S, d, generator=g, dtype=DTYPE)
    inputs = {
        "x": x,
        "grad_y": torch.randn(B, S, d, generator=g, dtype=DTYPE),
        "x_pad": torch.randn(B, S, d, generator=g, dtype=DTYPE),
        "pad_mask": padding_mask(lengths=[S - 2, S], s_kv=S),
        "x_dec": torch.randn(B, PREFILL + DECODE, d, generator=g, dtype=DTYPE),
    }
    if spec.get("per_head_mask"):
        m = torch.rand(B, h, S, S, generator=g) > 0.3
        m[..., 0] = True  # every query may see at least the first key
        inputs["pad_mask"] = inputs["pad_mask"] & m
    if spec.get("head_bias"):  # a float per-head score bias (h, s_q, s_kv), ALiBi-like, instead of padding
        inputs["pad_mask"] = torch.randn(h, S, S, generator=g, dtype=DTYPE)
    if spec.get("cross"):
        inputs["context"] = torch.randn(B, S_KV, d, generator=g, dtype=DTYPE)
        inputs["ctx_mask"] = padding_mask(lengths=[S_KV - 1, S_KV], s_kv=S_KV)
    return attn, inputs


def learnable(mask: torch.Tensor) -> torch.Tensor:
    """A float mask as a leaf that requires grad (a learnable score bias); a bool mask as it is."""
    return mask.clone().requires_grad_() if mask.is_floating_point() else mask


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def grad_storage(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Per parameter: the bytes of the storage that its ``.grad`` keeps alive, and the bytes of ``.grad``."""
    return {n: (p.grad.untyped_storage().nbytes(), p.grad.numel() * p.grad.element_size())
            for n, p in module.named_parameters() if p.grad is not None}


def _run_scenario(spec: dict, group, mesh) -> dict:
    from headwise.parallel import HeadNotLocalError, tensor_parallel

    attn, inp = build(spec)
    tp = tensor_parallel(attn, mesh if spec.get("mesh") else group)
    out: dict = {"q_heads": tp.partition.q_heads, "kv_heads": tp.partition.kv_heads,
                 "local_n_heads": tp.config.n_heads, "local_n_kv_heads": tp.config.n_kv_heads,
                 "d_head": tp.config.d_head, "scale": tp.config.scale, "describe": tp.plan.describe()}

    mask = inp["pad_mask"]
    if mask.dim() >= 3 and mask.shape[-3] == spec["n_heads"]:  # a per-head mask laid out for the global heads
        try:
            out["explain"] = dataclasses.replace(tp.explain_dispatch(inp["x_pad"], mask=mask, causal=True), plan=None)
        except ValueError as err:
            out["explain"] = str(err)

    x = inp["x"].clone().requires_grad_()
    y = tp(x, causal=True)
    (y * inp["grad_y"]).sum().backward()
    out["causal"] = {"y": y.detach(), "x_grad": x.grad, "grads": _grads(tp), "grad_storage": grad_storage(tp)}
    tp.zero_grad(set_to_none=True)

    x = inp["x_pad"].clone().requires_grad_()
    mask = learnable(inp["pad_mask"])
    y = tp(x, mask=mask, causal=True)
    (y * inp["grad_y"]).sum().backward()
    out["padding"] = {"y": y.detach(), "x_grad": x.grad, "grads": _grads(tp), "mask_grad": mask.grad}
    tp.zero_grad(set_to_none=True)

    if spec.get("cross"):
        x = inp["x"].clone().requires_grad_()
        c = inp["context"].clone().requires_grad_()
        y = tp(x, c, mask=inp["ctx_mask"])
        (y * inp["grad_y"]).sum().backward()
        out["cross"] = {"y": y.detach(), "x_grad": x.grad, "context_grad": c.grad, "grads": _grads(tp)}
        tp.zero_grad(set_to_none=True)

    with torch.no_grad():
        cache = tp.new_cache(B, PREFILL + DECODE)
        xd = inp["x_dec"]
        steps = [tp(xd[:, :PREFILL], cache=cache)]
        steps += [tp(xd[:, t:t + 1], cache=cache) for t in range(PREFILL, PREFILL + DECODE)]
    out["decode"] = {"steps": steps, "cache_n_kv_heads": cache.n_kv_heads, "cache_keys_shape": tuple(cache.keys.shape),
                     "cache_nbytes": cache.nbytes}

    heads = {}
    for h in range(spec["n_heads"]):
        try:
            view = tp.head(h)
        except HeadNotLocalError as err:
            heads[h] = {"error": str(err), "owner": err.owner}
        else:
            with torch.no_grad():
                heads[h] = {"z": view(inp["x"], causal=True), "w_o": view.w_o.clone(),
                            "z_masked": view(inp["x_pad"], mask=inp["pad_mask"]),
                            "global_index": view.global_index, "global_kv_index": view.global_kv_index}
    out["heads"] = heads
    full = tp.unshard()  # after the training steps above the weights are unchanged: no optimizer ran
    out["unshard"] = {n: t.detach().clone() for n, t in full.state_dict().items()}
    out["unshard_types"] = (type(full).__name__, full.config.to_dict())
    return out


SUBMESH = dict(name="submesh_mqa", d_model=32, n_heads=4, n_kv_heads=1, rotary=True)


def _run_submesh(rank: int) -> dict:
    """4 ranks as a (dp=2, tp=2) mesh: tensor parallelism inside each tp pair ({0, 1} and {2, 3})."""
    from torch.distributed.device_mesh import init_device_mesh

    from headwise.parallel import tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    attn, inp = build(SUBMESH)
    out: dict = {}
    try:
        tensor_parallel(attn, mesh)
    except ValueError as err:
        out["mesh2d_error"] = str(err)
    tp = tensor_parallel(attn, mesh["tp"])
    x = inp["x"].clone().requires_grad_()
    y = tp(x, causal=True)
    (y * inp["grad_y"]).sum().backward()
    out.update(tp_rank=tp.rank, tp_world=tp.world_size, q_heads=tp.partition.q_heads, y=y.detach(), x_grad=x.grad,
               grads=_grads(tp))
    return out


# headwise.trace on a sharded layer: edits keyed by global heads spread over the ranks, a z capture.
TRACE = dict(name="trace_gqa", d_model=32, n_heads=8, n_kv_heads=2)


def trace_edits(seen: list[int]) -> dict:
    """Edits on heads of every rank of 2 or 4 (and a callable on heads 2 and 7 that logs the heads it gets)."""
    def halve(x_h: torch.Tensor, layer: int, head: int) -> torch.Tensor:
        seen.append(head)
        return x_h * 0.5

    return {(0, 1): "zero", (0, 6, "k"): 0.5, (0, (3, 5), "pattern"): "zero", (0, (2, 7), "q"): halve}


def _trace(rank: int) -> dict:
    import headwise
    from headwise.parallel import tensor_parallel

    attn, inp = build(TRACE)
    tp = tensor_parallel(attn)
    seen: list[int] = []
    with torch.no_grad(), headwise.trace(tp, capture=("z",), edit=trace_edits(seen)) as t:
        y = tp(inp["x"], causal=True)
    out = {"y": y, "z": t[0].z, "seen": seen, "q_heads": tp.partition.q_heads}
    # ("mean", reference): a trace of the unsharded layer, and one of this rank's shard, on other data.
    with torch.no_grad(), headwise.trace(attn, capture=("z", "v")) as whole:
        attn(inp["x"].flip(1))
    with torch.no_grad(), headwise.trace(tp, capture=("z", "v")) as shard:
        tp(inp["x"].flip(1))
    means = {(0, 5, "v"): ("mean", whole), (0, 2, "z"): ("mean", shard), (0, 6, "z"): ("mean", shard)}
    with torch.no_grad(), headwise.trace(tp, edit=means):
        out["y_means"] = tp(inp["x"], causal=True)
    try:
        headwise.trace(tp, edit={(0, TRACE["n_heads"]): "zero"})
    except (IndexError, ValueError) as err:
        out["out_of_range"] = (type(err).__name__, str(err))
    # The unsharded layer edited with this shard's means: every head the shard does not hold has none to give.
    out["whole_from_shard"] = {}
    for head in range(TRACE["n_heads"]):
        try:
            with torch.no_grad(), headwise.trace(attn, edit={(0, head, "z"): ("mean", shard)}):
                out["whole_from_shard"][head] = attn(inp["x"], causal=True)
        except ValueError as err:
            out["whole_from_shard"][head] = str(err)
    return out


# Hooks on W_O of a sharded layer: a pre-hook zeroes the input columns of ABLATED (global heads, on ranks 0 and
# the last of 2 or 4), a forward hook counts its calls.
HOOKS = dict(name="hooks_gqa", d_model=32, n_heads=8, n_kv_heads=2)
ABLATED = (1, 6)


def ablate(heads: list[int], d_head: int, calls: list[int]):
    """A forward pre-hook on ``out_proj`` zeroing the columns of ``heads`` (indices into its input's heads)."""
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        calls.append(1)
        z = args[0].clone()
        for j in heads:
            z[..., j * d_head:(j + 1) * d_head] = 0
        return (z,)
    return hook


def _out_proj_hooks() -> dict:
    from headwise.parallel import tensor_parallel

    attn, inp = build(HOOKS)
    tp = tensor_parallel(attn)
    q_heads = list(tp.partition.q_heads)
    pre_calls: list[int] = []
    post_calls: list[int] = []
    tp.out_proj.register_forward_pre_hook(ablate([q_heads.index(h) for h in ABLATED if h in q_heads],
                                                 tp.config.d_head, pre_calls))
    tp.out_proj.register_forward_hook(lambda module, args, output: post_calls.append(1))
    x = inp["x"].clone().requires_grad_()
    y = tp(x, causal=True)
    (y * inp["grad_y"]).sum().backward()
    return {"hooked": {"y": y.detach(), "x_grad": x.grad, "grads": _grads(tp)},
            "calls": (len(pre_calls), len(post_calls))}


# An adapter on k_proj and a hook on v_proj of a layer whose one K/V head every rank holds (replicated).
ADAPTER = dict(name="adapter_mqa", d_model=32, n_heads=4, n_kv_heads=1)


class LoRALinear(torch.nn.Linear):
    """``W x + b + B A x``: a LoRA-style adapter that keeps its base layer's weight and bias as its own."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, dtype=base.weight.dtype)
        self.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(7)
        self.A = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=g, dtype=DTYPE))
        self.B = torch.nn.Parameter(torch.randn(base.out_features, rank, generator=g, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.A.T @ self.B.T


def _replicated_kv_adapter() -> dict:
    from headwise.parallel import tensor_parallel

    attn, inp = build(ADAPTER)
    tp = tensor_parallel(attn)
    tp.k_proj = LoRALinear(tp.k_proj)
    calls: list[int] = []
    tp.v_proj.register_forward_hook(lambda module, args, output: calls.append(1))
    with torch.no_grad():
        y_no_grad = tp(inp["x"], causal=True)
    x = inp["x"].clone().requires_grad_()
    y = tp(x, causal=True)
    (y * inp["grad_y"]).sum().backward()
    return {"y_no_grad": y_no_grad, "y": y.detach(), "x_grad": x.grad, "v_hook_calls": len(calls),
            "k_grads": {n: None if p.grad is None else p.grad.clone() for n, p in tp.k_proj.named_parameters()}}


def _shard_state(rank: int, world: int) -> dict:
    """Every rank's shard state dict loaded into this rank's shard: only its own may load, as saved, after
    torch.save / torch.load(weights_only=True), and cast to bfloat16 (its metadata kept)."""
    import io
    from collections import OrderedDict

    import torch.distributed as dist

    from headwise.parallel import tensor_parallel

    def weights_only(sd: dict) -> dict:
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    def bfloat16(sd: dict) -> dict:
        cast = OrderedDict((k, v.to(torch.bfloat16)) for k, v in sd.items())
        cast._metadata = sd._metadata  # type: ignore[attr-defined]
        return cast

    attn, _ = build(HOOKS)
    tp = tensor_parallel(attn)
    mine = tp.state_dict()
    shards: list = [None] * world
    dist.all_gather_object(shards, mine)  # pickled with its metadata
    own = {k: v.clone() for k, v in mine.items()}  # mine's tensors share the parameters' storage
    out: dict = {"loads": {}, "states": {}}
    for variant, convert in (("saved", lambda sd: sd), ("weights_only", weights_only), ("bfloat16", bfloat16)):
        for r, sd in enumerate(shards):
            try:
                tp.load_state_dict(convert(sd))
                out["loads"][variant, r] = None
            except ValueError as err:
                out["loads"][variant, r] = str(err)
            out["states"][variant, r] = {k: v.detach().clone() for k, v in tp.state_dict().items()}
            tp.load_state_dict(own)
    missing, unexpected = tp.load_state_dict(dict(mine))  # a plain dict, without the record, loads as before
    out["bare"] = (list(missing), list(unexpected))
    out["keys"] = sorted(mine)
    out["record"] = mine._metadata[""]["headwise_shard"]
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of one spawned rank (torch.multiprocessing.spawn passes ``rank`` first)."""

    def cases(results: dict) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        group = dist.group.WORLD
        for spec in SCENARIOS[world]:
            results[spec["name"]] = _run_scenario(spec, group, mesh)
        results["trace"] = _trace(rank)
        results["hooks"] = _out_proj_hooks()
        results["adapter"] = _replicated_kv_adapter()
        results["shard_state"] = _shard_state(rank, world)
        if world == 4:
            results["submesh"] = _run_submesh(rank)
            # Only rank 0 tries the impossible split: had it entered any collective, it would wait for the
            # other ranks there, and the barrier below would time out instead of passing.
            if rank == 0:
                from headwise.parallel import tensor_parallel

                try:
                    tensor_parallel(MultiHeadAttention(**INVALID, dtype=DTYPE), group)
                except ValueError as err:
                    results["invalid"] = str(err)
                else:
                    results["invalid"] = None
            dist.barrier()

    rank_session(rank, world, port, out_dir, 30, cases)
