"""What the TRL tests share (test_trl_cp.py, test_predict_cp.py): the documents, the example module, the
offline model and tokenizer, and the ``SFTConfig``. TRL is imported only inside the functions."""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 512


def documents() -> list[str]:
    """Small code-like documents: 14 for training, then 3 for evaluation whose packing leaves one eval row of
    fewer than SEQ_LEN / 2 tokens (its second CP shard is all padding: where per-rank means go wrong)."""
    rng = random.Random(0)

    def doc(i: int, lines: int) -> str:
        body = "".join(f"    y = y * {rng.randint(2, 99)} + {rng.randint(0, 9)}\n" for _ in range(lines))
        return f"def step_{i}(y):\n{body}    return y\n"

    return [doc(i, rng.randint(1, 12)) for i in range(14)] + [doc(100, 10), doc(101, 7), doc(102, 1)]


def example():
    """examples/sft_trl_cp.py as a module (its helpers: the offline model and tokenizer, the reference)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    import sft_trl_cp

    return sft_trl_cp


def setup(fmt: str):
    import torch

    module = example()
    model, tokenizer = module.load_model(str(ROOT / "configs" / "model" / "tiny-llama.json"), dtype=torch.float32)
    return model, tokenizer, module.sft_examples(documents(), fmt)


def sft_args(tmp_path, **overrides):
    from trl import SFTConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                bf16=False, max_length=SEQ_LEN, packing=True, per_device_train_batch_size=1,
                per_device_eval_batch_size=1, max_steps=1, gradient_checkpointing=False, dataset_num_proc=None)
    return SFTConfig(**{**base, **overrides})
