"""Model-level guards: what a whole model cannot do with packed rows, decided once, not in every layer.

Three things make a model compute something other than block-diagonal attention whatever the
attention function does, and transformers gives an attention function no way to see them:

- layers that mix tokens besides attention (Mamba / gated-delta / linear-attention scans, causal
  convolutions, RWKV, LSTM cells) carry state across document boundaries;
- position embeddings counted from the row start (a forward without ``position_ids``);
- attention that never goes through ``AttentionInterface``: the model accepts
  ``attn_implementation="blockdiag_cp"`` and runs its own attention, over the whole row.

:func:`install` puts a small :class:`ForwardProbe` on every submodule of a model and a forward pre-
and post-hook on the model itself: the pre-hook refuses a batch with more than one document per row
(or a CP shard) for a model of the first two kinds, the post-hook refuses a forward that carried
packing information (``cp_context``, ``cu_seq_lens_*`` or packed ``position_ids``) in which the
attention function was never called. :func:`patch_transformers` makes transformers install it for
every model whose ``attn_implementation`` is ``"blockdiag_cp"`` (``from_pretrained``, ``from_config``,
``set_attn_implementation``), so users need no extra call, and refuse at load time a model whose source
has attention layers that never call the interface (:func:`refuse_bypassing_model`). Tensor values are read only for models
that will be refused anyway (the hooks cost two dictionary reads otherwise).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from ..planning.documents import run_boundaries

__all__ = ["ForwardProbe", "PROBE_ATTR", "UnsupportedModel", "install", "mark_attention_call", "packing_refusal",
           "patch_transformers", "refuse_bypassing_model"]

ATTN_IMPLEMENTATION = "blockdiag_cp"
PROBE_ATTR = "_blockdiag_cp_probe"
_HOOKED_ATTR = "_blockdiag_cp_hooked"

#: Class-name patterns of token mixers other than attention (checked against every submodule).
_MIXER_PATTERN = re.compile(
    r"Mamba|Ssm|SSM|GatedDelta|DeltaNet|DeltaProduct|LinearAttention|LightningAttention|ShortConv|Rglru|RGLRU|"
    r"RecurrentBlock|Rwkv|LSTM|Lstm|Retention|Hyena|KimiDelta|Recurrent(?!Gemma)")

#: Module paths of other modalities' encoders (their convolutions run over audio/image features).
_NON_TEXT_PATTERN = re.compile(r"(^|[._])(audio|vision|visual|image|speech|video)", re.IGNORECASE)

#: Architectures whose layers mix across documents in ways the generic detectors do not see
#: (each entry found by ``python -m hf_blockdiag_cp.check --all``).
KNOWN_PACKING_REFUSALS: dict[str, str] = {}


class UnsupportedModel(NotImplementedError):
    """The model cannot be computed exactly by blockdiag_cp for this batch (raised instead of computing
    something else)."""


@dataclass(eq=False)
class ForwardProbe:
    """Shared by every submodule of one model: counts attention calls, carries the model's refusal.

    Attributes:
        model_type: ``config.model_type`` (for messages).
        refusal: why rows with more than one document (or a CP shard) would be computed wrongly.
        absolute_positions: the model adds learned/absolute position embeddings (``position_ids`` needed).
        attention_calls: calls of the ``"blockdiag_cp"`` attention function by this model's layers.
        starts: ``attention_calls`` at the start of the forward of each hooked module (by ``id``).
    """

    model_type: str
    refusal: str | None = None
    absolute_positions: bool = False
    attention_calls: int = 0
    starts: dict[int, int] = field(default_factory=dict)


def mark_attention_call(module: torch.nn.Module) -> None:
    """Record that ``module`` called the attention function (one dict read, no tensor access)."""
    probe = module.__dict__.get(PROBE_ATTR)
    if probe is not None:
        probe.attention_calls += 1


def _model_type(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def _uses_blockdiag(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run packed rows with more than one document (or CP shards), or ``None``."""
    model_type = _model_type(model)
    if model_type in KNOWN_PACKING_REFUSALS:
        return f"{model_type}: {KNOWN_PACKING_REFUSALS[model_type]}"
    for name, sub in model.named_modules():
        if isinstance(sub, PreTrainedModel):  # the model classes themselves are named after the architecture
            continue
        if _NON_TEXT_PATTERN.search(name):  # encoders of other modalities do not see the packed text row
            continue
        kind = None
        if isinstance(sub, torch.nn.Conv1d):
            kind = "a convolution over the sequence"
        elif _MIXER_PATTERN.search(type(sub).__name__):
            kind = "a recurrent / state-space / linear-attention token mixer"
        if kind is not None:
            return (f"{model_type} has {type(sub).__name__} layers ({name}: {kind}) that carry state across the whole "
                    "row whatever the attention does, so packed documents would leak into each other (and a context-"
                    "parallel shard would lose the state of the previous shard); blockdiag_cp refuses rows with more "
                    "than one document for it. Train it on one document per row without context parallelism")
    offset = next((sub for sub in model.modules() if hasattr(type(sub), "create_position_ids_from_input_ids")), None)
    if offset is not None:
        return (f"{model_type}'s {type(offset).__name__} counts positions from padding_idx + 1 when it computes them "
                "itself, while packing collators emit per-document position_ids from 0, so every position of a packed "
                "row would be shifted; blockdiag_cp refuses rows with more than one document for it")
    # Packed positions reach the embeddings only if some model class in the tree takes position_ids
    # (WhisperForCausalLM forwards them through **kwargs to its decoder; BartDecoder has none).
    takes_positions = any("position_ids" in inspect.signature(type(sub).forward).parameters
                          for sub in model.modules() if isinstance(sub, PreTrainedModel))
    if not takes_positions:
        return (f"{model_type}'s forward takes no position_ids: its position embeddings count from the row start, not "
                "from each packed document (and not from a context-parallel shard's offset); blockdiag_cp refuses rows "
                "with more than one document for it")
    return None


