"""pytest plugin: run Hugging Face's own model tests with every model they build patched by headwise.

Loaded by :mod:`tests.hf_suite.run` (``-p hf_plugin``) into a pytest session rooted in the assembled suite
(:mod:`tests.hf_suite.assemble`); it is never imported by the main test run. What it does:

* **patches every model**: ``PreTrainedModel.post_init`` (the last step of every model's ``__init__``, so also
  of ``from_pretrained`` and ``_from_config``) is wrapped to call :func:`headwise.interop.patch` on the new model.
  Models with no attention headwise can take over stay as they are (the check below catches tests that build only
  such models).
* **keeps headwise in charge**: ``set_attn_implementation("eager" | "sdpa")`` on a patched model switches it, then
  patches it again, so headwise computes with the conventions of the implementation asked for (eager's: weights
  on every call, uniform rows for queries that read nothing), except in ``test_eager_matches_sdpa*``: there the
  eager side is the reference, so a model switched to (or loaded as) ``"eager"`` is unpatched and runs
  transformers' own eager attention, and the side that stays on sdpa is headwise.
* **lets ``config.output_attentions = True`` stand on a patched model's config**, as transformers lets it stand
  under ``"eager"``: transformers' config refuses it for every other implementation, ``"headwise"`` included, and
  ``test_attention_outputs`` sets it after building the model (which patching switched to ``"headwise"``). The
  library leaves that rule alone (users pass ``output_attentions=True`` to the call); only this test process
  wraps the setter, a known difference listed in docs/interop_hf_tests.md.
* **proves the patch took over**: every test that passes must have built at least one patched layer and, if any
  attention module ran, have run ``headwise.functional`` attention at least once; otherwise it is turned into a
  failure (a test that silently ran unpatched would pass for the wrong reason). A test that built no model at all
  (HF's test skipped every model class) is reported as skipped, not passed.

``HEADWISE_HF=off`` turns all of this off: the same tests, unpatched, to tell failures of headwise from failures
that transformers' tests have on their own.
"""

from __future__ import annotations

import os

import pytest

ON = os.environ.get("HEADWISE_HF", "on") != "off"
REFERENCE_TESTS = "test_eager_matches_sdpa"  # tests whose eager side is the unpatched reference

# transformers 5.24's testing_utils lacks the shared tester defaults the vendored testers read (their source commit
# defines them in testing_utils); the values are that commit's, copied verbatim.
TEXT_MODEL_TESTER_DEFAULTS = {
    "batch_size": 13, "seq_length": 7, "is_training": True, "use_input_mask": True, "use_labels": True,
    "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 32, "hidden_act": "gelu", "max_position_embeddings": 512,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "expert_interval": 1, "moe_layer_start_index": 0,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 36, "shared_expert_gate": True,
    "moe_num_shared_experts": 2, "num_experts_per_tok": 2, "num_experts": 8,
}

MARKERS = ("slow", "is_pipeline_test", "is_staging_test", "accelerate_tests", "not_device_test",
           "torch_compile_test", "torch_export_test", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
           "training_ci", "tensor_parallel_ci", "fsdp_ci", "generate", "flaky")


class Counts:
    """What the running test did: patched layers built, headwise attention calls made."""

    def __init__(self) -> None:
        self.models = 0  # models built (every one passes through post_init)
        self.layers = 0
        self.calls = 0
        self.attention_forwards = 0  # forwards of any *Attention module, patched or not
        self.reference = False  # inside a test whose eager side is the reference


COUNTS = Counts()


def _not_here(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"{name}: multi-process tests are not part of this run")

    return refuse


def _shim_transformers() -> None:
    """The two gaps between the vendored files, the 5.24 common files and transformers 5.24."""
    import sys
    import types

    import transformers.testing_utils as tu

    if not hasattr(tu, "_TEXT_MODEL_TESTER_DEFAULTS"):
        tu._TEXT_MODEL_TESTER_DEFAULTS = dict(TEXT_MODEL_TESTER_DEFAULTS)
    # The 5.24 sdist's FSDP / tensor- / expert-parallel mixins import a helper module the sdist does not ship;
    # those (multi-process) tests are not run here, so the helpers only need to exist.
    stub = types.ModuleType("tests.distributed_testing_utils")
    stub.__getattr__ = _not_here
    sys.modules.setdefault("tests.distributed_testing_utils", stub)


