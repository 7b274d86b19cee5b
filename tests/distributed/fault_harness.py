"""The fault harness of tests/distributed/test_faults*.py (issue 13): real gloo ranks at CP=2 (or 4); a fault is
injected on one rank and every surviving rank must raise the documented error within
``collective_timeout_s`` + 30 s (docs/errors.md lists what each fault gets).

Several scenarios share one spawn: each starts a fresh process group and mesh through
``hf_blockdiag_cp.init_device_mesh`` (so the groups get the package's timeout, as in training), and a
rank that fails destroys its group as a dying process would close its sockets. A control store
(not a process group) lines the ranks up between scenarios. The test process serves every store (the
control store and one per scenario's group: a group leaves keys behind), so a rank that dies cannot take
the rendezvous of the others down. Times are measured on every rank from the
start of its scenario to its error, and printed (``pytest -s``) for the report.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import tempfile
import time

from tests.launch import LOCALHOST, client_env, hosted_stores, run_ranks

TIMEOUT_S = 5.0  # collective_timeout_s of every scenario
PG_TIMEOUT_S = TIMEOUT_S + 10.0  # what init_device_mesh gives the process groups (the minimum margin)
BOUND_S = TIMEOUT_S + 30.0  # the acceptance bound on every surviving rank's time to its error
# The stalls wait out a timeout by design: a shorter one keeps them short (the fast scenarios keep 5 s, so that
# a loaded machine cannot make a healthy collective time out).
STALL_TIMEOUT_S = 3.0
STALL_PG_TIMEOUT_S = STALL_TIMEOUT_S + 10.0
LENGTHS = [5, 20, 3, 12, 8]  # 48 tokens: at CP=2 (L=24) the second document straddles the boundary
SPLIT_AT_4 = [12, 12, 12, 12]  # at CP=4 no document crosses a rank boundary: nothing to exchange
FAULTY = 1  # the rank a fault is injected on


# ---- the step every scenario runs --------------------------------------------------------------------


def _row(lengths: list[int] = LENGTHS, seed: int = 0):
    """``doc_ids [S]``, ``input_ids [1, S]``, ``position_ids [1, S]`` of one packed row."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    ids = torch.randint(0, 97, (1, doc_ids.numel()), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return doc_ids, ids, pos


def _context(rank: int, world: int, group, config, *, lengths=LENGTHS, seed: int = 0, cp_size: int | None = None):
    from hf_blockdiag_cp import BlockDiagCPContext

    doc_ids, ids, pos = _row(lengths, seed)
    ctx = BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=rank, cp_size=cp_size or world, group=group,
                                   config=config, input_ids=ids, position_ids=pos)
    sl = slice(ctx.row_offset, ctx.row_offset + ctx.local_len)
    return ctx, ids[:, sl], pos[:, sl]


def _build(rank: int, world: int, group, config, *, seed: int = 0, placement: str = "contiguous"):
    """This rank's context and shard (``input_ids``, ``position_ids [1, L]``, copies) of the row ``_row(LENGTHS)``,
    for any ``placement``."""
    from hf_blockdiag_cp import BlockDiagCPContext

    doc_ids, ids, pos = _row(LENGTHS, seed)
    ctx = BlockDiagCPContext.build(doc_ids, placement=placement, cp_rank=rank, cp_size=world, group=group,
                                   config=config, input_ids=ids, position_ids=pos)
    return ctx, ids[:, ctx.local_index].clone(), pos[:, ctx.local_index].clone()


def _with(config, exchange: str):
    """``config`` with ``kv_exchange=exchange``."""
    return dataclasses.replace(config, kv_exchange=exchange)


def _step(model, ctx, ids, pos) -> None:
    """One forward and backward of the tiny model on this rank's shard."""
    out = model(ids, position_ids=pos, cp_context=ctx, use_cache=False)
    out.logits.float().square().mean().backward()


def _model(**overrides):
    from tests.reference import tiny_model

    model = tiny_model("llama", attn_implementation="blockdiag_cp", num_hidden_layers=3, **overrides)
    return model.train()


class _PatchedKernel:
    """Replace the ``sdpa_doc`` kernel on this rank while the scenario runs (restored afterwards)."""

    def __init__(self, make):
        import hf_blockdiag_cp.kernels.sdpa_doc as module

        self.module, self.make = module, make

    def __enter__(self):
        self.original = self.module.attention
        self.module.attention = self.make(self.original)

    def __exit__(self, *exc):
        self.module.attention = self.original


def _step_with_faulty_kernel(rank, world, mesh, config, make) -> None:
    """One step of every rank, the kernel replaced by ``make(original)`` on the faulty rank only."""
    ctx, ids, pos = _context(rank, world, mesh["cp"].get_group(), config)
    model = _model()
    if rank != FAULTY:
        _step(model, ctx, ids, pos)
        return
    with _PatchedKernel(make):
        _step(model, ctx, ids, pos)


# ---- scenarios: (rank, world, mesh, config) -> None, raising what the fault gives this rank --------------


