"""One token at a time: the forward's one-token route and DecodeStep give the general forward's tokens bit for bit,
and the forward's errors."""

from __future__ import annotations

import types

import pytest
import torch

import headwise
from headwise import DecodeStep, MultiHeadAttention, RotaryEmbedding
from headwise import functional as hwf
from headwise.plan import plan_attention
from headwise.token_step import PLAN_KEY, QUERY_PLAN_KEY, one_token
from tests.reference import reference_mha


def _layer(h: int, h_kv: int, rotary: bool = False, dtype=torch.float32) -> MultiHeadAttention:
    torch.manual_seed(0)
    rope = RotaryEmbedding(8) if rotary else None
    return MultiHeadAttention(8 * h, h, h_kv, rotary=rope, dtype=dtype).eval()


class GeneralRoute(MultiHeadAttention):
    """The same layer as a subclass: the forward's general route at every call (the one-token route serves the
    layer's own class only, as a subclass may override any step)."""


def _general_twin(attn: MultiHeadAttention) -> MultiHeadAttention:
    twin = GeneralRoute(config=attn.config, rotary=attn.rotary, dtype=attn.q_proj.weight.dtype).eval()
    twin.load_state_dict(attn.state_dict())
    return twin


@pytest.mark.parametrize("h, h_kv, rotary, bias", [(4, 4, False, True), (4, 2, False, False), (4, 1, False, True),
                                                   (4, 1, True, True), (2, 2, True, False)])
def test_one_token_calls_and_steps_equal_the_general_forward_bit_for_bit(h, h_kv, rotary, bias):
    torch.manual_seed(0)
    attn = MultiHeadAttention(8 * h, h, h_kv, bias=bias, rotary=RotaryEmbedding(8) if rotary else None).eval()
    general = _general_twin(attn)
    x = torch.randn(3, 9, attn.d_model)
    by_general, by_forward, by_step = general.new_cache(3, 12), attn.new_cache(3, 12), attn.new_cache(3, 12)
    step = DecodeStep(attn, by_step)
    with torch.no_grad():
        want = [general(x[:, :5], cache=by_general)] + [general(x[:, t:t + 1], cache=by_general)
                                                         for t in range(5, 9)]
        got_forward = [attn(x[:, :5], cache=by_forward)] + [attn(x[:, t:t + 1], cache=by_forward)
                                                             for t in range(5, 9)]
        got_step = [attn(x[:, :5], cache=by_step)] + [step(x[:, t:t + 1]) for t in range(5, 9)]
    for got, cache in ((got_forward, by_forward), (got_step, by_step)):
        torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=0, atol=0)
        torch.testing.assert_close(cache.keys[:, :, :9], by_general.keys[:, :, :9], rtol=0, atol=0)
        torch.testing.assert_close(cache.values[:, :, :9], by_general.values[:, :, :9], rtol=0, atol=0)
        assert cache.length == by_general.length == 9
    assert (PLAN_KEY in attn.__dict__) is not rotary  # the short route ran exactly where it serves


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
@pytest.mark.parametrize("b, sliced", [(3, True), (5, False), (1, True)])
def test_the_one_token_route_equals_the_general_forward_bit_for_bit_in_every_dtype(dtype, b, sliced):
    # In half precision a (b, d) product may round otherwise than nn.Linear's (b, 1, d) one: the route takes x
    # as the general forward does.
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 2, dtype=dtype).eval()
    general = _general_twin(attn)
    x = torch.randn(b, 8, 32, dtype=dtype)
    by_general, by_forward = general.new_cache(b, 8), attn.new_cache(b, 8)
    tokens = [x[:, t:t + 1] if sliced else x[:, t:t + 1].contiguous() for t in range(4, 8)]
    with torch.no_grad():
        want = [general(x[:, :4], cache=by_general)] + [general(t, cache=by_general) for t in tokens]
        got = [attn(x[:, :4], cache=by_forward)] + [attn(t, cache=by_forward) for t in tokens]
    assert PLAN_KEY in attn.__dict__  # the short route ran
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
    assert torch.equal(by_forward.keys, by_general.keys) and torch.equal(by_forward.values, by_general.values)


