"""Issue 17, single process: configuration refusals naming their environment variable, messages that
quote ids as given and name the plan field ranks differ in, K/V messages refused before sending when
their size cannot match the plan, the record of broken CP groups, and the once-only warning of a
last-resort backend."""

from __future__ import annotations

import dataclasses
import datetime
import warnings

import pytest
import torch

from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
from hf_blockdiag_cp.config import ENV_VARS
from hf_blockdiag_cp.distributed import CollectiveError, ExchangeSizeError, RankExchange, check_message
from hf_blockdiag_cp.distributed import exchange as exchange_module
from hf_blockdiag_cp.distributed.agreement import _plan_mismatch
from hf_blockdiag_cp.planning import as_doc_ids
from hf_blockdiag_cp.planning.fingerprint import PLAN_FIELDS, PlanFingerprint
from tests.layouts import runs

# ---- configuration -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0005, 0.0009999, 1e-9])
def test_collective_timeout_below_one_millisecond_is_refused(value):
    # torch hands gloo/NCCL whole milliseconds: 0.5 ms became 0 ms, which means "no timeout".
    with pytest.raises(ValueError, match="HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S.*whole milliseconds"):
        BlockDiagCPConfig(collective_timeout_s=value)
    assert BlockDiagCPConfig(collective_timeout_s=0.001).collective_timeout_s == 0.001


@pytest.mark.parametrize("raw", ["0.0005", "0", "-1", "nan", "inf", "1e9", "soon"])
def test_collective_timeout_env_refusals_name_the_variable(monkeypatch, raw):
    monkeypatch.setenv("HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S"):
        BlockDiagCPConfig()


@pytest.mark.parametrize("field,raw", [
    ("backend", "fastest"),
    ("kv_exchange", "ring"),
    ("placement", "random"),
    ("disabled_backends", "sdpa_doc,nope"),
    ("disabled_backends", "auto"),
    ("deterministic", "maybe"),
    ("validate", "2"),
    ("flash_prefix_guard", "yes please"),
    ("balance_tolerance", "tight"),
    ("balance_tolerance", "-0.1"),
    ("collective_timeout_s", "0.0001"),
    ("recurrent_layout", "rings"),
])
def test_every_invalid_env_value_names_its_variable(monkeypatch, field, raw):
    monkeypatch.setenv(ENV_VARS[field], raw)
    with pytest.raises(ValueError) as err:
        BlockDiagCPConfig()
    assert ENV_VARS[field] in str(err.value), str(err.value)


def test_disabled_backends_as_a_string_is_refused():
    with pytest.raises(TypeError, match="disabled_backends='sdpa_doc'.*HF_BLOCKDIAG_CP_DISABLE_BACKENDS"):
        BlockDiagCPConfig(disabled_backends="sdpa_doc")


# ---- ids quoted as given -----------------------------------------------------------------------------------


def test_uint64_id_above_2_63_is_quoted_as_given_not_as_negative():
    big = 2 ** 63 + 5
    with pytest.raises(ValueError) as err:
        as_doc_ids(torch.tensor([1, 1, big], dtype=torch.uint64))
    assert str(big) in str(err.value) and "-" not in str(err.value).split("found")[-1], str(err.value)
    assert as_doc_ids(torch.tensor([1, 2 ** 62], dtype=torch.uint64)).tolist() == [[1, 2 ** 62]]
    with pytest.raises(ValueError, match="found -3"):  # a real negative id stays negative
        as_doc_ids(torch.tensor([1, -3]))


# ---- which plan field differs ------------------------------------------------------------------------------

DOCS = torch.tensor(runs((1, 5), (2, 20), (3, 3), (4, 12), (5, 8)))


def _fields(rank: int, config: BlockDiagCPConfig, placement: str | None = None) -> list[int]:
    ctx = BlockDiagCPContext.build(DOCS, cp_rank=rank, cp_size=2, config=config, placement=placement)
    assert isinstance(ctx.plan_fingerprint, PlanFingerprint)
    return [ctx.plan_fingerprint.fields[name] for name in PLAN_FIELDS], int(ctx.plan_fingerprint)


