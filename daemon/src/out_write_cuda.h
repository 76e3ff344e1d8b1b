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
    const cudaError_t err =
        cudaMemcpyAsync(ops.out, data, static_cast<size_t>(plan.slot_elems) * g.itemsize(),
                        cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess)
      return absl::InternalError(StrCat("cudaMemcpyAsync: ", cudaGetErrorName(err), " (",
                                        cudaGetErrorString(err), ")"));
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
