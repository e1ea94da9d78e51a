"""Tokenizers: one small protocol, a character-level implementation and a `tokenizers` wrapper."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable


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


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded with the `tokenizers` library."""

    def __init__(self, path: str | Path, *, mask_id: int, eos_id: int, pad_id: int):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.mask_id, self.eos_id, self.pad_id = mask_id, eos_id, pad_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], show_masks: bool = False) -> str:
        ids = [int(i) for i in ids if show_masks or int(i) != self.mask_id]
        return self._tok.decode(ids, skip_special_tokens=not show_masks)
