"""The KernelBench drop-ins in examples/: ModelNew against Model the way KernelBench's harness runs
them (training mode under no_grad, fp32, allclose at 1e-4). On the CPU at small sizes; at the
problems' own sizes on a GPU."""
import importlib.util
from pathlib import Path

import pytest
import torch

from common import needs_cuda

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# problem: (file, (batch, in, out) from KernelBench; see ../shared/notes/peers.md)
PROBLEMS = {
    33: ("kernelbench_33_gemm_scale_batchnorm.py", (1024, 8192, 8192)),
    39: ("kernelbench_39_gemm_scale_batchnorm.py", (16384, 4096, 4096)),
}
SMALL = (48, 40, 24)  # the real sizes take minutes on a 2-core CPU


@pytest.fixture(params=sorted(PROBLEMS), ids=lambda p: f"problem{p}")
def problem(request, monkeypatch):
    file, sizes = PROBLEMS[request.param]
    spec = importlib.util.spec_from_file_location(f"kernelbench_{request.param}", EXAMPLES / file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.real_sizes = sizes
    return mod


def resize(monkeypatch, mod, batch, n_in, n_out):
    for name, v in [("batch_size", batch), ("in_features", n_in), ("out_features", n_out),
                    ("scale_shape", (n_out,))]:
        monkeypatch.setattr(mod, name, v)


def build(mod, cls, seed, device):
    torch.manual_seed(seed)
    return cls(*mod.get_init_inputs()).to(device)


def kernelbench_trials(mod, ref, new, device, trials):
    """KernelBench's correctness loop, and then the running stats that it leaves behind."""
    with torch.no_grad():
        for t in range(trials):
            torch.manual_seed(100 + t)
            x = [i.to(device) for i in mod.get_inputs()]
            a, b = ref(*x), new(*x)
            assert b.shape == a.shape and b.dtype == a.dtype
            assert torch.allclose(b, a, atol=1e-4, rtol=1e-4), f"trial {t}: max diff {(a - b).abs().max():.3g}"
    for name, v in ref.bn.state_dict().items():
        torch.testing.assert_close(new.bn.state_dict()[name], v, atol=1e-4, rtol=1e-4, msg=name)


def test_problem_files_describe_the_problems(problem):
    batch, n_in, n_out = problem.real_sizes
    assert (problem.batch_size, problem.in_features, problem.out_features) == (batch, n_in, n_out)
    assert problem.scale_shape == (n_out,)
    assert problem.get_init_inputs() == [n_in, n_out, (n_out,)]


def test_model_is_kernelbench_reference(problem, monkeypatch):
    """Model is bn(gemm(x) * scale) with KernelBench's defaults, written out in F ops here."""
    resize(monkeypatch, problem, *SMALL)
    m = build(problem, problem.Model, 0, "cpu")
    (x,) = problem.get_inputs()
    assert x.shape == (SMALL[0], SMALL[1]) and x.min() >= 0 and x.max() < 1  # torch.rand, as KernelBench
    assert m.training and m.bn.eps == 1e-5 and m.bn.momentum == 0.1
    rm, rv = m.bn.running_mean.clone(), m.bn.running_var.clone()
    z = torch.nn.functional.linear(x, m.gemm.weight, m.gemm.bias) * m.scale
    want = torch.nn.functional.batch_norm(z, rm, rv, m.bn.weight, m.bn.bias, True, 0.1, 1e-5)
    torch.testing.assert_close(m(x), want)


def test_model_new_matches_model_cpu(problem, monkeypatch):
    resize(monkeypatch, problem, *SMALL)
    ref = build(problem, problem.Model, 0, "cpu")
    # KernelBench builds both under one seed and compares them without loading weights.
    same_seed = build(problem, problem.ModelNew, 0, "cpu")
    assert list(same_seed.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(same_seed.state_dict()[k], v), k
    kernelbench_trials(problem, ref, same_seed, "cpu", trials=3)

    # Loading Model's state_dict, unchanged, into a differently initialized ModelNew.
    ref = build(problem, problem.Model, 1, "cpu")
    ref.bn.running_mean.normal_()
    loaded = build(problem, problem.ModelNew, 2, "cpu")
    loaded.load_state_dict(ref.state_dict())
    kernelbench_trials(problem, ref, loaded, "cpu", trials=3)


def test_model_new_rejects_other_scale_shapes(problem):
    with pytest.raises(ValueError, match=r"scale_shape must be \(6,\)"):
        problem.ModelNew(4, 6, (1, 6))


def test_check_reports_small_difference(problem, monkeypatch):
    """The example's own check (its __main__) agrees with the comparison above."""
    resize(monkeypatch, problem, *SMALL)
    assert problem.check(problem, trials=2) < 1e-4


@needs_cuda
def test_model_new_matches_model_cuda_real_sizes(problem):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref = build(problem, problem.Model, 0, "cuda")
        new = build(problem, problem.ModelNew, 0, "cuda")
        kernelbench_trials(problem, ref, new, "cuda", trials=5)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_readme_example_runs_as_written():
    """The README's first code block, run as a user pastes it: on the CPU here, on the GPU there."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert len(scope["report"].fused) == 1 and scope["y"].shape == (256, 10)
    # The fused model trained the model's own tensors, which it shares.
    assert scope["model"][0].weight.grad is not None
    assert isinstance(scope["layer"], scope["cutlass_fused"].LinearBatchNorm1d)


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ssl_projector_example(capsys):
    """The SimSiam head: every Linear -> BatchNorm1d fused (the projector's three and the predictor's
    first, each called on both views), the predictor's last Linear left, and the fused model's
    losses those of eager training from the same weights and data."""
    results, report = load_example("ssl_projector").main(["--width", "48", "--batch", "16", "--steps", "4"])
    assert len(report.fused) == 8 and len({f.name for f in report.fused}) == 4
    assert [s.linear for s in report.skipped] == ["predictor.3"] * 2
    (eager, _), (fused, _) = results["eager"], results["fused"]
    assert len(eager) == len(fused) == 4 and eager[0] != eager[-1]
    tol = 1e-5 if not torch.cuda.is_available() else 5e-2  # bf16 autocast on a GPU
    assert max(abs(a - b) for a, b in zip(eager, fused)) < tol
    assert "largest loss difference" in capsys.readouterr().out


def test_tabular_mlp_example():
    """The tabular MLP with Dropout: its three blocks fused, the head left, and the fused model as
    accurate as the unfused one on the held-out rows (both well above chance)."""
    pytest.importorskip("sklearn")
    out, report = load_example("tabular_mlp").main(["--width", "64", "--epochs", "3"])
    assert len(report.fused) == 3 and [s.linear for s in report.skipped] == ["12"]
    assert out["unfused"] > 0.85 and abs(out["fused"] - out["unfused"]) < 0.05
