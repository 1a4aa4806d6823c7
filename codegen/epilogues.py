"""The epilogues we trace with cutlass_cppgen.epilogue.trace.

The frontend parses these functions' source (names such as `sum` and
`multiply_add` are EVT ops, not Python builtins), so keep them plain.

Both modes compute the same per-column affine of the fp32 accumulator,
Z = (acc + b) * a + c, with b, a, c row vectors; null b and c read 0, null a 1:
  train:  H = x @ W^T + b                           a = null, c = null
          (the finalize applies scale: statistics of H give those of
          Z = H * scale without dividing by scale, and the backward needs H)
  eval:   y = BN_eval(Z) = (acc + b) * A + C        A = scale*gamma*invstd,
                                                    C = beta - running_mean*gamma*invstd
Adding b before scaling keeps PyTorch's order of operations, and no division
by scale or gamma is ever needed.
"""


def train(accum, b, a, c):
    # `Z * Z` would collapse into one DiGraph edge, and storing Z directly
    # while it also feeds the reductions fails PassDAG2Tree (outdegree 2).
    # This form traces on sm80 and sm90; generate.py then replaces the
    # multiply_add that forms D with `take_last` so D is exactly Z.
    Z = (accum + b) * a + c
    col_sum = sum(Z, dim=0)
    Zsq = Z * (Z + 0.0)
    col_sumsq = sum(Zsq, dim=0)
    D = multiply_add(Zsq, 0.0, Z)
    return D, col_sum, col_sumsq


def evaluate(accum, b, a, c):
    D = (accum + b) * a + c
    return D
