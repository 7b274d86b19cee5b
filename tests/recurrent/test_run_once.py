"""Every fragment of an SSD (Mamba2) or Mamba1 call runs once under CP, also one that both continues its document and
sends its state on (issue 36, item 2), and so does every fragment of a gated-delta-rule call on the package's op (a
continuing fragment that does not send runs once, from its state, after the gather): the model's function or the op
sees each local token exactly once per served call, and the step still equals each document alone."""

from __future__ import annotations

import pytest
import torch

SEQ_LEN = 48
LENGTHS = [5, 21, 1, 9, 12]


def _worker(rank: int, world: int) -> dict:
    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model
    from hf_blockdiag_cp.recurrent.kinds import MixerKind
    from hf_blockdiag_cp.recurrent.scan_runner import ScanRunner
    from tests.recurrent.harness import assert_matches_documents_alone, cp_step
    from tests.reference import documents_alone

    seen: dict[int, list] = {}
    run, partial, assemble = ScanRunner.run, ScanRunner.partial, ScanRunner.assemble
    counted_kinds = (MixerKind.SSD, MixerKind.SELECTIVE, MixerKind.DELTA)

    def counted_run(self, frags, states, want_end):
        seen.setdefault(id(self), [self, 0])[1] += sum(f.length for f in frags)
        return run(self, frags, states, want_end)

    def counted_partial(self, frags):  # SSD / Mamba1 partials call run (counted there); the delta rule's do not
        if self.kind is MixerKind.DELTA:
            seen.setdefault(id(self), [self, 0])[1] += sum(f.length for f in frags)
        return partial(self, frags)

    checked = []

    def checked_assemble(self, outputs, ends):
        if self.kind in counted_kinds:
            ran = seen.pop(id(self), [self, 0])[1]
            total = sum(f.length for f in self._frags)
            checked.append((str(self.kind), self.backend, ran, total))
        return assemble(self, outputs, ends)

    ScanRunner.run, ScanRunner.partial, ScanRunner.assemble = counted_run, counted_partial, checked_assemble
    report = {}
    for kind, backend in (("bamba", "model"), ("bamba", "torch"), ("mamba", "model"), ("mamba", "torch"),
                          ("qwen3_next", "torch")):
        config = tiny_config(kind)
        gen = torch.Generator().manual_seed(0)
        docs = [torch.randint(1, config.vocab_size, (n,), generator=gen) for n in LENGTHS]
        ref_logits, ref_grads = documents_alone(kind, docs, build_model(config, None).train())
        model = build_model(config, "blockdiag_cp").train()
        collator = bd.PackingCollator(SEQ_LEN, group=torch.distributed.group.WORLD, pad_token_id=0,
                                      placement="balanced",
                                      config=bd.BlockDiagCPConfig(collective_timeout_s=60, recurrent_backend=backend))
        step = cp_step(model, collator([{"input_ids": d.tolist()} for d in docs]))
        assert_matches_documents_alone(f"{kind}/{backend}", step, model, ref_logits, ref_grads)
        report[f"{kind}/{backend}"] = list(checked)
        checked.clear()
    return report


@pytest.mark.distributed
def test_ssd_mamba1_and_delta_rule_fragments_run_once_under_cp2() -> None:
    from tests.launch import run_ranks

    reports = run_ranks(_worker, 2, timeout=300)
    for report in reports:
        for key, calls in report.items():
            assert calls, f"{key}: no SSD / Mamba1 call was served"
            for kind, backend, ran, total in calls:
                assert ran == total, f"{key} {kind} ({backend}): {ran} tokens run for {total} local tokens"
