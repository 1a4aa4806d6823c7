"""SyncBatchNorm (and FSDP2) for LinearScaleBatchNorm1d over 2 processes: gloo on the CPU, NCCL on 2 GPUs.

References: the unfused layer in float64 in one process over the concatenated
batch, where each rank's rows use their own copy of the parameters, so that a
copy's gradient is that rank's local gradient (what nn.SyncBatchNorm gives
before DDP averages). PyTorch's own fp32 error, for the 2x rule, comes from
nn.SyncBatchNorm on the unfused model on GPUs; nn.SyncBatchNorm refuses CPU
tensors, so on the CPU it comes from the same one-process reference in fp32.
"""
import copy
import datetime
import io
import os
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from cutlass_fused.ops import ops
from cutlass_fused.sync_batch_norm import WORLD as WORLD_MARKER
from common import assert_close_rule, assert_close_rule_scaled, max_err

WORLD = 2
ACTIVATIONS = {None: lambda y: y, "relu": F.relu, "gelu": F.gelu, "leaky_relu": F.leaky_relu, "silu": F.silu}
PARAMS = ("gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias")
BACKENDS = [pytest.param("gloo", id="gloo-cpu"),
            pytest.param("nccl", id="nccl-cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                          reason="needs 2 GPUs"))]


def _entry(rank, fn, backend, store, args):
    # Each rank on its own device, passed explicitly: nothing may lean on cuda:0.
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    kw = {"device_id": device} if backend == "nccl" else {}
    # A collective that waits longer than this raises instead of hanging.
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30), **kw)
    try:
        fn(rank, device, *args)
        dist.barrier()  # every rank past its last collective: none waits on a peer that has left
    except BaseException:
        # Printed here: a rank that raises leaves its peers in a collective, and the test then
        # fails as a hang, with this rank's traceback only here.
        traceback.print_exc()
        raise
    # A rank that passed leaves at once, without destroy_process_group or the interpreter's
    # teardown. Through destroy_process_group, rank 0 could wait for good once rank 1 had gone
    # (torch 2.4.1, gloo; decisions.md, "Build"). Through
    # the teardown, a thread of torch's (gloo, FSDP2) could still be joinable, and the process
    # aborted ("terminate called without an active exception", SIGABRT) after the test had passed,
    # in about one full CPU run in five (test_fsdp2_trains_like_unfused[gloo-cpu], torch 2.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(rank, store, tasks, results):
    """A gloo rank of the module's pool (_Pool): runs each task it is given, fn(rank, cpu, *args),
    in one process group kept up between tasks, and reports None or the traceback. After a failure
    the group may be left mid-collective, so the rank leaves (and the pool is made anew)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            fn(rank, torch.device("cpu"), *args)
            dist.barrier()  # every rank past the task's last collective before the next task
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
            break
    results.close()
    results.join_thread()  # the queue's feeder thread has sent every report: os._exit would drop them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as _entry: no teardown that could hang or abort


class _Pool:
    """Two gloo ranks kept for the module's tests: spawning a pair and bringing torch up took ~6 s of
    each test's ~7 on a 2-core CPU, the suite's largest cost; the tasks themselves take a second.
    A task that fails or hangs retires the pool (its group may be mid-collective); the next test
    starts a new one."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.dir = tempfile.TemporaryDirectory()
        self.tasks = [ctx.Queue() for _ in range(WORLD)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, os.path.join(self.dir.name, "store"), self.tasks[r],
                                                       self.results), daemon=True) for r in range(WORLD)]
        for proc in self.procs:
            proc.start()

    def run(self, fn, args, limit):
        """None, or why fn failed (every failing rank's traceback, or the hang)."""
        for q in self.tasks:
            q.put((fn, args))
        deadline, failures = time.monotonic() + limit, []
        for _ in range(WORLD):
            try:
                rank, err = self.results.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # queue.Empty: a hang, or a rank that died without a word
                return f"{fn.__name__} did not finish in {limit} s" + "".join(f"\nrank {r}: {e}" for r, e in failures)
            if err is not None:
                failures.append((rank, err))
        return "".join(f"rank {r}: {e}" for r, e in failures) or None

    def close(self):
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.dir.cleanup()


_POOL = []  # the module's gloo pool, made on first use


@pytest.fixture(scope="module", autouse=True)
def _gloo_pool():
    yield
    while _POOL:
        _POOL.pop().close()


