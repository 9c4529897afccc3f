"""headwise.parallel.sequence_parallel on real process groups: 2 and 4 CPU ranks with gloo, against one process.

One process group per world size (a module-scoped spawn) runs every scenario of ``_sp_worker.SCENARIOS``;
here the float64 layer is rebuilt from the same seeds and run once on the whole sequence. The ranks' output
slices and input-gradient slices, concatenated in rank order, must equal the single-process output and input
gradients; every rank's parameter gradients must equal the single-process ones (``grad_reduction="sum"``),
or sum to them (``"none"``); under the (sp, tp) mesh each rank's gradients are its tensor-parallel slice,
with the rows of each shard written out again here from the GQA rule.
"""

from __future__ import annotations

import pytest
import torch

from headwise import MultiHeadAttention
from headwise.parallel import sequence_parallel
from tests.parallel import _sp_worker as worker
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
    ranks = {2: ranks2, 4: ranks4}[request.param]
    for res in ranks:
        assert "traceback" not in res, res["traceback"]
    return request.param, ranks


def _reference(spec: dict, phase: dict):
    attn, inp = worker.build(spec)
    x = inp["x"].clone().requires_grad_()
    args = (inp["context"].clone().requires_grad_(),) if phase.get("cross") else ()
    kv = {n: inp[n].clone().requires_grad_() for n in ("key", "value")} if phase.get("key_value") else {}
    kw = worker.call_kwargs(phase, inp)
    y = attn(x, *args, **kv, **kw)
    (y * inp["grad_y"]).sum().backward()
    extra = {"context_grad": args[0].grad} if args else {f"{n}_grad": t.grad for n, t in kv.items()}
    if "mask" in kw and kw["mask"].grad is not None:  # a float mask: not sliced, the same on every rank
        extra["mask_grad"] = kw["mask"].grad
    return attn, y.detach(), x.grad, extra


