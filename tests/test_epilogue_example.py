"""docs/epilogues.md's worked example, end to end: codegen/epilogues.py's evaluate_residual is traced
by cutlass_cppgen, built into an sm90 kernel with the kernel templates of csrc/kernels/gemm/
(tests/epilogue_example/), and checked against PyTorch: y = act((x W^T + b) * a + c) + r, a residual
MLP block's x + act(bn(linear(x))) in eval. Hopper only; the build takes a minute or two."""
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

from common import HOPPER, assert_close_rule

pytest.importorskip("cutlass_cppgen", reason="nvidia-cutlass (scripts/setup.sh installs it)")
if not HOPPER:
    pytest.skip("needs an sm90 GPU (the example is an sm90a kernel)", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
ACTIVATIONS = {"none": (0, lambda t: t), "relu": (1, F.relu), "silu": (5, F.silu)}  # csrc/kernels/types.h


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    import cutlass_library
    from torch.utils import cpp_extension

    from codegen import generate

    build = tmp_path_factory.mktemp("epilogue_example")
    (build / "evt_example.h").write_text(
        generate.tree_header("sm90_eval_residual_bf16", "evaluate_residual", "sm90", "bf16"))
    cutlass = pathlib.Path(cutlass_library.source_path)
    flags = ["-O3", "--expt-relaxed-constexpr", "-Xcudafe", "--diag_suppress=940", "-std=c++17",
             "-gencode=arch=compute_90a,code=sm_90a"]  # as CMakeLists.txt builds the kernels
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # cpp_extension's own -gencode: sm_90a only
    try:
        return cpp_extension.load(
            name="cutlass_fused_epilogue_example",
            sources=[str(ROOT / "tests/epilogue_example/binding.cpp"), str(ROOT / "tests/epilogue_example/residual.cu")],
            extra_include_paths=[str(build), str(ROOT / "csrc"), str(cutlass / "include"),
                                 str(cutlass / "tools/util/include")],
            extra_cuda_cflags=flags, extra_cflags=["-O2", "-std=c++20"], build_directory=str(build), verbose=False)
    finally:
        if arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST")
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch


# One test, so that one worker builds the example (pytest-xdist spreads a module's tests).
def test_residual_epilogue_matches_pytorch(example):
    for m, k, n in [(1000, 768, 520), (3, 64, 8), (2, 1024, 1000)]:
        for act in sorted(ACTIVATIONS):
            check(example, m, k, n, act)


def check(example, m, k, n, act):
    g = torch.Generator(device="cuda").manual_seed(m + n)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(m, k, device=dev, generator=g).to(bf16)
    w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(bf16)
    b = torch.randn(n, device=dev, generator=g).to(bf16)
    a = torch.rand(n, device=dev, generator=g) + 0.5           # the fold: scale * gamma * invstd
    c = torch.randn(n, device=dev, generator=g)                # beta - mean * a
    r = torch.randn(m, n, device=dev, generator=g).to(bf16)
    code, fn = ACTIVATIONS[act]
    y = example.residual(x, w, b, a, c, r, code, 0.0)
    torch.cuda.synchronize()
    ref64 = fn((x.double() @ w.double().T + b.double()) * a.double() + c.double()) + r.double()
    # PyTorch's bf16 block: linear, the folded BatchNorm and the activation in bf16, then the add.
    same = fn((F.linear(x, w, b) * a.to(bf16) + c.to(bf16))) + r
    assert y.dtype == bf16 and y.shape == (m, n)
    assert_close_rule(y, same, ref64, "bf16", f"residual {act} {m}x{k}x{n}")

