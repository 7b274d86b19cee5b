"""Train a causal LM on packed documents with block-diagonal context parallelism.

    accelerate launch --config_file configs/accelerate/cpu_cp2.yaml examples/train_packed_cp.py \
        --cp-size 2 --seq-len 2048 --steps 20 --check-parity

Defaults run offline on any machine: a tiny Llama from configs/model/tiny-llama.json, a byte-level
tokenizer, and the Python standard library's *.py files as documents. Every rank of a CP group
holds 1/cp_size of each packed row; DP groups read different rows; the loss is the exact token mean
over the whole step (see hf_blockdiag_cp.normalize_num_items).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    apply_lora,
    check_common_args,
    chunked_loss_setting,
    cp_config,
    example_parser,
    exchange_label,
    gather_floats,
    head_parallel_groups,
    load_documents,
    load_model_and_tokenizer,
    one_line_errors,
    peak_memory_bytes,
    quiet_other_ranks,
    refuse_accelerate_cp,
    report,
    resolve_cp_size,
)

import hf_blockdiag_cp as bd  # noqa: E402  (registers attn_implementation="blockdiag_cp")
from hf_blockdiag_cp import comm_stats  # noqa: E402

logger = logging.getLogger("train_packed_cp")


def parse_args(argv: list[str] | None = None):
    p = example_parser(__doc__)
    p.add_argument("--fsdp2", action="store_true",
                   help="shard the model with torch FSDP2 (fully_shard per decoder layer) over all ranks instead of "
                        "DDP; works on CPU too (accelerate's own FSDP config needs GPUs)")
    p.add_argument("--parameter-check-every", type=int, default=100,
                   help="compare the parameters of the CP group at the first step and every N steps (0 = never; "
                        "one pass over the parameters and two small all-gathers per check)")
    return p.parse_args(argv)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _rows_forever(loader):
    epoch = 0
    while True:
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        produced = 0
        for batch in loader:
            produced += 1
            yield batch
        if not produced:
            raise ValueError("the corpus gives this data-parallel group no packed row: use more data (--max-docs) "
                             "or fewer processes")
        epoch += 1


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name.removeprefix("module.")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach()
    return out


def _parity(ref_model, dataset, args, tokenizer, config, dp_size: int, cp_loss: float, cp_grads, device) -> dict:
    """The first step's global batch without CP (one process holds every row) vs the CP step."""
    rows = []
    for row in dataset:
        rows.append(row)
        if len(rows) == dp_size:
            break
    collator = bd.PackingCollator(args.seq_len, cp_size=1, pad_token_id=tokenizer.pad_token_id, config=config)
    batch = _to_device(collator(rows), device)
    out = ref_model(**batch)
    out.loss.backward()
    ref_grads = _grads(ref_model)
    grad_diff = max((cp_grads[n].to(g.device) - g).abs().max().item() for n, g in ref_grads.items())
    return {"loss_cp": cp_loss, "loss_no_cp": out.loss.item(), "abs_loss_diff": abs(cp_loss - out.loss.item()),
            "max_grad_diff": grad_diff, "grads_compared": sorted(ref_grads),
            "min_max_abs_grad": min(g.abs().max().item() for g in ref_grads.values())}


