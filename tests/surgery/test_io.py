"""Loading a surgery folder back (headwise.surgery.load_pretrained) from a tampered sidecar, weights index or
weight file: one ValueError naming the field or file, before anything is allocated; never another error."""

from __future__ import annotations

import json
import os
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


def load(path, seconds: float = 20.0):
    """load_pretrained in a thread (a blocked read fails the test instead of hanging it): its result or error."""
    result: list = []

    def target():
        try:
            result.append(load_pretrained(path, LLAMA))
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


def test_a_damaged_weight_file_of_a_plain_folder_is_a_value_error(tmp_path):
    build("bert").save_pretrained(tmp_path)  # no sidecar: transformers' own loader
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="(the weights in|weight file) .*: not a readable safetensors file: .*header"):
        load_pretrained(tmp_path, transformers.BertModel)


def test_a_config_with_more_layers_than_were_saved_is_refused_before_building(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 10**6
    (path / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    err = load(path)
    assert isinstance(err, ValueError) and "num_hidden_layers=1000000, but the sidecar records 2" in str(err), repr(err)
    assert time.perf_counter() - start < 2


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
