"""headwise.check runs on a copy: an Adapter subclass of the user's own (as docs/check.md recommends for any other
layer) is deep-copied with the module it holds, which runs in eval mode; the caller's module keeps its mode, its
values and its tensors' autograd version counters, so a graph built before the check still back-propagates."""

from __future__ import annotations

import torch

from headwise.checks import Adapter, check

from tests.checks.check_gallery import RefAttention


class MyAdapter(Adapter):
    """The user's adapter: it holds its layer as ``m`` and exposes weights and heads."""

    exposes_heads = exposes_weights = accepts_mask = True
    modes: list[bool] = []  # the layer's training flag at each call, shared by every copy

    def __init__(self, m: RefAttention) -> None:
        self.m, self.d_model, self.name = m, m.d_model, "MyAdapter"
        self.n_heads = self.n_kv_heads = m.n_heads
        self.d_head = m.d_head

    def _mask(self, keep):
        return None if keep is None else keep[:, None, None, :]

    def run(self, x, *, keep=None, causal=None, positions=None):
        type(self).modes.append(self.m.training)
        return self.m(x, mask=self._mask(keep))

    def run_weights(self, x, *, keep=None, causal=None):
        type(self).modes.append(self.m.training)
        return self.m(x, mask=self._mask(keep), return_weights=True)

    def contexts(self, x, *, causal=None):
        got = []
        handle = self.m.out_proj.register_forward_pre_hook(lambda mod, args: got.append(args[0]))
        try:
            self.run(x)
        finally:
            handle.remove()
        b, s, _ = got[0].shape
        return got[0].view(b, s, self.n_heads, self.d_head).transpose(1, 2)

    def head_slices(self, which, i):
        p = {"q": self.m.q_proj, "k": self.m.k_proj, "v": self.m.v_proj}[which]
        lo, hi = i * self.d_head, (i + 1) * self.d_head
        return [(p.weight, 0, lo, hi), (p.bias, 0, lo, hi)]


def test_a_users_adapter_runs_on_an_eval_copy_leaving_the_callers_tensors_as_they_were():
    torch.manual_seed(0)
    m = RefAttention().train()
    before = {n: (p._version, p.detach().clone()) for n, p in m.named_parameters()}
    x = torch.randn(2, 5, 32, requires_grad=True)
    loss = m(x).square().sum()  # a graph built before the check
    MyAdapter.modes.clear()
    adapter = MyAdapter(m)
    report = check(adapter)
    assert report.ok, str(report)
    assert MyAdapter.modes and not any(MyAdapter.modes)  # every call ran an eval-mode module
    assert m.training and adapter.m is m
    for n, p in m.named_parameters():
        assert p._version == before[n][0], n
        torch.testing.assert_close(p.detach(), before[n][1], rtol=0, atol=0)
    loss.backward()  # the reference: autograd's own check that nothing it saved was written to
    assert x.grad is not None


def test_a_users_adapter_is_checked_in_float64_where_its_layer_runs_in_it():
    torch.manual_seed(0)
    m = RefAttention()
    report = check(MyAdapter(m))
    assert report.ok and report.dtype == "float64", str(report)
    assert m.q_proj.weight.dtype == torch.float32  # the caller's layer was not converted
