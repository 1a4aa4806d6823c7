"""GPU robustness: outputs past 2^31 elements, streams, threads, a second GPU, and
bitwise determinism across processes. References are float64 (or eager PyTorch
where the test is about ordering, not arithmetic)."""
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import cutlass_fused
from common import CUDA, FAMILIES, FAMILY_IDS, max_err

GPUS = torch.cuda.device_count() if CUDA else 0


def reference64(x, layer, cols, dy=None):
    """y, running stats and (with dy) dh for columns `cols`, in float64, from the unfused model."""
    g = layer.gemm
    h = F.linear(x.double(), g.weight[cols].double(), g.bias[cols].double())
    z = h * layer.scale[cols].double()
    mean, var = z.mean(0), z.var(0, unbiased=False)
    invstd = (var + layer.bn.eps).rsqrt()
    zn = (z - mean) * invstd
    y = zn * layer.bn.weight[cols].double() + layer.bn.bias[cols].double()
    if dy is None:
        return y, mean, var * x.shape[0] / (x.shape[0] - 1)
    dzn = dy.double() * layer.bn.weight[cols].double()
    dz = invstd * (dzn - dzn.mean(0) - zn * (dzn * zn).mean(0))
    return dz * layer.scale[cols].double()


def run_child(code):
    """Runs `code` in a fresh interpreter with tests/ on the path; returns its stdout."""
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); {code}"],
                       capture_output=True, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return r.stdout


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_properties(0).total_memory < 60 * 2**30,
                    reason="needs a GPU with 60 GiB")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_outputs_past_two_to_the_31_elements(family):
    """65536 x 33000 bf16 outputs (2.16e9 elements, 4.3 GB each): every index is 64-bit.

    In a fresh process, so that no earlier test's memory (a failed test's frames, CUDA
    graph pools) counts against the ~30 GB it needs.
    """
    run_child(f"import test_robustness as t; t.large_outputs({family!r})")


def large_outputs(family):
    """Columns are independent in this layer, so the float64 reference is computed
    for a sample of columns (including the last) over all rows (including rows
    whose offsets exceed 2^31), and dX from all columns in chunks."""
    torch.manual_seed(0)
    m, k, n = 65536, 32, 33000
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bn.weight.uniform_(0.5, 1.5), layer.bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cols = torch.cat([torch.randint(0, n, (30,), device="cuda"), torch.tensor([0, n - 1], device="cuda")])
    rm0 = layer.bn.running_mean.clone()
    with cutlass_fused.use_kernel_family(family):
        y = layer(x)
        with torch.no_grad():
            y_ref, mean, var = reference64(x.detach(), layer, cols)
        assert max_err(y[:, cols], y_ref) < 0.05
        assert max_err(layer.bn.running_mean[cols], 0.9 * rm0[cols].double() + 0.1 * mean) < 1e-2
        dy = torch.randn_like(y)
        y.backward(dy)
        del y
        dx_ref = torch.zeros(m, k, device="cuda", dtype=torch.float64)
        with torch.no_grad():  # else autograd keeps every chunk's float64 temporaries alive
            for c0 in range(0, n, 1000):  # float64 temporaries of 0.5 GB each
                chunk = torch.arange(c0, min(n, c0 + 1000), device="cuda")
                dx_ref += reference64(x.detach(), layer, chunk, dy[:, chunk]) @ layer.gemm.weight[chunk].double()
        scale = dx_ref.abs().max().item()
        assert max_err(x.grad, dx_ref) / scale < 0.02
        del dy, dx_ref
        layer.eval()
        with torch.no_grad():
            y = layer(x.detach())
            rv = layer.bn.running_var[cols].double()
            h = F.linear(x.detach().double(), layer.gemm.weight[cols].double(), layer.gemm.bias[cols].double())
            y_ref = ((h * layer.scale[cols].double() - layer.bn.running_mean[cols].double()) * (rv + 1e-5).rsqrt()
                     * layer.bn.weight[cols].double() + layer.bn.bias[cols].double())
            assert max_err(y[:, cols], y_ref) < 0.05


