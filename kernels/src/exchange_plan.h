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

/// The plans of one block of any kind: one plan, or three (q, k, v) for the head-chunk scatter.
struct BlockPlans {
  RowCopyPlan plans[3];
  int count = 0;
};

/// Block (src, dst) of `ops` into destination `dst`'s buffer `out_dst`: the plan(s) of the
/// matching Plan*Block above.
absl::StatusOr<BlockPlans> PlanBlock(const ExchangeShape& shape, const BlockOperands& ops,
                                     int src, int dst, void* out_dst);

/// Packed form of a block: its rows back to back in plan row order (for the head-chunk
/// scatter, all q rows, then all k rows, then all v rows). The same for every unit width, so a
/// block packed on one rank unpacks on another whatever either side's alignment.
/// Bytes of block (src, dst) of `ops` in packed form (equal for every src and dst).
absl::StatusOr<int64_t> PackedBlockBytes(const ExchangeShape& shape, const BlockOperands& ops);

/// Block (src, dst) of `ops` into `packed` (16-byte aligned, PackedBlockBytes long).
absl::StatusOr<BlockPlans> PlanPackBlock(const ExchangeShape& shape, const BlockOperands& ops,
                                         int src, int dst, void* packed);

/// A block that source `src` packed for `dst`, from `packed` into `out_dst` exactly where
/// PlanBlock would have stored it. `ops.inputs` are not read (they are the source's); the
/// kind and head band are.
absl::StatusOr<BlockPlans> PlanUnpackBlock(const ExchangeShape& shape, const BlockOperands& ops,
                                           int src, int dst, const void* packed, void* out_dst);

/// Runs `plan` on host memory exactly as the kernel would (same RowAt, same units).
void RunPlanOnHost(const RowCopyPlan& plan);

}  // namespace ulysses::kernels::internal
