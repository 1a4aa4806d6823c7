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
          (fp16: y = round(round(acc + b) * scale) * A + C, A = gamma*invstd:
          evaluate_rounded, so that h and z overflow as the unfused model's)
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


def evaluate_rounded(accum, b, s, a, c):
    # fp16 eval (kernels.py): the unfused model rounds h = x W^T + b and then
    # z = h * scale to fp16, where either can overflow to inf, before the batch
    # norm; generate.py makes the H and Z nodes round to the output dtype, and
    # the fold passes a = gamma*invstd, c as in evaluate, and s = scale. With
    # s and a null (1) and c null (0) it is h alone (linear_h).
    H = accum + b
    Z = H * s
    D = multiply_add(Z, a, c)
    return D


def stats(accum, b, shift):
    # The swapped-AB training GEMM (kernels.py, mode "stats"): accum is h^T, one
    # row per feature, so the per-feature sums are column reductions of its rows
    # (cheap: no shared-memory pass). D = h exactly (generate.py turns the
    # multiply_add into take_last, as for train); the statistics are of h - shift.
    # Storing accum + b while accum also feeds the sums fails the DAG pass.
    H = accum + b
    U = H - shift
    u_sum = sum(U, dim=1)
    Usq = U * (U + 0.0)
    u_sumsq = sum(Usq, dim=1)
    D = multiply_add(Usq, 0.0, H)
    return D, u_sum, u_sumsq

