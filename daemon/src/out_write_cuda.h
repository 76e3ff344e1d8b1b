// The out= step of a head-exchange call on the GPU backends (nvlink and nccl): once the call's
// blocks are in this rank's slot, the caller's out gets the merged band or a copy of the result.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "call_views.h"
#include "ulysses/common/status.h"
#include "ulysses/kernels/exchange_cuda.h"

namespace ulysses::daemon {

/// Enqueues on `stream` the write of the caller's out from this rank's slot `data`: the merge
/// of the band (an op that merges into out), the copy of the result (any op given out; the
/// fused op's out is contiguous, a plain device copy). True when something was enqueued, false
/// for a call without out. `cancel`: the kernels' cancel word (nullptr: none).
inline absl::StatusOr<bool> EnqueueOutWrite(const SessionGeometry& g, const CallPlan& plan,
                                            const CallOperands& ops, const uint8_t* data,
                                            cudaStream_t stream, const uint64_t* cancel = nullptr) {
  if (Traits(plan.op).fused) {
    if (!plan.has_out) return false;
    // The copy kernel in rows of D elements, not a device copy: like every kernel of the
    // call it reads the cancel word first, so a cancelled call (whose client stream was let
    // go) writes nothing into out afterwards.
    const int64_t d = g.head_dim, rows = plan.slot_elems / g.head_dim;
    const int64_t shape[4] = {1, 1, rows, d};
    const kernels::MutView dst{ops.out, {rows * d, rows * d, d, 1}};
    ULY_RETURN_IF_ERROR(
        kernels::LaunchCopyContiguousToView(data, shape, g.itemsize(), dst, stream, cancel));
    return true;
  }
  if (Traits(plan.op).merges_into_out) {
    ULY_RETURN_IF_ERROR(kernels::LaunchGatherOutputHeadChunkMerge(
        ShapeOf(g, plan), data, plan.head_offset, plan.head_count, OutView(plan, ops), stream,
        cancel));
    return true;
  }
  if (!plan.has_out) return false;
  ULY_RETURN_IF_ERROR(kernels::LaunchCopyContiguousToView(
      data, plan.out_shape.data(), g.itemsize(), OutView(plan, ops), stream, cancel));
  return true;
}

}  // namespace ulysses::daemon