def test_the_one_token_route_serves_plain_calls_only():
    """It answers a plain one-token call and leaves everything it does not reproduce to the general forward."""
    attn = _layer(4, 2)
    cache = attn.new_cache(2, 8)
    x = torch.randn(2, 1, attn.d_model)
    with torch.no_grad():
        assert one_token(attn, x, headwise.KVCache(2, 8, 2, 8)) is None  # unclaimed: the forward binds it
        assert one_token(attn, x, {"keys": None}) is None  # not a cache: the forward's message
        attn(x, cache=cache)
        assert one_token(attn, x, cache) is not None and cache.length == 2
        assert one_token(attn, torch.randn(2, 2, attn.d_model), cache) is None  # two tokens
        assert one_token(attn, x.double(), cache) is None  # the forward's dtype message
        assert one_token(attn, x, attn.new_cache(3, 8)) is None  # a cache of another batch size
        handle = attn.v_proj.register_forward_hook(lambda m, a, o: o)
        assert one_token(attn, x, cache) is None  # a hooked projection must be called
        handle.remove()
        with headwise.trace(attn, capture=("z",)):
            assert one_token(attn, x, cache) is None
        attn.train()
        assert one_token(attn, x, cache) is not None  # training without dropout: the same math
        assert cache.length == 3


def test_a_layer_that_decoded_copies_and_pickles_without_its_cache(tmp_path):
    """The one-token plan refers to the layer's cache: copies and pickles leave it behind and plan anew."""
    import copy

    attn = _layer(4, 2)
    x = torch.randn(2, 3, attn.d_model)
    cache = attn.new_cache(2, 8)
    with torch.no_grad():
        attn(x[:, :2], cache=cache)
        attn(x[:, 2:], cache=cache)
    assert PLAN_KEY in attn.__dict__
    torch.save(attn, tmp_path / "layer.pt")
    for twin in (copy.deepcopy(attn), torch.load(tmp_path / "layer.pt", weights_only=False)):
        assert PLAN_KEY not in twin.__dict__
        own = twin.new_cache(2, 8)
        with torch.no_grad():
            ys = [twin(x[:, :2], cache=own), twin(x[:, 2:], cache=own)]
        torch.testing.assert_close(torch.cat(ys, 1), attn(x, causal=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h, h_kv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("grad", [False, True])
def test_attend_plans_a_loops_one_query_steps_once_and_equals_fresh_plans_bit_for_bit(h, h_kv, grad):
    """A model's own decoding loop calls ``attend`` on split heads at every token (a patched Hugging Face module):
    the layer's first one-query plan serves later key counts, and every step computes exactly what a plan made
    for that very call computes, and the formula in float64."""
    attn = _layer(h, h_kv, dtype=torch.float64)
    torch.manual_seed(1)
    steps = [(2, None), (3, None), (9, None), (5, None), (4, 0.5), (17, 0.5)]  # (key count, scale)
    with torch.set_grad_enabled(grad):
        for s_kv, scale in steps:
            q = torch.randn(3, h, 1, 8, dtype=torch.float64, requires_grad=grad)
            k, v = (torch.randn(3, h_kv, s_kv, 8, dtype=torch.float64) for _ in range(2))
            z, weights = attn.attend(q, k, v, scale=scale)
            fresh = plan_attention(h=h, h_kv=h_kv, d_h=8, scale=attn.config.scale if scale is None else scale, b=3,
                                   s_q=1, s_kv=s_kv, dtype=q.dtype, device=q.device, chunk_queries=False,
                                   records_grad=grad)
            torch.testing.assert_close(z, hwf.attend(fresh, q, k, v)[0], rtol=0, atol=0)
            g = h // h_kv
            scores = q.detach() @ k.repeat_interleave(g, 1).transpose(-1, -2) * fresh.scale  # (3, h, 1, s_kv)
            want = torch.softmax(scores, -1) @ v.repeat_interleave(g, 1)  # (3, h, 1, 8)
            torch.testing.assert_close(z.detach(), want)
            assert weights is None and z.requires_grad is grad
    key, plan = attn.__dict__[QUERY_PLAN_KEY]
    assert plan.shape == (3, h, 1, 4)  # made at the first call of the last scale, reused at 17 keys


def test_attend_plans_anew_whatever_its_one_query_plan_does_not_cover():
    """Calls the kept plan does not cover take the general path (they leave it as it was); another dtype plans
    anew; q, k, v are checked at every call."""
    import copy

    attn = _layer(4, 2)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with torch.no_grad():
        attn.attend(q, k, v)
        memo = attn.__dict__[QUERY_PLAN_KEY]
        others = [dict(mask=torch.ones(1, 1, 1, 6, dtype=torch.bool)), dict(return_weights=True), dict(scale=1),
                  dict(softcap=5.0), dict(sinks=torch.zeros(4)), dict(head_scale=torch.ones(4)), dict(dropout=0)]
        for kwargs in others:
            attn.attend(q, k, v, **kwargs)
        with pytest.raises(TypeError, match="causal must be a bool"):
            attn.attend(q, k, v, causal=1)  # the general path's message
        attn.attend(q, k[:, :, :1], v[:, :, :1])  # one key
        attn.attend(q.expand(1, 4, 2, 8), k, v)  # two queries
        with headwise.trace(attn, capture=("z",)):
            attn.attend(q, k, v)
        dropping = MultiHeadAttention(32, 4, 2, dropout=0.1).train()
        dropping.attend(q, k, v)
        assert attn.__dict__[QUERY_PLAN_KEY] is memo and QUERY_PLAN_KEY not in dropping.__dict__
        attn.attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))  # as many K/V heads as query heads
        assert attn.__dict__[QUERY_PLAN_KEY][1].grouping.name == "NONE" and memo[1].grouping.name == "FOLD"
        attn.attend(q.double(), k.double(), v.double())
        key, plan = attn.__dict__[QUERY_PLAN_KEY]
        assert torch.float64 in key and plan.shape == (1, 4, 1, 6)
        assert QUERY_PLAN_KEY not in copy.deepcopy(attn).__dict__  # copies plan for themselves
        with pytest.raises(ValueError, match="share"):
            attn.attend(q.double(), k.double()[:, :, :3], v.double())


