// SyncBatchNorm's per-column arithmetic between the collectives (cutlass_fused/sync_batch_norm.py):
// one rank's [count, mean, M2] row, the group's merge of those rows, and the parameters' local
// gradients from column vectors. One column per call, on the host (ops_cpu.cpp loops over the
// columns) and on the device (sync_stats.cu runs a thread a column), so both paths share these
// lines. All fp64. They were ~50 torch ops a layer and step in Python; under DDP that host time
// set the fused step's pace (docs/decisions.md, "SyncBatchNorm").
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define CF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CF_HOST_DEVICE inline
#endif

namespace cutlass_fused {
namespace sync_stats {

// row = [count, mean(n), M2(n)] from this rank's sums (2 x n: sum h, sum h^2) over `count` rows.
// M2 = Q - S mean cancels, but in fp64 it keeps ~1e-10 relative at mean/std = 1e3, as the
// unsynced path's own moments (README, "Statistics"). An empty rank's row is zeros.
CF_HOST_DEVICE void row_column(double const* stats, int64_t n, double count, int64_t c, double* row) {
  double s = stats[c], q = stats[n + c];
  double mean = s / (count > 1.0 ? count : 1.0);
  double m2 = q - s * mean;
  row[1 + c] = mean;
  row[1 + n + c] = m2 < 0.0 ? 0.0 : m2;  // not fmax: a NaN stays NaN
  if (c == 0) row[0] = count;
}

// Chan's pairwise merge of `world` rows (each 2n + 1 long), in rank order, so that every rank
// holds the same bits. M2 = M2a + M2b + delta^2 na nb / n adds no cancellation, unlike sums of
// squares, so a column whose mean is far above its spread merges exactly (Chan, Golub &
// LeVeque). Ranks with count 0 add nothing. Out: `stats` (2 x n), the sums that
// batch_norm_finalize turns into mean and the biased var for count 1, and `running` (2 x n), the
// sums that update_running_stats turns into mean and the unbiased var for count 2 (its
// count / (count - 1) correction then gives the group's); and the group's count. The ops take
// the count as a host int, but the merged count lives on the device: reading it would stall the
// stream once per layer and step.
CF_HOST_DEVICE void merge_column(double const* rows, int world, int64_t n, int64_t c, double* stats, double* running,
                                 double* count_out) {
  int64_t ld = 2 * n + 1;
  double count = rows[0], mean = rows[1 + c], m2 = rows[1 + n + c];
  for (int r = 1; r < world; ++r) {
    double const* row = rows + r * ld;
    double nb = row[0], total = count + nb;
    double delta = row[1 + c] - mean;
    double frac = nb / (total > 1.0 ? total : 1.0);
    mean = mean + delta * frac;
    m2 = m2 + row[1 + n + c] + delta * delta * count * frac;
    count = total;
  }
  double var = m2 / count, unbiased_half = m2 / (count - 1.0) / 2.0;
  stats[c] = mean;
  stats[n + c] = var + mean * mean;
  running[c] = 2.0 * mean;
  running[n + c] = 2.0 * (unbiased_half + mean * mean);
  if (c == 0) *count_out = count;
}

// This rank's gradients of the linear bias, the scale, the BN weight and the BN bias (out: 4 x n)
// from column vectors alone. dz = w istd (g - sdy / count - K (h - mean_h)), K = s^2 istd^2 q /
// count, where (sdy, q) = `sums` are the group's sums of g and g (h - mean_h) and `local` this
// rank's; the row sums of dz and dz (h - mean_h) need this rank's sums of (h - mean_h) and its
// square: m (mean - mean_h) and M2 + m (mean - mean_h)^2, from its forward row [m, mean, M2].
// The linear bias's gradient is zero summed over the group, not on one rank: this rank's share,
// as the unfused model under nn.SyncBatchNorm gives it.
CF_HOST_DEVICE void grads_column(double const* local, double const* sums, double const* row, double count,
                                 double mean_h, double istd, double s, double w, int64_t n, int64_t c, double* out) {
  double m = row[0], d = row[1 + c] - mean_h, m2 = row[1 + n + c];
  double sdy = sums[c], q = sums[n + c];
  double k = s * s * istd * istd * q / count;
  double shc = m * d, shc2 = m2 + m * d * d;
  double dz_sum = w * istd * (local[c] - m * sdy / count - k * shc);
  double dzhc_sum = w * istd * (local[n + c] - sdy / count * shc - k * shc2);
  out[c] = s * dz_sum;
  out[n + c] = dzhc_sum + mean_h * dz_sum;  // sum dz h, h = (h - mean_h) + mean_h
  out[2 * n + c] = istd * s * local[n + c];
  out[3 * n + c] = local[c];
}

}  // namespace sync_stats
}  // namespace cutlass_fused
