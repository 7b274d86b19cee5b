"""Supervised fine-tuning with TRL's SFTTrainer under block-diagonal context parallelism.

    accelerate launch --config_file configs/accelerate/cpu_cp2.yaml examples/sft_trl_cp.py \
        --seq-len 1024 --steps 20 --check-parity [--lora]

``hf_blockdiag_cp.training.trl.CPSFTTrainer`` is ``trl.SFTTrainer`` on a (dp, cp) mesh: TRL prepares the data
(chat template, tokenisation, completion-only loss), this package packs it into rows of ``--seq-len`` tokens and
shards every row over the CP ranks. Defaults run offline: a tiny Llama from configs/model/tiny-llama.json, a
byte-level Hugging Face tokenizer with a chat template, and the standard library's top-level definitions turned
into chat prompt/completion pairs ("Write the definition that starts with ..." -> the code). ``--check-parity``
compares the first step's loss and gradients, and the eval_loss before training, with one process running every
document of those rows alone through stock ``sdpa`` attention.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    apply_lora,
    byte_chat_tokenizer,
    check_common_args,
    chunked_loss_setting,
    cp_config,
    example_parser,
    exchange_label,
    full_row,
    launch_mesh,
    one_line_errors,
    quiet_other_ranks,
    read_corpus,
    refuse_accelerate_cp,
    report,
    trainer_arguments,
)
from trainer_packed_cp import StepProbe, measure_run  # noqa: E402

import hf_blockdiag_cp as bd  # noqa: E402  (registers attn_implementation="blockdiag_cp")

logger = logging.getLogger("sft_trl_cp")

FORMATS = ("conversational", "prompt-completion", "text")


def parse_args(argv: list[str] | None = None):
    p = example_parser(__doc__, trainer=True)
    p.add_argument("--format", default="conversational", choices=FORMATS,
                   help="TRL dataset type: chat prompt/completion (completion-only loss through the chat template), "
                        "plain prompt/completion (completion-only loss), or plain text (loss on every token)")
    p.add_argument("--eval-docs", type=int, default=4, help="the last N documents form the eval split (0: none)")
    p.add_argument("--no-packing", action="store_true", help="one example per row (SFTConfig(packing=False))")
    return p.parse_args(argv)


def sft_examples(texts: list[str], fmt: str) -> list[dict]:
    """Documents as TRL examples: the first line is the prompt, the rest the completion (``text``: the whole)."""
    out = []
    for text in texts:
        first, _, rest = text.partition("\n")
        if fmt == "text":
            out.append({"text": text})
        elif fmt == "prompt-completion":
            out.append({"prompt": first + "\n", "completion": rest})
        else:
            out.append({"prompt": [{"role": "user", "content": f"Write the definition that starts with: {first}"}],
                        "completion": [{"role": "assistant", "content": rest}]})
    return out


def load_model(model_name: str, dtype: torch.dtype):
    """A ``*.json`` config -> a fresh model sized for the byte chat tokenizer (offline); else ``from_pretrained``."""
    import transformers

    if model_name.endswith(".json"):
        tokenizer = byte_chat_tokenizer()
        with open(model_name, encoding="utf-8") as fh:
            config_dict = json.load(fh)
        config_dict.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config_dict),
                                                              attn_implementation="blockdiag_cp", dtype=dtype)
        return model, tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(model_name, attn_implementation="blockdiag_cp",
                                                              dtype=dtype)
    return model, transformers.AutoTokenizer.from_pretrained(model_name)


def make_trainer_class():
    from hf_blockdiag_cp.training.trl import CPSFTTrainer

    class MeasuredCPSFTTrainer(CPSFTTrainer):
        """Keeps this rank's shard of every micro-batch of the first optimizer step, and each step's real tokens."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.first_step_shards, self.step_tokens, self.last_context = [], defaultdict(int), None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                ctx = inputs["cp_context"]
                self.step_tokens[self.state.global_step] += int((ctx.doc_ids != 0).sum())
                self.last_context = ctx
                if self.state.global_step == 0:
                    shard = {k: inputs[k].detach().cpu() for k in ("input_ids", "labels")}
                    self.first_step_shards.append({**shard, "doc_ids": ctx.doc_ids, "cp_rank": ctx.cp_rank,
                                                    "local_index": ctx.local_index})
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    return MeasuredCPSFTTrainer


