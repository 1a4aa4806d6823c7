import os

# Every output of our CUDA ops starts as NaN, so an element a kernel never
# wrote fails the comparison instead of passing as stale memory.
os.environ.setdefault("CUTLASS_FUSED_POISON", "1")