def _count(fn):
    def counted(*args, **kwargs):
        COUNTS.calls += 1
        return fn(*args, **kwargs)

    counted.__wrapped__ = fn
    return counted


def _install() -> None:
    """Wrap model construction and attention-implementation switches; count headwise's attention calls."""
    import headwise.functional as hwf
    from transformers import PreTrainedModel

    import headwise.interop as interop

    import torch

    def seen(module, _args):
        if type(module).__name__.endswith("Attention"):
            COUNTS.attention_forwards += 1

    torch.nn.modules.module.register_module_forward_pre_hook(seen)
    hwf.attention = _count(hwf.attention)
    hwf.attend = _count(hwf.attend)
    post_init = PreTrainedModel.post_init
    set_impl = PreTrainedModel.set_attn_implementation

    def patched_post_init(self, *args, **kwargs):
        out = post_init(self, *args, **kwargs)
        COUNTS.models += 1
        impl = getattr(self.config, "_attn_implementation", None)
        if COUNTS.reference and impl == "eager":
            return out  # the reference side of eager-vs-sdpa stays transformers' own
        if impl not in (None, "eager", "sdpa", "headwise"):
            return out  # flash / flex kernels: headwise refuses them (patch raises ValueError)
        if impl == "headwise" and getattr(self.config, "output_attentions", False):
            # a config asking for weights (which only this process lets stand under "headwise") asks for eager, as
            # transformers reads it: patched with eager's conventions, the model returns them on every call
            self.config._attn_implementation = "eager"
        try:
            interop.patch(self)
        except TypeError as e:
            if "contains no attention module" not in str(e):
                raise
        COUNTS.layers = max(COUNTS.layers, len(interop.layers(self)))
        return out

    def patched_set_impl(self, attn_implementation, *args, **kwargs):
        if interop.layers(self) and attn_implementation in ("eager", "sdpa"):
            if COUNTS.reference and attn_implementation == "eager":
                interop.unpatch(self)  # the eager reference: transformers' own attention, not headwise's
            else:
                out = set_impl(self, attn_implementation, *args, **kwargs)
                interop.patch(self)  # headwise again, with the conventions of the implementation asked for
                return out
        return set_impl(self, attn_implementation, *args, **kwargs)

    PreTrainedModel.post_init = patched_post_init
    PreTrainedModel.set_attn_implementation = patched_set_impl
    _let_patched_configs_ask_for_weights()


def _let_patched_configs_ask_for_weights() -> None:
    """``config.output_attentions = True`` stands on a config whose implementation is ``"headwise"`` (this test
    process only; see the module docstring)."""
    from transformers import PreTrainedConfig

    prop = PreTrainedConfig.__dict__["output_attentions"]
    setter, validate = prop.fset, PreTrainedConfig.validate_output_attentions

    def fset(self, value):
        if value and self._attn_implementation == "headwise":
            self._output_attentions = value
        else:
            setter(self, value)

    def validate_output_attentions(self):
        if self._attn_implementation != "headwise":
            validate(self)

    PreTrainedConfig.output_attentions = property(prop.fget, fset, prop.fdel, prop.__doc__)
    PreTrainedConfig.validate_output_attentions = validate_output_attentions


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' test suite")
    _shim_transformers()
    if ON:
        _install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    COUNTS.models = COUNTS.layers = COUNTS.calls = COUNTS.attention_forwards = 0
    COUNTS.reference = REFERENCE_TESTS in item.name
    try:
        result = yield
    finally:
        COUNTS.reference = False
    if ON and COUNTS.models == 0:
        pytest.skip("the test built no model (every model class was excluded), so it tested nothing of headwise")
    # Tests that build models but never run attention (save/load round trips of state dicts) need only the first.
    if ON and (COUNTS.layers == 0 or (COUNTS.attention_forwards and COUNTS.calls == 0)):
        raise AssertionError(f"headwise did not take over: {COUNTS.layers} patched layers built, "
                             f"{COUNTS.attention_forwards} attention forwards, {COUNTS.calls} of them through "
                             "headwise; the test passed unpatched")
    return result
