"""The layer under torch.compile with the default Inductor backend, CUDA graphs
(mode="reduce-overhead") and torch.export.

test_compile.py traces through aot_eager, which needs no code generation; here
Inductor lowers the graphs itself (its own kernels around our ops: the eval
backward's elementwise math, the casts), and on CUDA its cudagraph trees
capture the whole step. Every test compares against an eager copy of the layer
or against the float64 reference of the unfused model.

CPU compiles are slow (a C++ toolchain per generated kernel), so each test
compiles one module and reuses it across steps, batch sizes and modes.
"""
import copy
import hashlib
import importlib
import logging
from pathlib import Path

import pytest
import torch
import torch._inductor.config  # noqa: F401  (patched by test_compile_cache_misses_for_another_build)
from torch import nn
from torch._dynamo.utils import counters

try:
    from torch.compiler import config as compiler_config
except ImportError:  # torch without it has no cache_key_tag
    compiler_config = None

import cutlass_fused
from cutlass_fused.ops import ops
from common import (END_TO_END_BATCH, FAMILIES, FAMILY_IDS, MODES, assert_close_rule, batch_norm, max_err, needs_cuda,
                    params, precision, reference_h, reference_z, shape_cases)

CUDA_FAMILIES = [f for d, f in FAMILIES if d == "cuda"]


# Each test counts its own compilations and graph breaks from zero (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def make_layer(device, n_in, n_out, dtype=torch.float32, seed=0):
    """A layer with random parameters and running stats (not nn.BatchNorm1d's 0/1 init, under
    which eval's fold would hide a mean/var swap). `dtype` is the weight's; the rest is fp32,
    as common.params makes them."""
    p = params(n_in, n_out, device, dtype, seed=seed)
    layer = cutlass_fused.LinearScaleBatchNorm1d(n_in, n_out, device=device)
    state = {"gemm.weight": p["weight"], "gemm.bias": p["bias"], "scale": p["scale"], "bn.weight": p["bn_weight"],
             "bn.bias": p["bn_bias"], "bn.running_mean": p["running_mean"], "bn.running_var": p["running_var"],
             "bn.num_batches_tracked": torch.tensor(0, device=device)}
    layer.load_state_dict(state, assign=True)  # assign: keep a 16-bit weight 16-bit
    return layer


def eager_and_copy(device, n_in=48, n_out=40):
    eager = make_layer(device, n_in, n_out)
    return eager, copy.deepcopy(eager)


