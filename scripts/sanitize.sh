#!/usr/bin/env bash
# compute-sanitizer over a GPU subset of the tests: both kernel families, every
# dtype, unaligned shapes (769, 1000, batch 3), train and eval, forward and
# backward, the fused training kernel's multi-item path (1000 x 5125), and the
# statistics GEMM with its exact fallback (bf16, TF32 and 3xTF32, sm90), and the
# sm80 family's rewrite of outputs that an infinite operand reaches, the sm90
# GEMMs in forced tile orders, the backward's variants (two passes, slab, cooperative,
# with two-item blocks at 520 x 50816, and its rows kept in shared memory: all of an item's
# at 1500 x 1032, some at 4096 x 2048 in bf16 and fp32, with relu) and the FP8 kernels (amax, cast, the
# transposing cast's shared-memory tiles, dequantize, the e4m3 rows, the e4m3 eval GEMMs (promoted
# and fast-accumulating), delayed scaling's casts that measure the amax and its history step, the
# FP8 ops' scale arithmetic), the eval fold that the sm90 eval epilogue makes itself, and the
# small-batch training tails (registers and shared-memory slab), the grad GEMM of the next Linear's
# dX with the BN backward's sums (batch_norm_backward_linear), sm90's 3xTF32 split of row views, and
# sm90's fp32 statistics GEMM over x, the weight and their remainders, with the rewrite of infinite rows.
# PyTorch's caching allocator would hide out-of-bounds accesses inside its
# blocks, so memcheck runs with it off.
# Usage: bash scripts/sanitize.sh [memcheck] [racecheck] [synccheck]   (default: all three)
# ONLY="11 12" runs those entries of FILES alone (0-based).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
# Test files and -k expressions, pairwise.
FILES=(
  "tests/test_forward.py::test_training tests/test_forward.py::test_eval"
  "tests/test_backward.py::test_training_grads tests/test_backward.py::test_eval_grads"
  "tests/test_forward.py::test_fused_train_matches_split_ops"
  "tests/test_stats_gemm.py"
  "tests/test_fp32.py::test_infinite_operands_in_a_forward_only_loop"
  "tests/test_tile_order.py"
  "tests/test_backward.py::test_backward_kernels_agree"
  "tests/test_fp8.py"
  "tests/test_activation.py::test_backward_kernels_agree_past_the_slab"
  "tests/test_forward.py::test_eval_fold_in_the_epilogue"
  "tests/test_forward.py::test_training_tails_agree"
  "tests/test_backward_linear.py::test_against_float64"
  "tests/test_fp32.py::test_sm90_3xtf32_row_views tests/test_fp32.py::test_sm90_3xtf32_unaligned_and_non_finite"
  "tests/test_fp32.py::test_train_non_finite_as_sgemm tests/test_fp32.py::test_train_operand_bits_below_tf32"
)
KEYS=("cuda and (3x769x1000 or 1000x1000x769)" "cuda" "1000x96x5125 or 333x128x130" "1000x96x5125 or falls_back"
      "cuda" "1000x96x5125 or 3x64x769" "spread and (bf16 or f32)"
      "(cuda and (values_transposed or torchs_cast or op_edges or e5m2_backward_in_the_layer or fast_accum)) or each_e4m3_row or (cuda and e4m3_eval_is_the_emulated_one and autocast-bf16-y and 3x769x1000) or (cuda and ((with_scale_is_fp8_rounding and bf16) or quantize_with_scale_edges or fp8_record_is or fp8_operand_scales_is_torchs or fp8_backward_scales_is_torchs or (delayed_operands_is_the_ops and bf16) or delayed_e5m2_backward))"
      "relu and (1500x1032-bf16 or 4096x2048-bf16 or 4096x2048-f32)"
      "not no_affine and relu and (bf16 or f16)" "bf16 and spread and (200x32 or 512x64)"
      "cuda and relu and (3x256x1000 or 1000x769x512)" "row_views or 3-769-1000 or 1000-300-5125"
      "1027 or bits")
rc=0
runs=(${ONLY:-${!FILES[@]}})
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck)
for tool in "${tools[@]}"; do
  log="$OUT/sanitize_$tool.log"
  : > "$log"
  for i in "${runs[@]}"; do
    read -r -a files <<< "${FILES[$i]}"
    extra=()
    [ "$tool" = memcheck ] && extra=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    "${extra[@]}" env CUTLASS_FUSED_POISON=1 CUTLASS_FUSED_NO_PROFILER=1 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider "${files[@]}" -k "${KEYS[$i]}" >> "$log" 2>&1 || rc=1
  done
  echo "$tool: $(grep -cE 'SUMMARY: 0 (errors|hazards)' "$log") of ${#runs[@]} runs clean;" \
    "$(grep -E 'SUMMARY: [1-9]' "$log" | head -1) pytest: $(grep -E '(passed|failed)' "$log" | tr '\n' ' ')"
done
exit $rc
