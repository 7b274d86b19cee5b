"""Vision-language fixtures and the independent reference of issue 32: tiny image-text-to-text models, synthetic
documents laid out as each architecture's processor writes them, and every document run alone through the stock model.

Processor layouts (one document, ``input_ids`` 1-D; ``N`` = the image's feature rows = its placeholder tokens):

- **qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5**: ``<|vision_start|> <|image_pad|>*N <|vision_end|>``;
  ``pixel_values [sum_i t*h*w, C*temporal_patch*patch*patch]`` (patch rows of all images, image after image),
  ``image_grid_thw [n_img, 3]`` (in patches), ``N = t*h*w / merge**2``; ``mm_token_type_ids [L]`` is 1 on the
  ``<|image_pad|>`` tokens only (M-RoPE positions are computed from it). qwen3_vl also returns ``deepstack_features``
  (per ``deepstack_visual_indexes`` entry, per image ``[N, hidden]``) added to the first text layers at the same rows.
- **llava**: ``<image>*N``, no delimiters (two adjacent images form one run); ``pixel_values [n_img, C, H, W]``;
  ``N = (H/patch)*(W/patch)`` (+1 with the ``full`` feature strategy).
- **idefics3, smolvlm**: an image is split into ``rows x cols`` tiles plus one global tile (or only the global
  tile): per tile ``<fake_token_around_image> <row_r_col_c> <image>*S``, ``\\n`` after each tile row, then
  ``\\n <fake_token_around_image> <global-img> <image>*S <fake_token_around_image>``; ``pixel_values`` is 5-D
  ``[1, n_tiles, C, H, W]`` (tiles of all images, crops before the global tile) with ``pixel_attention_mask
  [1, n_tiles, H, W]`` (the documents here store both without the leading 1: ``MediaLayout.batched``);
  ``S = (image_size/patch)**2 / scale_factor**2``, ``N = S * n_tiles(image)``.
- **mistral3** (Pixtral processor): per row of merged patches ``[IMG]*w [IMG_BREAK]``, the last break replaced by
  ``[IMG_END]``; ``pixel_values [n_img, C, Hmax, Wmax]`` padded to the largest image, ``image_sizes [n_img, 2]``;
  ``N = (H/patch/merge) * (W/patch/merge)`` (only ``[IMG]`` tokens take features).
- **internvl**: ``<img> <IMG_CONTEXT>*(S*n_tiles) </img>``; ``pixel_values [n_tiles_total, C, H, W]`` (crops then
  a thumbnail when split); ``S = (image_size/patch)**2 * downsample_ratio**2``.
- **gemma3**: ``\\n\\n <start_of_image> <image_soft_token>*mm_tokens_per_image <end_of_image> \\n\\n``;
  ``pixel_values [n_img, C, H, W]``; ``token_type_ids [L]`` is 1 on the soft tokens (bidirectional image blocks).
- **paligemma**: ``<image>*num_image_tokens`` for every image first, then ``<bos> prompt \\n`` and the suffix
  ``+ <eos>``; ``token_type_ids [L]`` is 0 on the prefix (images and prompt: bidirectional) and 1 on the suffix;
  ``labels`` are -100 on the prefix.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig

from ..errors import Refusal
from .configs import shrink_overrides

__all__ = ["IDS", "MEDIA_KEYS", "VLM_TYPES", "AloneResult", "MediaLayout", "build_vlm", "compare", "concat_media",
           "document_loss", "documents_alone", "feature_rows", "image_spans", "make_stateful", "model_inputs",
           "num_images", "rows_per_image", "split_images", "synthetic_documents", "tiny_vlm_config"]

VLM_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "idefics3", "smolvlm",
                              "mistral3", "internvl", "gemma3", "paligemma")
_QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
_TILED = ("idefics3", "smolvlm")

#: Token ids of the tiny vocabulary (256): text draws from ``[3, TEXT_END)``, specials sit above.
IDS: dict[str, int] = {"pad": 0, "bos": 1, "eos": 2, "text_end": 230, "row_col": 232, "newline": 248,
                       "global": 249, "image": 250, "video": 251, "start": 252, "end": 253, "break": 254}


@dataclass(frozen=True)
class MediaLayout:
    """Which keys of a document belong to its images and which to its tokens.

    ``per_image``: ``{key: unit}``, the key's first dim (after the batch dim of ``batched`` keys) indexes images
    (``"image"``), tiles (``"tile"``: an image covers several consecutive tiles) or patch rows (``"patch_rows"``: image
    ``i`` covers ``t*h*w`` rows); ``per_token``: keys shaped ``[L]`` like ``input_ids``; ``batched``: keys the model
    wants with a leading batch dim of 1 (idefics3's 5-D ``pixel_values``; documents store them without it);
    ``placeholder``: the token id the image features replace; ``text_tokens``: the names (in :data:`IDS`) of the
    delimiter tokens the processor writes around images (ordinary text tokens to the model).
    """

    per_image: dict[str, str]
    per_token: tuple[str, ...]
    batched: tuple[str, ...] = ()
    placeholder: int = IDS["image"]
    text_tokens: tuple[str, ...] = ()


_QWEN_LAYOUT = MediaLayout({"pixel_values": "patch_rows", "image_grid_thw": "image"},
                           ("input_ids", "labels", "mm_token_type_ids"), text_tokens=("start", "end"))
_TILED_LAYOUT = MediaLayout({"pixel_values": "tile", "pixel_attention_mask": "tile"}, ("input_ids", "labels"),
                            batched=("pixel_values", "pixel_attention_mask"),
                            text_tokens=("start", "row_col", "newline", "global"))
#: Per architecture: the document keys of images and of tokens (see :class:`MediaLayout`).
MEDIA_KEYS: dict[str, MediaLayout] = {
    **{t: _QWEN_LAYOUT for t in _QWEN},
    "llava": MediaLayout({"pixel_values": "image"}, ("input_ids", "labels")),
    **{t: _TILED_LAYOUT for t in _TILED},
    "mistral3": MediaLayout({"pixel_values": "image", "image_sizes": "image"}, ("input_ids", "labels"),
                            text_tokens=("break", "end")),
    "internvl": MediaLayout({"pixel_values": "tile"}, ("input_ids", "labels"), text_tokens=("start", "end")),
    "gemma3": MediaLayout({"pixel_values": "image"}, ("input_ids", "labels", "token_type_ids"),
                          text_tokens=("newline", "start", "end")),
    "paligemma": MediaLayout({"pixel_values": "image"}, ("input_ids", "labels", "token_type_ids"),
                             text_tokens=("bos", "newline", "eos")),
}

# Vision towers: 1-2 layers, hidden 32, images giving 4-16 placeholder tokens.
_QWEN_VISION = dict(depth=1, hidden_size=64, embed_dim=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                    patch_size=2, temporal_patch_size=2, spatial_merge_size=2, mlp_ratio=2)
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
               patch_size=4)
_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": _QWEN_VISION,
    "qwen2_5_vl": {**_QWEN_VISION, "hidden_size": 32, "depth": 2, "fullatt_block_indexes": [1], "window_size": 8},
    "qwen3_vl": {**_QWEN_VISION, "hidden_size": 32, "depth": 2, "deepstack_visual_indexes": [0],
                 "num_position_embeddings": 16},
    "qwen3_5": {**_QWEN_VISION, "hidden_size": 32, "num_position_embeddings": 16},
    "llava": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=12,
                  patch_size=4, projection_dim=32),
    "idefics3": _SIGLIP,
    "smolvlm": _SIGLIP,
    "mistral3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                     image_size=16, patch_size=2),
    "internvl": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     image_size=[8, 8], patch_size=[2, 2]),
    "gemma3": _SIGLIP,
    "paligemma": {**_SIGLIP, "projection_dim": 64},
}
_MROPE = {"qwen2_vl": [2, 3, 3], "qwen2_5_vl": [2, 3, 3], "qwen3_vl": [4, 2, 2], "qwen3_5": [2, 1, 1]}
_TOP: dict[str, dict[str, Any]] = {
    **{t: dict(image_token_id=IDS["image"], video_token_id=IDS["video"], vision_start_token_id=IDS["start"],
               vision_end_token_id=IDS["end"]) for t in _QWEN},
    "llava": dict(image_token_index=IDS["image"], image_seq_length=9),
    "idefics3": dict(image_token_id=IDS["image"], scale_factor=2),
    "smolvlm": dict(image_token_id=IDS["image"], scale_factor=2),
    "mistral3": dict(image_token_index=IDS["image"], spatial_merge_size=2),
    "internvl": dict(image_token_id=IDS["image"], image_seq_length=4),
    "gemma3": dict(image_token_index=IDS["image"], boi_token_index=IDS["start"], eoi_token_index=IDS["end"],
                   mm_tokens_per_image=4),
    "paligemma": dict(image_token_index=IDS["image"], vocab_size=256, projection_dim=64, hidden_size=64),
}


def tiny_vlm_config(model_type: str, *, seed: int = 0) -> PretrainedConfig:
    """A tiny fp32 config of an image-text-to-text ``model_type`` in :data:`VLM_TYPES` (text: hidden 64, two layers
    covering every layer type, 4 heads / 2 kv heads, vocabulary 256 with the ids of :data:`IDS`; vision: 1-2 layers,
    hidden 32, images of 4-16 placeholder tokens). ``seed`` is recorded for :func:`build_vlm`."""
    if model_type not in VLM_TYPES:
        raise Refusal(f"model_type={model_type!r} is not a covered VLM type; covered: {VLM_TYPES}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoConfig.for_model(model_type)
        text = base.text_config.to_dict()
        overrides = {k: v for k, v in shrink_overrides(text).items() if not k.endswith(("_token_id", "_token_index"))}
        text.update(overrides, vocab_size=256, num_key_value_heads=2, pad_token_id=IDS["pad"], bos_token_id=IDS["bos"],
                    eos_token_id=IDS["eos"], max_position_embeddings=512)
        if model_type in _MROPE:
            rope = dict(text.get("rope_parameters") or {})
            text["rope_parameters"] = {**rope, "mrope_section": _MROPE[model_type]}
        if model_type == "qwen3_5":
            text["head_dim"] = 32  # partial rotary 0.25 of 32 = 8 rotary dims: mrope [2, 1, 1] covers T, H and W
        if model_type == "paligemma":
            text["num_image_tokens"] = 16
        vision = {**base.vision_config.to_dict(), **_VISION[model_type]}
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **_TOP[model_type])
    config.dtype = torch.float32
    config.blockdiag_seed = seed
    return config


def build_vlm(config: PretrainedConfig, attn_implementation: Any = "sdpa", *, seed: int | None = None
              ) -> torch.nn.Module:
    """The stock image-text-to-text model of ``config`` (a deep copy: configs are shared by models), seeded random
    weights (matrices the model initialises to zero drawn at std 0.1), fp32, eval mode. ``attn_implementation``: a
    name or a per-sub-config dict."""
    torch.manual_seed(getattr(config, "blockdiag_seed", 0) if seed is None else seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                                        dtype=torch.float32)
    with torch.no_grad():  # zero-initialised matrices (gemma3's projector, internvl's positions) would hide images
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(std=0.1)
    return model.float().eval()


def make_stateful(model: torch.nn.Module, a_log: float = -4.0) -> int:
    """Give gated-delta-rule layers (Qwen3.5's ``linear_attention``) a slow decay (``A_log = a_log``: ~0.97 per token)
    so their state survives many tokens; tiny random configs forget it after one token. Returns the layers changed."""
    changed = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(a_log)
                changed += 1
    return changed


def _image_geometry(model_type: str, config: PretrainedConfig, gen: torch.Generator) -> dict[str, Any]:
    """One random image's geometry: the unit counts the document layout needs."""
    pick = int(torch.randint(0, 2, (), generator=gen))
    if model_type in _QWEN:
        return {"grid": (1, 4, 4) if pick else (1, 4, 6)}  # 4 or 6 placeholder tokens
    if model_type in _TILED:
        return {"split": (0, 0) if pick else (1, 2)}  # only the global tile, or 1x2 crops + global
    if model_type == "mistral3":
        return {"size": (8, 12) if pick else (12, 16)}  # 2x3 or 3x4 merged patches
    if model_type == "internvl":
        return {"tiles": 1 if pick else 3}  # 2 crops + thumbnail
    return {}


def _tokens_per_tile(model_type: str, config: PretrainedConfig) -> int:
    vision = config.vision_config
    if model_type in _TILED:
        return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2
    return config.image_seq_length  # internvl


def _image_tokens(model_type: str, config: PretrainedConfig, geo: dict[str, Any]) -> list[int]:
    """The token ids the processor writes for one image."""
    img, start, end = IDS["image"], IDS["start"], IDS["end"]
    if model_type in _QWEN:
        t, h, w = geo["grid"]
        return [start] + [img] * (t * h * w // config.vision_config.spatial_merge_size ** 2) + [end]
    if model_type == "llava":
        return [img] * _llava_rows(config, config.vision_config.image_size, config.vision_config.image_size)
    if model_type in _TILED:
        seq, (rows, cols) = _tokens_per_tile(model_type, config), geo["split"]
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += [start, IDS["row_col"] + 4 * r + c] + [img] * seq
            out.append(IDS["newline"])
        return out + ([IDS["newline"]] if rows else []) + [start, IDS["global"]] + [img] * seq + [start]
    if model_type == "mistral3":
        h, w = (s // (config.vision_config.patch_size * config.spatial_merge_size) for s in geo["size"])
        out = ([img] * w + [IDS["break"]]) * h
        return out[:-1] + [IDS["end"]]
    if model_type == "internvl":
        return [start] + [img] * (config.image_seq_length * geo["tiles"]) + [end]
    if model_type == "gemma3":
        return [IDS["newline"], start] + [img] * config.mm_tokens_per_image + [end, IDS["newline"]]
    return [img] * config.text_config.num_image_tokens  # paligemma


def _llava_rows(config: PretrainedConfig, height: int, width: int) -> int:
    patch = config.vision_config.patch_size
    return (height // patch) * (width // patch) + (config.vision_feature_select_strategy == "full")


def _pixels(model_type: str, config: PretrainedConfig, geos: list[dict[str, Any]], gen: torch.Generator
            ) -> dict[str, torch.Tensor]:
    """The per-image keys of a document's images (see :data:`MEDIA_KEYS`)."""
    vision = config.vision_config
    if model_type in _QWEN:
        row = 3 * vision.temporal_patch_size * vision.patch_size ** 2
        grids = torch.tensor([g["grid"] for g in geos])
        return {"pixel_values": torch.randn(int(grids.prod(-1).sum()), row, generator=gen), "image_grid_thw": grids}
    if model_type in _TILED:
        tiles = sum(g["split"][0] * g["split"][1] + 1 for g in geos)
        size = vision.image_size
        return {"pixel_values": torch.randn(tiles, 3, size, size, generator=gen),
                "pixel_attention_mask": torch.ones(tiles, size, size, dtype=torch.bool)}
    if model_type == "mistral3":
        sizes = torch.tensor([g["size"] for g in geos])
        pixels = torch.zeros(len(geos), 3, int(sizes[:, 0].max()), int(sizes[:, 1].max()))
        for i, (h, w) in enumerate(sizes.tolist()):  # the processor pads every image to the largest one with zeros
            pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=gen)
        return {"pixel_values": pixels, "image_sizes": sizes}
    if model_type == "internvl":
        size = vision.image_size[0]
        return {"pixel_values": torch.randn(sum(g["tiles"] for g in geos), 3, size, size, generator=gen)}
    size = vision.image_size
    return {"pixel_values": torch.randn(len(geos), 3, size, size, generator=gen)}


def synthetic_documents(config: PretrainedConfig, *, num_docs: int, seed: int, images: tuple[int, ...] = (0, 1, 2),
                        text_len: tuple[int, int] = (4, 20), labels: bool = True) -> list[dict[str, Any]]:
    """``num_docs`` random documents of ``config``'s architecture, each a dict as its processor returns ONE document:
    ``input_ids [L]`` (int64) with the image placeholder runs and delimiters, per-token keys ``[L]``, the per-image
    keys of :data:`MEDIA_KEYS` (absent with 0 images), ``labels [L]`` (-100 on placeholders; paligemma: on the
    prefix) unless ``labels=False``. The document's image count is drawn from ``images``, text runs from
    ``text_len`` (inclusive)."""
    model_type = config.model_type
    gen = torch.Generator().manual_seed(seed)
    lo, hi = text_len

    def text() -> list[int]:
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        return torch.randint(3, IDS["text_end"], (n,), generator=gen).tolist()

    docs = []
    for _ in range(num_docs):
        n_img = images[int(torch.randint(0, len(images), (), generator=gen))]
        geos = [_image_geometry(model_type, config, gen) for _ in range(n_img)]
        if model_type == "paligemma":
            prefix = [t for g in geos for t in _image_tokens(model_type, config, g)] + [IDS["bos"]] + text()
            prefix.append(IDS["newline"])
            suffix = text() + [IDS["eos"]]
            ids = prefix + suffix
            types = [0] * len(prefix) + [1] * len(suffix)
        else:
            ids = text()
            for g in geos:
                ids += _image_tokens(model_type, config, g) + text()
        doc: dict[str, Any] = {"input_ids": torch.tensor(ids)}
        is_image = doc["input_ids"] == IDS["image"]
        if model_type in _QWEN:
            doc["mm_token_type_ids"] = is_image.long()
        elif model_type == "gemma3":
            doc["token_type_ids"] = is_image.long()
        elif model_type == "paligemma":
            doc["token_type_ids"] = torch.tensor(types)
        if labels:
            mask = doc["token_type_ids"] == 0 if model_type == "paligemma" else is_image
            doc["labels"] = doc["input_ids"].masked_fill(mask, -100)
        if geos:
            doc.update(_pixels(model_type, config, geos, gen))
        docs.append(doc)
    return docs


def image_spans(config: PretrainedConfig, doc: dict[str, Any], unit: str = "image") -> list[tuple[int, int]]:
    """Per image of ``doc``: ``(first, end)`` along the first dim of its per-image keys of ``unit`` (``"image"``,
    ``"tile"`` or ``"patch_rows"``; see :data:`MEDIA_KEYS`)."""
    model_type = config.model_type
    if "pixel_values" not in doc:
        return []
    if unit == "patch_rows":
        sizes = doc["image_grid_thw"].prod(-1).tolist()
    elif unit == "tile":
        per_tile = _tokens_per_tile(model_type, config)
        sizes = [n // per_tile for n in _placeholder_counts(model_type, doc["input_ids"])]
    elif unit == "image":
        sizes = [1] * num_images(config, doc)
    else:
        raise ValueError(f"unit={unit!r}: expected 'image', 'tile' or 'patch_rows'")
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def num_images(config: PretrainedConfig, doc: dict[str, Any]) -> int:
    """How many images ``doc`` holds (tiled layouts: read from the delimiters, not from the tile count)."""
    if "pixel_values" not in doc:
        return 0
    if config.model_type in _TILED or config.model_type == "internvl":
        return len(_placeholder_counts(config.model_type, doc["input_ids"]))
    return len(doc["image_grid_thw" if config.model_type in _QWEN else "pixel_values"])


def _placeholder_counts(model_type: str, input_ids: torch.Tensor) -> list[int]:
    """Placeholder tokens per image, read from the delimiters (tiled layouts: an image ends with its global tile)."""
    counts, current, after_global = [], 0, False
    for tok in input_ids.tolist():
        current += tok == IDS["image"]
        if model_type == "internvl":
            end_of_image = tok == IDS["end"]
        else:  # tiled: the <fake_token_around_image> closing the global tile
            end_of_image = after_global and tok == IDS["start"]
            after_global = after_global or tok == IDS["global"]
        if end_of_image:
            counts.append(current)
            current, after_global = 0, False
    return counts


def rows_per_image(config: PretrainedConfig, doc: dict[str, Any], i: int) -> int:
    """Feature rows the model makes of image ``i`` of ``doc`` = the placeholder tokens it fills."""
    model_type = config.model_type
    if model_type in _QWEN:
        return int(doc["image_grid_thw"][i].prod()) // config.vision_config.spatial_merge_size ** 2
    if model_type == "llava":
        return _llava_rows(config, *doc["pixel_values"].shape[-2:])
    if model_type in _TILED or model_type == "internvl":
        first, end = image_spans(config, doc, "tile")[i]
        return (end - first) * _tokens_per_tile(model_type, config)
    if model_type == "mistral3":
        step = config.vision_config.patch_size * config.spatial_merge_size
        h, w = doc["image_sizes"][i].tolist()
        return (h // step) * (w // step)
    if model_type == "gemma3":
        return config.mm_tokens_per_image
    return config.text_config.num_image_tokens


def split_images(config: PretrainedConfig, doc: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """``doc``'s per-image keys cut into one dict per image (same layout, image dim first)."""
    keys = {k: unit for k, unit in MEDIA_KEYS[config.model_type].per_image.items() if k in doc}
    spans = {k: image_spans(config, doc, unit) for k, unit in keys.items()}
    return [{k: doc[k][slice(*spans[k][i])] for k in keys} for i in range(num_images(config, doc))]


def concat_media(config: PretrainedConfig, docs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The per-image keys of several documents as one packed row's model inputs, in document order (the inverse of
    :func:`split_images`): concatenated along the image dim; mistral3's images zero-padded to the largest of all
    (``image_sizes`` keeps each size); ``batched`` keys get their batch dim of 1. Empty without images."""
    layout = MEDIA_KEYS[config.model_type]
    out: dict[str, torch.Tensor] = {}
    for key in layout.per_image:
        parts = [d[key] for d in docs if key in d]
        if not parts:
            continue
        if key == "pixel_values" and config.model_type == "mistral3":
            height, width = max(p.shape[-2] for p in parts), max(p.shape[-1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in parts]
        out[key] = torch.cat(parts)[None] if key in layout.batched else torch.cat(parts)
    return out


def model_inputs(config: PretrainedConfig, doc: dict[str, Any]) -> dict[str, Any]:
    """``model(**inputs)`` of one document as a batch of 1 (no labels: the loss is computed by the caller)."""
    layout = MEDIA_KEYS[config.model_type]
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "labels":
            continue
        batched = key in layout.per_token or key in layout.batched
        out[key] = value[None] if batched else value
    return out


def feature_rows(model: torch.nn.Module, doc: dict[str, Any]) -> list[int]:
    """Rows the model's own ``get_image_features`` returns for each image of ``doc``, one image at a time (checks
    :func:`rows_per_image` and :func:`split_images` against the model, not against this module)."""
    config, hidden = model.config, model.config.get_text_config().hidden_size
    rows = []
    with torch.no_grad():
        for image in split_images(config, doc):
            out = model.model.get_image_features(**model_inputs(config, image))
            pooled = out.pooler_output if hasattr(out, "pooler_output") else out
            parts = pooled if isinstance(pooled, (list, tuple)) else [pooled]
            rows.append(sum(p.reshape(-1, hidden).shape[0] for p in parts))
    return rows


@dataclass
class AloneResult:
    """What :func:`documents_alone` measured: ``logits`` per document (``[n_i, V]`` fp32), ``loss`` the summed token
    loss (float64 scalar, detached), ``grads`` ``{parameter name: gradient}`` of it (parameters the loss reaches)."""

    logits: list[torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def document_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one document (``logits [n, V]``, unshifted ``labels [n]``, -100 ignored), float64."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=-100, reduction="sum")


def documents_alone(model: torch.nn.Module, docs: list[dict[str, Any]], *, loss: bool = True) -> AloneResult:
    """The reference: each document alone (batch of 1, no packing, the model's default positions) through ``model``.
    Labels default to ``input_ids``. With ``loss=False`` no autograd runs and ``grads`` is empty."""
    config = model.config
    model.zero_grad(set_to_none=True)
    logits, total = [], torch.zeros((), dtype=torch.float64)
    with torch.set_grad_enabled(loss):
        for doc in docs:
            out = model(**model_inputs(config, doc), use_cache=False).logits[0].float()
            logits.append(out)
            if loss:
                total = total + document_loss(out, doc.get("labels", doc["input_ids"]))
    grads: dict[str, torch.Tensor] = {}
    if loss:
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return AloneResult([lg.detach() for lg in logits], total.detach(), grads)


#: Parameters whose true gradient is zero (a key bias shifts every score of a query alike): their float32 gradients
#: are rounding noise of either run, so they are left out of the gradient comparison.
_GRADIENT_FREE = ("k_proj.bias", "self_attn.key.bias")


def compare(packed_logits_by_doc: list[torch.Tensor], packed_loss: torch.Tensor | float | None,
            packed_grads: dict[str, torch.Tensor] | None, alone: AloneResult) -> dict[str, float]:
    """Max relative errors of a packed run against :func:`documents_alone`: ``logits`` (max over documents of
    ``max|a-b| / max|b|``), ``loss`` (``|a-b| / |b|``), ``grads`` (max over parameters of ``||a-b|| / ||b||``, the
    norm floored at 1e-6 of the largest; a missing gradient counts as zero; key biases, whose true gradient is 0, left
    out) and ``grads_total`` (all parameters
    together). Keys whose packed value is ``None`` are left out. Tolerance of the tests: 1e-4."""
    out: dict[str, float] = {}
    if len(packed_logits_by_doc) != len(alone.logits):
        raise ValueError(f"{len(packed_logits_by_doc)} packed documents, {len(alone.logits)} reference documents")
    out["logits"] = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
                        for a, b in zip(packed_logits_by_doc, alone.logits))
    if packed_loss is not None:
        ref = float(alone.loss)
        out["loss"] = abs(float(packed_loss) - ref) / max(abs(ref), 1e-30)
    if packed_grads is not None:
        norms = {n: float(g.double().norm()) for n, g in alone.grads.items()}
        floor = 1e-6 * max(norms.values(), default=1.0)
        worst, num, den = 0.0, 0.0, 0.0
        for name in set(alone.grads) | set(packed_grads):
            if name.endswith(_GRADIENT_FREE):  # softmax is shift-invariant: their true gradient is 0, only noise
                continue
            ref_g = alone.grads.get(name)
            got = packed_grads.get(name)
            ref_g = torch.zeros_like(got) if ref_g is None else ref_g
            got = torch.zeros_like(ref_g) if got is None else got
            diff = float((got.double() - ref_g.double()).norm())
            worst = max(worst, diff / max(norms.get(name, 0.0), floor))
            num, den = num + diff ** 2, den + norms.get(name, 0.0) ** 2
        out["grads"] = worst
        out["grads_total"] = num ** 0.5 / max(den ** 0.5, 1e-30)
    return out
