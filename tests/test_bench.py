"""The benchmark CLI (python -m cutlass_fused.bench): its correctness check, JSON schema and report."""
import json

import pytest
import torch

from cutlass_fused import bench
from common import CUDA

ROW_KEYS = {"shape", "dtype", "mode", "impl", "graphs", "ms", "tflops", "ratio_to_mm", "peak_extra_mib", "kernels",
            "host_us"}


def test_bench_runs_and_writes_schema(tmp_path, capsys):
    argv = ["--shape", "64,96,40", "--out", str(tmp_path), "--impl", "torch.mm", "--impl", "eager",
            "--impl", "cutlass_fused"]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["meta"]) >= {"gpu", "torch", "cuda", "version", "commit", "date", "command"}
    rows = res["rows"]
    assert {(r["impl"], r["mode"]) for r in rows} == {(i, m) for i in ("torch.mm", "eager", "cutlass_fused")
                                                     for m in bench.MODES}
    for r in rows:
        assert set(r) == ROW_KEYS and r["shape"] == [64, 96, 40] and r["ms"] > 0
        assert r["ratio_to_mm"] == pytest.approx(r["ms"] / (bench.GEMMS[r["mode"]] * rows[0]["ms"]))
        assert (r["kernels"] is not None) == CUDA
    # The check compared both modes against float64 and passed the error rule.
    assert [c["mode"] for c in res["checks"]] == ["train", "eval"] and all(c["ok"] for c in res["checks"])
    assert "cutlass_fused" in capsys.readouterr().out
    assert bench.main(["--report", str(tmp_path / "results.json")]) == 0
    report = capsys.readouterr().out
    assert report.startswith("| shape |") and report.count("| 64x96x40 |") == len(rows)


def test_bench_rejects_bad_shape():
    with pytest.raises(SystemExit):
        bench.main(["--shape", "1,2"])


@pytest.mark.skipif(CUDA, reason="the CPU refusal of GPU-only precisions")
def test_bench_cpu_refuses_gpu_precisions(tmp_path):
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench.main(["--dtype", "tf32", "--out", str(tmp_path)])
