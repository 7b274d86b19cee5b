"""A new recurrent family is one state algebra and one table row: a stand-in mixer (``h_t = a_t * h_{t-1} + x_t``
inside its own module, taking and returning its state) registered as a :data:`~hf_blockdiag_cp.mixer_table.SCAN_MODULES`
row with the package's :class:`~hf_blockdiag_cp.recurrent.algebra.DecayAlgebra`, served by the package's hooks on
2 gloo ranks (documents split across them, every placement), equals a float64 sequential recurrence per document,
outputs and input gradients. Decays near 1 keep the state alive across a whole fragment, so a wrong hand-off fails."""

from __future__ import annotations

import pytest
import torch

SEQ_LEN = 40
LENGTHS = [7, 19, 3, 11]  # 40 tokens: the 19-token document is cut by every placement at CP = 2
CHANNELS = 3


class StandInMixer(torch.nn.Module):
    """``h_t = a_t * h_{t-1} + x_t`` per channel over ``x, a [B, T, C]`` from ``h0 [B, C]`` (zeros by default)."""

    def forward(self, x: torch.Tensor, a: torch.Tensor, h0: torch.Tensor | None = None,
                return_last_state: bool = False):
        h = torch.zeros_like(x[:, 0]) if h0 is None else h0.to(x.dtype)
        out = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out.append(h)
        y = torch.stack(out, 1)
        return (y, (h,)) if return_last_state else y


def _register() -> None:
    from hf_blockdiag_cp.mixer_table import SCAN_MODULES
    from hf_blockdiag_cp.recurrent.algebra import DecayAlgebra
    from hf_blockdiag_cp.recurrent.specs import ScanModule

    SCAN_MODULES["StandInMixer"] = ScanModule(  # the one table row
        "StandInMixer", ("x", "a", "h0", "return_last_state"), {"x": 1, "a": 1}, 1, ("h0",), "return_last_state",
        algebra=lambda named: DecayAlgebra((1, named["x"].shape[-1]), (1, named["x"].shape[-1])),
        transition=lambda named, f: (named["a"][f.row:f.row + 1, f.start:f.start + f.length].float().prod(1),),
        returns_states=lambda module, named: True)


def _reference(x: torch.Tensor, a: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float64 recurrence restarted at every document start (``ids [S]``)."""
    out, h = [], torch.zeros(x.shape[-1], dtype=torch.float64)
    for t in range(x.shape[0]):
        if t == 0 or ids[t] != ids[t - 1]:
            h = torch.zeros_like(h)
        h = a[t] * h + x[t]
        out.append(h)
    return torch.stack(out)


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.mixer_hooks import install_recurrent
    from hf_blockdiag_cp.recurrent.runs import local_runs

    _register()
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(SEQ_LEN, CHANNELS, dtype=torch.float64, generator=gen)
    a_full = 0.9 + 0.1 * torch.rand(SEQ_LEN, CHANNELS, dtype=torch.float64, generator=gen)
    weight = torch.randn(SEQ_LEN, CHANNELS, dtype=torch.float64, generator=gen)
    docs = [list(range(1, n + 1)) for n in LENGTHS]
    report = {}
    for placement in ("balanced", "contiguous", "zigzag"):
        collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, placement=placement,
                                      config=bd.BlockDiagCPConfig(collective_timeout_s=60))
        ctx = collator([{"input_ids": d} for d in docs])["cp_context"]
        ids, index = ctx.doc_ids[0], ctx.local_index.to(torch.int64)
        x_ref, a_ref = x_full.clone().requires_grad_(), a_full.clone().requires_grad_()
        ref = _reference(x_ref, a_ref, ids)
        ref_grads = torch.autograd.grad((ref * weight).sum(), (x_ref, a_ref))
        mixer = StandInMixer()
        probe = type("Probe", (), {"runs": local_runs({"cp_context": ctx}, True), "attention_calls": 0,
                                   "holds_step": lambda self: True, "check_recompute": lambda self, what: None})()
        assert install_recurrent(mixer, probe) == 1
        x = x_full[index][None].clone().requires_grad_()
        a = a_full[index][None].clone().requires_grad_()
        out, last = mixer(x, a)  # under CP a shard's last state is not the row's: None
        assert last is None
        (out[0] * weight[index]).sum().backward()
        real = ids[index] != 0
        torch.testing.assert_close(out[0][real], ref[index][real], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, p=placement: f"{p}: outputs vs the float64 recurrence: {m}")
        for got, want, name in ((x.grad[0], ref_grads[0], "x"), (a.grad[0], ref_grads[1], "a")):
            torch.testing.assert_close(got[real], want[index][real], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, p=placement, n=name: f"{p}: d/d{n} vs float64: {m}")
        report[placement] = len(probe.runs.plan.sources[rank])
    return report


@pytest.mark.distributed
def test_a_standin_family_registered_by_one_row_is_exact_at_cp2() -> None:
    from tests.launch import run_ranks

    reports = run_ranks(_worker, 2, timeout=240)
    for placement in ("balanced", "contiguous", "zigzag"):
        assert sum(r[placement] for r in reports) > 0, f"{placement}: no fragment continued a document"
