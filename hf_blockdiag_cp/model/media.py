"""Images and videos under CP, in the model's forward pre-hook: encode this rank's items, exchange the feature rows,
hand them to the model as its encoder outputs.

The collator gave each rank the pixels of the items it encodes (:mod:`hf_blockdiag_cp.planning.media`) and the
context the plan of the exchange. Before the model's forward runs, :func:`encode_and_exchange`

1. calls the model's own ``get_image_features`` / ``get_video_features`` on those pixels (the vision encoder runs
   once per item over the CP group, not once per rank);
2. puts every feature row (qwen3_vl: its deepstack levels side by side) into one buffer and runs ONE all-to-all
   (:func:`~hf_blockdiag_cp.distributed.media.exchange_features`), which brings each rank the rows of the
   placeholder tokens it holds, in their order; backward returns the gradients to the encoding rank;
3. replaces the pixel keys by ``mm_encoder_outputs`` (transformers' keyword for precomputed encoder outputs,
   :data:`~hf_blockdiag_cp.compat.MULTIMODAL_ENCODER_KEYWORD`), whose ``pooler_output`` holds this rank's rows.

The model then scatters the rows into its placeholder tokens exactly as it would its own features.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..compat import MULTIMODAL_ENCODER_KEYWORD, encoder_output_is_sequence
from ..context import BlockDiagCPContext
from ..distributed.exchange import CommStats
from ..distributed.media import MediaExchange, exchange_features
from ..errors import UnsupportedModel
from ..planning.media import IMAGE, VIDEO, item_keys
from ..runtime import step_runtime
from .batch import packing
from .heads import config_int, text_config

__all__ = ["encode_and_exchange", "is_mrope", "media_stats", "refuse_flat_mrope"]

_ENCODERS = {IMAGE: "get_image_features", VIDEO: "get_video_features"}


def _encoder_call(model: torch.nn.Module, kind: str, given: dict[str, Any]) -> Any:
    """The model's ``get_{kind}_features`` output for the pixels in ``given`` (the keys its signature takes)."""
    method = getattr(model, _ENCODERS[kind], None)
    if method is None:
        raise UnsupportedModel(f"{type(model).__name__} has no {_ENCODERS[kind]}: blockdiag_cp cannot encode its "
                               f"{kind}s once per CP rank group")
    params = inspect.signature(method).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in given.items() if k in params or (takes_any and k != "second_per_grid_ts")}
    return method(**args, return_dict=True)


def _rows(parts: Any, width: int) -> torch.Tensor:
    """Feature rows ``[R, width]`` of a ``pooler_output`` (a tensor, or one tensor per item)."""
    if isinstance(parts, torch.Tensor):
        return parts.reshape(-1, width)
    return torch.cat([p.reshape(-1, width) for p in parts]) if len(parts) else None


