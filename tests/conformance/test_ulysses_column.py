"""Issue 27, finding 9: the conformance check's head-parallel pass (``--ulysses-size 2`` at CP = 2).

afmoe and dory ``.view()`` the attention output: the head-parallel path must return it contiguous as stock sdpa does
(before: ``view size is not compatible``). jetmoe (mixture-of-attention heads) and mimo_v2_flash (more K/V heads on
its sliding-window layers) have layers whose head shape is not the config's: refused, naming that cause.
"""

from __future__ import annotations

import pytest

from hf_blockdiag_cp import conformance
from hf_blockdiag_cp.conformance.compare import check_model
from hf_blockdiag_cp.conformance.result import EXACT, REFUSED, CheckResult

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type, expected", [("llama", EXACT), ("afmoe", EXACT), ("dory", EXACT),
                                                  ("jetmoe", REFUSED), ("mimo_v2_flash", REFUSED)])
def test_head_parallel_collator_pass(model_type, expected):
    result = check_model(model_type, cp_size=2, ulysses_size=2, generate=False, variants=("collator",))
    assert result.status == expected, result.line()
    assert result.ulysses_size == 2
    if expected == REFUSED:
        assert "the model's layers do not all use the head counts its config names" in result.reason, result.reason


def test_markdown_has_a_head_parallel_column():
    one = [CheckResult(model="llama"), CheckResult(model="jetmoe")]
    cp2 = [CheckResult(model="llama", cp_size=2), CheckResult(model="jetmoe", cp_size=2)]
    u2 = [CheckResult(model="llama", cp_size=2, ulysses_size=2),
          CheckResult(model="jetmoe", status=REFUSED, reason="heads", cp_size=2, ulysses_size=2)]
    text = conformance.markdown_table(one, title="T", seconds=60, cp2=cp2, cp2_ulysses=u2)
    assert "| model type | CP = 1 | CP = 2 | CP = 2, u = 2 | logits | grads | detail |" in text
    assert "| `jetmoe` | exact | exact | refused |" in text
