"""A model patched from eager returns its attention weights only where transformers records them
(``output_attentions``, given or in the config): a statistics-only trace then holds no pattern, only bounded
chunks, as on a model patched from sdpa, and every output is the unpatched eager model's, padded rows included.

Peers: the unpatched eager model (its logits, its ``output_attentions`` and the float64 statistics of them), and
the sizes of the tensors every torch operation allocates (a ``TorchDispatchMode``: deterministic, not timed).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

transformers = pytest.importorskip("transformers")
from torch._dynamo.testing import CompileCounter  # noqa: E402

import headwise  # noqa: E402
import headwise.plan as hwp  # noqa: E402
from headwise.interop import patch  # noqa: E402
from headwise.statistics import STATISTICS  # noqa: E402
from headwise.viz import model_statistics  # noqa: E402

H = 8  # query heads: the pattern (b, h, s, s) is 8 times eager's own additive mask (b, 1, s, s)
S = 128
CHUNK = 64 * 2**10  # headwise.plan.STATISTICS_CHUNK_BYTES for these tests: a chunk is a fraction of the pattern
MASK = torch.ones(2, S, dtype=torch.long)
MASK[1, :3] = 0  # left padding: row 1's first queries may read no key (eager's uniform rows)
IDS = torch.randint(1, 64, (2, S), generator=torch.Generator().manual_seed(0))


def eager_model(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=H, n_layer=2, n_positions=S, bos_token_id=1,
                                      eos_token_id=2, attn_implementation="eager")
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=S,
                                       bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval().to(dtype)


class LargestAllocation(TorchDispatchMode):
    """The bytes of the largest storage any torch operation returns while active (a view reports its base's)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def bound(itemsize: int) -> int:
    """A chunk of scores, or eager's own additive mask (b, 1, s, s), which the unpatched model builds too."""
    return max(CHUNK, MASK.shape[0] * S * S * itemsize)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_statistics_trace_of_an_eager_model_holds_chunks_and_equals_the_float64_pattern(family, monkeypatch):
    # float32: transformers' float64 eager gives NaN on rows that may read no key (finfo.min + score overflows)
    monkeypatch.setattr(hwp, "STATISTICS_CHUNK_BYTES", CHUNK)
    plain = eager_model(family)
    patched = patch(copy.deepcopy(plain))
    with torch.no_grad():
        want = plain(input_ids=IDS, attention_mask=MASK, output_attentions=True)
        with headwise.trace(patched, capture=STATISTICS) as t, LargestAllocation() as seen:
            got = patched(input_ids=IDS, attention_mask=MASK)
    pattern = MASK.shape[0] * H * S * S * 4
    assert seen.nbytes <= bound(4) < pattern, (seen.nbytes, bound(4), pattern)
    assert t.materializes_probabilities == []
    torch.testing.assert_close(got.logits, want.logits)
    for i, w in enumerate(want.attentions):
        p = w.double()  # (b, h, s, s)
        torch.testing.assert_close(t[i].entropy.double(), -torch.special.xlogy(p, p).sum(-1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(t[i].max_weight.double(), p.amax(-1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(t[i].key_weight.double(), p.sum(-2), rtol=1e-4, atol=1e-4)


def test_model_statistics_of_an_eager_model_holds_chunks(monkeypatch):
    monkeypatch.setattr(hwp, "STATISTICS_CHUNK_BYTES", CHUNK)
    plain = eager_model("gpt2")
    model = patch(copy.deepcopy(plain))
    with torch.no_grad():
        want = plain(input_ids=IDS[:1], output_attentions=True).attentions
    with LargestAllocation() as seen:
        stats = model_statistics(model, {"input_ids": IDS[:1]})
    assert seen.nbytes <= max(CHUNK, S * S * 4) < H * S * S * 4, seen.nbytes
    p = torch.stack([w[0].double() for w in want])  # (L, h, s, s)
    torch.testing.assert_close(stats.entropy.double(), -torch.special.xlogy(p, p).sum(-1), rtol=1e-4, atol=1e-5)


def attention_modules(model: torch.nn.Module) -> list:
    found = [m for m in model.modules() if isinstance(getattr(m, "attn", None), headwise.MultiHeadAttention)]
    assert len(found) == 2
    return found


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_eager_models_hooks_read_eagers_weights_untraced(family):
    """Untraced, a forward hook on an attention module reads what it reads on the unpatched eager model."""
    plain = eager_model(family)
    patched = patch(copy.deepcopy(plain))
    want, got = [], []
    names = [name for name, m in patched.named_modules() if m in attention_modules(patched)]
    for name in names:  # the same modules of each model
        plain.get_submodule(name).register_forward_hook(lambda mod, args, out: want.append(out[1]))
        patched.get_submodule(name).register_forward_hook(lambda mod, args, out: got.append(out[1]))
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=IDS, attention_mask=MASK).logits,
                                   plain(input_ids=IDS, attention_mask=MASK).logits)
    assert len(want) == 2 and all(w is not None for w in want)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_traced_eager_model_returns_weights_exactly_where_transformers_records_them(family):
    plain = eager_model(family)
    patched = patch(copy.deepcopy(plain))
    handed: list = []
    for m in attention_modules(patched):
        m.register_forward_hook(lambda mod, args, out: handed.append(out[1]))
    with torch.no_grad(), headwise.trace(patched, capture=("entropy",)):
        want = plain(input_ids=IDS, attention_mask=MASK, output_attentions=True)
        got = patched(input_ids=IDS, attention_mask=MASK)
        assert handed == [None, None]  # not recorded: no (b, h, s, s) weights built
        torch.testing.assert_close(got.logits, want.logits)
        handed.clear()
        asked = patched(input_ids=IDS, attention_mask=MASK, output_attentions=True)
        torch.testing.assert_close(asked.logits, want.logits)
        torch.testing.assert_close(asked.attentions, want.attentions)
        assert [w.shape for w in handed] == [(2, H, S, S)] * 2
    plain.config.output_attentions = True  # asked by the config (set while eager): no keyword reaches a module
    patched = patch(copy.deepcopy(plain))
    with torch.no_grad(), headwise.trace(patched, capture=("entropy",)):
        torch.testing.assert_close(patched(input_ids=IDS, attention_mask=MASK).attentions, want.attentions)


def test_an_eager_module_called_on_its_own_returns_eagers_weights():
    """Outside a model forward nothing says who reads the weights: the module returns them, as eager's does."""
    plain = eager_model("llama")
    patched = patch(copy.deepcopy(plain))
    x = torch.randn(2, 5, 32)
    pe = plain.model.rotary_emb(x, torch.arange(5)[None])
    mask = torch.ones(2, 1, 5, 5).tril().log()  # eager's additive causal mask: 0 or -inf
    with torch.no_grad():
        z, w = plain.model.layers[0].self_attn(x, position_embeddings=pe, attention_mask=mask)
        z2, w2 = patched.model.layers[0].self_attn(x, position_embeddings=pe, attention_mask=mask)
    torch.testing.assert_close(z2, z)
    torch.testing.assert_close(w2, w)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_compiled_eager_model_returns_weights_where_asked():
    plain = eager_model("llama")
    patched = patch(copy.deepcopy(plain))
    ids, mask = IDS[:, :9], MASK[:, :9]
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask, output_attentions=True)
        patched(input_ids=ids[:, :2], output_attentions=True)  # transformers installs its recording hooks eagerly
        for asked in (False, True):
            torch._dynamo.reset()
            counter = CompileCounter()
            step = torch.compile(patched.forward, backend=counter, fullgraph=True)
            got = step(input_ids=ids, attention_mask=mask, output_attentions=asked)
            assert counter.frame_count == 1
            torch.testing.assert_close(got.logits, want.logits)
            if asked:
                torch.testing.assert_close(got.attentions, want.attentions)
            else:
                assert got.attentions is None


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_layers_compiled_one_by_one_run_whole_under_a_trace():
    # a region compiled inside the eager forward cannot read transformers' collector: it keeps eager's weights
    plain = eager_model("llama")
    patched = patch(copy.deepcopy(plain))
    ids, mask = IDS[:, :9], MASK[:, :9]
    torch._dynamo.reset()
    counter = CompileCounter()
    for layer in patched.model.layers:
        layer.compile(backend=counter, fullgraph=True)
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        with headwise.trace(patched, capture=("entropy",)) as t:
            got = patched(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    assert counter.frame_count >= 1 and len(t[0].calls) == 1


def test_a_mixture_of_experts_asking_for_router_logits_builds_no_pattern(monkeypatch):
    monkeypatch.setattr(hwp, "STATISTICS_CHUNK_BYTES", CHUNK)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=H, num_key_value_heads=2, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=S, attn_implementation="eager")
    torch.manual_seed(0)
    plain = transformers.MixtralForCausalLM(cfg).eval()
    patched = patch(copy.deepcopy(plain))
    with torch.no_grad():
        want = plain(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
        with headwise.trace(patched, capture=STATISTICS), LargestAllocation() as seen:
            got = patched(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    assert seen.nbytes <= bound(4) < MASK.shape[0] * H * S * S * 4, seen.nbytes
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.router_logits, want.router_logits)