def train_step(layer, x, dy):
    y = layer(x)
    y.backward(dy)
    return y


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_side_stream_orders_work_on_the_callers_stream(family):
    """On a side stream, with inputs produced on it just before the call: the same
    results as on the default stream (a kernel on the wrong stream would race)."""
    torch.manual_seed(0)
    layer = cutlass_fused.LinearScaleBatchNorm1d(512, 768, device="cuda")
    twin = cutlass_fused.LinearScaleBatchNorm1d(512, 768, device="cuda")
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(2048, 512, device="cuda")
    dy = torch.randn(2048, 768, device="cuda")
    with cutlass_fused.use_kernel_family(family):
        y0 = train_step(layer, x, dy)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(10_000_000)  # the side stream is busy when our kernels are queued
            xs = x * 1.0  # produced on the side stream
            y1 = train_step(twin, xs, dy)
        torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y0, y1)
    for a, b in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert torch.equal(layer.bn.running_var, twin.bn.running_var)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_two_threads_on_two_streams():
    """Two threads, each with its own layer and stream, many steps at once; each
    result equals the same steps run alone."""
    torch.manual_seed(0)
    layers = [cutlass_fused.LinearScaleBatchNorm1d(256, 384 + 128 * i, device="cuda", dtype=torch.bfloat16)
              for i in range(2)]
    inputs = [torch.randn(512 + i, 256, device="cuda", dtype=torch.bfloat16) for i in range(2)]
    alone = []
    for layer, x in zip(layers, inputs):
        copy = cutlass_fused.LinearScaleBatchNorm1d(256, layer.gemm.out_features, device="cuda",
                                                    dtype=torch.bfloat16)
        copy.load_state_dict(layer.state_dict())
        with torch.no_grad():
            for _ in range(20):
                y = copy(x)
                copy.eval(), copy(x), copy.train()
        alone.append((y, copy.bn.running_mean.clone()))
    results, errors = [None, None], []

    def work(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()), torch.no_grad():
                for _ in range(20):
                    y = layers[i](inputs[i])
                    layers[i].eval(), layers[i](inputs[i]), layers[i].train()
                torch.cuda.current_stream().synchronize()
            results[i] = (y, layers[i].bn.running_mean.clone())
        except Exception as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (y, rm), (y_a, rm_a) in zip(results, alone):
        assert torch.equal(y, y_a) and torch.equal(rm, rm_a)


@pytest.mark.uses_gpu0
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_second_gpu(family):
    """Everything on cuda:1 while cuda:0 is current: results equal cuda:0's, and
    nothing is allocated on cuda:0."""
    torch.manual_seed(0)
    layer0 = cutlass_fused.LinearScaleBatchNorm1d(300, 200, device="cuda:0")
    layer1 = cutlass_fused.LinearScaleBatchNorm1d(300, 200, device="cuda:1")
    layer1.load_state_dict(layer0.state_dict())
    x = torch.randn(128, 300)
    dy = torch.randn(128, 200)
    # cuda:0 current (and the test device restored after: see conftest.py).
    with torch.cuda.device(0):
        second_gpu_steps(layer0, layer1, x, dy, family)


