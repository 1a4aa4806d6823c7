"""codegen.generate's row checks: the table's rows pass, and a promotion interval goes only where a
promoted mainloop takes it (CPU only; nothing is compiled)."""
import pytest

from codegen.generate import check_defaults, check_row
from codegen.kernels import KERNELS, Kernel


def test_the_table_passes():
    for k in KERNELS:
        check_row(k)
    check_defaults(KERNELS)


def test_each_family_dtype_and_mode_has_one_default_row():
    a = Kernel("sm90", "bf16", "eval", (256, 128, 64), (1, 2, 1), default=True)
    b = Kernel("sm90", "bf16", "eval", (128, 256, 64), (1, 2, 1))
    check_defaults([b, a])  # the default need not come first
    for rows, count in (([a, Kernel("sm90", "bf16", "eval", (128, 256, 64), default=True)], 2), ([b], 0)):
        with pytest.raises(SystemExit, match=f"need one default=True, not {count}"):
            check_defaults(rows)


def test_e4m3_promote_is_a_multiple_of_the_k_tiles_mmas():
    check_row(Kernel("sm90", "e4m3", "stats", (128, 128, 128), promote=8))
    check_row(Kernel("sm90", "e4m3", "stats", (128, 128, 64), promote=2))
    for tile, promote in (((128, 128, 128), 6), ((128, 128, 16), 4)):
        with pytest.raises(SystemExit, match="multiple of the k-tile's MMAs"):
            check_row(Kernel("sm90", "e4m3", "stats", tile, promote=promote))


@pytest.mark.parametrize("row", [
    Kernel("sm90", "e4m3", "stats", (128, 256, 128), (2, 1, 1), "TmaWarpSpecializedCooperativeFP8FastAccum",
           promote=8),
    Kernel("sm90", "bf16", "stats", (128, 256, 64), (2, 1, 1), promote=8),
])
def test_promote_needs_a_promoted_mainloop(row):
    with pytest.raises(SystemExit, match="promote"):
        check_row(row)
