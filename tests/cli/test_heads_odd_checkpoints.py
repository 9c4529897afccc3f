"""`headwise heads --model DIR` on checkpoints out of the ordinary: a directory whose name is not UTF-8, and a
vocabulary of tokens that matplotlib's font cannot draw or that run far longer than a label."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from headwise.cli import main  # noqa: E402
from tests.interop.tiny_models import VOCAB, build  # noqa: E402

ODD = ["\U0001f642", "L" * 300, "</script>", "$x$"]
WORDS = ["[PAD]", "[UNK]", "[BOS]"] + ODD + [f"w{i}" for i in range(VOCAB - 3 - len(ODD))]
TEXT = "w1 \U0001f642 w5 " + "L" * 300 + " w2 </script> $x$"


def save_checkpoint(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)
    build("gpt2").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("odd"))


def test_a_model_directory_whose_name_is_not_utf8_is_named_in_the_error(checkpoint, capsys, tmp_path) -> None:
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/ck\xff"))
    odd.symlink_to(checkpoint, target_is_directory=True)
    assert main(["heads", "w1 w2", "--model", str(odd), "--out", str(tmp_path / "h.png")]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the tokenizer of {str(odd)!r}: its path is not valid UTF-8" in err
    assert repr(os.fsencode(odd)) in err and "rename the directory" in err
    assert not (tmp_path / "h.png").exists()


def test_tokens_without_a_glyph_are_drawn_without_a_warning_per_glyph(checkpoint, capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["heads", TEXT, "--model", str(checkpoint), "--out", str(tmp_path / "h.png")]) == 0
    err = capsys.readouterr().err
    assert not [w for w in caught if "Glyph" in str(w.message)], [str(w.message) for w in caught]
    assert "Glyph" not in err
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
