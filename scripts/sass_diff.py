"""Compare the SASS of two builds' kernel objects, function by function, names stripped.

    python3 scripts/sass_diff.py BEFORE_DIR AFTER_DIR [substring]

Each directory holds .o files (e.g. build/compile-cuda/CMakeFiles/cutlass_fused_kernels.dir/
csrc/generated from scripts/compile_cuda.sh, no GPU needed). A function's SASS is cuobjdump's
listing of it without its name; the two builds' functions are matched as multisets of listings,
so a renamed type that compiles to the same code counts as identical. Exits 1 on any difference.
"""
import collections
import hashlib
import pathlib
import re
import subprocess
import sys


def functions(obj: pathlib.Path) -> dict[str, collections.Counter]:
    out = subprocess.run(["cuobjdump", "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    per_arch: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    arch = "?"
    for part in re.split(r"\n(?=\s*Function : )|\n(?=\s*code for )", out):
        m = re.match(r"\s*code for (sm_\w+)", part)
        if m:
            arch = m.group(1)
            continue
        if not part.lstrip().startswith("Function : "):
            continue
        body = part.split("\n", 1)[1] if "\n" in part else ""
        per_arch[arch][hashlib.md5(body.encode()).hexdigest()] += 1
    return per_arch


def main() -> int:
    before, after = map(pathlib.Path, sys.argv[1:3])
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    differ = 0
    for a in sorted(p for p in after.glob("*.o") if only in p.name):
        b = before / a.name
        if not b.exists():
            print(f"{a.stem}: only after")
            differ += 1
            continue
        fb, fa = functions(b), functions(a)
        for arch in sorted(set(fb) | set(fa)):
            old, new = fb[arch], fa[arch]
            same = sum((old & new).values())
            line = (f"{a.name.removesuffix('.cu.o')}: {arch}: {sum(old.values())} old, {sum(new.values())} new, "
                    f"{same} identical")
            if old != new:
                differ += 1
                line += f", {sum((old - new).values())} only old, {sum((new - old).values())} only new"
            print(line)
    print(f"sass_diff: {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
