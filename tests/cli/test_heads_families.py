"""`headwise heads --model DIR` on tiny random checkpoints of families beyond BERT/GPT-2/Llama (the generic path
of headwise.interop.patch), saved with a tokenizer built offline: the drawn weights are the unpatched model's own
eager `output_attentions`, the writes are weight x ||v_j W_O^h|| from plain forward hooks, a family whose W_O is
not located draws its reads and says why, families patch refuses and other models give one line, and a pruned
checkpoint draws with its pruned head counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from headwise.cli import main  # noqa: E402
from tests.cli.test_heads_models import TEXT, WORDS  # noqa: E402

VOCAB = len(WORDS)
IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DENSE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
# model_type -> config.json fields: every family with 2 layers of 4 heads (as the tests expect from the config).
FAMILIES = {
    "opt": dict(hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                word_embed_proj_dim=16),
    "phi3": dict(DENSE),
    "gpt_neox": dict(DENSE),
    "gemma2": dict(DENSE, head_dim=4, num_key_value_heads=2, sliding_window=4),
    "mixtral": dict(DENSE, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1),
    "roberta": dict(DENSE),
    "deepseek_v3": dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=7, kv_lora_rank=6,
                        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=5, intermediate_size=32,
                        moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=64,
                        num_hidden_layers=2),
    # CodeGen's Q/K/V are not located (its fused qkv_proj is sharded), but W_O is: reads and writes are drawn.
    "codegen": dict(n_embd=16, n_layer=2, n_head=4, n_positions=64, rotary_dim=2),
    # JetMoE's attention projects through its experts: W_O is not located, so writes are not drawn. Its forward
    # runs num_key_value_heads x num_experts_per_tok query heads, which a real config's num_attention_heads is.
    "jetmoe": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, kv_channels=4,
                   intermediate_size=32, num_local_experts=2, num_experts_per_tok=2, max_position_embeddings=64),
}
WRITES_MISSING = {"jetmoe"}
# Families whose attention is not on transformers' attention interface: patch refuses them.
REFUSED = {"bloom": dict(hidden_size=16, n_layer=2, n_head=4),
           "falcon": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4),
           "mpt": dict(d_model=16, n_layers=2, n_heads=4, max_seq_len=64)}


def save_tokenizer(path: Path, specials: bool = False, types: bool = False) -> None:
    """A WordLevel tokenizer over WORDS; ``specials``: it adds [BOS] before and after the text, as BERT adds
    [CLS] and [SEP]; ``types``: it gives token_type_ids too."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if specials:
        tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [BOS]", special_tokens=[("[BOS]", 2)])
    names = ["input_ids", "token_type_ids", "attention_mask"] if types else ["input_ids", "attention_mask"]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            model_input_names=names).save_pretrained(path)


