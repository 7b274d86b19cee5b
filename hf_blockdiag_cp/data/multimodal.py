"""Multimodal documents: images and videos in packed rows, read and laid out on the host.

A vision-language document is what the model's processor returns for ONE document: ``input_ids`` with a run of
placeholder tokens per image (video), the images' ``pixel_values`` and, per architecture, their grids
(``image_grid_thw``), sizes or pixel masks, and per-token type ids. This module

- reads those fields into :class:`MediaItem` s (one per image or video, in document order), checking that the
  placeholders and the pixels agree (:func:`read_media`);
- gives mrope models (Qwen2-VL family, Qwen3-VL, Qwen3.5) their per-document 3-D positions from the model's own
  rope-index rule, run on each document alone (:meth:`MediaSpec.document_positions`);
- lays a row's items back out as the model's batch keys (:func:`media_batch`): the items in row order, or the
  items one CP rank encodes (:mod:`hf_blockdiag_cp.planning.media` chooses them).

:class:`MediaSpec` holds what differs per architecture, read from the model's config (:func:`media_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

from ..compat import rope_index_function
from ..errors import Refusal
from ..planning.media import IMAGE, VIDEO, item_keys

__all__ = ["IMAGE", "VIDEO", "MediaItem", "MediaSpec", "RowMedia", "item_keys", "media_batch", "media_spec",
           "read_media", "row_media"]

#: The grid key of each kind (Qwen family): an item's rows of its patch tensor are ``prod(grid)``.
_GRID_KEY = {IMAGE: "image_grid_thw", VIDEO: "video_grid_thw"}
_PIXEL_KEY = {IMAGE: "pixel_values", VIDEO: "pixel_values_videos"}
#: Architectures whose item -> feature-rows rule the tests check under CP (tests/multimodal/test_vlm_packed.py).
CHECKED_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "idefics3", "smolvlm", "mistral3",
                           "internvl", "gemma3", "paligemma"})
#: Per-token type keys the models read (Qwen: mm_token_type_ids; gemma3 / paligemma: token_type_ids).
TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One image or video of a document.

    Attributes:
        kind: :data:`IMAGE` or :data:`VIDEO`.
        rows: the feature rows the encoder gives it, i.e. the placeholder tokens it fills in the text.
        fields: its slice of each per-item batch key (``pixel_values`` rows or entries, its grid ``[3]`` as
            ``[1, 3]``, ...), CPU tensors, ready to be concatenated along dim 0.
        work: a proxy of its encoder cost (patch rows), for assigning items to CP ranks.
    """

    kind: str
    rows: int
    fields: dict[str, torch.Tensor]
    work: int


