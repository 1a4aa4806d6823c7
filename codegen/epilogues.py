"""The epilogues of the fused GEMMs, as Python functions.

codegen/trace.py traces each with CUTLASS's Python interface (cutlass_cppgen.epilogue) into
an epilogue visitor tree (EVT), and codegen/generate.py writes the tree's C++ types to
csrc/generated/evt_<family>_<mode>_<dtype>.h, which the kernel templates in csrc/kernels/gemm/
take as a parameter. The tracer parses these functions' source, so keep them plain:
  - a name is a node: the arguments are tensors the epilogue reads (accum, the accumulator,
    and the vectors named as codegen/trace.py's ARGUMENTS gives them to the kernel), the
    returned names the ones it writes (D, and the sums);
  - `+`, `-`, `*` and multiply_add are CUTLASS's functors; the other calls are the named
    operations of codegen/trace.py's ops(), whose C++ functors are ours (csrc/kernels/evt_extra.h);
  - a literal is a runtime scalar of the kernel, zero as the launcher passes it;
  - what a sum reduces over is decided by the shape of its output (trace.py's examples), not
    by `dim`, which the tracer ignores and which is written for the reader.
docs/epilogues.md says how to add one.

Every tree computes in fp32 and rounds once to the output type, except where it says.
"""


def evaluate(accum, b, a, c):
    # Eval: y = act((x W^T + b) * a + c) per column, the BatchNorm folded into a and c
    # (a = scale * gamma * invstd, c = beta - mean * a); b is added before the scale, in
    # PyTorch's order, so nothing is divided by scale or gamma. Null b and c read 0, null a 1
    # (linear_h: h alone). The activation is a runtime argument of the last node.
    H = accum + b
    Z = H * a
    D = plus_activated(Z, c)
    return D


def evaluate_rounded(accum, b, s, g, c):
    # fp16 eval: y = act(f16(f16(acc + b) * s) * g + c). The unfused model rounds h and then
    # z = h * scale to fp16, and either can overflow to inf before the BatchNorm, so the tree
    # rounds (and overflows) at the same two places; the fold passes s = scale, g = gamma * invstd.
    H = rounded_plus(accum, b)
    Z = rounded_multiplies(H, s)
    D = multiply_add_activated(Z, g, c)
    return D


def stats(accum, b, shift):
    # The sm90 training GEMM, swapped (W x^T: a feature is a row of accum), so that a feature's
    # sums over the batch are column reductions in registers. h = acc + b rounded to the output
    # type (the sums are of the h that is stored, as PyTorch's BatchNorm sees it); per CTA and
    # feature, the partial sums of u = h - shift and u^2 (shift is null at runtime: u = h).
    # u * (u + 0): the tracer's graph keeps one edge for u * u. D is a node over u^2 as well as
    # h (the tracer will not store h while h feeds the sums), and take_last(u^2, 0, h) = h keeps
    # D exact where multiply_add(u^2, 0, h) would turn an overflow of u^2 into 0 * inf = NaN.
    H = rounded_plus(accum, b)
    U = H - shift
    u_sum = partial_sum(U, dim=1)
    Usq = U * (U + 0.0)
    u_sumsq = partial_sum(Usq, dim=1)
    D = take_last(Usq, 0.0, H)
    return D, u_sum, u_sumsq


def stats_unswapped(accum, b):
    # The sm80 training GEMM, not swapped (x W^T: a feature is a column of accum): h rounded as
    # above, the CTA's partial sums of h and h^2 over its rows (CUTLASS 2.x's row reduction),
    # and the store of h. The tail reads them as stats' sums with a null shift.
    D = rounded_plus(accum, b)
    u_sum = partial_sum(D, dim=0)
    u_sumsq = partial_sum(square(D), dim=0)
    return D, u_sum, u_sumsq


def evaluate_residual(accum, b, a, c, r):
    # docs/epilogues.md's worked example, eval with a residual added after the activation:
    # y = act((x W^T + b) * a + c) + r, a residual MLP block's x + act(bn(linear(x))) in one kernel
    # (r of y's shape and dtype, rounded with it once). No kernel row uses it yet:
    # tests/test_epilogue_example.py builds a kernel around it and checks it against PyTorch.
    H = accum + b
    Z = H * a
    Y = plus_activated(Z, c)
    D = Y + r
    return D


def grad_sums(accum, h, h2, shift, shift2, mul, beta):
    # The dX GEMM of the Linear after a layer (sm90, swapped: W2^T dz^T, a feature of the layer
    # is a row of accum), with the layer's BatchNorm-backward sums in its epilogue. g = dy times
    # the activation's derivative at BN(z) = (h - shift) * mul + beta, the forward's value
    # (bn_common.cuh, pre_activation), with dy = accum rounded to h's dtype as torch.mm stores it;
    # shift, mul and beta are the forward's fp32 mean_h, scale * invstd * gamma and BN bias. D is g
    # rounded to h's dtype, as the unfused model's activation backward stores it, and per CTA and
    # feature the partial sums of g and g (h - shift), which the BN backward's one pass takes
    # (bn_backward.cu, batch_norm_backward_partials). h2 is h again and shift2 mean_h again: the
    # tracer nests no topological visitors, so one leaf may not feed two nodes while g feeds three.
    G = bn_grad(accum, h, shift, mul, beta)
    u_sum = partial_sum(G, dim=1)
    GU = times_centered(G, h2, shift2)
    u_sumsq = partial_sum(GU, dim=1)
    D = take_last(GU, 0.0, G)
    return D, u_sum, u_sumsq