def assert_matches(got, want, what, tol=1e-5):
    """Compiled against eager: the same ops run, so they agree to fp32 rounding (relative to the
    values' size: gradients are sums over the batch)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    err, k = max_err(got, want), max(1.0, want.double().abs().max().item())
    assert err <= tol * k, f"{what}: compiled differs from eager by {err:.3g} (scale {k:.3g})"


def assert_same_state(compiled_layer, eager, what, tol=1e-5):
    """Parameters, their gradients, and the running stats with num_batches_tracked."""
    for (name, a), b in zip(eager.state_dict().items(), compiled_layer.state_dict().values()):
        assert_matches(b, a, f"{what}: {name}", tol)
    for (name, a), b in zip(eager.named_parameters(), compiled_layer.parameters()):
        assert (a.grad is None) == (b.grad is None), f"{what}: {name}.grad"
        if a.grad is not None:
            assert_matches(b.grad, a.grad, f"{what}: {name}.grad", tol)


def step(layer, x, dy):
    """Forward and backward with a fixed random output gradient (a plain sum of a batch norm's
    output would give the weights exactly zero gradient); returns y and dL/dx."""
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad


def step_both(eager, compiled, compiled_layer, x, dy, what):
    """One step of each, compared: y, dx, parameters, gradients and running stats."""
    y_e, dx_e = step(eager, x, dy)
    y_c, dx_c = step(compiled, x, dy)
    assert_matches(y_c, y_e, f"y {what}")
    assert_matches(dx_c, dx_e, f"dx {what}")
    assert_same_state(compiled_layer, eager, what)
    eager.zero_grad(), compiled_layer.zero_grad()


def graphs_compiled():
    """Dynamo frames compiled (one per recompilation), whatever the backend did with them."""
    return counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------------------
# Default Inductor backend against eager


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_inductor_matches_eager(device, family, training):
    eager, compiled_layer = eager_and_copy(device)
    eager.train(training), compiled_layer.train(training)
    compiled = torch.compile(compiled_layer, fullgraph=True)  # the default backend: Inductor
    g = torch.Generator().manual_seed(1)
    with cutlass_fused.use_kernel_family(family):
        # Two steps: the second runs the cached graph (in training, on the running stats the first updated).
        for i in range(2):
            x = torch.randn(16, 48, generator=g).to(device)
            dy = torch.randn(16, 40, generator=g).to(device)
            step_both(eager, compiled, compiled_layer, x, dy, f"step {i}")
    assert compiled_layer.bn.num_batches_tracked.item() == (2 if training else 0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs_compiled() == 1


NONFINITE = [("x", (3, 0), float("inf")), ("x", (0, 1), float("nan")), ("weight", (1, 2), float("nan")),
             ("bn_weight", (2,), -float("inf")), ("dy", (1, 1), float("inf"))]


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name,at,value", NONFINITE, ids=[f"{n}-{v}" for n, _, v in NONFINITE])
def test_inductor_keeps_nan_gradients(device, family, training, name, at, value):
    """Non-finite values reach y, the running stats and the gradients compiled as they do eagerly
    (eagerly as in PyTorch: test_bad_inputs' test_nan_and_inf). torch 2.13's Inductor folds a
    product with the integer 0 into zeros, which had given a compiled linear bias gradient of 0
    where eager's was NaN."""
    eager, compiled_layer = eager_and_copy(device)
    eager.train(training), compiled_layer.train(training)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(16, 48, generator=g), torch.randn(16, 40, generator=g)
    with torch.no_grad():
        for layer in (eager, compiled_layer):
            vectors = {"weight": layer.gemm.weight, "bn_weight": layer.bn.weight}
            if name in vectors:
                vectors[name][at] = value
    if name == "x":
        x[at] = value
    elif name == "dy":
        dy[at] = value
    # A cached graph of an older build is not served here: cache keys carry the build (cutlass_fused/ops.py).
    with cutlass_fused.use_kernel_family(family):
        y_e, dx_e = step(eager, x.to(device), dy.to(device))
        y_c, dx_c = step(torch.compile(compiled_layer, fullgraph=True), x.to(device), dy.to(device))
    if training and name == "x":
        assert eager.gemm.bias.grad.isnan().all()  # the case the fold broke
    pairs = [("y", y_c, y_e), ("dx", dx_c, dx_e)]
    pairs += [(f"{n}.grad", b.grad, a.grad) for (n, a), b in zip(eager.named_parameters(), compiled_layer.parameters())]
    pairs += [(n, b, a) for (n, a), b in zip(eager.named_buffers(), compiled_layer.buffers())]
    for what, got, want in pairs:
        assert (got is None) == (want is None), what
        if want is not None:
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), \
                f"{what}: compiled NaN/Inf where eager's are not, or not where they are"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_traced_calls_do_not_cache(training):
    """What torch.compile traces calls our GEMM ops with cache=False, inside frozen_weights() too
    (the cudagraph cases below say why)."""
    calls = []

    def record(gm, example_inputs):
        calls.extend(n for n in gm.graph.nodes if n.op == "call_function" and "cutlass_fused" in str(n.target))
        return gm.forward

    layer = make_layer("cpu", 8, 6).train(training)
    with cutlass_fused.frozen_weights(layer):
        torch.compile(layer, backend=record, fullgraph=True)(torch.randn(4, 8))
    assert calls, "the traced graph holds no cutlass_fused op"
    for n in calls:
        schema = getattr(n.target, "default", n.target)._schema
        i = [a.name for a in schema.arguments].index("cache")
        value = n.args[i] if len(n.args) > i else n.kwargs.get("cache", schema.arguments[i].default_value)
        assert value is False, f"{n.target} traced with cache={value}"


OPS_MODULE = importlib.import_module("cutlass_fused.ops")  # cutlass_fused.ops is the ops' namespace


