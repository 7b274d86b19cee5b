"""The benchmarks and examples as a newcomer meets them: every command-line option has ``--help`` text, the docs
name the ``[bench]`` extra and the plots the scripts write, and the balance plot's colours mean what its legend
says (one colour per placement)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
def test_every_option_has_help_text(path):
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            if not any(k.arg == "help" for k in node.keywords):
                missing.append(ast.unparse(node.args[0]) if node.args else ast.unparse(node))
    assert not missing, f"{path.name}: options without help=: {missing}"


def test_benchmarks_doc_names_the_extra_every_script_and_the_plots():
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert 'pip install -e ".[bench]"' in doc
    for script in ROOT.glob("benchmarks/*.py"):
        assert f"benchmarks/{script.name}" in doc, script.name
    # The plot files the doc names are the scripts' defaults.
    for script, png in (("bench_kernels.py", "bench_kernels.png"), ("bench_balance.py", "bench_balance.png"),
                        ("bench_layout_wall.py", "bench_layout_wall.png")):
        assert f"`{png}`" in doc
        assert re.search(rf'"--out", default="{png}"', (ROOT / "benchmarks" / script).read_text()), script
    assert "bench_cpu.png" not in doc


def _bench(name: str):
    """``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_balance_plot_colours_follow_the_placement():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgba

    bench = _bench("bench_balance")
    results = {(kind, p, scheme): {"remote_mean": 0.1 * p, "imbalance_mean": 1.0 + 0.01 * i}
               for kind in bench.ROWS for p in (2, 4, 8) for i, scheme in enumerate(bench.SCHEMES)}
    fig = bench.balance_figure(results)
    for ax, kind in zip(fig.axes, bench.ROWS):
        keys = sorted(k for k in results if k[0] == kind)
        assert len(ax.collections) == len(keys)
        markers = {}
        for points, (_, p, scheme) in zip(ax.collections, keys):
            assert tuple(points.get_facecolor()[0][:3]) == to_rgba(bench.COLORS[scheme])[:3], (kind, p, scheme)
            markers.setdefault(p, set()).add(points.get_paths()[0].vertices.tobytes())
        assert all(len(shapes) == 1 for shapes in markers.values())  # one marker per P ...
        assert len({next(iter(s)) for s in markers.values()}) == 3  # ... and a different one for each P
    legend = {text.get_text(): handle for text, handle in zip(fig.legends[0].get_texts(),
                                                              fig.legends[0].legend_handles)}
    for scheme in bench.SCHEMES:
        assert to_rgba(legend[scheme].get_color()) == to_rgba(bench.COLORS[scheme])
    assert {"P = 2", "P = 4", "P = 8"} <= set(legend)


