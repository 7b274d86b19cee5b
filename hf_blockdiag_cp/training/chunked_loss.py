"""A causal-LM loss that never holds ``[L, V]`` logits: the output projection and cross-entropy in chunks.

The model's own loss projects every local position onto the vocabulary at once: fp32 logits of ``L x V``
(512 KiB per token for V = 128,256), their log-softmax and their gradient. Here the model runs its body as
usual (through every wrapper: DDP, PEFT, the package's forward guard), its head is asked for no position
(``logits_to_keep`` = an empty index), and the hidden states ``[B, L, H]`` are projected ``chunk_size``
tokens at a time. Each chunk runs under non-reentrant activation checkpointing: its logits are dropped after
the forward and recomputed in the backward, so at most one chunk's ``[chunk, V]`` logits (and their gradient)
exist at any time.

Exact (same number, same gradients up to float summation order) only for heads whose forward is known:
:data:`HEADS` names each accepted ``*ForCausalLM`` class and what its forward does between ``lm_head`` and
the loss (nothing, gemma2/3's final softcap, cohere's ``logit_scale``, granite's ``logits_scaling``). The
head module must be an ``nn.Linear`` (tied or not, with or without bias) or PEFT's LoRA ``Linear`` around one,
and the model's ``loss_function`` transformers' ``ForCausalLMLoss``. Anything else raises
``NotImplementedError`` naming the model and the cause.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers.loss.loss_utils import ForCausalLMLoss

from ..errors import Refusal
from ..model.batch import check_cp_loss_count

__all__ = ["DEFAULT_CHUNK_SIZE", "HEADS", "check_chunked_loss", "chunked_causal_lm_loss"]

#: Tokens projected at once: ``chunk_size x V`` fp32 logits (125 MiB for V = 128,256) plus their softmax and
#: gradient live at a time, instead of ``L x V``.
DEFAULT_CHUNK_SIZE = 256
IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default; the package's collators pad labels with it

#: ``*ForCausalLM`` class name -> what its forward applies to ``lm_head``'s output before the loss
#: (transformers 5.24, checked against each class's source by tests/training/test_chunked_loss.py).
HEADS: dict[str, str] = {
    **dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "GemmaForCausalLM", "Phi3ForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM",
                     "Starcoder2ForCausalLM", "SmolLM3ForCausalLM", "GlmForCausalLM", "HeliumForCausalLM"),
                    "identity"),
    "Gemma2ForCausalLM": "final_logit_softcapping",
    "Gemma3ForCausalLM": "final_logit_softcapping",
    "CohereForCausalLM": "logit_scale",
    "Cohere2ForCausalLM": "logit_scale",
    "GraniteForCausalLM": "logits_scaling",
}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside DDP (``.module``) and PEFT (``get_base_model()``) wrappers."""
    for _ in range(8):  # wrappers nest a few levels at most
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)) and type(model).__module__.startswith("peft."):
            model = model.get_base_model()
        else:
            return model
    return model


def _accepted_linear(head: Any) -> bool:
    """``nn.Linear`` itself, or PEFT's LoRA ``Linear`` around one (its forward takes any leading shape)."""
    if type(head) is torch.nn.Linear:
        return True
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    return type(head) is LoraLinear and type(head.get_base_layer()) is torch.nn.Linear


