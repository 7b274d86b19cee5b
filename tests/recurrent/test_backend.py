"""Issue 24, recurrent kernels behind one contract: ``BlockDiagCPConfig.recurrent_backend`` picks the model's own
function per fragment (``"model"``) or the package's chunked ops (``"torch"``, one varlen call), and both equal each
document run alone through the unmodified model, per family; ranks asking for different backends raise the
package's agreement error before any collective; a call an op cannot express falls back to the model's function.
"""

from __future__ import annotations

import collections
import datetime

import pytest
import torch

import hf_blockdiag_cp.distributed.agreement as agreement
from hf_blockdiag_cp.config import ENV_VARS, BlockDiagCPConfig
from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.conformance.runs import (
    build_model,
    grad_error,
    make_documents,
    packed_inputs,
    packed_run,
    reference_run,
)
from hf_blockdiag_cp.errors import AgreementError
from hf_blockdiag_cp.mixer_table import SCANS
from hf_blockdiag_cp.model.forward_agreement import FORWARD_FIELDS, agree_on_forward
from hf_blockdiag_cp.planning.fragments import local_fragments
from hf_blockdiag_cp.recurrent import ops
from hf_blockdiag_cp.recurrent.backend import AUTO_ON_CPU, agreement_code, call_backend, op_refusal
from hf_blockdiag_cp.recurrent.kinds import MixerKind
from hf_blockdiag_cp.recurrent.runs import LocalRuns
from hf_blockdiag_cp.recurrent.scan_runner import ScanRunner, known_arguments
from hf_blockdiag_cp.recurrent.serve import serve_scan
from hf_blockdiag_cp.recurrent.specs import bind
from tests.fake_collective import FAKE_GROUP, with_peers

ENV = ENV_VARS["recurrent_backend"]
CPU = torch.device("cpu")


