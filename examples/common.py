"""Shared pieces of the examples: an offline byte tokenizer, corpus readers, model loading.

Nothing here downloads anything unless asked to (a hub id for ``--model`` / a dataset name for
``--data``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # as when an example runs: its siblings import

from setup_errors import check_paths, launched_rank, one_line_errors  # noqa: E402,F401  (the examples' names)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(ROOT / "configs" / "model" / "tiny-llama.json")


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


#: A chat template with ``{% generation %}`` markers (TRL's assistant-only loss reads them).
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{%- else -%}<|user|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")


def byte_chat_tokenizer():
    """A Hugging Face fast tokenizer over UTF-8 bytes (one token per byte, no merges) with ``<s>``, ``</s>`` (EOS
    and padding) and the chat tokens of :data:`CHAT_TEMPLATE`: what TRL needs (it takes only
    ``PreTrainedTokenizerBase`` processing classes), built offline. 261 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


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
    standard library's modules, tens to thousands of bytes each), ``"stdlib-files"`` (whole modules), a glob of
    text files, a ``.jsonl`` file (field ``text``), or a Hugging Face ``datasets`` name (``name[:config]``, split
    ``train``, field ``text``)."""
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


def example_parser(description: str, *, trainer: bool = False) -> argparse.ArgumentParser:
    """The command line of an example: the options every example shares (:func:`add_common_args`) and, with
    ``trainer``, those of the ``Trainer``-driven ones (``--grad-accum``, ``--max-grad-norm``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    if trainer:
        p.add_argument("--grad-accum", type=int, default=1, help="packed rows per optimizer step and DP group")
        p.add_argument("--max-grad-norm", type=float, default=1.0, help="the Trainer's gradient clipping (0: off)")
    return p


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every example shares (the data, the model, CP, LoRA and the report)."""
    import hf_blockdiag_cp as bd

    p = parser
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a config *.json (fresh weights, byte tokenizer) or a local dir / hub id for from_pretrained")
    p.add_argument("--data", default=None, help="'stdlib' (default: top-level definitions of the standard library), "
                   "'stdlib-files', a glob of text files, a .jsonl with a 'text' field, or a datasets name")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many documents")
    p.add_argument("--max-chars", type=int, default=None, help="cut every document to this many characters")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row (all CP ranks together)")
    p.add_argument("--cp-size", type=int, default=None,
                   help="ranks sharing one row (must divide the world size); default: all processes form one CP "
                        "group (use --cp-size 1 for plain data parallelism)")
    p.add_argument("--backend", default="auto", choices=bd.BACKENDS, help="attention kernel ('auto' picks one)")
    p.add_argument("--kv-exchange", default="auto", choices=bd.KV_EXCHANGES, help="how CP ranks exchange K/V")
    p.add_argument("--ulysses-size", default="1", type=ulysses_size_arg,
                   help="CP ranks per head-parallel (Ulysses) subgroup: an int dividing the CP size, or 'auto' (chosen "
                        "per step by the cost model; see docs/layouts.md). Default 1: sequence parallelism only")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (constant)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the adapters and the row order")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--grad-checkpointing", action="store_true", help="activation checkpointing (recompute in backward)")
    p.add_argument("--offload-activations", action="store_true",
                   help="keep the tensors saved for the backward in host memory (torch.autograd.graph.save_on_cpu); "
                        "with --grad-checkpointing, what is saved outside the recomputed layers")
    p.add_argument("--chunked-loss", default="auto", choices=["auto", "on", "off"],
                   help="the loss through bd.chunked_causal_lm_loss (no [L, V] logits): 'auto' where it is exact")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"],
                   help="run the forward under torch.autocast (parameters stay in --dtype); the parity check "
                        "compares with a float32 run, so expect differences of the autocast dtype's rounding")
    p.add_argument("--check-parity", action="store_true",
                   help="re-run the first step without CP and print both losses and the max gradient difference")
    p.add_argument("--output-dir", default=None, help="save the trained model here")
    p.add_argument("--summary-json", default=None, help="write the final summary here (main process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter instead of all weights")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scaling numerator (scale = alpha / r)")
    p.add_argument("--lora-target-modules", default="q_proj,v_proj",
                   help="comma-separated module names that get an adapter")
    p.add_argument("--lora-init", default="default", choices=["default", "random"],
                   help="'default': PEFT's (B = 0, the adapter starts as the identity); 'random': B random too, so "
                        "that every adapter matrix has a gradient in step 1 (what --check-parity then compares)")


def ulysses_size_arg(value: str) -> int | str:
    """``--ulysses-size``: ``"auto"`` or an int (the package validates it against the CP size and the heads)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'auto', got {value!r}") from None


def chunked_loss_setting(args) -> bool | None:
    """``--chunked-loss`` as CPTrainer's ``chunked_loss``: None (on where exact), True or False."""
    return {"auto": None, "on": True, "off": False}[args.chunked_loss]


def resolve_cp_size(requested: int | None, world: int) -> int:
    """The CP size of a run: ``--cp-size`` if given, else every process in one CP group (the one place the
    default is decided; ``--cp-size 1`` asks for plain data parallelism)."""
    cp_size = world if requested is None else requested
    if cp_size < 1:
        raise SystemExit(f"--cp-size {cp_size}: give a positive number of ranks per CP group")
    if world == 1 and cp_size > 1:
        raise SystemExit(f"--cp-size {cp_size} needs {cp_size} processes: launch with accelerate launch "
                         "--config_file configs/accelerate/cpu_cp2.yaml (or torchrun)")
    if world % cp_size:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise SystemExit(f"--cp-size {cp_size} does not divide the {world} launched processes: use a --cp-size "
                         f"that does ({divisors}), or launch a multiple of {cp_size} processes")
    return cp_size


def launch_mesh(args: argparse.Namespace, config: Any) -> Any:
    """The ``("dp", "cp")`` mesh of a ``Trainer``-driven example (``None`` on one process).

    The process group's timeout follows ``HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S`` (``CPTrainer`` refuses a longer
    one). transformers 5.24 passes ``ddp_timeout`` on only without ``use_cpu``, so ``init_device_mesh`` creates
    the group first, with that timeout, and the Trainer's accelerate state adopts it.
    """
    import hf_blockdiag_cp as bd

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    cp_size = resolve_cp_size(args.cp_size, launched)
    return bd.init_device_mesh(cp_size, config=config) if launched > 1 else None


def cp_config(args: argparse.Namespace) -> Any:
    """The ``BlockDiagCPConfig`` of the shared options (``--backend``, ``--kv-exchange``, ``--ulysses-size``)."""
    import hf_blockdiag_cp as bd

    return bd.BlockDiagCPConfig(backend=args.backend, kv_exchange=args.kv_exchange, ulysses_size=args.ulysses_size)


def head_parallel_groups(mesh: Any, config: Any) -> Any:
    """The head-parallel (Ulysses) subgroups ``config.ulysses_size`` needs on ``mesh`` (``None`` when it is 1 or
    there is no CP): created once, at setup, by every process (a collective over the world)."""
    import hf_blockdiag_cp as bd

    if mesh is None or mesh["cp"].size() == 1 or config.ulysses_size == 1:
        return None
    return bd.ulysses_groups(mesh, config=config)


def trainer_arguments(args: argparse.Namespace, config: Any, output_dir: str) -> dict[str, Any]:
    """The ``TrainingArguments`` (or ``trl.SFTConfig``) keywords the ``Trainer``-driven examples share.

    ``use_cpu`` on a machine without GPU: ``accelerate launch`` (torchrun path) + ``use_cpu=True`` gives a
    MULTI_CPU gloo run.
    """
    import torch

    return dict(
        output_dir=output_dir, use_cpu=not torch.cuda.is_available(), max_steps=args.steps,
        per_device_train_batch_size=1, gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=args.max_grad_norm, logging_steps=1,
        save_strategy="no", report_to=[], seed=args.seed, disable_tqdm=args.no_progress,
        activation_checkpointing=args.grad_checkpointing, ddp_find_unused_parameters=False,
        ddp_timeout=int(config.process_group_timeout.total_seconds()),
        bf16=args.mixed_precision == "bf16", fp16=args.mixed_precision == "fp16")


def quiet_other_ranks() -> None:
    """Only the main process prints progress bars and library INFO/WARNING logs (``datasets``' and TRL's dataset
    preparation, transformers' logging); the others print errors only."""
    if launched_rank() == 0:
        return
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        import datasets
    except ImportError:  # only the TRL example and --data NAME need it
        return
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


def exchange_label(ctx) -> str:
    """What moved K/V in the step of context ``ctx``: the head all-to-all of a head-parallel layout (``u > 1``),
    the exchange strategy between sequence groups, both, or ``none``."""
    if ctx is None:
        return "none"
    parts = [f"head all-to-all (u={ctx.ulysses_size})"] if getattr(ctx, "ulysses_size", 1) > 1 else []
    if ctx.exchange is not None and ctx.exchange.strategy != "none":
        parts.append(ctx.exchange.strategy)
    return " + ".join(parts) or "none"


def check_common_args(args: argparse.Namespace) -> None:
    """Mistakes in the shared options, found before any rank starts work (``SystemExit`` with one line; call it
    inside :func:`one_line_errors`). The CP size comes from the launcher's ``WORLD_SIZE``, as the run will."""
    check_paths(args)
    if args.max_docs is not None and args.max_docs < 1:
        raise SystemExit(f"--max-docs {args.max_docs}: give at least 1 document (or leave it out to use them all)")
    if args.seq_len < 1:
        raise SystemExit(f"--seq-len {args.seq_len}: give a positive number of tokens per row")
    cp_size = resolve_cp_size(args.cp_size, int(os.environ.get("WORLD_SIZE", "1")))
    if args.seq_len % cp_size:
        fit = args.seq_len + cp_size - args.seq_len % cp_size
        raise SystemExit(f"--seq-len {args.seq_len} is not divisible by the CP size {cp_size} (each rank holds "
                         f"seq_len / cp_size tokens): use a multiple of {cp_size}, e.g. --seq-len {fit}")


def refuse_accelerate_cp() -> None:
    """Exit if accelerate's own context parallelism is set (config file or launcher flag), before anything of
    accelerate's starts: its CP forces a causal mask over packed documents, and on CPU it is refused with a
    message that does not point here, or (as a launcher flag) dropped without a word."""
    from hf_blockdiag_cp.training.checks import check_no_accelerate_cp

    try:
        check_no_accelerate_cp()
    except ValueError as err:
        raise SystemExit(str(err)) from None


def apply_lora(model, args):
    """``model`` wrapped as a PEFT LoRA model per ``--lora-*`` (only the adapters train), or ``model`` unchanged."""
    if not args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in args.lora_target_modules.split(",") if t.strip()]
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0,
                        task_type="CAUSAL_LM", init_lora_weights=args.lora_init == "default")
    torch.manual_seed(args.seed)  # the same adapters on every rank
    return get_peft_model(model, config)


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


