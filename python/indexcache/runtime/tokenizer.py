"""Tokenizers: the byte-level one of the small shipped models and a checkpoint's own
``tokenizer.json`` (through the ``tokenizers`` library)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Union


class ByteTokenizer:
    """Byte-level: ids 0..255 are bytes; the small shipped models add BOS/EOS after them."""

    def __init__(self, bos_token_id: Optional[int] = 256, eos_token_id: Optional[int] = 257):
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer.json through the ``tokenizers`` library."""

    def __init__(self, path: Path, bos_token_id: Optional[int]):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"{path} needs the 'tokenizers' package (pip install tokenizers)") from None
        self.tok, self.bos_token_id = Tokenizer.from_file(str(path)), bos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: Union[str, Path], config: Optional[dict] = None):
    path = Path(path)
    config = config if config is not None else json.loads((path / "config.json").read_text())
    if (path / "tokenizer.json").is_file():
        tok = HFTokenizer(path / "tokenizer.json", config.get("bos_token_id"))
        size, vocab = tok.tok.get_vocab_size(with_added_tokens=True), config.get("vocab_size")
        if isinstance(vocab, int) and size > vocab:
            raise ValueError(f"{path / 'tokenizer.json'} has {size} tokens but the model's vocab_size is {vocab}: "
                             "the tokenizer does not belong to this checkpoint")
        return tok
    if config.get("indexcache_tokenizer") == "bytes":
        return ByteTokenizer(config.get("bos_token_id"), config.get("eos_token_id"))
    raise ValueError(f"{path} has no tokenizer.json (and is not marked byte-level)")
