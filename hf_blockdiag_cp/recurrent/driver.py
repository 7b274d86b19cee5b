"""The one algorithm of every served recurrent call: fragments, summaries, one gather, composition, reassembly.

Legend: a *fragment* is a piece of one document on this rank (:class:`~hf_blockdiag_cp.planning.fragments.Fragment`);
it *continues* when an earlier piece of its document exists and *sends* when a later one does. A :class:`Runner`
knows how to run fragments of one call (the model's function, the package's ops, a whole module, a window); its
:attr:`~Runner.algebra` knows the summaries (:mod:`.algebra`). :func:`run_fragments`:

1. runs what the summaries need: from a zero state every fragment that sends and starts its document (its end state
   from zero is its summary's end) — a runner that *batches* (one call over many fragments) runs every fragment that
   starts its document in that one call — and, for the fragments that continue and send, their transitions (a runner
   that *corrects*, outputs linear in the entering state ``o(S) = o(0) + read(S)``, gets the output from zero, the
   end, the transition and the reads in one pass);
2. under CP starts ONE fixed-shape all-gather of every rank's summaries (``slots`` per rank, :func:`gather`) and,
   while it is under way, runs what needs no incoming state and was not run yet: the other fragments that start
   their document and, when the runner corrects, the reads of the continuing ones that do not send (a batching
   runner reads them together with the continuing senders in step 1 when there are any, one call instead of two).
   A runner whose reads cost an *augmented* pass (the delta rules on an op: ~1.4x a plain pass on CPU) runs a
   continuing fragment that does not send from its state after the wait instead, one plain pass;
3. waits, folds each continuing fragment's entering state from the earlier fragments' summaries in document order
   and either corrects its output or runs it from that state;
4. reassembles the rows and ties the gather into the output so that every rank runs the gather's backward
   (:func:`tie`, a zero that does not carry values: a NaN document stays in its document).

Every fragment runs once when the runner corrects (a non-correcting runner runs a continuing fragment that sends
twice: from zero for its summary's end, and from its state).

At CP = 1 the fragments are the documents (nothing continues): step 1 is the whole call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..distributed.exchange import Deferred
from ..planning.fragments import Fragment
from .algebra import State, StateAlgebra, Summary
from .runs import LocalRuns

__all__ = ["Runner", "gather", "run_fragments", "tie"]


class Runner(Protocol):
    """How one call's fragments run (see the module docstring); every method takes fragments of this rank."""

    algebra: StateAlgebra
    #: outputs are linear in the entering state: continuing fragments run once, before the gather
    corrects: bool
    #: one call runs many fragments (an op over ``cu_seqlens``): a call more costs a pass over the longest
    #: fragment's chunks, so the driver splits off only what the overlap needs (see :func:`run_fragments`)
    batches: bool
    #: the summary is the fragment's last inputs (:class:`~.algebra.WindowAlgebra`), not read off a run
    window: bool
    #: the call asks for its final state (CP = 1: each row's last fragment's end state)
    final: bool
    #: its reads come from an augmented pass (the delta rules on an op: values widened by ``Dk`` columns, ~1.4x a
    #: plain pass on CPU): a continuing fragment that does not send runs once from its state after the gather instead
    augments: bool

    def run(self, frags: Sequence[Fragment], states: Sequence[State] | None,
            want_end: bool) -> tuple[list[Any], list[State] | None]:
        """Outputs (one per fragment, in the runner's form) from ``states`` (``None``: zero states) and, when
        ``want_end``, the end states."""

    def transitions(self, frags: Sequence[Fragment]) -> list[State]:
        """Each fragment's transition parts (``window`` runners: the inputs' tail as the end, see :meth:`tails`)."""

    def tails(self, frags: Sequence[Fragment]) -> list[State]:
        """``window`` runners: each fragment's last inputs (its summary's end)."""

    def partial(self, frags: Sequence[Fragment]) -> tuple[list[Any], list[State], list[State], list[Any]]:
        """``corrects`` runners: ``(o(0), end from zero, transition, reads)`` of continuing fragments in one pass."""

    def correct(self, out: Any, read: Any, state: State) -> Any:
        """``corrects`` runners: the output of a fragment entered with ``state``."""

    def assemble(self, outputs: list[Any], ends: list[State] | None) -> Any:
        """The call's result from every fragment's output in local order (and the end states at CP = 1)."""