def documents_of_rows(input_ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple]:
    """``[(input_ids [n], labels [n]), ...]``: every document (a maximal run of one non-zero id) of the full
    rows ``[B, S]``."""
    docs = []
    for ids, lab, doc in zip(input_ids, labels, doc_ids):
        start = 0
        for end in range(1, len(doc) + 1):
            if end == len(doc) or doc[end] != doc[start]:
                if doc[start] != 0:
                    docs.append((ids[start:end], lab[start:end]))
                start = end
    return docs


def documents_loss(model, docs: list[tuple], device) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies of every document run alone (positions from 0), and the target count.
    Targets are each document's own labels shifted by one (TRL's -100 prompt masks kept)."""
    total, count = torch.zeros((), device=device), 0
    for ids, lab in docs:
        logits = model(input_ids=ids[None].to(device), use_cache=False).logits[0, :-1].float()
        targets = lab[1:].to(device)
        total = total + torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total, count


def eval_reference(model, rows, dp_size: int, device) -> float:
    """The Trainer's eval_loss definition (mean over eval steps of each step's token mean over all processes),
    with every document run alone. Step ``k`` holds rows ``k*dp .. k*dp+dp-1`` of the DistributedSampler order
    (padded by repeating the first rows)."""
    order = list(range(len(rows)))
    order += order[:(-len(order)) % dp_size]
    means = []
    with torch.no_grad():
        for k in range(0, len(order), dp_size):
            docs = [(d.input_ids, d.labels) for i in order[k:k + dp_size] for d in rows[i].documents]
            total, count = documents_loss(model, docs, device)
            means.append(total.item() / count)
    return sum(means) / len(means)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_other_ranks()
    with one_line_errors():  # set-up mistakes: one line on the main process
        check_common_args(args)  # before any rank starts work
        refuse_accelerate_cp()  # before SFTConfig starts accelerate
        import datasets
        from trl import SFTConfig

        output_dir = args.output_dir or tempfile.mkdtemp(prefix="sft_trl_cp_")
        config = cp_config(args)
        mesh = launch_mesh(args, config)
        sft_args = SFTConfig(**trainer_arguments(args, config, output_dir), max_length=args.seq_len,
                             packing=not args.no_packing, per_device_eval_batch_size=1, dataset_num_proc=None)
        device, world = sft_args.device, sft_args.world_size  # .device started accelerate (the process group)
        main_process = sft_args.process_index == 0
        logging.basicConfig(level=logging.INFO if main_process else logging.WARNING,
                            format="%(asctime)s %(name)s: %(message)s")
        coords = bd.cp_coordinates(mesh)

        model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
        model = apply_lora(model, args)
        texts = list(read_corpus(args.data, args.max_docs, args.max_chars))
        split = len(texts) - args.eval_docs if args.eval_docs > 0 else len(texts)
        train = datasets.Dataset.from_list(sft_examples(texts[:split], args.format))
        evaluation = (datasets.Dataset.from_list(sft_examples(texts[split:], args.format)) if split < len(texts)
                      else None)
        logger.info("%d train / %d eval examples (%s), seq_len %d, world %d = dp %d x cp %d, ulysses_size %s, "
                    "lora %s", len(train), len(texts) - split, args.format, args.seq_len, world, coords.dp_size,
                    coords.cp_size, args.ulysses_size, args.lora)

        # The reference runs no collective after training: only the main process needs the model copy. Taken
        # before the trainer exists: TRL patches the forward of the model it is given.
        reference = copy.deepcopy(model) if args.check_parity and main_process else None
        probe = StepProbe(keep_grads=args.check_parity)
        trainer = make_trainer_class()(model=model, args=sft_args, train_dataset=train, eval_dataset=evaluation,
                                       processing_class=tokenizer, callbacks=[probe], mesh=mesh, cp_config=config,
                                       chunked_loss=chunked_loss_setting(args),
                                       offload_activations=args.offload_activations)
    eval_loss = trainer.evaluate()["eval_loss"] if evaluation is not None else None  # before any update
    trainer.train()

    losses, tokens_per_s, peaks, kvs, shards = measure_run(trainer, probe, world, coords, args.check_parity)
    parity = None
    if args.check_parity:
        if main_process:
            parity = check_parity(reference.to(device), shards, trainer, losses[0], probe.first_grads, eval_loss,
                                  coords.dp_size, args.max_grad_norm, device)
    summary = {
        "world": world, "lora": args.lora, "format": args.format, "dp_size": coords.dp_size,
        "cp_size": coords.cp_size, "seq_len": args.seq_len, "steps": len(losses), "first_loss": losses[0],
        "last_loss": losses[-1], "losses": losses, "eval_loss": eval_loss, "tokens_per_s": tokens_per_s,
        "peak_memory_gib_per_rank": [p / 2**30 for p in peaks],
        "peak_memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "process max RSS",
        "kv_exchange_bytes_per_step_per_rank": kvs,
        "kv_exchange_strategy": exchange_label(trainer.last_context),
        "ulysses_size": args.ulysses_size, "ulysses_size_last_step": trainer.last_context.ulysses_size,
        "train_rows": len(trainer.train_dataset), "parity": parity,
    }
    if main_process:
        report(summary, args.summary_json)
    if args.output_dir:
        trainer.save_model(args.output_dir)
    trainer.accelerator.wait_for_everyone()
    bd.training.close_process_groups()  # after the last collective: exit 0, no gloo hang or abort at exit
    trainer.accelerator.end_training()
    return summary


def check_parity(reference, shards_per_rank, trainer, loss_cp: float, grads_cp: dict, eval_loss_cp: float | None,
                 dp_size: int, max_grad_norm: float, device) -> dict:
    """The first step and the eval_loss against one process running every document alone through ``sdpa``."""
    by_row: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
    for rank_shards, dp_rank in shards_per_rank:
        for micro, shard in enumerate(rank_shards):
            by_row[(dp_rank, micro)][shard["cp_rank"]] = shard
    docs = []
    for _, parts in sorted(by_row.items()):
        row = [parts[r] for r in sorted(parts)]
        docs += documents_of_rows(full_row(row, "input_ids"), full_row(row, "labels"), row[0]["doc_ids"])  # [1, S]
    base = reference.get_base_model() if hasattr(reference, "get_base_model") else reference
    base.set_attn_implementation("sdpa")  # stock attention: the documents alone, no packing, no CP
    reference.train()
    total, count = documents_loss(reference, docs, device)
    loss = total / count
    loss.backward()
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    parity = {"reference": "on 1 process, every document alone (sdpa)", "loss_cp": loss_cp,
              "loss_no_cp": loss.item(), "abs_loss_diff": abs(loss_cp - loss.item()),
              "max_grad_diff": max((grads_cp[n] - g).abs().max().item() for n, g in ref_grads.items()),
              "grads_compared": sorted(ref_grads),
              "min_max_abs_grad": min(g.abs().max().item() for g in ref_grads.values()),
              "documents": len(docs), "targets": count}
    if eval_loss_cp is not None:
        reference.zero_grad(set_to_none=True)
        reference.eval()
        rows = trainer.eval_dataset.rows
        ref_eval = eval_reference(reference, rows, dp_size, device)
        cp_size = trainer.mesh["cp"].size() if trainer.mesh is not None else 1
        last_shard_start = trainer.args.max_length - trainer.args.max_length // cp_size
        parity.update(eval_loss_cp=eval_loss_cp, eval_loss_no_cp=ref_eval,
                      abs_eval_loss_diff=abs(eval_loss_cp - ref_eval), eval_rows=len(rows),
                      # rows whose last CP shard is all padding: where a mean of per-rank means goes wrong
                      eval_rows_with_a_padding_only_shard=sum(len(r) <= last_shard_start for r in rows)
                      if cp_size > 1 else 0)
    return parity


if __name__ == "__main__":
    main()