def test_compile_caches_key_on_this_build():
    """torch.compile's cache keys carry this build of the extension (cutlass_fused/ops.py), beside
    the user's own tag: AOTAutograd keys a graph on Dynamo's graph, blind to what our C++ autograd
    traces the ops into."""
    digest = hashlib.sha256(Path(cutlass_fused._C.__file__).read_bytes()).hexdigest()[:16]
    assert OPS_MODULE.build_tag() == f"cutlass_fused:{digest}"
    assert OPS_MODULE.with_build_tag("", "cutlass_fused:new") == "cutlass_fused:new"
    assert OPS_MODULE.with_build_tag("mine|cutlass_fused:old", "cutlass_fused:new") == "mine|cutlass_fused:new"
    if not hasattr(compiler_config, "cache_key_tag"):
        pytest.skip("this torch has no torch.compiler.config.cache_key_tag (nor AOTAutograd's cache)")
    assert f"cutlass_fused:{digest}" in compiler_config.cache_key_tag.split("|")


def test_compile_cache_misses_for_another_build(tmp_path, monkeypatch):
    """What the tag is for: a graph compiled under one build is a cache hit for a second compile of
    the same build and a miss for another build's, where it would otherwise be served the first
    build's traced forward and backward."""
    if not hasattr(compiler_config, "cache_key_tag") or not hasattr(torch._functorch.config, "enable_autograd_cache"):
        pytest.skip("this torch has no AOTAutograd cache or no cache_key_tag")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layer = make_layer("cpu", 16, 8)

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(layer)(torch.randn(4, 16)).sum().backward()
        return dict(counters["aot_autograd"])

    ours = compiler_config.cache_key_tag
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        assert compile_once().get("autograd_cache_saved") == 1
        assert compile_once().get("autograd_cache_hit") == 1
        with compiler_config.patch(cache_key_tag=OPS_MODULE.with_build_tag(ours, "cutlass_fused:another")):
            assert compile_once().get("autograd_cache_miss") == 1


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_dynamic_batch_does_not_recompile_per_size(device, family):
    """Automatic dynamic shapes (torch._dynamo.config.automatic_dynamic_shapes, on by default; no
    mark_dynamic): the first batch size compiles a static graph, the second recompiles once with
    a symbolic batch, and every later size, a short last batch included, reuses that graph."""
    eager, compiled_layer = eager_and_copy(device)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    compiles = []
    with cutlass_fused.use_kernel_family(family):
        for m in (16, 24, 13, 16):
            x = torch.randn(m, 48, generator=g).to(device)
            dy = torch.randn(m, 40, generator=g).to(device)
            step_both(eager, compiled, compiled_layer, x, dy, f"batch {m}")
            compiles.append(graphs_compiled())
    assert compiles == [1, 2, 2, 2], f"graphs compiled after each batch size: {compiles}"
    assert not counters["graph_break"], dict(counters["graph_break"])


# ---------------------------------------------------------------------------
# Compiled results against the float64 reference: test_forward.py's rule
# (error <= 2x PyTorch's own at the same precision + a floor) on a compiled layer.

SHAPES = [(256, 512, 384), (3, 769, 1000)]  # aligned; tiny batch with unaligned K and N


