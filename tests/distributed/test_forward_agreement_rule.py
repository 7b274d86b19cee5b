"""The per-forward agreement's rule on one real gloo rank: checksums compared with the context's, ``-1``
skipped, the field named (the multi-rank rows are in ``test_faults_forward.py``)."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed


def _rule_worker(rank: int, world: int) -> list[str]:
    import datetime

    import torch
    import torch.distributed as dist

    from hf_blockdiag_cp.distributed.agreement import AgreementError
    from hf_blockdiag_cp.model.forward_agreement import FORWARD_FIELDS, agree_on_forward

    fields = {name: 1 for name in FORWARD_FIELDS}
    kw = dict(group=dist.group.WORLD, rank=rank, size=world, timeout=datetime.timedelta(seconds=30),
              device=torch.device("cpu"))
    agree_on_forward(fields, [torch.tensor(5), -1], (5, 9), **kw)  # unknown actual: not compared
    agree_on_forward(fields, [torch.tensor(5), torch.tensor(8)], (5, -1), **kw)  # unknown expectation
    messages = []
    for checksums in ([torch.tensor(6), torch.tensor(9)], [torch.tensor(5), torch.tensor(8)]):
        try:
            agree_on_forward(fields, checksums, (5, 9), **kw)
        except AgreementError as err:
            messages.append(str(err))
    return messages


@pytest.mark.timeout(120)
def test_forward_checksums_are_compared_with_the_context_and_named():
    (messages,) = run_ranks(_rule_worker, 1, timeout=100)
    assert len(messages) == 2, messages
    assert "input_ids on rank 0 (checksum 0x6, its cp_context expects 0x5)" in messages[0]
    assert "position_ids on rank 0 (checksum 0x8, its cp_context expects 0x9)" in messages[1]
    assert "guard_model supplies them" in messages[1] and "guard_model" not in messages[0]
