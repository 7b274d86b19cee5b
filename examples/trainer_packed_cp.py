"""Train a causal LM on packed documents with block-diagonal context parallelism through the HF Trainer.

    accelerate launch --config_file configs/accelerate/cpu_cp2.yaml examples/trainer_packed_cp.py \
        --cp-size 2 --seq-len 2048 --steps 20 --check-parity

The same run as examples/train_packed_cp.py, with ``transformers.Trainer`` driving the loop through
``hf_blockdiag_cp.CPTrainer`` (data sharded over the mesh's dp dimension only; the Trainer's own
loss normalisation gives the exact token mean). Defaults run offline: a tiny Llama from
configs/model/tiny-llama.json, a byte-level tokenizer, the Python standard library as documents.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    apply_lora,
    check_common_args,
    chunked_loss_setting,
    cp_config,
    example_parser,
    exchange_label,
    full_row,
    gather_floats,
    head_parallel_groups,
    launch_mesh,
    load_documents,
    load_model_and_tokenizer,
    one_line_errors,
    peak_memory_bytes,
    quiet_other_ranks,
    refuse_accelerate_cp,
    report,
    trainer_arguments,
)

import hf_blockdiag_cp as bd  # noqa: E402  (registers attn_implementation="blockdiag_cp")
from hf_blockdiag_cp import comm_stats  # noqa: E402

logger = logging.getLogger("trainer_packed_cp")


def parse_args(argv: list[str] | None = None):
    p = example_parser(__doc__, trainer=True)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (they pack and plan rows)")
    return p.parse_args(argv)


class MeasuredCPTrainer(bd.CPTrainer):
    """Records each optimizer step's real tokens (full rows, this DP group), the last context and, with
    ``keep_first_step``, this rank's shard of every micro-batch of the first step."""

    def __init__(self, *args, keep_first_step: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_tokens: dict[int, int] = defaultdict(int)
        self.last_context = None
        self.keep_first_step, self.first_step_shards = keep_first_step, []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:  # compute_loss gets the prepared inputs: the context the layers will use
            ctx = inputs["cp_context"]
            self.step_tokens[self.state.global_step] += int((ctx.doc_ids != 0).sum())
            self.last_context = ctx
            if self.keep_first_step and self.state.global_step == 0:
                shard = {k: inputs[k].detach().cpu() for k in ("input_ids", "position_ids", "shift_labels")}
                self.first_step_shards.append({**shard, "doc_ids": ctx.doc_ids, "cp_rank": ctx.cp_rank,
                                                    "local_index": ctx.local_index})
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class StepProbe(TrainerCallback):
    """Times every optimizer step and keeps the first step's gradients (after clipping, before the update)."""

    def __init__(self, keep_grads: bool) -> None:
        self.keep_grads, self.first_grads, self.step_times, self._start = keep_grads, None, [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.keep_grads and state.global_step == 0:
            self.first_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
                                if p.grad is not None}

    def on_step_end(self, args, state, control, **kwargs):
        self.step_times.append(time.perf_counter() - self._start)


def first_step_rows(shards_per_rank: list[tuple[list[dict], int]]) -> dict[str, torch.Tensor]:
    """The full rows of the first step over all DP groups, rebuilt from every rank's shards."""
    by_row: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
    for rank_shards, dp_rank in shards_per_rank:
        for micro, shard in enumerate(rank_shards):
            by_row[(dp_rank, micro)][shard["cp_rank"]] = shard
    rows = [[parts[r] for r in sorted(parts)] for _, parts in sorted(by_row.items())]
    full = {k: torch.cat([full_row(row, k) for row in rows]) for k in ("input_ids", "position_ids", "shift_labels")}
    full["doc_ids"] = torch.cat([row[0]["doc_ids"] for row in rows])
    return full


def reference_step(ref_model, rows: dict[str, torch.Tensor], config, max_grad_norm: float, device) -> tuple:
    """Loss and clipped gradients of one process holding every row of the step (no CP)."""
    targets = rows["shift_labels"]
    batch = {"input_ids": rows["input_ids"], "position_ids": rows["position_ids"], "labels": targets,
             "shift_labels": targets, "num_items_in_batch": int((targets != -100).sum())}
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    context = bd.BlockDiagCPContext.build(rows["doc_ids"], config=config, input_ids=rows["input_ids"])
    ref_model.train()
    out = ref_model(**batch, cp_context=context, use_cache=False)
    out.loss.backward()
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_grad_norm)
    return out.loss.item(), {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}


