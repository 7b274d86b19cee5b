"""The per-forward agreement's rule in one process (its collective faked with a one-rank group): checksums
compared with the context's, ``-1`` skipped, the field named (the multi-rank rows are in
``test_faults_forward.py``)."""

from __future__ import annotations

import datetime

import pytest
import torch

import hf_blockdiag_cp.distributed.agreement as agreement
from hf_blockdiag_cp.distributed.agreement import AgreementError
from hf_blockdiag_cp.model.forward_agreement import FORWARD_FIELDS, agree_on_forward
from tests.fake_collective import FAKE_GROUP, with_peers


def test_forward_checksums_are_compared_with_the_context_and_named(monkeypatch):
    with_peers(monkeypatch, agreement, 0, [None])
    fields = {name: 1 for name in FORWARD_FIELDS}
    kw = dict(group=FAKE_GROUP, rank=0, size=1, timeout=datetime.timedelta(seconds=30), device=torch.device("cpu"))
    agree_on_forward(fields, [torch.tensor(5), -1], (5, 9), **kw)  # unknown actual: not compared
    agree_on_forward(fields, [torch.tensor(5), torch.tensor(8)], (5, -1), **kw)  # unknown expectation
    messages = []
    for checksums in ([torch.tensor(6), torch.tensor(9)], [torch.tensor(5), torch.tensor(8)]):
        with pytest.raises(AgreementError) as err:
            agree_on_forward(fields, checksums, (5, 9), **kw)
        messages.append(str(err.value))
    assert "input_ids on rank 0 (checksum 0x6, its cp_context expects 0x5)" in messages[0]
    assert "position_ids on rank 0 (checksum 0x8, its cp_context expects 0x9)" in messages[1]
    assert "guard_model supplies them" in messages[1] and "guard_model" not in messages[0]
