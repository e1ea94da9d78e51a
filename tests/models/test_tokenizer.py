import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilaserve_jax.models import CharTokenizer, HFTokenizer

printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126) | st.sampled_from("\t\n"))


@given(printable)
def test_char_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert all(i not in (tok.pad_id, tok.eos_id, tok.mask_id) and i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_char_rejects_unknown_and_shows_masks():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="é"):
        tok.encode("café")
    assert tok.decode([ord("a"), tok.mask_id, ord("b"), tok.eos_id], show_masks=True) == "a_b"
    assert tok.decode([ord("a"), tok.mask_id, ord("b")]) == "ab"


def test_hf_tokenizer_wrapper(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, "<mask>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    wrapped = HFTokenizer(tmp_path / "tokenizer.json", mask_id=2, eos_id=1, pad_id=1)
    assert wrapped.encode("hello world") == [3, 4]
    assert wrapped.vocab_size == 5
    assert "hello" in wrapped.decode([3, 2, 4])
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
