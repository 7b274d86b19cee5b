"""Issue 24, the head-parallel side of recurrent layers under CP, on gloo ranks.

- ``recurrent_layout="heads"`` (:mod:`hf_blockdiag_cp.recurrent.head_parallel`): a full tiny training step of
  qwen3_next (gated delta rule with 2 key heads for 4 value heads + causal convolution; also under bf16 autocast),
  bamba (Mamba2/SSD with one B/C group, no attention layer), lfm2 (short convolution), kimi_linear (KDA) and mamba
  (Mamba1 selective scan, B / C sent whole to every rank) at
  P = 2 and 4, documents split over ranks, activation checkpointing, a rank holding only padding, equals
  each document run alone through the unmodified model (logits mapped back through ``local_index``, parameter
  gradients all-reduced). At P = 4 qwen3_next's 2 key heads and bamba's one group are sent to several ranks (their
  gradients add up). For bamba every byte moved is the fallback's all-to-alls: they equal the formula
  (:func:`~hf_blockdiag_cp.recurrent.head_parallel.head_parallel_bytes`, docs/layouts.md).
- Recurrent layers under the attention's head-parallel layout (``ulysses_size = 2``) with state passing: exact
  for qwen3_next (GDN) and falcon_h1 (Mamba2 + attention in every layer).
- Refusals: a gated-delta-rule layer with 3 heads at P = 2 under ``"heads"`` names the function and the counts on
  every rank at that call;
  ranks configured with different ``recurrent_layout`` raise ``AgreementError`` naming the field (a model whose
  first collective is a recurrent one: bamba). Host-only refusals (head counts the CP size does not divide) run
  without ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_ranks
from tests.recurrent.harness import assert_matches_documents_alone, cp_step

SEQ_LEN = 48  # divisible by 2P for zigzag at P = 2, 4
DOCS = [5, 21, 1, 9, 12]  # 48 tokens: the 21-token document spans several ranks
PADDED = [10, 4]  # 34 padding tokens: at P = 4 the last ranks hold only padding
#: Per CP size: (model kind, placement, activation checkpointing, ulysses_size, recurrent_layout, documents, bf16).
CASES = {
    2: [("qwen3_next", "zigzag", False, 1, "heads", DOCS, False),
        ("bamba", "balanced", True, 1, "heads", DOCS, False),
        ("lfm2", "contiguous", False, 1, "heads", DOCS, False),
        ("bamba", "contiguous", False, 1, "heads", PADDED, False),
        ("kimi_linear", "zigzag", False, 1, "heads", DOCS, False),
        ("mamba", "contiguous", True, 1, "heads", DOCS, False),
        ("qwen3_next", "balanced", False, 1, "heads", DOCS, True),
        ("qwen3_next", "balanced", False, 2, "state", DOCS, False),
        ("falcon_h1", "zigzag", True, 2, "state", DOCS, False),
        ("qwen3_next", "contiguous", True, 2, "heads", DOCS, False)],
    4: [("qwen3_next", "balanced", False, 1, "heads", DOCS, False),
        ("bamba", "zigzag", False, 1, "heads", PADDED, False),
        ("qwen3_next", "zigzag", False, 2, "state", DOCS, False)],
}


def _config(kind: str):
    from hf_blockdiag_cp.conformance.configs import tiny_config

    config = tiny_config(kind)
    if kind == "qwen3_next":
        config.linear_num_key_heads = 2  # fewer key heads than value heads (and than P = 4)
    if kind == "bamba":
        config.attn_layer_indices = None  # Mamba2 layers only: every byte moved is the fallback's all-to-alls
    return config


def _docs(lengths: list[int], vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


def fallback_bytes(model: torch.nn.Module, local_len: int, cp_size: int) -> int:
    """Bytes one rank sends in one forward's head-parallel all-to-alls of a Mamba2 model (fp32): per mixer the
    convolution (``C`` channels in and out) and the SSD scan (x ``[H, P]``, dt ``[H]``, B / C ``[G, N]``, y)."""
    from hf_blockdiag_cp.recurrent.head_parallel import head_parallel_bytes

    total = 0
    for module in model.modules():
        if hasattr(module, "ssm_state_size") and hasattr(module, "conv1d") and hasattr(module, "num_heads"):
            channels = module.conv1d.weight.shape[0]
            heads, head_dim, state, groups = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
            total += head_parallel_bytes(local_len, cp_size, [(channels, 1, 4)], [], (channels, 1, 4))
            total += head_parallel_bytes(local_len, cp_size, [(heads, head_dim, 4), (heads, 1, 4)],
                                         [(groups, state, 4), (groups, state, 4)], (heads, head_dim, 4))
    return total


def _collator(model, ulysses_size: int, placement: str, layout: str, groups):
    import torch.distributed as dist

    import hf_blockdiag_cp as bd

    config = bd.BlockDiagCPConfig(collective_timeout_s=60, recurrent_layout=layout)
    extra = dict(ulysses_size=ulysses_size, model_config=model.config, ulysses_groups=groups) if ulysses_size > 1 \
        else {}
    return bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, placement=placement, config=config,
                              **extra)


def _worker(rank: int, world: int) -> dict:

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.runs import build_model
    from tests.reference import documents_alone

    groups = bd.ulysses_groups(None, 2, config=bd.BlockDiagCPConfig(collective_timeout_s=60))
    report = {}
    for kind, placement, checkpointing, u, layout, lengths, bf16 in CASES[world]:
        config = _config(kind)
        docs = _docs(lengths, config.vocab_size)
        ref_logits, ref_grads = documents_alone(kind, docs, build_model(config, None).train(),
                                               autocast=torch.bfloat16 if bf16 else None)
        model = build_model(config, "blockdiag_cp").train()
        if checkpointing:
            model.activation_checkpointing_enable()
        batch = _collator(model, u, placement, layout, groups)([{"input_ids": d.tolist()} for d in docs])
        step = cp_step(model, batch, bf16)
        key = f"{kind}/{placement}/ckpt={checkpointing}/u={u}/{layout}/{len(lengths)}docs/bf16={bf16}"
        assert_matches_documents_alone(key, step, model, ref_logits, ref_grads, bf16)
        report[key] = dict(u=step.ctx.ulysses_size, sent_forward=step.sent_forward,
                           padding_only=not bool(step.real.any()),
                           expected=fallback_bytes(model, step.ctx.local_len, world) if kind == "bamba" else None)
    if world == 2:
        report["refusal"] = _refusal(rank)
        report["mismatch"] = _mismatch(rank)
    return report


def _refusal(rank: int) -> tuple:
    """3 key and value heads at P = 2 under ``"heads"``: refused naming the function and the counts, on every rank
    at its call (no rank waits for another)."""
    from hf_blockdiag_cp import comm_stats
    from hf_blockdiag_cp.conformance.runs import build_model

    config = _config("qwen3_next")
    config.linear_num_key_heads = config.linear_num_value_heads = 3
    model = build_model(config, "blockdiag_cp").train()
    batch = _collator(model, 1, "balanced", "heads", None)([{"input_ids": d.tolist()}
                                                            for d in _docs(DOCS, config.vocab_size)])
    try:
        model(**batch)
    except NotImplementedError as err:
        return type(err).__name__, str(err), comm_stats(batch["cp_context"]).sent_bytes
    return ("no error",)


def _mismatch(rank: int) -> tuple:
    """Rank 1 asks for the fallback, rank 0 for state passing: both raise before any recurrent byte moves."""
    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp import comm_stats
    from hf_blockdiag_cp.conformance.runs import build_model

    config = _config("bamba")
    model = build_model(config, "blockdiag_cp").train()
    batch = _collator(model, 1, "balanced", "heads" if rank else "state", None)(
        [{"input_ids": d.tolist()} for d in _docs(DOCS, config.vocab_size)])
    try:
        model(**batch)
    except bd.AgreementError as err:
        return "AgreementError", str(err), comm_stats(batch["cp_context"]).sent_bytes
    return ("no error",)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_head_parallel_fallback_and_ulysses_layout_match_documents_alone(world: int) -> None:
    reports = run_ranks(_worker, world, timeout=840)
    for key in reports[0]:
        if key in ("refusal", "mismatch"):
            continue
        if reports[0][key]["expected"] is not None:  # bamba: no attention, every byte is the fallback's
            for r in reports:
                assert r[key]["sent_forward"] == r[key]["expected"] > 0, (key, r[key])
        if "/u=2/" in key:
            assert all(r[key]["u"] == 2 for r in reports), key
    if world == 4:
        assert any(r[k]["padding_only"] for r in reports for k in r if k not in ("refusal", "mismatch"))
    else:
        for r in reports:
            name, message, moved = r["refusal"]
            # Raised by every rank at the scan's call (its convolution, served by the fallback, ran before it).
            assert name == "UnsupportedModel" and "chunk_gated_delta_rule" in message and "'state'" in message, message
            assert "splits the layer's 3 heads over the 2 CP ranks" in message, message
            name, message, moved = r["mismatch"]
            assert name == "AgreementError" and "recurrent_layout (rank 0: 'state', rank 1: 'heads')" in message, \
                message
            assert moved == 0


# ---- host-only refusals ---------------------------------------------------------------------------------------


def _delta_args(value_heads: int, key_heads: int) -> dict:
    return {"query": torch.zeros(1, 8, key_heads, 4), "key": torch.zeros(1, 8, key_heads, 4),
            "value": torch.zeros(1, 8, value_heads, 4), "g": torch.zeros(1, 8, value_heads),
            "beta": torch.zeros(1, 8, value_heads)}


@pytest.mark.parametrize("name,args,size,fragment", [
    ("chunk_gated_delta_rule", _delta_args(6, 6), 4, "splits the layer's 6 heads over the 4 CP ranks"),
    ("chunk_gated_delta_rule", _delta_args(8, 8), 3, "3 does not divide 8"),
    ("chunk_gated_delta_rule", _delta_args(12, 6), 4, "cuts the 6 groups of 12 heads (query, key) over 4"),
    ("causal_conv1d_fn", {"hidden_states": torch.zeros(1, 6, 8), "weight": torch.zeros(6, 4)}, 4,
     "6 channels over the 4 CP ranks"),
    ("selective_scan_fn", {"hidden_states": torch.zeros(1, 6, 8), "B": torch.zeros(1, 2, 8)}, 4,
     "6 channels over the 4 CP ranks"),
    ("mamba_chunk_scan_combined", {"hidden_states": torch.zeros(1, 8, 4, 2), "dt": torch.zeros(1, 8, 4),
                                   "B": torch.zeros(1, 8, 1, 2), "C": torch.zeros(1, 8, 1, 2),
                                   "A": torch.zeros(4), "return_final_states": True}, 2, "a final state"),
])
def test_what_cannot_be_cut_by_head_is_refused_naming_the_cause(name, args, size, fragment):
    from hf_blockdiag_cp.errors import UnsupportedModel
    from hf_blockdiag_cp.mixer_table import SCANS
    from hf_blockdiag_cp.recurrent.head_parallel import _split

    with pytest.raises(UnsupportedModel) as err:
        _split(SCANS[name], args, size)
    assert fragment in str(err.value) and name in str(err.value), str(err.value)


def test_head_layouts_cover_every_scan_kind():
    from hf_blockdiag_cp.mixer_table import SCANS
    from hf_blockdiag_cp.recurrent.head_parallel import HEAD_LAYOUTS

    kinds = {spec.kind for spec in SCANS.values()}
    assert kinds <= set(HEAD_LAYOUTS)
    for spec in SCANS.values():  # every cut input is a time-axis input of the function
        layout = HEAD_LAYOUTS.get(spec.kind)
        if layout is not None:
            assert set(layout.heads) | set(layout.groups) >= set(spec.time_args) - {"seq_idx"}, spec.name
