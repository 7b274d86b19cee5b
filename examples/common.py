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


def add_common_args(parser) -> None:
    """The options both examples share (the data, the model, CP and the report)."""
    import hf_blockdiag_cp as bd

    p = parser
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a config *.json (fresh weights, byte tokenizer) or a local dir / hub id for from_pretrained")
    p.add_argument("--data", default=None, help="'stdlib' (default: top-level definitions of the standard library), "
                   "'stdlib-files', a glob of text files, a .jsonl with a 'text' field, or a datasets name")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many documents")
    p.add_argument("--max-chars", type=int, default=None, help="cut every document to this many characters")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row (all CP ranks together)")
    p.add_argument("--cp-size", type=int, default=1, help="ranks sharing one row (must divide the world size)")
    p.add_argument("--backend", default="auto", choices=bd.BACKENDS)
    p.add_argument("--kv-exchange", default="auto", choices=bd.KV_EXCHANGES)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--check-parity", action="store_true",
                   help="re-run the first step without CP and print both losses and the max gradient difference")
    p.add_argument("--output-dir", default=None, help="save the trained model here")
    p.add_argument("--summary-json", default=None, help="write the final summary here (main process)")
    p.add_argument("--no-progress", action="store_true")


def load_documents(args, tokenizer) -> list[dict]:
    """The corpus as examples for the collator: ``[{"input_ids": [...]}, ...]``."""
    return [{"input_ids": tokenize(tokenizer, t)} for t in read_corpus(args.data, args.max_docs, args.max_chars)]


def peak_memory_bytes() -> float:
    """This process's peak: CUDA ``max_memory_allocated`` with a GPU, else the max RSS (Linux: KiB)."""
    import resource

    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def gather_floats(value: float, world: int) -> list[float]:
    """``value`` of every rank (a collective when ``world > 1``)."""
    import torch.distributed as dist

    mine = torch.tensor(float(value))
    if world == 1:
        return [mine.item()]
    out = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(out, mine)
    return [x.item() for x in out]


def report(summary: dict, summary_json: str | None) -> None:
    """Print the final summary (and the parity line tests look for); write it as JSON if asked."""
    losses = summary["losses"]
    print(f"loss: step 1 {losses[0]:.4f} -> step {len(losses)} {losses[-1]:.4f}")
    print(f"throughput: {summary['tokens_per_s']:,.0f} tokens/s (world {summary['world']}, cp {summary['cp_size']}, "
          f"seq_len {summary['seq_len']})")
    print("peak memory per rank (GiB, {}): {}".format(
        summary["peak_memory_kind"], ", ".join(f"{g:.2f}" for g in summary["peak_memory_gib_per_rank"])))
    print("K/V exchanged per step per rank (fwd+bwd, MiB, {}): {}".format(
        summary["kv_exchange_strategy"],
        ", ".join(f"{b / 2**20:.2f}" for b in summary["kv_exchange_bytes_per_step_per_rank"])))
    parity = summary.get("parity")
    if parity is not None:
        print(f"parity: loss with CP {parity['loss_cp']:.8f} without CP {parity['loss_no_cp']:.8f} "
              f"|dloss| {parity['abs_loss_diff']:.2e} max|dgrad| {parity['max_grad_diff']:.2e}")
    if summary_json:
        with open(summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
