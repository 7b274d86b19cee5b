"""The per-step context: everything the attention layers of one step need, planned once on the host.

The collator builds one :class:`BlockDiagCPContext` per rank and step; ``model(**batch)`` carries it
as the ``cp_context`` keyword to every attention layer (also through gradient-checkpoint recompute
and the HF ``Trainer``). It is frozen data: layers only read it, and it pickles (DataLoader workers)
to the same bytes before and after a step. What the layers derive from it during the step (device
plans, the rank agreement, the rank's exchange, kernel schedules, byte counters) lives in the
:class:`~hf_blockdiag_cp.runtime.StepRuntime`, shared by a context and
its device copies through one attribute, :attr:`BlockDiagCPContext.origin`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._validate import check_int
from .config import BlockDiagCPConfig
from .distributed.groups import GroupRef, group_to_ref, ref_to_group
from .errors import Refusal
from .planning import PlanError, VarlenPlan, as_doc_ids, build_varlen_plan
from .planning.blocks import BlockSpans, block_spans
from .planning.documents import arange, document_runs
from .planning.exchange import ExchangePlan, plan_exchange
from .planning.fingerprint import data_fingerprint, fingerprint, plan_fingerprint, shard_checksum
from .planning.layout import HeadShape, LayoutPlan, plan_layout
from .planning.media import MediaTransfer
from .planning.placement import Placement, make_placement

__all__ = ["BlockDiagCPContext"]


@dataclass(frozen=True, eq=False)
class BlockDiagCPContext:
    """Per-step block-diagonal CP metadata for one rank.

    Attributes:
        doc_ids: ``[B, S]`` int32 CPU document ids of the full (all-rank) rows, 0 = padding.
        cp_rank / cp_size: this rank's index in the CP group and the group size.
        group: the CP process group (``None`` when ``cp_size == 1``).
        row_offset: global position of local row 0 (``cp_rank * local_len`` for contiguous placement).
        local_len: ``L = S / cp_size`` local rows per batch row.
        local_index: ``[L]`` int64 global position of every local row (ascending; the placement's row).
        plan: this rank's :class:`~hf_blockdiag_cp.planning.VarlenPlan` (CPU; see :meth:`to`).
        exchange: the K/V :class:`~hf_blockdiag_cp.planning.exchange.ExchangePlan` for
            ``cp_size > 1`` (``None`` on one rank).
        data_fingerprint: hash of the step's rows (document ids, and token ids when the collator
            gives them); CP ranks compare it before their first exchange.
        config: the :class:`~hf_blockdiag_cp.config.BlockDiagCPConfig` of this step.
        placement: which positions every CP rank holds (``None`` on one rank).
        window_plans: per planned sliding window, the varlen and exchange plans of windowed layers.
        plan_fingerprint: hash of what every CP rank must have planned alike (placement, windows,
            exchange strategies, backend request); compared in the step's agreement.
        local_position_ids: ``[B, L]`` int64 CPU position ids of this rank's rows when the full rows' were given
            (the collators give them), else ``None``; :func:`~hf_blockdiag_cp.guard_model` supplies them to a
            forward that lacks ``position_ids``. Only this rank's share: the context carries no row-long ids
            beyond ``doc_ids``.
        layout: the step's head-parallel (Ulysses) :class:`~hf_blockdiag_cp.planning.layout.LayoutPlan` when
            ``config.ulysses_size != 1`` (``None``: today's sequence-only layout). When it chose ``u > 1``
            (:attr:`ulysses_size`), ``placement`` is the layout's ``[P, L]`` table, and ``plan``,
            ``exchange`` and ``window_plans`` are this rank's *sequence group's*: ``u * L`` query rows
            after the head all-to-all, and the ``c``-rank exchange between groups (run as rank ``cp_rank // u``).
        head_group / seq_group: the process groups of the ``u`` consecutive CP ranks of this rank and of
            the ``c`` ranks of equal ``cp_rank % u`` (``None`` unless ``u > 1``).
        blocks: the step's bidirectional blocks (:class:`~hf_blockdiag_cp.planning.blocks.BlockSpans`; empty when
            ``block_ids`` were given and mark none: a text-only row of a model with image blocks is plain causal; from
            ``block_ids``), or ``None``: the plans then hold non-causal segments for them, and the exchange covers
            the later keys of a block held by another rank.
        shard_checksum: this rank's ``(input_ids, position_ids)`` checksums
            (:func:`~hf_blockdiag_cp.planning.fingerprint.shard_checksum`) of the rows its forward must
            receive, ``-1`` where the collator did not give that tensor (``()`` on one rank); every forward's
            agreement compares them with what the forward actually got. Only this rank's: computing every
            rank's would be a pass over the whole row, and no rank checks another's tensors.
        media: this rank's :class:`~hf_blockdiag_cp.planning.media.MediaTransfer` (CP > 1, rows with images or
            videos): the items it encodes and where their feature rows go; ``None`` otherwise.

    One attribute is not a field (not compared, not pickled, not carried by ``dataclasses.replace``):
    ``origin``, the context a device copy was made from by :meth:`to` (``None`` on the context the
    collator built). The attention layers key the step's runtime by ``origin or self``, so a context and
    its device copies share one (:func:`hf_blockdiag_cp.runtime.step_runtime`).
    """

    doc_ids: torch.Tensor
    cp_rank: int
    cp_size: int
    group: Any
    row_offset: int
    local_len: int
    local_index: torch.Tensor
    plan: VarlenPlan
    exchange: ExchangePlan | None = None
    data_fingerprint: int = 0
    config: BlockDiagCPConfig = field(default_factory=BlockDiagCPConfig)
    placement: Placement | None = None
    window_plans: dict[int, tuple[VarlenPlan, ExchangePlan]] = field(default_factory=dict)
    local_position_ids: torch.Tensor | None = None
    plan_fingerprint: int = 0
    layout: LayoutPlan | None = None
    head_group: Any = None
    seq_group: Any = None
    shard_checksum: tuple[int, ...] = ()
    media: MediaTransfer | None = None
    blocks: BlockSpans | None = None
    if TYPE_CHECKING:  # set by __post_init__ / to(), not a dataclass field
        origin: BlockDiagCPContext | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "origin", None)

    @classmethod
    def build(cls, doc_ids: torch.Tensor, *, cp_rank: int = 0, cp_size: int = 1, group: Any = None,
              config: BlockDiagCPConfig | None = None, input_ids: torch.Tensor | None = None,
              placement: str | Placement | None = None,
              sliding_windows: Sequence[int | None] = (),
              position_ids: torch.Tensor | None = None, heads: HeadShape | None = None,
              ulysses_groups: Any = None, block_ids: torch.Tensor | None = None) -> BlockDiagCPContext:
        """Plan one rank's step: which positions it holds, its kernel segments and its K/V exchange.

        Args:
            doc_ids: ``[S]`` or ``[B, S]`` full-row document ids (the same on every CP rank).
            cp_rank, cp_size: position in the CP group; ``S`` must be divisible by ``cp_size``.
            group: the CP process group (required when ``cp_size > 1`` for the exchange).
            config: defaults to ``BlockDiagCPConfig()`` (environment-overridable).
            input_ids: the full rows' token ids, if known: included in ``data_fingerprint`` so
                that CP ranks holding different tokens are caught, not only different layouts.
            placement: a kind (default ``config.placement``) or a ready
                :class:`~hf_blockdiag_cp.planning.placement.Placement`; ignored at ``cp_size == 1``.
            sliding_windows: the model's attention windows (``None`` for full layers). Each finite
                window gets its own plans, so a windowed layer receives only the keys inside its
                window; a layer whose window was not planned uses the full plans (exact, more bytes).
                The balanced placement's work model averages over them.
            position_ids: the full rows' ``[S]`` / ``[B, S]`` position ids, if known: under CP they are
                part of the step (a rank-local ``arange`` is wrong on every rank but the first). mrope models'
                ``[4, B, S]`` (text row, then the three rope rows) are sharded and checked the same way.
            heads: the attention layers' head geometry; needed when ``config.ulysses_size != 1``.
            ulysses_groups: the :class:`~hf_blockdiag_cp.distributed.ulysses.UlyssesGroups` made at setup
                (:func:`hf_blockdiag_cp.ulysses_groups`); needed when a step chooses ``u > 1``.
            block_ids: ``[S]`` / ``[B, S]`` bidirectional blocks of the full rows (0 = causal token, ``k > 0``: member
                of block ``k``; a block is a maximal run of one id inside one document): a block's tokens see each
                other both ways, "causal, or same block" (gemma3's image tokens, PaliGemma's prefix: the collator
                derives them from the documents' ``token_type_ids``). See :mod:`hf_blockdiag_cp.planning.blocks`.

        Raises ``ValueError`` when ``group`` is a live process group whose size is not ``cp_size``, or when
        ``block_ids`` is malformed (shape, negative ids, a block on padding or across a document boundary).
        """
        config = config or BlockDiagCPConfig()
        ids = as_doc_ids(doc_ids)
        check_int("cp_size", cp_size, minimum=1)
        check_int("cp_rank", cp_rank, minimum=0, below=("cp_size", cp_size))
        full_len = ids.shape[1]
        if full_len % cp_size:
            raise ValueError(f"the row length S={full_len} is not divisible by cp_size={cp_size}")
        _check_group_size(group, cp_size)
        positions = None
        if position_ids is not None:
            positions = torch.as_tensor(position_ids).detach().to("cpu", torch.int64)
            positions = positions.expand(ids.shape[0], -1) if positions.dim() == 1 else positions
            if positions.shape[-2:] != ids.shape or positions.dim() not in (2, 3):
                raise ValueError(f"position_ids has shape {tuple(positions.shape)} but doc_ids has "
                                 f"{tuple(ids.shape)}; both describe the full rows")
            positions = positions.contiguous()
        local_len = full_len // cp_size
        windows = sorted({w for w in sliding_windows if w is not None})
        for w in windows:
            check_int("sliding_windows", w, minimum=1)
        doc_ids32 = ids.to(torch.int32).contiguous()
        tokens = _full_rows(input_ids, ids.shape)
        blocks = None
        found = None  # what the context records: the blocks given, an empty set when block_ids hold none
        if block_ids is not None:
            found = block_spans(block_ids, ids)
            blocks = found if found.count else None  # no block: planned as plain causal, as without block_ids
        common = dict(doc_ids=doc_ids32, cp_rank=cp_rank, cp_size=cp_size, group=group,
                      local_len=local_len, data_fingerprint=data_fingerprint(doc_ids32, tokens), config=config,
                      blocks=found)
        if cp_size == 1:
            plan = build_varlen_plan(ids, local_len=local_len, validate=config.validate, blocks=blocks)
            # A copy: the context outlives the rows it was built from (a collator reuses their buffers).
            local_positions = None if positions is None else positions.clone()
            # Without blocks the kernel applies a window to the full plan; a block's queries need their window in
            # the plan (no exchange on one rank).
            window_plans = {} if blocks is None else {w: (build_varlen_plan(
                ids, local_len=local_len, validate=config.validate, blocks=blocks, window=w), None) for w in windows}
            return cls(row_offset=0, local_index=arange(local_len), plan=plan, local_position_ids=local_positions,
                       window_plans=window_plans, **common)
        layout = None
        if config.ulysses_size != 1 and blocks is not None:
            raise Refusal(f"bidirectional blocks (block_ids) are not implemented with the head-parallel "
                          f"layout (ulysses_size={config.ulysses_size!r}); use ulysses_size=1")
        if config.ulysses_size != 1:
            layout = _plan_layout(ids, cp_size, config, placement, sliding_windows, heads)
            if layout.ulysses_size > 1:
                return _layout_context(cls, layout, ids, cp_rank, ulysses_groups, windows, common,
                                       placement or config.placement, tokens, positions)
            placement = layout.placement  # auto chose u = 1: today's layout on the same placement
        # The row's documents as runs, found once: the placement and every window's exchange and varlen plans
        # start from them (each would otherwise scan the row again).
        documents = document_runs(ids[0])
        if not isinstance(placement, Placement):
            placement = make_placement(ids[0], cp_size, placement or config.placement,
                                       tolerance=config.balance_tolerance,
                                       windows=tuple(sliding_windows) or (None,), documents=documents)
        pieces = placement.pieces(cp_rank)

        def plans(window: int | None) -> tuple[VarlenPlan, ExchangePlan]:
            exchange = plan_exchange(ids, cp_size=cp_size, config=config, placement=placement, window=window,
                                     documents=documents, blocks=blocks)
            positions = exchange.for_rank(cp_rank).buffer_positions
            exchange.for_rank(cp_rank).send_index  # expanded here, on the host, not in the first layer
            return build_varlen_plan(ids, local_len=local_len, pieces=pieces, kv_positions=positions, window=window,
                                     validate=config.validate, documents=documents, blocks=blocks), exchange

        plan, exchange = plans(None)
        window_plans = {w: plans(w) for w in windows}
        local_index = placement.positions(cp_rank)  # its own storage: pickles L positions, not P * L
        # Per-field plan fingerprint (issue 17): the agreement can then name the field ranks differ in.
        planned = [(None, exchange), *((w, ex) for w, (_, ex) in window_plans.items())]
        plan_fp = plan_fingerprint(config, cp_size=cp_size, placement_kind=placement.kind,
                                   placement_rows=placement, windows=[w for w, _ in planned],
                                   strategies=[str(ex.strategy) for _, ex in planned],
                                   blocks=None if blocks is None else blocks.key())
        return cls(row_offset=int(local_index[0]), local_index=local_index, plan=plan, exchange=exchange,
                   placement=placement, window_plans=window_plans, plan_fingerprint=plan_fp, layout=layout,
                   **_own_shard(local_index, tokens, positions), **common)

    @property
    def ulysses_size(self) -> int:
        """``u``: CP ranks per head-parallel subgroup in this step (1: sequence parallelism only)."""
        return 1 if self.layout is None else self.layout.ulysses_size

    def plans_for(self, window: int | None) -> tuple[VarlenPlan, ExchangePlan | None]:
        """The varlen and exchange plans of a layer with sliding ``window`` (the full ones if that
        window was not planned: exact, only more K/V moved)."""
        return self.window_plans.get(window, (self.plan, self.exchange)) if window is not None else (
            self.plan, self.exchange)

    def __getstate__(self) -> dict[str, Any]:
        # Batches come back from DataLoader workers pickled: the fields only, the group by name.
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _GROUP_FIELDS:
            state[name] = group_to_ref(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {**state, **{name: ref_to_group(state.get(name)) for name in _GROUP_FIELDS}}
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def batch_size(self) -> int:
        return self.doc_ids.shape[0]

    @property
    def full_len(self) -> int:
        return self.doc_ids.shape[1]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> BlockDiagCPContext:
        """This context with its plans' few small tensors on ``device`` (``self`` when they are there already).

        For ``accelerate.utils.send_to_device`` (hence ``non_blocking``), once per batch: each call makes
        a new copy, whose :attr:`origin` is this context's origin. Attention layers do not call it; they
        take the step's device plans from the runtime, which copies once per device.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.plan.device == device:
            return self
        window_plans = {w: (plan.to(device), exchange) for w, (plan, exchange) in self.window_plans.items()}
        moved = dataclasses.replace(self, plan=self.plan.to(device), window_plans=window_plans)
        object.__setattr__(moved, "origin", self if self.origin is None else self.origin)
        return moved

    def with_media(self, media: MediaTransfer) -> BlockDiagCPContext:
        """This context with its row's media exchange; the plan joins the data fingerprint (ranks that planned
        different encoders or feature rows fail the step's agreement before any exchange)."""
        fp = fingerprint(self.data_fingerprint.to_bytes(8, "little"), media.key)
        return dataclasses.replace(self, media=media, data_fingerprint=fp)

    def check_local(self, batch_size: int, local_len: int) -> None:
        """Raise if an attention call's local shapes disagree with this context."""
        if batch_size != self.batch_size or local_len != self.local_len:
            raise PlanError(f"cp_context plans [B={self.batch_size}, L={self.local_len}] local rows but the attention "
                            f"layer got [B={batch_size}, L={local_len}]; was the batch built by this context's "
                            f"collator?")


def _full_rows(input_ids: Any, shape: torch.Size) -> torch.Tensor | None:
    """``input_ids`` as CPU int64 ``[B, S]`` rows of ``shape`` (a 1-D row is shared by every batch row), or
    ``None`` when not given or of another shape (nothing to hash or compare against)."""
    if input_ids is None:
        return None
    tokens = torch.as_tensor(input_ids).detach().to("cpu", torch.int64)
    tokens = tokens.expand(shape[0], -1) if tokens.dim() == 1 else tokens
    return tokens if tokens.shape == shape else None


def _own_shard(local_index: torch.Tensor, tokens: torch.Tensor | None,
               positions: torch.Tensor | None) -> dict[str, Any]:
    """This rank's share of the full rows ``tokens`` / ``positions`` (``[B, S]`` or ``None``): its ``[B, L]``
    position ids and the checksums of the ``input_ids`` / ``position_ids`` shard its forward must receive (``-1``:
    not known); gathers of its ``L`` positions, no pass over the row."""
    local_positions = None if positions is None else positions.index_select(positions.dim() - 1, local_index)
    sums = (-1 if tokens is None else int(shard_checksum(tokens.index_select(1, local_index))),
            -1 if local_positions is None else int(shard_checksum(local_positions)))
    return {"local_position_ids": local_positions, "shard_checksum": sums}


def _check_group_size(group: Any, cp_size: int) -> None:
    """A live process group must have ``cp_size`` ranks (a group only named, or none, is checked by the
    step's rank agreement once it is attached)."""
    if group is None or isinstance(group, GroupRef) or not dist.is_initialized():
        return
    size = dist.get_world_size(group)
    if size != cp_size:
        raise ValueError(f"cp_size={cp_size} but the process group given has {size} ranks; build the context "
                         f"(collator) with the group's size, e.g. group=mesh['cp']")


#: The context's process-group fields (pickled by name).
_GROUP_FIELDS = ("group", "head_group", "seq_group")


def _plan_layout(ids: torch.Tensor, cp_size: int, config: BlockDiagCPConfig, placement: str | Placement | None,
                 sliding_windows: Sequence[int | None], heads: HeadShape | None) -> LayoutPlan:
    """The step's ``u x c`` layout (``config.ulysses_size != 1``), its ``c`` groups placed by ``placement``."""
    if isinstance(placement, Placement):
        raise ValueError(f"a ready Placement cannot be combined with ulysses_size={config.ulysses_size!r}: the layout "
                         "places the sequence groups itself; pass a placement kind")
    if heads is None:
        raise ValueError(f"ulysses_size={config.ulysses_size!r} needs the model's head shape: pass "
                         "heads=HeadShape(...) (PackingCollator: heads= or model_config=model.config)")
    if placement is not None and placement != config.placement:
        config = dataclasses.replace(config, placement=placement)
    return plan_layout(ids, cp_size=cp_size, heads=heads, windows=tuple(sliding_windows) or (None,), config=config)


def _layout_context(cls: type[BlockDiagCPContext], layout: LayoutPlan, ids: torch.Tensor, cp_rank: int,
                    ulysses_groups: Any, windows: list[int], common: dict[str, Any],
                    placement_kind: str, tokens: torch.Tensor | None,
                    positions: torch.Tensor | None) -> BlockDiagCPContext:
    """Rank ``cp_rank``'s context under a ``u > 1`` layout: its sequence group's plans (``u * L`` query rows)."""
    u, c = layout.ulysses_size, layout.seq_groups
    if ulysses_groups is None:
        raise ValueError(f"this step's layout uses ulysses_size={u}, but no head-parallel subgroups were given: create "
                         "them at setup with hf_blockdiag_cp.ulysses_groups(mesh, sizes=...) and pass them as "
                         "ulysses_groups=")
    head_group, seq_group = ulysses_groups.get(u)
    config: BlockDiagCPConfig = common["config"]
    group, _ = layout.position(cp_rank)
    group_placement = layout.group_placement
    pieces = group_placement.pieces(group)

    def plans(window: int | None) -> tuple[VarlenPlan, ExchangePlan]:
        exchange = layout.exchange(window) if window in layout.windows else plan_exchange(
            ids, cp_size=c, config=config, placement=group_placement, window=window)
        positions = exchange.for_rank(group).buffer_positions
        exchange.for_rank(group).send_index  # expanded here, on the host, not in the first layer
        return build_varlen_plan(ids, local_len=u * common["local_len"], pieces=pieces, kv_positions=positions,
                                 window=window, validate=config.validate), exchange

    plan, exchange = plans(None)
    window_plans = {w: plans(w) for w in windows}
    local_index = layout.placement.index[cp_rank].clone()
    planned = [(None, exchange), *((w, ex) for w, (_, ex) in window_plans.items())]
    key = layout.key() + repr(layout.heads).encode()  # the head split too: the all-to-all's sizes follow it
    # The requested kind (one group's placement is contiguous whatever was asked): ranks compare requests.
    plan_fp = plan_fingerprint(config, cp_size=common["cp_size"], placement_kind=placement_kind,
                               placement_rows=layout.placement, windows=[w for w, _ in planned],
                               strategies=[str(ex.strategy) for _, ex in planned], ulysses_size=u, layout=key,
                               ulysses_groups=getattr(ulysses_groups, "tag", 0))
    return cls(row_offset=int(local_index[0]), local_index=local_index, plan=plan, exchange=exchange,
               placement=layout.placement, window_plans=window_plans, plan_fingerprint=plan_fp, layout=layout,
               head_group=head_group, seq_group=seq_group,
               **_own_shard(local_index, tokens, positions), **common)
