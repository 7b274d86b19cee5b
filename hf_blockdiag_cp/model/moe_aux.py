"""The MoE router auxiliary (load-balancing) loss under CP: the whole row's loss, counted once over the CP ranks.

transformers' MoE causal LMs (``output_router_logits=True``) add ``router_aux_loss_coef * aux`` to their loss, with
``aux = load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``: a function of statistics
averaged over *all* tokens of the batch (the fraction of tokens routed to each expert times the mean router
probability). A CP rank holds one shard of the row, so its model computes ``aux`` of its shard's statistics, and
adding it on every rank counts it ``P`` times under the package's convention (losses summed over the CP ranks).

What this module does instead, in the prepared model's post-forward hook, on a CP forward (``cp_size > 1``):

1. all-gather every layer's router logits ``[B * L, E]`` (and the ``attention_mask``, if given) over the CP group
   in one collective and put them back in row order (``ctx.placement.index``): every rank now holds exactly what one
   process on the whole row would hand to the function;
2. call the *model's own* ``load_balancing_loss_func`` on them: ``aux_row``, the value one process gets;
3. count it once over the ranks: this rank's share is ``aux_row / P`` in value, with the gradient of ``aux_row``
   with respect to this rank's logits (the gather's backward keeps this rank's slice, no collective in backward:
   summed over the ranks, the parameter gradients are those of ``aux_row``);
4. replace the shard's term in ``output.loss`` by that share and set ``output.aux_loss`` to it.

So ``sum over CP ranks of loss`` and the summed gradients equal one process on the same row. Padding is treated as
transformers treats it: a token counts unless the forward's ``attention_mask`` says it is padding (the mask is gathered
with the logits); a ``PackingCollator`` batch has no mask, so its row padding counts here as for one process on the row.
 This holds for every
family whose function is the Switch-style one shared by mixtral (checked by comparing the function's bytecode, so a
family whose variant changes is refused, not silently wrong) and whose causal LM passes ``(router_logits,
num_experts, num_experts_per_tok, attention_mask)``; any other model returning an ``aux_loss`` under CP is refused.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as _switch_loss

from ..context import BlockDiagCPContext
from ..distributed.exchange import all_gather_single, check_usable, wait
from ..errors import Refusal
from ..runtime import step_runtime

__all__ = ["exact_router_aux_loss", "router_aux_refusal"]

_WHAT = "blockdiag_cp router-logit gather (MoE auxiliary loss)"
_MODEL_ATTRS = ("num_experts", "num_experts_per_tok")
#: Where the causal LM keeps the loss's coefficient (jetmoe: ``aux_loss_coef``).
_COEF_ATTRS = ("router_aux_loss_coef", "aux_loss_coef")


def _reference_code() -> Any:
    """The bytecode of transformers' Switch-style load-balancing loss (mixtral's)."""
    return _switch_loss.__code__


def _loss_function(model: torch.nn.Module) -> Any:
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def router_aux_refusal(model: torch.nn.Module) -> str | None:
    """Why the router auxiliary loss of ``model`` cannot be made exact under CP (``None``: it can)."""
    fn = _loss_function(model)
    reference = _reference_code()
    missing = [name for name in _MODEL_ATTRS if not hasattr(model, name)]
    if not any(hasattr(model, name) for name in _COEF_ATTRS):
        missing.append("router_aux_loss_coef")
    if fn is None or missing:
        return (f"{type(model).__name__} returns a router auxiliary loss but is not a causal LM calling "
                "load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)")
    code = getattr(fn, "__code__", None)
    if code is None or (code.co_code, code.co_names) != (reference.co_code, reference.co_names):
        return (f"the load_balancing_loss_func of {type(model).__module__} is not the Switch-style loss blockdiag_cp "
                "knows how to compute over the CP group")
    return None


class _GatherRows(torch.autograd.Function):
    """All-gather ``[n]`` flat buffers of every CP rank into ``[P * n]``; backward keeps this rank's slice.

    Every rank computes the same function of the gathered buffer, so the gradient of its own copy with respect to
    its own slice is that slice of the gradient: no collective runs in backward.
    """

    @staticmethod
    def forward(fctx: Any, local: torch.Tensor, group: Any, rank: int, size: int,
                timeout: datetime.timedelta) -> torch.Tensor:
        out = local.new_empty(size * local.numel())
        wait(all_gather_single(out, local.detach().contiguous(), group=group, async_op=True), _WHAT, rank, timeout,
             group=group)
        fctx.rank, fctx.count = rank, local.numel()
        return out

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple:
        start = fctx.rank * fctx.count
        return grad[start:start + fctx.count], None, None, None, None


def _row_order(ctx: BlockDiagCPContext, gathered: torch.Tensor, per_token: int) -> torch.Tensor:
    """``gathered [P, B, L, per_token]`` (rank-major shards) -> ``[B, S, per_token]`` in row order."""
    size, batch, local_len, _ = gathered.shape
    index = ctx.placement.index if ctx.placement is not None else torch.arange(size * local_len).view(size, -1)
    inverse = torch.argsort(index.reshape(-1).to(gathered.device))
    return gathered.permute(1, 0, 2, 3).reshape(batch, size * local_len, per_token)[:, inverse]


def exact_router_aux_loss(model: torch.nn.Module, named: dict[str, Any], output: Any) -> None:
    """Make ``output.loss`` / ``output.aux_loss`` count the whole row's router loss once over the CP ranks (in
    place; see the module docstring). Does nothing outside CP or when the model returned no ``aux_loss``.

    Args:
        model: the prepared causal LM whose forward just returned ``output``.
        named: the forward's arguments by name (``cp_context``, ``attention_mask``).
        output: its ``MoeCausalLMOutputWithPast`` (``router_logits``: per layer ``[B * L, E]``).

    Raises ``NotImplementedError`` (on every rank alike: the models are identical) for a model whose auxiliary loss
    this module cannot reproduce.
    """
    ctx = named.get("cp_context")
    if not isinstance(ctx, BlockDiagCPContext) or ctx.cp_size <= 1:
        return
    aux = getattr(output, "aux_loss", None) if not isinstance(output, tuple) else None
    if aux is None:
        if isinstance(output, tuple) and getattr(getattr(model, "config", None), "output_router_logits", False):
            raise Refusal(
                f"{type(model).__name__} with output_router_logits=True and return_dict=False under CP: blockdiag_cp "
                "cannot make the router auxiliary loss exact on a tuple output; call the model with return_dict=True")
        return
    refusal = router_aux_refusal(model)
    if refusal is not None:
        raise Refusal(
            f"blockdiag_cp cannot compute the MoE router auxiliary loss exactly under CP: {refusal}; each CP rank "
            "would compute it on its own shard's statistics. Set output_router_logits=False (or router_aux_loss_coef "
            "to 0 and compute the loss yourself), or train at CP size 1")
    logits = tuple(output.router_logits)
    experts = int(model.num_experts)
    batch, local_len = ctx.batch_size, ctx.local_len
    if not logits or any(not isinstance(t, torch.Tensor) or t.numel() != batch * local_len * experts for t in logits):
        raise Refusal(
            f"{type(model).__name__}'s router logits are not one [B * L, {experts}] tensor per layer for this shard "
            f"(B={batch}, L={local_len}); blockdiag_cp cannot gather them for the router auxiliary loss")
    check_usable(ctx.group, _WHAT, ctx.cp_rank)
    timeout = step_runtime(ctx).collective_timeout(ctx)
    layers = len(logits)
    local = torch.stack([t.reshape(batch, local_len, experts) for t in logits], dim=-2)  # [B, L, layers, E]
    mask = named.get("attention_mask")
    per_token = layers * experts
    flat = local.reshape(-1)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # padding weights travel in the same collective
        flat = torch.cat([flat, mask.to(local.dtype).reshape(-1)])
    else:
        mask = None
    gathered = _GatherRows.apply(flat, ctx.group, ctx.cp_rank, ctx.cp_size, timeout).view(ctx.cp_size, -1)
    head = batch * local_len * per_token
    rows = _row_order(ctx, gathered[:, :head].reshape(ctx.cp_size, batch, local_len, per_token), per_token)
    full_logits = tuple(rows.view(batch, -1, layers, experts)[:, :, i].reshape(-1, experts) for i in range(layers))
    full_mask = None
    if mask is not None:
        full_mask = _row_order(ctx, gathered[:, head:].reshape(ctx.cp_size, batch, local_len, 1), 1)[..., 0]
        full_mask = full_mask.detach().to(mask.dtype)
    row_aux = _loss_function(model)(full_logits, experts, model.num_experts_per_tok, full_mask)
    share = row_aux.detach() / ctx.cp_size + (row_aux - row_aux.detach())
    loss = getattr(output, "loss", None)
    if loss is not None:  # the model added coef * (this shard's aux): replace that term by this rank's share
        coef = next(getattr(model, name) for name in _COEF_ATTRS if hasattr(model, name))
        output.loss = loss + coef * (share - aux).to(loss.device)
    output.aux_loss = share
