"""The one owner of what this package installs on a model: its findings, its forward state and one ordered pair of
forward hooks.

:func:`prepare_model` is called by the transformers integration (:mod:`hf_blockdiag_cp.integration`: every
model loaded with, or switched to, ``attn_implementation="blockdiag_cp"``), by
:func:`~hf_blockdiag_cp.guard_model` (which turns on the strict checks) and by ``CPTrainer`` /
``CPSFTTrainer``. Whatever calls it, in whatever order, a prepared model carries exactly:

- a :class:`ModelFindings` (what preparation found about the model: its refusals, position needs, served mixers)
  and a :class:`ForwardState` (the forward in progress: the attention calls counted by :func:`attention_context`,
  the forward's ``cp_context``, its document fragments), each one object shared by all its submodules;
- a per-instance ``forward`` on each of its recurrent mixers (:mod:`hf_blockdiag_cp.mixer_hooks`) and DSA
  indexers (:mod:`hf_blockdiag_cp.sparse.indexer`), which read the forward's document fragments (the forward
  state's ``runs``, set by the pre-hook);
- one forward **pre-hook**, which in this order
  1. *checks and fills* (strict models only, i.e. after ``guard_model``): :func:`~.batch.check_batch`
     refuses a ``cp_context`` the model's attention would ignore or CP labels without ``shift_labels``,
     then the missing ``position_ids`` are supplied from the ``cp_context``
     (:func:`~.batch.context_position_ids`);
  2. *refuses* (models using ``blockdiag_cp``) what cannot be computed from the arguments as filled: packed
     rows for a model that mixes tokens outside attention (:func:`~.detect.packing_refusal`), a packed batch
     without ``position_ids`` for a model with absolute position embeddings, ``shift_labels`` (or packed
     ``labels``) for a model whose own loss ignores them (:func:`~.detect.loss_refusal`); and records the
     forward's ``cp_context`` (CP > 1) in the forward state, so that an attention call the model did not hand it
     to raises (:func:`attention_context`: layers that call attention without the model's keyword
     arguments would attend within their own shard);
  3. *agrees* (a ``cp_context`` with ``cp_size > 1``, outermost prepared module only): one small collective
     with the CP group about this forward (:func:`~.forward_agreement.agree_forward`); then, for a row with
     images or videos, encodes this rank's and exchanges their feature rows (:func:`~.media.encode_and_exchange`);
- one forward **post-hook**: refuses a forward that carried packing information (``cp_context``,
  ``cu_seq_lens_*``, packed ``position_ids``) in which the attention function was never called.

Filling comes before refusing, so a GPT-2 (absolute positions) under ``guard_model`` gets its
per-document positions instead of a refusal; a model that was only loaded with the attention name
keeps refusing such a batch (nothing is filled without ``guard_model``).

The outermost prepared transformers model owns its tree: preparing a ``PreTrainedModel`` that uses
``blockdiag_cp`` removes the pairs of the models nested in it (transformers prepares ``LlamaModel`` before
``LlamaForCausalLM``), taking over their strictness. A wrapper that is no ``PreTrainedModel`` (a PEFT model,
your own module) gets its own pair and leaves the wrapped model's in place: the wrapper's pre-hook runs
first, so it fills before the wrapped model refuses, and the wrapped model keeps its refusals once
unwrapped. :func:`unprepare_model` removes everything.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from ..compat import forward_hooks, in_autograd_backward
from ..context import BlockDiagCPContext
from ..errors import AgreementError, Refusal
from ..mixer_hooks import install_recurrent, uninstall_recurrent
from ..recurrent.runs import LocalRuns, local_runs
from ..runtime import abandon
from ..sparse.indexer import install_indexers, uninstall_indexers
from .batch import arguments, check_batch, check_cp_loss_count, fill_position_ids, packing, positional_index
from .detect import (
    UnsupportedModel,
    has_absolute_positions,
    loss_refusal,
    model_type,
    packing_refusal,
    padding_refusal,
    resets_at_position_zero,
    uses_blockdiag_cp,
)
from .forward_agreement import agree_forward
from .forward_runs import PROBE_ATTR, Held, check_recompute, install_layer_hooks, remove_layer_hooks
from .head_refusals import check_logits_to_keep, row_pooling_refusal
from .media import encode_and_exchange, is_mrope, refuse_flat_mrope
from .moe_aux import exact_router_aux_loss

__all__ = ["FINDINGS_ATTR", "PROBE_ATTR", "ForwardState", "ModelFindings", "Preparation", "attention_context",
           "held_positions", "package_hooks", "prepare_model", "unprepare_model"]

#: Attribute of every submodule of a prepared model holding the model's :class:`ModelFindings`.
FINDINGS_ATTR = "_blockdiag_cp_findings"
#: Attribute of a prepared model holding its :class:`Preparation`.
PREPARATION_ATTR = "_blockdiag_cp_preparation"


@dataclass(eq=False)
class ModelFindings:
    """What :func:`prepare_model` found about a model (refreshed by each call, read by its hooks).

    Attributes:
        model_type: ``config.model_type`` (for messages).
        refusal: why rows with more than one document (or a CP shard) would be computed wrongly.
        absolute_positions: the model adds learned/absolute position embeddings (``position_ids`` needed).
        position_resets: a recurrent mixer of the model restarts where ``position_ids`` are 0 (``position_ids``
            needed; :data:`~hf_blockdiag_cp.mixer_table.POSITION_RESETS`).
        loss_refusal: why the model's own loss cannot take the collator's ``shift_labels``, or ``None``.
        padding_refusal: ``(token id, why)`` when that token as row padding would make the gradients NaN.
        head_refusal: why the model's head (row pooling) cannot serve packed or sharded rows, or ``None``.
        mrope: the model reads 3-D rope positions of images and videos (Qwen2-VL family, Qwen3-VL, Qwen3.5).
        recurrent_mixers: recurrent mixers served per document fragment (:mod:`hf_blockdiag_cp.recurrent`).
        sparse_indexers: DSA indexers served per document (:mod:`hf_blockdiag_cp.sparse.indexer`).
    """

    model_type: str
    refusal: str | None = None
    absolute_positions: bool = False
    position_resets: bool = False
    loss_refusal: str | None = None
    padding_refusal: tuple[int, str] | None = None
    head_refusal: str | None = None
    mrope: bool = False
    recurrent_mixers: int = 0
    sparse_indexers: int = 0


@dataclass(eq=False)
class ForwardState:
    """The state of a prepared model's forward in progress, shared by all its submodules (under :data:`PROBE_ATTR`).

    Attributes:
        attention_calls: calls of the package's token mixing (the ``"blockdiag_cp"`` attention function, served
            recurrent mixers) by this model's layers.
        starts: ``attention_calls`` at the start of the forward of each hooked module (by ``id``).
        cp_context: the ``cp_context`` (CP > 1) of the forward in progress, set by the pre-hook and cleared by
            the post-hook; every attention call inside that forward must receive it.
        held_context: the ``cp_context`` (CP > 1) of the latest forward, kept after it (activation-checkpoint
            recompute): attention layers called without the model's keyword arguments use it
            (:func:`attention_context`).
        runs: the :class:`~hf_blockdiag_cp.recurrent.runs.LocalRuns` of the latest forward with packed rows or a
            ``cp_context`` (``None``: one document per row), set by the pre-hook of every forward and kept after
            it, so that an activation-checkpoint recompute during backward reads the same fragments (refused while
            two packed forwards wait for one backward, :mod:`.forward_runs`).
        held_positions: ``[B, T]`` the packed ``position_ids`` the latest forward without a ``cp_context`` (CP > 1)
            was given, kept like ``runs``: the document boundaries for attention layers the model does not hand
            them to (granitemoehybrid builds neither its layers' keywords nor its masks from them).
        agreed: the forward in progress passed its agreement (CP > 1): from there on its peers are in its
            collectives, and a raise that leaves them there breaks the group (:func:`_post_forward`).
        replaying: the :class:`~.forward_runs.Held` state of the forward whose checkpointed layer runs now (its
            first run or its recompute in backward), carried by the layer's checkpoint function; read instead of the
            latest forward's (:meth:`held`).
    """

    attention_calls: int = 0
    starts: dict[int, int] = field(default_factory=dict)
    cp_context: BlockDiagCPContext | None = None
    held_context: BlockDiagCPContext | None = None
    runs: LocalRuns | None = None
    held_positions: torch.Tensor | None = None
    agreed: bool = False
    replaying: Held | None = None

    def holds_step(self) -> bool:
        """Whether the held forward state (``held_context``, ``runs``) applies to a call now: during the forward
        (its pre-hook ran, its post-hook not yet) or during a backward (an activation-checkpoint recompute), not
        to a later direct call of a submodule, whose pre-hook does not run."""
        return bool(self.starts) or in_autograd_backward()

    def current(self) -> Held:
        """The latest forward's state, as a snapshot a checkpoint can carry to its recompute."""
        return Held(self, self.runs, self.held_positions, self.held_context)

    def held(self, what: str) -> Held:
        """The state ``what`` (a served mixer, an attention layer, ...) reads now: the forward being replayed, else
        the latest one; the latter refused in a recompute while several packed forwards wait for the backward
        (:func:`~.forward_runs.check_recompute`)."""
        if self.replaying is not None:
            return self.replaying
        check_recompute(self, what)
        return self.current()


@dataclass(eq=False)
class Preparation:
    """What :func:`prepare_model` installed on one model.

    Attributes:
        strict: run the user-level checks and fill ``position_ids`` (turned on by ``guard_model``).
        position_arg: index of ``position_ids`` among the forward's positional parameters, if any.
        handles: the pre- and post-hook, in that order.
    """

    strict: bool
    position_arg: int | None
    handles: tuple[RemovableHandle, RemovableHandle]


def attention_context(module: torch.nn.Module, cp_context: Any) -> Any:
    """What an attention call needs from its model's preparation, in one lookup: counts the call (the post-hook
    refuses a packed forward without one), and returns the call's ``cp_context``: the one it was given, else the
    one its model's forward was given (CP > 1), which the forward's pre-hook holds.

    A decoder layer that calls ``self_attn`` without the model's ``**kwargs`` (stablelm, nemotron, falcon) drops the
    context; without it that layer would attend to this rank's keys only. The held context stays after the forward,
    so an activation-checkpoint recompute during backward finds it too. A call without the context its model's
    forward was given, and with none held (a model whose pre-hook did not run: a prepared submodule called
    directly), is refused, the same on every rank, so every rank raises at the same layer and none is left waiting
    in an exchange. Dict reads, no tensor access.
    """
    state: ForwardState | None = module.__dict__.get(PROBE_ATTR)
    if state is None:
        return cp_context
    state.attention_calls += 1
    if cp_context is not None:
        return cp_context
    if state.holds_step() and (state.replaying is not None or state.held_context is not None):
        held = state.held(f"{type(module).__name__} (attention called without the model's keyword arguments)")
        if held.context is not None:
            return held.context
    if state.cp_context is None:
        return None
    findings: ModelFindings | None = module.__dict__.get(FINDINGS_ATTR)
    raise UnsupportedModel(
        f"{findings.model_type if findings else type(module).__name__} was given a cp_context (CP size "
        f"{state.cp_context.cp_size}) but its {type(module).__name__} was called without it: its layers do not pass "
        "the model's keyword arguments to attention, so each CP rank would attend to its own keys only; blockdiag_cp "
        "cannot run this model with context parallelism (CP size 1 is exact)")


def held_positions(module: torch.nn.Module, length: int) -> torch.Tensor | None:
    """The packed ``position_ids [B, length]`` of the forward in progress (or being recomputed) of ``module``'s
    model, for an attention call that got no boundaries in its keywords (no ``position_ids``, ``cu_seq_lens_*``,
    ``cp_context``); ``None`` when the forward's row is one document, its length differs, or no forward holds.

    transformers' granitemoehybrid passes neither its layers nor its mask builder the model's ``position_ids``:
    without this, its attention layers would attend across the documents of a ``DataCollatorWithFlattening`` row.
    """
    state: ForwardState | None = module.__dict__.get(PROBE_ATTR)
    if state is None or not state.holds_step() or (state.replaying is None and state.held_positions is None):
        return None
    positions = state.held(f"{type(module).__name__} (attention without position_ids)").positions
    return positions if positions is not None and positions.shape[-1] == length else None


def prepare_model(model: torch.nn.Module, *, strict: bool = False) -> torch.nn.Module:
    """Install (or refresh) the findings, the forward state and the one ordered hook pair on ``model``; returns
    ``model``.

    Idempotent: a second call refreshes the findings and keeps the same state and pair. ``strict=True``
    turns on the strict checks (see the module docstring); a later call with ``strict=False`` keeps them.
    """
    state = next((m.__dict__[PROBE_ATTR] for m in model.modules() if PROBE_ATTR in m.__dict__), None)
    findings = next((m.__dict__[FINDINGS_ATTR] for m in model.modules() if FINDINGS_ATTR in m.__dict__), None)
    state = ForwardState() if state is None else state
    findings = ModelFindings(model_type(model)) if findings is None else findings
    findings.model_type = model_type(model)
    findings.refusal = packing_refusal(model)
    findings.absolute_positions = has_absolute_positions(model)
    findings.position_resets = resets_at_position_zero(model)
    findings.loss_refusal = loss_refusal(model)
    findings.padding_refusal = padding_refusal(model)
    findings.head_refusal = row_pooling_refusal(model) or findings.head_refusal  # a wrapper keeps its wrapped model's
    findings.mrope = findings.mrope or is_mrope(model)
    for sub in model.modules():
        sub.__dict__[PROBE_ATTR] = state
        sub.__dict__[FINDINGS_ATTR] = findings
    # Served mixers read the forward's state (its runs, holds_step) and count their calls in it.
    findings.recurrent_mixers = install_recurrent(model, state)
    findings.sparse_indexers = install_indexers(model, state)
    install_layer_hooks(model)  # which packed forwards wait for a checkpoint recompute
    if isinstance(model, PreTrainedModel) and uses_blockdiag_cp(model):  # its pair refuses for its nested models
        for sub in list(model.modules())[1:]:
            nested = sub.__dict__.pop(PREPARATION_ATTR, None)
            if nested is not None:
                strict = strict or nested.strict
                _remove(nested)
    own = model.__dict__.get(PREPARATION_ATTR)
    if own is not None:
        own.strict = own.strict or strict
        return model
    handles = (model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
               # always_call: a forward that raises (an OOM caught by the loop, a refusal) must still clear
               # the forward state, or the next forward of a nested pair would see a stale entry and skip agreeing.
               model.register_forward_hook(_post_forward, with_kwargs=True, always_call=True))
    model.__dict__[PREPARATION_ATTR] = Preparation(strict, positional_index(model, "position_ids"), handles)
    return model


def unprepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Remove everything :func:`prepare_model` installed on ``model`` and the modules in it; returns ``model``.

    Loading or switching a model to ``blockdiag_cp`` again prepares it again.
    """
    for sub in model.modules():
        preparation = sub.__dict__.pop(PREPARATION_ATTR, None)
        if preparation is not None:
            _remove(preparation)
        sub.__dict__.pop(PROBE_ATTR, None)
        sub.__dict__.pop(FINDINGS_ATTR, None)
    uninstall_recurrent(model)
    uninstall_indexers(model)
    remove_layer_hooks(model)
    return model


def package_hooks(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The package's forward pre-hooks and post-hooks registered on ``model`` itself (for checks and tests)."""
    pre, post = forward_hooks(model)
    return [hook for hook in pre if hook is _pre_forward], [hook for hook in post if hook is _post_forward]


def _remove(preparation: Preparation) -> None:
    for handle in preparation.handles:
        handle.remove()


def _pre_forward(module: torch.nn.Module, args: tuple,
                 kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Fill (strict models), then refuse (models using blockdiag_cp): see the module docstring."""
    preparation: Preparation | None = module.__dict__.get(PREPARATION_ATTR)
    state: ForwardState | None = module.__dict__.get(PROBE_ATTR)
    findings: ModelFindings | None = module.__dict__.get(FINDINGS_ATTR)
    if preparation is None or state is None or findings is None:
        return None
    filled = None
    if preparation.strict:
        check_batch(module, kwargs)
        filled = fill_position_ids(preparation.position_arg, args, kwargs)
        if filled is not None:
            args, kwargs = filled
    if uses_blockdiag_cp(module):
        if id(module) in state.starts:  # an earlier forward of this module never finished (BaseException, compile)
            state.starts.clear()
            state.agreed = False
        state.starts[id(module)] = state.attention_calls
        ctx = kwargs.get("cp_context")
        state.cp_context = ctx if getattr(ctx, "cp_size", 1) > 1 else None
        state.held_context = state.cp_context
        _refuse(module, findings, args, kwargs)
        outermost = not any(key != id(module) for key in state.starts)
        if outermost:
            named = arguments(module, args, kwargs)
            packed = packing(named) is not None
            if findings.recurrent_mixers or findings.sparse_indexers:
                state.runs = local_runs(named, packed)
            positions = named.get("position_ids")
            state.held_positions = (positions if packed and state.cp_context is None
                                    and isinstance(positions, torch.Tensor) and positions.dim() == 2 else None)
        if outermost:  # the outermost prepared module of the forward
            try:
                agree_forward(module, arguments(module, args, kwargs))
                state.agreed = state.cp_context is not None
                # CP rows with images: encode this rank's, exchange the feature rows (after the agreement).
                exchanged = encode_and_exchange(module, kwargs)
            except BaseException:
                state.starts.pop(id(module), None)
                raise
            if exchanged is not kwargs:
                return args, exchanged
    return filled


def _refuse(module: torch.nn.Module, probe: ModelFindings, args: tuple, kwargs: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedModel` for a batch the model cannot compute exactly (reads tensor values only
    for models with a refusal or absolute positions)."""
    if getattr(kwargs.get("cp_context"), "cp_size", 1) > 1:
        named = arguments(module, args, kwargs)
        check_cp_loss_count(named)
        check_logits_to_keep(probe.model_type, named)
    if probe.mrope:
        refuse_flat_mrope(probe.model_type, arguments(module, args, kwargs))
    if probe.head_refusal is not None:
        found = packing(arguments(module, args, kwargs))
        if found is not None:
            raise UnsupportedModel(f"blockdiag_cp cannot compute this batch ({found}) exactly: {probe.head_refusal}")
    if probe.loss_refusal is not None:
        _refuse_loss(probe, arguments(module, args, kwargs))
    if probe.padding_refusal is not None:
        _refuse_padding(probe, arguments(module, args, kwargs))
    if probe.refusal is None and not probe.absolute_positions and not probe.position_resets:
        return
    named = arguments(module, args, kwargs)
    if probe.refusal is not None:
        found = packing(named)
        if found is not None:
            raise UnsupportedModel(f"blockdiag_cp cannot compute this batch ({found}) exactly: {probe.refusal}")
    elif named.get("position_ids") is None and (named.get("cu_seq_lens_q") is not None
                                                 or named.get("cp_context") is not None):
        what = ("adds absolute position embeddings" if probe.absolute_positions else
                "restarts its recurrence (and skips its input normalisation) where position_ids are 0")
        raise UnsupportedModel(
            f"{probe.model_type} {what} but this packed batch has no position_ids: every "
            "document after the first would get the positions of its place in the row; pass the per-document "
            "position_ids (PackingCollator and DataCollatorWithFlattening emit them), or call "
            "hf_blockdiag_cp.guard_model(model) to have them supplied from the cp_context")


def _refuse_padding(probe: ModelFindings, named: dict[str, Any]) -> None:
    """Refuse a packed batch padded with the token whose zero embedding makes the gradients NaN (one read of
    ``input_ids``, for such models only)."""
    token, why = probe.padding_refusal
    ids = named.get("input_ids")
    if not isinstance(ids, torch.Tensor) or packing(named) is None and named.get("cp_context") is None:
        return
    if bool((ids == token).any()):
        raise UnsupportedModel(f"blockdiag_cp cannot compute this batch (row padding with token {token}) exactly: "
                               f"{why}")


def _refuse_loss(probe: ModelFindings, named: dict[str, Any]) -> None:
    """Refuse targets the model's own loss would ignore: ``shift_labels`` / ``num_items_in_batch``, or ``labels``
    in a packed batch (its own shift would predict across documents)."""
    given = [name for name in ("shift_labels", "num_items_in_batch") if named.get(name) is not None]
    if not given and named.get("labels") is not None:
        found = packing(named)
        if found is not None:
            given = [f"labels with {found}"]
    if given:
        raise UnsupportedModel(f"{probe.model_type} cannot take {', '.join(given)}: {probe.loss_refusal}")


def _post_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """Refuse a forward with packing information in which the attention function never ran.

    Also runs when the forward (or a pre-hook) raised, with ``output=None``: it then clears this forward's state, so
    that the next forward agrees again and a later call without a ``cp_context`` is not refused, and, for a CP forward
    that raised after its agreement something other than a refusal (raised alike on every rank), records the CP
    group as broken (:func:`~hf_blockdiag_cp.runtime.abandon`): the peers wait in a collective this rank left, and a
    retry must fail at once on every rank rather than meet them in the wrong collective.
    """
    state: ForwardState | None = module.__dict__.get(PROBE_ATTR)
    findings: ModelFindings | None = module.__dict__.get(FINDINGS_ATTR)
    if state is None or findings is None or not uses_blockdiag_cp(module):
        return
    start = state.starts.pop(id(module), None)
    agreed, ctx = state.agreed, state.cp_context
    if not state.starts:  # the outermost prepared module's forward ended: no cp_context is in flight
        state.cp_context, state.agreed = None, False
    if output is None:
        err = sys.exc_info()[1]
        # Refusals, agreement errors and bad input (ValueError / TypeError: the package's checks of the arguments,
        # alike on every rank) leave the group usable; anything else (an OOM, a failed kernel) may strand the peers.
        alike = (Refusal, AgreementError, ValueError, TypeError)
        if agreed and ctx is not None and ctx.group is not None and isinstance(err, Exception) \
                and not isinstance(err, alike):
            abandon(ctx, err)
        return
    if isinstance(module, PreTrainedModel) and getattr(kwargs.get("cp_context"), "cp_size", 1) > 1:
        # MoE: the row's router loss, counted once over the CP ranks (the causal LM's own hook, not a wrapper's)
        exact_router_aux_loss(module, arguments(module, args, kwargs), output)
    if start is None or state.attention_calls != start:
        return
    found = packing(arguments(module, args, kwargs))
    if found is not None:
        raise UnsupportedModel(
            f"{findings.model_type} does not call its attention through transformers' AttentionInterface: it accepted "
            f"attn_implementation='blockdiag_cp' but never called it in a forward with {found}, so its own "
            "attention attended across documents; blockdiag_cp cannot serve this model")