def test_steps_compute_the_float64_formula():
    attn = _layer(4, 2, rotary=True, dtype=torch.float64)
    x = torch.randn(2, 6, attn.d_model, dtype=torch.float64)
    cache = attn.new_cache(2, 6)
    step = DecodeStep(attn, cache)
    with torch.no_grad():
        ys = [step(x[:, t:t + 1]) for t in range(6)]
    torch.testing.assert_close(torch.cat(ys, 1), reference_mha(attn, x, causal=True)[0])


def _outcome(fn):
    try:
        return "ok", fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("case", ["shape", "dtype", "batch", "numpy", "full cache"])
def test_calls_it_is_not_built_for_get_the_forwards_answer_and_leave_the_cache_as_the_forward_does(case):
    attn = _layer(4, 2)
    d = attn.d_model
    bad = {"shape": torch.randn(2, 1, d + 1), "dtype": torch.randn(2, 1, d, dtype=torch.float64),
           "batch": torch.randn(3, 1, d), "numpy": torch.randn(2, 1, d).numpy(), "full cache": torch.randn(2, 1, d)}[case]
    results = []
    for use_step in (False, True):
        cache = attn.new_cache(2, 3 if case == "full cache" else 8)
        step = DecodeStep(attn, cache)
        with torch.no_grad():
            attn(torch.ones(2, 3, d) if case == "full cache" else torch.ones(2, 2, d), cache=cache)
            before = cache.length, cache.keys.clone()
            results.append(_outcome(lambda: step(bad) if use_step else attn(bad, cache=cache)))
        assert cache.length == before[0]
        torch.testing.assert_close(cache.keys, before[1], rtol=0, atol=0)
    assert results[0][0] != "ok" and results[0] == results[1]


def test_autograd_training_and_a_trace_take_the_forward():
    attn = _layer(4, 2)
    x = torch.randn(2, 1, attn.d_model)
    cache, twin = attn.new_cache(2, 4), attn.new_cache(2, 4)
    step = DecodeStep(attn, cache)
    y = step(x)  # autograd on: the forward records the graph
    assert y.grad_fn is not None
    torch.testing.assert_close(y, attn(x, cache=twin), rtol=0, atol=0)
    with headwise.trace(attn, capture=("z",), edit={(0, 1): "zero"}) as t, torch.no_grad():
        y_step = step(x)
    with headwise.trace(attn, edit={(0, 1): "zero"}), torch.no_grad():
        y_forward = attn(x, cache=twin)
    torch.testing.assert_close(y_step, y_forward, rtol=0, atol=0)  # the edit applied: the forward ran
    assert t[0].z.shape == (2, 1, 4, 8) and bool(t[0].z[:, :, 1].eq(0).all())
    attn.train()
    with torch.no_grad():
        torch.testing.assert_close(step(x), attn(x, cache=twin), rtol=0, atol=0)


def test_weights_changed_after_the_step_was_built_are_used():
    attn = _layer(4, 2)
    x = torch.randn(2, 1, attn.d_model)
    cache, twin = attn.new_cache(2, 4), attn.new_cache(2, 4)
    step = DecodeStep(attn, cache)
    with torch.no_grad():
        step(x)
        attn(x, cache=twin)
        attn.load_state_dict({k: torch.randn_like(v) for k, v in attn.state_dict().items()})
        torch.testing.assert_close(step(x), attn(x, cache=twin), rtol=0, atol=0)
        attn.q_proj.weight = torch.nn.Parameter(torch.randn_like(attn.q_proj.weight))  # packing broken: 3 products
        torch.testing.assert_close(step(x), attn(x, cache=twin), rtol=0, atol=0)