@pytest.mark.parametrize("device,family,mode,shape", list(shape_cases(SHAPES)))
def test_compiled_matches_float64(device, family, mode, shape):
    """Three training steps, then eval, through one compiled layer (two graphs: train, eval)."""
    dtype, _ = MODES[mode]
    m, k, n = shape
    layer = make_layer(device, k, n, dtype, seed=m + k + n)
    compiled = torch.compile(layer, fullgraph=True)
    p = {"weight": layer.gemm.weight.detach(), "bias": layer.gemm.bias.detach(), "scale": layer.scale.detach(),
         "bn_weight": layer.bn.weight.detach(), "bn_bias": layer.bn.bias.detach()}
    p64 = {k_: v.double().cpu() for k_, v in p.items()}
    # Running stats as the reference updates them from our h (test_forward.py's "stage" check).
    run = (layer.bn.running_mean.clone(), layer.bn.running_var.clone())
    run64 = tuple(t.double().cpu() for t in run)
    bn = lambda z, running: batch_norm(z, p64 if z.dtype == torch.float64 else p, running, True)
    g = torch.Generator().manual_seed(3)
    for i in range(3):
        x = torch.randn(m, k, generator=g).to(device, dtype)
        with precision(device, family, mode), torch.no_grad():
            y = compiled(x)
            # The op the compiled graph calls, on the same operands: the h it normalized.
            h = ops.linear_stats(x, layer.gemm.weight, layer.gemm.bias, family)[0]
        assert y.dtype == torch.promote_types(dtype, torch.float32) and y.shape == (m, n)
        if m >= END_TO_END_BATCH:  # (a training y does not depend on the running stats passed)
            y64 = bn(reference_z(x.double().cpu(), p64), run64)[0]
            y_t = bn(reference_z(x, p, dtype, mode), run)[0]
            assert_close_rule(y.cpu(), y_t.cpu(), y64, mode, f"y step {i}")
        assert_close_rule(h.cpu(), reference_h(x, p, dtype, mode).cpu(), reference_h(x.double().cpu(), p64), mode,
                          f"h step {i}")
        ys64, *run64 = bn(h.double().cpu() * p64["scale"], run64)
        ys_t, *run = bn(h * p["scale"].to(dtype), run)
        assert_close_rule(y.cpu(), ys_t.cpu(), ys64, mode, f"batch norm of our h * scale, step {i}")
        for j, name in enumerate(("running_mean", "running_var")):
            assert_close_rule(getattr(layer.bn, name).cpu(), run[j].cpu(), run64[j], mode, f"{name} step {i}")
    assert layer.bn.num_batches_tracked.item() == 3

    # Eval normalizes with the running stats the compiled training steps left.
    layer.eval()
    running = (layer.bn.running_mean.clone(), layer.bn.running_var.clone())
    run64 = tuple(t.double().cpu() for t in running)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    with precision(device, family, mode), torch.no_grad():
        y = compiled(x)
    y64 = batch_norm(reference_z(x.double().cpu(), p64), p64, run64, False)[0]
    y_t = batch_norm(reference_z(x, p, dtype, mode), p, running, False)[0]
    assert_close_rule(y.cpu(), y_t.cpu(), y64, mode, "y eval")
    assert torch.equal(layer.bn.running_mean, running[0]) and torch.equal(layer.bn.running_var, running[1])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs_compiled() == 2


# ---------------------------------------------------------------------------
# CUDA graphs: mode="reduce-overhead" (Inductor's cudagraph trees)


