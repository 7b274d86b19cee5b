"""Explicit configuration that travels with every per-step context.

Every field has a documented environment variable that overrides its *default*; values passed
explicitly to :class:`BlockDiagCPConfig` always win. Nothing here is global state: a config is an
immutable value built once and carried by :class:`~hf_blockdiag_cp.context.BlockDiagCPContext`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

__all__ = ["ATTN_IMPLEMENTATION", "BACKENDS", "BUILTIN_BACKENDS", "KV_EXCHANGES", "PLACEMENTS", "RECURRENT_BACKENDS",
           "RECURRENT_LAYOUTS", "BlockDiagCPConfig", "ENV_VARS", "add_backend_name", "backend_choices"]

#: The name this package registers with transformers (``attn_implementation="blockdiag_cp"``).
ATTN_IMPLEMENTATION = "blockdiag_cp"

#: The built-in attention kernel backends ("auto" picks per device and dtype); what each can run is declared in
#: its module's ``CAPABILITIES`` (:mod:`hf_blockdiag_cp.kernels`), which also checks this list.
BUILTIN_BACKENDS: tuple[str, ...] = ("auto", "flash", "te", "torch_varlen", "flex", "sdpa_doc", "sdpa_mask")
#: Every backend name: ``"auto"``, the built-in ones, then the registered ones (:func:`backend_choices`). Declared
#: only: each read goes through ``__getattr__``, so it lists the backends registered after this import too.
BACKENDS: tuple[str, ...]
#: Backends registered beyond the built-in ones (:func:`hf_blockdiag_cp.kernels.register_backend` is its owner).
_REGISTERED: list[str] = []


def add_backend_name(name: str) -> None:
    """Accept ``name`` as a backend in configurations (called by ``kernels.register_backend`` only)."""
    if name not in BUILTIN_BACKENDS and name not in _REGISTERED:
        _REGISTERED.append(name)


def backend_choices() -> tuple[str, ...]:
    """Every name ``BlockDiagCPConfig.backend`` accepts: ``"auto"`` and every registered backend, in registration
    order (the built-in ones first); also what ``BACKENDS`` is."""
    return BUILTIN_BACKENDS + tuple(_REGISTERED)


def __getattr__(name: str) -> tuple[str, ...]:
    # ``BACKENDS`` is read from the registry each time it is asked for, so it names the backends registered after
    # this module was imported too (``from hf_blockdiag_cp.config import BACKENDS`` reads it once, at that import).
    if name == "BACKENDS":
        return backend_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
#: K/V exchange strategies across context-parallel ranks.
KV_EXCHANGES: tuple[str, ...] = ("auto", "allgather", "halo", "a2a")
#: Kernels of recurrent token mixers (:mod:`hf_blockdiag_cp.recurrent.backend`): ``"model"`` calls the model's own
#: function once per document fragment, ``"torch"`` the package's chunked ops once per call (``cu_seqlens``),
#: ``"fla"`` / ``"mamba_ssm"`` their GPU adapters, ``"auto"`` picks per device and mixer kind.
RECURRENT_BACKENDS: tuple[str, ...] = ("auto", "model", "torch", "fla", "mamba_ssm")
#: Which row positions each CP rank holds (see :mod:`hf_blockdiag_cp.planning.placement`).
PLACEMENTS: tuple[str, ...] = ("balanced", "contiguous", "zigzag", "mirror")
#: How recurrent layers (scans, causal convolutions) run under CP: ``"state"`` passes fragment summaries between the
#: sequence shards (:mod:`hf_blockdiag_cp.recurrent.driver`), ``"heads"`` splits their heads over the CP group
#: and runs whole rows (:mod:`hf_blockdiag_cp.recurrent.head_parallel`).
RECURRENT_LAYOUTS: tuple[str, ...] = ("state", "heads")

#: Environment variable overriding the default of each field.
ENV_VARS: dict[str, str] = {
    "backend": "HF_BLOCKDIAG_CP_BACKEND",
    "kv_exchange": "HF_BLOCKDIAG_CP_KV_EXCHANGE",
    "deterministic": "HF_BLOCKDIAG_CP_DETERMINISTIC",
    "validate": "HF_BLOCKDIAG_CP_VALIDATE",
    "flash_prefix_guard": "HF_BLOCKDIAG_CP_FLASH_PREFIX_GUARD",
    "collective_timeout_s": "HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S",
    "disabled_backends": "HF_BLOCKDIAG_CP_DISABLE_BACKENDS",
    "placement": "HF_BLOCKDIAG_CP_PLACEMENT",
    "balance_tolerance": "HF_BLOCKDIAG_CP_BALANCE_TOLERANCE",
    "ulysses_size": "HF_BLOCKDIAG_CP_ULYSSES_SIZE",
    "layout_flops_per_byte": "HF_BLOCKDIAG_CP_LAYOUT_FLOPS_PER_BYTE",
    "recurrent_layout": "HF_BLOCKDIAG_CP_RECURRENT_LAYOUT",
    "recurrent_backend": "HF_BLOCKDIAG_CP_RECURRENT_BACKEND",
}

#: Longest collective timeout accepted (a year): ``datetime.timedelta`` and the process-group
#: timeouts overflow on larger values such as ``inf``.
_MAX_TIMEOUT_S = 365 * 24 * 3600.0
#: Shortest collective timeout accepted: torch hands timeouts to gloo/NCCL as whole milliseconds
#: (``work.wait(timedelta)`` truncates), and 0 ms there means *no timeout* — 0.0005 s would wait forever.
_MIN_TIMEOUT_S = 1e-3

#: Process groups wait this much longer than the package's own collectives (at least
#: ``_PG_MARGIN_MIN_S`` seconds, else this fraction of ``collective_timeout_s``): a stall inside a CP
#: collective then ends with the package's own ``CollectiveError`` first, and NCCL's watchdog (which
#: aborts the process at the group's timeout) fires only after that error was raised.
_PG_MARGIN_FRACTION = 0.1
_PG_MARGIN_MIN_S = 10.0

#: Default of ``layout_flops_per_byte``: effective bf16 attention throughput over NVLink bandwidth per
#: direction on one H100/H200 node (400 TFLOP/s over 450 GB/s, see :mod:`hf_blockdiag_cp.planning.layout`).
DEFAULT_LAYOUT_FLOPS_PER_BYTE = 400e12 / 450e9

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env_str(name: str, default: str) -> str:
    return os.environ.get(ENV_VARS[name], default).strip().lower()


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(ENV_VARS[name])
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VARS[name]}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _env_names(name: str) -> tuple[str, ...]:
    raw = os.environ.get(ENV_VARS[name], "")
    return tuple(part.strip().lower() for part in raw.split(",") if part.strip())


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(ENV_VARS[name])
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as err:
        raise ValueError(f"{ENV_VARS[name]}={raw!r} is not a number") from err


def _ulysses_size(value: object, name: str, note: str = "") -> int | str:
    """``value`` as a positive int or ``"auto"`` (digit strings accepted: they come from env and CLI)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit() and int(text) >= 1:
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{name}={value!r}{note} must be a positive int (ranks per head-parallel group; 1 = no head "
                     "parallelism) or 'auto'")


