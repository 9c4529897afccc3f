"""Sweep cases of the tools on top of the layer: headwise.trace, patching.head_effects, surgery (and its
files), interop.patch, headwise.check and the CLI (see sweep_harness for the outcomes)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

import headwise
from headwise.patching import head_effects
from headwise.surgery import prune_heads, to_gqa
from tests.reference import reference_mha
from tests.robustness.sweep_core import DH, H, HKV, layer, xs
from tests.robustness.sweep_harness import Case, Setup, close

CASES: list[Case] = []


def refuse(id, build, xfail=None):
    CASES.append(Case(id, build, works=False, xfail=xfail))


def works(id, build, xfail=None):
    CASES.append(Case(id, build, works=True, xfail=xfail))


def z_edit_reference(a, x, scale):
    """float64: the layer's output with head h's context multiplied by scale[h] (zero = ablated)."""
    import tests.reference as ref
    cfg = a.config
    z, _ = ref.reference_heads(*(headwise.functional.split_heads(p(x).detach().double(), n)
                                 for p, n in ((a.q_proj, cfg.n_heads), (a.k_proj, cfg.n_kv_heads),
                                              (a.v_proj, cfg.n_kv_heads))))
    z = z * torch.tensor(scale, dtype=torch.float64).view(1, -1, 1, 1)
    b, s = x.shape[:2]
    return z.transpose(1, 2).reshape(b, s, -1) @ a.out_proj.weight.double().T + a.out_proj.bias.double()


# -- headwise.trace -----------------------------------------------------------------------------------------
def traced(capture=(), edit=None, on=None):
    """Build the trace and run the layer inside it; the layer (and its tracer slot) is watched."""
    def build(tmp):
        a, x = layer(), xs()
        target = a if on is None else on(a)

        def run():
            with headwise.trace(target, capture=capture, edit=edit() if callable(edit) else edit) as t:
                a(x)
            return t
        return Setup(run, [a, x])
    return build


BAD_TRACE = {
    "capture 'zz'": dict(capture=("zz",)), "capture 5": dict(capture=5), "capture ['q', 3]": dict(capture=["q", 3]),
    "capture {7: 'q'}": dict(capture={7: ("q",)}), "edit list": dict(edit=[(0, 0)]),
    "edit head 99": dict(edit={(0, 99): "zero"}), "edit layer 5": dict(edit={(5, 0): "zero"}),
    "edit layer 'nope'": dict(edit={("nope", 0): "zero"}), "edit head twice": dict(edit={(0, (1, 1)): "zero"}),
    "edit head 1.5": dict(edit={(0, 1.5): "zero"}), "edit key (0, 1, 2)": dict(edit={(0, 1, 2): "zero"}),
    "edit 10**400": dict(edit={(0, 1): 10**400}), "edit nan": dict(edit={(0, 1): math.nan}),
    "edit inf": dict(edit={(0, 1): math.inf}), "edit 'double'": dict(edit={(0, 1): "double"}),
    "edit meta tensor": dict(edit=lambda: {(0, 1): torch.zeros(DH, device="meta")}),
    "edit int tensor": dict(edit=lambda: {(0, 1): torch.zeros(DH, dtype=torch.long)}),
    "edit tensor d_h 5": dict(edit=lambda: {(0, 1): torch.zeros(5)}),
    "edit tensor s 5": dict(edit=lambda: {(0, 1): torch.zeros(5, DH)}),
    "edit callable wrong shape": dict(edit={(0, 1): lambda z, l, h: z[..., :2]}),
    "edit callable returns None": dict(edit={(0, 1): lambda z, l, h: None}),
    "edit ('mean', 5)": dict(edit={(0, 1): ("mean", 5)}), "edit object()": dict(edit={(0, 1): object()}),
    "edit True": dict(edit={(0, 1): True}),
}
TRACE_XFAIL = {
    "edit 10**400": None,
    "edit meta tensor": None,
}
for name, kw in BAD_TRACE.items():
    refuse(f"trace {name}", traced(**kw), TRACE_XFAIL.get(name))
refuse("trace of 5", lambda tmp: Setup(lambda: headwise.trace(5)))
refuse("trace of nn.Linear", lambda tmp: Setup(lambda: headwise.trace(nn.Linear(2, 2))))


def _nested(tmp):
    """Traces nest: the outer trace's edits first, then the inner's (head 0 x 2 x 3, head 1 zeroed)."""
    a, x = layer(), xs()

    def run():
        with headwise.trace(a, edit={(0, 0): 2.0}):
            with headwise.trace(a, edit={(0, 0): 3.0, (0, 1): "zero"}):
                return a(x)
    return Setup(run, [], lambda y: (close(y, z_edit_reference(a, x, [6, 0, 1, 1])), _no_tracer(a)))


works("trace nested", _nested)


def _record(get):
    def build(tmp):
        a, x = layer(), xs()
        with headwise.trace(a, capture=("z",)) as t:
            a(x)
        return Setup(lambda: get(t), [a])
    return build


refuse("trace record not captured", _record(lambda t: t[0].pattern))
refuse("trace record name 'nope'", _record(lambda t: t["nope"]))
refuse("trace record 3", _record(lambda t: t[3]))
refuse("trace record 1.0", _record(lambda t: t[1.0]))


def edit_ok(edit, scale):
    def build(tmp):
        a, x = layer(), xs()

        def run():
            with headwise.trace(a, edit=edit()):
                return a(x)
        return Setup(run, [], lambda y: (close(y, z_edit_reference(a, x, scale)), _no_tracer(a)))
    return build


def _no_tracer(a):
    assert a.tracer is None, "the tracer outlived the with block"


works("trace ok zero", edit_ok(lambda: {(0, 1): "zero"}, [1, 0, 1, 1]))
works("trace ok scale 2", edit_ok(lambda: {(0, (0, 3)): 2.0}, [2, 1, 1, 2]))
works("trace ok 0-d tensor scale", edit_ok(lambda: {(0, 2): torch.tensor(0.5)}, [1, 1, 0.5, 1]),
      None)
works("trace ok float64 replacement zeros", edit_ok(lambda: {(0, 1): torch.zeros(DH, dtype=torch.float64)}, [1, 0, 1, 1]))
works("trace ok int scale", edit_ok(lambda: {(0, 3): 0}, [1, 1, 1, 0]))


def _repr(tmp):
    t = headwise.trace(layer(), capture=("z",))
    return Setup(lambda: repr(t), [], lambda r: _has(r, "edits on 0 layers"))


def _has(text, part):
    assert part in text, f"{part!r} not in {text!r}"


works("trace ok repr without edits", _repr, None)


def _copy_in_trace(make_copy):
    def build(tmp):
        a, x = layer(), xs()

        def run():
            with headwise.trace(a, edit={(0, 1): "zero"}):
                c = make_copy(a)
            return c
        return Setup(run, [], lambda c: (_no_tracer(c), close(c(x), reference_mha(c, x)[0])))
    return build


works("trace ok deepcopy inside a trace", _copy_in_trace(copy.deepcopy))
works("trace ok prune_heads inside a trace", _copy_in_trace(lambda a: prune_heads(a, [0])))
works("trace ok to_gqa inside a trace", _copy_in_trace(lambda a: to_gqa(a, 1)))

# -- patching.head_effects ----------------------------------------------------------------------------------
def effects(make):
    def build(tmp):
        model = nn.Sequential(layer(), layer()).eval()
        args, kw = make(model)
        return Setup(lambda: head_effects(*args, **kw), [model])
    return build


METRIC = lambda y: y[0, -1, 0]  # noqa: E731
for name, make in {
    "model 5": lambda m: ((5, xs(1, 3), xs(1, 3), METRIC), {}),
    "batch mismatch": lambda m: ((m, xs(1, 3), xs(2, 3), METRIC), {}),
    "seq mismatch": lambda m: ((m, xs(1, 3), xs(1, 4), METRIC), {}),
    "metric vector": lambda m: ((m, xs(1, 3), xs(1, 3), lambda y: y[0, -1]), {}),
    "metric str": lambda m: ((m, xs(1, 3), xs(1, 3), lambda y: "x"), {}),
    "batch_heads 0": lambda m: ((m, xs(1, 3), xs(1, 3), METRIC), {"batch_heads": 0}),
    "batch_heads True": lambda m: ((m, xs(1, 3), xs(1, 3), METRIC), {"batch_heads": True}),
    "clean list of str": lambda m: ((m, ["a"], ["a"], METRIC), {}),
}.items():
    refuse(f"head_effects {name}", effects(make))


def _effects_ok(tmp):
    a = layer().eval()
    clean, bad = xs(1, 3), xs(2, 3)[1:]

    def check(e):
        import tests.reference as ref
        split = headwise.functional.split_heads
        zs = [ref.reference_heads(*(split(p(x).detach().double(), n) for p, n in
                                    ((a.q_proj, H), (a.k_proj, HKV), (a.v_proj, HKV))))[0] for x in (clean, bad)]
        out = lambda z: (z.transpose(1, 2).reshape(1, 3, -1) @ a.out_proj.weight.double().T  # noqa: E731
                         + a.out_proj.bias.double())[0, -1, 0]
        expected = []
        for h in range(H):
            z = zs[1].clone()
            z[:, h] = zs[0][:, h]
            expected.append(out(z) - out(zs[1]))
        close(e, torch.stack(expected)[None])
    return Setup(lambda: head_effects(a, clean, bad, METRIC), [], check)


works("head_effects ok one layer", _effects_ok)
