"""A short CPTrainer run written as a user script (for test_clean_exit.py): it trains on a (dp, cp) mesh and never
ends its process groups itself. At exit it prints whether the groups are gone: its exit handler is registered
before CPTrainer registers the package's, and exit handlers run last-registered first.

    accelerate launch --num_processes 4 tests/training/exit_run.py OUTPUT_DIR CP_SIZE
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist


def _report() -> None:
    print(f"rank {os.environ.get('RANK', '0')}: process groups destroyed at exit: {not dist.is_initialized()}",
          flush=True)


def main(output_dir: str, cp_size: int) -> None:
    from transformers import TrainingArguments

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(cp_size)
    gen = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(1, 97, (int(n),), generator=gen).tolist()}
            for n in torch.randint(3, 30, (12,), generator=gen)]
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             logging_steps=1, max_steps=3, per_device_train_batch_size=1, lr_scheduler_type="constant",
                             ddp_find_unused_parameters=False, train_sampling_strategy="sequential")
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    trainer = bd.CPTrainer(model=model, args=args, train_dataset=bd.PackedDataset(docs, 64),
                           data_collator=bd.PackingCollator(64, group=mesh["cp"], pad_token_id=0), mesh=mesh)
    trainer.train()
    # A last collective of the script's own, whose tensors Python drops at once (what left gloo's workers holding
    # them at exit); nothing ends the groups afterwards.
    out = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.ones(4))
    print(f"rank {dist.get_rank()}: trained {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    atexit.register(_report)
    main(sys.argv[1], int(sys.argv[2]))