def measure_run(trainer, probe, world: int, coords: bd.training.CPCoordinates, keep_shards: bool) -> tuple:
    """After ``trainer.train()``: ``(losses, tokens/s, peak memory per rank, K/V bytes per rank, first-step
    shards of every rank)`` (collectives when ``world > 1``; shards ``None`` unless ``keep_shards``)."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens = torch.tensor([float(trainer.step_tokens[s]) for s in range(len(probe.step_times))], dtype=torch.float64)
    if world > 1:  # every CP rank of a DP group counted the same full rows
        dist.all_reduce(tokens)
        tokens /= coords.cp_size
    timed = slice(1, None) if len(probe.step_times) > 1 else slice(None)  # the first step warms up
    tokens_per_s = tokens[timed].sum().item() / sum(probe.step_times[timed])
    peaks = gather_floats(peak_memory_bytes(), world)
    stats = comm_stats(trainer.last_context)
    kvs = gather_floats(stats.sent_bytes + stats.received_bytes, world)
    shards = None
    if keep_shards:
        shards = [(trainer.first_step_shards, coords.dp_rank)]
        if world > 1:  # the rows the Trainer really consumed in step 1, as every rank's shards
            gathered = [None] * world
            dist.all_gather_object(gathered, shards[0])
            shards = gathered
    return losses, tokens_per_s, peaks, kvs, shards


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_other_ranks()
    with one_line_errors():  # set-up mistakes: one line on the main process
        check_common_args(args)  # before any rank starts work
        refuse_accelerate_cp()  # before TrainingArguments starts accelerate
        output_dir = args.output_dir or tempfile.mkdtemp(prefix="trainer_packed_cp_")
        config = cp_config(args)
        mesh = launch_mesh(args, config)
        targs = TrainingArguments(**trainer_arguments(args, config, output_dir),
                                  dataloader_num_workers=args.num_workers)
        device, world = targs.device, targs.world_size
        main_process = targs.process_index == 0
        logging.basicConfig(level=logging.INFO if main_process else logging.WARNING,
                            format="%(asctime)s %(name)s: %(message)s")
        if world > 1 and not dist.is_initialized():
            raise SystemExit("accelerate did not initialise torch.distributed: launch with accelerate launch or "
                             "torchrun")
        coords = bd.cp_coordinates(mesh)

        model, tokenizer = load_model_and_tokenizer(args.model, getattr(torch, args.dtype))
        model = apply_lora(model, args)
        docs = load_documents(args, tokenizer)
        dataset = bd.PackedDataset(docs, args.seq_len, seed=args.seed)
        # Head-parallel subgroups are created once, here, for every u a step may use (collective over the world).
        collator = bd.PackingCollator(args.seq_len, group=mesh["cp"] if mesh is not None else None,
                                      pad_token_id=tokenizer.pad_token_id, config=config, model_config=model.config,
                                      ulysses_groups=head_parallel_groups(mesh, config))
        logger.info("%d documents (%d tokens), seq_len %d, world %d = dp %d x cp %d, backend %s, kv_exchange %s, "
                    "ulysses_size %s", len(docs), sum(len(d["input_ids"]) for d in docs), args.seq_len, world,
                    coords.dp_size, coords.cp_size, args.backend, args.kv_exchange, args.ulysses_size)

        # The no-CP reference runs no collective after training: only the main process needs the model copy.
        ref_model = copy.deepcopy(model) if args.check_parity and main_process else None
        probe = StepProbe(keep_grads=args.check_parity)
        trainer = MeasuredCPTrainer(model=model, args=targs, train_dataset=dataset, data_collator=collator,
                                    callbacks=[probe], mesh=mesh, keep_first_step=args.check_parity,
                                    chunked_loss=chunked_loss_setting(args),
                                    offload_activations=args.offload_activations)
    trainer.train()

    losses, tokens_per_s, peaks, kvs, shards = measure_run(trainer, probe, world, coords, args.check_parity)
    parity = None
    if args.check_parity:
        if main_process:
            ref_loss, ref_grads = reference_step(ref_model.to(device), first_step_rows(shards), config,
                                                 args.max_grad_norm, device)
            grad_diff = max((probe.first_grads[n] - g).abs().max().item() for n, g in ref_grads.items())
            parity = {"loss_cp": losses[0], "loss_no_cp": ref_loss, "abs_loss_diff": abs(losses[0] - ref_loss),
                      "max_grad_diff": grad_diff, "grads_compared": sorted(ref_grads),
                      "min_max_abs_grad": min(g.abs().max().item() for g in ref_grads.values()),
                      "grads": "after clipping to max_grad_norm" if args.max_grad_norm > 0 else "unclipped"}
    summary = {
        "world": world, "lora": args.lora, "dp_size": coords.dp_size, "cp_size": coords.cp_size,
        "seq_len": args.seq_len,
        "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "tokens_per_s": tokens_per_s, "peak_memory_gib_per_rank": [p / 2**30 for p in peaks],
        "peak_memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "process max RSS",
        "kv_exchange_bytes_per_step_per_rank": kvs,
        "kv_exchange_strategy": exchange_label(trainer.last_context),
        "ulysses_size": args.ulysses_size, "ulysses_size_last_step": trainer.last_context.ulysses_size,
        "parity": parity,
    }
    if main_process:
        report(summary, args.summary_json)
    if args.output_dir:
        trainer.save_model(args.output_dir)  # gathers and writes on the main process
    trainer.accelerator.wait_for_everyone()
    bd.training.close_process_groups()  # after the last collective: exit 0, no gloo hang or abort at exit
    trainer.accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
