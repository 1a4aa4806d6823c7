"""The benchmarks' tables and figures (cutlass_fused.bench, cutlass_fused.bench_step)."""
import sys


def fmt(v, spec):
    return "–" if v is None else format(v, spec)


def render(head, lines, right_from, markdown, meta):
    """A markdown table with the run's line below it, or plain columns, those from right_from on
    (the numbers) right-aligned."""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        out.append(f"\n{meta['gpu']}, {meta['date']}, torch {meta['torch']}, commit {meta['commit']}: "
                   f"`{meta['command']}`")
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt_line = lambda cells: "  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in
                                       enumerate(zip(cells, widths)))
    return "\n".join([fmt_line(head)] + [fmt_line(line) for line in lines])


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said once) where the [bench] extra is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("cutlass_fused.bench: matplotlib missing (pip install .[bench]): no plot", file=sys.stderr)
        return None
    return plt


def save_figure(plt, fig, meta, path):
    title = f"cutlass_fused on {meta['gpu']}, {meta['date']}, commit {meta['commit']}"
    if meta["gpu"] == "cpu":  # said on the image itself: a plot travels without its log
        title += "\nCPU: PyTorch ops, not the CUDA kernels.\nThese times check that it runs; they are no speed measure."
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