def full_row(shards: list[dict], key: str) -> torch.Tensor:
    """The ``[1, S]`` full row of ``key`` from every CP rank's ``[1, L]`` shard, each placed at its
    ``local_index`` (the context's placement need not be contiguous)."""
    first = shards[0][key]
    out = first.new_empty(1, first.shape[1] * len(shards))
    for shard in shards:
        out[0, shard["local_index"]] = shard[key][0]
    return out


def mesh_description(world: int, dp_size: int, cp_size: int) -> str:
    """What a run's mesh is, in words: ``world 2 = dp 1 x cp 2``, with ``(no CP)`` when ``cp_size == 1``."""
    return f"world {world} = dp {dp_size} x cp {cp_size}" + (" (no CP)" if cp_size == 1 else "")


def parity_label(world: int, dp_size: int, cp_size: int) -> str:
    """How the step that ``--check-parity`` compares actually ran (so a run without CP never says "with CP")."""
    if cp_size > 1:
        return f"with CP (dp {dp_size} x cp {cp_size})"
    if world > 1:
        return f"with data parallelism only (dp {dp_size} x cp 1, no CP)"
    return "on 1 process (no CP)"


def report(summary: dict, summary_json: str | None) -> None:
    """Print the final summary (and the parity line tests look for); write it as JSON if asked."""
    losses = summary["losses"]
    ran = mesh_description(summary["world"], summary["dp_size"], summary["cp_size"])
    print(f"mesh: {ran}")
    print(f"loss: step 1 {losses[0]:.4f} -> step {len(losses)} {losses[-1]:.4f}")
    print(f"throughput: {summary['tokens_per_s']:,.0f} tokens/s (world {summary['world']}, cp {summary['cp_size']}, "
          f"seq_len {summary['seq_len']})")
    print("peak memory per rank (GiB, {}): {}".format(
        summary["peak_memory_kind"], ", ".join(f"{g:.2f}" for g in summary["peak_memory_gib_per_rank"])))
    print("K/V exchanged per step per rank (fwd+bwd, MiB, {}): {}".format(
        summary["kv_exchange_strategy"],
        ", ".join(f"{b / 2**20:.2f}" for b in summary["kv_exchange_bytes_per_step_per_rank"])))
    if "ulysses_size" in summary:
        used = summary["ulysses_size_last_step"]
        print(f"layout: ulysses_size {summary['ulysses_size']} (last step: u={used} x c={summary['cp_size'] // used})")
    parity = summary.get("parity")
    if parity is not None:
        ran = parity_label(summary["world"], summary["dp_size"], summary["cp_size"])
        reference = parity.get("reference", "without CP (1 process)")
        print(f"parity: loss {ran} {parity['loss_cp']:.8f} {reference} {parity['loss_no_cp']:.8f} "
              f"|dloss| {parity['abs_loss_diff']:.2e} max|dgrad| {parity['max_grad_diff']:.2e}")
        if "eval_loss_cp" in parity:
            print(f"parity: eval_loss {ran} {parity['eval_loss_cp']:.8f} {reference} {parity['eval_loss_no_cp']:.8f} "
                  f"|deval_loss| {parity['abs_eval_loss_diff']:.2e}")
    if summary_json:
        with open(summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
