"""Train a causal LM on packed documents with block-diagonal context parallelism.

    accelerate launch --config_file configs/accelerate/cpu_cp2.yaml examples/train_packed_cp.py \
        --cp-size 2 --seq-len 2048 --steps 20 --check-parity

Defaults run offline on any machine: a tiny Llama from configs/model/tiny-llama.json, a byte-level
tokenizer, and the Python standard library's *.py files as documents. Every rank of a CP group
holds 1/cp_size of each packed row; DP groups read different rows; the loss is the exact token mean
over the whole step (see hf_blockdiag_cp.normalize_num_items).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_blockdiag_cp as bd  # noqa: E402  (registers attn_implementation="blockdiag_cp")
from common import DEFAULT_MODEL, load_model_and_tokenizer, read_corpus, tokenize  # noqa: E402
from hf_blockdiag_cp.distributed.runtime import comm_stats  # noqa: E402

logger = logging.getLogger("train_packed_cp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a config *.json (fresh weights, byte tokenizer) or a local dir / hub id for from_pretrained")
    p.add_argument("--data", default=None,
                   help="'stdlib' (default), a glob of text files, a .jsonl with a 'text' field, or a datasets name")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many documents")
    p.add_argument("--max-chars", type=int, default=None, help="cut every document to this many characters")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row (all CP ranks together)")
    p.add_argument("--cp-size", type=int, default=1, help="ranks sharing one row (must divide the world size)")
    p.add_argument("--backend", default="auto", choices=bd.BACKENDS)
    p.add_argument("--kv-exchange", default="auto", choices=bd.KV_EXCHANGES)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--fsdp2", action="store_true",
                   help="shard the model with torch FSDP2 (fully_shard per decoder layer) over all ranks instead of "
                        "DDP; works on CPU too (accelerate's own FSDP config needs GPUs)")
    p.add_argument("--check-parity", action="store_true",
                   help="re-run the first step without CP and print both losses and the max gradient difference")
    p.add_argument("--output-dir", default=None, help="save_pretrained the trained model here")
    p.add_argument("--summary-json", default=None, help="write the final summary here (main process)")
    p.add_argument("--no-progress", action="store_true")
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
            "max_grad_diff": grad_diff}


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
    from accelerate import Accelerator

    # On CPU, accelerate spawns several processes only through its torchrun path (distributed_type
    # MULTI_GPU in the config); cpu=True then makes it a gloo MULTI_CPU run.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    world = accelerator.num_processes
    if world == 1 and args.cp_size > 1:
        raise SystemExit(f"--cp-size {args.cp_size} needs {args.cp_size} processes: launch with accelerate launch "
                         "--config_file configs/accelerate/cpu_cp2.yaml (or torchrun)")
    mesh = bd.init_device_mesh(args.cp_size) if world > 1 else None
    coords = bd.cp_coordinates(mesh)
    dtype = getattr(torch, args.dtype)
    config = bd.BlockDiagCPConfig(backend=args.backend, kv_exchange=args.kv_exchange)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype)
    model.config.use_cache = False
    if args.grad_checkpointing:
        model.activation_checkpointing_enable()
    texts = list(read_corpus(args.data, args.max_docs, args.max_chars))
    docs = [{"input_ids": tokenize(tokenizer, t)} for t in texts]
    dataset = bd.PackedDataset(docs, args.seq_len, seed=args.seed)
    collator = bd.PackingCollator(args.seq_len, group=mesh["cp"] if mesh is not None else None,
                                  pad_token_id=tokenizer.pad_token_id, config=config)
    bd.check_collator(collator, mesh)
    loader = bd.dp_dataloader(dataset, mesh, collate_fn=collator)
    logger.info("%d documents (%d tokens), seq_len %d, world %d = dp %d x cp %d, backend %s, kv_exchange %s",
                len(docs), sum(len(d["input_ids"]) for d in docs), args.seq_len, world, coords["dp_size"],
                coords["cp_size"], args.backend, args.kv_exchange)

    model = bd.guard_model(model.to(accelerator.device))
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

    progress = None
    if accelerator.is_main_process and not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=args.steps, desc="train", dynamic_ncols=True)
    losses, step_times, step_tokens, parity, kv_bytes = [], [], [], None, 0
    rows = _rows_forever(loader)
    for step in range(args.steps):
        batch = next(rows)
        ctx = batch["cp_context"]
        tokens = torch.tensor(float((ctx.doc_ids != 0).sum()))
        if mesh is not None and coords["dp_size"] > 1:
            dist.all_reduce(tokens, group=mesh["dp"].get_group())  # real tokens of the whole step
        batch = bd.normalize_num_items(_to_device(batch, accelerator.device), mesh, device=accelerator.device)
        start = time.perf_counter()
        out = model(**batch)
        accelerator.backward(out.loss)
        loss = bd.reduce_loss_for_logging(out.loss, mesh).item()
        if step == 0 and ref_model is not None:
            parity = _parity(ref_model, dataset, args, tokenizer, config, coords["dp_size"], loss, _grads(model),
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
    if torch.cuda.is_available():
        peak = torch.tensor(float(torch.cuda.max_memory_allocated()))
    else:
        peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))  # Linux: KiB
    peaks = [peak.clone() for _ in range(world)]
    kv = [torch.tensor(float(kv_bytes)) for _ in range(world)]
    if world > 1:
        dist.all_gather(peaks, peak)
        dist.all_gather(kv, torch.tensor(float(kv_bytes)))
    summary = {
        "world": world, "wrapper": wrapper, "fsdp2": sharded, "dp_size": coords["dp_size"], "cp_size": coords["cp_size"], "seq_len": args.seq_len,
        "steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "tokens_per_s": tokens_per_s,
        "peak_memory_gib_per_rank": [p.item() / 2**30 for p in peaks],
        "peak_memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "process max RSS",
        "kv_exchange_bytes_per_step_per_rank": [k.item() for k in kv],
        "kv_exchange_strategy": ctx.exchange.strategy if ctx.exchange is not None else "none",
        "parity": parity,
    }
    if accelerator.is_main_process:
        print(f"loss: step 1 {losses[0]:.4f} -> step {args.steps} {losses[-1]:.4f}")
        print(f"throughput: {tokens_per_s:,.0f} tokens/s (world {world}, cp {coords['cp_size']}, "
              f"seq_len {args.seq_len})")
        print("peak memory per rank (GiB, {}): {}".format(
            summary["peak_memory_kind"], ", ".join(f"{g:.2f}" for g in summary["peak_memory_gib_per_rank"])))
        print("K/V exchanged per step per rank (fwd+bwd, MiB, {}): {}".format(
            summary["kv_exchange_strategy"],
            ", ".join(f"{b / 2**20:.2f}" for b in summary["kv_exchange_bytes_per_step_per_rank"])))
        if parity is not None:
            print(f"parity: loss with CP {parity['loss_cp']:.8f} without CP {parity['loss_no_cp']:.8f} "
                  f"|dloss| {parity['abs_loss_diff']:.2e} max|dgrad| {parity['max_grad_diff']:.2e}")
        if args.summary_json:
            with open(args.summary_json, "w", encoding="utf-8") as fh:
                json.dump(summary, fh, indent=2)
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
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