@dataclass(frozen=True, eq=False)
class MediaSpec:
    """What a vision-language architecture needs from the collator, read once from its config.

    Attributes:
        model_type: ``config.model_type`` (for messages).
        token_ids: placeholder token id per kind (only the kinds the model has).
        merge: the vision encoder's spatial merge factor (Qwen family: grid rows per feature row is
            ``merge ** 2``); ``None`` when items have no grid.
        rope_index: the model's ``get_rope_index`` rule as a function, for mrope models; else ``None``.
        token_type_key: the per-token type key the model's forward reads (``None``: none).
        five_d: ``pixel_values`` is laid out ``[1, N, C, H, W]`` (idefics3 / smolvlm) rather than ``[N, ...]``.
        size_step: images of varying size (mistral3): an image of ``image_sizes`` ``(h, w)`` gives
            ``(h // size_step) * (w // size_step)`` feature rows (``None``: not this rule).
        blocks: which tokens attend each other both ways, from the per-token types: ``"ones"`` (gemma3: each run of
            type 1, an image's soft tokens), ``"prefix"`` (paligemma: the type-0 prefix, images and prompt), or
            ``None`` (plain causal).
        checked: the architecture's positions and item -> feature-rows rules are ones the tests check
            (:data:`CHECKED_TYPES`); another architecture's images are refused (its packed images could get other
            positions, or under CP features on the wrong tokens), its text-only documents are served.

    Items are the units the vision encoder takes one at a time: an image, a video, or a tile of a tiled image
    (idefics3, smolvlm, internvl: each tile has its own placeholder run and feature rows).
    """

    model_type: str
    token_ids: dict[str, int]
    merge: int | None = None
    rope_index: Any = None
    token_type_key: str | None = None
    five_d: bool = False
    size_step: int | None = None
    blocks: str | None = None
    checked: bool = False

    @property
    def mrope(self) -> bool:
        return self.rope_index is not None

    def item_rows(self, kind: str, grid: torch.Tensor | None, placeholders: int, count: int,
                  sizes: torch.Tensor | None = None) -> list[int]:
        """Feature rows of each of ``count`` items of ``kind``: from their grids or sizes, else an equal share of the
        document's ``placeholders`` (architectures whose images all give the same number of rows)."""
        if grid is not None and self.merge:
            return [int(torch.prod(g)) // (self.merge ** 2) for g in grid]
        if sizes is not None and self.size_step:
            return [(int(h) // self.size_step) * (int(w) // self.size_step) for h, w in sizes.reshape(-1, 2).tolist()]
        if count == 0:
            return []
        return [placeholders // count] * count

    def document_positions(self, input_ids: torch.Tensor, token_types: torch.Tensor,
                           items: Sequence[MediaItem]) -> torch.Tensor:
        """``[3, n]`` mrope positions of one document run alone (the model's own rule), ``input_ids [n]``."""
        grids = {kind: [it.fields[_GRID_KEY[kind]] for it in items if it.kind == kind] for kind in (IMAGE, VIDEO)}
        kwargs = {f"{kind}_grid_thw": torch.cat(g) if g else None for kind, g in grids.items()}
        seconds = [it.fields["second_per_grid_ts"] for it in items if "second_per_grid_ts" in it.fields]
        if seconds:
            kwargs["second_per_grid_ts"] = torch.cat(seconds)
        positions, _ = self.rope_index(input_ids[None], mm_token_type_ids=token_types[None], **kwargs)
        return positions[:, 0].to(torch.int64)


def media_spec(model_or_config: Any) -> MediaSpec | None:
    """The :class:`MediaSpec` of a vision-language model or config, ``None`` for a text-only one."""
    config = getattr(model_or_config, "config", model_or_config)
    if config is None or getattr(config, "vision_config", None) is None:
        return None
    token_ids = {}
    for kind, names in ((IMAGE, ("image_token_id", "image_token_index")), (VIDEO, ("video_token_id",))):
        value = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
        if value is not None:
            token_ids[kind] = value
    if not token_ids:
        return None
    model_type = getattr(config, "model_type", type(config).__name__)
    class_name = MODEL_MAPPING_NAMES.get(model_type)
    rope_index = rope_index_function(config, getattr(transformers, class_name, None) if class_name else None)
    merge = getattr(config.vision_config, "spatial_merge_size", None) if rope_index is not None else None
    token_type_key = "mm_token_type_ids" if rope_index is not None else (
        "token_type_ids" if model_type in ("gemma3", "paligemma") else None)
    size_step = None
    if model_type in ("mistral3", "pixtral", "lighton_ocr"):
        size_step = config.vision_config.patch_size * getattr(config, "spatial_merge_size", 1)
    blocks = {"gemma3": "ones", "paligemma": "prefix"}.get(model_type)
    return MediaSpec(model_type, token_ids, merge, rope_index, token_type_key,
                     five_d=model_type in ("idefics3", "smolvlm", "idefics2"), size_step=size_step, blocks=blocks,
                     checked=model_type in CHECKED_TYPES)


def _tensor(value: Any, where: str) -> torch.Tensor:
    try:
        return torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{where} must be a tensor or nested list of numbers: {err}") from err


def read_media(example: Mapping[str, Any], input_ids: torch.Tensor, spec: MediaSpec | None, *,
               index: int) -> tuple[tuple[MediaItem, ...], torch.Tensor | None, torch.Tensor | None]:
    """The images / videos of one example, its per-token type ids and (mrope models) its ``[3, n]`` positions.

    Raises ``ValueError`` naming ``example {index}`` when pixels come without placeholders, placeholders without
    pixels, a placeholder count that does not match the items' grids, or media for a model without a spec.
    """
    kinds_given = [kind for kind in (IMAGE, VIDEO) if example.get(_PIXEL_KEY[kind]) is not None]
    if spec is None:
        if kinds_given:
            raise ValueError(f"example {index}: has {_PIXEL_KEY[kinds_given[0]]} but the collator knows no vision "
                             "model: pass model_config=model.config to PackingCollator (and to PackedDataset, "
                             "when rows come from one) so that it knows the placeholder tokens and the position rule")
        return (), None, None
    items: list[MediaItem] = []
    for kind in (IMAGE, VIDEO):
        token = spec.token_ids.get(kind)
        placeholders = int((input_ids == token).sum()) if token is not None else 0
        pixels = example.get(_PIXEL_KEY[kind])
        if pixels is None:
            if placeholders:
                raise ValueError(f"example {index}: input_ids hold {placeholders} {kind} placeholder token(s) "
                                 f"(id {token}) but the example has no {_PIXEL_KEY[kind]}")
            continue
        if token is None:
            raise ValueError(f"example {index}: has {_PIXEL_KEY[kind]} but {spec.model_type} has no {kind} token")
        if not spec.checked:
            raise Refusal(f"example {index}: {spec.model_type} documents with {kind}s: blockdiag_cp gives each packed "
                          "document its own positions and each image its feature rows by rules checked for "
                          f"{', '.join(sorted(CHECKED_TYPES))} only; another architecture's packed images could get "
                          "other positions or features than the document alone (its text-only documents are served)")
        if not placeholders:
            raise ValueError(f"example {index}: has {_PIXEL_KEY[kind]} but its input_ids hold no {kind} "
                             f"placeholder token (id {token}); did the processor's text go through the tokenizer "
                             "without the images?")
        items.extend(_split_items(example, kind, spec, placeholders, index))
        rows = sum(it.rows for it in items if it.kind == kind)
        if rows != placeholders:
            raise ValueError(f"example {index}: its {kind}s give {rows} feature rows (from their "
                             f"{_GRID_KEY[kind] if spec.merge else 'count'}) but input_ids hold {placeholders} "
                             f"{kind} placeholder tokens; the text and the {kind}s do not match")
    token_types = None
    if spec.token_type_key is not None:
        given = example.get(spec.token_type_key)
        if given is not None:
            token_types = _tensor(given, f"example {index}: {spec.token_type_key}").reshape(-1).to(torch.int64)
            if token_types.numel() != input_ids.numel():
                raise ValueError(f"example {index}: {spec.token_type_key} has {token_types.numel()} entries but "
                                 f"input_ids has {input_ids.numel()}")
        elif spec.mrope:
            token_types = torch.zeros_like(input_ids)
            for kind, value in ((IMAGE, 1), (VIDEO, 2)):
                if kind in spec.token_ids:
                    token_types.masked_fill_(input_ids == spec.token_ids[kind], value)
    positions = None
    if spec.mrope and items:
        positions = spec.document_positions(input_ids, token_types, items)
    return tuple(items), token_types, positions


def _split_items(example: Mapping[str, Any], kind: str, spec: MediaSpec, placeholders: int,
                 index: int) -> list[MediaItem]:
    """One example's ``kind`` items: its per-item keys cut into one slice per item."""
    keys = [k for k in item_keys(kind) if example.get(k) is not None]
    values = {k: _tensor(example[k], f"example {index}: {k}") for k in keys}
    pixels = values[_PIXEL_KEY[kind]]
    if spec.five_d and pixels.dim() == 5:  # [1, N, C, H, W]: one document's images
        values = {k: v[0] if v.dim() >= 2 and k in ("pixel_values", "pixel_attention_mask") else v
                  for k, v in values.items()}
        pixels = values[_PIXEL_KEY[kind]]
    if spec.five_d and pixels.dim() == 4 and pixels.shape[0]:
        blank = torch.nonzero(pixels.reshape(pixels.shape[0], -1).eq(0).all(dim=1)).flatten()
        if blank.numel():  # the model takes an all-zero tile for padding and gives it no features
            raise ValueError(f"example {index}: tile {int(blank[0])} of its pixel_values is all zeros, which "
                             f"{spec.model_type} drops as padding (its placeholders would get no features); "
                             "remove the tile and its placeholders, or give it non-zero pixels")
    grid_key = _GRID_KEY[kind]
    grid = values.get(grid_key)
    if grid is not None:
        grid = grid.reshape(-1, 3).to(torch.int64)
        values[grid_key] = grid
        count = grid.shape[0]
        patch_rows = [int(torch.prod(g)) for g in grid]
        if sum(patch_rows) != pixels.shape[0]:
            raise ValueError(f"example {index}: {_PIXEL_KEY[kind]} has {pixels.shape[0]} patch rows but its "
                             f"{grid_key} gives {sum(patch_rows)}")
    else:
        count = pixels.shape[0]
        patch_rows = [int(pixels[0].numel())] * count
    rows = spec.item_rows(kind, grid, placeholders, count, values.get("image_sizes") if kind == IMAGE else None)
    items = []
    start = 0
    for i in range(count):
        fields = {}
        for k, v in values.items():
            if k == _PIXEL_KEY[kind] and grid is not None:
                fields[k] = v[start:start + patch_rows[i]]
            elif v.dim() == 0:
                fields[k] = v.reshape(1)
            else:
                if v.shape[0] != count:
                    raise ValueError(f"example {index}: {k} has {v.shape[0]} entries for {count} {kind}s")
                fields[k] = v[i:i + 1]
        start += patch_rows[i]
        items.append(MediaItem(kind, rows[i], fields, patch_rows[i]))
    return items


def _padded(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` zero-padded at the end of every dim but the first to their largest sizes (images of different sizes
    in one batch tensor, as the processors pad them: mistral3's ``image_sizes`` keeps each size)."""
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    if all(list(p.shape[1:]) == shape for p in parts):
        return parts
    out = []
    for p in parts:
        pad = []
        for d in reversed(range(1, p.dim())):
            pad += [0, shape[d - 1] - p.shape[d]]
        out.append(torch.nn.functional.pad(p, pad))
    return out


def media_batch(items: Sequence[MediaItem], spec: MediaSpec) -> dict[str, torch.Tensor]:
    """The batch keys of ``items`` (in the given order): each per-item key concatenated along dim 0
    (``pixel_values`` of a five-dimensional architecture as ``[1, N, ...]``). Empty for no items."""
    out: dict[str, torch.Tensor] = {}
    for kind in (IMAGE, VIDEO):
        chosen = [it for it in items if it.kind == kind]
        if not chosen:
            continue
        for key in item_keys(kind):
            parts = [it.fields[key] for it in chosen if key in it.fields]
            if not parts:
                continue
            if len(parts) != len(chosen):
                raise ValueError(f"{key} is given for some {kind}s of the row and not for others")
            value = torch.cat(_padded(parts), dim=0)
            if spec.five_d and key in ("pixel_values", "pixel_attention_mask"):
                value = value[None]
            out[key] = value
    return out


@dataclass(frozen=True, eq=False)
class RowMedia:
    """The multimodal part of full packed rows (identical on every CP rank).

    Attributes:
        items: every image / video of the rows, in row order (row by row, document by document).
        positions: ``[3, B, S]`` int64 mrope positions (each document's own, 0 at padding), or ``None``.
        token_types: ``[B, S]`` int64 per-token type ids (0 for text and padding), or ``None``.
        spec: the model's :class:`MediaSpec`.
        block_ids: ``[B, S]`` int64 bidirectional blocks (0: causal token, ``k > 0``: block ``k``, inside one
            document) for :meth:`~hf_blockdiag_cp.BlockDiagCPContext.build`, or ``None``.
    """

    items: tuple[MediaItem, ...]
    positions: torch.Tensor | None
    token_types: torch.Tensor | None
    spec: MediaSpec
    block_ids: torch.Tensor | None = None

    def ordered(self) -> list[MediaItem]:
        """The items images first, then videos (row order within a kind): the order of the model's feature rows."""
        return [it for kind in (IMAGE, VIDEO) for it in self.items if it.kind == kind]

    def placeholder_positions(self, input_ids: torch.Tensor) -> dict[str, np.ndarray]:
        """Per kind present, the ascending row positions of its placeholder tokens in ``input_ids [1, S]``."""
        kinds = dict.fromkeys(it.kind for it in self.items)
        return {k: torch.nonzero(input_ids[0] == self.spec.token_ids[k]).flatten().numpy() for k in kinds}


def row_media(rows: Sequence[Sequence[Any]], length: int, text_positions: torch.Tensor,
              spec: MediaSpec | None) -> RowMedia | None:
    """The :class:`RowMedia` of ``rows`` (documents per row) laid out like :func:`~.rows.assemble_rows`,
    ``text_positions [B, S]`` being the rows' 1-D positions; ``None`` when no document carries media or types."""
    docs = [d for row in rows for d in row]
    if not any(d.media or d.token_types is not None for d in docs):
        return None
    if spec is None:
        raise ValueError("the rows hold documents with images or videos but the collator knows no vision model: pass "
                         "model_config=model.config to PackingCollator (the same model as the PackedDataset's)")
    batch = len(rows)
    positions = None
    if spec.mrope:
        positions = text_positions[None].expand(3, -1, -1).clone()
    token_types = torch.zeros((batch, length), dtype=torch.int64) if spec.token_type_key is not None else None
    block_ids = torch.zeros((batch, length), dtype=torch.int64) if spec.blocks is not None else None
    next_block = 1
    for b, row in enumerate(rows):
        start = 0
        for d in row:
            n = len(d)
            if positions is not None and d.mrope is not None:
                positions[:, b, start:start + n] = d.mrope
            if token_types is not None and d.token_types is not None:
                token_types[b, start:start + n] = d.token_types
            if block_ids is not None:
                next_block = _document_blocks(d, spec, block_ids[b, start:start + n], next_block)
            start += n
    return RowMedia(tuple(it for d in docs for it in d.media), positions, token_types, spec, block_ids)


def _document_blocks(doc: Any, spec: MediaSpec, out: torch.Tensor, first: int) -> int:
    """Write ``doc``'s bidirectional blocks into ``out [n]`` (ids from ``first``); returns the next free id."""
    if doc.token_types is None:
        if spec.blocks == "prefix":
            raise ValueError(f"example {doc.index}: {spec.model_type} attends its prefix both ways, but the example "
                             f"has no {spec.token_type_key} to say where the prefix ends; pass the processor's "
                             f"{spec.token_type_key}")
        return first
    member = doc.token_types == 1 if spec.blocks == "ones" else doc.token_types == 0
    if spec.blocks == "prefix" and member.any():
        size = int(member.sum())
        if not bool(member[:size].all()):
            raise ValueError(f"example {doc.index}: {spec.model_type}'s {spec.token_type_key} mark a prefix (0) that "
                             "is not one run at the start of the document; blockdiag_cp serves prefix-then-suffix")
    starts = member & ~torch.cat([torch.zeros(1, dtype=torch.bool), member[:-1]])
    ids = torch.cumsum(starts.to(torch.int64), 0) + (first - 1)
    out.copy_(torch.where(member, ids, torch.zeros_like(ids)))
    return first + int(starts.sum())
