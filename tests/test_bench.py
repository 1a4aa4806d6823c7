"""The benchmark CLI (python -m cutlass_fused.bench): its correctness check, JSON schema and report."""
import importlib.util
import json
import math

import pytest
import torch
from torch import nn

import cutlass_fused
from cutlass_fused import bench, bench_rows, bench_step, timing
from common import CUDA, HOPPER, skip_without_e4m3

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
    built = {n for n in __import__("cutlass_fused").built_kernels() if n.startswith(("sm80_bf16_eval_", "sm80_bf16_stats_"))}
    assert {r["kernel"] for r in rows} == built and all(r["train_ms"] > 0 for r in rows)
    # A statistics kernel serves the training forward only.
    assert all(r["eval_ms"] > 0 for r in rows if "_eval_" in r["kernel"])
    assert not any("eval_ms" in r for r in rows if "_stats_" in r["kernel"])


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
    """The timing order of bench's tools (tune, benchmarks/kernels.py's *_time): no item always first."""
    assert list(timing.alternating(["a", "b", "c"], 3)) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_bench_modules_import_downward():
    """The step benchmark stands on timing, report and bench_rows, not on the layer's CLI module
    (bench.py imports bench_step: the other way would be an import circle)."""
    import subprocess
    import sys
    code = ("import sys, cutlass_fused.bench_step, cutlass_fused.timing, cutlass_fused.report, "
            "cutlass_fused.bench_rows; print('cutlass_fused.bench' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_overrides_reach_the_plan_and_are_restored():
    """tune and benchmarks/kernels.py's *_time tools force choices through cutlass_fused.overrides(): the
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


# The training-step mode (cutlass_fused/bench_step.py).
def check_step_json(path, cases, rows, parity):
    """step.json holds one row per case and row name, each timed, with its loss parity to eager's
    within `parity` (eager's own: 0) and every block of the model fused in the fused rows."""
    from cutlass_fused import bench_step
    res = json.loads(path.read_text())
    assert res["mode"] == "step" and res["parity_steps"] == bench_step.PARITY_STEPS
    assert set(res["meta"]) >= {"gpu", "torch", "cuda", "version", "commit", "date", "command"}
    assert [(bench_step.case_of(r), r["impl"]) for r in res["rows"]] == [(c, n) for c in cases for n in rows]
    for r in res["rows"]:
        case = bench_step.case_of(r)
        eager = next(e for e in res["rows"] if e["impl"] == "eager" and bench_step.case_of(e) == case)
        assert r["mode"] == "step" and r["error"] is None and r["ms"] > 0 and math.isfinite(r["loss_last"])
        assert r["vs_eager"] == pytest.approx(eager["ms"] / r["ms"])
        # The case's GEMMs in torch.mm, timed once a case: the same floor for every row.
        assert r["mm_ms"] == eager["mm_ms"] > 0 and r["x_mm"] == pytest.approx(r["ms"] / r["mm_ms"])
        assert (r["peak_extra_mib"] is not None) == CUDA
        assert r["fused_layers"] == (case.blocks if r["impl"].startswith("fused") else None)
        if r["impl"] == "eager":
            assert r["loss_parity"] == 0
        else:
            assert 0 <= r["loss_parity"] < parity
    return res


@pytest.mark.skipif(CUDA, reason="the CPU's rows; the GPU's are in test_bench_step_gpu_all_rows")
def test_bench_step_cpu_end_to_end(tmp_path, capsys):
    from cutlass_fused.bench_step import Case
    cases = [Case("f32", 32, 48, 2, "relu"), Case("amp-bf16", 32, 48, 1, "gelu")]
    assert bench.main(["--step-case", "f32,32,48,2", "--step-case", "amp-bf16,32,48,1,gelu",
                       "--out", str(tmp_path)]) == 0
    # f32 on the CPU: the fused layer's PyTorch path trains as eager does, to rounding.
    res = check_step_json(tmp_path / "step.json", cases, ("eager", "fused"), parity=1e-3)
    assert next(r for r in res["rows"] if r["impl"] == "fused")["loss_parity"] < 1e-5
    out = capsys.readouterr().out
    assert "cutlass_fused.fuse: fused 2" in out and "loss parity" in out
    assert (tmp_path / "step.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert bench.main(["--report", str(tmp_path / "step.json")]) == 0
    report = capsys.readouterr().out
    assert report.startswith("| precision | batch | width | blocks | act | model | impl | ms/step | x mm |")
    assert report.count("| f32 | 32 | 48 | 2 | relu | seed | ") == 2
    assert "| amp-bf16 | 32 | 48 | 1 | gelu | seed | fused |" in report


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_bench_step_gpu_all_rows(tmp_path, capsys):
    from cutlass_fused.bench_step import ROWS, Case
    assert bench.main(["--step-case", "amp-bf16,64,128,2", "--out", str(tmp_path)]) == 0
    res = check_step_json(tmp_path / "step.json", [Case("amp-bf16", 64, 128, 2, "relu")], ROWS, parity=2e-2)
    ms = {r["impl"]: r["ms"] for r in res["rows"]}
    assert all(r["vs_compile"] == pytest.approx(ms["compile"] / r["ms"]) for r in res["rows"])
    assert all(r["peak_extra_mib"] > 0 for r in res["rows"])
    assert bench.main(["--report", str(tmp_path / "step.json")]) == 0
    assert capsys.readouterr().out.count("| amp-bf16 | 64 | 128 | 2 | relu | seed | ") == len(ROWS)


def test_bench_step_records_a_failed_row(tmp_path, monkeypatch):
    """A row that cannot run here (torch.compile without a toolchain) is a row with its error; the
    others are measured."""
    from cutlass_fused import bench_step

    def no_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(torch, "compile", no_compile)
    case = bench_step.Case("f32", 16, 24, 1, "relu")
    res = bench_step.measure([case], ("eager", "compile", "fused"), torch.device("cpu"), 1, [], tmp_path)
    rows = {r["impl"]: r for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    assert rows == {r["impl"]: r for r in res["rows"]}
    assert rows["compile"]["error"] == "RuntimeError: no compiler here" and rows["compile"]["ms"] is None
    assert all(rows[n]["error"] is None and rows[n]["ms"] > 0 and rows[n]["vs_compile"] is None
               for n in ("eager", "fused"))
    assert "failed: compile f32 16x24x1 relu: RuntimeError: no compiler here" in bench_step.table(res)


@pytest.mark.skipif(CUDA, reason="the CPU's rows")
def test_bench_step_fails_when_the_fused_row_fails(tmp_path, monkeypatch):
    def no_fuse(model, **kwargs):
        raise RuntimeError("cannot fuse")
    monkeypatch.setattr(cutlass_fused, "fuse", no_fuse)
    assert bench.main(["--step", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    assert [(r["impl"], r["error"]) for r in rows] == [("eager", None), ("fused", "RuntimeError: cannot fuse")]
    assert rows[0]["ms"] > 0


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed here")
def test_bench_step_torchao_row_without_torchao(tmp_path):
    """Issue 33's anchor rows where torchao is missing: a row with an error saying what to install;
    the other rows are measured."""
    assert bench.main(["--step-case", "f32,16,32,1", "--step-row", "eager", "--step-row", "torchao-float8",
                       "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    assert list(rows) == ["eager", "torchao-float8"] and rows["eager"]["ms"] > 0
    assert rows["torchao-float8"]["error"] == "RuntimeError: the torchao rows need torchao (pip install torchao)"


def test_bench_step_torchao_row(tmp_path):
    """torchao's float8 training of the blocks' Linears (emulated off CUDA) trains like eager to FP8's
    rounding, and leaves the head (1000 outputs: not a multiple of 16) alone."""
    pytest.importorskip("torchao.float8")
    from cutlass_fused import bench_step
    from torchao.float8.float8_linear import Float8Linear
    device = torch.device("cuda" if CUDA else "cpu")
    case = bench_step.Case("bf16", 16, 32, 2, "relu")  # bf16: what torchao's float8 GEMMs take on a GPU
    model = bench_rows.torchao_float8(bench_step.mlp(case, device), "tensorwise", device)
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [Float8Linear] * 2 + [nn.Linear]
    assert bench.main(["--step-case", "bf16,16,32,2", "--step-row", "eager", "--step-row", "torchao-float8",
                       "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    assert rows["torchao-float8"]["error"] is None and rows["torchao-float8"]["ms"] > 0
    assert 0 < rows["torchao-float8"]["loss_parity"] < 5e-2  # e4m3's rounding, not a different model


def test_bench_torchao_layer_rows(tmp_path):
    """The layer benchmark's torchao rows: the unfused model with torchao's float8 Linear; a shape
    it cannot take (features not a multiple of 16) is a skipped row, not a bf16 one."""
    pytest.importorskip("torchao.float8")
    args = ["--shape", "64,32,48", "--shape", "64,32,40", "--mode", "train", "--impl", "torch.mm", "--impl",
            "torchao-float8", "--out", str(tmp_path)] + ([] if CUDA else ["--dtype", "f32"])
    assert bench.main(args) == 0
    rows = [r for r in json.loads((tmp_path / "results.json").read_text())["rows"] if r["impl"] == "torchao-float8"]
    assert [r["shape"] for r in rows] == [[64, 32, 48]] and rows[0]["ms"] > 0


def test_bench_fp8_rows(tmp_path, monkeypatch):
    """Our FP8 rows: fuse(model) with Float8Recipe() on every fused layer (step), ours with it (layer).
    On the CPU the e4m3 op's bf16 reference; on a GPU they need the e4m3 kernels."""
    skip_without_e4m3("cuda" if CUDA else "cpu")
    calls = []
    import cutlass_fused.module as module
    orig = module.train_e4m3
    monkeypatch.setattr(module, "train_e4m3", lambda *a: (calls.append(1), orig(*a))[1])
    fp8_rows = ("fused-fp8", "fused-fp8-e5m2", "fused-fp8-delayed-e5m2", "fused-fp8-delayed-e5m2-fast")
    assert bench.main(["--step-case", "bf16,32,48,2", "--step-row", "eager", "--step-row", "fused",
                       *[a for row in fp8_rows for a in ("--step-row", row)], "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    for row in fp8_rows:
        assert rows[row]["error"] is None and rows[row]["fused_layers"] == 2
        assert rows[row]["loss_parity"] < 5e-2, row
    # (a row's bf16 loss may round to fused's)
    assert len(calls) >= 4 * 2, "each fused-fp8 row ran the e4m3 op on both layers"
    impls = ("cutlass_fused-fp8", "cutlass_fused-fp8-e5m2", "cutlass_fused-fp8-delayed",
             "cutlass_fused-fp8-delayed-e5m2", "cutlass_fused-fp8-delayed-e5m2-fast")
    assert bench.main(["--shape", "64,32,48", "--dtype", "bf16", "--mode", "fwdbwd", "--impl", "torch.mm",
                       *[a for impl in impls for a in ("--impl", impl)], "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["impl"] for r in rows if r["ms"] > 0 and r["impl"].startswith("cutlass_fused-fp8")] == list(impls)
    assert bench_rows.fp8_recipe("fused-fp8-delayed-e5m2+compile") == cutlass_fused.Float8Recipe(scaling="delayed",
                                                                                          backward="e5m2")
    assert bench_rows.fp8_recipe("cutlass_fused-fp8-delayed-fast") == cutlass_fused.Float8Recipe(scaling="delayed",
                                                                                          fast_accum=True)


@pytest.mark.skipif(CUDA, reason="the CPU refusal of compile rows")
@pytest.mark.parametrize("row", ["torchao-float8+compile", "fused+compile-ro", "compile-ro"])
def test_bench_step_cpu_refuses_compile_rows(tmp_path, row):
    with pytest.raises(SystemExit, match="compile rows need a GPU"):
        bench.main(["--step-row", row, "--out", str(tmp_path)])


def test_compile_modes_of_rows():
    assert [bench_step.compile_mode(r) for r in ("fused", "compile", "fused+compile", "compile-ro",
                                                 "fused+compile-ro", "fused-fp8+compile", "fused+graph")] == [
        None, "default", "default", "reduce-overhead", "reduce-overhead", "default", None]


@pytest.mark.skipif(CUDA, reason="the CPU refusal of +graph rows")
def test_bench_step_cpu_refuses_graph_rows(tmp_path):
    with pytest.raises(SystemExit, match=r"\+graph rows need a GPU"):
        bench.main(["--step-row", "eager", "--step-row", "fused+graph", "--out", str(tmp_path)])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("row", ["eager", "fused", "fused-fp8-delayed-e5m2", "fused-fp8"])
@pytest.mark.parametrize("precision", ["amp-bf16", "bf16"])
def test_bench_step_graph_row_is_the_eager_step(row, precision):
    """A +graph row (cutlass_fused.graphed_step: the step captured once, then replayed) trains as the
    same row run eagerly: over the parity steps (warm-up, capture, replays) the same losses and, at
    their end, the same parameters and buffers (running stats; an FP8 row's delayed state, whose
    in-place step the graph replays)."""
    from cutlass_fused import bench_step
    if row.startswith("fused-fp8"):
        skip_without_e4m3("cuda")
    case, device = bench_step.Case(precision, 48, 64, 2, "relu"), torch.device("cuda")
    base = bench_step.mlp(case, device)
    with bench_step.precision_flags(precision):
        eager = bench_step.Row(row, base, case, device, [])
        graphed = bench_step.Row(row + "+graph", base, case, device, [])
    assert eager.run == eager.body and len(graphed.run.graphs) == 1
    assert len(graphed.losses) == bench_step.PARITY_STEPS > bench_step.GRAPH_WARMUP + 1
    torch.testing.assert_close(graphed.losses, eager.losses, rtol=1e-5, atol=0)
    want, got = eager.call.state_dict(), graphed.call.state_dict()
    assert want.keys() == got.keys()
    if row == "fused-fp8-delayed-e5m2":
        assert any(k.endswith("fp8_amax_history") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert graphed.peak() > 0


@pytest.mark.parametrize("bad", ["f32,64,64", "f16,64,64,2", "f32,64,64,2,tanh", "f32,1,64,2", "f32,64,0,2",
                                 "f32,64,64,x", "f32,64,64,2,relu,resnet", "f32,64,64,2,relu,plain,7"])
def test_bench_step_rejects_bad_cases(bad, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--step-case", bad])
    assert "expected --step-case PRECISION,BATCH,WIDTH,BLOCKS[,ACTIVATION[,MODEL]]" in capsys.readouterr().err


def test_bench_step_parses_cases():
    from cutlass_fused.bench_step import Case, parse_case
    assert parse_case("amp-bf16,4096,4096,4") == Case("amp-bf16", 4096, 4096, 4, "relu")
    assert parse_case("tf32,8,16,3,leaky_relu") == Case("tf32", 8, 16, 3, "leaky_relu", "seed")
    assert parse_case("amp-bf16,512,2048,3,relu,simsiam") == Case("amp-bf16", 512, 2048, 3, "relu", "simsiam")


@pytest.mark.skipif(CUDA, reason="the CPU refusal of tf32")
def test_bench_step_cpu_refuses_tf32(tmp_path):
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench.main(["--step-case", "tf32,8,16,1", "--out", str(tmp_path)])


def test_bench_step_sets_and_restores_tf32():
    from cutlass_fused.bench_step import precision_flags
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    old = flags()
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        with precision_flags("tf32"):
            assert flags() == (True, True)
        assert flags() == (False, True)
        with precision_flags("f32"):
            assert flags() == (False, False)
        assert flags() == (False, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.skipif(CUDA, reason="the GPU's default run takes minutes")
def test_bench_default_run_times_the_training_step_too(tmp_path):
    """The README's main job: the layer's default shapes, then the step case(s); a run that picks
    the layer's shapes is about the layer alone."""
    assert bench.main(["--out", str(tmp_path)]) == 0
    assert {r["impl"] for r in json.loads((tmp_path / "step.json").read_text())["rows"]} == {"eager", "fused"}
    assert json.loads((tmp_path / "results.json").read_text())["rows"]
    assert bench.main(["--shape", "16,24,8", "--impl", "eager", "--out", str(tmp_path / "layer")]) == 0
    assert not (tmp_path / "layer" / "step.json").exists()
