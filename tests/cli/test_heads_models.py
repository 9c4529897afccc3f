"""`headwise heads --model DIR` on tiny random GPT-2 and Llama checkpoints saved with a tokenizer built
offline: the drawn weights are the unpatched model's own `output_attentions`, and every argument is
checked against config.json before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from headwise.cli import main  # noqa: E402
from tests.interop.tiny_models import VOCAB, build  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[BOS]"] + [f"w{i}" for i in range(VOCAB - 3)]
TEXT = "w1 w5 w9 w2 w7 w3 w30 w4"


def save_checkpoint(family: str, path: Path) -> Path:
    """A tiny random `family` model and a WordLevel tokenizer (its vocabulary is the model's) in `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)
    build(family).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def reference_attentions(path: Path, text: str, max_tokens: int = 64) -> tuple[list[str], torch.Tensor]:
    """(tokens, (layers, h, s, s)) from the unpatched model's own eager attention (output_attentions)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    enc = tok(text, return_tensors="pt", truncation=True, max_length=max_tokens)
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_attentions=True)
    return tok.convert_ids_to_tokens(enc["input_ids"][0].tolist()), torch.cat(out.attentions)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_all_layers_are_the_models_own_attention(checkpoint, capsys) -> None:
    family, path = checkpoint
    tokens, ref = reference_attentions(path, TEXT)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["family"] == family and not r["truncated"] and [m["layer"] for m in r["layers"]] == [0, 1]
    assert all(m["tokens"] == tokens for m in r["layers"])
    drawn = torch.tensor([m["weights"] for m in r["layers"]], dtype=torch.float32)
    torch.testing.assert_close(drawn, ref, rtol=1e-5, atol=1e-6)  # JSON keeps 6 significant digits
    if family != "bert":
        assert bool(drawn.triu(1).eq(0).all())  # the decoder's causal mask was the model's


def test_chosen_layer_and_heads(checkpoint, capsys) -> None:
    family, path = checkpoint
    _, ref = reference_attentions(path, TEXT)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1", "--heads", "0,2", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["layer"] == 1 and r["heads"] == [0, 2] and [s["head"] for s in r["summary"]] == [0, 2]
    torch.testing.assert_close(torch.tensor(r["weights"]), ref[1, [0, 2]], rtol=1e-5, atol=1e-6)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1", "--heads", "0-1")
    assert code == 0 and "head" in out and f"{path.name}, layer 1, heads 0,1" in out


def test_long_text_is_cut_and_the_cut_announced(checkpoint, capsys) -> None:
    _, path = checkpoint
    text = " ".join(f"w{i % 30 + 3}" for i in range(100))  # 100 tokens, past the 64 positions
    code, out, err = run(capsys, text, "--model", str(path), "--max-tokens", "64", "--json")
    assert code == 0
    assert "note: the text has 100 tokens; only the first 64 are drawn (--max-tokens 64; the model takes at most 64)" in err
    r = json.loads(out)
    assert r["truncated"] and r["text_tokens"] == 100 and len(r["tokens"]) == 64
    _, ref = reference_attentions(path, text, 64)
    torch.testing.assert_close(torch.tensor(r["weights"]), ref[0], rtol=1e-5, atol=1e-6)


def test_default_cut_is_the_position_limit_of_a_model_with_fewer_than_64(capsys, tmp_path) -> None:
    path = tmp_path / "short"
    save_checkpoint("gpt2", path)
    build("gpt2", n_positions=16).save_pretrained(path)  # the same tokenizer, 16 positions
    text = " ".join(f"w{i % 30 + 3}" for i in range(20))
    code, out, err = run(capsys, text, "--model", str(path), "--json")  # no --max-tokens: 16, not 64
    assert code == 0, err
    assert "only the first 16 are drawn (--max-tokens 16; the model takes at most 16)" in err
    r = json.loads(out)
    assert r["truncated"] and r["text_tokens"] == 20 and len(r["tokens"]) == 16
    _, ref = reference_attentions(path, text, 16)
    torch.testing.assert_close(torch.tensor(r["weights"]), ref[0], rtol=1e-5, atol=1e-6)
    code, _, err = run(capsys, text, "--model", str(path), "--max-tokens", "64")  # given: still refused
    assert code == 2 and "--max-tokens must be at most 16 (the model's position embeddings), got 64" in err


def test_html_and_png_of_every_layer(checkpoint, capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from headwise.viz.html import decode
    from tests.viz.test_html import embedded

    _, path = checkpoint
    _, ref = reference_attentions(path, TEXT)
    page = tmp_path / "m.html"
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--out", str(page))
    assert code == 0, err
    meta, blob = embedded(page.read_text())
    weights, _ = decode(meta, blob)
    torch.testing.assert_close(weights, ref, atol=0.5 / 255 + 1e-6, rtol=0)
    png = tmp_path / "m.png"
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--out", str(png))
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert "note: model view: attention weights only" in err


@pytest.fixture
def no_loading(monkeypatch):
    import headwise.viz.models as models

    def refuse(*a, **k):
        raise AssertionError("nothing may load before the arguments are checked")

    monkeypatch.setattr(models, "load", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)


def test_bad_arguments_are_refused_before_loading(capsys, tmp_path, no_loading) -> None:
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 3, "n_positions": 64}))
    (path / "tokenizer.json").write_text("{}")
    odd = tmp_path / "t5"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "t5", "num_layers": 2, "num_heads": 4,
                                                "is_encoder_decoder": True}))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((path / "config.json").read_text())
    cases = [
        (["--max-tokens", "65"], "--max-tokens must be at most 64 (the model's position embeddings), got 65"),
        (["--max-tokens", "100000"], "at most 64"),
        (["--layer", "2"], "layer must be an int in [-2, 2) for the 2-layer gpt2 model, got 2"),
        (["--heads", "1,3"], "heads must be in [0, 3) for this 3-head model, got 3"),
        (["--heads", "x"], "error: --heads must be head numbers and ranges such as 0,3,5-7, got 'x'"),
        (["--heads", "3-1"], "argument --heads: '3-1' is not a head number or a range"),
        (["--layer", "1", "--all-layers"], "not allowed with argument"),
        (["--out", str(tmp_path / "x.gif")], "--out must end in .png or .html"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, TEXT, "--model", str(path), *argv)
        assert code == 2 and message in err, (argv, err)
        assert "Traceback" not in err + out and len(err.strip().splitlines()) == 1
    for model, message in [(tmp_path / "nope", "neither 'all-minilm-l6-v2' nor an existing directory"),
                           (path / "config.json", "is a file; pass the save_pretrained directory"),
                           (tmp_path, "has no config.json"),
                           (odd, "model_type 't5' in"),
                           (odd, "is an encoder-decoder model, which headwise heads does not draw"),
                           (bare, "has no tokenizer files")]:
        code, out, err = run(capsys, TEXT, "--model", str(model))
        assert code == 2 and message in err, (model, err)
        assert len(err.strip().splitlines()) == 1


def test_drawings_too_large_are_refused_before_the_model_loads(checkpoint, capsys, tmp_path, monkeypatch) -> None:
    import shutil

    import headwise.viz.models as models

    _, path = checkpoint
    big = tmp_path / "big"
    big.mkdir()
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, big / f.name)
    (big / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 40, "n_head": 40,
                                                 "n_positions": 8192}))

    def refuse(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(models, "load", refuse)
    text = " ".join(f"w{i % 30 + 3}" for i in range(3000))
    code, out, err = run(capsys, text, "--model", str(big), "--all-layers", "--max-tokens", "3000")
    assert code == 2 and "40 layers x 40 heads x 3000 x 3000 tokens would hold 107.3 GiB" in err, err
    code, out, err = run(capsys, text, "--model", str(big), "--max-tokens", "3000", "--out", str(tmp_path / "x.html"))
    assert code == 2 and "an HTML page of 1 layer x 40 heads x 3000 x 3000 tokens would hold 360M weights" in err
    assert len(err.strip().splitlines()) == 1


def tampered(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` in `dst` whose safetensors weights are `edit(state dict)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file(edit(dict(weights)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _renamed(sd: dict, key: str) -> dict:
    sd[key.replace(".weight", ".renamed")] = sd.pop(key)
    return sd


TAMPERING = {  # what is done to the weights, given layer 1's attention key
    "an attention weight renamed": _renamed,
    "an attention weight missing": lambda sd, k: {n: t for n, t in sd.items() if n != k},
    "a layer missing": lambda sd, k: {n: t for n, t in sd.items() if ".1." not in n},
}
ATTENTION_KEY = {"gpt2": "transformer.h.1.attn.c_attn.weight", "llama": "model.layers.1.self_attn.q_proj.weight"}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_weights_that_are_not_the_checkpoints_model_are_refused(checkpoint, capsys, tmp_path, how) -> None:
    family, path = checkpoint
    edit = TAMPERING[how]
    key = ATTENTION_KEY[family]
    bad = tampered(path, tmp_path / "bad", lambda sd: edit(sd, key))
    code, out, err = run(capsys, TEXT, "--model", str(bad), "--json")
    assert code == 2 and out == "", (how, out[:200], err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "refusing to draw a model that is not the checkpoint" in err
    assert key.split(".")[1] + ".1." in err  # names (a key of) the layer whose weights are not there


def test_a_layer_the_config_does_not_have_is_refused(checkpoint, capsys, tmp_path) -> None:
    family, path = checkpoint
    bad = tampered(path, tmp_path / "bad", lambda sd: sd)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = 1
    (bad / "config.json").write_text(json.dumps(cfg))
    code, out, err = run(capsys, TEXT, "--model", str(bad))
    assert code == 2 and "does not take" in err and ".1." in err and len(err.strip().splitlines()) == 1


def test_a_bert_checkpoint_without_its_pooler_is_drawn(capsys, tmp_path) -> None:
    path = save_checkpoint("bert", tmp_path / "full")
    bare = tampered(path, tmp_path / "bare", lambda sd: {k: v for k, v in sd.items() if not k.startswith("pooler.")})
    tokens, ref = reference_attentions(path, TEXT)  # the pooler never feeds an attention layer
    code, out, err = run(capsys, TEXT, "--model", str(bare), "--all-layers", "--json")
    assert code == 0, err
    drawn = torch.tensor([m["weights"] for m in json.loads(out)["layers"]], dtype=torch.float32)
    torch.testing.assert_close(drawn, ref, rtol=1e-5, atol=1e-6)


def timed(capsys, *argv: str) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of `heads *argv`, run in a thread so that a hang fails instead of blocking."""
    import threading
    import time

    result: list = []
    thread = threading.Thread(target=lambda: result.append(main(["heads", *argv])), daemon=True)
    start = time.perf_counter()
    thread.start()
    thread.join(30)
    seconds = time.perf_counter() - start
    _, err = capsys.readouterr()
    return (result[0] if result else -1), err, seconds


@pytest.mark.parametrize("n_layers", [10**6, 10**9])
def test_a_config_far_larger_than_its_weights_is_refused_at_once(checkpoint, capsys, tmp_path, n_layers) -> None:
    family, path = checkpoint
    big = tampered(path, tmp_path / "big", lambda sd: sd)
    cfg = json.loads((big / "config.json").read_text())
    cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = n_layers
    (big / "config.json").write_text(json.dumps(cfg))
    for extra in ([], ["--all-layers"]):
        code, err, seconds = timed(capsys, TEXT, "--model", str(big), *extra)
        assert code == 2 and seconds < 2, (extra, code, seconds, err)
        assert f"at least" in err and f"({n_layers} layers)" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_in_the_checkpoint_is_refused_without_opening_it(checkpoint, capsys, tmp_path, name) -> None:
    import os

    _, path = checkpoint
    bad = tampered(path, tmp_path / "bad", lambda sd: sd)
    (bad / name).unlink()
    os.mkfifo(bad / name)
    try:
        code, err, seconds = timed(capsys, TEXT, "--model", str(bad))
    finally:  # a reader blocked on the FIFO gets end-of-file, so the thread ends
        try:
            os.close(os.open(bad / name, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: nothing blocked
            pass
    assert code == 2 and seconds < 2, (code, seconds, err)
    assert f"{name}' is a FIFO, not a regular file" in err and len(err.strip().splitlines()) == 1
    assert "cannot read" not in err and err.count("--model:") == 1  # said once, plainly


def test_a_config_too_large_for_a_config_is_not_read(capsys, tmp_path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    (path / "tokenizer.json").write_text("{}")
    with open(path / "config.json", "wb") as f:
        f.truncate(2**30)  # sparse: a gigabyte of zeros on no disk
    code, err, seconds = timed(capsys, TEXT, "--model", str(path))
    assert code == 2 and seconds < 2 and "more than a config.json can be" in err, (code, seconds, err)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(capsys, tmp_path, where) -> None:
    import shutil

    path = save_checkpoint("gpt2", tmp_path / "m")
    (path / "model.safetensors").unlink()
    build("gpt2").save_pretrained(path, max_shard_size="4KB")  # the same model, in shards
    capsys.readouterr()
    code, out, err = run(capsys, TEXT, "--model", str(path), "--json")
    assert code == 0, err  # untampered shards load
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / shard
    shutil.move(path / shard, outside)  # a real shard, so that following the name would load it
    name = f"../{shard}" if where == "parent" else str(outside)
    index["weight_map"] = {k: (name if v == shard else v) for k, v in index["weight_map"].items()}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()  # the saving's progress bars
    code, out, err = run(capsys, TEXT, "--model", str(path))
    assert code == 2 and f"names shard {name!r}, which is not a file name in the folder" in err, err
    assert len(err.strip().splitlines()) == 1


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as RFC 8259 and JavaScript's JSON.parse do."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_of_a_one_token_text_is_strict_json_with_null_for_undefined_scores(checkpoint, capsys) -> None:
    family, path = checkpoint
    code, out, err = run(capsys, "w1", "--model", str(path), "--json")
    assert code == 0, err
    r = _strict_json(out)  # one token: the positional scores have no pairs to average over (NaN in the library)
    tokens, ref = reference_attentions(path, "w1")
    assert r["tokens"] == tokens == ["w1"]
    torch.testing.assert_close(torch.tensor(r["weights"], dtype=torch.float64), ref[0].double(),
                               rtol=1e-5, atol=1e-6)
    for head in r["summary"]:
        assert head["previous"] is None and head["next"] is None and head["positional"] is None
        assert head["reads_most"] == "w1"


def test_a_tokenizer_file_that_is_not_json_is_named(capsys, tmp_path) -> None:
    path = save_checkpoint("gpt2", tmp_path / "ckpt")
    (path / "tokenizer.json").write_text("not json {")
    capsys.readouterr()  # saving's progress bars
    code, out, err = run(capsys, TEXT, "--model", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--model: cannot load the tokenizer: {str(path / 'tokenizer.json')!r} is not valid JSON" in err


def test_a_config_value_of_the_wrong_type_is_named_with_what_was_read(capsys, tmp_path) -> None:
    path = save_checkpoint("llama", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = None
    (path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # saving's progress bars
    code, out, err = run(capsys, TEXT, "--model", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--model: cannot load the tokenizer of {str(path)!r}: config.json:" in err
    assert "max_position_embeddings" in err