def tiny(model_type: str, fields: dict, seed: int = 0) -> torch.nn.Module:
    """A random base model of ``model_type``, every weight moved well off its init so patterns are not uniform."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.for_model(model_type, **IDS, **fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def save(model_type: str, path: Path, fields: dict | None = None, specials: bool = False) -> Path:
    save_tokenizer(path, specials)
    tiny(model_type, FAMILIES.get(model_type, {}) if fields is None else fields).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: save(f, root / f, specials=f == "roberta") for f in FAMILIES}


def reference(path: Path, text: str = TEXT) -> tuple[list[str], torch.Tensor, dict]:
    """(tokens, (layers, h, s, s) weights, inputs) of the unpatched model under eager attention (plain
    transformers' own output_attentions)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    enc = tok(text, return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    return tok.convert_ids_to_tokens(enc["input_ids"][0].tolist()), torch.cat(out.attentions), inputs


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (a checkpoint's saving progress bar) is not the command's
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("headwise heads: note:")]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_drawn_weights_are_the_models_own_attention(saved, capsys, family) -> None:
    path = saved[family]
    tokens, ref, _ = reference(path)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--json")
    assert code == 0, err
    r = json.loads(out)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)  # transformers' own reading of the counts (n_layer, n_head, ...)
    assert r["family"] == family == cfg.model_type
    assert [m["layer"] for m in r["layers"]] == list(range(cfg.num_hidden_layers))
    assert [m["n_heads"] for m in r["layers"]] == [cfg.num_attention_heads] * cfg.num_hidden_layers
    assert all(m["tokens"] == tokens for m in r["layers"])
    drawn = torch.tensor([m["weights"] for m in r["layers"]], dtype=torch.float32)
    torch.testing.assert_close(drawn, ref, rtol=1e-5, atol=1e-6)  # JSON keeps 6 significant digits
    missing = [m["writes_missing"] for m in r["layers"]]
    if family in WRITES_MISSING:
        assert all(m["writes"] is None and m["value_norms"] is None for m in r["layers"])
        assert all("W_O is not located" in why for why in missing), missing
        assert [n for n in notes(err) if "what each head writes is not drawn" in n] != []
    else:
        assert missing == [""] * len(missing) and all(m["writes"] is not None for m in r["layers"])
        assert notes(err) == []


