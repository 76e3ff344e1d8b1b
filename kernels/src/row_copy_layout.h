// The one data-movement primitive behind every exchange launcher: copy a 4-level grid of rows,
// each row a run of units, between two affine byte layouts. Shared by the CUDA kernel and its
// host emulation (RunPlanOnHost), so tests on a machine without a GPU still exercise the exact
// index math the kernel runs. Host-visible, C++17.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels::internal {

/// Row (i0, i1, i2, i3), i_k in [0, extent[k]), row-major order, starts at byte
/// src + sum_k i_k * src_coef[k] and dst + sum_k i_k * dst_coef[k]. Unit u of a row (u in
/// [0, units_per_row), unit_bytes each) is at + u * src_unit_step / + u * dst_unit_step.
/// Block offsets of an exchange (which rank's band, which sequence block) are folded into
/// `src` and `dst`. All offsets are bytes, all math 64-bit.
struct RowCopyPlan {
  const void* src;
  void* dst;
  int64_t extent[4];
  int64_t src_coef[4];
  int64_t dst_coef[4];
  int64_t rows;  // extent[0] * extent[1] * extent[2] * extent[3]
  int64_t units_per_row;
  int64_t src_unit_step;
  int64_t dst_unit_step;
  int32_t unit_bytes;  // 16 (vector path) or the itemsize (scalar path)
  int32_t lanes;       // threads that share one row: a power of two in [1, 32]
};
static_assert(std::is_trivially_copyable_v<RowCopyPlan>);
static_assert(offsetof(RowCopyPlan, extent) == 16);
static_assert(offsetof(RowCopyPlan, rows) == 112);
static_assert(offsetof(RowCopyPlan, unit_bytes) == 144);
static_assert(sizeof(RowCopyPlan) == 152);

/// Byte offsets of a row's first unit from plan.src and plan.dst.
struct RowOffsets {
  int64_t src;
  int64_t dst;
};

ULY_HOST_DEVICE inline RowOffsets RowAt(const RowCopyPlan& p, int64_t row) {
  const int64_t i3 = row % p.extent[3];
  row /= p.extent[3];
  const int64_t i2 = row % p.extent[2];
  row /= p.extent[2];
  const int64_t i1 = row % p.extent[1];
  const int64_t i0 = row / p.extent[1];
  return RowOffsets{
      i0 * p.src_coef[0] + i1 * p.src_coef[1] + i2 * p.src_coef[2] + i3 * p.src_coef[3],
      i0 * p.dst_coef[0] + i1 * p.dst_coef[1] + i2 * p.dst_coef[2] + i3 * p.dst_coef[3]};
}

}  // namespace ulysses::kernels::internal