class OpSpy:
    """Counts calls of the package's torch ops (the op path reads ``ops.TORCH_OPS`` at call time)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        for name, fn in list(ops.TORCH_OPS.items()):
            def counted(*args, _fn=fn, _name=name, **kwargs):
                self.calls[_name] += 1
                return _fn(*args, **kwargs)
            monkeypatch.setitem(ops.TORCH_OPS, name, counted)


# ---------------------------------------------------------------- configuration and resolution



def run_fragments(spec, original, runs, args, kwargs):
    """One served scan call on ``runs`` (what the mixer hook does with a call's arguments)."""
    return serve_scan(spec, original, runs, bind(spec.params, spec.name, args, kwargs))

def test_config_field_env_and_refusal(monkeypatch):
    monkeypatch.setenv(ENV, "Torch")
    assert BlockDiagCPConfig().recurrent_backend == "torch"
    assert BlockDiagCPConfig(recurrent_backend="model").recurrent_backend == "model"
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(ValueError, match=ENV):
        BlockDiagCPConfig()


def test_resolution_per_kind_on_cpu():
    for kind in ("conv", "ssd", "delta", "kda", "selective"):
        assert call_backend(("model", 0), kind, CPU) == "model"
        assert call_backend(("torch", 0), kind, CPU) == "torch"
        assert call_backend(("auto", 0), kind, CPU) == AUTO_ON_CPU[kind]
        # a library request on CPU (or without the library) runs the torch op: same contract, same result
        assert call_backend(("fla", 0), kind, CPU) == "torch"
        assert call_backend(("mamba_ssm", 0), kind, CPU) == "torch"
    assert call_backend(("auto", 0), MixerKind.DIAG, CPU) == "model"  # a kind without an op
    # on CUDA (resolution is pure: no device needed): a library where the agreed mask says it imports, else torch
    cuda, fla, mamba, conv = torch.device("cuda"), 1, 2, 4  # bits of fla, mamba_ssm, causal_conv1d
    assert call_backend(("auto", fla | mamba | conv), "delta", cuda) == "fla"
    assert call_backend(("auto", fla | mamba | conv), "ssd", cuda) == "mamba_ssm"
    assert call_backend(("auto", fla), "conv", cuda) == "torch"  # no causal-conv1d
    assert call_backend(("fla", fla | mamba | conv), "ssd", cuda) == "torch"  # fla covers no SSD
    assert call_backend(("mamba_ssm", mamba | conv), "conv", cuda) == "mamba_ssm"
    assert call_backend(("auto", 0), "kda", cuda) == "torch"
    assert call_backend(("model", fla), "delta", cuda) == "model"
    # the agreement code separates requests (and libraries): ranks asking differently never match
    codes = {agreement_code(r, CPU) for r in ("auto", "model", "torch", "fla", "mamba_ssm")}
    assert len(codes) == 5


def test_op_refusal_names_what_the_op_cannot_express():
    conv = SCANS["causal_conv1d_fn"]
    x, w = torch.zeros(1, 4, 8), torch.zeros(4, 3)
    base = {"hidden_states": x, "weight": w, "bias": None, "activation": "silu"}
    assert op_refusal("conv", base, known_arguments(conv)) is None
    # keywords transformers' torch functions take in **kwargs and ignore: ignored by the op too
    assert op_refusal("conv", {**base, "shift_labels": x, "position_embeddings": (x, x)}, known_arguments(conv)) is None
    assert "activation='gelu'" in op_refusal("conv", {**base, "activation": "gelu"}, known_arguments(conv))
    assert "final_states_out" in op_refusal("conv", {**base, "final_states_out": x}, known_arguments(conv))
    delta = SCANS["chunk_gated_delta_rule"]
    assert "scale" in op_refusal("delta", {"scale": 0.5}, known_arguments(delta))
    ssd = SCANS["mamba_chunk_scan_combined"]
    named = {"hidden_states": torch.zeros(1, 8, 2, 3), "A": torch.zeros(2), "z": torch.zeros(1, 8, 2, 3)}
    assert "z gate" in op_refusal("ssd", named, known_arguments(ssd))


# ---------------------------------------------------------------- a call the op cannot express falls back


def _runs(lengths: list[int], request: str) -> LocalRuns:
    ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    return LocalRuns(local_fragments(ids, torch.arange(ids.shape[1])), ids.shape[1], backend=(request, 0))


def _conv_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lengths: list[int], act) -> torch.Tensor:
    """Each document alone through a float64 causal depthwise convolution."""
    outs, start = [], 0
    for n in lengths:
        piece = torch.nn.functional.pad(x[..., start:start + n].double(), (w.shape[-1] - 1, 0))
        outs.append(act(torch.nn.functional.conv1d(piece, w.double()[:, None], b.double(), groups=w.shape[0])))
        start += n
    return torch.cat(outs, -1)


def test_a_call_the_op_cannot_express_takes_the_model_path(monkeypatch):
    """An activation the op lacks (relu) runs transformers' function once per fragment; silu runs the op once;
    both equal each document alone."""
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn

    spy = OpSpy(monkeypatch)
    model_calls = []

    def original(*args, **kwargs):
        model_calls.append(kwargs["hidden_states"].shape[-1])
        return causal_conv1d_fn(*args, **kwargs)

    lengths = [5, 1, 9]
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 6, 15, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    spec = SCANS["causal_conv1d_fn"]
    runs = _runs(lengths, "torch")
    out = run_fragments(spec, original, runs, (x, w, b), {"activation": "relu"})
    assert model_calls == lengths and not spy.calls
    torch.testing.assert_close(out.double(), _conv_reference(x, w, b, lengths, torch.relu), rtol=1e-5, atol=1e-6)
    out = run_fragments(spec, original, runs, (x, w, b), {"activation": "silu"})
    assert model_calls == lengths and spy.calls == {"causal_conv1d": 1}
    torch.testing.assert_close(out.double(), _conv_reference(x, w, b, lengths, torch.nn.functional.silu), rtol=1e-5,
                               atol=1e-6)