def run(fn, backend, *args, limit=300):
    """fn(rank, device, *args) on WORLD processes; a failure in any fails the test, as does a hang.
    gloo runs in the module's pool of two ranks (_Pool); NCCL spawns its two GPU ranks for each
    test. The limit only catches hangs: gloo's DDP test took ~9 s alone and over 90 s under 16
    pytest workers on a 16-core GPU host."""
    if backend == "gloo":
        if not _POOL:
            _POOL.append(_Pool())
        why = _POOL[0].run(fn, args, limit)
        if why is not None:
            _POOL.pop().close()
            pytest.fail(why)
        return
    with tempfile.TemporaryDirectory() as d:
        procs = mp.start_processes(_entry, args=(fn, backend, os.path.join(d, "store"), args), nprocs=WORLD,
                                   join=False, start_method="spawn")
        deadline = time.monotonic() + limit
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                pytest.fail(f"{fn.__name__} did not finish in {limit} s")


def seed_state(k, n, robust=False, **bn):
    torch.manual_seed(0)
    m = Seed(k, n, **bn)
    if robust:  # column means of h 1000x their spread (x ~ N(0, 1): the spread is |W row|)
        with torch.no_grad():
            m.gemm.bias.copy_(1000 * m.gemm.weight.norm(dim=1) * torch.randn(n).sign())
    return m.state_dict()


def rows(sizes, rank):
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


class Reference:
    """Training steps of the unfused layer over the concatenated batch, in one process, in `dtype`."""

    def __init__(self, state, dtype, momentum=0.1, eps=1e-5, activation=None):
        self.p = {k: state[k].to(dtype) for k in PARAMS if k in state}
        self.act = ACTIVATIONS[activation]
        self.running = [state[k].to(dtype) for k in ("bn.running_mean", "bn.running_var") if k in state]
        self.momentum, self.eps, self.steps = momentum, eps, 0

    def step(self, x, dy, sizes):
        """Each rank's y and local gradients; updates the running stats as nn.BatchNorm1d."""
        dtype = self.p["gemm.weight"].dtype
        copies = [{k: v.clone().requires_grad_() for k, v in self.p.items()} for _ in sizes]
        xs = [t.to(dtype).requires_grad_() for t in x.split(sizes)]
        scaled = lambda h, c: h * c["scale"] if "scale" in c else h  # the layer without a scale: none
        z = torch.cat([scaled(F.linear(t, c["gemm.weight"], c.get("gemm.bias")), c) for t, c in zip(xs, copies)])
        var, mean = torch.var_mean(z, 0, correction=0)
        zhat = ((z - mean) * (var + self.eps).rsqrt()).split(sizes)
        ys = [self.act(t * c["bn.weight"] + c["bn.bias"] if "bn.weight" in c else t) for t, c in zip(zhat, copies)]
        sum((y * g.to(dtype)).sum() for y, g in zip(ys, dy.split(sizes))).backward()
        self.steps += 1
        m = 1 / self.steps if self.momentum is None else self.momentum
        count = z.shape[0]
        if self.running:
            rm, rv = self.running
            self.running = [(1 - m) * rm + m * mean.detach(), (1 - m) * rv + m * var.detach() * count / (count - 1)]
        grads = [{"x": t.grad, **{k: v.grad for k, v in c.items()}} for t, c in zip(xs, copies)]
        return [y.detach() for y in ys], grads


def local_step(module, x, dy, none_is_zero=False):
    """y and the local gradients of one training step of `module` on this rank's rows.

    none_is_zero: nn.SyncBatchNorm leaves its input's, weight's and bias's gradients None on a
    rank without rows (zeros, to autograd); ours must give the zeros themselves."""
    dev = next(module.parameters()).device
    x = x.to(dev).requires_grad_()
    y = module(x)
    (y * dy.to(dev)).sum().backward()
    grad = lambda p: torch.zeros_like(p) if p.grad is None and none_is_zero else p.grad.clone()
    grads = {"x": grad(x), **{k: grad(p) for k, p in module.named_parameters()}}
    module.zero_grad()
    return y.detach(), grads


def same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return all(torch.equal(o, out[0]) for o in out)


