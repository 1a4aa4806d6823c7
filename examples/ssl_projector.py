"""A SimSiam-style head trained eagerly and after cutlass_fused.fuse, from the same weights.

The head is SimSiam's: a projector of three Linear(bias=False) -> BatchNorm1d blocks (ReLU after the
first two, the last BatchNorm without affine) and a predictor Linear(bias=False) -> BatchNorm1d ->
ReLU -> Linear. Its inputs are the features of a frozen random backbone for two noisy views of each
batch; the loss is SimSiam's symmetric negative cosine similarity, with the stop-gradient on the
projections. fuse() turns every Linear -> BatchNorm1d of the head into one fused layer; the last
predictor Linear, which reaches no BatchNorm, stays as it is.

    python examples/ssl_projector.py                      # GPU: width 2048, batch 512, AMP bf16
    python examples/ssl_projector.py --width 64 --batch 32 --steps 5   # the CPU, in seconds

It prints the fuse report, both models' losses and their median step times. On the CPU the fused
layer runs PyTorch ops: the times there say nothing of the kernels.
"""
import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused


def head(width, bottleneck):
    """SimSiam's projector and predictor, as its paper's code builds them."""
    projector = nn.Sequential(
        nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU(inplace=True),
        nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU(inplace=True),
        nn.Linear(width, width, bias=False), nn.BatchNorm1d(width, affine=False))
    predictor = nn.Sequential(nn.Linear(width, bottleneck, bias=False), nn.BatchNorm1d(bottleneck),
                              nn.ReLU(inplace=True), nn.Linear(bottleneck, width))
    return nn.ModuleDict({"projector": projector, "predictor": predictor})


class SimSiamHead(nn.Module):
    def __init__(self, width, bottleneck):
        super().__init__()
        parts = head(width, bottleneck)
        self.projector, self.predictor = parts["projector"], parts["predictor"]

    def forward(self, f1, f2):
        z1, z2 = self.projector(f1), self.projector(f2)
        p1, p2 = self.predictor(z1), self.predictor(z2)
        return -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048, help="feature width (default 2048)")
    ap.add_argument("--batch", type=int, default=512, help="rows a view (default 512)")
    ap.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = device.type == "cuda"
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(64, args.width), nn.ReLU()).to(device).requires_grad_(False)  # frozen
    eager = SimSiamHead(args.width, max(1, args.width // 4)).to(device)
    fused, report = cutlass_fused.fuse(copy.deepcopy(eager))
    print(report)
    results = {}
    for name, model in (("eager", eager), ("fused", fused)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator(device=device).manual_seed(1)  # the same data for both
        losses, times = [], []
        for _ in range(args.steps):
            x = torch.randn(args.batch, 64, device=device, generator=g)
            views = [backbone(x + 0.3 * torch.randn(x.shape, device=device, generator=g)) for _ in range(2)]
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = model(*views)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        results[name] = (losses, statistics.median(times[len(times) // 3:]) * 1e3)
        print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {results[name][1]:.3f} ms a step (median)")
    gap = max(abs(a - b) for a, b in zip(results["eager"][0], results["fused"][0]))
    print(f"largest loss difference over {args.steps} steps: {gap:.2e}; fused runs "
          f"{results['eager'][1] / results['fused'][1]:.2f}x eager's speed on {device.type}"
          + ("" if device.type == "cuda" else " (PyTorch ops on the CPU: not a speed measure)"))
    return results, report


if __name__ == "__main__":
    main()