def test_a_step_that_fails_after_its_cache_write_crops_the_cache_back(monkeypatch):
    attn = _layer(4, 2)
    cache = attn.new_cache(1, 6)
    step = DecodeStep(attn, cache)
    with torch.no_grad():
        step(torch.randn(1, 1, attn.d_model))

        def broken(*args, **kwargs):
            raise RuntimeError("kernel failed")

        monkeypatch.setattr(hwf, "attend", broken)
        with pytest.raises(RuntimeError, match="kernel failed"):
            step(torch.randn(1, 1, attn.d_model))
    assert cache.length == 1


def test_refusals_name_what_was_expected_and_bind_nothing():
    attn, other = _layer(4, 2), _layer(4, 2)
    with pytest.raises(TypeError, match="needs a MultiHeadAttention, got Linear"):
        DecodeStep(torch.nn.Linear(2, 2), attn.new_cache(1, 4))
    with pytest.raises(TypeError, match="needs a KVCache"):
        DecodeStep(attn, None)
    with pytest.raises(ValueError, match="decodes self-attention; this layer has kdim=16"):
        DecodeStep(MultiHeadAttention(32, 4, kdim=16, vdim=16), headwise.KVCache(1, 4, 4, 8))
    with pytest.raises(ValueError, match="the cache holds n_kv_heads=4, d_head=8; the layer has n_kv_heads=2"):
        DecodeStep(attn, headwise.KVCache(1, 4, 4, 8))
    theirs = other.new_cache(1, 4)
    with pytest.raises(ValueError, match="belongs to"):
        DecodeStep(attn, theirs)
    assert theirs.owner is other


@pytest.mark.parametrize("where", ["layer step", "projection forward"])
def test_steps_and_projection_forwards_assigned_on_the_instance_run_in_a_decode_step(where):
    # A notebook's monkeypatch shadows the class's step: the token must get it, as the full causal forward does.
    attn = _layer(4, 2)
    if where == "layer step":
        plain = MultiHeadAttention.project_out
        attn.project_out = types.MethodType(lambda self, z, results=None: 2 * plain(self, z, results), attn)
    else:
        lin = attn.out_proj
        lin.forward = lambda inp: 2 * torch.nn.functional.linear(inp, lin.weight, lin.bias)
    x = torch.randn(2, 5, attn.d_model)
    with torch.no_grad():
        want = attn(x, causal=True)  # (2, 5, d)
        cache = attn.new_cache(2, 8)
        attn(x[:, :3], cache=cache)
        got = [attn(x[:, 3:4], cache=cache), DecodeStep(attn, cache)(x[:, 4:5])]
    torch.testing.assert_close(torch.cat(got, 1), want[:, 3:])


def test_after_a_first_step_hooks_config_and_module_swaps_are_honoured():
    # A step is the forward: whatever the forward honours between tokens, a step honours too.
    attn = _layer(4, 2)
    d = attn.d_model
    x = torch.randn(2, 6, d)

    def pair():
        """(the step's answer, the forward's answer) for the same next token from equal caches."""
        a, b = attn.new_cache(2, 8), attn.new_cache(2, 8)
        with torch.no_grad():
            attn(x[:, :4], cache=a)
            attn(x[:, :4], cache=b)
            step = DecodeStep(attn, a)
            step(x[:, 4:5])  # a first call, before anything changes
            attn(x[:, 4:5], cache=b)
            return step, a, b

    step, a, b = pair()
    handle = attn.register_forward_hook(lambda m, i, o: o * 0 + 7)
    with torch.no_grad():
        torch.testing.assert_close(step(x[:, 5:6]), torch.full((2, 1, d), 7.0))
    handle.remove()
    pre = attn.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    step, a, b = pair()
    with torch.no_grad():
        torch.testing.assert_close(step(x[:, 5:6]), attn(x[:, 5:6] * 0, cache=b))
    pre.remove()
    step, a, b = pair()
    attn.config = attn.config.replace(scale=0.05)
    with torch.no_grad():
        torch.testing.assert_close(step(x[:, 5:6]), attn(x[:, 5:6], cache=b))
        torch.testing.assert_close(attn.explain_dispatch(x[:, :1]).plan.scale, 0.05)
    step, a, b = pair()
    attn.out_proj = torch.nn.Identity()  # a module swap: the step writes the merged heads
    with torch.no_grad():
        assert step(x[:, 5:6]).shape == (2, 1, attn.config.inner_dim)