def _layer_worker(rank, device, sizes, robust, bn, act=None, form="scaled"):
    """form: "scaled" (LinearScaleBatchNorm1d), "plain" (LinearBatchNorm1d, bias=False with
    "plain_no_bias"), or "fused_module": fuse() of Linear -> nn.SyncBatchNorm -> activation as
    nn.SyncBatchNorm.convert_sync_batchnorm leaves it, whose fused layer syncs over the module's
    group (None: the whole world)."""
    k, n = 12, 10
    state = seed_state(k, n, robust, **bn)
    if form != "scaled":
        state = {key: v for key, v in state.items() if key != "scale" and not (form.endswith("no_bias") and key ==
                                                                                  "gemm.bias")}
    if form == "fused_module":
        acts = {None: nn.Identity, "relu": nn.ReLU}
        model = nn.Sequential(nn.Linear(k, n), nn.BatchNorm1d(n, **bn), acts[act]())
        fused, report = cutlass_fused.fuse(nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device))
        ours = fused.get_submodule(report.fused[0].name)
        assert isinstance(ours.bn, nn.SyncBatchNorm) and ours.process_group is None
    elif form == "scaled":
        ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device, process_group=dist.group.WORLD,
                                                    activation=act, **bn)
    else:
        ours = cutlass_fused.LinearBatchNorm1d(k, n, bias=not form.endswith("no_bias"), device=device,
                                               process_group=dist.group.WORLD, activation=act, **bn)
    ours.load_state_dict(state)
    momentum = bn.get("momentum", 0.1)
    ref64, ref32 = (Reference(state, dt, momentum, activation=act) for dt in (torch.float64, torch.float32))
    # nn.SyncBatchNorm on the unfused model: PyTorch's fp32 error (with an activation, the fp32
    # reference's, whose activation is PyTorch's op too).
    nccl_ref = device.type == "cuda" and act is None and form == "scaled"
    if nccl_ref:
        same = nn.SyncBatchNorm.convert_sync_batchnorm(Seed(k, n, **bn)).to(device)
        same.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 3):
        x, dy = torch.randn(sum(sizes), k, generator=g), torch.randn(sum(sizes), n, generator=g)
        r = rows(sizes, rank)
        y, grads = local_step(ours, x[r], dy[r])
        y64, g64 = (t[rank] for t in ref64.step(x, dy, sizes))
        y32, g32 = (t[rank] for t in ref32.step(x, dy, sizes))
        if nccl_ref:
            y32, g32 = local_step(same, x[r], dy[r], none_is_zero=True)
        assert_close_rule(y.cpu(), y32.cpu(), y64, "f32", f"step {step}: y")
        for name, g_ours in grads.items():
            assert g_ours.dtype == g32[name].dtype, name
            assert_close_rule_scaled(g_ours, g32[name], g64[name], "f32", f"step {step}: d{name}")
        assert len(grads) == len(g64)
        if not ours.bn.track_running_stats:
            assert ours.bn.running_mean is None and ours.bn.num_batches_tracked is None
            continue
        running32 = [same.bn.running_mean, same.bn.running_var] if nccl_ref else ref32.running
        for name, ours_t, t32, t64 in zip(("running_mean", "running_var"), (ours.bn.running_mean, ours.bn.running_var),
                                          running32, ref64.running):
            assert_close_rule_scaled(ours_t, t32, t64, "f32", f"step {step}: {name}")
            assert same_on_all_ranks(ours_t), f"{name} differs between ranks"
        assert ours.bn.num_batches_tracked.item() == step
        if robust:  # the judge for robust statistics: float64 to 1e-3 relative
            assert max_err(y.cpu(), y64) <= 1e-3 * y64.abs().max()
            assert max_err(ours.bn.running_var.cpu(), ref64.running[1]) <= 1e-3 * ref64.running[1].abs().max()


