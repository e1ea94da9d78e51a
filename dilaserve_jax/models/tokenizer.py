"""Tokenizers: one small protocol, a character-level implementation, a `tokenizers` wrapper, and
the stand-in for a checkpoint that ships no tokenizer files (token ids only)."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from dilaserve_jax.models.files import read_json


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    mask_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """Character vocabulary of the embedded models: id == ord(c) for tab, newline and printable ASCII.

    Ids 0, 1, 2 are pad, EOS and mask; they never collide with a character.
    """

    PAD, EOS, MASK = 0, 1, 2
    vocab_size = 128
    pad_id, eos_id, mask_id = PAD, EOS, MASK
    _SPECIAL_TEXT = {PAD: "", EOS: "", MASK: "_"}

    @staticmethod
    def is_char(ch: str) -> bool:
        return ch in "\t\n" or 32 <= ord(ch) <= 126

    def encode(self, text: str) -> list[int]:
        bad = sorted({ch for ch in text if not self.is_char(ch)})
        if bad:
            raise ValueError(f"characters outside the tiny model's vocabulary (printable ASCII, tab, newline): {bad!r}")
        return [ord(ch) for ch in text]

    def decode(self, ids: Sequence[int], show_masks: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.MASK:
                out.append("_" if show_masks else "")
            elif i in (self.PAD, self.EOS):
                continue
            elif 0 <= i < self.vocab_size and self.is_char(chr(i)):
                out.append(chr(i))
            else:
                out.append("\ufffd")  # an id with no character (only an untrained model proposes one)
        return "".join(out)


TOKENIZER_FILES = "tokenizer.json, or vocab.json + merges.txt"  # what a checkpoint directory may hold


def has_hf_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").exists() or \
        ((directory / "vocab.json").exists() and (directory / "merges.txt").exists())


class TokenizerMissing(FileNotFoundError):
    """Text asked of a model whose checkpoint has no tokenizer files; token-id prompts still work."""


class MissingTokenizer:
    """The tokenizer of a checkpoint directory without tokenizer files. The special ids come from the
    model's config, so token-id requests run; `encode` raises TokenizerMissing naming the files
    looked for. `decode` gives no text (""): a reply still carries the answer's token ids."""

    def __init__(self, directory: str | Path, *, vocab_size: int, mask_id: int, eos_id: int, pad_id: int):
        self.directory = Path(directory)
        self.vocab_size, self.mask_id, self.eos_id, self.pad_id = vocab_size, mask_id, eos_id, pad_id

    @property
    def message(self) -> str:
        return (f"{self.directory} has no tokenizer ({TOKENIZER_FILES}): this model takes token-id prompts "
                f"only; add the tokenizer files to the checkpoint to send text")

    def encode(self, text: str) -> list[int]:
        raise TokenizerMissing(self.message)

    def decode(self, ids: Sequence[int], show_masks: bool = False) -> str:
        return ""


# Qwen2's pre-tokenization split (transformers' Qwen2Converter, convert_slow_tokenizer.py): the same
# pipeline Dream's DreamTokenizer (a Qwen2Tokenizer) runs on vocab.json + merges.txt.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_level_bpe(vocab: str | Path, merges: str | Path):
    """A Qwen2 byte-level BPE `tokenizers.Tokenizer` from vocab.json + merges.txt: NFC, the Qwen2
    regex split, byte-level mapping without a prefix space, no unknown token."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE.from_file(str(vocab), str(merges), unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


_ADDED_TOKEN_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")


def added_tokens(directory: Path) -> dict[int, dict]:
    """{id: {content, special, normalized, ...}} from added_tokens.json (ids only; taken as special)
    and tokenizer_config.json's added_tokens_decoder (full entries; these win)."""
    found: dict[int, dict] = {}
    path = directory / "added_tokens.json"
    if path.exists():
        found |= {int(i): {"content": content, "special": True} for content, i in read_json(path).items()}
    path = directory / "tokenizer_config.json"
    if path.exists():
        decoder = read_json(path).get("added_tokens_decoder") or {}
        found |= {int(i): dict(entry) for i, entry in decoder.items()}
    return found


def load_hf_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json file, or from a directory holding either
    tokenizer.json or vocab.json + merges.txt (Qwen2 byte-level BPE, as Dream ships) plus the
    special tokens of tokenizer_config.json / added_tokens.json at their declared ids."""
    from tokenizers import AddedToken, Tokenizer

    path = Path(path)
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if not has_hf_tokenizer(path):
        raise TokenizerMissing(f"{path} holds no tokenizer ({TOKENIZER_FILES})")
    tok = byte_level_bpe(path / "vocab.json", path / "merges.txt")
    for token_id, entry in sorted(added_tokens(path).items()):
        content = entry["content"]
        if tok.token_to_id(content) == token_id:
            continue
        if token_id != tok.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"{path}: added token {content!r} declares id {token_id}, but the next free id "
                             f"is {tok.get_vocab_size(with_added_tokens=True)} (ids must follow the vocabulary)")
        flags = {k: bool(entry.get(k, k == "special")) for k in _ADDED_TOKEN_FLAGS}
        token = AddedToken(content, **flags)
        (tok.add_special_tokens if flags["special"] else tok.add_tokens)([token])
    return tok


class HFTokenizer:
    """A Hugging Face tokenizer loaded with the `tokenizers` library: a tokenizer.json file, or a
    checkpoint directory (see `load_hf_tokenizer`)."""

    def __init__(self, path: str | Path, *, mask_id: int, eos_id: int, pad_id: int):
        self._tok = load_hf_tokenizer(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.mask_id, self.eos_id, self.pad_id = mask_id, eos_id, pad_id

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special tokens written in the text (e.g. chat markers) map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], show_masks: bool = False) -> str:
        ids = [int(i) for i in ids if show_masks or int(i) != self.mask_id]
        return self._tok.decode(ids, skip_special_tokens=not show_masks)