def _has_absolute_positions(model: torch.nn.Module) -> bool:
    for name, sub in model.named_modules():
        cls = type(sub).__name__
        if "Rotary" in cls or "Rope" in cls:
            continue
        if re.search(r"Position(al)?Embedding", cls) or (
                isinstance(sub, torch.nn.Embedding) and re.search(r"(^|\.)(wpe|embed_positions|position_embeddings)$",
                                                                  name)):
            return True
    return False


def install(model: torch.nn.Module) -> None:
    """Install the probe and the forward hooks on ``model`` (idempotent; nested models share one probe)."""
    probe = next((m.__dict__[PROBE_ATTR] for m in model.modules() if PROBE_ATTR in m.__dict__), None)
    if probe is None:
        probe = ForwardProbe(model_type=_model_type(model))
    probe.model_type = _model_type(model)
    probe.refusal = packing_refusal(model)
    probe.absolute_positions = _has_absolute_positions(model)
    for sub in model.modules():
        sub.__dict__[PROBE_ATTR] = probe
    if not model.__dict__.get(_HOOKED_ATTR, False):
        model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
        model.register_forward_hook(_post_forward, with_kwargs=True)
        model.__dict__[_HOOKED_ATTR] = True


def _arguments(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name (positional ones bound to the signature, ``**kwargs`` flattened)."""
    if not args:
        return kwargs
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return kwargs
    named = dict(bound)
    for name, param in inspect.signature(module.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    return named


def _packed_position_ids(position_ids: Any) -> bool:
    """Whether ``position_ids`` restart inside a row (one host read; only for models being refused)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() == 0 or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids[..., 1:] != position_ids[..., :-1] + 1).any())


def _packing(named: dict[str, Any]) -> str | None:
    """What in these forward arguments puts more than one document in a row (or shards a row), or ``None``."""
    ctx = named.get("cp_context")
    if ctx is not None:
        if getattr(ctx, "cp_size", 1) > 1:
            return f"a context-parallel shard (cp_size={ctx.cp_size})"
        ids = getattr(ctx, "doc_ids", None)
        if isinstance(ids, torch.Tensor) and ids.numel():
            if int((run_boundaries(ids) & (ids != 0)).sum(dim=1).max()) > 1:
                return "cp_context with more than one document per row"
    cu = named.get("cu_seq_lens_q")
    if cu is None:
        cu = named.get("cu_seq_lens_k")
    if isinstance(cu, torch.Tensor) and cu.numel() > 2:
        return f"cu_seq_lens_* with {cu.numel() - 1} documents"
    if named.get("past_key_values") is None and named.get("cache") is None:
        if _packed_position_ids(named.get("position_ids")):
            return "packed position_ids (positions restart inside a row)"
    return None