def _kernel_forward(rank, world, mesh, config):
    def make(original):
        def broken(*args, **kwargs):
            raise RuntimeError("injected kernel fault")
        return broken

    _step_with_faulty_kernel(rank, world, mesh, config, make)


def _kernel_backward(rank, world, mesh, config):
    import torch

    class RaiseInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("injected backward fault")

    def make(original):
        def broken(*args, **kwargs):
            return RaiseInBackward.apply(original(*args, **kwargs))
        return broken

    _step_with_faulty_kernel(rank, world, mesh, config, make)


def _sleep_past_timeout(rank, world, mesh, config):
    ctx, ids, pos = _context(rank, world, mesh["cp"].get_group(), config)
    model = _model()
    if rank == FAULTY:
        time.sleep(config.collective_timeout_s + 4)
    _step(model, ctx, ids, pos)


def _skipped_step(rank, world, mesh, config):
    """The faulty rank skips step 1 (e.g. a data loader that dropped a batch): it runs step 2 while its
    peers run step 1."""
    group = mesh["cp"].get_group()
    model = _model()
    steps = [dict(lengths=LENGTHS, seed=0), dict(lengths=[9, 14, 25], seed=1)]
    for step in (steps[1:] if rank == FAULTY else steps):
        _step(model, *_context(rank, world, group, config, **step))


def _different_rows_same_layout(rank, world, mesh, config):
    ctx, ids, pos = _context(rank, world, mesh["cp"].get_group(), config, seed=100 + rank)
    _step(_model(), ctx, ids, pos)


def _wrong_cp_size(rank, world, mesh, config):
    """Contexts planned for CP=4 used in a 2-rank group: no document crosses a rank boundary at CP=4,
    so nothing is exchanged and only the agreement can notice (before the fix: half of every row
    trained silently)."""
    import dataclasses

    group = mesh["cp"].get_group()
    try:
        _context(rank, world, group, config, lengths=SPLIT_AT_4, cp_size=4)
    except ValueError as err:  # a live group is checked when the context is built
        assert "cp_size=4 but the process group given has 2 ranks" in str(err), err
    else:
        raise AssertionError("BlockDiagCPContext.build accepted cp_size=4 with a 2-rank group")
    ctx, ids, pos = _context(rank, world, None, config, lengths=SPLIT_AT_4, cp_size=4)
    ctx = dataclasses.replace(ctx, group=group)  # attached later, as a loop that fills in the group would
    _step(_model(), ctx, ids, pos)


def _sigkill(rank, world, mesh, config):
    """The faulty rank is SIGKILLed in its second layer's kernel, with the halo exchange (point-to-point)."""
    import dataclasses

    calls = []

    def make(original):
        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return dying

    _step_with_faulty_kernel(rank, world, mesh, dataclasses.replace(config, kv_exchange="halo"), make)


def _ddp_step(rank, world, mesh, config, *, stall_collator: bool, stall_backward: bool):
    """The README's DDP loop (DDP over the world, PackingCollator, normalize_num_items) at CP=2; the faulty
    rank stalls for longer than the process group's timeout in its collator or in the embedding backward."""
    import torch

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    stall = config.process_group_timeout.total_seconds() + 1
    model = bd.guard_model(tiny_model("llama", attn_implementation="blockdiag_cp").train())
    if stall_backward and rank == FAULTY:
        model.get_input_embeddings().weight.register_hook(lambda grad: time.sleep(stall))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    collator = bd.PackingCollator(48, group=mesh["cp"], pad_token_id=0, config=config)
    doc_ids, ids, _ = _row()
    examples = [{"input_ids": ids[0, doc_ids == d].tolist()} for d in range(1, len(LENGTHS) + 1)]
    if stall_collator and rank == FAULTY:
        time.sleep(stall)
    batch = bd.normalize_num_items(collator(examples), mesh)
    ddp(**batch).loss.backward()


def _ddp_collator_stall(rank, world, mesh, config):
    _ddp_step(rank, world, mesh, config, stall_collator=True, stall_backward=False)


def _ddp_backward_stall(rank, world, mesh, config):
    _ddp_step(rank, world, mesh, config, stall_collator=False, stall_backward=True)


def _state_gather_peer_fails(rank, world, mesh, config):
    """The faulty rank raises in its recurrent runner instead of joining the step runtime's named state all-gather
    (its group then closes, as a failing process's would); the survivor's gather must fail naming it, and its next
    gather on that group must refuse to start (the broken-group check)."""
    import torch

    from hf_blockdiag_cp.errors import CollectiveError
    from hf_blockdiag_cp.runtime import step_runtime

    ctx, _, _ = _context(rank, world, mesh["cp"].get_group(), config)
    runtime = step_runtime(ctx)
    what = "recurrent state all-gather"
    if rank == FAULTY:
        with runtime.guard(ctx, "recurrent test runner"):
            raise RuntimeError("injected runner fault")
    try:
        runtime.all_gather(ctx, torch.ones(2, 3, requires_grad=True), what=what)
    except CollectiveError as first:
        try:
            runtime.all_gather(ctx, torch.ones(2, 3), what=what)
        except CollectiveError as second:  # both messages, the refusal first (the log keeps 600 characters)
            raise CollectiveError(f"{second} || {first}") from None
        raise AssertionError("the second gather on the broken group started") from first
    raise AssertionError("the state all-gather did not fail")


