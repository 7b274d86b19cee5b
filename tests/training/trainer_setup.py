"""What the Trainer tests share: their documents, the launcher environment, the arguments, and the references
(every document alone through stock sdpa)."""

from __future__ import annotations

SEQ_LEN = 48
# Four documents per micro-batch (each group fits one row of SEQ_LEN), two micro-batches per step.
DOC_LENGTHS = [9, 14, 1, 20, 30, 5, 11, 2]


def rank_env(world: int) -> dict[int, dict[str, str]]:
    """What a launcher would set: accelerate reads it to run MULTI_CPU on the already-initialised group."""
    return {r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1"} for r in range(world)}


def documents() -> list:
    import torch

    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, 97, (n,), generator=gen) for n in DOC_LENGTHS]


def reference_step() -> tuple[dict, dict, float]:
    """One SGD step (lr 1) of one process on all documents, each run alone through stock sdpa."""
    from tests.reference import per_document_sgd_step

    return per_document_sgd_step(documents())


def reference_eval_loss() -> float:
    """The Trainer's eval_loss definition (mean over eval steps of each step's token mean), computed with every
    document run alone through stock sdpa; an eval step is one row of four documents here."""
    from tests.reference import documents_alone, tiny_model

    model = tiny_model("llama", attn_implementation="sdpa")
    docs = documents()
    means = [documents_alone("llama", row, model, backward=False).loss for row in (docs[:4], docs[4:])]
    return sum(means) / len(means)


def training_args(tmp: str, **overrides):
    from transformers import TrainingArguments

    base = dict(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
                max_steps=1, per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
                train_sampling_strategy="sequential", max_grad_norm=0.0, lr_scheduler_type="constant",
                warmup_steps=0, ddp_find_unused_parameters=False)
    if overrides.get("dataloader_num_workers"):
        # The test ranks are forkserver children, whose DataLoader workers would each start a fork server and
        # import torch afresh (seconds a run); fork is what a Linux launch gets by default.
        base["dataloader_multiprocessing_context"] = "fork"
    return TrainingArguments(**{**base, **overrides})
