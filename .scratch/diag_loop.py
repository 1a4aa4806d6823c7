import sys, torch
sys.path.insert(0, "tests")
import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from common import precision
dev = "cuda"
for s in range(4):
    torch.manual_seed(s)
    seed = Seed(48, 32)
    models = {"ref": Seed(48, 32).double(), "same": Seed(48, 32).to(dev),
              "ours": cutlass_fused.LinearScaleBatchNorm1d(48, 32, device=dev)}
    for mdl in models.values():
        mdl.load_state_dict(seed.state_dict())
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
    target = torch.randn(64, 32, dtype=torch.float64)
    L = {k: [] for k in models}
    with precision(dev, "sm80", "f32"):
        for step in range(20):
            x = torch.randn(64, 48, dtype=torch.float64)
            ys = {}
            for k, mdl in models.items():
                d, dt = ("cpu", torch.float64) if k == "ref" else (dev, torch.float32)
                opts[k].zero_grad()
                y = mdl(x.to(d, dt)); ys[k] = y.detach().double().cpu()
                loss = ((y - target.to(d, dt)) ** 2).mean(); loss.backward(); opts[k].step()
                L[k].append(loss.item())
            if step == 0:
                g = {k: {n: p.grad.double().cpu() for n, p in m.named_parameters()} for k, m in models.items()}
                print("seed", s, "step0 y err ours %.2e same %.2e" % ((ys["ours"] - ys["ref"]).abs().max(), (ys["same"] - ys["ref"]).abs().max()))
                for n in g["ref"]:
                    print("   grad", n, "ours %.2e same %.2e" % ((g["ours"][n] - g["ref"][n]).abs().max(), (g["same"][n] - g["ref"][n]).abs().max()))
    r = torch.tensor(L["ref"])
    eo = (torch.tensor(L["ours"], dtype=torch.float64) - r).abs(); es = (torch.tensor(L["same"], dtype=torch.float64) - r).abs()
    print("seed", s, "loss err ours", " ".join("%.1e" % v for v in eo.tolist()))
    print("seed", s, "loss err same", " ".join("%.1e" % v for v in es.tolist()))