class _ZeroOf(torch.autograd.Function):
    """A 0-d zero whose backward reaches ``gathered`` with zeros (``x * 0`` would carry a NaN of ``x``)."""

    @staticmethod
    def forward(ctx, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.shape, ctx.gdtype = gathered.shape, gathered.dtype
        return torch.zeros((), dtype=dtype, device=gathered.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.new_zeros(ctx.shape, dtype=ctx.gdtype), None


def tie(out: Any, gathered: torch.Tensor) -> Any:
    """``out`` (a tensor or a tuple of them) tied to ``gathered`` by an exact zero: every rank runs the gather's
    backward (a collective), also one whose fragments use none of it, and no value crosses documents."""
    if isinstance(out, tuple):
        return tuple(tie(o, gathered) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
    if not torch.is_grad_enabled():
        return out
    return out + _ZeroOf.apply(gathered, out.dtype)


def gather(runs: LocalRuns, sent: Sequence[torch.Tensor], width: int, device: torch.device,
           deferred: Deferred | None = None) -> torch.Tensor:
    """Every rank's summaries ``[P * slots, W]`` fp32 (rank ``r``'s slot ``s`` at row ``r * slots + s``) from this
    rank's ``sent`` (``[W]`` each, in the plan's send order, zero-padded to ``slots``); with ``deferred``, read the
    result after ``deferred.wait()``."""
    buffer = torch.zeros(runs.plan.slots, width, dtype=torch.float32, device=device)
    if sent:
        buffer = torch.cat([torch.stack([s.float() for s in sent]), buffer[len(sent):]])
    if torch.is_grad_enabled() and not buffer.requires_grad:
        buffer.requires_grad_()  # a rank that sends nothing differentiable must still join the backward
    return runs.gather(buffer, deferred)


def _summarise(runner: Runner, frags: list[Fragment], send: Sequence[int], sources: dict, outputs: dict[int, Any],
               reads: dict[int, tuple[Any, Any]]) -> dict[int, Summary]:
    """Step 1 (module docstring): the summaries of this rank's sending fragments ``send``; fills the outputs of
    the fragments it runs from zero and, for a correcting runner, the reads of the continuing ones it runs."""
    if runner.window:
        return {i: Summary(end) for i, end in zip(send, runner.tails([frags[i] for i in send]))}
    summaries: dict[int, Summary] = {}
    sending = set(send)
    first = [i for i in range(len(frags)) if i in sending and (i not in sources or not runner.corrects)
             or runner.batches and i not in sources]
    if first:
        outs, ends = runner.run([frags[i] for i in first], None, any(i in sending for i in first))
        for i, out, end in zip(first, outs, ends or [None] * len(first)):
            if i in sending:
                summaries[i] = Summary(end)
            if i not in sources:
                outputs[i] = out
    movers = [i for i in send if i in sources]
    if movers and runner.corrects:
        both = sorted(sources) if runner.batches else movers  # one call for every continuing fragment
        out0, end0, trans, read = runner.partial([frags[i] for i in both])
        for j, i in enumerate(both):
            reads[i] = (out0[j], read[j])
            if i in sending:
                summaries[i] = Summary(end0[j], trans[j])
    elif movers:
        for i, t in zip(movers, runner.transitions([frags[i] for i in movers])):
            summaries[i] = Summary(summaries[i].end, t)
    return summaries


def run_fragments(runner: Runner, runs: LocalRuns, device: torch.device) -> Any:
    """One served call: see the module docstring. ``runs``: the forward's fragments (and, under CP, its plan)."""
    frags = list(runs.local)
    plan = runs.plan
    if plan is None:
        outs, ends = runner.run(frags, None, runner.final)
        return runner.assemble(outs, ends)
    send, sources = plan.send[runs.rank], plan.sources[runs.rank]
    outputs: dict[int, Any] = {}
    reads: dict[int, tuple[Any, Any]] = {}
    summaries = _summarise(runner, frags, send, sources, outputs, reads)
    algebra = runner.algebra
    deferred = Deferred()
    gathered = gather(runs, [algebra.pack(summaries[i]) for i in send], algebra.width, device, deferred)
    # While the summaries travel: what needs no incoming state.
    rest = [i for i in range(len(frags)) if i not in sources and i not in outputs]
    if rest:
        outputs.update(zip(rest, runner.run([frags[i] for i in rest], None, False)[0]))
    continuing = sorted(sources)
    late = [i for i in continuing if i not in reads] if runner.corrects and not runner.augments else []
    if late:
        out0, _, _, read = runner.partial([frags[i] for i in late])
        reads.update(zip(late, zip(out0, read)))
    deferred.wait()
    states = {i: algebra.fold([gathered[r * plan.slots + s] for r, s in sources[i]],
                              [plan.fragments[r][plan.send[r][s]].length for r, s in sources[i]])
              for i in continuing}
    for i in continuing:
        if i in reads:
            outputs[i] = runner.correct(reads[i][0], reads[i][1], states[i])
    rerun = [i for i in continuing if i not in reads]
    if rerun:
        outputs.update(zip(rerun, runner.run([frags[i] for i in rerun], [states[i] for i in rerun], False)[0]))
    return tie(runner.assemble([outputs[i] for i in range(len(frags))], None), gathered)
