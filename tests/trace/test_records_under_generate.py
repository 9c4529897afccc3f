"""What a trace keeps of each call under ``generate``: a static cache's keys and values as they were in that call
(plain PyTorch hooks on the unpatched model read the cache buffer right after each call), and
``LayerRecord.mean`` of k and v over several calls, each real key position counted once (a float64 mean written
from the captured tensors and the masks)."""

from __future__ import annotations

import copy

import pytest
import torch

import headwise

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402

IDS = torch.tensor([[0, 0, 5, 7, 3, 9], [5, 7, 3, 9, 11, 12]])  # row 0 left-padded
MASK = (IDS != 0).long()
NEW = 4
GEN = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
           pad_token_id=0)


def llama():
    """A tiny random Llama (d64, 4 query heads on 2 key/value heads, 2 layers) and its patched twin."""
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).eval()
    return plain, patch(copy.deepcopy(plain))


def cache_after_each_call(plain, run=None, **gen):
    """Per layer, each call's (keys, values) of the cache right after the unpatched attention module ran: what
    that call attended over (a static cache: its whole buffer). ``run()`` (default: ``plain.generate(**gen)``)
    runs the model."""
    seen = [[] for _ in plain.model.layers]

    def keep(module, args, kwargs, out):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer = cache.layers[module.layer_idx]
        seen[module.layer_idx].append((layer.keys.clone(), layer.values.clone()))

    handles = [block.self_attn.register_forward_hook(keep, with_kwargs=True) for block in plain.model.layers]
    try:
        with torch.no_grad():
            out = plain.generate(**gen) if run is None else run()
    finally:
        for h in handles:
            h.remove()
    return out, seen


def test_static_cache_captures_hold_each_calls_keys_and_values():
    plain, model = llama()
    want, seen = cache_after_each_call(plain, **GEN, cache_implementation="static")
    with torch.no_grad(), headwise.trace(model, capture=("k", "v")) as t:
        got = model.generate(**GEN, cache_implementation="static")
    assert torch.equal(got, want)
    for li in range(2):
        assert len(t[li].calls) == len(seen[li]) == NEW
        for j, (keys, values) in enumerate(seen[li]):
            # whole buffers: the slots later calls write were still empty in call j
            torch.testing.assert_close(t[li].calls[j]["k"], keys)
            torch.testing.assert_close(t[li].calls[j]["v"], values)


def mean64(tensors, masks):
    """Each key/value head's float64 mean over the real positions of every (keys, mask) pair. Shapes:
    (b, h_kv, s, d_h) and (b, s) bool each -> (h_kv, d_h)."""
    rows = torch.cat([x.double().transpose(1, 2)[m] for x, m in zip(tensors, masks)])  # (n, h_kv, d_h)
    return rows.mean(0)


@pytest.mark.parametrize("site", ["k", "v"])
def test_mean_of_k_and_v_over_several_batches_averages_every_real_key(site):
    plain, model = llama()
    other = torch.tensor([[3, 8, 0, 0], [6, 2, 9, 0], [4, 4, 7, 13]])  # another batch size and length
    batches = [(IDS, MASK), (other, (other != 0).long())]
    _, seen = cache_after_each_call(
        plain, run=lambda: [plain(input_ids=i, attention_mask=m, use_cache=True) for i, m in batches])
    with torch.no_grad(), headwise.trace(model, capture=(site,)) as t:
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask)
    at = "kv".index(site)
    for li in range(2):
        want = mean64([call[at] for call in seen[li]], [m.bool() for _, m in batches])
        torch.testing.assert_close(t[li].mean(site), want.float())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("site", ["k", "v"])
def test_mean_of_k_and_v_under_generate_counts_each_real_position_once(site, cache):
    plain, model = llama()
    _, seen = cache_after_each_call(plain, **GEN, cache_implementation=cache)
    with torch.no_grad(), headwise.trace(model, capture=(site,)) as t:
        model.generate(**GEN, cache_implementation=cache)
    length = IDS.shape[1] + NEW - 1  # the last call's keys: the prompt and every token but the last one
    real = torch.cat([MASK, torch.ones(2, NEW - 1, dtype=torch.long)], 1).bool()
    at = "kv".index(site)
    for li in range(2):
        assert len(t[li].calls) == NEW
        final = seen[li][-1][at][:, :, :length]  # (b, h_kv, length, d_h): every position, once
        torch.testing.assert_close(t[li].mean(site), mean64([final], [real]).float())


def test_mean_of_keys_a_trace_cannot_place_is_refused_leaving_the_record():
    """A decoding step on a cache whose earlier positions the calls before it did not reach (here another
    sequence's cache): which keys were counted already is unknown, so the mean is refused."""
    _, model = llama()
    prompt = IDS[:, 2:]  # 4 tokens, no padding
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache, use_cache=True)
        with headwise.trace(model, capture=("k", "z")) as t:
            model(input_ids=IDS, attention_mask=MASK)  # 6 positions, no cache
            model(input_ids=IDS[:, :1], attention_mask=torch.ones(2, 5, dtype=torch.long), cache=cache,
                  use_cache=True)  # 4 cached positions and 1 new
    before = [call["k"].clone() for call in t[1].calls]
    with pytest.raises(ValueError, match=r"call 1 attends over 5 key positions for its 1 queries.*continue the 6 positions"):
        t[1].mean("k")
    assert len(t[1].calls) == 2
    for call, k in zip(t[1].calls, before):
        torch.testing.assert_close(call["k"], k)
    assert t[1].mean("z").shape == (4, 16)  # queries are each call's own: still averaged
