"""What a whole model cannot do with packed rows, decided once from its structure, not in every layer.

Three things make a model compute something other than block-diagonal attention whatever the
attention function does, and transformers gives an attention function no way to see them:

- layers that mix tokens besides attention (Mamba / gated-delta / linear-attention scans, causal
  convolutions, RWKV, LSTM cells) carry state across document boundaries (:func:`packing_refusal`);
- position embeddings counted from the row start (:func:`has_absolute_positions`: such a model needs
  per-document ``position_ids``);
- attention that never goes through ``AttentionInterface``: the model accepts
  ``attn_implementation="blockdiag_cp"`` and runs its own attention over the whole row
  (:func:`refuse_bypassing_model` at load time; the post-forward hook of :mod:`.prepare` at run time).

A fourth is not about attention: a model whose own loss does not go through transformers'
``self.loss_function`` ignores the collator's ``shift_labels`` and ``num_items_in_batch`` and trains
another objective (:func:`loss_refusal`).

Also the one test of whether a model uses this package's attention (:func:`uses_blockdiag_cp`) and the
one error for a model that does not (:func:`require_blockdiag_cp`).
"""

from __future__ import annotations

import inspect
import re
import sys

import torch
from transformers import PreTrainedModel

from ..compat import can_set_attn_implementation, config_attn_implementation, kernels_available
from ..config import ATTN_IMPLEMENTATION
from ..errors import UnsupportedModel
from ..mixer_hooks import served_modules
from ..mixer_table import POSITION_RESETS
from .subconfigs import OTHER_MODALITY

__all__ = ["UnsupportedModel", "has_absolute_positions", "loss_refusal", "model_type", "packing_refusal",
           "padding_refusal", "refuse_bypassing_model", "require_blockdiag_cp", "resets_at_position_zero",
           "uses_blockdiag_cp"]

#: Class-name patterns of token mixers other than attention (checked against every submodule).
_MIXER_PATTERN = re.compile(
    r"Mamba|Ssm|SSM|GatedDelta|DeltaNet|DeltaProduct|LinearAttention|LightningAttention|ShortConv|Rglru|RGLRU|"
    r"RecurrentBlock|Rwkv|LSTM|Lstm|Retention|Hyena|KimiDelta|Recurrent(?!Gemma)")

#: What each token mixer that :mod:`hf_blockdiag_cp.recurrent` does not serve is (class-name pattern, description),
#: so that a refusal names the piece that is missing. A plain ``nn.Conv1d`` is named after the module holding it.
_UNSERVED_MIXERS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), d) for p, d in (
    (r"LightningAttention", "lightning attention"),
    (r"^RecurrentGemma(RecurrentBlock|Rglru)$", "RG-LRU recurrence and its plain nn.Conv1d"),
    (r"^xLSTM", "mLSTM cell"),
    (r"DynamicShortConvolution$", "dynamic short convolution with per-token taps, outside transformers' "
                                  "replaceable causal_conv1d functions"),
    (r"^ZayaCCAProjection$", "compressed convolutional attention projection, plain nn.Conv1d layers over the "
                             "sequence and a delayed value state"),
    (r"Rwkv", "RWKV time mixing"),
))



def model_type(model: torch.nn.Module) -> str:
    """``config.model_type``, else the class name (for messages)."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def attn_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation ``model``'s config names (``None``: no config, e.g. a plain module)."""
    return config_attn_implementation(getattr(model, "config", None))


