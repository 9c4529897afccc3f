"""k/v "mean" edits on a PEFT prefix-tuned model: its keys include the prefix's virtual tokens, which the mask
the model is given leaves out. The refusal names that cause and only remedies that work, and the one it
suggests (tracing the transformers model inside, which PEFT gives its own mask) averages over every real key:
against a float64 mean of the captured keys under PEFT's mask."""

from __future__ import annotations

import pytest
import torch

import headwise

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from headwise.interop import patch  # noqa: E402

from tests.interop.tiny_models import build, inputs  # noqa: E402

# PEFT asks transformers deprecated questions (and passes past_key_values); not ours to fix.
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

PREFIX = 3


def _prefixed():
    torch.manual_seed(3)
    return peft.get_peft_model(patch(build("llama")), peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                             num_virtual_tokens=PREFIX))


@pytest.mark.parametrize("site", ["k", "v"])
def test_a_key_mean_on_a_prefix_tuned_model_names_the_prefix_and_only_remedies_that_work(site):
    model, kw = _prefixed(), inputs()
    with torch.no_grad(), headwise.trace(model, edit={(0, 1, site): "mean"}):
        with pytest.raises(ValueError) as err:
            model(**kw)
    message = str(err.value)
    assert f"the {PREFIX} virtual tokens of PeftModelForCausalLM's prefix tuning" in message
    assert "get_base_model()" in message and "a tensor of the means" in message
    # neither works here: PEFT builds the mask itself, and a trace's mean of these keys is refused the same way
    assert "4-D mask" not in message and "('mean', reference)" not in message


@pytest.mark.parametrize("site", ["k", "v"])
def test_the_suggested_trace_of_the_inner_model_averages_over_the_prefix_and_the_real_prompt_keys(site):
    model, kw = _prefixed(), inputs()
    inner = model.get_base_model()
    with torch.no_grad(), headwise.trace(inner, capture={0: (site,)}) as t:
        model(**kw)
    x = t[0].get(site)  # (b, h_kv, prefix + s, d_h)
    group = 6 // x.shape[1]  # query head 1 reads K/V head 1 // group
    real = torch.cat([torch.ones(2, PREFIX), kw["attention_mask"]], dim=1).double()  # PEFT's mask: prefix real
    x1 = x[:, 1 // group].double()  # (b, prefix + s, d_h)
    mean = (x1 * real[..., None]).sum(1, keepdim=True) / real.sum(1)[:, None, None]  # (b, 1, d_h)
    with torch.no_grad(), headwise.trace(inner, edit={(0, 1, site): "mean"}):
        got = model(**kw).logits
    with torch.no_grad(), headwise.trace(inner, edit={(0, 1, site): mean.float()}):
        want = model(**kw).logits
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        assert (got - model(**kw).logits).abs().max() > 1e-4  # the edit changed the output
