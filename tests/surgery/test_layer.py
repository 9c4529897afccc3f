"""Surgery on bare headwise layers, against float64 references written from the formula."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention, RotaryEmbedding
from headwise.surgery import ablation_importance, gradient_importance, prune_heads, similarity_groups, to_gqa, to_mha
from headwise.surgery.layers import read
from tests.surgery.reference import attention, weights


def layer(h=6, h_kv=2, d=24, **kw):
    attn = MultiHeadAttention(d_model=d, n_heads=h, n_kv_heads=h_kv, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-zero biases
    return attn


@pytest.mark.parametrize("drop", [[1], [0, 1, 2], [0, 4], [5, 3, 1], [0, 1, 2, 3, 4]])
def test_pruning_equals_zero_ablation_float64(drop):
    attn = layer()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    gate = torch.ones(6, dtype=torch.float64)
    gate[drop] = 0
    want = attention(weights(attn), x, 6, 2, 4, gate=gate, causal=True)
    small = prune_heads(attn, drop)
    assert small.n_heads == 6 - len(drop) and attn.n_heads == 6  # the original is untouched
    torch.testing.assert_close(small(x, causal=True), want)


@pytest.mark.parametrize("drop, n_kv", [([0, 1, 2], 1), ([1], 5), ([0, 3, 4], 3), ([1, 4], 2)])
def test_kv_heads_go_only_with_their_whole_group(drop, n_kv):
    # groups {0,1,2}, {3,4,5}; unequal survivors are split exactly into sub-groups of their gcd size
    small = prune_heads(layer(), drop)
    assert (small.n_heads, small.n_kv_heads) == (6 - len(drop), n_kv)


def test_regroup_deals_survivors_into_equal_groups_with_mean_kv():
    attn = layer(h=8, h_kv=2, d=32)  # groups {0..3}, {4..7}; drop 0, 1 -> survivors 2..7 -> [2,3,4], [5,6,7]
    small = prune_heads(attn, [0, 1], regroup=True)
    assert (small.n_heads, small.n_kv_heads) == (6, 2)
    k = attn.k_proj.weight.detach().reshape(2, 4, 32)
    want = torch.cat([(2 * k[0] + k[1]) / 3, k[1]])  # [2,3,4] read kv 0,0,1; [5,6,7] read kv 1
    torch.testing.assert_close(small.k_proj.weight, want)
    with pytest.raises(ValueError, match="does not divide"):
        prune_heads(attn, [0], regroup=True)  # 7 survivors, 2 groups


def test_pruning_every_head_gives_bias_only():
    attn = layer()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    empty = prune_heads(attn, range(6))
    torch.testing.assert_close(empty(x), attn.out_proj.bias.detach().expand(2, 5, 24))
    no_bias = prune_heads(layer(bias=False), list(range(6)))
    assert torch.equal(no_bias(x), torch.zeros(2, 5, 24, dtype=torch.float64))


@pytest.mark.parametrize("surgery", [lambda a: prune_heads(a, [1, 4]), lambda a: to_gqa(a, 1)], ids=["prune", "to_gqa"])
def test_new_projections_keep_the_requires_grad_of_their_own_weight_and_bias(surgery):
    attn, x = layer(), torch.randn(2, 5, 24, dtype=torch.float64)
    flags = {"q_proj": (True, True), "k_proj": (True, False), "v_proj": (False, True), "out_proj": (False, False)}
    for name, (w, b) in flags.items():  # every weight/bias combination, one per projection (a frozen bias, BitFit)
        getattr(attn, name).weight.requires_grad_(w), getattr(attn, name).bias.requires_grad_(b)
    small = surgery(attn)
    small(x).sum().backward()  # the parameters a training step would update: exactly the trainable ones
    for name, (w, b) in flags.items():
        proj = getattr(small, name)
        assert (proj.weight.requires_grad, proj.bias.requires_grad) == (w, b), name
        assert (proj.weight.grad is not None, proj.bias.grad is not None) == (w, b), name


def test_pruned_layer_keeps_rotary_cache_trace_and_heads():
    attn = layer(rotary=RotaryEmbedding(4))
    small = prune_heads(attn, [0, 4])
    x = torch.randn(1, 7, 24, dtype=torch.float64)
    with headwise.trace(attn, edit={(0, 0): "zero", (0, 4): "zero"}):
        want = attn(x, causal=True)  # the unpruned layer with those contexts zeroed, rotary included
    torch.testing.assert_close(small(x, causal=True), want)
    cache = small.new_cache(1, 7)
    steps = [small(x[:, :4], cache=cache)] + [small(x[:, t:t + 1], cache=cache) for t in (4, 5, 6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), want)
    with headwise.trace(small, capture=("z",)) as t:
        small(x)
    assert t[0].z.shape == (1, 7, 4, 4)
    torch.testing.assert_close(small.head(1).w_q, attn.head(2).w_q)


def test_module_with_layers_pruned_in_place_per_layer_counts():
    model = torch.nn.Sequential(layer(), layer())
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    with headwise.trace(model, edit={(0, 1): "zero", (1, 0): "zero", (1, 5): "zero", (1, 2): "zero"}):
        want = model(x)
    assert prune_heads(model, {0: [1], 1: [0, 5, 2]}) is model
    assert [m.n_heads for m in model] == [5, 3]
    torch.testing.assert_close(model(x), want)


def test_to_gqa_mean_pool_equals_hand_written_reference():
    attn = layer(h=6, h_kv=6)
    w = weights(attn)
    pooled = dict(w)
    for name in ("k_proj", "v_proj"):
        pooled[name + ".w"] = w[name + ".w"].reshape(3, 2, 4, 24).mean(1).reshape(12, 24)
        pooled[name + ".b"] = w[name + ".b"].reshape(3, 2, 4).mean(1).reshape(12)
    gqa = to_gqa(attn, 3)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(gqa.k_proj.weight, pooled["k_proj.w"])
    torch.testing.assert_close(gqa(x), attention(pooled, x, 6, 3, 4))


@pytest.mark.parametrize("groups", ["consecutive", "similarity"])
def test_to_mha_after_to_gqa_is_exact(groups):
    attn = layer(h=6, h_kv=6)
    gqa = to_gqa(attn, 2, groups=groups)
    mha = to_mha(gqa)
    assert (gqa.n_kv_heads, mha.n_kv_heads) == (2, 6)
    assert torch.equal(mha.k_proj.weight, gqa.k_proj.weight.reshape(2, 1, 4, 24).expand(2, 3, 4, 24).reshape(24, 24))
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(mha(x), gqa(x))


def test_similarity_groups_find_identical_kv_heads():
    attn = layer(h=4, h_kv=4, d=16)
    with torch.no_grad():  # heads 0 and 2, 1 and 3 share K and V: pooling them loses nothing
        for p in (attn.k_proj.weight, attn.v_proj.weight, attn.k_proj.bias, attn.v_proj.bias):
            p[8:12] = p[0:4]
            p[12:16] = p[4:8]
    assert similarity_groups(read(attn), 2) == [[0, 2], [1, 3]]
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(to_gqa(attn, 2, groups="similarity")(x), attn(x))
    assert not torch.allclose(to_gqa(attn, 2)(x), attn(x))  # consecutive groups do lose something here


def _metric(y):
    return (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().sin()


def test_gradient_importance_equals_autograd_on_explicit_gate():
    model = torch.nn.Sequential(layer(), layer(h=4, h_kv=4))
    batches = [torch.randn(2, 5, 24, dtype=torch.float64) for _ in range(2)]
    got = gradient_importance(model, batches, _metric)
    want = torch.zeros(2, 6, dtype=torch.float64)
    for x in batches:
        g0 = torch.ones(6, dtype=torch.float64, requires_grad=True)
        g1 = torch.ones(4, dtype=torch.float64, requires_grad=True)
        y = attention(weights(model[1]), attention(weights(model[0]), x, 6, 2, 4, gate=g0), 4, 4, 6, gate=g1)
        d0, d1 = torch.autograd.grad(_metric(y), (g0, g1))
        want[0] += d0.abs() / 2
        want[1, :4] += d1.abs() / 2
    want[1, 4:] = float("nan")
    torch.testing.assert_close(got, want, equal_nan=True)
    norm = gradient_importance(model, batches, _metric, normalize=True)
    torch.testing.assert_close(norm[0], want[0] / want[0].norm())


def test_ablation_importance_equals_reference():
    attn = layer()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    got = ablation_importance(attn, x, _metric)
    base = _metric(attention(weights(attn), x, 6, 2, 4))
    want = torch.stack([_metric(attention(weights(attn), x, 6, 2, 4, gate=torch.ones(6).index_fill(0, torch.tensor(i), 0)
                                          .double())) - base for i in range(6)])
    torch.testing.assert_close(got[0], want)


@pytest.mark.parametrize("call, exc, match", [
    (lambda a: prune_heads(a, [6]), ValueError, r"in \[0, 6\).*got 6"),
    (lambda a: prune_heads(a, [-1]), ValueError, r"in \[0, 6\).*got -1"),
    (lambda a: prune_heads(a, [1, 1]), ValueError, "more than once"),
    (lambda a: prune_heads(a, [1.0]), TypeError, "must be ints, got float"),
    (lambda a: prune_heads(a, {3: [0]}), ValueError, r"layer position must be in \[-1, 1\).*got 3"),
    (lambda a: prune_heads(a, {"encoder": [0]}), ValueError, "no layer is named 'encoder'"),
    (lambda a: prune_heads(a, [0], regroup=1), TypeError, "regroup must be a bool"),
    (lambda a: to_gqa(a, 4), ValueError, r"must divide n_heads=6; valid: \[1, 2, 3, 6\], got 4"),
    (lambda a: to_gqa(a, 0), ValueError, "must divide"),
    (lambda a: to_gqa(a, 2.0), TypeError, "n_kv_heads must be an int, got float"),
    (lambda a: to_gqa(a, 2, groups="nearest"), ValueError, "groups must be"),
    (lambda a: to_gqa(a, 2, groups=[[0, 1, 2], [3, 4, 4]]), ValueError, "covering heads"),
    (lambda a: to_gqa(a, 2, groups=[[0, 1, 2], [3, 4, 5.0]]), TypeError,
     r"group members must be int head indices, got float \(5\.0\)"),
    (lambda a: to_gqa(a, 2, groups=[[0.9, 1, 2], [3, 4, 5]]), TypeError, r"got float \(0\.9\)"),
    (lambda a: to_gqa(a, 2, groups=[[True, 1, 2], [3, 4, 5]]), TypeError, r"got bool \(True\)"),
    (lambda a: to_gqa(a, 2, groups=[[0, 1, 2], 3]), TypeError, "groups must be a list of lists of head indices"),
    (lambda a: prune_heads("attn", [0]), TypeError, "expected a MultiHeadAttention"),
])
def test_bad_input_names_expected_and_received_and_changes_nothing(call, exc, match):
    attn = layer()
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    with pytest.raises(exc, match=match):
        call(attn)
    assert attn.config.n_heads == 6 and all(torch.equal(before[k], v) for k, v in attn.state_dict().items())


def test_failed_model_call_changes_no_layer():
    model = torch.nn.Sequential(layer(), layer())
    with pytest.raises(ValueError, match="got 9"):
        prune_heads(model, {0: [1], 1: [9]})  # layer 0 was valid: it must not be pruned either
    assert [m.n_heads for m in model] == [6, 6]


def test_to_gqa_with_explicit_groups_pools_those_heads():
    attn = layer(h=4, h_kv=4, d=16)
    gqa = to_gqa(attn, 2, groups=[[0, 3], [1, 2]])
    w = attn.k_proj.weight.detach().reshape(4, 4, 16)
    torch.testing.assert_close(gqa.k_proj.weight, torch.cat([(w[0] + w[3]) / 2, (w[1] + w[2]) / 2]))
    torch.testing.assert_close(gqa.q_proj.weight, attn.q_proj.weight.reshape(4, 4, 16)[[0, 3, 1, 2]].reshape(16, 16))


@pytest.mark.parametrize("call, exc, match", [
    (lambda a, x: gradient_importance(a, [], _metric), ValueError, "empty list"),
    (lambda a, x: gradient_importance(a, x, lambda y: y.sum(-1)), ValueError, r"one-element tensor.*shape \(2, 5\)"),
    (lambda a, x: ablation_importance(a, x, lambda y: 3), ValueError, "one floating number"),
    (lambda a, x: similarity_groups(a, 4), ValueError, "must divide n_heads=6"),
    (lambda a, x: similarity_groups("a", 2), TypeError, "expected a MultiHeadAttention, got str"),
])
def test_importance_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(layer(), torch.randn(2, 5, 24, dtype=torch.float64))


def test_to_gqa_to_the_same_grouping_is_exact_and_empty_pruning_is_a_no_op():
    attn = layer()
    same = to_gqa(attn, 2)
    assert all(torch.equal(a, b) for a, b in zip(attn.state_dict().values(), same.state_dict().values()))


@pytest.mark.parametrize("call", [lambda a: prune_heads(a, []), lambda a: prune_heads(a, {0: []}),
                                  lambda a: to_mha(a), lambda a: to_mha(a, layers=[])],
                         ids=["prune nothing", "prune nothing by layer", "to_mha of MHA", "to_mha of no layer"])
def test_a_surgery_that_changes_nothing_still_returns_a_copy(call):
    attn = layer(h=4, h_kv=4, d=16)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    want = attn(x)
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    copy = call(attn)
    assert copy is not attn and type(copy) is type(attn) and copy.config == attn.config
    shared = {p.data_ptr() for p in attn.parameters()} & {p.data_ptr() for p in copy.parameters()}
    assert not shared  # no weight is shared with the original
    torch.testing.assert_close(copy(x), want, rtol=0, atol=0)
    with torch.no_grad():
        for p in copy.parameters():
            p.zero_()  # editing the copy leaves the original as it was
    assert all(torch.equal(before[k], v) for k, v in attn.state_dict().items())


def test_a_sharded_layer_is_refused():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a running process group")
    from headwise.parallel import tensor_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tp = tensor_parallel(layer())
        with pytest.raises(TypeError, match="already hold only this rank's heads"):
            prune_heads(tp, [0])
    finally:
        dist.destroy_process_group()


def test_a_view_sharing_a_torch_module_is_refused_saying_to_copy_it_and_the_copy_prunes():
    # from_torch(m, share=True) cannot change m's head count in place; the refusal says so (not "a patched Hugging
    # Face module" nor "an adapter wrapper"), bare or inside a module, and m is untouched.
    from torch import nn

    from headwise.interop import from_torch

    m = nn.MultiheadAttention(8, 4, batch_first=True, dtype=torch.float64).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    view = from_torch(m, share=True)
    for target, ref in ((view, [0]), (nn.Sequential(view), {0: [0]})):
        with pytest.raises(TypeError, match=r"view sharing an nn\.MultiheadAttention's parameters \(from_torch\(m, "
                                            r"share=True\)\).*take a copy with from_torch\(m\) \(without share\)"):
            prune_heads(target, ref)
        with pytest.raises(TypeError, match="view sharing an nn.MultiheadAttention's parameters"):
            to_gqa(target, 2)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    x = torch.randn(2, 5, 8, dtype=torch.float64)  # the advice works: the copy prunes to the zero-ablated layer
    gate = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    want = attention(weights(view), x, 4, 4, 2, gate=gate)
    torch.testing.assert_close(prune_heads(from_torch(m), [0])(x), want)


# -- layers in a module: shared layers, hooks; index types; an emptied layer ------------------------------------
class Shared(torch.nn.Module):
    """One attention layer applied three times (weights shared, as a universal transformer does)."""

    def __init__(self, attn):
        super().__init__()
        self.blocks = torch.nn.ModuleList([attn] * 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def zero_heads_before_w_o(attn, heads, d_h):
    """A plain forward pre-hook on W_O zeroing the heads' slices of its input: the zero-ablated layer."""
    def hook(module, args):
        z = args[0].clone()
        for i in heads:
            z[..., i * d_h:(i + 1) * d_h] = 0
        return (z,)
    attn.out_proj.register_forward_pre_hook(hook)


