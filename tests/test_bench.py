"""The benchmark CLI (python -m cutlass_fused.bench): its correctness check, JSON schema and report."""
import importlib.util
import json

import pytest

import cutlass_fused
from cutlass_fused import bench
from common import CUDA, HOPPER

ROW_KEYS = {"shape", "dtype", "mode", "impl", "graphs", "ms", "tflops", "ratio_to_mm", "peak_extra_mib", "kernels",
            "host_us"}


@pytest.mark.parametrize("rounds", [1, 2])
def test_bench_runs_and_writes_schema(tmp_path, capsys, rounds):
    argv = ["--shape", "64,96,40", "--out", str(tmp_path), "--impl", "torch.mm", "--impl", "eager",
            "--impl", "cutlass_fused", "--impl", "cutlass_fused-frozen", "--rounds", str(rounds)]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["meta"]) >= {"gpu", "torch", "cuda", "version", "commit", "date", "command"}
    rows = res["rows"]
    impls = ("torch.mm", "eager", "cutlass_fused", "cutlass_fused-frozen")
    assert {(r["impl"], r["mode"]) for r in rows} == {(i, m) for i in impls for m in bench.MODES}
    for r in rows:
        assert set(r) == ROW_KEYS and r["shape"] == [64, 96, 40] and r["ms"] > 0
        # Every ratio is to one torch.mm time per shape (the median of all its rounds), so the
        # ratios order the rows as their times do.
        assert r["ratio_to_mm"] == pytest.approx(r["ms"] / (bench.GEMMS[r["mode"]] * rows[0]["ms"]))
        assert (r["kernels"] is not None) == CUDA
    # The check compared both modes against float64 and passed the error rule.
    assert [c["mode"] for c in res["checks"]] == ["train", "eval"] and all(c["ok"] for c in res["checks"])
    assert "cutlass_fused" in capsys.readouterr().out
    # The PNG is drawn on the CPU too (where matplotlib, the [bench] extra, is installed).
    assert (tmp_path / "results.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert bench.main(["--report", str(tmp_path / "results.json")]) == 0
    report = capsys.readouterr().out
    assert report.startswith("| shape |") and report.count("| 64x96x40 |") == len(rows)


def test_bench_rejects_bad_shape():
    with pytest.raises(SystemExit):
        bench.main(["--shape", "1,2"])


def test_bench_rejects_zero_rounds(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "expected --rounds to be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(CUDA, reason="the CPU refusal of GPU-only precisions")
def test_bench_cpu_refuses_gpu_precisions(tmp_path):
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench.main(["--dtype", "tf32", "--out", str(tmp_path)])


def test_tune_times_every_candidate(tmp_path):
    from cutlass_fused import tune
    argv = ["--shape", "64,96,40", "--family", "sm80", "--out", str(tmp_path)]
    if not CUDA:
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            tune.main(argv)
        return
    assert tune.main(argv) == 0
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"]
    built = {n for n in __import__("cutlass_fused").built_kernels() if n.startswith("sm80_bf16_eval_")}
    assert {r["kernel"] for r in rows} == built and all(r["eval_ms"] > 0 and r["train_ms"] > 0 for r in rows)


@pytest.mark.skipif(not HOPPER, reason="tile orders are the sm90 scheduler's")
def test_tune_times_each_tile_order_in_rounds(tmp_path):
    from cutlass_fused import tune
    name = next(n for n in __import__("cutlass_fused").built_kernels() if n.startswith("sm90_bf16_eval_"))
    argv = ["--shape", "64,96,40", "--kernel", name, "--swizzle=auto,8", "--raster=-,m", "--rounds", "2",
            "--out", str(tmp_path)]
    assert tune.main(argv) == 0
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"]
    assert [(r["swizzle"], r["raster"]) for r in rows] == [("auto", "-"), ("auto", "m"), ("8", "-"), ("8", "m")]
    assert all(r["kernel"] == name and r["eval_x_mm"] > 0 and r["train_x_mm"] > 0 for r in rows)


def test_alternating_reverses_every_other_round():
    """The timing order of bench's tools (tune, benchmarks/*_time.py): no item always first."""
    assert list(bench.alternating(["a", "b", "c"], 3)) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_overrides_reach_the_plan_and_are_restored():
    """tune and the benchmarks/*_time.py tools force choices through cutlass_fused.overrides(): the
    plan (C++) sees them inside, nested blocks stack, and each exit restores what was in force."""
    small = dict(m=128, n=8192, k=1024)  # bf16: the plan's own tail is the small one
    own = cutlass_fused.plan(**small)
    assert (own["tail"], own["swizzle"]) == ("small", 1)
    with cutlass_fused.overrides(tail="cooperative"):
        assert cutlass_fused.plan(**small)["tail"] == "cooperative"
        with cutlass_fused.overrides(swizzle=2):
            got = cutlass_fused.plan(**small)
            assert (got["tail"], got["swizzle"]) == ("cooperative", 2)
        assert cutlass_fused.plan(**small) == {**own, "tail": "cooperative"}
    assert cutlass_fused.plan(**small) == own


def test_run_shapes_puts_the_sweep_after_the_shapes():
    """--shape with --sweep: one results file holds both (issue 7's record), each shape once."""
    sweep = [(b, 8192, 8192) for b in bench.SWEEP]
    assert bench.run_shapes([(1024, 8192, 8192), (4096, 4096, 4096)], sweep, True) == \
        [(1024, 8192, 8192), (4096, 4096, 4096)] + [s for s in sweep if s != (1024, 8192, 8192)]
    assert bench.run_shapes(None, sweep, True) == sweep
    assert bench.run_shapes(None, [], True) == bench.SHAPES
    assert bench.run_shapes([(2, 3, 4)], [], False) == [(2, 3, 4)]
