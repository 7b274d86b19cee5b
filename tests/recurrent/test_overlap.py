"""The summary all-gather overlaps the fragments that need no incoming state (issue 36, item 3).

A stand-in runner and a stand-in gather record, on one rank of a CP = 2 plan, the order of what the driver does: the
gather starts as soon as this rank's sending fragments are summarised; the fragments that start their document and
do not send, and (correcting runners) the continuing ones that do not send, run before the wait. A runner that
batches fragments into one call runs every fragment that starts its document in that one call before the gather, so
that the overlap costs no extra call. The entering states are folded only after the wait (the gathered buffer is NaN
until the wait fills it, so an early read shows as NaN). The gather's numbers are not checked here: every exactness
test of tests/recurrent runs this driver on real ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_blockdiag_cp.planning.fragments import plan_fragments
from hf_blockdiag_cp.recurrent.algebra import DecayAlgebra
from hf_blockdiag_cp.recurrent.driver import run_fragments

WIDTH = 3
# 16 tokens over 2 ranks, contiguous: rank 0 holds doc 1 (starts, alone) and doc 2's head (sends); rank 1 holds
# doc 2's tail (continues, sends nothing) and doc 3 (starts).
DOC_IDS = torch.tensor([[1] * 3 + [2] * 10 + [3] * 3])
PLACEMENT = torch.arange(16).view(2, 8)


class _Runner:
    window = False
    final = False
    augments = False

    def __init__(self, events: list[str], corrects: bool, batches: bool = False) -> None:
        self.events, self.corrects, self.batches = events, corrects, batches
        self.algebra = DecayAlgebra((WIDTH,), (WIDTH,))

    def _name(self, frags: Any) -> str:
        return ",".join(f"doc{f.doc}" for f in frags)

    def run(self, frags, states, want_end):
        self.events.append(f"run[{self._name(frags)}]" + ("+state" if states is not None else ""))
        outs = [torch.zeros(f.length) + (0 if states is None else s[0].sum()) for f, s in
                zip(frags, states or [None] * len(frags))]
        return outs, [(torch.ones(WIDTH),) for _ in frags] if want_end else None

    def transitions(self, frags):
        self.events.append(f"transitions[{self._name(frags)}]")
        return [(torch.ones(WIDTH),) for _ in frags]

    def partial(self, frags):
        self.events.append(f"partial[{self._name(frags)}]")
        n = len(frags)
        return ([torch.zeros(f.length) for f in frags], [(torch.ones(WIDTH),)] * n, [(torch.ones(WIDTH),)] * n,
                [None] * n)

    def correct(self, out, read, state):
        self.events.append("correct")
        return out + state[0].sum()

    def assemble(self, outputs, ends):
        return torch.cat(outputs)


class _Runs:
    def __init__(self, rank: int, events: list[str]) -> None:
        self.plan = plan_fragments(DOC_IDS, PLACEMENT)
        self.rank, self.events = rank, events
        self.local = self.plan.fragments[rank]

    def gather(self, buffer: torch.Tensor, deferred: Any) -> torch.Tensor:
        assert deferred is not None, "the recurrent gather is started deferred"
        self.events.append("gather")
        out = torch.full((len(self.plan.fragments) * buffer.shape[0], buffer.shape[1]), float("nan"))

        def wait() -> None:
            self.events.append("wait")
            out.zero_()
        deferred.wait = wait
        return out


#: per (rank, corrects, batches): what the driver does, in order
EXPECTED = {
    # rank 0 sends doc 2's head: summarised first; doc 1 runs while the gather travels (a batching runner runs both
    # in its one call before it)
    (0, True, False): ["run[doc2]", "gather", "run[doc1]", "wait"],
    (0, False, False): ["run[doc2]", "gather", "run[doc1]", "wait"],
    (0, True, True): ["run[doc1,doc2]", "gather", "wait"],
    (0, False, True): ["run[doc1,doc2]", "gather", "wait"],
    # rank 1 sends nothing: the gather starts at once; doc 2's tail reads its correction while it travels, then
    # corrects (a non-correcting runner runs it from its state after the wait)
    (1, True, False): ["gather", "run[doc3]", "partial[doc2]", "wait", "correct"],
    (1, False, False): ["gather", "run[doc3]", "wait", "run[doc2]+state"],
    (1, True, True): ["run[doc3]", "gather", "partial[doc2]", "wait", "correct"],
    (1, False, True): ["run[doc3]", "gather", "wait", "run[doc2]+state"],
}


@pytest.mark.parametrize("rank,corrects,batches", sorted(EXPECTED))
def test_the_gather_overlaps_the_fragments_that_need_no_state(rank: int, corrects: bool, batches: bool) -> None:
    events: list[str] = []
    with torch.no_grad():
        out = run_fragments(_Runner(events, corrects, batches), _Runs(rank, events), torch.device("cpu"))
    assert torch.isfinite(out).all(), "an entering state was read before the gather finished"
    assert events == EXPECTED[rank, corrects, batches]


@pytest.mark.parametrize("rank,expected", [
    (0, ["run[doc1,doc2]", "gather", "wait"]),  # nothing continues on rank 0
    (1, ["run[doc3]", "gather", "wait", "run[doc2]+state"]),  # doc 2's tail: one plain pass after the wait
])
def test_an_augmenting_runner_runs_a_continuing_fragment_from_its_state(rank: int, expected: list[str]) -> None:
    """A correcting runner whose reads cost an augmented pass (the delta rules on an op) does not read a continuing
    fragment that does not send during the gather: it runs it once from its entering state after the wait."""
    events: list[str] = []
    runner = _Runner(events, True, True)
    runner.augments = True
    with torch.no_grad():
        out = run_fragments(runner, _Runs(rank, events), torch.device("cpu"))
    assert torch.isfinite(out).all()
    assert events == expected


def test_a_summary_is_packed_before_the_gather_starts() -> None:
    """The continuing fragment that also sends is summarised (its transition) before the gather."""
    doc_ids = torch.tensor([[1] * 12 + [2] * 4])  # at P = 4 doc 1 spans ranks 0-2: rank 1 continues and sends
    placement = torch.arange(16).view(4, 4)
    events: list[str] = []

    class Runs(_Runs):
        def __init__(self) -> None:
            self.plan = plan_fragments(doc_ids, placement)
            self.rank, self.events = 1, events
            self.local = self.plan.fragments[1]

        def gather(self, buffer, deferred):
            assert torch.isfinite(buffer).all() and buffer.abs().sum() > 0, "summaries packed before the gather"
            return super().gather(buffer, deferred)

    with torch.no_grad():
        run_fragments(_Runner(events, False), Runs(), torch.device("cpu"))
    assert events == ["run[doc1]", "transitions[doc1]", "gather", "wait", "run[doc1]+state"]
    events.clear()
    with torch.no_grad():  # a correcting runner: one pass gives its output from zero, end, transition and reads
        run_fragments(_Runner(events, True), Runs(), torch.device("cpu"))
    assert events == ["partial[doc1]", "gather", "wait", "correct"]
