"""Loading a surgery folder back (headwise.surgery.load_pretrained) from a tampered sidecar, weights index or
weight file: one ValueError naming the field or file, before anything is allocated; never another error."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from headwise.interop import patch  # noqa: E402
from headwise.surgery import load_pretrained, prune_heads, save_pretrained  # noqa: E402
from tests.interop.tiny_models import build, inputs, output  # noqa: E402

LLAMA = transformers.LlamaForCausalLM
DROP = {0: [1], 1: [0, 2, 5]}  # different head counts per layer: the headwise loader rebuilds it
ATTN = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A pruned Llama saved in one file, and the same model saved in shards."""
    model = prune_heads(patch(build("llama")), DROP)
    one, shards = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("shards")
    save_pretrained(model, one)
    save_pretrained(model, shards, max_shard_size="4KB")
    assert (shards / "model.safetensors.index.json").exists()
    return one, shards, output(model, inputs())


def copy_of(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def load(path, seconds: float = 20.0, cls=LLAMA):
    """load_pretrained in a thread (a blocked read fails the test instead of hanging it): its result or error."""
    result: list = []

    def target():
        try:
            result.append(load_pretrained(path, cls))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result.append(exc)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else TimeoutError("load_pretrained did not return")


def edit_sidecar(path, edit):
    file = path / "headwise_surgery.json"
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _set(key, value):
    return lambda d: d["modules"][ATTN].update({key: value})


SIDECARS = {
    "a module is not an object": (lambda d: d["modules"].update({ATTN: 3}), rf"modules\['{ATTN}'\] must be an object"),
    "a count is missing": (lambda d: d["modules"][ATTN].pop("n_heads"), r"\.n_heads must be a positive int, got None"),
    "a count is a string": (_set("n_kv_heads", "2"), r"\.n_kv_heads must be a positive int, got '2'"),
    "a count is a bool": (_set("d_head", True), r"\.d_head must be a positive int, got True"),
    # a sidecar without original_heads (they are optional): the counts alone reach the shape check
    "a huge count": (lambda d: (d["modules"][ATTN].pop("original_heads"), d["modules"][ATTN].update(n_heads=10**12)),
                     r"n_heads=1000000000000.*do not fit the saved .*q_proj.weight"),
    "a huge grouped count": (lambda d: (d["modules"][ATTN].pop("original_heads"),
                                        d["modules"][ATTN].update(n_heads=2 * 10**12, n_kv_heads=10**12)),
                             r"do not fit the saved"),
    "a huge count with its original heads": (_set("n_heads", 10**12), r"original_heads must list the original "
                                             r"index of each of its 1000000000000 heads"),
    "a class that is not a name": (_set("class", 3), r"\.class must be the attention module's class name, got 3"),
    "modules is a list": (lambda d: d.update(modules=[]), "'modules' must be an object"),
    "format is true": (lambda d: d.update(format=True), "format 2 .*got format True"),
    "plain_hf is a string": (lambda d: d.update(plain_hf="no"), "'plain_hf' must be true or false"),
}


@pytest.mark.parametrize("case", list(SIDECARS))
def test_a_tampered_sidecar_is_one_value_error_naming_the_field(saved, tmp_path, case):
    edit, match = SIDECARS[case]
    path = copy_of(saved[0], tmp_path)
    edit_sidecar(path, edit)
    err = load(path)
    assert isinstance(err, ValueError), repr(err)
    assert __import__("re").search(match, str(err)), str(err)


def test_a_sidecar_nested_past_the_recursion_limit_is_a_value_error(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    (path / "headwise_surgery.json").write_text("[" * 100_000 + "]" * 100_000)
    err = load(path)
    assert isinstance(err, ValueError) and "not readable JSON" in str(err), repr(err)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_sidecar_that_is_not_a_file_is_refused_without_opening_it(saved, tmp_path, kind):
    path = copy_of(saved[0], tmp_path)
    sidecar = path / "headwise_surgery.json"
    sidecar.unlink()
    sidecar.mkdir() if kind == "directory" else os.mkfifo(sidecar)
    start = time.perf_counter()
    try:
        err = load(path, seconds=5)
    finally:
        if kind == "fifo":  # let a reader blocked on it see end-of-file
            try:
                os.close(os.open(sidecar, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert isinstance(err, ValueError) and "is not a regular file" in str(err), repr(err)
    assert time.perf_counter() - start < 2


def test_a_damaged_weight_file_is_a_value_error_naming_it(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # the header cut short
    err = load(path)
    assert isinstance(err, ValueError) and "model.safetensors': not a readable safetensors file" in str(err), repr(err)
    weights.unlink()
    weights.mkdir()
    err = load(path)
    assert isinstance(err, ValueError) and "model.safetensors' is not a regular file" in str(err), repr(err)


def edit_index(path, edit):
    file = path / "model.safetensors.index.json"
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(saved, tmp_path, where):
    path = copy_of(saved[1], tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / shard  # a real shard, so that following the name would load
    shutil.move(path / shard, outside)
    name = f"../{shard}" if where == "parent" else str(outside)
    edit_index(path, lambda d: d["weight_map"].update({k: name for k, v in d["weight_map"].items() if v == shard}))
    err = load(path)
    assert isinstance(err, ValueError) and f"names shard {name!r}, which is not a file name in the folder" in str(err), \
        repr(err)


def test_a_malformed_index_is_a_value_error(saved, tmp_path):
    path = copy_of(saved[1], tmp_path)
    edit_index(path, lambda d: d.update(weight_map=["model-00001-of-00002.safetensors"]))
    err = load(path)
    assert isinstance(err, ValueError) and "'weight_map' must map weight names to shard file names" in str(err), repr(err)


def test_the_untampered_folders_still_load(saved):
    import torch

    one, shards, want = saved
    for path in (one, shards):
        torch.testing.assert_close(output(load_pretrained(path, LLAMA), inputs()), want)


@pytest.mark.parametrize("drop, plain", [({0: [0, 1, 2], 1: [3, 4, 5]}, True), (DROP, False)],
                         ids=["plain_hf", "rebuilt"])
def test_a_missing_weight_is_refused_and_a_task_head_the_folder_never_had_is_initialised(tmp_path, drop, plain):
    import torch
    from safetensors.torch import load_file, save_file

    model = prune_heads(patch(build("llama")), drop)
    assert save_pretrained(model, tmp_path) is plain
    task = load_pretrained(tmp_path, transformers.LlamaForSequenceClassification)  # a head the LM never had
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(task.model(**batch).last_hidden_state, model.model(**batch).last_hidden_state)
    assert tuple(task.score.weight.shape) == (task.config.num_labels, 24) and task.score.weight.abs().sum() > 0
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    del state[f"{ATTN}.q_proj.weight"]  # an incomplete folder: a weight the saving class has
    save_file(state, weights, metadata={"format": "pt"})
    for cls in (LLAMA, transformers.LlamaForSequenceClassification):
        with pytest.raises(ValueError, match=rf"does not match .*: missing keys \['{ATTN}.q_proj.weight'\]"):
            load_pretrained(tmp_path, cls)


def test_a_damaged_weight_file_of_a_plain_folder_is_a_value_error(tmp_path):
    build("bert").save_pretrained(tmp_path)  # no sidecar: transformers' own loader
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="(the weights in|weight file) .*: not a readable safetensors file: .*header"):
        load_pretrained(tmp_path, transformers.BertModel)


@pytest.mark.parametrize("cls", [LLAMA, transformers.AutoModelForCausalLM], ids=["class", "auto"])
def test_a_config_with_more_layers_than_were_saved_is_refused_before_building(saved, tmp_path, cls):
    path = copy_of(saved[0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 10**6
    (path / "config.json").write_text(json.dumps(config))
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        n_saved = len(list(f.keys()))
    start = time.perf_counter()
    err = load(path, seconds=60, cls=cls)
    assert isinstance(err, ValueError), repr(err)
    assert re.search(rf"config\.json \(num_hidden_layers=1000000\) builds more than \d+ modules for {cls.__name__}, "
                     rf"more than the {n_saved} saved weights in .* can fill: refused before building it", str(err)), err
    # a fraction of a second alone; building the 10**6 layers would take many minutes, so a loaded CI machine's
    # seconds say the same
    assert time.perf_counter() - start < 30


def test_a_config_that_is_a_fifo_is_refused_without_opening_it(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    (path / "config.json").unlink()
    os.mkfifo(path / "config.json")
    try:
        err = load(path, seconds=5)
    finally:
        try:
            os.close(os.open(path / "config.json", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert isinstance(err, ValueError) and "config" in str(err) and "is not a regular file" in str(err), repr(err)


def _hybrid(model_type):
    """A tiny model with fewer attention modules than layers: ALBERT's one layer shared by every depth, or a
    hybrid with attention in layers 0 and 2 only (a convolution or Mamba mixer in layer 1); norms and biases
    moved off HF's init so they matter."""
    base = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4)
    extra = {"albert": dict(embedding_size=8, num_hidden_groups=1),
             "lfm2": dict(num_key_value_heads=2, layer_types=["full_attention", "conv", "full_attention"]),
             "nemotron_h": dict(num_key_value_heads=2, hybrid_override_pattern="*M*", mamba_num_heads=4,
                                mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=4)}[model_type]
    config = transformers.AutoConfig.for_model(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               **base, **extra)
    import torch

    torch.manual_seed(0)
    auto = transformers.AutoModel if model_type == "albert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("model_type", ["albert", "lfm2", "nemotron_h"])
def test_a_model_with_fewer_attention_modules_than_layers_reloads(tmp_path, model_type):
    import torch

    from headwise.interop import layers
    from headwise.surgery import original_heads

    model = patch(_hybrid(model_type))
    assert len(layers(model)) < model.config.num_hidden_layers  # what the loader must not take for missing layers
    prune_heads(model, {0: [1]})
    assert save_pretrained(model, tmp_path) is False  # the headwise loader's path, not plain from_pretrained
    want = output(model, inputs())
    reloaded = load_pretrained(tmp_path, type(model))
    torch.testing.assert_close(output(reloaded, inputs()), want, rtol=0, atol=0)
    assert original_heads(patch(reloaded)) == original_heads(model)
    assert original_heads(model)[0] == (0, 2, 3)


def _more_layers(path, model_type):
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] += 1
    if model_type == "lfm2":
        config["layer_types"].append("full_attention")
    (path / "config.json").write_text(json.dumps(config))
    return config["num_hidden_layers"]


@pytest.mark.parametrize("model_type", ["llama", "lfm2"])
def test_a_config_with_one_more_layer_than_saved_is_refused_before_allocating(saved, tmp_path, monkeypatch,
                                                                                model_type):
    if model_type == "llama":
        path, cls = copy_of(saved[0], tmp_path), LLAMA
    else:
        model = prune_heads(patch(_hybrid("lfm2")), {0: [1]})
        path, cls = tmp_path / "lfm2", type(model)
        save_pretrained(model, path)
    n = _more_layers(path, model_type)

    def allocate(*args, **kwargs):
        raise AssertionError("from_pretrained was reached: the model was allocated")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(allocate))
    with pytest.raises(ValueError) as err:
        load_pretrained(path, cls)
    assert re.search(rf"config\.json \(num_hidden_layers={n}\) builds {n} entries of {cls.__name__}'s "
                     rf"'model\.layers', but the saved weights in .* have none for \['model\.layers\.{n - 1}'\]: "
                     r"config\.json describes more layers than were saved", str(err.value)), err.value


def test_a_config_with_more_layers_under_another_name_is_refused_fast(tmp_path):
    """The bound is on what the probe builds, whatever the config calls its layer count (BART's
    decoder_layers is not num_hidden_layers)."""
    from tests.surgery.test_hf_families import build as family

    model = prune_heads(patch(family("bart")), {0: [1]})
    assert save_pretrained(model, tmp_path) is False
    config = json.loads((tmp_path / "config.json").read_text())
    config["decoder_layers"] = 10**6
    (tmp_path / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    err = load(tmp_path, seconds=60, cls=type(model))
    assert isinstance(err, ValueError), repr(err)
    assert re.search(r"decoder_layers=1000000.*builds more than \d+ modules for BartForConditionalGeneration, "
                     r"more than the \d+ saved weights", str(err)), err
    assert time.perf_counter() - start < 30  # as above: seconds, not the minutes of building every layer


def test_a_peft_wrapper_or_a_bare_layer_is_refused_before_anything_is_written(tmp_path):
    import torch

    import headwise
    from headwise.interop import unpatch

    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(build("llama"), peft.LoraConfig(target_modules=["gate_proj"], r=2,
                                                                  init_lora_weights=False))
    prune_heads(patch(wrapped), DROP)
    folder = tmp_path / "out"
    # PEFT's own save_pretrained would write the adapter alone, losing the resized attention weights
    with pytest.raises(TypeError, match=r"expected the transformers model itself \(a PreTrainedModel\), got "
                                        r"PeftModel holding a LlamaForCausalLM: .*merge_and_unload\(\) first"):
        save_pretrained(wrapped, folder)
    with pytest.raises(TypeError, match=r"expected the transformers model itself .*got MultiHeadAttention"):
        save_pretrained(headwise.MultiHeadAttention(d_model=8, n_heads=2), folder)
    assert not folder.exists()
    merged = unpatch(wrapped.merge_and_unload())  # what the message says to do
    want = output(merged, inputs())
    assert save_pretrained(merged, folder) is False
    torch.testing.assert_close(output(load_pretrained(folder, LLAMA), inputs()), want)


def test_the_model_inside_a_peft_wrapper_is_refused_while_adapters_wrap_its_modules(tmp_path):
    import torch

    peft = pytest.importorskip("peft")
    from headwise.interop import unpatch

    model = unpatch(prune_heads(patch(build("llama")), DROP))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=2,
                                                         init_lora_weights=False))
    want = output(wrapped, inputs())  # PEFT's own forward, adapters applied
    folder = tmp_path / "out"
    # saved as it is, the folder would hold q_proj.base_layer.weight and lora_A: weights Llama does not have
    with pytest.raises(TypeError, match=rf"expected a model without adapters, got a LlamaForCausalLM whose "
                                        rf"'{ATTN}.q_proj' \(peft.Linear\), '{ATTN}.v_proj' \(peft.Linear\), .* "
                                        r"wrapped by an adapter \(PEFT\).*merge_and_unload\(\).*own save_pretrained"):
        save_pretrained(wrapped.base_model.model, folder)
    assert not folder.exists()
    assert save_pretrained(wrapped.merge_and_unload(), folder) is False  # what the message says to do
    torch.testing.assert_close(output(load_pretrained(folder, LLAMA), inputs()), want)


@pytest.mark.parametrize("cls", [LLAMA, transformers.AutoModelForCausalLM], ids=["class", "auto"])
def test_a_missing_folder_or_a_wrong_attn_implementation_is_refused_in_words(tmp_path, cls):
    missing = tmp_path / "does_not_exist"
    with pytest.raises(ValueError, match=rf"load_pretrained: cannot read the config '{re.escape(str(missing))}/"
                                         r"config\.json': No such file or directory"):
        load_pretrained(missing, cls)  # not transformers' OSError about hub repo ids
    with pytest.raises(TypeError, match=r"attn_implementation must be a str \(\"eager\", \"sdpa\"\), a dict of them "
                                        r"\(a composite model's parts\) or None, got int 3"):
        load_pretrained(missing, cls, attn_implementation=3)


def test_a_folder_that_also_holds_an_adapter_is_refused_and_a_dict_implementation_taken(tmp_path):
    # transformers would load the adapter into the model and report the adapter's weights, not the model's
    import torch

    peft = pytest.importorskip("peft")
    model = prune_heads(patch(build("llama")), DROP)
    want = output(model, inputs())
    folder = tmp_path / "out"
    save_pretrained(model, folder)
    loaded = load_pretrained(folder, LLAMA, attn_implementation={"": "eager"})  # transformers' per-part form
    torch.testing.assert_close(output(loaded, inputs()), want)
    wrapped = peft.get_peft_model(loaded, peft.LoraConfig(target_modules=["q_proj"], r=2))
    wrapped.save_pretrained(folder)  # the adapter beside the model
    with pytest.raises(ValueError, match=r"also holds a PEFT adapter \(adapter_config\.json\): expected a folder of "
                                         r"the model alone"):
        load_pretrained(folder, LLAMA)