def _pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    probe: ForwardProbe | None = module.__dict__.get(PROBE_ATTR)
    if probe is None or not _uses_blockdiag(module):
        return
    probe.starts[id(module)] = probe.attention_calls
    if probe.refusal is None and not probe.absolute_positions:
        return
    named = _arguments(module, args, kwargs)
    if probe.refusal is not None:
        packing = _packing(named)
        if packing is not None:
            raise UnsupportedModel(f"blockdiag_cp cannot compute this batch ({packing}) exactly: {probe.refusal}")
    elif named.get("position_ids") is None and (named.get("cu_seq_lens_q") is not None
                                                 or named.get("cp_context") is not None):
        raise UnsupportedModel(
            f"{probe.model_type} adds absolute position embeddings but this packed batch has no position_ids: every "
            "document after the first would get the positions of its place in the row; pass the per-document "
            "position_ids (PackingCollator and DataCollatorWithFlattening emit them)")


def _post_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    probe: ForwardProbe | None = module.__dict__.get(PROBE_ATTR)
    if probe is None or not _uses_blockdiag(module):
        return
    start = probe.starts.pop(id(module), None)
    if start is None or probe.attention_calls != start:
        return
    packing = _packing(_arguments(module, args, kwargs))
    if packing is not None:
        raise UnsupportedModel(
            f"{probe.model_type} does not call its attention through transformers' AttentionInterface: it accepted "
            f"attn_implementation='blockdiag_cp' but never called it in a forward with {packing}, so its own "
            "attention attended across documents; blockdiag_cp cannot serve this model")


def patch_transformers() -> None:
    """Make transformers call :func:`install` for every model whose attention implementation is ours.

    Wraps ``PreTrainedModel.post_init`` (the end of every model's ``__init__``, so ``from_pretrained`` and
    ``from_config`` with ``attn_implementation="blockdiag_cp"``) and ``set_attn_implementation``.
    Idempotent; models using other implementations are untouched.
    """
    if getattr(PreTrainedModel.post_init, "_blockdiag_cp_wrapped", False):
        return
    original_post_init = PreTrainedModel.post_init
    original_set = PreTrainedModel.set_attn_implementation
    original_check = PreTrainedModel._check_and_adjust_attn_implementation

    @functools.wraps(original_check)
    def check_and_adjust(self: PreTrainedModel, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if attn_implementation == ATTN_IMPLEMENTATION:
            refuse_bypassing_model(self)
        return original_check(self, attn_implementation, *args, **kwargs)

    @functools.wraps(original_post_init)
    def post_init(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        out = original_post_init(self, *args, **kwargs)
        if _uses_blockdiag(self):
            install(self)
        return out

    @functools.wraps(original_set)
    def set_attn_implementation(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        out = original_set(self, *args, **kwargs)
        for sub in list(self.modules())[::-1]:  # inner models first, so the outer one owns the probe
            if isinstance(sub, PreTrainedModel) and _uses_blockdiag(sub):
                install(sub)
        return out

    post_init._blockdiag_cp_wrapped = True
    set_attn_implementation._blockdiag_cp_wrapped = True
    PreTrainedModel.post_init = post_init
    PreTrainedModel.set_attn_implementation = set_attn_implementation
    PreTrainedModel._check_and_adjust_attn_implementation = check_and_adjust


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
    still caught at their first packed forward (:func:`_post_forward`).
    """
    config = getattr(model, "config", None)
    try:
        composite = config is not None and config.get_text_config() is not config
    except (ValueError, AttributeError):
        composite = True
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    by_name = _picks_attention_class_by_name(type(model))
    if not by_name and (composite or can_set is None or can_set()):
        return
    raise UnsupportedModel(
        f"{_model_type(model)} ({type(model).__name__}) does not route attention through transformers' "
        "AttentionInterface: its attention layers compute attention themselves (or pick a class by implementation "
        "name), so attn_implementation='blockdiag_cp' would never be called and packed documents would attend to "
        "each other; blockdiag_cp cannot serve this model")