# ---------------------------------------------------------------- the wired backend per family, CP = 1

# gated delta rule + conv, KDA, SSD, Mamba1 (a layer dropping kwargs), conv, SSD with a gated norm (5-10 s each)
FAMILIES = ("qwen3_next", "kimi_linear", "bamba", "mamba", "lfm2", "falcon_h1")


def _family(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(model_type)
    docs = make_documents(config)
    ref_logits, ref_grads = reference_run(build_model(config, None), docs)
    ours = build_model(config, "blockdiag_cp")
    spy = OpSpy(monkeypatch)
    results = {}
    for backend in ("model", "torch"):
        monkeypatch.setenv(ENV, backend)
        spy.calls.clear()
        # packed position_ids, and a PackingCollator batch (its context carries the config; extra batch keys)
        for variant in ("position_ids", "collator"):
            logits, grads = packed_run(ours, docs, packed_inputs(docs, variant, config.pad_token_id or 0))
            err = (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item()
            assert err < 1e-5, f"{model_type} {backend} {variant}: logits differ from documents alone by {err:.2e}"
            assert grad_error(grads, ref_grads) < 1e-4, f"{model_type} {backend} {variant}: gradients differ"
            results[backend, variant] = logits
        assert (sum(spy.calls.values()) > 0) == (backend == "torch"), (backend, dict(spy.calls))
    for variant in ("position_ids", "collator"):
        torch.testing.assert_close(results["torch", variant], results["model", variant], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_torch_ops_equal_the_model_path_and_documents_alone_per_family(model_type, monkeypatch):
    _family(model_type, monkeypatch)


def test_gated_delta_rule_call_through_the_op_equals_the_model_path(monkeypatch):
    """One served call (three documents in two rows): the op once vs transformers' function once per fragment."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    spy = OpSpy(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    rows, length, k_heads, heads, dk, dv = 2, 20, 2, 4, 8, 6
    q, k = (torch.randn(rows, length, k_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, length, heads, dv, generator=gen)
    g, beta = -torch.rand(rows, length, heads, generator=gen), torch.rand(rows, length, heads, generator=gen)
    ids = torch.tensor([[1] * 7 + [2] * 13, [3] * 20])
    spec = SCANS["chunk_gated_delta_rule"]
    kwargs = {"g": g, "beta": beta, "use_qk_l2norm_in_kernel": True, "output_final_state": False}
    outs = {}
    for request in ("model", "torch"):
        runs = LocalRuns(local_fragments(ids, torch.arange(length)), length, backend=(request, 0))
        outs[request], _ = run_fragments(spec, torch_chunk_gated_delta_rule, runs, (q, k, v), kwargs)
    assert spy.calls == {"chunk_gated_delta_rule": 1}
    torch.testing.assert_close(outs["torch"], outs["model"], rtol=1e-5, atol=1e-5)
    alone, _ = torch_chunk_gated_delta_rule(q[:1, 7:], k[:1, 7:], v[:1, 7:], g=g[:1, 7:], beta=beta[:1, 7:],
                                            use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(outs["torch"][:1, 7:], alone, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- agreement


def test_ranks_asking_for_different_backends_disagree_by_name(monkeypatch):
    """The forward agreement (before any K/V or state moves) quotes each rank's request."""
    fields = {name: 1 for name in FORWARD_FIELDS}
    mine = {**fields, "recurrent_backend": agreement_code("torch", CPU)}
    peer = [mine[name] if name != "recurrent_backend" else agreement_code("model", CPU) for name in FORWARD_FIELDS]
    with_peers(monkeypatch, agreement, 0, [None, [0x6264_6370_6677, 1, 2, *peer, -1, -1, -1, -1]])
    with pytest.raises(AgreementError, match=r"recurrent_backend \(rank 0: 'torch', rank 1: 'model'\)"):
        agree_on_forward(mine, [-1, -1], (-1, -1), group=FAKE_GROUP, rank=0, size=2,
                         timeout=datetime.timedelta(seconds=30), device=CPU)


# ---------------------------------------------------------------- CP = 2 on gloo (one spawn)

SEQ_LEN = 48
MIXED = [5, 21, 1, 9, 12]  # 48 tokens: the 21-token document spans both ranks in several pieces


def _docs(lengths: list[int], vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


CP_CASES = [("qwen3_next", "balanced"), ("bamba", "zigzag"), ("mamba", "contiguous"), ("lfm2", "zigzag"),
            ("kimi_linear", "balanced")]


def _cp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.recurrent.runs import _cached_plan
    from tests.reference import documents_alone

    counts: collections.Counter[str] = collections.Counter()
    for name, fn in list(ops.TORCH_OPS.items()):
        def counted(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)
        ops.TORCH_OPS[name] = counted
    plain = ScanRunner.partial

    def augmented(*args, **kwargs):  # delta rule / KDA fragments that continue and send: one pass, no rerun
        counts["augmented"] += 1
        return plain(*args, **kwargs)
    ScanRunner.partial = augmented
    report = {"continuing": 0, "op_calls": 0}
    for kind, placement in CP_CASES:
        config = tiny_config(kind)
        docs = _docs(MIXED, config.vocab_size)
        ref_logits, ref_grads = documents_alone(kind, docs, build_model(config, None).train())
        model = build_model(config, "blockdiag_cp").train()
        collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, placement=placement,
                                      config=bd.BlockDiagCPConfig(collective_timeout_s=60, recurrent_backend="torch"))
        batch = collator([{"input_ids": d.tolist()} for d in docs])
        ctx = batch["cp_context"]
        out = model(**batch)
        out.loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        real = ctx.doc_ids[0, ctx.local_index] != 0
        torch.testing.assert_close(out.logits[0][real].float(), ref_logits[ctx.local_index[real]], rtol=1e-4,
                                   atol=1e-5, msg=lambda m, k=kind: f"{k} logits vs documents alone: {m}")
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name, k=kind: f"{k} grad {n} vs documents alone: {m}")
        report["continuing"] += len(_cached_plan(ctx).sources[rank])
    report["augmented"] = counts.pop("augmented", 0)
    report["op_calls"] = sum(counts.values())
    # Rank 1 asks for another recurrent backend: every rank raises the agreement error in the model's pre-hook,
    # before any layer (no K/V exchange, no state all-gather) runs.
    config = tiny_config("qwen3_next")
    model = build_model(config, "blockdiag_cp").train()
    collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, config=bd.BlockDiagCPConfig(
        collective_timeout_s=60, recurrent_backend="torch" if rank == 0 else "model"))
    batch = collator([{"input_ids": d.tolist()} for d in _docs(MIXED, config.vocab_size)])
    comm = bd.comm_stats(batch["cp_context"])
    try:
        model(**batch)
    except AgreementError as err:
        report["error"] = str(err)
    report["bytes_after_refusal"] = comm.sent_bytes + comm.forward_calls
    return report


@pytest.mark.distributed
@pytest.mark.slow
def test_torch_ops_under_cp2_match_documents_alone_and_ranks_agree():
    from tests.launch import run_ranks

    reports = run_ranks(_cp_worker, 2, timeout=600)
    assert sum(r["continuing"] for r in reports) > 0, "no fragment continued a document"
    assert all(r["op_calls"] > 0 for r in reports), "the torch ops did not run"
    assert sum(r["augmented"] for r in reports) > 0, "no delta-rule fragment both continued and sent"
    for r in reports:
        assert "recurrent_backend (rank 0: 'torch', rank 1: 'model')" in r.get("error", ""), r
        assert r["bytes_after_refusal"] == 0
