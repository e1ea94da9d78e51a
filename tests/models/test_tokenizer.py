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


CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def _qwen2_style_files(directory, texts):
    """vocab.json + merges.txt of a small byte-level BPE trained with Qwen2's pre-tokenization, and
    a tokenizer_config.json declaring chat special tokens right after the vocabulary (as Dream does)."""
    from tokenizers import pre_tokenizers, trainers

    from dilaserve_jax.models.tokenizer import byte_level_bpe

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "seed_vocab.json").write_text("{}")
    (directory / "seed_merges.txt").write_text("#version: 0.2\n")
    tok = byte_level_bpe(directory / "seed_vocab.json", directory / "seed_merges.txt")
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.model.save(str(directory))
    n = tok.get_vocab_size()
    decoder = {str(n + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for i, c in enumerate(CHAT_TOKENS)}
    (directory / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return n


TEXTS = ["hello world, the 2024 diffusion model", "Hello there! numbers 12345 and words", "café naïve déjà vu"] * 20


def test_vocab_and_merges_load_as_qwen2_byte_level_bpe_with_chat_tokens(tmp_path):
    n = _qwen2_style_files(tmp_path / "dream", TEXTS)
    assert not (tmp_path / "dream" / "tokenizer.json").exists()
    tok = HFTokenizer(tmp_path / "dream", mask_id=n + 3, eos_id=n, pad_id=n)
    assert tok.vocab_size == n + len(CHAT_TOKENS)
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert ids[0] == n + 1 and ids[-1] == n + 2  # special tokens in text map to their declared ids
    for text in ("hello world, the 2024 diffusion model", "café naïve", " leading space", "tab\tand\nnewline"):
        assert tok.decode(tok.encode(text)) == text  # byte-level: every string round-trips
    assert len(tok.encode("12345")) == 5  # Qwen2 splits digits one by one before BPE
    assert tok.decode([*tok.encode("hi"), n + 3, n], show_masks=False) == "hi"


def test_tokenizer_json_and_vocab_merges_give_the_same_ids(tmp_path):
    from dilaserve_jax.models.tokenizer import load_hf_tokenizer

    n = _qwen2_style_files(tmp_path / "files", TEXTS)
    load_hf_tokenizer(tmp_path / "files").save(str(tmp_path / "tokenizer.json"))
    from_files = HFTokenizer(tmp_path / "files", mask_id=n + 3, eos_id=n, pad_id=n)
    from_json = HFTokenizer(tmp_path / "tokenizer.json", mask_id=n + 3, eos_id=n, pad_id=n)
    for text in TEXTS[:3] + ["<|im_start|>assistant\n<|mask|><|endoftext|>"]:
        assert from_files.encode(text) == from_json.encode(text)


def test_added_token_at_a_wrong_id_is_refused(tmp_path):
    from dilaserve_jax.models.tokenizer import load_hf_tokenizer

    n = _qwen2_style_files(tmp_path / "bad", TEXTS)
    config = json.loads((tmp_path / "bad" / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(n + 5): config["added_tokens_decoder"][str(n)]}
    (tmp_path / "bad" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"<\|endoftext\|>.*id {n + 5}.*next free id is {n}"):
        load_hf_tokenizer(tmp_path / "bad")