CASES = {"even": ([4, 4], False, {}), "uneven": ([5, 3], False, {}), "single_sample": ([1, 6], False, {}),
         "empty_rank": ([0, 6], False, {}),
         "robust_variance": ([5, 3], True, {}), "momentum_none": ([5, 3], False, {"momentum": None}),
         "affine_false_no_running_stats": ([5, 3], False, {"affine": False, "track_running_stats": False}),
         # The activation fused into finalize and its derivative into the backward's two passes.
         "relu": ([5, 3], False, {}, "relu"), "gelu_uneven": ([6, 1], False, {}, "gelu"),
         "leaky_relu_affine_false": ([4, 4], False, {"affine": False}, "leaky_relu"),
         "silu": ([5, 3], True, {}, "silu"),
         # The layer without a scale (SimSiam's and MoCo v3's heads), and fuse() of nn.SyncBatchNorm.
         "no_scale": ([5, 3], False, {}, "relu", "plain"),
         "no_scale_no_bias_affine_false": ([4, 4], False, {"affine": False}, None, "plain_no_bias"),
         "no_scale_empty_rank": ([0, 6], False, {}, None, "plain"),
         "fused_sync_module": ([5, 3], False, {}, "relu", "fused_module"),
         "fused_sync_module_uneven": ([7, 1], False, {"momentum": None}, None, "fused_module")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_sync_batch_norm(backend, case):
    run(_layer_worker, backend, *CASES[case])


def _ddp_worker(rank, device, sizes):
    k, n, lr = 12, 10, 0.1
    state = seed_state(k, n)
    ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device, process_group=dist.group.WORLD)
    ours.load_state_dict(state)
    ids = [device.index] if device.type == "cuda" else None
    distributed = {"ours": DDP(ours, device_ids=ids)}
    whole = {"ref": Seed(k, n).double()}  # one process over the whole batch
    if device.type == "cuda":
        distributed["same"] = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(Seed(k, n)).to(device), device_ids=ids)
    else:
        whole["same"] = Seed(k, n)
    models = {**distributed, **whole}
    for m in models.values():
        m.load_state_dict(state) if isinstance(m, Seed) else m.module.load_state_dict(state)
    opts = {key: torch.optim.SGD(m.parameters(), lr=lr) for key, m in models.items()}
    g = torch.Generator().manual_seed(2)
    r = rows(sizes, rank)
    for step in range(4):
        x, target = torch.randn(sum(sizes), k, generator=g), torch.randn(sum(sizes), n, generator=g)
        for key, m in models.items():
            opts[key].zero_grad()
            if key in distributed:
                loss = F.mse_loss(m(x[r].to(device)), target[r].to(device))
            else:  # DDP averages the ranks' gradients: the mean of the ranks' losses
                dt = next(m.parameters()).dtype
                y = m(x.to(dt)).split(sizes)
                loss = sum(F.mse_loss(a, b.to(dt)) for a, b in zip(y, target.split(sizes))) / WORLD
            loss.backward()
            opts[key].step()
        state_of = lambda key: (models[key].module if key in distributed else models[key]).state_dict()
        ours_s, same_s, ref_s = state_of("ours"), state_of("same"), state_of("ref")
        for name, ref_t in ref_s.items():
            if name.endswith("num_batches_tracked"):
                assert ours_s[name].item() == step + 1
                continue
            assert_close_rule_scaled(ours_s[name], same_s[name], ref_t, "f32", f"step {step}: {name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_training_matches_unfused(backend):
    run(_ddp_worker, backend, [6, 4])


def _ranked_steps(sharded, ref, device, sizes, rank, k, outputs, lr):
    """Three SGD steps of MSE on random (x, target) of k and `outputs` columns: each wrapped model in
    `sharded` on this rank's rows (BN's statistics too; DDP and FSDP average the gradients), ref on
    every rank's rows as WORLD batches. Yields each step's number after it."""
    opts = {key: torch.optim.SGD(m.parameters(), lr=lr) for key, m in {**sharded, "ref": ref}.items()}
    g = torch.Generator().manual_seed(7)
    r = rows(sizes, rank)
    for step in range(3):
        x, target = torch.randn(sum(sizes), k, generator=g), torch.randn(sum(sizes), outputs, generator=g)
        for key, opt in opts.items():
            opt.zero_grad()
            if key in sharded:
                loss = F.mse_loss(sharded[key](x[r].to(device)), target[r].to(device))
            else:
                loss = sum(F.mse_loss(ref(a), b) for a, b in zip(x.double().split(sizes),
                                                                 target.double().split(sizes))) / WORLD
            loss.backward()
            opt.step()
        yield step


def _fsdp_worker(rank, device, sizes):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # On the rank's device type: FSDP2's default mesh is CUDA's wherever CUDA is, gloo's ranks too.
    mesh = init_device_mesh(device.type, (WORLD,))
    k, n, lr = 12, 10, 0.1
    state = {f"block.{key}": v for key, v in seed_state(k, n).items()}
    state.update({f"head.{key}": v for key, v in nn.Linear(n, 3).state_dict().items()})
    fused = nn.Sequential()
    fused.add_module("block", cutlass_fused.LinearScaleBatchNorm1d(k, n, activation="relu"))
    fused.add_module("head", nn.Linear(n, 3))
    unfused = nn.Sequential()
    unfused.add_module("block", nn.Sequential(Seed(k, n), nn.ReLU()))
    unfused.add_module("head", nn.Linear(n, 3))
    ref = copy.deepcopy(unfused).double()
    fused.load_state_dict(state)
    unfused.load_state_dict({key.replace("block.", "block.0."): v for key, v in state.items()})
    ref.load_state_dict(unfused.state_dict())
    sharded = {}
    for name, model in (("fused", fused), ("unfused", unfused)):
        model.to(device)
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded[name] = model
    for step in _ranked_steps(sharded, ref, device, sizes, rank, k, 3, lr):
        full = {key: {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
                      for name, t in m.state_dict().items()} for key, m in sharded.items()}
        for name, t64 in ref.state_dict().items():
            if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
                continue  # each rank's own, from its rows
            ours = full["fused"][name.replace("block.0.", "block.")]
            assert_close_rule_scaled(ours, full["unfused"][name], t64, "f32", f"step {step}: {name}")


def _linked_worker(rank, device, sizes, wrap):
    """Two fused blocks and a head that fuse() linked, against the unfused model wrapped alike: in
    DDP (wrap "ddp"), or each an FSDP2 unit (resharded after its forward; wrap "fsdp2")."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    unfused = nn.Sequential(nn.Linear(12, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 8), nn.BatchNorm1d(8),
                            nn.Linear(8, 3))
    with torch.no_grad():
        for m in (unfused[1], unfused[4]):
            m.weight.normal_(1, 0.2)
            m.bias.normal_(0, 0.2)
    ref = copy.deepcopy(unfused).double()
    base = copy.deepcopy(unfused)  # its modules are the fused model's, its parameters in unfused's order
    fused, report = cutlass_fused.fuse(base)
    assert len(report.linked) == 2, report  # the blocks, and the second one to the head
    layers = [m for m in fused.modules() if isinstance(m, cutlass_fused.LinearBatchNorm1d)]
    sharded = {}
    for name, model, units in (("fused", fused, layers + [fused.get_submodule("5")]),
                               ("unfused", unfused, [unfused[0], unfused[3], unfused[5]])):
        model.to(device)
        if wrap == "ddp":
            sharded[name] = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            continue
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (WORLD,))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded[name] = model
    for step in _ranked_steps(sharded, ref, device, sizes, rank, 12, 3, 0.1):
        full = {key: [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
                      for t in m.parameters()] for key, m in (("fused", base), ("unfused", unfused))}
        for i, t64 in enumerate(ref.parameters()):
            assert_close_rule_scaled(full["fused"][i], full["unfused"][i], t64.detach(), "f32",
                                     f"step {step}: parameter {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_trains_linked_blocks_like_unfused(backend):
    """FSDP2 units of one linked block (or the head) each: the first block's parameters are resharded
    after its forward, before the second block's backward would read its BN vectors (a crash, when it
    did), and the head's are unsharded in its own call alone: FSDP-managed layers run unlinked."""
    if backend == "gloo" and torch.__version__ < "2.5":
        pytest.skip("torch 2.4's fully_shard makes CUDA streams: FSDP2 does not run on the CPU there")
    run(_linked_worker, backend, [6, 4], "fsdp2")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_trains_linked_blocks_like_unfused(backend):
    """DDP over linked blocks and their head: each rank's BN statistics, DDP's averaged gradients."""
    run(_linked_worker, backend, [6, 4], "ddp")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_trains_like_unfused(backend):
    """FSDP2 (fully_shard) shards the fused layer's parameters and trains it as the unfused model."""
    if backend == "gloo" and torch.__version__ < "2.5":
        pytest.skip("torch 2.4's fully_shard makes CUDA streams: FSDP2 does not run on the CPU there")
    run(_fsdp_worker, backend, [6, 4])