def uses_blockdiag_cp(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention is this package's (``attn_implementation="blockdiag_cp"``)."""
    return attn_implementation(model) == ATTN_IMPLEMENTATION


def require_blockdiag_cp(model: torch.nn.Module, consequence: str, *, allow_unknown: bool = False) -> None:
    """Raise ``ValueError`` unless ``model`` uses ``attn_implementation="blockdiag_cp"``.

    Args:
        consequence: what would go wrong otherwise (completes "the model's attn_implementation is X: ...").
        allow_unknown: accept a module without a config (its attention cannot be read).
    """
    implementation = attn_implementation(model)
    if implementation == ATTN_IMPLEMENTATION or (allow_unknown and implementation is None):
        return
    raise ValueError(f"the model's attn_implementation is {implementation!r}: {consequence}; load it with "
                     f"attn_implementation={ATTN_IMPLEMENTATION!r} or call model.set_attn_implementation"
                     f"({ATTN_IMPLEMENTATION!r})")


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run packed rows with more than one document (or CP shards), or ``None``."""
    name_of_model = model_type(model)
    # Recurrent mixers run per document fragment (hf_blockdiag_cp.recurrent): they, their convolutions and the
    # blocks around them (MambaBlock, ...DecoderLayer) carry no state across documents any more.
    served = served_modules(model)
    prefix = re.sub(r"(ForCausalLM|Model|LMHeadModel|PreTrainedModel)$", "", type(model).__name__)
    for name, sub in model.named_modules():
        if isinstance(sub, PreTrainedModel):  # the model classes themselves are named after the architecture
            continue
        if OTHER_MODALITY.search(name):  # encoders of other modalities do not see the packed text row
            continue
        if any(s == name or s.startswith(name + ".") or name.startswith(s + ".") for s in served):
            continue
        if _calls_attention_interface(type(sub)):  # softmax attention named after its architecture (KimiLinear...)
            continue
        kind = None
        cls_name = type(sub).__name__
        if served and prefix and cls_name.startswith(prefix):  # MambaRMSNorm: named after a served architecture
            cls_name = cls_name[len(prefix):]
        if isinstance(sub, torch.nn.Conv1d):
            kind = "plain nn.Conv1d over the sequence, outside transformers' replaceable causal_conv1d functions"
        elif _MIXER_PATTERN.search(cls_name):
            kind = "recurrent / state-space / linear-attention token mixer"
        if kind is not None:
            owner = _owner(model, name) if isinstance(sub, torch.nn.Conv1d) else sub
            what = _unserved_mixer(owner, kind)
            if not kernels_available():  # transformers then wires no replaceable wrappers the package could serve
                return (f"{name_of_model}'s {what} ({type(owner).__name__} at {name}) cannot be served per document: "
                        "transformers routes recurrent mixers through the `kernels` package, which is not installed "
                        "here, so the mixer has no replaceable functions (pip install kernels, a dependency of "
                        "hf-blockdiag-cp); blockdiag_cp refuses rows with more than one document for it")
            return (f"{name_of_model}'s {what} ({type(owner).__name__} at {name}) has no per-document reset or "
                    "state passing in blockdiag_cp yet: its layers carry state across the whole row whatever the "
                    "attention does, so packed documents would leak into each other (and a context-parallel shard "
                    "would lose the state of the previous shard); blockdiag_cp refuses rows with more than one "
                    "document for it. Train it on one document per row without context parallelism")
    offset = next((sub for sub in model.modules() if hasattr(type(sub), "create_position_ids_from_input_ids")), None)
    if offset is not None:
        return (f"{name_of_model}'s {type(offset).__name__} counts positions from padding_idx + 1 when it computes "
                "them itself, while packing collators emit per-document position_ids from 0, so every position of a "
                "packed row would be shifted; blockdiag_cp refuses rows with more than one document for it")
    # Packed positions reach the embeddings only if some model class in the tree takes position_ids
    # (WhisperForCausalLM forwards them through **kwargs to its decoder; BartDecoder has none).
    if served and not any(_calls_attention_interface(type(sub)) for sub in model.modules()):
        return None  # a pure state-space model has no positions to count; its mixers read the packing
    takes_positions = any("position_ids" in inspect.signature(type(sub).forward).parameters
                          for sub in model.modules() if isinstance(sub, PreTrainedModel))
    if not takes_positions:
        return (f"{name_of_model}'s forward takes no position_ids: its position embeddings count from the row start, "
                "not from each packed document (and not from a context-parallel shard's offset); blockdiag_cp refuses "
                "rows with more than one document for it")
    return None


def _owner(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """The module holding submodule ``name`` (a plain convolution is described by the layer that uses it)."""
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def _unserved_mixer(module: torch.nn.Module, kind: str) -> str:
    """What ``module`` is, for a refusal: its entry in :data:`_UNSERVED_MIXERS`, else ``kind``."""
    cls_name = type(module).__name__
    return next((what for pattern, what in _UNSERVED_MIXERS if pattern.search(cls_name)), kind)


def _calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' ``AttentionInterface`` (then it is softmax attention)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return False


def padding_refusal(model: torch.nn.Module) -> tuple[int, str] | None:
    """``(padding_idx, why)`` when a padding token of ``model`` would make every gradient NaN, else ``None``.

    Activation sparsity (gemma3n's ``activation_sparsity_pattern``) takes a standard deviation over each token's
    hidden state. A row's padding token belongs to no document, so it attends to nothing (stock attention lets a
    padded query see the real tokens before it); with the embedding's all-zero ``padding_idx`` row its hidden
    state stays constant, and the standard deviation's gradient there is 0/0: NaN, which reaches every weight's
    gradient although the padding's loss is ignored."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    pattern = getattr(config, "activation_sparsity_pattern", None) or ()
    if not any(float(v) > 0 for v in pattern):
        return None
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # wrappers (e.g. BartDecoderWrapper) that do not expose them
        return None
    idx = getattr(embeddings, "padding_idx", None)
    if idx is None:
        return None
    return idx, (f"{model_type(model)}'s activation sparsity (activation_sparsity_pattern) takes a standard deviation "
                 f"over each token's hidden state; a padding token with id {idx} (the embedding's all-zero padding_idx "
                 "row) belongs to no document, attends to nothing and keeps a constant hidden state, where that "
                 "standard deviation's gradient is NaN, and every weight's gradient would become NaN. Pad rows with "
                 f"another token id (PackingCollator(pad_token_id=...), e.g. the EOS id), or fill rows without padding")


def loss_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s own loss cannot serve the collator's targets, or ``None``.

    transformers' ``ForCausalLMLoss`` (``self.loss_function``) reads ``shift_labels`` (the targets the
    collator shifted on the full row, -100 at every document end and rank boundary) and
    ``num_items_in_batch``. A causal LM whose ``forward`` takes ``labels`` but computes its loss
    itself (e.g. ``WhisperForCausalLM``: a plain ``CrossEntropyLoss`` over its own shift of ``labels``)
    ignores both, so it would predict across documents and normalise per shard.

    Conservative, from the source: flagged only when the outermost model's ``forward`` takes
    ``labels`` and its source (readable, decorators unwrapped) never mentions ``loss_function``. A
    forward whose source cannot be read, or that takes no ``labels``, is not flagged.
    """
    forward = getattr(type(model), "forward", None)
    if forward is None or not isinstance(model, PreTrainedModel):
        return None
    try:
        if "labels" not in inspect.signature(forward).parameters:
            return None
        source = inspect.getsource(forward)
    except (OSError, TypeError, ValueError):
        return None
    if "loss_function" in source:
        return None
    return (f"{model_type(model)}'s {type(model).__name__}.forward computes its loss itself instead of through "
            "transformers' loss_function, so it ignores shift_labels (the collator's targets, -100 at every document "
            "end and CP boundary) and num_items_in_batch, and would train another objective; pass no labels / "
            "shift_labels to the model and compute the loss from its logits with the batch's shift_labels "
            "(cross_entropy(logits, shift_labels, ignore_index=-100, reduction='sum') / num_items_in_batch)")


def resets_at_position_zero(model: torch.nn.Module) -> bool:
    """Whether a recurrent mixer of ``model`` reads ``position_ids`` for its document resets (RecurrentGemma's
    RG-LRU): a packed batch then needs per-document ``position_ids``, like absolute position embeddings."""
    return any(type(sub).__name__ in POSITION_RESETS for sub in model.modules())


def has_absolute_positions(model: torch.nn.Module) -> bool:
    """Whether ``model`` adds learned/absolute position embeddings (it needs per-document ``position_ids``)."""
    for name, sub in model.named_modules():
        cls = type(sub).__name__
        if "Rotary" in cls or "Rope" in cls:
            continue
        if re.search(r"Position(al)?Embedding", cls) or (
                isinstance(sub, torch.nn.Embedding) and re.search(r"(^|\.)(wpe|embed_positions|position_embeddings)$",
                                                                  name)):
            return True
    return False


def _picks_attention_class_by_name(cls: type) -> bool:
    """Whether ``cls``'s module looks its attention class up by implementation name
    (``X_ATTENTION_CLASSES[config._attn_implementation]``), which only knows the stock names."""
    module = sys.modules.get(cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return re.search(r"ATTENTION_CLASSES\[\s*(self\.)?config\._attn_implementation\s*\]", source) is not None


def refuse_bypassing_model(model: torch.nn.Module) -> None:
    """Raise at load time if ``model``'s own code has attention layers that never call
    ``AttentionInterface`` (transformers' own source heuristic, ``_can_set_attn_implementation``).

    Composite (multimodal) wrappers are exempt: their vision/audio towers may run their own
    attention while the text model they wrap calls the interface. Models the heuristic misses are
    still caught at their first packed forward (the post-forward hook of :mod:`.prepare`).
    """
    config = getattr(model, "config", None)
    try:
        composite = config is not None and config.get_text_config() is not config
    except (ValueError, AttributeError):
        composite = True
    can_set = can_set_attn_implementation(type(model))
    by_name = _picks_attention_class_by_name(type(model))
    if not by_name and (composite or can_set is None or can_set):
        return
    raise UnsupportedModel(
        f"{model_type(model)} ({type(model).__name__}) does not route attention through transformers' "
        "AttentionInterface: its attention layers compute attention themselves (or pick a class by implementation "
        "name), so attn_implementation='blockdiag_cp' would never be called and packed documents would attend to "
        "each other; blockdiag_cp cannot serve this model")
