// Plans of the exchange blocks for the row-copy kernel (row_copy_layout.h). Each planner checks
// its arguments (INVALID_ARGUMENT naming the argument) and returns the plan the CUDA launcher
// runs; RunPlanOnHost runs the same plan on host memory, for tests. Host-only.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "row_copy_layout.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels::internal {

/// Plan of ScatterHeadsBlockRef (same arguments, same contract).
absl::StatusOr<RowCopyPlan> PlanScatterHeadsBlock(const ExchangeShape& shape, ConstView x_src,
                                                  int src, int dst, void* out_dst);

/// Plan of GatherHeadsBlockRef.
absl::StatusOr<RowCopyPlan> PlanGatherHeadsBlock(const ExchangeShape& shape, ConstView y_src,
                                                 int src, int dst, void* out_dst);

/// Plan of one part of ScatterQkvHeadChunkBlockRef: `part` (0 = q, 1 = k, 2 = v) is that
/// part's view; it lands in [part*D, (part+1)*D) of each 3D record.
absl::StatusOr<RowCopyPlan> PlanScatterQkvHeadChunkPart(const ExchangeShape& shape,
                                                        ConstView part_view, int part,
                                                        int32_t head_offset, int32_t head_count,
                                                        int src, int dst, void* out_dst);

/// Plan of GatherOutputHeadChunkBlockRef.
absl::StatusOr<RowCopyPlan> PlanGatherOutputHeadChunkBlock(const ExchangeShape& shape,
                                                           ConstView x_src, int32_t head_count,
                                                           int src, int dst, void* stage_dst);

/// Plan of GatherOutputHeadChunkMergeRef.
absl::StatusOr<RowCopyPlan> PlanGatherOutputHeadChunkMerge(const ExchangeShape& shape,
                                                           const void* stage, int32_t head_offset,
                                                           int32_t head_count, MutView out);

/// Plan of CopyContiguousToViewRef.
absl::StatusOr<RowCopyPlan> PlanCopyContiguousToView(const void* src, const int64_t shape[4],
                                                     int32_t itemsize, MutView dst);

/// Plan of CopyViewToContiguousRef.
absl::StatusOr<RowCopyPlan> PlanCopyViewToContiguous(ConstView src, const int64_t shape[4],
                                                     int32_t itemsize, void* dst);

/// Runs `plan` on host memory exactly as the kernel would (same RowAt, same units).
void RunPlanOnHost(const RowCopyPlan& plan);

}  // namespace ulysses::kernels::internal