class _Ops(TorchDispatchMode):
    """The ops a region dispatches below autograd, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_worker(rank, device, sizes):
    """One training step of the synced layer dispatches a handful of ops: the column arithmetic
    between the collectives is three ops, not the ~50 torch ops that made the DDP step host-bound
    (docs/decisions.md, "SyncBatchNorm")."""
    layer = cutlass_fused.LinearScaleBatchNorm1d(12, 10, device=device, process_group=dist.group.WORLD,
                                                 activation="relu")
    x = torch.randn(sizes[rank], 12, device=device, requires_grad=True)
    layer(x).sum().backward()  # warm: nothing lazily made on the first call is counted
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with _Ops() as fwd:
        y = layer(x)
    dy = torch.ones_like(y)
    with _Ops() as bwd:
        y.backward(dy)
    # Forward: linear_stats, the row, the gather (its buffer(s), the collective, then gloo's stack
    # or NCCL's view), the merge, finalize, num_batches_tracked's +1 and the running stats.
    # Backward: the two passes, the sums' copy and all-reduce, dX and dW (and a transpose), the
    # gradients' op and one cast of all four, unbound; AccumulateGrad's detach of each gradient it
    # takes launches nothing.
    assert len(fwd.names) <= 10, fwd.names
    assert len([name for name in bwd.names if name != "aten.detach.default"]) <= 11, bwd.names
    ours = [name for name in fwd.names + bwd.names if name.startswith("cutlass_fused.")]
    assert ours.count("cutlass_fused.sync_batch_norm_merge.default") == 1, ours


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_dispatches_few_ops(backend):
    run(_ops_worker, backend, [6, 4])


def _compile_worker(rank, device, sizes):
    """torch.compile(fullgraph=True) of the synced layer: one graph (the collectives and the column
    ops inside it), and eager's y, gradients and running stats (torch >= 2.5)."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    eager = cutlass_fused.LinearScaleBatchNorm1d(12, 10, device=device, process_group=dist.group.WORLD,
                                                 activation="relu")
    compiled = copy.deepcopy(eager)
    # torch 2.4's Dynamo cannot trace dist.get_backend (_gather_rows): a graph break there, then eager.
    one_graph = torch.__version__ >= "2.5"
    step = torch.compile(compiled, fullgraph=one_graph)
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        x = torch.randn(sum(sizes), 12, generator=g)[rows(sizes, rank)].to(device)
        y_e, grads_e = local_step(eager, x.clone(), torch.ones(len(x), 10))  # each its own leaf
        y_c, grads_c = local_step(step, x.clone(), torch.ones(len(x), 10))
        assert torch.allclose(y_c, y_e, rtol=1e-5, atol=1e-5)
        for name, a in grads_c.items():
            b = grads_e[name.removeprefix("_orig_mod.")]  # the compiled wrapper's parameter names
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, max_err(a, b))
    for a, b in zip(compiled.buffers(), eager.buffers()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-6)
    assert not one_graph or not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_layer_matches_eager(backend):
    run(_compile_worker, backend, [5, 3])