def second_gpu_steps(layer0, layer1, x, dy, family):
    # PyTorch's own first GEMMs on cuda:1 (cuBLAS handles and workspaces, which
    # the sm80 family's fp32 backward uses through at::mm) are made before the
    # count starts: the check is of our code, not of PyTorch's lazy set-up.
    ref = torch.nn.Linear(300, 200, device="cuda:1")
    ref(x.to("cuda:1").requires_grad_()).sum().backward()
    with cutlass_fused.use_kernel_family(family):
        y0 = train_step(layer0, x.to("cuda:0"), dy.to("cuda:0"))
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        before = torch.cuda.memory_allocated(0)
        grown = {}  # stage -> bytes newly allocated on cuda:0, to name the culprit
        y1 = layer1(x.to("cuda:1").requires_grad_())
        grown["forward"] = torch.cuda.memory_allocated(0) - before
        y1.backward(dy.to("cuda:1"))
        grown["backward"] = torch.cuda.memory_allocated(0) - before
        layer1.eval()
        with torch.no_grad():
            e1 = layer1(x.to("cuda:1"))
        grown["eval"] = torch.cuda.memory_allocated(0) - before
        torch.cuda.synchronize(1)
        assert not any(grown.values()), grown
    assert y1.device == torch.device("cuda:1") and e1.device == torch.device("cuda:1")
    assert torch.equal(y0.cpu(), y1.cpu())
    for a, b in zip(layer0.parameters(), layer1.parameters()):
        assert torch.equal(a.grad.cpu(), b.grad.cpu())


# Run in a fresh interpreter: the layer's outputs, gradients and running stats
# under deterministic algorithms, as one hash-free byte dump.
_CHILD = r"""
import sys, torch, cutlass_fused
device, family = sys.argv[1], sys.argv[2]
torch.use_deterministic_algorithms(True)
g = torch.Generator().manual_seed(123)
layer = cutlass_fused.LinearScaleBatchNorm1d(384, 257)
with torch.no_grad():
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
layer = layer.to(device)
x = torch.randn(1000, 384, generator=g).to(device).requires_grad_()
dy = torch.randn(1000, 257, generator=g).to(device)
with cutlass_fused.use_kernel_family(family):
    y = layer(x)
    y.backward(dy)
out = [y, x.grad, layer.bn.running_mean, layer.bn.running_var] + [p.grad for p in layer.parameters()]
sys.stdout.buffer.write(b"".join(t.detach().cpu().contiguous().numpy().tobytes() for t in out))
"""


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_bitwise_equal_across_processes(device, family):
    code = f"sys.argv = ['-', {device!r}, {family!r}]\n" + _CHILD
    runs = [run_child(code) for _ in range(2)]
    assert len(runs[0]) > 0 and runs[0] == runs[1]


SYNC_SHAPES = [(3, 64, 128), (1000, 96, 769), (256, 128, 8192), (4096, 256, 512)]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_no_host_sync(family, dtype, activation):
    """The hot path never waits for the GPU: the training forward and backward, under autocast too,
    eval, and (sm90) the e4m3 path, at shapes that take each tail and backward kernel the plan picks
    by shape, run clean under torch's sync debug mode, which raises at any synchronizing call. One
    call of each first, outside it: what a first call sets up (plans, handles) is not the hot path."""
    torch.manual_seed(0)
    fp8 = family == "sm90" and dtype == torch.bfloat16 and cutlass_fused.fp8.e4m3_kernels(torch.device("cuda"))

    # Built outside the checked calls: construction is not the hot path (its torch.tensor copies
    # a host value to the GPU).
    cases = []
    for m, k, n in SYNC_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        recipes = [None]
        if fp8 and k % 16 == 0 and n % 16 == 0:
            recipes += [dict(backward="e5m2"), dict(), dict(scaling="delayed"), dict(scaling="delayed", backward="e5m2")]
        for recipe in recipes:
            layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, activation=activation, device="cuda", dtype=dtype)
            if recipe is not None:
                layer.fp8 = cutlass_fused.Float8Recipe(**recipe)
            cases.append((layer, x, dy))

    def calls():
        for layer, x, dy in cases:
            layer.train()
            train_step(layer, x, dy)
            if dtype == torch.float32:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = layer(x)
                y.backward(dy)
            layer.eval()
            with torch.no_grad():
                layer(x)

    with cutlass_fused.use_kernel_family(family):
        calls()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