class SkipLog(logging.Handler):
    """Collects the "skipping cudagraphs due to ..." warnings Inductor logs when it runs a graph
    without CUDA graphs (torch._inductor.cudagraph_utils and cudagraph_trees log them)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.messages.append(msg)


@pytest.fixture
def cudagraph_skips():
    """The skip messages logged during the test; torch's loggers do not propagate to the root
    logger (pytest's caplog), so the handler sits on torch's own."""
    handler = SkipLog()
    logger = logging.getLogger("torch")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def assert_ran_as_cuda_graphs(skips):
    assert counters["inductor"]["cudagraph_skips"] == 0 and not skips, (
        f"{counters['inductor']['cudagraph_skips']} cudagraph skips: {skips}")


def profile_one(fn):
    """fn's result and the host-side events of that one call: under a replayed CUDA graph our
    ops do not run on the host at all, and the launches are cudaGraphLaunch."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, prof.events()


def sgd_steps(eager, compiled_layer, compiled, steps, m=32):
    """fwd + bwd + SGD step on both copies; compares y, dx, parameters, grads and running stats
    after every step. Returns the host events of the last compiled step."""
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled_layer.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    dtype = eager.gemm.weight.dtype
    # A bf16 layer's gradients are bf16; the same ops run, but Inductor may fuse their casts.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    events = None
    for i in range(steps):
        x = torch.randn(m, eager.gemm.in_features, generator=g).to("cuda", dtype)
        dy = torch.randn(m, eager.gemm.out_features, generator=g).cuda()
        y_e, dx_e = step(eager, x, dy)

        def compiled_step():
            torch.compiler.cudagraph_mark_step_begin()
            # Clone: the graph's outputs are overwritten by its next replay.
            y, dx = step(compiled, x, dy)
            return y.clone(), dx.clone()

        if i == steps - 1:  # the steady state: warmed up and recorded in earlier steps
            (y_c, dx_c), events = profile_one(compiled_step)
        else:
            y_c, dx_c = compiled_step()
        assert_matches(y_c, y_e, f"y step {i}", tol)
        assert_matches(dx_c, dx_e, f"dx step {i}", tol)
        assert_same_state(compiled_layer, eager, f"step {i}", tol)
        opt_e.step(), opt_c.step()
        # To None: the next replay overwrites this step's gradients (they live in the graph's
        # pool), so accumulating into them is an error under cudagraph trees, for any module.
        eager.zero_grad(), compiled_layer.zero_grad()
    assert_same_state(compiled_layer, eager, "after the last SGD step", tol)
    assert compiled_layer.bn.num_batches_tracked.item() == steps
    return events


def assert_replayed(events):
    """A replay launches the graph; our ops (the host-side dispatcher events, not the kernels,
    whose names also start with cutlass_fused::) do not run."""
    cpu = torch.autograd.DeviceType.CPU
    ours = {e.name for e in events if e.device_type == cpu and e.name.startswith("cutlass_fused::")}
    assert any(e.name.startswith("cudaGraphLaunch") for e in events), "no cudaGraphLaunch in the steady-state step"
    assert not ours, f"our ops ran on the host in a step that should be a graph replay: {sorted(ours)}"


# Inside frozen_weights() the CUDA ops keep values derived from parameters, keyed on their
# versions: eval's fold of the batch norm into the GEMM epilogue and the 3xTF32 split of an fp32
# weight for the sm90 family without TF32 (csrc/derived_cache.h). Cudagraph trees run each
# graph's first call (warmup) eagerly with every allocation of the thread routed to the graph's
# private memory pool, so a value kept there would keep a tensor in that pool, and the warmup's
# check raises "Detected 1 tensor(s) in the cudagraph pool not tracked as outputs" (seen on an
# H100, torch 2.11). So traced code passes cache=False (cutlass_fused.frozen.may_cache): the
# cases below failed that way before it did, when values were kept outside any scope.
@needs_cuda
@pytest.mark.parametrize("mode", ["bf16", "f32", "tf32"])
@pytest.mark.parametrize("family", CUDA_FAMILIES)
def test_cudagraphs_train_steps_match_eager(family, mode, cudagraph_skips):
    """The running stats are buffers the op mutates in place (Tensor(a!)); Dynamo marks a
    module's buffers as static inputs, which cudagraph trees allow to be mutated
    (pytorch#139207 was plain BatchNorm skipping on exactly this)."""
    eager = make_layer("cuda", 48, 40, MODES[mode][0])
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, mode="reduce-overhead", fullgraph=True)
    # Warmup, recording, then replays.
    with precision("cuda", family, mode):
        events = sgd_steps(eager, compiled_layer, compiled, steps=5)
    assert_ran_as_cuda_graphs(cudagraph_skips)
    assert_replayed(events)
    assert not counters["graph_break"], dict(counters["graph_break"])


@needs_cuda
@pytest.mark.parametrize("scaling,backward", [("current", "bf16"), ("current", "e5m2"), ("delayed", "e5m2")])
def test_cudagraphs_fp8_train_steps_match_eager(scaling, backward, cudagraph_skips):
    """The e4m3 path under cudagraph trees: its casts, the FP8 op and, with delayed scaling, the
    state's in-place step (buffers, as the running stats) replay as eager runs them, with y, dx,
    the parameters, gradients, running stats and delayed state compared after every step."""
    if not cutlass_fused.fp8.e4m3_kernels(torch.device("cuda")):
        pytest.skip("the e4m3 kernels: an sm90 GPU and a build with the e4m3 rows")
    eager = make_layer("cuda", 48, 40, torch.bfloat16)
    eager.fp8 = cutlass_fused.Float8Recipe(scaling=scaling, backward=backward)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, mode="reduce-overhead", fullgraph=True)
    events = sgd_steps(eager, compiled_layer, compiled, steps=5)
    assert_ran_as_cuda_graphs(cudagraph_skips)
    assert_replayed(events)
    assert not counters["graph_break"], dict(counters["graph_break"])