def hooked_value_norms(path: Path, inputs: dict, layer: int) -> torch.Tensor:
    """||v_j W_O^h|| of OPT layer ``layer`` from forward hooks on the unpatched model: v_proj's output split into
    heads, times each head's columns of out_proj. Shapes: -> (h, s)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    attn = model.decoder.layers[layer].self_attn
    seen = {}
    handle = attn.v_proj.register_forward_hook(lambda m, i, o: seen.setdefault("v", o.detach()))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    h = model.config.num_attention_heads
    v = seen["v"][0].double()  # (s, h * d_h)
    d_h = v.shape[-1] // h
    w_o = attn.out_proj.weight.detach().double()  # (d, h * d_h)
    return torch.stack([(v[:, i * d_h:(i + 1) * d_h] @ w_o[:, i * d_h:(i + 1) * d_h].T).norm(dim=-1)
                        for i in range(h)]).float()


def test_writes_are_weight_times_value_norm_from_hooks(saved, capsys) -> None:
    path = saved["opt"]
    _, ref, inputs = reference(path)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1", "--json")
    assert code == 0, err
    r = json.loads(out)
    norms = hooked_value_norms(path, inputs, 1)
    torch.testing.assert_close(torch.tensor(r["value_norms"]), norms, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(r["writes"]), ref[1] * norms[:, None, :], rtol=1e-5, atol=1e-6)


def test_a_family_without_located_w_o_draws_its_reads_everywhere(saved, capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from headwise.viz.html import decode
    from tests.viz.test_html import embedded

    path = saved["jetmoe"]
    _, ref, _ = reference(path)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "0")
    assert code == 0, err
    assert "n/a" in out and "What each head writes is not shown" in out and "Traceback" not in err
    assert len(notes(err)) == 1 and "W_O is not located" in notes(err)[0]
    page = tmp_path / "j.html"
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--out", str(page))
    assert code == 0, err
    meta, blob = embedded(page.read_text())
    assert "W_O is not located" in meta["writes_missing"]
    weights, _ = decode(meta, blob)
    torch.testing.assert_close(weights, ref, atol=0.5 / 255 + 1e-6, rtol=0)
    png = tmp_path / "j.png"
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1", "--out", str(png))
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG", err


def test_token_type_ids_go_where_the_tokenizer_gives_them_and_the_model_takes_them(capsys, tmp_path) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = tmp_path / "gpt2"
    save_tokenizer(path, types=True)
    tiny("gpt2", dict(n_embd=12, n_head=4, n_layer=2, n_positions=64)).save_pretrained(path)
    enc = AutoTokenizer.from_pretrained(path, local_files_only=True)(TEXT, return_tensors="pt")
    assert "token_type_ids" in enc
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():  # GPT-2 embeds token types with its token embedding: they change every pattern
        ref = torch.cat(model(**enc, output_attentions=True).attentions)
        without = torch.cat(model(input_ids=enc["input_ids"], output_attentions=True).attentions)
    assert not torch.allclose(ref, without, atol=1e-4)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--json")
    assert code == 0, err
    drawn = torch.tensor([m["weights"] for m in json.loads(out)["layers"]])
    torch.testing.assert_close(drawn, ref, rtol=1e-5, atol=1e-6)


def test_special_tokens_are_counted_from_the_tokenizer(saved, capsys) -> None:
    path = saved["roberta"]
    code, out, err = run(capsys, TEXT, "--model", str(path), "--max-tokens", "2")
    assert code == 2 and "--max-tokens must be at least 3 (this tokenizer adds 2 special tokens" in err, err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, TEXT, "--model", str(path), "--max-tokens", "3", "--json")
    assert code == 0, err
    assert json.loads(out)["tokens"] == ["[BOS]", "w1", "[BOS]"]


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_family_patch_refuses_is_one_line(capsys, tmp_path, family) -> None:
    path = save(family, tmp_path / family, REFUSED[family])
    code, out, err = run(capsys, TEXT, "--model", str(path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    attention = {"bloom": "BloomAttention", "falcon": "FalconAttention", "mpt": "MptAttention"}[family]
    assert f"model_type {family!r} cannot be drawn: its attention ({attention}) does not go through " \
           "transformers' attention interface and has no headwise adapter" in err, err


def test_models_that_are_not_one_text_stack_are_refused_in_one_line(capsys, tmp_path) -> None:
    cases = {"no_such_family": ({"num_hidden_layers": 2, "num_attention_heads": 4},
                                "model_type 'no_such_family' in"),
             "llava": ({"text_config": {"num_hidden_layers": 2}, "vision_config": {"hidden_size": 8}},
                       "takes more than text (vision_config)"),
             "bart": ({"num_hidden_layers": 2, "encoder_attention_heads": 4, "is_encoder_decoder": True},
                      "is an encoder-decoder model")}
    for family, (fields, message) in cases.items():
        path = tmp_path / family
        save_tokenizer(path)
        (path / "config.json").write_text(json.dumps({"model_type": family, **fields}))
        code, out, err = run(capsys, TEXT, "--model", str(path))
        assert code == 2 and message in err, (family, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, out, err = run(capsys, TEXT, "--model", str(tmp_path / "no_such_family"))
    assert "is not known to the installed transformers" in err


def test_shared_layers_are_refused_in_one_line(capsys, tmp_path) -> None:
    fields = dict(hidden_size=16, embedding_size=8, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_hidden_groups=1, max_position_embeddings=64)
    path = save("albert", tmp_path / "albert", fields)  # ALBERT runs its one layer 3 times
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "config.json says 3 layers, but headwise.interop.patch found 1 attention module (shared" in err, err


@pytest.mark.parametrize("family", ["gpt2", "opt", "roberta"])
def test_a_pruned_checkpoint_draws_with_its_pruned_head_counts(capsys, tmp_path, family) -> None:
    from headwise.interop import patch
    from headwise.surgery import load_pretrained, prune_heads, save_pretrained

    path = tmp_path / "pruned"
    save_tokenizer(path)
    model = tiny(family, dict(n_embd=12, n_head=4, n_layer=2, n_positions=64) if family == "gpt2" else
                 FAMILIES[family])
    prune_heads(patch(model), {0: [1], 1: [0, 2]})
    assert not save_pretrained(model, path)  # layers of different counts: the sidecar is needed
    ref_model = load_pretrained(path, type(model), attn_implementation="eager")
    enc = {"input_ids": torch.tensor([[WORDS.index(w) for w in TEXT.split()]])}
    with torch.no_grad():
        ref = ref_model(**enc, output_attentions=True).attentions
    assert [a.shape[1] for a in ref] == [3, 2]  # the reference itself has the pruned counts
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [m["n_heads"] for m in r["layers"]] == [3, 2]
    assert [m["original_heads"] for m in r["layers"]] == [[0, 2, 3], [1, 3]]  # numbered as before surgery
    assert [m["heads"] for m in r["layers"]] == [[0, 1, 2], [0, 1]]  # their indices now
    for m, a in zip(r["layers"], ref):
        torch.testing.assert_close(torch.tensor(m["weights"]), a[0], rtol=1e-5, atol=1e-6)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1", "--heads", "2")
    assert code == 2 and "layer 1 has no head 2: head surgery left its heads 1, 3 (numbered as before surgery)" in err
    assert len(err.strip().splitlines()) == 1
    import headwise.viz.models as vm

    with pytest.MonkeyPatch.context() as mp:  # the sidecar's counts refuse the picture before the model loads
        mp.setattr(vm, "load", lambda *a, **k: pytest.fail("the model must not load"))
        code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--out", str(tmp_path / "p.html"))
    assert code == 2 and "different head counts (3, 2, after head surgery)" in err, err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "0", "--out", str(tmp_path / "p.html"))
    assert code == 0, err


def test_the_table_of_a_pruned_checkpoint_says_its_head_counts(capsys, tmp_path) -> None:
    from headwise.interop import patch
    from headwise.surgery import load_pretrained, prune_heads, save_pretrained

    path = tmp_path / "pruned"
    save_tokenizer(path)
    model = tiny("gpt2", dict(n_embd=12, n_head=4, n_layer=2, n_positions=64))
    prune_heads(patch(model), {0: [0, 1], 1: [3]})
    save_pretrained(model, path)
    enc = {"input_ids": torch.tensor([[WORDS.index(w) for w in TEXT.split()]])}
    with torch.no_grad():  # the unpatched model as saved: its own head counts per layer
        counts = [a.shape[1] for a in load_pretrained(path, type(model), attn_implementation="eager")(
            **enc, output_attentions=True).attentions]
    assert counts == [2, 3]
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers")
    lines = out.splitlines()
    assert code == 0 and "all 2 layers, 2-3 heads per layer, " in lines[0], lines[0]
    assert len([ln for ln in lines if ln.split()[:1] and ln.split()[0][:2] in ("0.", "1.")]) == sum(counts)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--layer", "1")
    assert code == 0 and ", layer 1, 3 heads, " in out.splitlines()[0]


def test_a_pruned_checkpoint_the_config_describes_loads_as_any_other(capsys, tmp_path) -> None:
    from headwise.interop import patch
    from headwise.surgery import prune_heads, save_pretrained

    path = tmp_path / "pruned"
    save_tokenizer(path)
    model = tiny("mixtral", FAMILIES["mixtral"])
    prune_heads(patch(model), {0: [0, 1], 1: [2, 3]})  # 2 of 4 heads, one K/V head left, in both layers
    assert save_pretrained(model, path)  # the config now says 2 heads: plain from_pretrained rebuilds it
    tokens, ref, _ = reference(path)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [m["n_heads"] for m in r["layers"]] == [2, 2] and tuple(ref.shape[:2]) == (2, 2)  # (layers, heads)
    torch.testing.assert_close(torch.tensor([m["weights"] for m in r["layers"]]), ref, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_saved_with_its_task_head_draws_its_base_model(capsys, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path / "causal"
    save_tokenizer(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **IDS, **FAMILIES["phi3"])).save_pretrained(path)
    _, ref, _ = reference(path)  # lm_head is not the base model's: neither loader takes it
    code, out, err = run(capsys, TEXT, "--model", str(path), "--all-layers", "--json")
    assert code == 0, err
    drawn = torch.tensor([m["weights"] for m in json.loads(out)["layers"]])
    torch.testing.assert_close(drawn, ref, rtol=1e-5, atol=1e-6)
