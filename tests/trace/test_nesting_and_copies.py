"""Nested traces compose (against hooks on the unpatched model); a copy of a traced layer or model is not
traced; surgery that replaces a patched model's layers inside a trace is refused at the next forward."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch

import headwise
from headwise import MultiHeadAttention
from headwise.surgery import prune_heads, to_gqa
from headwise.tracing.tracer import LayerTracer

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_nested_traces_apply_both_edits_and_both_capture(family):
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)
    h = model.config.num_attention_heads
    both, zs, _ = ref.hooked_run(plain, kw, h, edit={(0, 1): torch.zeros_like, (1, 2): lambda z: 3 * z})
    outer_only, _, _ = ref.hooked_run(plain, kw, h, edit={(0, 1): torch.zeros_like})
    with torch.no_grad(), headwise.trace(model, capture={1: ("z",)}, edit={(0, 1): "zero"}) as outer:
        with headwise.trace(model, capture={0: ("z",)}, edit={(1, 2): 3.0}) as inner:
            got = model(**kw)
        after_inner = model(**kw)
    torch.testing.assert_close(got.logits, both.logits)
    torch.testing.assert_close(inner[0].z, zs[0])  # each trace captured what it asked for, after every edit
    torch.testing.assert_close(outer[1].calls[0]["z"], zs[1])
    torch.testing.assert_close(after_inner.logits, outer_only.logits)  # the inner edits ended with its block
    assert all(m.tracer is None for _, m in outer.layers)


def test_a_deep_copy_inside_a_trace_is_not_traced():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 3, 16)
    want = attn(x)
    with headwise.trace(attn, capture=("z",), edit={(0, 1): "zero"}) as t:
        twin = copy.deepcopy(attn)
        buffer = io.BytesIO()
        torch.save(attn, buffer)
        assert not torch.allclose(attn(x), want)  # the original is edited ...
        torch.testing.assert_close(twin(x), want)  # ... its copies are not
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert twin.tracer is None and loaded.tracer is None
    assert len(t[0].calls) == 1  # the copies' calls reached no record
    with headwise.trace(twin, capture=("z",)) as t2:  # a copy can be traced on its own
        twin(x)
    assert len(t2[0].calls) == 1


def test_surgery_copies_of_a_bare_layer_inside_a_trace_are_not_traced():
    torch.manual_seed(1)
    attn = MultiHeadAttention(24, 6).eval()
    x = torch.randn(1, 3, 24)
    with headwise.trace(attn, edit={(0, 5): "zero"}):
        pruned = prune_heads(attn, [0])
        grouped = to_gqa(attn, 3)
    assert pruned.tracer is None and grouped.tracer is None
    with headwise.trace(pruned, capture=("z",)) as t:  # 5 heads now: a new trace works
        pruned(x)
    assert t[0].z.shape == (1, 3, 5, 4)


def test_a_deep_copy_of_a_patched_model_inside_a_trace_is_not_traced():
    model = ref.gpt2("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)
    with torch.no_grad(), headwise.trace(model, edit={(1, 0): "zero"}) as t:
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        torch.testing.assert_close(twin(**kw).logits, plain(**kw).logits)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (twin, loaded):
        with torch.no_grad():
            torch.testing.assert_close(copied(**kw).logits, plain(**kw).logits)
        refers = [o for m in copied.modules() for o in (*m.__dict__.values(), *m._forward_pre_hooks.values())
                  if o is t or getattr(o, "__self__", None) is t or isinstance(o, LayerTracer)]
        assert refers == []  # nothing of the trace is left on the copy
        with torch.no_grad(), headwise.trace(copied, capture=("z",)) as t2:
            copied(**kw)
        assert len(t2[1].calls) == 1


def test_pruning_a_patched_model_inside_a_trace_is_refused_at_the_next_forward():
    model = ref.gpt2("sdpa")
    patch(model)
    kw = ref.inputs(model)
    with torch.no_grad(), headwise.trace(model, capture=("z",), edit={(1, 3): "zero"}) as t:
        model(**kw)
        prune_heads(model, {0: [1]})
        with pytest.raises(RuntimeError, match="replaced or added inside the trace"):
            model(**kw)
    assert len(t[0].calls) == 1
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t2:  # a new trace sees the new layers
        model(**kw)
    assert t2[0].z.shape[2] == 3


def test_repr_counts_only_layers_with_edits():
    model = torch.nn.Sequential(*[MultiHeadAttention(8, 2) for _ in range(4)])
    assert "edits on 0 layers" in repr(headwise.trace(model, capture=("z",)))
    assert "edits on 2 layers" in repr(headwise.trace(model, edit={(0, 1): "zero", (3, 0, "q"): 0.5}))


def test_odd_edit_values_work_or_are_refused_clearly():
    torch.manual_seed(2)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 3, 16)
    with torch.no_grad(), headwise.trace(attn, edit={(0, 1): 0.5}):
        by_number = attn(x)
    with torch.no_grad(), headwise.trace(attn, edit={(0, 1): torch.tensor(0.5, dtype=torch.float64)}):
        by_tensor = attn(x)  # a 0-d tensor is a scale
    torch.testing.assert_close(by_tensor, by_number)
    replacement = torch.randn(4, dtype=torch.float64)
    with torch.no_grad(), headwise.trace(attn, edit={(0, 1): replacement}):
        wide = attn(x)  # a float64 replacement of a float32 layer: cast
    with torch.no_grad(), headwise.trace(attn, edit={(0, 1): replacement.float()}):
        torch.testing.assert_close(wide, attn(x))
    with pytest.raises(ValueError, match="finite number, got an int of 401 digits"):
        headwise.trace(attn, edit={(0, 1): 10 ** 400})
    with pytest.raises(ValueError, match="meta device"):
        headwise.trace(attn, edit={(0, 1): torch.zeros(4, device="meta")})
    with pytest.raises(ValueError, match="floating tensor .* got torch.int64"):
        headwise.trace(attn, edit={(0, 1): torch.zeros(4, dtype=torch.long)})
    with pytest.raises(TypeError, match="must be real, got torch.bool"):
        headwise.trace(attn, edit={(0, 1): torch.tensor(True)})
    with pytest.raises(ValueError, match="inf or NaN"):
        headwise.trace(attn, edit={(0, 1): torch.full((4,), float("nan"))})
    with pytest.raises(TypeError, match="got a bool"):
        headwise.trace(attn, edit={(0, 1): True})
    assert attn.tracer is None  # every refusal left the layer as it was


def test_a_model_pickled_inside_a_trace_by_an_earlier_version_loads_untraced():
    # Earlier versions pickled the trace's pre-hook as a call of headwise.tracing.session._inert: such a file
    # must still load, with a hook that does nothing.
    import pickle

    class Saved:
        def __reduce__(self):
            return (headwise.tracing.session.__dict__["_inert"], ())

    attn = MultiHeadAttention(8, 2)
    attn.register_forward_pre_hook(Saved(), with_kwargs=True)
    loaded = pickle.loads(pickle.dumps(attn))
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), attn.__class__.forward(loaded, x))


def test_a_trace_open_in_another_thread_refuses_a_second_threads_trace_and_keeps_its_own_calls():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        plain = attn(x)
    opened, tried, seen = threading.Event(), threading.Event(), {}

    def capture_only():
        with torch.no_grad(), headwise.trace(attn, capture=("z",)) as t:
            opened.set()
            tried.wait(timeout=60)
            seen["y"] = attn(x)
        seen["calls"] = len(t[0].calls)

    worker = threading.Thread(target=capture_only)
    worker.start()
    try:
        assert opened.wait(timeout=60)
        with pytest.raises(ValueError, match=r"layers \[0\] \(of 1\) have a trace open that another thread entered"):
            with headwise.trace(attn, edit={(0, 1): "zero"}):
                attn(x)
        assert len(attn.tracer.entries) == 1  # the refused trace left nothing behind
    finally:
        tried.set()
        worker.join()
    torch.testing.assert_close(seen["y"], plain)  # the other thread's edit never reached this call
    assert seen["calls"] == 1
    with torch.no_grad(), headwise.trace(attn, edit={(0, 1): "zero"}):  # once it is closed, any thread may trace
        zeroed = attn(x)
    assert not torch.allclose(zeroed, plain)
