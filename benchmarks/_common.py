"""What the benchmark entry points (kernels.py, accuracy.py, host.py) share: a command line with one
subcommand a question, and the argument types their subcommands take. How they time is
cutlass_fused.timing's, the harness the layer and step benchmarks use too."""
import argparse
import inspect
import textwrap

import torch

from cutlass_fused import bench_step


def shape(text):
    """An argparse type: "B,IN,OUT" (or "B,N") as a tuple of ints."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def arg(*names, **options):
    """One add_argument call's arguments, for Commands.command."""
    return names, options


def case_arg(default, cpu=None):
    """--case: one training-step case of the step benchmark (cutlass_fused.bench_step), its MLP's
    precision and size. Its default is `default`, parsed only where no --case is given; with `cpu`
    too, the default is left to the command (None), which takes `cpu` off CUDA."""
    where = f", on the CPU {cpu}" if cpu else ""
    return arg("--case", type=bench_step.parse_case, default=default if cpu is None else None,
               metavar="PRECISION,BATCH,WIDTH,BLOCKS",
               help=f"a step case, [,ACTIVATION[,MODEL]] optional (python -m cutlass_fused.bench --help "
                    f"lists their values); default {default}{where}")


def cuda_device(command):
    """The CUDA device, or an exit that names the subcommand: most of these time CUDA kernels."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{command}: needs a CUDA GPU")
    return torch.device("cuda")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (docstrings keep their paragraphs); option help wrapped at spaces
    only, so that row names such as fused-fp8-e5m2 stay whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Commands:
    """An entry point's subcommands. Each is a function of the parsed arguments, registered with
    @commands.command(arg(...), ...), its name the subcommand's and its docstring the help: the
    first paragraph is the line in the entry point's list, the whole the subcommand's --help. It
    returns the exit status, or None for 0."""

    def __init__(self, doc):
        self.doc, self.commands = doc, {}

    def command(self, *args):
        def register(fn):
            self.commands[fn.__name__] = (fn, args)
            return fn
        return register

    def parser(self):
        ap = argparse.ArgumentParser(description=self.doc, formatter_class=Formatter)
        sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands (COMMAND --help for each)")
        for name, (fn, args) in self.commands.items():
            doc = inspect.cleandoc(fn.__doc__)
            summary = " ".join(doc.split("\n\n")[0].split())
            p = sub.add_parser(name, help=summary, description=doc, formatter_class=Formatter)
            for names, options in args:
                p.add_argument(*names, **options)
            p.set_defaults(run=fn)
        return ap

    def main(self, argv=None):
        args = self.parser().parse_args(argv)
        return args.run(args) or 0
