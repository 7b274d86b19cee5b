"""Reading user examples: validate one example's fields and turn them into a :class:`Document`.

Every check runs on the host before any packing, and every error names the example index and the
field, so a bad record in a large dataset can be found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .multimodal import read_media

__all__ = ["Document", "read_example", "token_tensor"]

#: Per-token fields a processor returns as ``[1, n]`` for one document.
_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "token_type_ids")


@dataclass(frozen=True, eq=False)
class Document:
    """One document (or one piece of a long document) ready to be laid into a row.

    Attributes:
        input_ids: ``[n]`` int64 token ids (CPU).
        labels: ``[n]`` int64 unshifted labels, ``-100`` where ignored (CPU; the collator writes its
            own ``label_pad_id`` when it lays the row out).
        position_start: position id of the first token (0, or the cut offset of a split piece).
        index: index of the source example (for error messages and bookkeeping).
        media: its images / videos in document order (:class:`~.multimodal.MediaItem`), for vision-language models.
        token_types: ``[n]`` int64 per-token type ids the model reads (``mm_token_type_ids`` / ``token_type_ids``),
            or ``None``.
        mrope: ``[3, n]`` int64 3-D rope positions of the document run alone (mrope models with media), or ``None``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_start: int = 0
    index: int = 0
    media: tuple[Any, ...] = ()
    token_types: torch.Tensor | None = None
    mrope: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    def piece(self, start: int, length: int) -> Document:
        """Tokens ``[start, start + length)`` as a document whose positions continue this one's."""
        if start == 0 and length >= len(self):
            return self  # the whole document (documents are read-only): no new slices
        if self.media:
            raise ValueError(f"example {self.index}: a document with images or videos ({len(self)} tokens) does not "
                             f"fit the row ({length} tokens left): it cannot be split or truncated (an image's "
                             "placeholders would be cut from its pixels); raise seq_len or drop the example")
        if self.token_types is not None:
            return Document(self.input_ids[start:start + length], self.labels[start:start + length],
                            self.position_start + start, self.index,
                            token_types=self.token_types[start:start + length])
        return Document(self.input_ids[start:start + length], self.labels[start:start + length],
                        self.position_start + start, self.index)


def token_tensor(value: Any, *, index: int | None, field: str) -> torch.Tensor:
    """``value`` (list of ints, 1-D tensor or array) as a CPU int64 ``[n]`` tensor, or a ``ValueError``
    naming ``example {index}`` (``batch`` when ``index`` is None) and ``field``.

    Checked by dtype and shape, never by a Python loop per token: a list of ints becomes one int64 array in
    one C-level pass (a bool among them is refused), an int64 CPU tensor or writeable int64 array is used
    without a copy; values are then checked by ``min`` / ``max`` where the caller needs a range.
    """
    if (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.dim() == 1
            and value.device.type == "cpu"):
        return value.detach()  # already what is asked for (the common case of tokenized datasets): no checks to run
    where = f"example {index}: {field}" if index is not None else f"batch: {field}"
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{where} must be a sequence of ints, got {type(value).__name__} (tokenize first)")
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    else:
        if isinstance(value, (list, tuple)):
            # One C-level pass over the element types (not a Python loop): a bool among ints is refused, and a
            # list of plain ints converts directly (np.fromiter; ints beyond int64 raise OverflowError).
            types = set(map(type, value))
            if bool in types:
                raise ValueError(f"{where} must contain ints, found a bool")
            if types == {int}:
                try:
                    return torch.from_numpy(np.fromiter(value, dtype=np.int64, count=len(value)))
                except OverflowError as err:
                    raise ValueError(f"{where} must be a sequence of ints within int64: {err}") from err
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"{where} must be a sequence of ints: {err}") from err
        if array.dtype == object or array.dtype.kind not in "biufc":
            kinds = sorted({type(v).__name__ for v in array.reshape(-1)[:8]}) if array.dtype == object else []
            raise ValueError(f"{where} must be a sequence of ints, got dtype {array.dtype}"
                             + (f" (values of type {', '.join(kinds)}; ints beyond int64?)" if kinds else ""))
        if array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
            raise ValueError(f"{where} must be < 2**63 (int64), found {int(array.max())}")
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    if tensor.numel() == 0 and tensor.dim() == 1:
        return torch.zeros(0, dtype=torch.int64)  # [] reads as float; an empty document has no dtype to check
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ValueError(f"{where} must contain integers, got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{where} must be 1-D (one document), got shape {tuple(tensor.shape)}")
    return tensor.to(device="cpu", dtype=torch.int64)


def read_example(example: Any, *, index: int, label_pad_id: int = -100, media: Any = None) -> Document:
    """Validate one example and return it as a :class:`Document`.

    Args:
        example: a mapping with ``input_ids`` (``[n]`` ints >= 0) and optional ``labels`` (``[n]``
            ints; ``-100`` and ``label_pad_id`` mean ignored). Other keys are ignored.
        index: the example's index, quoted in errors.
        label_pad_id: a second value (besides ``-100``) that marks an ignored input label.
        media: the model's :class:`~.multimodal.MediaSpec` (vision-language models): the example's images,
            videos and per-token type ids are read with it (:func:`~.multimodal.read_media`).

    Returns:
        A :class:`Document` with ignored labels as ``-100``; without ``labels`` the labels are a copy
        of ``input_ids``.
    """
    if not isinstance(example, Mapping):
        raise ValueError(f"example {index} must be a mapping with 'input_ids', got {type(example).__name__}")
    if "input_ids" not in example:
        raise ValueError(f"example {index}: missing field 'input_ids' (keys: {sorted(map(str, example))})")
    if media is not None:  # a processor's output for one document: [1, n] tensors
        example = {k: v[0] if k in _TOKEN_KEYS and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] == 1
                   else v for k, v in example.items()}
    input_ids = token_tensor(example["input_ids"], index=index, field="input_ids")
    # numpy's min: a few microseconds less per example than torch's dispatch (a step reads hundreds).
    if input_ids.numel() and input_ids.numpy().min() < 0:
        pos = int(torch.nonzero(input_ids < 0)[0])
        raise ValueError(f"example {index}: input_ids[{pos}]={int(input_ids[pos])} is negative; token ids must be >= 0")
    items, token_types, mrope = read_media(example, input_ids, media, index=index)
    extra = {"media": items, "token_types": token_types, "mrope": mrope}
    labels_value = example.get("labels")
    if labels_value is None:
        # The same tensor: documents are read-only, and the row is laid out by copying them (no clone per token).
        return Document(input_ids, input_ids, 0, index, **extra)
    labels = token_tensor(labels_value, index=index, field="labels")
    if labels.numel() != input_ids.numel():
        raise ValueError(f"example {index}: labels has length {labels.numel()} but input_ids has length "
                         f"{input_ids.numel()}; they must match (labels are unshifted, one per token)")
    ignored = (labels == -100) | (labels == label_pad_id)
    bad = (labels < 0) & ~ignored
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0])
        raise ValueError(f"example {index}: labels[{pos}]={int(labels[pos])} is negative but not an ignore value "
                         f"(-100 or label_pad_id={label_pad_id})")
    return Document(input_ids, labels.masked_fill(ignored, -100), 0, index, **extra)