def _logit_transform(base: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``base``'s forward does to ``lm_head``'s output, or ``NotImplementedError`` naming the cause."""
    name = type(base).__name__
    kind = HEADS.get(name)
    if kind is None or type(base) is not getattr(transformers, name, None):  # a subclass may change the head
        raise Refusal(f"chunked_causal_lm_loss does not know the head of {name}: it is exact only for "
                      f"{', '.join(sorted(HEADS))}; use the model's own loss")
    if base.loss_function is not ForCausalLMLoss:
        raise Refusal(f"{name}.loss_function is {getattr(base.loss_function, '__name__', '?')}, not "
                      "transformers' ForCausalLMLoss: the chunked loss would differ; use the model's own")
    head = getattr(base, "lm_head", None)
    if not _accepted_linear(head):
        raise Refusal(f"{name}.lm_head is a {type(head).__name__}: the chunked loss takes an nn.Linear "
                      "or a PEFT LoRA Linear around one; use the model's own loss")
    if kind == "identity":
        return _identity
    if kind == "final_logit_softcapping":
        cap = base.config.final_logit_softcapping
        return _identity if cap is None else functools.partial(_softcap, cap=cap)
    if kind == "logit_scale":
        return functools.partial(_scale, factor=base.logit_scale)
    return functools.partial(_divide, divisor=base.config.logits_scaling)


# The transforms mirror each model's forward operation for operation (same rounding).
def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap


def _scale(logits: torch.Tensor, factor: float) -> torch.Tensor:
    return logits * factor


def _divide(logits: torch.Tensor, divisor: float) -> torch.Tensor:
    return logits / divisor


def check_chunked_loss(model: torch.nn.Module) -> None:
    """Raise ``NotImplementedError`` (naming the model and the cause) unless the chunked loss is exact for it."""
    base = _unwrap(model)
    for module in (model, base):
        # FSDP re-shards the parameters when the root forward returns: the head cannot run after it.
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            raise Refusal(f"{type(base).__name__} is sharded with FSDP: its head's parameters are "
                          "released after the forward; use the model's own loss")
    if getattr(getattr(base, "config", None), "output_router_logits", False):
        raise Refusal(f"{type(base).__name__} adds a MoE router auxiliary loss to its own loss "
                      "(output_router_logits=True), which the chunked loss would drop; use the model's "
                      "own loss")
    _logit_transform(base)


def _chunk_loss(head: torch.nn.Module, transform: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk: ``hidden [c, H]``, ``labels [c]`` -> a scalar (logits ``[c, V]`` inside)."""
    logits = transform(head(hidden)).float()  # the model's own loss upcasts after the head, as here
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """The batch's next-token targets ``[B, L]``: ``shift_labels`` as given, else ``labels`` shifted by one."""
    shift_labels = batch.get("shift_labels")
    if shift_labels is not None:
        return shift_labels
    labels = batch.get("labels")
    if labels is None:
        raise ValueError("the batch has neither shift_labels nor labels: nothing to score")
    ctx = batch.get("cp_context")
    if getattr(ctx, "cp_size", 1) > 1:
        raise ValueError("a context-parallel batch carries labels but no shift_labels: shifting each shard locally "
                         "loses the target at every rank boundary; build batches with hf_blockdiag_cp.PackingCollator")
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def chunked_causal_lm_loss(model: torch.nn.Module, batch: Mapping[str, Any], *,
                           chunk_size: int = DEFAULT_CHUNK_SIZE,
                           num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """The model's causal-LM loss on ``batch``, computed ``chunk_size`` tokens at a time.

    Args:
        model: a causal LM whose head :func:`check_chunked_loss` accepts, possibly inside DDP / PEFT wrappers
            (it is called as a whole, so their forward hooks and gradient synchronisation run).
        batch: the model's keyword arguments (``input_ids [B, L]``, ``position_ids``, ``cp_context``, ...) plus
            the targets: ``shift_labels [B, L]`` (used as given, as the model's loss does; under CP they come from
            the collator's full row) or ``labels [B, L]`` (shifted by one here), -100 = no target.
        chunk_size: tokens (over the flattened ``B * L``) projected onto the vocabulary at once.
        num_items_in_batch: the loss is ``sum / num_items_in_batch``; default: the batch's
            ``num_items_in_batch`` (:func:`~hf_blockdiag_cp.normalize_num_items`' ``N / W`` under a mesh, or the
            Trainer's count); without either, the mean over this batch's targets — all as the model's own loss (under
            CP, refused: it would be each shard's own mean).

    Returns the scalar loss (fp32, or the count's dtype if wider); the model's output logits are not built.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1")
    if "logits_to_keep" in batch:
        raise ValueError("the batch sets logits_to_keep: chunked_causal_lm_loss asks the model for no logits itself")
    check_chunked_loss(model)
    base = _unwrap(model)
    transform = _logit_transform(base)
    if num_items_in_batch is None:
        num_items_in_batch = batch.get("num_items_in_batch")
    check_cp_loss_count({**batch, "num_items_in_batch": num_items_in_batch}, "chunked_causal_lm_loss")
    targets = _targets(batch)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}

    captured: list[torch.Tensor] = []

    def keep_hidden(module: torch.nn.Module, args: tuple, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = base.model.register_forward_hook(keep_hidden)
    try:
        # An empty index: the head projects no position (logits [B, 0, V]); the body runs as in a normal step.
        model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long))
    finally:
        handle.remove()
    if len(captured) != 1:
        raise Refusal(f"{type(base).__name__}'s body ran {len(captured)} times in one forward; the "
                      "chunked loss expects once")
    hidden = captured[0]
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"the targets have shape {tuple(targets.shape)} but the model's hidden states "
                         f"{tuple(hidden.shape[:-1])}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    loss_fn = functools.partial(_chunk_loss, base.lm_head, transform)
    total = None
    for start in range(0, hidden.shape[0], chunk_size):
        part = (hidden[start:start + chunk_size], targets[start:start + chunk_size])
        # Without grad nothing is saved anyway; with it, the chunk's logits are recomputed in the backward.
        chunk = checkpoint(loss_fn, *part, use_reentrant=False) if torch.is_grad_enabled() else loss_fn(*part)
        total = chunk if total is None else total + chunk
    if num_items_in_batch is None:  # ForCausalLMLoss' "mean" reduction
        return total / (targets != IGNORE_INDEX).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
