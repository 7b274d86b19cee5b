"""Tiny image-text models with bidirectional blocks (gemma3: each image's tokens; PaliGemma: the image + prompt prefix)
and hand-built packed batches of them, for the tests of bidirectional blocks.

Each document is ``[text..., image tokens..., text...]`` (gemma3) or ``[image tokens..., prompt..., suffix...]``
(PaliGemma) with one synthetic image; the reference is each document alone through the stock model (sdpa).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

import hf_blockdiag_cp as bd

#: Text with blockdiag_cp, the vision tower with sdpa (it runs each image alone anyway).
SPLIT_ATTENTION = {"text_config": "blockdiag_cp", "vision_config": "sdpa", "": "blockdiag_cp"}
VOCAB = 300
IMAGE_TOKEN = 299
IMAGE_TOKENS = 4  # per image


def _shrink_vision(vision) -> None:
    vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers = 32, 64, 1
    vision.num_attention_heads, vision.image_size, vision.patch_size = 2, 16, 4


def tiny_gemma3_config(sliding_window: int = 512):
    """gemma3 with a 2-layer text model (one sliding, one full layer) and a 16 x 16 px image of 4 tokens."""
    config = AutoConfig.for_model("gemma3")
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 32, 64, 2
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 4, 2, 16
    text.query_pre_attn_scalar = 16
    text.vocab_size, text.sliding_window = VOCAB, sliding_window
    text.layer_types = ["sliding_attention", "full_attention"]
    _shrink_vision(config.vision_config)
    config.mm_tokens_per_image = IMAGE_TOKENS
    config.image_token_id = config.image_token_index = IMAGE_TOKEN
    config.boi_token_index, config.eoi_token_index = 297, 298
    return config


def tiny_paligemma_config():
    """PaliGemma (Gemma text model, ``use_bidirectional_attention=True`` by default) with a 4-token image."""
    config = AutoConfig.for_model("paligemma")
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 32, 64, 2
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 4, 2, 16
    text.vocab_size = VOCAB
    _shrink_vision(config.vision_config)
    config.vision_config.projection_dim = config.projection_dim = config.hidden_size = 32
    text.num_image_tokens = IMAGE_TOKENS * 4  # (16 / 4) ** 2 patches, no pooling
    config.image_token_id = config.image_token_index = IMAGE_TOKEN
    config.vocab_size = VOCAB
    return config


def model_pair(config, seed: int = 0, dtype: torch.dtype = torch.float64):
    """``(stock sdpa model, blockdiag_cp model)`` with the same weights, in train mode without dropout."""
    torch.manual_seed(seed)
    ref = AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation="sdpa").to(dtype)
    ours = AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation=SPLIT_ATTENTION)
    ours = ours.to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


@dataclass
class Document:
    input_ids: torch.Tensor  # [n]
    token_type_ids: torch.Tensor  # [n]
    pixel_values: torch.Tensor  # [1, 3, H, W]
    position_ids: torch.Tensor  # [n] (PaliGemma counts from 1)


def image_tokens(model_type: str) -> int:
    return IMAGE_TOKENS if model_type == "gemma3" else IMAGE_TOKENS * 4


def gemma3_document(before: int, after: int, *, seed: int, dtype: torch.dtype = torch.float64) -> Document:
    """``before`` text tokens, one image, ``after`` text tokens; token_type_ids 1 on the image tokens."""
    g = torch.Generator().manual_seed(seed)
    n = image_tokens("gemma3")
    ids = torch.cat([torch.randint(2, 290, (before,), generator=g), torch.full((n,), IMAGE_TOKEN),
                     torch.randint(2, 290, (after,), generator=g)])
    types = (ids == IMAGE_TOKEN).long()
    pixels = torch.randn(1, 3, 16, 16, generator=g, dtype=dtype)
    return Document(ids, types, pixels, torch.arange(ids.numel()))


def paligemma_document(prompt: int, suffix: int, *, seed: int, dtype: torch.dtype = torch.float64) -> Document:
    """One image, ``prompt`` prompt tokens (token type 0 with the image: the bidirectional prefix), ``suffix``
    causal tokens (type 1)."""
    g = torch.Generator().manual_seed(seed)
    n = image_tokens("paligemma")
    ids = torch.cat([torch.full((n,), IMAGE_TOKEN), torch.randint(2, 290, (prompt + suffix,), generator=g)])
    types = torch.cat([torch.zeros(n + prompt, dtype=torch.long), torch.ones(suffix, dtype=torch.long)])
    pixels = torch.randn(1, 3, 16, 16, generator=g, dtype=dtype)
    return Document(ids, types, pixels, torch.arange(1, ids.numel() + 1))


def block_ids_of(doc: Document, model_type: str) -> torch.Tensor:
    """What the packing collator derives from a document's token_type_ids: gemma3 makes each run of image tokens
    (type 1) a block, PaliGemma its prefix (type 0)."""
    in_block = doc.token_type_ids == (1 if model_type == "gemma3" else 0)
    starts = in_block & ~torch.nn.functional.pad(in_block, (1, 0))[:-1]
    return torch.where(in_block, torch.cumsum(starts.long(), 0), 0)


def packed(docs: list[Document], model_type: str, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """One packed row ``[1, S]`` of ``docs``: input_ids, token_type_ids, position_ids, doc_ids, block_ids (block
    numbers unique over the row), pixel_values (one image per document, in order); padded to ``pad_to``."""
    ids, types, pos, doc_ids, blocks = [], [], [], [], []
    offset = 0
    for i, d in enumerate(docs):
        ids.append(d.input_ids)
        types.append(d.token_type_ids)
        pos.append(d.position_ids)
        doc_ids.append(torch.full_like(d.input_ids, i + 1))
        b = block_ids_of(d, model_type)
        blocks.append(torch.where(b > 0, b + offset, 0))
        offset += int(b.max())
    row = {"input_ids": torch.cat(ids), "token_type_ids": torch.cat(types), "position_ids": torch.cat(pos),
           "doc_ids": torch.cat(doc_ids), "block_ids": torch.cat(blocks)}
    if pad_to is not None and pad_to > row["input_ids"].numel():
        extra = pad_to - row["input_ids"].numel()
        fill = {"input_ids": 1, "token_type_ids": 1 if model_type == "gemma3" else 1, "position_ids": 0,
                "doc_ids": 0, "block_ids": 0}
        row = {k: torch.cat([v, torch.full((extra,), fill[k], dtype=v.dtype)]) for k, v in row.items()}
    row = {k: v.unsqueeze(0) for k, v in row.items()}
    row["pixel_values"] = torch.cat([d.pixel_values for d in docs])
    return row


def context(row: dict[str, torch.Tensor], *, with_blocks: bool = True, **kwargs) -> bd.BlockDiagCPContext:
    if with_blocks:
        kwargs["block_ids"] = row["block_ids"]
    return bd.BlockDiagCPContext.build(row["doc_ids"], position_ids=row["position_ids"], **kwargs)
