"""Train a vision-language model on packed image-text documents with block-diagonal context parallelism.

    accelerate launch --config_file configs/accelerate/cpu_cp2.yaml examples/train_vlm_packed_cp.py --check-parity

Defaults run offline in well under a minute on 2 CPU processes: a tiny Qwen2.5-VL-style model built from
configs/model/tiny-qwen2_5-vl.json (fresh weights), and synthetic image-text documents: the text of top-level
definitions of the Python standard library (UTF-8 bytes as tokens) with images of a few grid sizes (random patch
pixels) cut into it at random places, some documents without images, about --image-share of all tokens being image
placeholders. Each document is what a Qwen2.5-VL processor returns for one document (input_ids with a placeholder
run per image, pixel_values, image_grid_thw, mm_token_type_ids, labels with the placeholders ignored).

The collator packs documents into rows (model_config=model.config: it reads the images and gives every document its
own 3-D rope positions from the model's get_rope_index); under CP every image is encoded by ONE rank and its feature
rows go to the ranks holding its placeholder tokens in one all-to-all (see docs/multimodal.md).
--check-parity compares step 1's loss and gradients (vision tower, projector and language model) with every
document of that step run alone through the stock model (sdpa attention, no packing, no CP).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    ROOT,
    ByteTokenizer,
    check_common_args,
    exchange_label,
    gather_floats,
    one_line_errors,
    peak_memory_bytes,
    quiet_other_ranks,
    read_corpus,
    refuse_accelerate_cp,
    report,
    resolve_cp_size,
)

import hf_blockdiag_cp as bd  # noqa: E402  (registers attn_implementation="blockdiag_cp")
from hf_blockdiag_cp.model.media import media_stats  # noqa: E402

logger = logging.getLogger("train_vlm_packed_cp")

DEFAULT_MODEL = str(ROOT / "configs" / "model" / "tiny-qwen2_5-vl.json")
#: The package's attention: as a plain string it applies to the language model, while the vision tower keeps its
#: stock implementation (sdpa: its attention is bidirectional within an image and never sees a packed row).
ATTN_IMPLEMENTATION: Any = "blockdiag_cp"
#: Image grids (t, h, w) in patches; with spatial merge 2 they fill 4, 16, 24 and 64 placeholder tokens.
GRIDS = ((1, 4, 4), (1, 8, 8), (1, 8, 12), (1, 16, 16))
#: At most this many images per document.
MAX_IMAGES = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The options of the text examples that apply here, under the same names (common.add_common_args also has text
    # corpora, LoRA, chunked losses, ... which this example does not cover).
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a vision-language config *.json (fresh weights) or a local dir / hub id for from_pretrained; "
                        "the documents are made from its config (placeholder token, patch size, merge)")
    p.add_argument("--max-docs", type=int, default=64, help="documents (standard-library definitions + images)")
    p.add_argument("--max-chars", type=int, default=320, help="cut every document's text to this many characters")
    p.add_argument("--image-share", type=float, default=0.3,
                   help="the share of all tokens that should be image placeholders (the run reports the actual one)")
    p.add_argument("--text-only-share", type=float, default=0.25, help="the share of documents without images")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row (all CP ranks together)")
    p.add_argument("--cp-size", type=int, default=None,
                   help="ranks sharing one row (must divide the world size); default: all processes form one CP group")
    p.add_argument("--backend", default="auto", choices=bd.BACKENDS, help="attention kernel ('auto' picks one)")
    p.add_argument("--kv-exchange", default="auto", choices=bd.KV_EXCHANGES, help="how CP ranks exchange K/V")
    p.add_argument("--placement", default=None, choices=bd.PLACEMENTS,
                   help="which row tokens each CP rank holds (default: the config's, 'balanced')")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (constant)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the documents and the row order")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--check-parity", action="store_true",
                   help="compare step 1's loss and gradients with every document run alone through the stock model")
    p.add_argument("--summary-json", default=None, help="write the final summary here (main process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def load_vlm(path: str, dtype: torch.dtype, attn_implementation: Any = ATTN_IMPLEMENTATION) -> torch.nn.Module:
    """A ``*.json`` config builds a fresh model (seeded); anything else goes to ``from_pretrained``."""
    import transformers

    if path.endswith(".json"):
        with open(path, encoding="utf-8") as fh:
            config = transformers.AutoConfig.for_model(**json.load(fh))
        return transformers.AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation,
                                                                    dtype=dtype)
    return transformers.AutoModelForImageTextToText.from_pretrained(path, attn_implementation=attn_implementation,
                                                                    dtype=dtype)


def _image(config: Any, grid: tuple[int, int, int], g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """One image as a Qwen2-VL-family processor lays it out: ``<vision_start>``, one placeholder per merged patch
    group, ``<vision_end>``; its ``[t*h*w, C*T*p*p]`` patch rows (random pixels)."""
    vc = config.vision_config
    t, h, w = grid
    ids = [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // vc.spatial_merge_size ** 2)
    ids.append(config.vision_end_token_id)
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return ids, torch.randn(t * h * w, width, generator=g)


def make_documents(config: Any, texts: list[str], *, seq_len: int, image_share: float, text_only_share: float,
                   seed: int, max_images: int = MAX_IMAGES) -> list[dict[str, Any]]:
    """Image-text documents as a processor returns them for one document each (see the module docstring).

    A share ``text_only_share`` of the documents has no image; the others get images (up to ``max_images`` each,
    grids from :data:`GRIDS`) until the image placeholders of the documents made so far are about ``image_share``
    of their tokens. Documents never exceed ``seq_len`` (a document with images cannot be split over rows).
    """
    tokenizer = ByteTokenizer()
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    merge = config.vision_config.spatial_merge_size
    tokens_of = {grid: grid[0] * grid[1] * grid[2] // merge ** 2 for grid in GRIDS}
    docs, image_tokens, other_tokens = [], 0, 0
    for text in texts:
        text_ids = tokenizer.encode(text)[: seq_len // 2]
        grids: list[tuple[int, int, int]] = []
        if rng.random() >= text_only_share and len(text_ids) > 2:
            # image tokens that bring the running share to image_share (2 more text tokens per image: its markers)
            budget = (image_share * (other_tokens + len(text_ids)) - (1 - image_share) * image_tokens) / (
                1 - image_share)
            while len(grids) < max_images and budget >= min(tokens_of.values()):
                fitting = sorted((gr for gr in GRIDS if tokens_of[gr] <= budget), key=tokens_of.get)
                grid = rng.choice(fitting[-2:])  # one of the two largest that fit
                grids.append(grid)
                budget -= tokens_of[grid] + 2 * image_share / (1 - image_share)
            grids = grids or [min(GRIDS, key=tokens_of.get)]
        cuts = sorted(rng.randint(1, len(text_ids) - 1) for _ in grids)  # after BOS, before EOS
        ids, pixels, start = [], [], 0
        for cut, grid in zip(cuts, grids):
            image_ids, image_pixels = _image(config, grid, g)
            if len(ids) + len(image_ids) + len(text_ids) - start > seq_len:
                break  # keep the document within one row
            ids += text_ids[start:cut] + image_ids
            pixels.append(image_pixels)
            start = cut
        ids += text_ids[start:]
        input_ids = torch.tensor(ids)
        placeholder = input_ids == config.image_token_id
        image_tokens += int(placeholder.sum())
        other_tokens += len(ids) - int(placeholder.sum())
        doc: dict[str, Any] = {"input_ids": input_ids, "labels": input_ids.masked_fill(placeholder, -100),
                               "mm_token_type_ids": placeholder.to(torch.int64)}
        if pixels:
            doc["pixel_values"] = torch.cat(pixels)
            doc["image_grid_thw"] = torch.tensor(grids[:len(pixels)])
        docs.append(doc)
    return docs


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _rows_forever(loader):
    epoch = 0
    while True:
        loader.dataset.set_epoch(epoch)
        produced = 0
        for batch in loader:
            produced += 1
            yield batch
        if not produced:
            raise ValueError("the documents give this data-parallel group no packed row: use more (--max-docs)")
        epoch += 1


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _part(name: str) -> str:
    """The part of a Qwen2-VL-family model a parameter belongs to."""
    if "visual.merger" in name:
        return "projector"
    return "vision" if "visual" in name else "language"


def _parity(stock: torch.nn.Module, examples: list[dict], rows: list[Any], cp_loss: float,
            cp_grads: dict[str, torch.Tensor]) -> dict:
    """Every document of the step's rows alone through ``stock``: the token mean of their losses and its gradients,
    vs the CP step's. ``rows``: the step's :class:`~hf_blockdiag_cp.PackedRow` s (every DP group's)."""
    stock.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for row in rows:
        for piece in row.documents:
            ex = examples[piece.index]
            batch = {k: (v[None] if k in ("input_ids", "labels", "mm_token_type_ids") else v) for k, v in ex.items()}
            out = stock(**batch, use_cache=False)
            targets = int((ex["labels"][1:] != -100).sum())
            total, count = total + out.loss * targets, count + targets
    loss = total / count
    loss.backward()
    ref = _grads(stock)
    diff = max((cp_grads[n] - g).abs().max().item() for n, g in ref.items())
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for n, g in ref.items():
        part = _part(n)
        num[part] = num.get(part, 0.0) + float((cp_grads[n].double() - g.double()).pow(2).sum())
        den[part] = den.get(part, 0.0) + float(g.double().pow(2).sum())
    return {"reference": "each document alone (stock sdpa, 1 process)", "loss_cp": cp_loss,
            "loss_no_cp": loss.item(), "abs_loss_diff": abs(cp_loss - loss.item()), "max_grad_diff": diff,
            "relative_grad_diff": {k: (num[k] / den[k]) ** 0.5 for k in sorted(num)},
            "grads_compared": len(ref), "documents": sum(len(r.documents) for r in rows)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_other_ranks()
    with one_line_errors():  # set-up mistakes: one line on the main process
        check_common_args(args)
        if not 0 <= args.image_share < 1 or not 0 <= args.text_only_share < 1:
            raise SystemExit("--image-share and --text-only-share are fractions in [0, 1)")
        refuse_accelerate_cp()
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

        config = bd.BlockDiagCPConfig(backend=args.backend, kv_exchange=args.kv_exchange)
        # A rank that encodes none of its row's images (under CP each image is encoded by one rank; a row may have
        # none) leaves the vision tower without gradient in that step: without find_unused_parameters DDP then
        # fails the next step ("Expected to have finished reduction in the prior iteration").
        accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
            InitProcessGroupKwargs(timeout=config.process_group_timeout),
            DistributedDataParallelKwargs(find_unused_parameters=True)])
        logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                            format="%(asctime)s %(name)s: %(message)s")
        world = accelerator.num_processes
        cp_size = resolve_cp_size(args.cp_size, world)
        mesh = bd.init_device_mesh(cp_size, config=config) if world > 1 else None
        coords = bd.cp_coordinates(mesh)
        torch.manual_seed(args.seed)
        model = load_vlm(args.model, getattr(torch, args.dtype))
        model.config.use_cache = False
        stock = None
        if args.check_parity:  # the same weights, stock attention everywhere
            stock = load_vlm(args.model, getattr(torch, args.dtype), "sdpa") if accelerator.is_main_process else None
            if stock is not None:
                stock.load_state_dict(model.state_dict())
        texts = list(read_corpus("stdlib", args.max_docs, args.max_chars))
        examples = make_documents(model.config, texts, seq_len=args.seq_len, image_share=args.image_share,
                                  text_only_share=args.text_only_share, seed=args.seed)
        dataset = bd.PackedDataset(examples, args.seq_len, seed=args.seed, model_config=model.config)
        collator = bd.PackingCollator(args.seq_len, group=mesh["cp"] if mesh is not None else None,
                                      pad_token_id=model.config.text_config.pad_token_id, config=config,
                                      placement=args.placement, model_config=model.config)
        bd.check_collator(collator, mesh)
        loader = bd.dp_dataloader(dataset, mesh, collate_fn=collator)
        image_tokens = sum(int((e["input_ids"] == model.config.image_token_id).sum()) for e in examples)
        all_tokens = sum(len(e["input_ids"]) for e in examples)
        images = sum(len(e.get("image_grid_thw", ())) for e in examples)
        logger.info("%d documents (%d without images), %d images, %d tokens (%.0f %% image placeholders), seq_len %d, "
                    "world %d = dp %d x cp %d", len(examples), sum("pixel_values" not in e for e in examples), images,
                    all_tokens, 100 * image_tokens / all_tokens, args.seq_len, world, coords.dp_size, coords.cp_size)
        model = bd.prepare_model(model.to(accelerator.device), strict=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if world > 1:
            model, optimizer = accelerator.prepare(model, optimizer)
        model.train()

    progress = None
    if accelerator.is_main_process and not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=args.steps, desc="train", dynamic_ncols=True)
    losses, step_times, step_tokens, parity = [], [], [], None
    kv_bytes = media_bytes = encoded = 0
    rows = _rows_forever(loader)
    for step in range(args.steps):
        batch = next(rows)
        ctx = batch["cp_context"]
        tokens = torch.tensor(float((ctx.doc_ids != 0).sum()))
        if mesh is not None and coords.dp_size > 1:
            dist.all_reduce(tokens, group=mesh["dp"].get_group())  # real tokens of the whole step
        batch = bd.normalize_num_items(_to_device(batch, accelerator.device), mesh, device=accelerator.device)
        start = time.perf_counter()
        out = model(**batch)
        accelerator.backward(out.loss)
        loss = bd.reduce_loss_for_logging(out.loss, mesh).item()
        if step == 0 and stock is not None:
            step_rows = []  # the first row of every DP group: the dataset's first dp_size rows
            for row in dataset:
                step_rows.append(row)
                if len(step_rows) == coords.dp_size:
                    break
            parity = _parity(stock, examples, step_rows, loss, _grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        step_times.append(elapsed)
        step_tokens.append(tokens.item())
        kv = bd.comm_stats(ctx)
        kv_bytes = kv.sent_bytes + kv.received_bytes
        media = media_stats(ctx)
        media_bytes = media.sent_bytes + media.received_bytes
        encoded = len(ctx.media.encode) if ctx.media is not None else len(batch.get("image_grid_thw", ()))
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{step_tokens[-1] / elapsed:,.0f}")
            progress.update(1)
    if progress is not None:
        progress.close()

    timed = slice(1, None) if args.steps > 1 else slice(None)  # the first step warms up
    summary = {
        "world": world, "dp_size": coords.dp_size, "cp_size": coords.cp_size, "seq_len": args.seq_len,
        "steps": args.steps, "documents": len(examples), "images": images,
        "image_token_share": image_tokens / all_tokens,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "tokens_per_s": sum(step_tokens[timed]) / sum(step_times[timed]),
        "peak_memory_gib_per_rank": [p / 2**30 for p in gather_floats(peak_memory_bytes(), world)],
        "peak_memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "process max RSS",
        "kv_exchange_bytes_per_step_per_rank": gather_floats(kv_bytes, world),
        "kv_exchange_strategy": exchange_label(ctx),
        "media_bytes_per_step_per_rank": gather_floats(media_bytes, world),
        "images_encoded_last_step_per_rank": [int(x) for x in gather_floats(encoded, world)],
        "parity": parity,
    }
    if accelerator.is_main_process:
        print(f"documents: {len(examples)}, {images} images, {100 * summary['image_token_share']:.0f} % of the "
              "tokens are image placeholders")
        print("image features exchanged per step per rank (fwd+bwd, KiB): {}; images encoded in the last step per "
              "rank: {}".format(", ".join(f"{b / 2**10:.1f}" for b in summary["media_bytes_per_step_per_rank"]),
                                ", ".join(map(str, summary["images_encoded_last_step_per_rank"]))))
        if parity is not None:
            print("gradient vs each document alone, relative difference per part: " + ", ".join(
                f"{k} {v:.1e}" for k, v in parity["relative_grad_diff"].items()))
        report(summary, args.summary_json)
    accelerator.wait_for_everyone()
    bd.training.close_process_groups()  # after the last collective: exit 0, no gloo hang or abort at exit
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