def test_layout_wall_plot_has_one_bar_per_layout_with_its_spread(tmp_path):
    """bench_layout_wall's plot (no gloo run: a made-up table): per P a wall-time and a bytes panel, one bar per
    layout that ran (``auto`` named under the layout it chose, not a second bar of it), coloured by u, with
    min-max whiskers on the wall time."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgba

    bench = _bench("bench_layout_wall")
    results = {2: {1: (1, 35.0, 34.0, 30.0, 41.0), 2: (2, 32.0, 320.0, 31.0, 36.0),
                   "auto": (1, 28.0, 34.0, 27.0, 30.0)},
               4: {1: (1, 63.0, 48.0, 60.0, 70.0), 2: (2, 73.0, 177.0, 70.0, 80.0), 4: (4, 61.0, 288.0, 55.0, 66.0),
                   "auto": (4, 37.0, 288.0, 35.0, 40.0)}}
    fig = bench.layout_figure(results, 256)
    for col, world in enumerate(sorted(results)):
        fixed = {u: v for u, v in results[world].items() if u != "auto"}
        for row, value in ((0, 1), (1, 2)):
            ax = fig.axes[row * len(results) + col]
            bars = [p for p in ax.patches if p.get_height() > 0]
            assert [b.get_height() for b in bars] == [v[value] for v in fixed.values()], (world, row)
            for bar, u in zip(bars, fixed):
                assert to_rgba(bar.get_facecolor()) == to_rgba(bench.U_COLORS[u]), (world, u)
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            chosen = results[world]["auto"][0]
            assert ticks == [f"u={u} x c={world // u}" + ("\n(auto's choice)" if u == chosen else "") for u in fixed]
        assert fig.axes[col].collections, "the wall-time panel draws the min-max spread"
        segments = fig.axes[col].collections[0].get_segments()
        assert [(s[0][1], s[1][1]) for s in segments] == [(v[3], v[4]) for v in fixed.values()]
    bench.plot(results, 256, str(tmp_path / "wall.png"))
    assert (tmp_path / "wall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planning_bench_measures_a_small_row():
    """bench_planning.py end to end on a tiny row: a row per rank pair, its table line and the issue-25 notes."""
    bench = _bench("bench_planning")
    examples = bench.documents(4096, median=300, sigma=1.0)
    assert sum(e["input_ids"].numel() for e in examples) <= 4096
    row = bench.measure(examples, 4096, 4, "balanced", "64", "1", repeats=1)
    assert row.cp_size == 4 and row.docs == len(examples) and row.context_bytes > 0
    assert row.slowest_s >= row.first_s > 0 and row.one_pass_s > 0 and row.ratio_fastest >= row.ratio > 0
    line = bench.table([row]).splitlines()[-1]
    assert line.startswith("| 4,096 | 4 | balanced | 64 | 1 |")
    assert bench.acceptance([row]) == []  # its checks are for S = 1M and 4M only


def test_vlm_bench_rows_fill_a_row_with_about_30_percent_image_tokens():
    """bench_vlm.py's rows (no gloo run): one row of documents in the processor's format, >= 90 % full, with about 30 %
    image placeholders, some documents without images."""
    bench = _bench("bench_vlm")
    for model_type in bench.MODELS:
        config = bench.tiny_config(model_type)
        docs = bench.row_documents(config, 2048, seed=0)
        tokens = sum(len(d["input_ids"]) for d in docs)
        images = sum(int((d["input_ids"] == config.image_token_id).sum()) for d in docs)
        assert 0.9 * 2048 <= tokens <= 2048 and 0.2 <= images / tokens <= 0.4, (model_type, tokens, images)
        assert any("pixel_values" not in d for d in docs) and any("pixel_values" in d for d in docs)


def test_vlm_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    bench = _bench("bench_vlm")
    results = {s: {"cpu": (0.1 * s / 1024, 0.06 * s / 1024), "wall": (0.1 * s / 1024, 0.07 * s / 1024),
                   "media_kib": 10.0, "kv_kib": 5.0} for s in (1024, 2048)}
    bench.plot(results, str(tmp_path / "vlm.png"))
    assert (tmp_path / "vlm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cp_floor_shards_cover_every_document_once_in_pieces():
    """bench_recurrent_layers.py --floor's shards (cp_floor.shard_documents): over the ranks, every document's tokens
    exactly once, each piece a contiguous run of one document, and a document cut by the placement in pieces."""
    import hf_blockdiag_cp as bd
    floor = _bench("cp_floor")
    lengths, base, docs = [700, 90, 300, 500, 200], 1, []
    for n in lengths:  # token ids unique over the row: a piece's first id names its document and offset
        docs.append(list(range(base, base + n)))
        base += n
    for world, placement in ((2, "balanced"), (4, "balanced"), (4, "contiguous"), (4, "mirror")):
        pieces = []
        for rank in range(world):
            batch = bd.PackingCollator(2048, cp_size=world, cp_rank=rank, pad_token_id=0, vocab_size=base,
                                       placement=placement)([{"input_ids": d} for d in docs])
            pieces += floor.shard_documents(batch)
        assert all(p == list(range(p[0], p[0] + len(p))) for p in pieces), placement  # contiguous runs
        owner = {t: i for i, d in enumerate(docs) for t in d}
        assert all(owner[p[0]] == owner[p[-1]] for p in pieces), placement  # never across a document boundary
        assert sorted(t for p in pieces for t in p) == list(range(1, base)), placement  # every token once
        assert len(pieces) > len(docs), (world, placement)  # some document is cut


def test_cp_floor_attention_clock_and_floor_arithmetic(monkeypatch):
    """cp_floor.AttentionClock times a tiny hybrid's one attention layer forward and, once, backward (a clock that
    ticks by one per reading: each timed range reads it twice in a row), nothing after a reset; refuses a model without
    an attention layer; floor_cpu swaps each shard's attention time for CP = 1's share and takes the busiest."""
    import itertools

    import torch
    from transformers import AutoConfig

    from hf_blockdiag_cp.conformance.runs import build_model
    floor = _bench("cp_floor")
    config = AutoConfig.from_pretrained(ROOT / "configs" / "model" / "tiny-qwen3-next.json")
    model = build_model(config, "sdpa").train()
    clock = floor.AttentionClock(model)
    ids = torch.randint(3, 250, (1, 64))
    ticks = itertools.count()
    monkeypatch.setattr(floor.time, "thread_time", lambda: float(next(ticks)))
    with torch.no_grad():
        model(input_ids=ids)
    assert clock.seconds == 1.0  # one attention layer's forward
    model(input_ids=ids).logits.sum().backward()
    assert clock.seconds == 3.0  # its forward and its backward, once each
    clock.reset()
    assert clock.seconds == 0.0
    plain = torch.nn.Module()
    plain.model = torch.nn.Module()
    plain.model.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4))])
    with pytest.raises(ValueError, match="no attention layer"):
        floor.AttentionClock(plain)
    assert floor.keep_heap() in (True, False)
    assert floor.floor_cpu([(1.0, 0.2), (0.9, 0.05)], 0.6, 2) == pytest.approx(max(1.0 - 0.2, 0.9 - 0.05) + 0.3)


@pytest.mark.parametrize("argv, message", [(["--warmup", "-1"], "--warmup -1: must be >= 0"),
                                           (["--worlds", "2", "3", "--tokens", "2048"],
                                            "--worlds 3: must be >= 1 and divide --tokens 2048")])
def test_recurrent_layers_bench_names_the_bad_flag(argv, message, monkeypatch, capsys):
    """bench_recurrent_layers.py --part cp: an out-of-range option is a usage error naming it, before any spawn."""
    bench = _bench("bench_recurrent_layers")
    monkeypatch.setattr("sys.argv", ["bench_recurrent_layers.py", "--part", "cp", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_train_scaling_real_vocab_lengths_are_whole_documents(monkeypatch, capsys):
    """bench_train_scaling.py --real-vocab packs 512-token documents: a length that is not a multiple (which packed
    nothing and failed inside torchrun with "examples is empty") is a usage error naming the lengths."""
    bench = _bench("bench_train_scaling")
    monkeypatch.setattr("sys.argv", ["bench_train_scaling.py", "--real-vocab", "--own-seq-lens", "256", "1024",
                                     "--seq-lens", "700"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2 and "multiples of 512 (got [256, 700])" in capsys.readouterr().err


RANK_SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py"), *ROOT.glob("scripts/*.py"),
                       ROOT / "tests" / "launch.py", ROOT / "hf_blockdiag_cp" / "conformance" / "launch.py"])


@pytest.mark.parametrize("path", RANK_SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in RANK_SCRIPTS])
def test_every_script_that_makes_a_process_group_ends_it_settled(path):
    """A rank whose group is destroyed bare, or never, while its batch's context still holds it, can abort at exit
    (``terminate called without an active exception``: follow_data.py's rank 1 did once in CI). A file that calls
    ``init_process_group`` or ``init_device_mesh`` also calls ``close_process_groups``, which settles gloo's workers
    first (a bare ``destroy_process_group`` stays only as the fallback of a ``finally``), or runs ``CPTrainer`` /
    ``CPSFTTrainer``, which register it at exit. examples/common.py only hands its mesh to such scripts."""
    names = {getattr(n.func, "attr", getattr(n.func, "id", None))
             for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}
    if names & {"init_process_group", "init_device_mesh", "launch_mesh"} and path.name != "common.py":
        assert names & {"close_process_groups", "CPTrainer", "CPSFTTrainer"}, \
            f"{path.name} makes a process group and never calls close_process_groups"
