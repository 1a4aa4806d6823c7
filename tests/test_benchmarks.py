"""The benchmark entry points under benchmarks/ start: each one's --help runs and lists its
subcommands, and each subcommand's --help runs, so that a broken import or argument parser fails
here, on the CPU, and not on the GPU machine. No GPU, no build: a few seconds."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "kernels.py": ["backward_time", "backward_linear", "two_block", "tail_time", "stats_ab", "bits_ab",
                   "eval_activation", "fp8_rows", "fp8_casts", "fp8_given_x8", "fp8_eval"],
    "accuracy.py": ["errors", "f32_accuracy", "fp8_accuracy", "parity_probe", "fp8_teacher", "kernelbench_check"],
    "host.py": ["step_host", "step_gaps", "step_busy", "profile_mlp_step", "host_overhead", "layer_host", "fp8_host"],
    "ddp_step.py": [],  # a torchrun script, no subcommands
}

# Runs each script's command line (its __main__, with sys.path[0] its folder, as `python3 SCRIPT
# ARGS` does) once for each argument list, all in one process: importing torch, the slow part, is
# paid once rather than once a subcommand. One JSON line a run: the exit status and stdout.
DRIVER = r"""
import contextlib, io, json, runpy, sys
from pathlib import Path
for script, argv in json.loads(sys.argv[1]):
    sys.path[0] = str(Path(script).parent)
    sys.argv, out, code = [script, *argv], io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code
    print(json.dumps({"script": Path(script).name, "argv": argv, "code": code, "out": out.getvalue()}))
"""


@pytest.fixture(scope="module")
def helps():
    """{script: {argv as a string: (exit status, stdout)}}."""
    runs = [(str(ROOT / "benchmarks" / script), argv) for script, subs in COMMANDS.items()
            for argv in [["--help"]] + [[s, "--help"] for s in subs]]
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        run = json.loads(line)
        out.setdefault(run["script"], {})[" ".join(run["argv"])] = (run["code"], run["out"])
    return out


def listed(help_text):
    """The subcommands an entry point's --help lists: the names under its commands heading."""
    section = help_text.split("commands (", 1)[1] if "commands (" in help_text else ""
    return re.findall(r"^    (\w+)", section, re.M)


@pytest.mark.parametrize("script", COMMANDS)
def test_help_lists_the_subcommands(helps, script):
    code, text = helps[script]["--help"]
    assert code == 0 and text.startswith("usage:"), text
    assert listed(text) == COMMANDS[script], text


@pytest.mark.parametrize("script,sub", [(s, c) for s, subs in COMMANDS.items() for c in subs])
def test_subcommand_help_runs(helps, script, sub):
    code, text = helps[script][f"{sub} --help"]
    assert code == 0, text
    assert text.startswith(f"usage: {script} {sub} "), text


def test_the_probes_are_folded_in():
    """Every script under benchmarks/ is an entry point above (or their shared helpers): a probe
    of its own would go untested here."""
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"_common.py"}
    assert scripts == set(COMMANDS)