def test_a_layer_registered_under_several_names_is_replaced_under_every_name():
    torch.manual_seed(0)
    model = Shared(layer())
    ablated = Shared(layer())
    ablated.load_state_dict(model.state_dict())
    zero_heads_before_w_o(ablated.blocks[0], [1, 4], 4)  # the one shared W_O: every application
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    assert prune_heads(model, {"blocks.2": [1, 4]}) is model  # any of its names addresses it
    assert model.blocks[0] is model.blocks[1] is model.blocks[2]
    assert model.blocks[2].n_heads == 4
    torch.testing.assert_close(model(x), ablated(x))
    to_gqa(model, 1)
    assert model.blocks[0] is model.blocks[1] is model.blocks[2] and model.blocks[1].n_kv_heads == 1


def test_hooks_of_a_replaced_layer_go_with_its_replacement_and_their_handles_remove_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(layer(), layer())
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    seen = []
    post = model[0].register_forward_hook(lambda mod, args, out: seen.append((mod, out)))
    pre = model[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    prune_heads(model, {0: [0]})
    new = model[0]
    model(x)
    assert len(seen) == 1 and seen[0][0] is new  # the hook runs on the new layer, its pre-hook too
    w = weights(new)
    torch.testing.assert_close(seen[0][1], attention(w, 2 * x, 5, new.n_kv_heads, 4))
    post.remove()
    pre.remove()  # the handles the user holds reach the new layer's hooks
    model(x)
    assert len(seen) == 1 and not new._forward_hooks and not new._forward_pre_hooks
    torch.testing.assert_close(new(x), attention(w, x, 5, new.n_kv_heads, 4))


@pytest.mark.parametrize("make", [lambda np: torch.tensor([3, 1]), lambda np: np.array([3, 1]),
                                  lambda np: torch.tensor(1), lambda np: np.int64(1),
                                  lambda np: [np.int32(3), torch.tensor(1)]],
                         ids=["tensor", "numpy array", "0-d tensor", "np.int64", "mixed list"])
def test_head_indices_may_be_integer_tensors_and_numpy_integers(make):
    heads = make(pytest.importorskip("numpy"))  # what argsort of an importance score gives
    drop = [3, 1] if isinstance(heads, list) or getattr(heads, "ndim", 0) == 1 else [1]
    attn = layer()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    gate = torch.ones(6, dtype=torch.float64)
    gate[drop] = 0
    small = prune_heads(attn, heads)
    assert small.n_heads == 6 - len(drop)
    torch.testing.assert_close(small(x), attention(weights(attn), x, 6, 2, 4, gate=gate))


@pytest.mark.parametrize("heads, match", [
    (torch.tensor([1.0, 2.0]), "head indices must be ints, got Tensor"),
    (torch.tensor([True, False, True, False, False, False]), "got a bool .*mask.nonzero"),
    (torch.tensor(True), "got a bool"),
    ([torch.tensor([1])], r"got a tensor of shape \(1,\)"),
    (torch.tensor([[1, 2]]), r"1-d list of indices, got a 2-d Tensor of shape \(1, 2\)"),
])
def test_float_bool_and_2d_head_indices_are_refused(heads, match):
    attn = layer()
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    model = torch.nn.Sequential(attn)
    with pytest.raises(TypeError, match=match):
        prune_heads(model, {0: heads})
    assert model[0] is attn and all(torch.equal(before[k], v) for k, v in attn.state_dict().items())


@pytest.mark.parametrize("normalize", ["no", 1, None])
def test_gradient_importance_takes_only_a_bool_normalize(normalize):
    with pytest.raises(TypeError, match=f"normalize must be True or False, got {type(normalize).__name__}"):
        gradient_importance(layer(), torch.randn(2, 3, 24, dtype=torch.float64), lambda y: y.square().mean(),
                            normalize=normalize, progress=False)


def test_to_gqa_on_a_module_with_an_emptied_layer_keeps_its_placeholder():
    torch.manual_seed(0)
    model = torch.nn.Sequential(layer(h=6, h_kv=6), layer(h=6, h_kv=6))
    prune_heads(model, {0: list(range(6))})  # layer 0: one zero placeholder head
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    w = weights(model[1])
    for name in ("k_proj", "v_proj"):  # by hand: K/V heads {0, 1, 2} and {3, 4, 5} mean-pooled
        w[name + ".w"] = w[name + ".w"].reshape(2, 3, 4, 24).mean(1).reshape(8, 24)
        w[name + ".b"] = w[name + ".b"].reshape(2, 3, 4).mean(1).reshape(8)
    to_gqa(model, 1, layers=0)
    to_gqa(model, 1, layers=0, groups="similarity")
    with pytest.raises(ValueError, match=r"layer 0 .*must divide n_heads=1; valid: \[1\], got 2"):
        to_gqa(model, 2)  # every layer: the placeholder has 1 head, so 2 K/V heads is refused there
    assert model[1].n_kv_heads == 6  # refused before anything changed
    to_gqa(model, 2, layers=1)
    assert headwise.surgery.original_heads(model) == [(), (0, 1, 2, 3, 4, 5)]
    assert (model[0].n_heads, model[0].n_kv_heads) == (1, 1)
    torch.testing.assert_close(model[0](x), model[0].out_proj.bias.detach().expand(2, 5, 24))
    torch.testing.assert_close(model[1](x), attention(w, x, 6, 2, 4))
    to_gqa(model, 1)
    assert [m.n_kv_heads for m in model] == [1, 1] and headwise.surgery.original_heads(model)[0] == ()
