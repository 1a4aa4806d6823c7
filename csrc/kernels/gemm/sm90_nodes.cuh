// What the traced sm90 visitor trees (csrc/generated/evt_sm90_*.h) name: CUTLASS's sm90
// visitors, our compute functors (evt_extra.h), the fold broadcast (sm90_fold.cuh), and the
// GemmEvtArgs their Arguments are built from.
#pragma once

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "kernels/evt_extra.h"
#include "kernels/gemm/sm90_fold.cuh"
#include "kernels/gemm_evt.h"
