"""headwise.parallel.tensor_parallel on real process groups: 2 and 4 CPU ranks with gloo.

One process group per world size (a module-scoped spawn) runs every scenario of ``_tp_worker.SCENARIOS``;
here the unsharded float64 layer is rebuilt from the same seeds and every rank's outputs and gradients are
compared with it: outputs on every rank, every parameter's gradient re-assembled from the ranks' slices
(with the head -> rank arithmetic written out again here, not taken from the library), replicated K/V
gradients on every replica, the input gradient on every rank, and KV-cache decoding step by step.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch

from headwise import MultiHeadAttention
from headwise.parallel import tensor_parallel
from tests.parallel import _tp_worker as worker
from tests.parallel.spawn import spawn

pytestmark = [pytest.mark.xdist_group("parallel"), pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return spawn(worker.run_rank, 2)


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return spawn(worker.run_rank, 4)


@pytest.fixture(params=[2, 4], ids=["world2", "world4"])
def world(request, ranks2, ranks4) -> tuple[int, list[dict]]:
    return request.param, {2: ranks2, 4: ranks4}[request.param]


def _specs(world_size: int) -> list[dict]:
    return worker.SCENARIOS[world_size]


def _owned(spec: dict, world_size: int, rank: int) -> tuple[list[int], list[int]]:
    """Rank ``rank``'s query heads and the K/V heads they read (the GQA rule, written out independently)."""
    h, h_kv = spec["n_heads"], spec["n_kv_heads"]
    per_rank, group = h // world_size, h // h_kv
    q = list(range(rank * per_rank, (rank + 1) * per_rank))
    return q, sorted({i // group for i in q})


def _rows(heads: list[int], d_head: int) -> torch.Tensor:
    return torch.cat([torch.arange(i * d_head, (i + 1) * d_head) for i in heads])


def _reference(spec: dict, phase: str):
    """Unsharded output and gradients for one phase (``causal``, ``padding``, ``cross``)."""
    attn, inp = worker.build(spec)
    x = (inp["x_pad"] if phase == "padding" else inp["x"]).clone().requires_grad_()
    if phase == "causal":
        y = attn(x, causal=True)
    elif phase == "padding":
        mask = worker.learnable(inp["pad_mask"])
        y = attn(x, mask=mask, causal=True)
    else:
        c = inp["context"].clone().requires_grad_()
        y = attn(x, c, mask=inp["ctx_mask"])
    (y * inp["grad_y"]).sum().backward()
    extra = {"context_grad": c.grad} if phase == "cross" else {"mask_grad": mask.grad} if phase == "padding" else {}
    return attn, y.detach(), x.grad, extra


def _check_grads(spec: dict, world_size: int, ranks: list[dict], phase: str, attn: MultiHeadAttention) -> None:
    d_head = attn.d_head
    q_rows, kv_rows = [], []
    for r, res in enumerate(ranks):
        q, kv = _owned(spec, world_size, r)
        q_rows.append(_rows(q, d_head))
        kv_rows.append(_rows(kv, d_head))
    grads = [res[spec["name"]][phase]["grads"] for res in ranks]
    # Query heads and out_proj columns are partitioned: concatenated over ranks they give the whole gradient.
    q_order = torch.cat(q_rows)
    torch.testing.assert_close(torch.cat([g["q_proj.weight"] for g in grads]), attn.q_proj.weight.grad[q_order])
    torch.testing.assert_close(torch.cat([g["out_proj.weight"] for g in grads], dim=1),
                               attn.out_proj.weight.grad[:, q_order])
    assert q_order.tolist() == list(range(attn.q_proj.weight.shape[0]))
    names = ["k_proj.weight", "v_proj.weight"]
    if attn.q_proj.bias is not None:
        torch.testing.assert_close(torch.cat([g["q_proj.bias"] for g in grads]), attn.q_proj.bias.grad[q_order])
        names += ["k_proj.bias", "v_proj.bias"]
    # K/V heads: every rank holding a K/V head (one, or several when replicated) has its full gradient.
    covered = set()
    for r, g in enumerate(grads):
        covered.update(kv_rows[r].tolist())
        for name in names:
            full = attn.get_parameter(name).grad
            torch.testing.assert_close(g[name], full[kv_rows[r]], msg=lambda m: f"rank {r} {name}: {m}")
    assert covered == set(range(attn.k_proj.weight.shape[0]))
    if attn.out_proj.bias is not None:
        for g in grads:  # replicated, added once after the reduce: the full gradient on every rank
            torch.testing.assert_close(g["out_proj.bias"], attn.out_proj.bias.grad)
    for name in ("q_norm.weight", "k_norm.weight"):  # per-head norms read by every rank's heads: whole everywhere
        if name in dict(attn.named_parameters()):
            for r, g in enumerate(grads):
                torch.testing.assert_close(g[name], attn.get_parameter(name).grad,
                                           msg=lambda m: f"rank {r} {name}: {m}")
    for g in grads:
        assert set(g) == {n for n, _ in attn.named_parameters()}


@pytest.mark.parametrize("phase", ["causal", "padding", "cross"])
def test_forward_and_every_gradient_match_the_unsharded_layer(world, phase):
    world_size, ranks = world
    assert "traceback" not in ranks[0], ranks[0].get("traceback")
    checked = learnable_masks = 0
    for spec in _specs(world_size):
        if phase == "cross" and not spec.get("cross"):
            continue
        attn, y_ref, x_grad_ref, extra = _reference(spec, phase)
        for r, res in enumerate(ranks):
            got = res[spec["name"]][phase]
            torch.testing.assert_close(got["y"], y_ref, msg=lambda m: f"{spec['name']} rank {r} output: {m}")
            torch.testing.assert_close(got["x_grad"], x_grad_ref, msg=lambda m: f"{spec['name']} rank {r} dx: {m}")
            if phase == "cross":
                torch.testing.assert_close(got["context_grad"], extra["context_grad"])
            if phase == "padding":  # a float mask (a learnable score bias): its whole gradient on every rank
                if extra["mask_grad"] is None:
                    assert got["mask_grad"] is None
                else:
                    torch.testing.assert_close(got["mask_grad"], extra["mask_grad"],
                                               msg=lambda m: f"{spec['name']} rank {r} dmask: {m}")
                    learnable_masks += 1
        _check_grads(spec, world_size, ranks, phase, attn)
        checked += 1
    assert checked >= 1
    assert (learnable_masks > 0) == (phase == "padding")


def test_cache_decoding_equals_single_process_decoding(world):
    world_size, ranks = world
    for spec in _specs(world_size):
        attn, inp = worker.build(spec)
        b, n_pre, n_dec = worker.B, worker.PREFILL, worker.DECODE
        with torch.no_grad():
            cache = attn.new_cache(b, n_pre + n_dec)
            xd = inp["x_dec"]
            ref = [attn(xd[:, :n_pre], cache=cache)] + [attn(xd[:, t:t + 1], cache=cache)
                                                        for t in range(n_pre, n_pre + n_dec)]
            one_pass = attn(xd, causal=True)
        torch.testing.assert_close(torch.cat(ref, dim=1), one_pass)
        for r, res in enumerate(ranks):
            dec = res[spec["name"]]["decode"]
            assert len(dec["steps"]) == len(ref) == 1 + n_dec
            for t, (got, want) in enumerate(zip(dec["steps"], ref)):
                torch.testing.assert_close(got, want, msg=lambda m: f"{spec['name']} rank {r} step {t}: {m}")
            # Only the local K/V heads are cached.
            local_kv = len(_owned(spec, world_size, r)[1])
            assert dec["cache_n_kv_heads"] == local_kv
            assert dec["cache_keys_shape"] == (b, local_kv, n_pre + n_dec, attn.d_head)
            assert dec["cache_nbytes"] == cache.nbytes * local_kv // attn.n_kv_heads


def test_local_layers_have_local_head_counts_and_the_plan_says_so(world):
    world_size, ranks = world
    for spec in _specs(world_size):
        attn, _ = worker.build(spec)
        for r, res in enumerate(ranks):
            got = res[spec["name"]]
            q, kv = _owned(spec, world_size, r)
            assert (list(got["q_heads"]), list(got["kv_heads"])) == (q, kv)
            assert (got["local_n_heads"], got["local_n_kv_heads"]) == (len(q), len(kv))
            assert (got["d_head"], got["scale"]) == (attn.d_head, attn.config.scale)
            replicated = spec["n_kv_heads"] < world_size
            assert ("replicated" in got["describe"]) == replicated
            assert f"rank {r}: query heads {q}, K/V heads {kv}" in got["describe"]


def test_global_head_view_on_the_owner_and_a_named_error_elsewhere(world):
    world_size, ranks = world
    for spec in _specs(world_size):
        attn, inp = worker.build(spec)
        for h in range(spec["n_heads"]):
            owner = next(r for r in range(world_size) if h in _owned(spec, world_size, r)[0])
            with torch.no_grad():
                z_ref = attn.head(h)(inp["x"], causal=True)
                # a mask laid out for the whole layer (per-head in some specs): the view takes its global row
                z_masked_ref = attn.head(h)(inp["x_pad"], mask=inp["pad_mask"])
            for r, res in enumerate(ranks):
                got = res[spec["name"]]["heads"][h]
                if r == owner:
                    torch.testing.assert_close(got["z"], z_ref)
                    torch.testing.assert_close(got["z_masked"], z_masked_ref)
                    torch.testing.assert_close(got["w_o"], attn.head(h).w_o)
                    assert (got["global_index"], got["global_kv_index"]) == (h, attn.config.kv_head_of(h))
                else:
                    assert got["owner"] == owner
                    assert f"head {h} is on rank {owner}" in got["error"]


def test_unshard_gathers_the_whole_layer_on_every_rank(world):
    world_size, ranks = world
    for spec in _specs(world_size):
        attn, _ = worker.build(spec)
        want = attn.state_dict()
        for r, res in enumerate(ranks):
            got = res[spec["name"]]["unshard"]
            assert res[spec["name"]]["unshard_types"] == (type(attn).__name__, attn.config.to_dict())
            assert set(got) == set(want)
            for name in want:  # gathered copies of the same numbers: exact
                assert torch.equal(got[name], want[name]), (spec["name"], r, name)


def test_qk_norm_layers_are_sharded_with_their_norms(world):
    """QKNormAttention (Qwen3 / Gemma 3 from from_hf) keeps its per-head norms in every shard: the scenarios'
    outputs, gradients (the norms' whole on every rank), head views, decoding and unshard are checked above."""
    pytest.importorskip("transformers")
    world_size, ranks = world
    specs = [s for s in _specs(world_size) if s.get("qk_norm")]
    assert len(specs) == 1
    attn, _ = worker.build(specs[0])
    assert type(attn).__name__ == "QKNormAttention"
    for res in ranks:
        assert res[specs[0]["name"]]["unshard_types"][0] == "QKNormAttention"


def test_explaining_a_call_with_a_global_per_head_mask_explains_the_local_call_forward_runs(world):
    """tp.explain_dispatch takes the mask tp(x, mask=...) takes (laid out for the global heads) and describes
    what runs on the rank: a plain layer of the rank's heads on its rows of the mask."""
    world_size, ranks = world
    checked = 0
    for spec in _specs(world_size):
        if "explain" not in ranks[0][spec["name"]]:
            continue
        attn, inp = worker.build(spec)
        for r, res in enumerate(ranks):
            q, kv = _owned(spec, world_size, r)
            cfg = attn.config.replace(n_heads=len(q), n_kv_heads=len(kv))
            local = MultiHeadAttention(config=cfg, dtype=worker.DTYPE)
            mask = inp["pad_mask"]
            rows = mask.narrow(mask.dim() - 3, q[0], len(q))
            want = local.explain_dispatch(inp["x_pad"], mask=rows, causal=True)
            assert res[spec["name"]]["explain"] == dataclasses.replace(want, plan=None), (spec["name"], r)
        checked += 1
    assert checked >= 2


def test_an_adapter_and_a_hook_on_replicated_kv_projections_run_with_grad_as_without(world):
    """A LoRA-style k_proj and a hooked v_proj of an MQA layer (its one K/V head on every rank): the output with
    grad equals the output without, and the same adapter on the unsharded layer; the adapter's gradients are
    whole on every rank (summed over the replicas)."""
    world_size, ranks = world
    attn, inp = worker.build(worker.ADAPTER)
    attn.k_proj = worker.LoRALinear(attn.k_proj)
    x = inp["x"].clone().requires_grad_()
    y = attn(x, causal=True)
    (y * inp["grad_y"]).sum().backward()
    for r, res in enumerate(ranks):
        got = res["adapter"]
        torch.testing.assert_close(got["y_no_grad"], y.detach(), msg=lambda m: f"rank {r} no grad: {m}")
        torch.testing.assert_close(got["y"], y.detach(), msg=lambda m: f"rank {r} grad: {m}")
        torch.testing.assert_close(got["x_grad"], x.grad, msg=lambda m: f"rank {r} dx: {m}")
        assert got["v_hook_calls"] == 2, f"rank {r}"  # once without grad, once with
        assert sorted(got["k_grads"]) == ["A", "B", "bias", "weight"]
        for name, g in got["k_grads"].items():
            torch.testing.assert_close(g, attn.k_proj.get_parameter(name).grad, msg=lambda m: f"rank {r} {name}: {m}")


def test_tensor_parallel_inside_a_sub_group_of_a_2d_mesh(ranks4):
    # (dp=2, tp=2) mesh: ranks {0, 1} and {2, 3} each split the layer; group ranks differ from global ranks.
    spec = worker.SUBMESH
    attn, y_ref, x_grad_ref, _ = _reference(spec, "causal")
    for r, res in enumerate(ranks4):
        got = res["submesh"]
        assert "1-D DeviceMesh" in got["mesh2d_error"]
        assert (got["tp_rank"], got["tp_world"]) == (r % 2, 2)
        assert list(got["q_heads"]) == _owned(spec, 2, r % 2)[0]
        torch.testing.assert_close(got["y"], y_ref)
        torch.testing.assert_close(got["x_grad"], x_grad_ref)
    for pair in ([0, 1], [2, 3]):
        _check_grads(spec, 2, [{spec["name"]: {"causal": ranks4[r]["submesh"]}} for r in pair], "causal", attn)


def test_invalid_split_fails_on_one_rank_without_entering_a_collective(ranks4):
    # Rank 0 alone called tensor_parallel; the group then met at a barrier, so no collective was entered.
    msg = ranks4[0]["invalid"]
    assert msg is not None and "valid world sizes" in msg and "[1, 2, 6]" in msg


def test_needs_an_initialised_group_and_a_headwise_layer():
    with pytest.raises(RuntimeError, match="init_process_group"):
        tensor_parallel(MultiHeadAttention(16, 4))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        tensor_parallel(torch.nn.Linear(4, 4))


class _ScaledOutput(MultiHeadAttention):
    def project_out(self, z, results=None):
        return 2 * super().project_out(z, results)


def test_a_layer_computing_more_than_a_shard_carries_is_refused_before_any_group_is_read():
    """A subclass with its own forward step, a projection that is an adapter, or a view of another module's
    weights would lose what they compute in a shard: TypeError naming it (no process group is needed)."""
    from headwise.interop import from_torch

    with pytest.raises(TypeError, match=r"cannot shard _ScaledOutput: it overrides the forward step "
                                        r"_ScaledOutput\.project_out; a shard computes only"):
        tensor_parallel(_ScaledOutput(16, 4))
    adapted = MultiHeadAttention(16, 4, dtype=worker.DTYPE)
    adapted.k_proj = worker.LoRALinear(adapted.k_proj)
    with pytest.raises(TypeError, match=r"its projections k_proj=LoRALinear are not plain nn\.Linear.*merge_and_unload"):
        tensor_parallel(adapted)
    hooked = MultiHeadAttention(16, 4, dtype=worker.DTYPE)
    hooked.q_proj.register_forward_hook(lambda m, args, out: 2 * out)
    with pytest.raises(TypeError, match=r"q_proj has forward hooks, which a shard does not carry"):
        tensor_parallel(hooked)
    view = from_torch(torch.nn.MultiheadAttention(16, 4, batch_first=True), share=True)
    with pytest.raises(TypeError, match=r"cannot shard TorchMHAView: it overrides the forward step.*view of another "
                                        r"module's weights: shard a standalone copy"):
        tensor_parallel(view)


def test_trace_edits_take_global_heads_and_equal_the_same_edits_on_the_unsharded_layer(world):
    import headwise

    world_size, ranks = world
    attn, inp = worker.build(worker.TRACE)
    seen: list[int] = []
    with torch.no_grad(), headwise.trace(attn, capture=("z",), edit=worker.trace_edits(seen)) as t:
        want = attn(inp["x"], causal=True)
    with torch.no_grad(), headwise.trace(attn, capture=("z", "v")) as whole:
        attn(inp["x"].flip(1))
    means = {(0, 5, "v"): ("mean", whole), (0, 2, "z"): ("mean", whole), (0, 6, "z"): ("mean", whole)}
    with torch.no_grad(), headwise.trace(attn, edit=means):
        want_means = attn(inp["x"], causal=True)
    h = worker.TRACE["n_heads"]
    for rank, res in enumerate(ranks):
        got = res["trace"]
        q, _ = _owned(worker.TRACE, world_size, rank)
        assert list(got["q_heads"]) == q
        torch.testing.assert_close(got["y"], want, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(got["y_means"], want_means, msg=lambda m: f"rank {rank} means: {m}")
        # Captures are this rank's heads, in global order.
        torch.testing.assert_close(got["z"], t[0].z[:, :, q], msg=lambda m: f"rank {rank} z: {m}")
        assert sorted(set(got["seen"])) == [i for i in (2, 7) if i in q]
        for head, res_head in got["whole_from_shard"].items():
            if head in q:  # the shard's mean of a head it holds: the same edit as with the whole layer's
                with torch.no_grad(), headwise.trace(attn, edit={(0, head, "z"): ("mean", whole)}):
                    torch.testing.assert_close(res_head, attn(inp["x"], causal=True))
            else:
                assert f"not head {head}" in res_head
        assert got["out_of_range"] == ranks[0]["trace"]["out_of_range"]
        assert f"head must be in [0, {h}), got {h}" in got["out_of_range"][1]



def test_replicated_kv_gradients_own_exactly_their_storage(world):
    """The K/V gradients summed over their replicas keep no larger buffer alive behind their ``.grad``."""
    world_size, ranks = world
    replicated = 0
    for spec in _specs(world_size):
        for r, res in enumerate(ranks):
            for name, (held, own) in res[spec["name"]]["causal"]["grad_storage"].items():
                assert held == own, f"{spec['name']} rank {r} {name}: .grad keeps {held} bytes alive for {own}"
        replicated += spec["n_kv_heads"] < world_size
    assert replicated >= 1


def test_hooks_on_out_proj_run_on_every_rank_and_act_as_on_the_unsharded_layer(world):
    """A forward pre-hook zeroing heads' columns of W_O's input ablates them: the same output and gradients
    as the same hook on the unsharded layer's out_proj."""
    world_size, ranks = world
    spec = worker.HOOKS
    attn, inp = worker.build(spec)
    calls: list[int] = []
    attn.out_proj.register_forward_pre_hook(worker.ablate(list(worker.ABLATED), attn.d_head, calls))
    x = inp["x"].clone().requires_grad_()
    y = attn(x, causal=True)
    (y * inp["grad_y"]).sum().backward()
    assert len(calls) == 1
    with torch.no_grad():
        assert not torch.allclose(y, worker.build(spec)[0](inp["x"], causal=True))  # the ablation shows
    for r, res in enumerate(ranks):
        got = res["hooks"]
        assert got["calls"] == (1, 1), f"rank {r}"
        torch.testing.assert_close(got["hooked"]["y"], y.detach(), msg=lambda m: f"rank {r} output: {m}")
        torch.testing.assert_close(got["hooked"]["x_grad"], x.grad, msg=lambda m: f"rank {r} dx: {m}")
    _check_grads(spec, world_size, [{spec["name"]: {"hooked": res["hooks"]["hooked"]}} for res in ranks],
                 "hooked", attn)


def test_a_shard_state_dict_loads_only_into_the_shard_of_the_same_rank(world):
    """As saved, through torch.save / torch.load(weights_only=True), and cast to bfloat16 (metadata kept)."""
    world_size, ranks = world
    attn, _ = worker.build(worker.HOOKS)
    h, h_kv = worker.HOOKS["n_heads"], worker.HOOKS["n_kv_heads"]
    for r, res in enumerate(ranks):
        got = res["shard_state"]
        q, kv = _owned(worker.HOOKS, world_size, r)
        assert got["keys"] == sorted(attn.state_dict())  # exactly the projections' tensors
        assert got["record"] == {"world_size": world_size, "rank": r, "n_heads": h, "n_kv_heads": h_kv,
                                 "q_heads": q, "kv_heads": kv}
        want = {n: t[_rows(q, attn.d_head)] for n, t in attn.state_dict().items() if n.startswith("q_proj")}
        assert sorted(got["loads"]) == [(v, o) for v in ("bfloat16", "saved", "weights_only")
                                        for o in range(world_size)]
        for (variant, other), error in got["loads"].items():
            state = got["states"][variant, other]
            if other == r:
                assert error is None, (r, variant, error)
                for name, t in want.items():
                    t = t.to(torch.bfloat16).to(t.dtype) if variant == "bfloat16" else t
                    torch.testing.assert_close(state[name], t, rtol=0, atol=0)
                continue
            for name, t in want.items():  # refused: the layer holds its own slices, untouched
                torch.testing.assert_close(state[name], t, rtol=0, atol=0)
            q_o, kv_o = _owned(worker.HOOKS, world_size, other)
            assert error is not None, f"rank {r} accepted rank {other}'s shard ({variant})"
            assert (f"holds the tensor-parallel shard of rank {other} of {world_size} (query heads {q_o}, K/V "
                    f"heads {kv_o} of a layer with {h} query, {h_kv} K/V heads), but this layer is the shard of "
                    f"rank {r} of {world_size} (query heads {q}, K/V heads {kv} of") in error, error
        assert got["bare"] == ([], [])


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_shard_state_dict_is_plain_tensors_and_loads_into_a_plain_layer(one_rank_group):
    attn, inp = worker.build(worker.HOOKS)
    tp = tensor_parallel(attn)
    sd = tp.state_dict()
    assert list(sd) == list(attn.state_dict())
    plain = MultiHeadAttention(config=tp.config, dtype=worker.DTYPE)
    assert not plain.load_state_dict(sd, strict=True).unexpected_keys  # the record is metadata, ignored here
    torch.testing.assert_close(plain(inp["x"], causal=True), attn(inp["x"], causal=True))
    # A copy whose tensors were cast or averaged keeps the record intact.
    half = OrderedDict((k, v.to(torch.bfloat16)) for k, v in sd.items())
    half._metadata = sd._metadata
    tp16 = tensor_parallel(attn).to(torch.bfloat16)
    tp16.load_state_dict(half)
    for name, t in attn.state_dict().items():
        torch.testing.assert_close(tp16.state_dict()[name], t.to(torch.bfloat16), rtol=0, atol=0)
    tp.load_state_dict({k: 0.5 * v + 0.5 * v for k, v in sd.items()})
    # Nested, another shard's record is refused under its prefix, and a malformed one names what it expects.
    model = torch.nn.Sequential(tensor_parallel(attn))
    msd = model.state_dict()
    other = {"world_size": 2, "rank": 1, "n_heads": 8, "n_kv_heads": 2, "q_heads": [4, 5, 6, 7], "kv_heads": [1]}
    before = {k: v.clone() for k, v in msd.items()}
    for record, message in ((other, "at '0' holds the tensor-parallel shard of rank 1 of 2"),
                            ({"rank": "1"}, "must be a dict of ints")):
        bad = OrderedDict((k, torch.zeros_like(v)) for k, v in msd.items())
        bad._metadata = {k: dict(v) for k, v in msd._metadata.items()}
        bad._metadata["0"]["headwise_shard"] = record
        with pytest.raises(ValueError, match=message):
            model.load_state_dict(bad)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)