def test_backend_is_checked_whenever_it_is_set():
    attn = _layer(4, 2)
    with pytest.raises(ValueError, match=r"backend must be one of \['eager', 'sdpa'\], got 'eagre'"):
        attn.backend = "eagre"
    assert attn.backend == "sdpa"
    attn.backend = "eager"
    cache = attn.new_cache(2, 4)
    with torch.no_grad():
        _, w = attn(torch.randn(2, 2, attn.d_model), cache=cache, return_weights=True)
    assert w.shape == (2, 4, 2, 2)


@pytest.mark.parametrize("rotary", [False, True])
def test_under_autocast_a_cache_of_the_autocast_dtype_decodes_like_one_causal_pass(rotary):
    attn = _layer(4, 2, rotary)  # float32 parameters; autocast makes the projections write bfloat16
    x = torch.randn(2, 7, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = attn.new_cache(2, 8, dtype=torch.bfloat16)
        step = DecodeStep(attn, cache)
        with torch.no_grad():
            got = torch.cat([attn(x[:, :4], cache=cache)] + [step(x[:, t:t + 1]) for t in range(4, 7)], 1)
            want = attn(x, causal=True)  # the same autocast computation without a cache
        # With autograd too: the decode step's gradient reaches its own token, as in the causal pass.
        token = x[:, 6:7].clone().requires_grad_()
        cache.crop(6)
        grad_step, = torch.autograd.grad(step(token).float().square().sum(), token)
        whole = x.clone().requires_grad_()
        grad_whole, = torch.autograd.grad(attn(whole, causal=True)[:, 6:].float().square().sum(), whole)
    assert got.dtype == want.dtype == torch.bfloat16 and cache.length == 7
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad_step, grad_whole[:, 6:7], rtol=1.6e-2, atol=1e-3)  # bfloat16 products


def test_under_autocast_a_cache_of_another_dtype_is_refused_and_left_unchanged():
    attn = _layer(4, 2)
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for dtype, message in ((torch.float16, r"the cache holds torch.float16, this layer writes torch.bfloat16 "
                                               r"keys under torch.autocast\('cpu', dtype=torch.bfloat16\)"),
                               (torch.float32, r"cache holds torch.float32, got keys of dtype torch.bfloat16 \(under "
                                               r"torch.autocast the projections write torch.bfloat16")):
            cache = attn.new_cache(2, 8, dtype=dtype)
            keys = cache.keys.clone()
            for call in (lambda: attn(x[:, :2], cache=cache), lambda: DecodeStep(attn, cache)(x[:, 2:3])):
                with pytest.raises(TypeError, match=message):
                    call()
                assert cache.length == 0 and torch.equal(cache.keys, keys)


def test_decode_step_refuses_a_cache_of_another_dtype_where_the_loop_is_set_up():
    attn = MultiHeadAttention(16, 2, dtype=torch.float64).eval()
    cache = headwise.KVCache(1, 4, 2, 8)  # float32: this layer writes float64 keys
    with pytest.raises(TypeError, match="the cache holds torch.float32, this layer writes torch.float64 keys"):
        DecodeStep(attn, cache)
    assert cache.owner is None
    with pytest.raises(TypeError, match="float64"):
        DecodeStep(attn, headwise.KVCache(1, 4, 2, 8, dtype=torch.bfloat16))  # float64 layers are never autocast
    # A float32 layer may decode under an autocast entered later: a half-precision cache is its autocast's.
    attn = _layer(2, 2)
    with pytest.raises(ValueError, match="the cache is on meta, this layer's parameters on cpu"):
        DecodeStep(attn, headwise.KVCache(1, 4, 2, 8, device="meta"))
    DecodeStep(attn, attn.new_cache(1, 4, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        DecodeStep(attn, attn.new_cache(1, 4, dtype=torch.bfloat16))


def test_self_attention_on_a_layer_with_other_key_widths_is_a_value_error_everywhere():
    attn = MultiHeadAttention(32, 4, kdim=16, vdim=16).eval()
    cache = attn.new_cache(1, 4)
    message = r"projects keys from kdim=16 and values from vdim=16 features, but self-attention .* d_model=32"
    with torch.no_grad():
        for call in (lambda: attn(torch.randn(1, 1, 32), cache=cache), lambda: attn(torch.randn(1, 2, 32)),
                     lambda: attn.explain_dispatch(torch.randn(1, 1, 32), cache=cache)):
            with pytest.raises(ValueError, match=message):
                call()
        assert cache.length == 0
        y = attn(torch.randn(1, 2, 32), torch.randn(1, 3, 16))  # cross-attention is what it is for
    assert y.shape == (1, 2, 32)
