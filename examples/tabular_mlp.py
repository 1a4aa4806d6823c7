"""A tabular MLP with BatchNorm and Dropout, trained unfused and after cutlass_fused.fuse.

The data is scikit-learn's bundled breast-cancer table (569 rows, 30 numeric features, no
download); the model is three blocks of Linear -> BatchNorm1d -> ReLU -> Dropout and a Linear to
the two classes, as tabular models are often written. fuse() turns each Linear -> BatchNorm1d -> ReLU
into one fused layer and leaves the Dropouts and the last Linear as they are. Both models start from
the same weights and see the same batches and Dropout masks (the fused layers draw no random
numbers), so their accuracies differ by rounding alone.

    python examples/tabular_mlp.py                 # needs scikit-learn (pip install scikit-learn)
    python examples/tabular_mlp.py --epochs 3      # quicker

It prints the fuse report and both models' test accuracy.
"""
import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused


def data(device, seed=0):
    """(x_train, y_train, x_test, y_test): the table standardized on its training part, 80/20."""
    from sklearn.datasets import load_breast_cancer
    x, y = load_breast_cancer(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    mean, std = x[train].mean(0), x[train].std(0)
    x = (x - mean) / std
    return x[train].to(device), y[train].to(device), x[test].to(device), y[test].to(device)


def mlp(features, width, classes, dropout):
    blocks = []
    for n_in in (features, width, width):
        blocks += [nn.Linear(n_in, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=512, help="hidden width (default 512)")
    ap.add_argument("--epochs", type=int, default=20, help="epochs (default 20)")
    ap.add_argument("--batch", type=int, default=64, help="rows a batch (default 64)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, y, x_test, y_test = data(device)
    torch.manual_seed(0)
    unfused = mlp(x.shape[1], args.width, 2, dropout=0.2).to(device)
    fused, report = cutlass_fused.fuse(copy.deepcopy(unfused))
    print(report)
    out = {}
    for name, model in (("unfused", unfused), ("fused", fused)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        order = torch.Generator().manual_seed(1)  # the same batches for both
        torch.manual_seed(2)  # and the same Dropout masks
        for _ in range(args.epochs):
            model.train()
            perm = torch.randperm(len(x), generator=order).to(device)
            # Whole batches only: BatchNorm1d refuses a batch of one row in training.
            for i in range(0, len(x) - args.batch + 1, args.batch):
                idx = perm[i:i + args.batch]
                loss = F.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[name] = accuracy(model, x_test, y_test)
        print(f"{name}: test accuracy {out[name]:.3f} ({len(x_test)} rows)")
    return out, report


if __name__ == "__main__":
    main()