def _convert_worker(rank, device, sizes):
    k, n = 12, 10
    torch.manual_seed(0)
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device)
    inner = cutlass_fused.LinearScaleBatchNorm1d(n, n, device=device).eval()
    model = nn.Sequential(layer, nn.ReLU(), nn.Sequential(inner))
    assert cutlass_fused.convert_sync_batchnorm(model) is model
    synced = model[0]
    assert synced is not layer and layer.process_group is None and synced.process_group == dist.group.WORLD
    assert synced.gemm is layer.gemm and synced.scale is layer.scale and synced.bn is layer.bn
    assert model[2][0].process_group == dist.group.WORLD and not model[2][0].training

    x = torch.randn(sum(sizes), k, generator=torch.Generator().manual_seed(3))
    xr = x[rows(sizes, rank)].to(device)
    y64 = Reference({key: v.cpu() for key, v in layer.state_dict().items()}, torch.float64).step(
        x, torch.zeros(len(x), n), sizes)[0][rank]
    with torch.no_grad():
        y_sync, y_local = synced(xr), layer(xr)
        assert max_err(y_sync.cpu(), y64) < 1e-4, "the converted layer must use the whole batch's statistics"
        assert max_err(y_local.cpu(), y64) > 1e-2, "the original layer must stay unsynchronized"
        # Eval mode and a group of one rank take the normal path, to the bit.
        synced.eval(), layer.eval()
        assert torch.equal(synced(xr), layer(xr))
        groups = [dist.new_group([i]) for i in range(WORLD)]
        alone = cutlass_fused.convert_sync_batchnorm(layer, groups[rank]).train()
        assert torch.equal(alone(xr), layer.train()(xr))
        # Either order with nn.SyncBatchNorm's own conversion (which also converts our bn).
        both = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(layer, nn.BatchNorm1d(n)))
        both = cutlass_fused.convert_sync_batchnorm(both)
        assert isinstance(both[1], nn.SyncBatchNorm) and both[0].process_group == dist.group.WORLD
        assert max_err(both[0](xr).cpu(), y64) < 1e-4
        # A deep copy (an EMA model's, say) shares the group, which cannot be copied, and syncs the same.
        twin = copy.deepcopy(synced).train()
        assert twin.process_group is synced.process_group and twin.gemm.weight is not synced.gemm.weight
        assert torch.equal(twin(xr), synced.train()(xr))
        # torch.save of the model: the default group travels as WORLD, which the loading process
        # resolves to its own default group; another group is refused by name, not by pickle's error.
        buf = io.BytesIO()
        torch.save(model, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert loaded[0].process_group is WORLD_MARKER and loaded[2][0].process_group is WORLD_MARKER
        assert loaded[0].gemm.weight is not synced.gemm.weight
        assert torch.equal(loaded[0].train()(xr), synced.train()(xr))
        with pytest.raises(TypeError, match="state_dict"):
            torch.save(alone, io.BytesIO())


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_sync_batchnorm(backend):
    run(_convert_worker, backend, [5, 3])


def test_world_marker_without_distributed():
    """A synced layer pickled and loaded where torch.distributed is not up normalizes its own batch,
    as nn.SyncBatchNorm falls back, and pickles again as it came."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    layer = cutlass_fused.LinearScaleBatchNorm1d(6, 5, activation="relu")
    marked = copy.deepcopy(layer)
    marked.process_group = WORLD_MARKER
    buf = io.BytesIO()
    torch.save(marked, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert loaded.process_group is WORLD_MARKER
    x = torch.randn(7, 6)
    assert torch.equal(loaded(x), layer(x))
    torch.save(loaded, io.BytesIO())


def test_convert_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        cutlass_fused.convert_sync_batchnorm(cutlass_fused.LinearScaleBatchNorm1d(4, 3))


def _autocast_worker(rank, device, size, act):
    """The same batch on both ranks: global statistics equal local ones, so the synchronized layer must
    give the unsynchronized one's y and gradients, dtypes included (the GEMM in bf16, y in fp32)."""
    k, n = 12, 10
    state = seed_state(k, n)
    layers = [cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device, process_group=pg, activation=act)
              for pg in (dist.group.WORLD, None)]
    out = []
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(size, k, generator=g).to(device), torch.randn(size, n, generator=g).to(device)
    for layer in layers:
        layer.load_state_dict(state)
        xi = x.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(xi)
        (y * dy).sum().backward()
        out.append((y.detach(), {"x": xi.grad, **{k: p.grad for k, p in layer.named_parameters()}}))
    (y_sync, g_sync), (y_local, g_local) = out
    assert y_sync.dtype == y_local.dtype == torch.float32
    assert max_err(y_sync, y_local) < 1e-5
    for name, a in g_sync.items():
        b = g_local[name]
        assert a.dtype == b.dtype, name
        # dh is rounded to bf16 by differently ordered fp32/fp64 arithmetic: an ulp apart at most.
        assert max_err(a, b) <= 2e-2 * max(1.0, b.abs().max().item()), name
    assert max_err(layers[0].bn.running_mean, layers[1].bn.running_mean) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_autocast_matches_unsynchronized(backend, act):
    run(_autocast_worker, backend, 16, act)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype,dy_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("m,n", [(3, 769), (1000, 1000), (2, 8)])