@pytest.mark.parametrize("differ,configs,placements,fragment", [
    ("placement", (BlockDiagCPConfig(), BlockDiagCPConfig()), ("balanced", "contiguous"),
     "placement (rank 0: 'balanced', rank 1: 'contiguous')"),
    ("backend", (BlockDiagCPConfig(backend="sdpa_doc"), BlockDiagCPConfig(backend="sdpa_mask")), (None, None),
     "backend (rank 0: 'sdpa_doc', rank 1: 'sdpa_mask')"),
    ("balance_tolerance", (BlockDiagCPConfig(balance_tolerance=0.05), BlockDiagCPConfig(balance_tolerance=0.5)),
     ("balanced", "balanced"), "balance_tolerance (rank 0: 0.05, rank 1: 0.5)"),
    ("kv_exchange", (BlockDiagCPConfig(kv_exchange="halo"), BlockDiagCPConfig(kv_exchange="a2a")),
     ("contiguous", "contiguous"), "kv_exchange (rank 0: 'halo', rank 1: 'a2a')"),
    ("recurrent_layout", (BlockDiagCPConfig(recurrent_layout="state"), BlockDiagCPConfig(recurrent_layout="heads")),
     (None, None), "recurrent_layout (rank 0: 'state', rank 1: 'heads')"),
])
def test_plan_mismatch_names_the_field_with_each_ranks_value(differ, configs, placements, fragment):
    rows = [_fields(rank, config, placement) for rank, (config, placement) in enumerate(zip(configs, placements))]
    fields, plans = [r[0] for r in rows], [r[1] for r in rows]
    assert plans[0] != plans[1]
    message = _plan_mismatch(plans, fields)
    assert fragment in message and "planned different K/V exchanges" in message, message
    others = {"placement", "backend", "balance_tolerance", "kv_exchange", "cp_size"} - {differ}
    assert not any(f"{name} (rank" in message for name in others), message


def test_same_config_gives_the_same_plan_fingerprint_on_every_rank_and_pickles():
    import pickle

    a, b = (BlockDiagCPContext.build(DOCS, cp_rank=r, cp_size=2).plan_fingerprint for r in (0, 1))
    assert a == b and a.fields == b.fields
    c = pickle.loads(pickle.dumps(a))
    assert isinstance(c, PlanFingerprint) and c == a and c.fields == a.fields
    # The tolerance of a non-balanced placement is not compared (it shapes nothing).
    x, y = (BlockDiagCPContext.build(DOCS, cp_rank=0, cp_size=2, placement="contiguous",
                                     config=BlockDiagCPConfig(balance_tolerance=t)).plan_fingerprint
            for t in (0.0, 1.0))
    assert x == y


# ---- message sizes checked before sending -------------------------------------------------------------------


class _Group:
    """A stand-in process group (weakly referenceable, never used for a collective here)."""


def _exchange(strategy: str, rank: int = 0, **fields) -> tuple[RankExchange, int]:
    config = BlockDiagCPConfig(kv_exchange=strategy)
    ctx = BlockDiagCPContext.build(DOCS, cp_rank=rank, cp_size=2, config=config, placement="contiguous")
    transfer = ctx.exchange.for_rank(rank)
    ex = RankExchange(transfer=transfer, size=2, global_ranks=(0, 1), send_index=transfer.send_index,
                      timeout=datetime.timedelta(seconds=5), group=_Group(), **fields)
    return ex, ctx.local_len


@pytest.mark.parametrize("strategy", ["allgather", "halo", "a2a"])
def test_message_of_the_planned_size_passes(strategy):
    ex, local = _exchange(strategy)
    check_message(torch.zeros(local, 96), ex)
    ex, local = _exchange(strategy, rank=1, row_width=96, dtype=torch.float32)
    check_message(torch.zeros(local, 96), ex)


@pytest.mark.parametrize("strategy", ["allgather", "halo", "a2a"])
def test_message_cut_from_other_rows_is_refused_before_sending(strategy):
    ex, local = _exchange(strategy)
    with pytest.raises(ExchangeSizeError,
                       match=f"CP rank 0: .*{local - 3}, 96.*plan gives this rank {local} local rows"):
        check_message(torch.zeros(local - 3, 96), ex)