@needs_cuda
@pytest.mark.parametrize("family", CUDA_FAMILIES)
@pytest.mark.parametrize("inference", [False, True], ids=["parameters", "inference-tensors"])
def test_cudagraphs_eval_sees_parameter_updates(family, inference, cudagraph_skips):
    """A replay after an in-place parameter update must use the new values: the fold is
    recomputed inside the graph. Inference tensors have no version counter, so nothing derived
    from them is cached: that variant runs without the pool problem above."""
    with torch.inference_mode(inference):
        eager = make_layer("cuda", 48, 40).eval()
        compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    with cutlass_fused.use_kernel_family(family), torch.inference_mode(inference), torch.no_grad():
        for i in range(5):
            x = torch.randn(32, 48, generator=g).cuda()
            torch.compiler.cudagraph_mark_step_begin()
            if i == 4:  # warmed up and recorded in earlier steps
                y_c, events = profile_one(lambda: compiled(x).clone())
            else:
                y_c = compiled(x).clone()
            assert_matches(y_c, eager(x), f"y step {i}")
            # As an optimizer step would, in place: the graph's inputs keep their addresses.
            for layer in (eager, compiled_layer):
                for t in (*layer.parameters(), layer.bn.running_mean, layer.bn.running_var):
                    t.mul_(1.01)
    assert_ran_as_cuda_graphs(cudagraph_skips)
    assert_replayed(events)


@needs_cuda
def test_cudagraphs_under_ddp(tmp_path, cudagraph_skips):
    """DDP in one process (world size 1): its bucketed gradient all-reduce hooks into the compiled
    backward. DDP's own forward does not trace whole (its logger call breaks the graph), so the
    layer is compiled inside it, as nn.Module.compile does, and fullgraph holds for our layer.
    bf16: fp32 on the sm90 family (the default on Hopper) meets the pool problem above."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        eager = make_layer("cuda", 48, 40, torch.bfloat16)
        compiled_layer = copy.deepcopy(eager)
        compiled_layer.compile(mode="reduce-overhead", fullgraph=True)
        ddp = DDP(compiled_layer, device_ids=[torch.cuda.current_device()])
        events = sgd_steps(eager, compiled_layer, ddp, steps=5)
        assert_ran_as_cuda_graphs(cudagraph_skips)
        assert_replayed(events)
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# torch.export

def exportable(device):
    return nn.Sequential(make_layer(device, 48, 40), nn.ReLU())


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_export_eval(device, family):
    model = exportable(device).eval()
    x = torch.randn(16, 48, device=device)
    batch = torch.export.Dim("batch")
    with cutlass_fused.use_kernel_family(family):  # the family is a constant of the exported graph
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
        for m in (16, 13):
            x = torch.randn(m, 48, device=device)
            assert_matches(ep.module()(x), model(x), f"y batch {m}")
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "cutlass_fused.linear_scale_batch_norm_eval.default" in targets, targets


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("decompose", [False, True], ids=["training-ir", "functional"])
def test_export_train(device, family, decompose):
    """Training mode exports too. export's default IR keeps the op's in-place update of the
    running stats; run_decompositions() functionalizes it (auto_functionalized), and the
    updates become the graph's BUFFER_MUTATION outputs. Both must update the running stats
    of the module they run in as eager does."""
    model = exportable(device).train()
    eager = copy.deepcopy(model)
    x = torch.randn(16, 48, device=device)
    with cutlass_fused.use_kernel_family(family):
        ep = torch.export.export(model, (x,))
        assert_same_state(model, eager, "export ran the layer")  # exporting traces on fake tensors only
        if decompose:
            ep = ep.run_decompositions()
            mutated = set(ep.graph_signature.buffers_to_mutate.values())
            assert mutated == {"0.bn.running_mean", "0.bn.running_var", "0.bn.num_batches_tracked"}, mutated
        exported = ep.module()
        for i in range(2):
            x = torch.randn(16, 48, device=device)
            assert_matches(exported(x), eager(x), f"y step {i}")
            for name, want in eager.state_dict().items():
                assert_matches(exported.state_dict()[name], want, f"step {i}: {name}")
    assert exported.state_dict()["0.bn.num_batches_tracked"].item() == 2
