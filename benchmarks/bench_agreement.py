"""Cost of the per-forward agreement (issue 17): µs per forward and % of a tiny-model training step.

Spawns ``--cp`` gloo ranks on this machine. Each rank builds a tiny Llama (``tests/reference.py``) using
``blockdiag_cp`` and one packed row of ``--seq-len`` tokens, then measures, in lockstep with its peers:

- ``agreement``: :func:`hf_blockdiag_cp.model.forward_agreement.agree_forward` alone (what the model's
  pre-hook adds to every forward given a ``cp_context``: the counter, the forward's facts, the
  checksums of ``input_ids`` / ``position_ids`` and one ``all_gather`` of a 17-entry int64 row);
- ``step``: a whole training step (forward with the agreement, backward) on a fresh context each time;
- ``step without``: the same with the agreement replaced by a no-op (A/B);
- for scale: the agreement's host part alone (collective stubbed) and a bare ``all_gather`` of its row.

Medians over ``--steps`` repetitions after ``--warmup``; rank 0 prints one line per measurement.

    python benchmarks/bench_agreement.py                 # CP = 2, S = 256, 3 layers
    python benchmarks/bench_agreement.py --cp 4 --seq-len 1024 --steps 50
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.cp,
                            timeout=datetime.timedelta(seconds=120))
    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.model import forward_agreement, prepare
    from tests.reference import tiny_model

    model = tiny_model("llama", attn_implementation="blockdiag_cp", num_hidden_layers=args.layers).train()
    gen = torch.Generator().manual_seed(0)
    lengths, left = [], args.seq_len
    while left:
        lengths.append(min(left, int(torch.randint(8, args.seq_len // 2, (), generator=gen))))
        left -= lengths[-1]
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    ids = torch.randint(1, 97, (1, args.seq_len), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    config = bd.BlockDiagCPConfig(kv_exchange=args.kv_exchange, collective_timeout_s=60)

    def context():
        ctx = bd.BlockDiagCPContext.build(doc_ids, cp_rank=rank, cp_size=args.cp, group=dist.group.WORLD,
                                          config=config, input_ids=ids, position_ids=pos)
        return ctx, ids[:, ctx.local_index], pos[:, ctx.local_index]

    def timed(fn, count: int) -> float:
        times = []
        for i in range(args.warmup + count):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    ctx, local_ids, local_pos = context()
    named = {"input_ids": local_ids, "position_ids": local_pos, "cp_context": ctx}
    agreement = timed(lambda: forward_agreement.agree_forward(model, named), args.steps * 4)
    with mock.patch.object(forward_agreement, "agree_on_forward", lambda *a, **k: None):
        local = timed(lambda: forward_agreement.agree_forward(model, named), args.steps * 4)
    row, table = torch.zeros(17, dtype=torch.int64), torch.zeros(17 * args.cp, dtype=torch.int64)
    bare = timed(lambda: dist.all_gather_into_tensor(table, row), args.steps * 4)

    def step():
        ctx, local_ids, local_pos = context()
        model.zero_grad(set_to_none=True)
        out = model(local_ids, position_ids=local_pos, cp_context=ctx, use_cache=False)
        out.logits.float().square().mean().backward()

    with_agreement = timed(step, args.steps)
    with mock.patch.object(prepare, "agree_forward", lambda *a, **k: None):
        without = timed(step, args.steps)
    if rank == 0:
        print(f"CP={args.cp} gloo, tiny Llama ({args.layers} layers), S={args.seq_len}, "
              f"kv_exchange={args.kv_exchange}, "
              f"medians of {args.steps} (agreement: {args.steps * 4})")
        print(f"agreement per forward: {agreement * 1e6:8.0f} us  (host part without the collective: "
              f"{local * 1e6:.0f} us; a bare all_gather of the row: {bare * 1e6:.0f} us)")
        print(f"step (fwd+bwd):        {with_agreement * 1e6:8.0f} us  (agreement = "
              f"{100 * agreement / with_agreement:.1f}%)")
        print(f"step without it:       {without * 1e6:8.0f} us  (A/B difference "
              f"{1e6 * (with_agreement - without):.0f} us)")
    bd.training.close_process_groups()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="CP ranks (gloo processes), default 2")
    parser.add_argument("--seq-len", type=int, default=256, help="packed row length S, default 256")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers of the tiny Llama, default 3")
    parser.add_argument("--kv-exchange", default="a2a", help="kv_exchange of the steps, default a2a")
    parser.add_argument("--steps", type=int, default=30, help="measured steps, default 30")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured warm-up repetitions, default 5")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=args.cp, join=True)


if __name__ == "__main__":
    main()