def test_message_of_another_width_or_dtype_than_agreed_is_refused():
    ex, local = _exchange("halo", row_width=96, dtype=torch.float32)
    with pytest.raises(ExchangeSizeError, match="width 64 .*agreed on width 96"):
        check_message(torch.zeros(local, 64), ex)
    with pytest.raises(ExchangeSizeError, match="bfloat16.*agreed on width 96 \\(torch.float32\\)"):
        check_message(torch.zeros(local, 96, dtype=torch.bfloat16), ex)


def test_splits_that_do_not_fit_the_peers_are_refused_naming_rank_and_peer():
    ex, local = _exchange("a2a")
    bad = dataclasses.replace(ex.transfer, send_splits=(0, local + 1))
    with pytest.raises(ExchangeSizeError,
                       match=f"CP rank 0: .*sends {local + 1} rows to rank 1, more than its {local}"):
        check_message(torch.zeros(local, 8), dataclasses.replace(ex, transfer=bad))
    ex, local = _exchange("halo", rank=1)
    bad = dataclasses.replace(ex.transfer, send_splits=(4, 0))
    with pytest.raises(ExchangeSizeError, match="CP rank 1: .*sends 4 rows to rank 0, not its successor"):
        check_message(torch.zeros(local, 8), dataclasses.replace(ex, transfer=bad))
    bad = dataclasses.replace(ex.transfer, recv_splits=(ex.transfer.recv_rows + 2, 0))
    with pytest.raises(ExchangeSizeError, match="receives .* into a buffer of"):
        check_message(torch.zeros(local, 8), dataclasses.replace(ex, transfer=bad))


# ---- a broken group stays broken ------------------------------------------------------------------------


class _FailingWork:
    def wait(self, timeout):
        raise RuntimeError("Connection closed by peer")


def test_failed_collective_marks_the_group_and_the_next_use_raises_at_once():
    group, other = _Group(), _Group()
    with pytest.raises(CollectiveError, match="cannot be used again.*restart") as first:
        exchange_module.wait(_FailingWork(), "K/V all-to-all", 1, datetime.timedelta(seconds=5), group=group)
    assert "Connection closed by peer" in str(first.value)
    with pytest.raises(CollectiveError, match="CP rank 1: refusing to start the K/V halo exchange: this CP group "
                                              "failed earlier \\(the K/V all-to-all on CP rank 1 failed"):
        exchange_module.check_usable(group, "K/V halo exchange", 1)
    exchange_module.check_usable(other, "K/V halo exchange", 1)  # another group is untouched
    ex, local = _exchange("halo")
    ex = dataclasses.replace(ex, group=group)
    with pytest.raises(CollectiveError, match="failed earlier"):  # exchange_kv refuses before any collective
        exchange_module.exchange_kv(torch.zeros(local, 8), ex)


def test_broken_group_record_forgets_destroyed_groups():
    import gc

    group = _Group()
    exchange_module.mark_broken(group, "test")
    assert len([g for g in exchange_module._BROKEN if g is group]) == 1
    del group
    gc.collect()
    assert not any(isinstance(g, _Group) and exchange_module._BROKEN[g] == "test" for g in exchange_module._BROKEN)


# ---- a last-resort backend is announced, once --------------------------------------------------------------


def test_auto_falling_to_sdpa_mask_warns_once_naming_the_cause():
    from hf_blockdiag_cp.kernels import KernelSpec, _warn_last_resort, choose_backend

    _warn_last_resort.cache_clear()
    spec = KernelSpec("cpu", torch.float32, 16, 16, 4, 2, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # e.g. three steps
            assert choose_backend("auto", spec, frozenset({"sdpa_mask"})) == ("sdpa_mask", None)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "'sdpa_mask'" in messages[0] and "sdpa_doc: disabled" in messages[0] and "another CP rank" in messages[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert choose_backend("auto", spec) == ("sdpa_doc", None)  # the normal choice says nothing
    assert not caught