SCENARIOS = {
    "kernel_forward": _kernel_forward,
    "kernel_backward": _kernel_backward,
    "skipped_step": _skipped_step,
    "different_rows_same_layout": _different_rows_same_layout,
    "wrong_cp_size": _wrong_cp_size,
    "state_gather_peer_fails": _state_gather_peer_fails,
    "sigkill": _sigkill,  # must be the last scenario of its spawn: the faulty rank dies
    "sleep_past_timeout": _sleep_past_timeout,
    "ddp_collator_stall": _ddp_collator_stall,
    "ddp_backward_stall": _ddp_backward_stall,
}


# ---- the harness ---------------------------------------------------------------------------------------


def _barrier(store, key: str, world: int) -> None:
    if store.add(key, 1) == world:
        store.set(f"{key}/go", "1")
    store.wait([f"{key}/go"])


def _scenario_worker(rank: int, world: int, names: list[str], ports: list[int], cp_size: int, log_dir: str,
                     timeout_s: float) -> None:
    """Run ``names`` one after another, each in a fresh process group made by init_device_mesh; every
    outcome is appended to ``log_dir/rank{rank}.jsonl`` at once (a rank may be killed by its scenario)."""
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.distributed.groups import group_timeout

    dist.destroy_process_group()  # the harness's group: every scenario makes its own
    store = dist.TCPStore(LOCALHOST, ports[0], is_master=False, timeout=datetime.timedelta(seconds=240))
    config = bd.BlockDiagCPConfig(collective_timeout_s=timeout_s)
    pg_timeout_s = timeout_s + 10.0
    assert config.process_group_timeout.total_seconds() == pg_timeout_s
    for i, (name, port) in enumerate(zip(names, ports[1:])):
        _barrier(store, f"scenario{i}", world)
        os.environ.update(client_env(port), RANK=str(rank), WORLD_SIZE=str(world))  # a fresh store per group
        mesh = bd.init_device_mesh(cp_size, config=config)
        assert group_timeout().total_seconds() == pg_timeout_s  # init_device_mesh made the default group
        start = time.monotonic()
        try:
            SCENARIOS[name](rank, world, mesh, config)
            error, message = None, ""
        except Exception as err:  # the outcome under test
            error, message = type(err).__name__, str(err)
        elapsed = time.monotonic() - start
        dist.destroy_process_group()  # as a failing process would: its peers see the connection close
        with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a", encoding="utf-8") as fh:
            record = {"scenario": name, "error": error, "message": message[:600], "elapsed_s": elapsed}
            fh.write(json.dumps(record) + "\n")


def _run(names: list[str], world: int = 2, timeout: float = 240.0, timeout_s: float = TIMEOUT_S) -> dict[str, list]:
    """``{scenario: [(status, error, message, elapsed_s) per rank]}``; status is 'ran', or 'died' for a rank
    that was killed before it could report the scenario."""
    with hosted_stores(len(names) + 1) as ports, tempfile.TemporaryDirectory() as log_dir:
        outcome = run_ranks(_scenario_worker, world, names, ports, world, log_dir, timeout_s, timeout=timeout,
                            expect_failure=True)
        logs = []
        for rank in range(world):
            path = os.path.join(log_dir, f"rank{rank}.jsonl")
            lines = open(path, encoding="utf-8").read().splitlines() if os.path.exists(path) else []
            logs.append({r["scenario"]: r for r in map(json.loads, lines)})
    table: dict[str, list] = {}
    for name in names:
        rows = []
        for rank in range(world):
            r = logs[rank].get(name)
            rows.append(("ran", r["error"], r["message"], r["elapsed_s"]) if r is not None
                        else ("died", None, str(outcome[rank][1])[-2000:], None))
        table[name] = rows
        print(f"fault {name}: " + "; ".join(  # the measured times, for the report (pytest -s)
            f"rank {rank}: {err or 'no error'} after {t:.1f} s" if t is not None else f"rank {rank}: {status}"
            for rank, (status, err, _, t) in enumerate(rows)))
    return table


def _survivors_raise(rows: list, expected: dict[int, tuple[str, str]], bound: float = BOUND_S) -> None:
    """Every rank in ``expected`` raised that (error type, message fragment) within ``bound`` seconds."""
    for rank, (error, fragment) in expected.items():
        status, got, message, elapsed = rows[rank]
        assert status == "ran" and got == error and fragment in message, (rank, rows[rank])
        assert elapsed < bound, f"rank {rank} took {elapsed:.1f} s > {bound:.0f} s"


