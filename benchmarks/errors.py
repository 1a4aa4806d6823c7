"""Max |error| against float64 of the train and eval forward, ours next to eager PyTorch's,
for every kernel family and precision on this GPU:  python benchmarks/errors.py"""
import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed

MODES = {"bf16": (torch.bfloat16, False), "f16": (torch.float16, False), "tf32": (torch.float32, True),
         "f32": (torch.float32, False)}


def main(m=1024, k=1024, n=1000):
    families = ["sm90", "sm80"] if torch.cuda.get_device_capability() == (9, 0) else ["sm80"]
    print(f"{torch.cuda.get_device_name()}, batch={m} in={k} out={n}: max|y - float64|, ours / eager")
    print(f"{'family':6s} {'mode':5s} {'train ours':>11s} {'train eager':>12s} {'eval ours':>10s} {'eval eager':>11s}")
    for family in families:
        for mode, (dtype, tf32) in MODES.items():
            torch.manual_seed(0)
            torch.backends.cuda.matmul.allow_tf32 = tf32
            seed = Seed(k, n).cuda()
            seed.bn.running_mean.normal_()
            seed.bn.running_var.uniform_(0.5, 2)
            ref = Seed(k, n).cuda().double()
            ref.load_state_dict(seed.state_dict())
            eager = Seed(k, n).cuda().to(dtype)
            eager.load_state_dict(seed.state_dict())
            ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=dtype)
            ours.load_state_dict(seed.state_dict())
            x = torch.randn(m, k, device="cuda").to(dtype)
            row = []
            for train in (True, False):
                for mod in (ref, eager, ours):
                    mod.train(train)
                with torch.no_grad(), cutlass_fused.use_kernel_family(family):
                    y64 = ref(x.double())
                    row += [(ours(x).double() - y64).abs().max().item(), (eager(x).double() - y64).abs().max().item()]
            print(f"{family:6s} {mode:5s} {row[0]:11.2e} {row[1]:12.2e} {row[2]:10.2e} {row[3]:11.2e}")


if __name__ == "__main__":
    main()