def _env_ulysses_size() -> int | str:
    raw = os.environ.get(ENV_VARS["ulysses_size"])
    return 1 if raw is None else _ulysses_size(raw, ENV_VARS["ulysses_size"])


@dataclass(frozen=True)
class BlockDiagCPConfig:
    """Configuration of block-diagonal (context-parallel) attention.

    Attributes:
        backend: attention kernel, one of :data:`BACKENDS`. ``"auto"`` picks ``flash`` > ``te`` >
            ``torch_varlen`` > ``sdpa_doc`` on CUDA and ``sdpa_doc`` on CPU. An explicitly chosen
            backend that cannot run (not installed, wrong device or dtype) falls back to the
            ``"auto"`` choice with a warning, on every rank together. Env: ``HF_BLOCKDIAG_CP_BACKEND``.
        kv_exchange: how K/V reach the ranks that need them, one of :data:`KV_EXCHANGES`.
            Env: ``HF_BLOCKDIAG_CP_KV_EXCHANGE``.
        deterministic: ask kernels for deterministic backward passes (flash ``deterministic=True``).
            Env: ``HF_BLOCKDIAG_CP_DETERMINISTIC``.
        validate: check every plan on the host before a kernel sees it (cheap, once per step).
            Env: ``HF_BLOCKDIAG_CP_VALIDATE``.
        flash_prefix_guard: run segments whose keys start before their queries (the document
            straddling a shard boundary) through fixed-length flash, the rest in one varlen call.
            Env: ``HF_BLOCKDIAG_CP_FLASH_PREFIX_GUARD``.
        collective_timeout_s: bound on every collective this package issues (rank agreement, K/V
            exchange), so that a rank whose peer failed raises a clear error instead of hanging. The
            process groups of training (DDP/FSDP collectives, the mesh) are bounded by
            :attr:`process_group_timeout` (this plus a margin): see ``init_device_mesh``. At least
            1 ms (gloo and NCCL count whole milliseconds; 0 ms would mean no timeout).
            Env: ``HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S``.
        disabled_backends: backends this process must not use (e.g. a kernel known to be broken on
            one machine); the rank agreement makes every rank avoid them together.
            Env: ``HF_BLOCKDIAG_CP_DISABLE_BACKENDS`` (comma-separated names).
        placement: which positions of a packed row each CP rank holds, one of :data:`PLACEMENTS`:
            ``"balanced"`` balances causal work over ranks splitting as few documents as possible,
            ``"contiguous"`` gives rank ``r`` the ``r``-th slice, ``"zigzag"`` chunks ``r`` and
            ``2P-1-r`` of ``2P``, ``"mirror"`` zigzag's two stretches per rank with split points chosen to balance
            work, over the documents lightest per token first (at most two recurrent state summaries per rank).
            Env: ``HF_BLOCKDIAG_CP_PLACEMENT``.
        balance_tolerance: ``"balanced"`` stops splitting documents once the most loaded rank is
            within this fraction of the mean (smaller: better balance, more K/V moved).
            Env: ``HF_BLOCKDIAG_CP_BALANCE_TOLERANCE``.
        ulysses_size: ``u``, ranks per head-parallel (Ulysses) subgroup: the CP group of ``P`` ranks
            splits as ``P = u x c``, each subgroup of ``u`` consecutive ranks holding its ``u * L``
            tokens with ``Hq / u`` heads per rank. ``1`` (default) is sequence parallelism only,
            ``P`` is pure Ulysses, ``"auto"`` picks per step the ``u`` of least modelled cost
            (:func:`hf_blockdiag_cp.planning.layout.plan_layout`). Env: ``HF_BLOCKDIAG_CP_ULYSSES_SIZE``.
        layout_flops_per_byte: the cost model of ``ulysses_size="auto"``: attention FLOPs a device
            computes in the time its link moves one byte per direction (default 400 TFLOP/s over
            450 GB/s, one NVLink H100/H200 node). Larger: bytes dearer against compute, so layouts
            moving fewer bytes win more often (see :mod:`hf_blockdiag_cp.planning.layout`).
            Env: ``HF_BLOCKDIAG_CP_LAYOUT_FLOPS_PER_BYTE``.
        recurrent_layout: how recurrent layers (Mamba2/SSD and gated delta rule scans, causal convolutions) run
            under CP, one of :data:`RECURRENT_LAYOUTS`: ``"state"`` (default) keeps them on the sequence shards
            and passes each fragment's fixed-size summary between ranks (one all-gather per layer and direction,
            bytes independent of the row length); ``"heads"`` is the head-parallel fallback: every rank gets the
            whole row for ``1 / P`` of the layer's heads (channels) by an all-to-all over the CP group, runs each
            document whole and sends the outputs back (bytes grow with the row; see docs/layouts.md). Part of
            the step's plan fingerprint (all ranks agree before a recurrent collective).
            Env: ``HF_BLOCKDIAG_CP_RECURRENT_LAYOUT``.
        recurrent_backend: kernels of recurrent token mixers (Mamba1/2, gated delta rule, KDA, short
            convolutions), one of :data:`RECURRENT_BACKENDS`: ``"model"`` runs the model's own function once per
            document fragment, ``"torch"`` the package's chunked ops once per call over all fragments,
            ``"fla"`` / ``"mamba_ssm"`` their libraries on CUDA (the torch op where a library does not cover a
            call), ``"auto"`` (default) the fastest exact choice per device and mixer kind. A call the ops cannot
            express takes ``"model"``. Every CP rank must ask for the same (the forward agreement checks it).
            Env: ``HF_BLOCKDIAG_CP_RECURRENT_BACKEND``.
    """

    backend: str = field(default_factory=lambda: _env_str("backend", "auto"))
    kv_exchange: str = field(default_factory=lambda: _env_str("kv_exchange", "auto"))
    deterministic: bool = field(default_factory=lambda: _env_bool("deterministic", False))
    validate: bool = field(default_factory=lambda: _env_bool("validate", True))
    flash_prefix_guard: bool = field(default_factory=lambda: _env_bool("flash_prefix_guard", True))
    collective_timeout_s: float = field(default_factory=lambda: _env_float("collective_timeout_s", 600.0))
    disabled_backends: tuple[str, ...] = field(default_factory=lambda: _env_names("disabled_backends"))
    placement: str = field(default_factory=lambda: _env_str("placement", "balanced"))
    balance_tolerance: float = field(default_factory=lambda: _env_float("balance_tolerance", 0.05))
    ulysses_size: int | str = field(default_factory=_env_ulysses_size)
    layout_flops_per_byte: float = field(
        default_factory=lambda: _env_float("layout_flops_per_byte", DEFAULT_LAYOUT_FLOPS_PER_BYTE))
    recurrent_layout: str = field(default_factory=lambda: _env_str("recurrent_layout", "state"))
    recurrent_backend: str = field(default_factory=lambda: _env_str("recurrent_backend", "auto"))

    def __post_init__(self) -> None:
        backends = backend_choices()
        if not isinstance(self.backend, str) or self.backend.lower() not in backends:
            raise ValueError(f"backend={self.backend!r} (env {ENV_VARS['backend']}) is not one of "
                             f"{', '.join(backends)}")
        if not isinstance(self.kv_exchange, str) or self.kv_exchange.lower() not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange={self.kv_exchange!r} (env {ENV_VARS['kv_exchange']}) is not one of "
                             f"{', '.join(KV_EXCHANGES)}")
        if not isinstance(self.placement, str) or self.placement.lower() not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} (env {ENV_VARS['placement']}) is not one of "
                             f"{', '.join(PLACEMENTS)}")
        object.__setattr__(self, "placement", self.placement.lower())
        if not isinstance(self.recurrent_layout, str) or self.recurrent_layout.lower() not in RECURRENT_LAYOUTS:
            raise ValueError(f"recurrent_layout={self.recurrent_layout!r} (env {ENV_VARS['recurrent_layout']}) is not "
                             f"one of {', '.join(RECURRENT_LAYOUTS)}")
        object.__setattr__(self, "recurrent_layout", self.recurrent_layout.lower())
        if (not isinstance(self.recurrent_backend, str)
                or self.recurrent_backend.lower() not in RECURRENT_BACKENDS):
            raise ValueError(f"recurrent_backend={self.recurrent_backend!r} (env {ENV_VARS['recurrent_backend']}) is "
                             f"not one of {', '.join(RECURRENT_BACKENDS)}")
        object.__setattr__(self, "recurrent_backend", self.recurrent_backend.lower())
        tolerance = self.balance_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 10:
            raise ValueError(f"balance_tolerance={tolerance!r} (env {ENV_VARS['balance_tolerance']}) must be a "
                             "number in [0, 10)")
        object.__setattr__(self, "backend", self.backend.lower())
        object.__setattr__(self, "kv_exchange", self.kv_exchange.lower())
        names = self.disabled_backends
        if isinstance(names, str) or not all(isinstance(name, str) for name in names):
            raise TypeError(f"disabled_backends={names!r} (env {ENV_VARS['disabled_backends']}) must be a tuple of "
                            "backend names")
        disabled = tuple(name.lower() for name in names)
        unknown = [name for name in disabled if name not in backends or name == "auto"]
        if unknown:
            raise ValueError(f"disabled_backends={unknown!r} (env {ENV_VARS['disabled_backends']}) are not backend "
                             f"names ({', '.join(backends[1:])})")
        object.__setattr__(self, "disabled_backends", disabled)
        timeout = self.collective_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not _MIN_TIMEOUT_S <= timeout <= _MAX_TIMEOUT_S):
            raise ValueError(f"collective_timeout_s={timeout!r} (env {ENV_VARS['collective_timeout_s']}) must be a "
                             f"number of seconds in [{_MIN_TIMEOUT_S:g}, {_MAX_TIMEOUT_S:.0f}] (gloo and NCCL count "
                             "whole milliseconds, and 0 ms means no timeout at all)")
        object.__setattr__(self, "ulysses_size", _ulysses_size(
            self.ulysses_size, "ulysses_size", f" (env {ENV_VARS['ulysses_size']})"))
        ratio = self.layout_flops_per_byte
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < float("inf"):
            raise ValueError(f"layout_flops_per_byte={ratio!r} (env {ENV_VARS['layout_flops_per_byte']}) must be a "
                             "positive finite number (FLOPs per byte moved)")

    @property
    def process_group_timeout(self) -> datetime.timedelta:
        """Timeout the training's process groups should have: ``collective_timeout_s`` plus a margin of
        ``max(10 s, 10 %)`` (600 + 60 = 660 s by default).

        DDP's buffer broadcast and gradient all-reduce, FSDP's collectives and the mesh's ``dp`` reduction
        wait this long for a stalled peer; :func:`~hf_blockdiag_cp.init_device_mesh` creates groups with it
        and refuses an existing default group whose timeout is longer.
        """
        timeout = self.collective_timeout_s
        return datetime.timedelta(seconds=timeout + max(_PG_MARGIN_MIN_S, _PG_MARGIN_FRACTION * timeout))