def _tp_rows(spec: dict, tp: int, t: int, d_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of q_proj and of k_proj/v_proj that tensor-parallel shard ``t`` holds (the GQA rule)."""
    h, h_kv = spec["n_heads"], spec["n_kv_heads"]
    q = list(range(t * h // tp, (t + 1) * h // tp))
    kv = sorted({i // (h // h_kv) for i in q})
    rows = lambda heads: torch.cat([torch.arange(i * d_head, (i + 1) * d_head) for i in heads])  # noqa: E731
    return rows(q), rows(kv)


def _expected_grads(spec: dict, attn: MultiHeadAttention, res: dict) -> dict[str, torch.Tensor]:
    full = {n: p.grad for n, p in attn.named_parameters()}
    if not spec.get("mesh"):
        return full
    q_rows, kv_rows = _tp_rows(spec, 2, res["tp_rank"], attn.d_head)
    out = {"q_proj.weight": full["q_proj.weight"][q_rows], "k_proj.weight": full["k_proj.weight"][kv_rows],
           "v_proj.weight": full["v_proj.weight"][kv_rows], "out_proj.weight": full["out_proj.weight"][:, q_rows],
           "out_proj.bias": full["out_proj.bias"]}
    if attn.q_proj.bias is not None:
        out |= {"q_proj.bias": full["q_proj.bias"][q_rows], "k_proj.bias": full["k_proj.bias"][kv_rows],
                "v_proj.bias": full["v_proj.bias"][kv_rows]}
    # Per-head Q/K norms: every shard holds them whole, read by all its heads over all tokens.
    return out | {n: g for n, g in full.items() if n.startswith(("q_norm.", "k_norm."))}


def test_slices_and_every_gradient_equal_one_process_on_the_whole_sequence(world):
    world_size, ranks = world
    checked = learnable_masks = 0
    for spec in worker.SCENARIOS[world_size]:
        sp_size = ranks[0][spec["name"]]["sp_size"]
        for phase in spec["phases"]:
            attn, y_ref, x_grad_ref, extra_ref = _reference(spec, phase)
            tag = f"{spec['name']}/{phase['name']}"
            # Every group of sp ranks (one per tp shard) re-assembles the whole output and input gradient.
            groups: dict[int, list[dict]] = {}
            for res in ranks:
                groups.setdefault(res[spec["name"]]["tp_rank"], []).append(res[spec["name"]])
            for members in groups.values():
                members.sort(key=lambda m: m["sp_rank"])
                assert [m["sp_rank"] for m in members] == list(range(sp_size))
                got = [m[phase["name"]] for m in members]
                torch.testing.assert_close(torch.cat([g["y"] for g in got], dim=1), y_ref, msg=lambda m: f"{tag}: {m}")
                torch.testing.assert_close(torch.cat([g["x_grad"] for g in got], dim=1), x_grad_ref,
                                           msg=lambda m: f"{tag} dx: {m}")
                for name, want in extra_ref.items():  # context / key / value gradients, slice by slice
                    if name == "mask_grad":
                        continue
                    torch.testing.assert_close(torch.cat([g[name] for g in got], dim=1), want,
                                               msg=lambda m: f"{tag} {name}: {m}")
            mask_grads = [res[spec["name"]][phase["name"]]["mask_grad"] for res in ranks]
            if "mask_grad" not in extra_ref:
                assert mask_grads == [None] * len(ranks), tag
            elif spec.get("grad_reduction") == "none":  # each rank's heads' part, like the weights'
                torch.testing.assert_close(sum(mask_grads), extra_ref["mask_grad"], msg=lambda m: f"{tag}: {m}")
                assert not torch.allclose(mask_grads[0], extra_ref["mask_grad"]), tag
            else:  # a learnable score bias: its whole gradient on every rank
                for r, g in enumerate(mask_grads):
                    torch.testing.assert_close(g, extra_ref["mask_grad"], msg=lambda m: f"{tag} rank {r} dmask: {m}")
                learnable_masks += 1
            for r, res in enumerate(ranks):
                want = _expected_grads(spec, attn, res[spec["name"]])
                grads = res[spec["name"]][phase["name"]]["grads"]
                assert set(grads) == set(want), tag
                if spec.get("grad_reduction") == "none":
                    continue
                for name, g in grads.items():
                    torch.testing.assert_close(g, want[name], msg=lambda m: f"{tag} rank {r} {name}: {m}")
            if spec.get("grad_reduction") == "none":  # each rank holds its tokens' part: they sum to the whole
                for name, g in want.items():
                    total = sum(res[spec["name"]][phase["name"]]["grads"][name] for res in ranks)
                    torch.testing.assert_close(total, g, msg=lambda m: f"{tag} sum of {name}: {m}")
                    assert not torch.allclose(ranks[0][spec["name"]][phase["name"]]["grads"][name], g)
            checked += 1
    assert checked >= 13 and learnable_masks >= 1


def test_parameters_made_trainable_or_replaced_after_building_get_the_single_process_gradient(ranks2):
    spec = worker.LATE
    attn, _, _, _ = _reference(spec, worker.CAUSAL)
    want = {n: p.grad for n, p in attn.named_parameters()}
    for r, res in enumerate(ranks2):
        assert "traceback" not in res, res["traceback"]
        for workflow in ("unfrozen", "assigned"):
            grads = res["late_trainable"][workflow]
            assert set(grads) == set(want), workflow
            for name, g in grads.items():
                torch.testing.assert_close(g, want[name], msg=lambda m: f"{workflow} rank {r} {name}: {m}")


def test_the_plan_names_each_ranks_heads(world):
    world_size, ranks = world
    for spec in worker.SCENARIOS[world_size]:
        h, h_kv = spec["n_heads"], spec["n_kv_heads"]
        for res in ranks:
            got = res[spec["name"]]
            tp = 2 if spec.get("mesh") else 1
            sp = world_size // tp
            shard = h // tp
            counts = [shard // sp + (1 if r < shard % sp else 0) for r in range(sp)]
            start = got["tp_rank"] * shard + sum(counts[:got["sp_rank"]])
            assert list(got["heads"]) == list(range(start, start + counts[got["sp_rank"]]))
            assert f"query heads={list(got['heads'])}" in got["repr"]
            assert f"sequence parallel over {sp} ranks (tp {tp})" in got["describe"]
            assert ("replicated" in got["describe"].split("\n")[0]) == (h_kv // tp < sp or (h_kv // tp) % sp != 0)


def _bytes_formula(spec: dict, world_size: int) -> tuple[int, int]:
    """(bytes sent to other ranks, bytes handed to the all-to-alls) per rank in one forward, written out."""
    h, h_kv, d_h = spec["n_heads"], spec["n_kv_heads"], spec["d_model"] // spec["n_heads"]
    row = worker.B * spec["s_local"] * d_h * 8  # one head of a local slice, float64
    kv_per_rank = h_kv // world_size if h_kv % world_size == 0 else 1  # (world_size % h_kv == 0 here)
    q_out = 2 * h * row  # Q in, the output back: all heads of the slice, one block per rank
    kv = 2 * kv_per_rank * world_size * row
    return (q_out + kv) * (world_size - 1) // world_size, q_out + kv


def test_all_to_all_bytes_match_the_closed_form_and_do_not_grow_with_p_for_mha(ranks2, ranks4):
    sent_mha = {}
    for world_size, ranks in ((2, ranks2), (4, ranks4)):
        for spec in (worker.BYTES, worker.BYTES_MQA):
            sent, buffer = _bytes_formula(spec, world_size)
            for res in ranks:
                got = res[spec["name"]]
                assert got["calls"] == (4, 4)  # Q, K, V, output; their gradients back
                assert got["forward_sent"] == got["backward_sent"] == sent
                assert got["forward_buffer"] == buffer
                assert got["plan_bytes"]["forward"] == got["plan_bytes"]["backward"] == sent
            if spec is worker.BYTES:
                sent_mha[world_size] = sent
                bound = 4 * spec["n_heads"] * worker.B * spec["s_local"] * (spec["d_model"] // spec["n_heads"]) * 8
                assert buffer == bound  # independent of P at fixed s/P; the wire bytes are (P-1)/P of it
    assert sent_mha[2] < sent_mha[4] < 4 * worker.B * 4 * 32 * 8


def test_all_to_all_bytes_of_every_rank_equal_the_bytes_it_hands_over_each_way(world):
    """The plan's count and parallel_costs' largest count against the bytes each rank handed to
    all_to_all_single for other ranks, forward and backward, with uneven head counts (6 heads on 4 ranks)."""
    from headwise import AttentionConfig
    from headwise.analysis.parallel import parallel_costs

    world_size, ranks = world
    spec = worker.BYTES_UNEVEN
    counted = [(res[spec["name"]]["forward_sent"], res[spec["name"]]["backward_sent"]) for res in ranks]
    for r, res in enumerate(ranks):
        plan = res[spec["name"]]["plan_bytes"]
        assert (plan["forward"], plan["backward"]) == counted[r], (r, plan, counted[r])
    cfg = AttentionConfig(d_model=spec["d_model"], n_heads=spec["n_heads"], n_kv_heads=spec["n_kv_heads"])
    costs = parallel_costs(cfg, spec["s_local"] * world_size, world_size, batch=worker.B, dtype=torch.float64)["sp"]
    assert (costs["sent_forward"], costs["sent_backward"]) == tuple(max(c) for c in zip(*counted))
    if world_size == 4:  # the case that tells the two directions apart
        assert any(f != b for f, b in counted)


def test_qkv_context_closed_form_counts_the_heads_each_rank_attends_with(world):
    """parallel_costs' "Q, K, V, context" bytes against the shapes the layer hands to attention on each rank
    (K/V repeated per query head where a rank's heads do not follow the plain GQA pattern; uneven slices
    unpadded)."""
    from math import prod

    from headwise import AttentionConfig
    from headwise.analysis.parallel import parallel_costs

    world_size, ranks = world
    checked = []
    for spec in worker.SCENARIOS[world_size]:
        if spec.get("mesh") or spec.get("s_kv") or worker.CAUSAL not in spec["phases"]:
            continue  # the closed form is for self-attention on a 1-D group
        cfg = AttentionConfig(d_model=spec["d_model"], n_heads=spec["n_heads"], n_kv_heads=spec["n_kv_heads"])
        held = []
        for res in ranks:
            ((q, k, v),) = res[spec["name"]]["causal"]["attend_shapes"]
            assert q[2] == k[2] == v[2] == spec["s"]  # the whole sequence of this rank's heads
            held.append(2 * prod(q) + prod(k) + prod(v))  # Q and the context have Q's shape
        costs = parallel_costs(cfg, spec["s"], world_size, batch=worker.B, dtype=torch.float64)["sp"]
        assert costs["qkv_context"] == max(held) * 8, spec["name"]  # float64; the padding is gone by then
        checked.append(spec["s"])
    assert len(checked) >= 3 and any(s % world_size for s in checked)  # uneven slices among them


def test_peak_memory_per_rank_stays_flat_in_p_at_fixed_tokens_per_rank(ranks2, ranks4):
    spec = worker.PEAK
    p2, p4 = max(r["peak"] for r in ranks2), max(r["peak"] for r in ranks4)
    attn, inp = worker.build(dict(spec, s=spec["s_local"] * 4))
    whole = worker.peak_bytes(attn, inp["x"].clone().requires_grad_())  # one process, the 4-rank sequence
    d_h = spec["d_model"] // spec["n_heads"]
    gathered = 4 * worker.B * spec["s_local"] * spec["n_heads"] * d_h * 8  # Q, K, V, context of a rank's heads
    assert abs(p4 - p2) <= 0.1 * p2, (p2, p4)  # same tokens per rank: same memory, whatever P
    assert p4 >= gathered  # it does hold the whole sequence of its heads
    assert whole > 2 * p4, (whole, p4)


def test_impossible_layout_refused_on_one_rank_before_any_communication(world):
    world_size, ranks = world
    msg = ranks[0]["refusals"]["invalid"]
    assert f"fewer than sp={world_size}" in msg and "valid (sp, tp) layouts" in msg or "no (sp, tp) layout" in msg


def test_ranks_that_disagree_all_get_the_same_error(world):
    world_size, ranks = world
    errors = [res["refusals"]["mismatch"] for res in ranks]
    assert len(set(errors)) == 1
    assert f"batch sizes differ by rank: [1{', 2' * (world_size - 1)}]" in errors[0]


def test_a_rank_that_never_joins_gives_a_clear_timeout_error(ranks2):
    got = ranks2[0]["timeout"]
    assert "all-to-all" in got["timeout"] or "exchange of call signatures" in got["timeout"]
    assert "did not complete within the process group's timeout" in got["timeout"]
    assert got["timeout_s"] < 25  # the group's 2 s, not the default group's 30 s nor torch's 30 minutes


def test_needs_an_initialised_group_and_a_headwise_layer():
    with pytest.raises(RuntimeError, match="init_process_group"):
        sequence_parallel(MultiHeadAttention(16, 4))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        sequence_parallel(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        sequence_parallel(MultiHeadAttention(16, 4), grad_reduction="mean")


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_unbatched_input_and_bad_masks(one_rank_group):
    attn, inp = worker.build(worker.SCENARIOS[2][2])  # MQA with rotary
    sp = sequence_parallel(attn)
    x = inp["x"][0]  # (s, d): unbatched
    torch.testing.assert_close(sp(x, causal=True, positions=inp["positions"][1]),
                               attn(x, causal=True, positions=inp["positions"][1]))
    with pytest.raises(ValueError, match="does not broadcast to"):
        sp(inp["x"], mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="rotary embeddings apply to self-attention only"):
        sp(inp["x"], inp["x"])
    with pytest.raises(ValueError, match=r"^positions are on meta, but the inputs are on cpu$"):
        sp(inp["x"], causal=True, positions=inp["positions"].to("meta"))
    plain = sequence_parallel(MultiHeadAttention(16, 4, dtype=worker.DTYPE))
    with pytest.raises(ValueError, match="positions= is for rotary layers"):
        plain(inp["x"], positions=torch.arange(inp["x"].shape[1]))
    with pytest.raises(TypeError, match="already sequence-parallel"):
        sequence_parallel(sp)
    sp.grad_reduction = "mean"  # set after building: refused at the call, as at construction
    with pytest.raises(ValueError, match=r"^grad_reduction must be one of \('sum', 'none'\), got 'mean'$"):
        sp(x, causal=True)
    sp.grad_reduction = "sum"
    assert sp.layer is not attn and all(p is not q for p, q in zip(sp.parameters(), attn.parameters()))


def test_summed_weight_gradients_own_exactly_their_storage(world):
    """A gradient summed over the ranks keeps no larger buffer alive behind its ``.grad``."""
    world_size, ranks = world
    checked = learnable_masks = 0
    for spec in worker.SCENARIOS[world_size]:
        if spec.get("grad_reduction") == "none":
            continue
        for r, res in enumerate(ranks):
            for name, (held, own) in res[spec["name"]][spec["phases"][0]["name"]]["grad_storage"].items():
                assert held == own, f"{spec['name']} rank {r} {name}: .grad keeps {held} bytes alive for {own}"
                checked += 1
    assert checked >= 40


def test_replica_gradient_sum_equals_the_sum_over_each_slots_ranks(ranks2):
    """SumOverReplicas alone, on 2 ranks: one slot (both ranks summed), both ranks in one slot of three, and
    each rank in a slot of its own (nothing summed); the gradients own their storage, and with one slot the
    backward holds no more than the incoming gradients and one summed copy."""
    upstream = [worker.replica_upstream(r) for r in range(2)]
    for r, res in enumerate(ranks2):
        assert "traceback" not in res, res["traceback"]
        for (n_slots, *slots), got in res["replica_sums"].items():
            peers = [q for q in range(2) if slots[q] == slots[r]]
            for i, g in enumerate(got["grads"]):
                want = sum(upstream[q][i] for q in peers)
                torch.testing.assert_close(g, want, rtol=0, atol=0, msg=lambda m: f"slots {slots} rank {r}: {m}")
            if n_slots == 1:
                grad_bytes = sum(own for _, own in got["storage"])
                assert got["peak"] <= 2 * grad_bytes + 1024, (got["peak"], grad_bytes)
            assert all(held == own for held, own in got["storage"]), (n_slots, slots, got["storage"])
            weight, bias = got["mixed"]
            n = float(len(peers))
            torch.testing.assert_close(weight, torch.full((8,), n, dtype=torch.bfloat16), rtol=0, atol=0)
            want = torch.full((8,), worker.MIXED_BIAS_GRAD, dtype=torch.float32) * n
            torch.testing.assert_close(bias, want, rtol=0, atol=0)
