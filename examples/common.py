"""Shared pieces of the examples: an offline byte tokenizer, corpus readers, model loading.

Nothing here downloads anything unless asked to (a hub id for ``--model`` / a dataset name for
``--data``).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "configs" / "model" / "tiny-llama.json")


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, plus BOS (256) and EOS (257, also used for padding)."""

    bos_token_id: int = 256
    eos_token_id: int = 257
    vocab_size: int = 258

    @property
    def pad_token_id(self) -> int:
        return self.eos_token_id

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8"), self.eos_token_id]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stdlib_python_files() -> list[str]:
    """The Python standard library's ``*.py`` files: real documents of varied length on any machine."""
    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


def split_top_level(source: str) -> list[str]:
    """A Python module cut before every top-level ``def`` / ``class`` (decorators stay with theirs):
    the module header and each top-level definition become one document each."""
    blocks, current = [], []
    for line in source.splitlines(keepends=True):
        starts = line.startswith(("def ", "class ", "async def ", "@"))
        if starts and current and not current[-1].startswith("@"):
            blocks.append("".join(current))
            current = []
        current.append(line)
    if current:
        blocks.append("".join(current))
    return [b for b in blocks if b.strip()]


def read_corpus(data: str | None, max_docs: int | None, max_chars: int | None = None) -> Iterator[str]:
    """Documents as text from ``data``: ``None`` / ``"stdlib"`` (every top-level definition of the
    standard library's modules, tens to thousands of bytes each), ``"stdlib-files"`` (whole modules), a glob of text files, a ``.jsonl`` file
    (field ``text``), or a Hugging Face ``datasets`` name (``name[:config]``, split ``train``, field ``text``)."""
    count = 0

    def emit(text: str) -> Iterator[str]:
        nonlocal count
        if text:
            count += 1
            yield text[:max_chars] if max_chars else text

    if data is None or data == "stdlib":
        for path in stdlib_python_files():
            with open(path, encoding="utf-8", errors="replace") as fh:
                for block in split_top_level(fh.read()):
                    if max_docs is not None and count >= max_docs:
                        return
                    yield from emit(block)
        return
    if data == "stdlib-files":
        files = stdlib_python_files()
    elif data.endswith(".jsonl") and os.path.exists(data):
        with open(data, encoding="utf-8") as fh:
            for line in fh:
                if max_docs is not None and count >= max_docs:
                    return
                yield from emit(json.loads(line)["text"])
        return
    elif glob.has_magic(data) or os.path.exists(data):
        files = sorted(glob.glob(data, recursive=True)) if glob.has_magic(data) else [data]
        if not files:
            raise FileNotFoundError(f"--data {data!r} matches no file")
    else:
        import datasets  # optional: only for dataset names

        name, _, config = data.partition(":")
        for row in datasets.load_dataset(name, config or None, split="train", streaming=True):
            if max_docs is not None and count >= max_docs:
                return
            yield from emit(row["text"])
        return
    for path in files:
        if max_docs is not None and count >= max_docs:
            return
        with open(path, encoding="utf-8", errors="replace") as fh:
            yield from emit(fh.read())


def load_model_and_tokenizer(model: str, dtype: torch.dtype, attn_implementation: str = "blockdiag_cp"):
    """A ``*.json`` config builds a fresh model with the byte tokenizer (offline); anything else is a
    local directory or hub id for ``from_pretrained`` (model and its tokenizer)."""
    import transformers

    if model.endswith(".json"):
        with open(model, encoding="utf-8") as fh:
            config_dict = json.load(fh)
        config = transformers.AutoConfig.for_model(**config_dict)
        torch.manual_seed(0)
        lm = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                           dtype=dtype)
        return lm, ByteTokenizer()
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation=attn_implementation, dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return lm, tokenizer


def tokenize(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return ids