@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
def test_backward_passes_apart_are_the_backward(device, dtype, dy_dtype, m, n, act):
    """batch_norm_backward_reduce, then _elemt with this batch's own sums and count, give
    batch_norm_backward's sums and dh to the bit: SyncBatchNorm runs the unsynced backward's
    kernels, its passes apart."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(m, 40, generator=g), torch.randn(n, 40, generator=g)
    v = lambda: torch.randn(n, generator=g).to(device)
    x, w = x.to(device, dtype), w.to(device, dtype)
    bn_w, bn_b, scale = v(), v(), v()
    _, h, _, mean, invstd = ops.linear_scale_batch_norm_train(x, w, v(), scale, bn_w, bn_b, None, None, None, 0.1,
                                                              1e-5, "auto", activation=act)
    dy = torch.randn(m, n, generator=g).to(device, dy_dtype)
    common = (dy, h, mean, invstd, scale, bn_w)
    dh, _, dweight, dbias, _ = ops.batch_norm_backward(*common, 1e-5, bn_b, act, 0.01)
    sums = ops.batch_norm_backward_reduce(*common, 1e-5, bn_b, act, 0.01)
    count = torch.tensor([float(m)], device=device, dtype=torch.float64)
    dh_apart = ops.batch_norm_backward_elemt(*common, sums, count, 1e-5, bn_b, act, 0.01)
    assert torch.equal(dh_apart, dh)
    assert torch.equal(sums[0].float(), dbias)
    # dweight = istd s q: the same q.
    assert torch.allclose((invstd * scale.double() * sums[1]).float(), dweight, rtol=1e-6, atol=1e-6)
    # Twice the count with the same sums is another dh (the kernel reads the count it is given).
    assert not torch.equal(ops.batch_norm_backward_elemt(*common, sums, 2 * count, 1e-5, bn_b, act, 0.01), dh)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gathered_rows(parts, device):
    """sync_batch_norm_row of each part's column sums, stacked as the all_gather leaves them."""
    rows_ = [ops.sync_batch_norm_row(torch.stack([p.sum(0), (p * p).sum(0)]).to(device), len(p)) for p in parts]
    return torch.stack(rows_)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_is_chan(device):
    """Rows of uneven, single-sample, empty and far-off-centre batches merge to float64's two-pass values:
    finalize's sums for count 1 and update_running_stats' for count 2 give the whole batch's mean,
    biased and unbiased var."""
    g = torch.Generator().manual_seed(5)
    parts = [1000 + torch.randn(m, 6, generator=g, dtype=torch.float64) for m in (5, 1, 0, 9)]
    stats, running, count = (t.cpu() for t in ops.sync_batch_norm_merge(_gathered_rows(parts, device)))
    whole = torch.cat(parts)
    assert count.item() == len(whole)
    assert max_err(stats[0], whole.mean(0)) < 1e-12
    assert max_err(running[0] / 2, whole.mean(0)) < 1e-12
    # The var is a difference of sums ~1e6 apart from it: fp64's 1e6 * 2^-53 absolute.
    assert max_err(stats[1] - stats[0] ** 2, whole.var(0, correction=0)) < 1e-9
    assert max_err((running[1] / 2 - (running[0] / 2) ** 2) * 2, whole.var(0)) < 1e-9