def _fully_shard(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over every rank (the flattened dp x cp world): each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=world_mesh)
    fully_shard(model, mesh=world_mesh)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_other_ranks()
    with one_line_errors():  # set-up mistakes: one line on the main process
        check_common_args(args)  # before any rank starts work
        if args.fsdp2 and args.lora:
            raise SystemExit("--fsdp2 with --lora is not covered by tests: use one of them")
        refuse_accelerate_cp()
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        config = cp_config(args)
        # On CPU, accelerate spawns several processes only through its torchrun path (distributed_type
        # MULTI_GPU in the config); cpu=True then makes it a gloo MULTI_CPU run. The process group's
        # timeout follows HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S: DDP's collectives would otherwise wait 30
        # minutes for a stalled peer (init_device_mesh would lower a longer one).
        accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision,
                                  kwargs_handlers=[InitProcessGroupKwargs(timeout=config.process_group_timeout)])
        logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                            format="%(asctime)s %(name)s: %(message)s")
        torch.manual_seed(args.seed)
        world = accelerator.num_processes
        cp_size = resolve_cp_size(args.cp_size, world)
        mesh = bd.init_device_mesh(cp_size, config=config) if world > 1 else None
        coords = bd.cp_coordinates(mesh)
        dtype = getattr(torch, args.dtype)

        model, tokenizer = load_model_and_tokenizer(args.model, dtype)
        model.config.use_cache = False
        if args.grad_checkpointing:
            model.activation_checkpointing_enable()  # also makes the embeddings' output require grad (for LoRA)
        model = apply_lora(model, args)
        docs = load_documents(args, tokenizer)
        dataset = bd.PackedDataset(docs, args.seq_len, seed=args.seed)
        # Head-parallel subgroups are created once, here, for every u a step may use (collective over the world).
        groups = head_parallel_groups(mesh, config)
        collator = bd.PackingCollator(args.seq_len, group=mesh["cp"] if mesh is not None else None,
                                      pad_token_id=tokenizer.pad_token_id, config=config, model_config=model.config,
                                      ulysses_groups=groups)
        bd.check_collator(collator, mesh)
        loader = bd.dp_dataloader(dataset, mesh, collate_fn=collator)
        logger.info("%d documents (%d tokens), seq_len %d, world %d = dp %d x cp %d, backend %s, kv_exchange %s, "
                    "ulysses_size %s", len(docs), sum(len(d["input_ids"]) for d in docs), args.seq_len, world,
                    coords.dp_size, coords.cp_size, args.backend, args.kv_exchange, args.ulysses_size)

        model = bd.prepare_model(model.to(accelerator.device), strict=True)
        ref_model = copy.deepcopy(model) if args.check_parity else None
        if args.fsdp2:
            if accelerator.distributed_type.value == "FSDP":
                raise SystemExit("--fsdp2 shards the model itself: use it with a MULTI_GPU accelerate config, not FSDP")
            _fully_shard(model, accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if world > 1 and not args.fsdp2:
            model, optimizer = accelerator.prepare(model, optimizer)
        model.train()
        wrapper = type(model).__name__
        sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
        logger.info("model wrapped as %s%s", wrapper, " (FSDP2: DTensor parameters)" if sharded else "")
        chunked = chunked_loss_setting(args)
        if chunked is not False:  # 'on' raises where the chunked loss is not exact, 'auto' falls back to the model's
            try:
                bd.check_chunked_loss(model)
                chunked = True
            except NotImplementedError:
                if chunked:
                    raise
                chunked = False
        logger.info("loss: %s", "chunked (bd.chunked_causal_lm_loss)" if chunked else "the model's own")

    progress = None
    if accelerator.is_main_process and not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=args.steps, desc="train", dynamic_ncols=True)
    losses, step_times, step_tokens, parity, kv_bytes = [], [], [], None, 0
    rows = _rows_forever(loader)
    for step in range(args.steps):
        batch = next(rows)
        ctx = batch["cp_context"]
        if mesh is not None and coords.cp_size > 1 and args.parameter_check_every \
                and step % args.parameter_check_every == 0:
            bd.check_parameters_consistent(model, mesh, step=step)  # same weights on every CP rank
        tokens = torch.tensor(float((ctx.doc_ids != 0).sum()))
        if mesh is not None and coords.dp_size > 1:
            dist.all_reduce(tokens, group=mesh["dp"].get_group())  # real tokens of the whole step
        batch = bd.normalize_num_items(_to_device(batch, accelerator.device), mesh, device=accelerator.device)
        start = time.perf_counter()
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
                   if args.offload_activations else contextlib.nullcontext())
        with accelerator.autocast(), offload:  # autocast: a no-op unless --mixed-precision
            step_loss = bd.chunked_causal_lm_loss(model, batch) if chunked else model(**batch).loss
        accelerator.backward(step_loss)
        loss = bd.reduce_loss_for_logging(step_loss, mesh).item()
        if step == 0 and ref_model is not None:
            parity = _parity(ref_model, dataset, args, tokenizer, config, coords.dp_size, loss, _grads(model),
                             accelerator.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        step_times.append(elapsed)
        step_tokens.append(tokens.item())
        stats = comm_stats(ctx)
        kv_bytes = stats.sent_bytes + stats.received_bytes
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{step_tokens[-1] / elapsed:,.0f}")
            progress.update(1)
    if progress is not None:
        progress.close()

    timed = slice(1, None) if args.steps > 1 else slice(None)  # the first step warms up
    tokens_per_s = sum(step_tokens[timed]) / sum(step_times[timed])
    peaks = gather_floats(peak_memory_bytes(), world)
    kv = gather_floats(kv_bytes, world)
    summary = {
        "world": world, "wrapper": wrapper, "lora": args.lora, "fsdp2": sharded, "dp_size": coords.dp_size,
        "cp_size": coords.cp_size, "seq_len": args.seq_len, "mixed_precision": args.mixed_precision,
        "steps": args.steps, "chunked_loss": chunked,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "tokens_per_s": tokens_per_s,
        "peak_memory_gib_per_rank": [p / 2**30 for p in peaks],
        "peak_memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "process max RSS",
        "kv_exchange_bytes_per_step_per_rank": kv,
        "kv_exchange_strategy": exchange_label(ctx),
        "ulysses_size": args.ulysses_size, "ulysses_size_last_step": ctx.ulysses_size,
        "parity": parity,
    }
    if accelerator.is_main_process:
        report(summary, args.summary_json)
    if args.output_dir:
        if args.fsdp2:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = accelerator.get_state_dict(model) if world > 1 else None
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(args.output_dir, state_dict=state)
            logger.info("saved the model to %s", args.output_dir)
    accelerator.wait_for_everyone()
    bd.training.close_process_groups()  # after the last collective: exit 0, no gloo hang or abort at exit
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
