"""The code's comments and docstrings name files that exist: a path into the repository
(csrc/..., cutlass_fused/..., docs/decisions.md), or a source or document file by its name alone
(bn_train.cu, plan.cpp, NOTES.md). A moved or deleted file leaves comments pointing nowhere; this
fails on them. The CPU runs it (no build needed)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("csrc", "cutlass_fused", "codegen", "scripts", "benchmarks", "tests", "examples")
SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".h", ".sh"}
TOP = "csrc|cutlass_fused|codegen|scripts|benchmarks|tests|docs|examples|third_party"
# A path into the repository, ending in a file's suffix (a glob's prefix, csrc/generated/sm90_, is not one).
PATH = re.compile(rf"(?<![\w./-])((?:{TOP})/[\w./-]*\.\w+)")
# A file of ours named alone: source and document suffixes (headers are left out: `a.h` is a
# member of `a` in a comment as often as a file).
NAME = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:cu|cuh|cpp|md))\b")
COMMENT = {"#": re.compile(r"#(.*)$"), "//": re.compile(r"//(.*)$")}


def comment_text(path, text):
    """What a reader takes as prose: comments and, in Python, every line (docstrings and strings)."""
    if path.suffix in (".py", ".sh"):
        return text.splitlines() if path.suffix == ".py" else [
            m.group(1) if (m := COMMENT["#"].search(line)) else "" for line in text.splitlines()]
    return [m.group(1) if (m := COMMENT["//"].search(line)) and not line.lstrip().startswith("#include") else ""
            for line in text.splitlines()]


def files():
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if (path.suffix in SUFFIXES and "generated" not in path.parts and "__pycache__" not in path.parts
                    and path != Path(__file__).resolve()):  # this file names missing files on purpose
                yield path


def test_comments_name_files_that_exist():
    ours = {p.name for top in (*SOURCES, "docs") for p in (ROOT / top).rglob("*")} | {"README.md"}
    missing = []
    for path in files():
        for i, line in enumerate(comment_text(path, path.read_text()), 1):
            for ref in PATH.findall(line):
                if not (ROOT / ref.rstrip(".")).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{i}: {ref}")
            for name in NAME.findall(line):
                if name not in ours:
                    missing.append(f"{path.relative_to(ROOT)}:{i}: {name}")
    assert not missing, "comments name files that do not exist:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_file(tmp_path):
    """The patterns catch what they are for (a test that cannot fail is no test)."""
    line = "see csrc/kernels/batch_norm.cu and registry.cpp (docs/decisions.md)"
    assert PATH.findall(line) == ["csrc/kernels/batch_norm.cu", "docs/decisions.md"]
    assert NAME.findall(line) == ["registry.cpp"]  # a name inside a path is the path's
    assert comment_text(Path("x.cpp"), '#include "a.cu"\nint x;  // in plan.cpp') == ["", " in plan.cpp"]


# A decisions heading cited as decisions.md, "Heading" (the quotes may follow on the comment's next line).
CITE = re.compile(r'decisions\.md,?\s+"([^"]+)"')


def headings():
    return {line.lstrip("#").strip() for line in (ROOT / "docs" / "decisions.md").read_text().splitlines()
            if line.startswith("#")}


def test_comments_cite_decisions_headings_that_exist():
    known, missing = headings(), []
    for path in files():
        prose = " ".join(line.strip().lstrip("/#*").strip() for line in comment_text(path, path.read_text()))
        missing += [f"{path.relative_to(ROOT)}: {h!r}" for h in CITE.findall(prose) if h not in known]
    assert not missing, "comments cite decisions.md headings that do not exist:\n" + "\n".join(missing)


def test_the_heading_check_finds_a_citation():
    assert CITE.findall('the rule (docs/decisions.md, "Row passes"); see decisions.md "Tests"') == \
        ["Row passes", "Tests"]