def _grads_reference(local, sums, row, count, mean_h, invstd, scale, bn_weight):
    """sync_batch_norm_grads' four rows in float64 torch ops (the formulas of csrc/kernels/sync_stats.h)."""
    n = mean_h.numel()
    m, mean, m2 = row[:1], row[1:n + 1], row[n + 1:]
    s, w = scale.double(), bn_weight.double()
    sdy, q = sums
    k = s * s * invstd * invstd * q / count
    d = mean - mean_h
    shc, shc2 = m * d, m2 + m * d * d
    dz = w * invstd * (local[0] - m * sdy / count - k * shc)
    dzhc = w * invstd * (local[1] - sdy / count * shc - k * shc2)
    return torch.stack([s * dz, dzhc + mean_h * dz, invstd * s * local[1], local[0]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 769])
def test_grads_columns(device, n):
    """The gradient op against its formulas in torch (each device's own build of sync_stats.h's lines),
    and the row and merge ops of a two-rank group against CPU's (the same lines, FMA contraction apart)."""
    g = torch.Generator().manual_seed(8)
    f64 = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    parts = [3 + f64(5, n), 3 + f64(3, n)]
    rows_ = _gathered_rows(parts, device)
    _, _, count = ops.sync_batch_norm_merge(rows_)
    local, sums = f64(2, n), f64(2, n)
    mean_h, invstd = 3 + f64(n) / 10, 1 + f64(n).abs()
    scale, bn_weight = f64(n).float(), f64(n).to(torch.bfloat16)
    args = [t.to(device) for t in (local, sums, rows_[0], count, mean_h, invstd, scale, bn_weight)]
    ours = ops.sync_batch_norm_grads(*args).cpu()
    ref = _grads_reference(*(t.cpu() for t in args))
    assert ours.shape == (4, n) and ours.dtype == torch.float64
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12)
    no_weight = ops.sync_batch_norm_grads(*args[:-1], None).cpu()
    assert torch.allclose(no_weight, _grads_reference(*(t.cpu() for t in args[:-1]), torch.ones(n)), rtol=1e-12,
                          atol=1e-12)
    if device == "cuda":
        for a, b in zip(ops.sync_batch_norm_merge(rows_), ops.sync_batch_norm_merge(rows_.cpu())):
            assert torch.allclose(a.cpu(), b, rtol=1e-13, atol=0)
        # M2 = Q - S mean, which CUDA contracts to one FMA: a column's few rows can cancel to ~1e-3 of
        # Q (~50 here), so the two differ by Q's rounding step, not M2's.
        assert torch.allclose(rows_.cpu(), _gathered_rows(parts, "cpu"), rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_sync_ops_refuse_bad_arguments(device):
    f64 = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="expected stats to be a contiguous float64 tensor of shape"):
        ops.sync_batch_norm_row(f64(3, 4), 2)
    with pytest.raises(RuntimeError, match="expected stats to have at least one column"):
        ops.sync_batch_norm_row(f64(2, 0), 2)
    with pytest.raises(RuntimeError, match="expected count to be non-negative"):
        ops.sync_batch_norm_row(f64(2, 4), -1)
    with pytest.raises(RuntimeError, match=r"expected rows to be a contiguous float64 tensor of shape \[world"):
        ops.sync_batch_norm_merge(f64(2, 8))
    with pytest.raises(RuntimeError, match="expected rows"):
        ops.sync_batch_norm_merge(f64(2, 9).float())
    n = 4
    good = [f64(2, n), f64(2, n), f64(2 * n + 1), f64(1), f64(n), f64(n), f64(n).float(), None]
    ops.sync_batch_norm_grads(*good)
    for i, bad, message in [(2, f64(2 * n), r"expected row to be a contiguous float64 tensor of shape \[9\]"),
                            (4, f64(n).float(), "expected mean to be float64"),
                            (1, f64(2, n + 1), "expected sums to be a contiguous float64 tensor"),
                            (6, f64(n + 1).float(), r"expected scale to have shape \[4\]")]:
        with pytest.raises(RuntimeError, match=message):
            ops.sync_batch_norm_grads(*good[:i], bad, *good[i + 1:])