def _levels(model: torch.nn.Module) -> int:
    """Deepstack feature levels the vision encoder returns besides its output (qwen3_vl: one per index)."""
    vision = getattr(model.config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def encode_and_exchange(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a forward with a CP media plan, with this rank's encoder outputs in place of its pixels."""
    ctx = kwargs.get("cp_context")
    if not isinstance(ctx, BlockDiagCPContext) or ctx.media is None:
        return kwargs
    transfer = ctx.media
    if kwargs.get(MULTIMODAL_ENCODER_KEYWORD) is not None:
        raise ValueError(f"a CP batch with images plans their encoding itself; do not pass "
                         f"{MULTIMODAL_ENCODER_KEYWORD}")
    kwargs = dict(kwargs)
    given = {kind: {k: kwargs.pop(k) for k in item_keys(kind) if kwargs.get(k) is not None} for kind in (IMAGE, VIDEO)}
    config = text_config(model.config)
    width = config_int(config, "hidden_size")
    levels = _levels(model)
    param = next(p for p in model.parameters() if p.is_floating_point())
    encoded, template = [], {}
    for kind in (IMAGE, VIDEO):
        if given[kind]:
            out = _encoder_call(model, kind, given[kind])
            template[kind] = out
            rows = [_rows(out.pooler_output, width)]
            rows += [_rows(level, width) for level in (getattr(out, "deepstack_features", None) or ())]
            encoded.append(torch.cat(rows, dim=1))
    fused_width = width * (1 + levels)
    # One dtype on every rank (the forward agreement checked autocast and the parameters' dtype alike): under autocast
    # the autocast dtype, else the parameters'. An encoder's own output dtype could differ from a rank's that encodes
    # nothing, and an all-to-all between buffers of two dtypes would misread the bytes.
    device_type = param.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else param.dtype
    if encoded:
        buffer = torch.cat(encoded).to(dtype)
    else:  # nothing to encode here: an empty buffer that still takes part in backward's all-to-all
        buffer = torch.zeros(0, fused_width, dtype=dtype, device=param.device, requires_grad=torch.is_grad_enabled())
    if buffer.shape[1] != fused_width:
        raise UnsupportedModel(f"{type(model).__name__}'s encoder gives feature rows of width {buffer.shape[1]}, "
                               f"not the text hidden size {width} x {1 + levels} level(s): blockdiag_cp cannot "
                               "exchange them")
    runtime = step_runtime(ctx)
    ex = MediaExchange(transfer, transfer.send_index.to(buffer.device), ctx.group, runtime.collective_timeout(ctx),
                       runtime.media)
    received = exchange_features(buffer, ex)
    as_sequence = encoder_output_is_sequence(model)
    outputs: dict[str, Any] = {}
    for kind in dict.fromkeys(transfer.kinds):
        local = received.index_select(0, transfer.gather[kind].to(received.device))
        pooled, *deep = local.split(width, dim=1)
        fields = {"pooler_output": (pooled,) if as_sequence else pooled}
        if levels:
            fields["deepstack_features"] = [(d,) if as_sequence else d for d in deep]
        cls = type(template[kind]) if kind in template else _output_class(model, levels)
        outputs[kind] = cls(**fields)
    kwargs[MULTIMODAL_ENCODER_KEYWORD] = outputs
    return kwargs


def _output_class(model: torch.nn.Module, levels: int) -> type:
    """The encoder output class a rank that encoded nothing hands the model (with deepstack levels if needed)."""
    if not levels:
        return BaseModelOutputWithPooling
    module = inspect.getmodule(type(model))
    cls = getattr(module, "BaseModelOutputWithDeepstackFeatures", None)
    if cls is None:
        raise UnsupportedModel(f"{type(model).__name__}: no deepstack encoder output class found in {module}")
    return cls


def media_stats(ctx: BlockDiagCPContext) -> CommStats:
    """Bytes this rank moved through the image / video feature all-to-all of ``ctx``'s step (both directions)."""
    return step_runtime(ctx).media


def is_mrope(model: torch.nn.Module) -> bool:
    """Whether ``model`` places image and video tokens with 3-D rope positions (a module of it has the mrope
    ``get_rope_index``)."""
    return any(hasattr(type(m), "get_rope_index") and hasattr(type(m), "get_vision_position_ids")
               for m in model.modules())


def refuse_flat_mrope(model_type: str, named: dict[str, Any]) -> None:
    """Refuse a packed batch with image / video grids but 1-D ``position_ids`` for an mrope model: its image tokens
    would lose their (t, h, w) positions (the model builds 3-D positions only when it is given none)."""
    positions = named.get("position_ids")
    grids = [k for k in ("image_grid_thw", "video_grid_thw") if named.get(k) is not None]
    if not grids or not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return
    found = packing(named)
    if found is not None:
        raise UnsupportedModel(
            f"{model_type} reads 3-D rope positions (t, h, w) for image and video tokens, but this packed batch "
            f"({found}) has {', '.join(grids)} with 1-D position_ids [B, T]: its image tokens would be placed as text; "
            "build the batch with hf_blockdiag_cp.PackingCollator(..., model_config=model.config), which gives the "
            "per-document [4, B, T] position_ids (text row, then the model's own 3-D positions)")
