"""Runs a module of cutlass_fused from another tree (an older build's package and its .so), past the
editable install's import hook, for an A/B of two builds in one device call.

    python3 scripts/old_build.py DIR MODULE [ARGS...]
    # e.g. DIR=/tmp/old holding cutlass_fused/ (git archive OLD cutlass_fused) with OLD's _C*.so in it:
    #   python3 scripts/old_build.py /tmp/old cutlass_fused.bench --step-case amp-bf16,256,2048,6

scikit-build-core's editable install puts finders at the front of sys.meta_path that map
cutlass_fused to the installed tree whatever PYTHONPATH says (docs/decisions.md, "Measuring"); this
drops them and puts DIR first. Copying only an old .so over the installed one fails where the Python
side changed too (a fake registered for an op the old .so lacks). Run it from a directory without a
cutlass_fused/ of its own (not the repository root), and give each build its own
TORCHINDUCTOR_CACHE_DIR where torch.compile runs and the old build predates the cache tag.
"""
import runpy
import sys

if len(sys.argv) < 3:
    raise SystemExit(__doc__)
tree, module = sys.argv[1], sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
sys.path.insert(0, tree)
import cutlass_fused._C as built  # noqa: E402

if not built.__file__.startswith(tree.rstrip("/") + "/"):
    raise SystemExit(f"scripts/old_build.py: cutlass_fused._C came from {built.__file__}, not from {tree}")
print(f"old_build: {built.__file__}", file=sys.stderr)
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
