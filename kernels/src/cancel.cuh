// The cancel word of a stream-ordered session, read by a launch before it stores anything.
// Include only from .cu sources.
#pragma once

#include <cstdint>

namespace ulysses::kernels::internal {

/// Whether `cancel` (null: never) is set, read once per block: thread (0, 0) loads the word and
/// the block learns it through shared memory. Every thread of the block must call this, before
/// any divergence. A load per warp instead would send every warp of the grid to the one L2 line
/// that holds the word, which serializes them there.
__device__ __forceinline__ bool BlockCancelled(const uint64_t* cancel) {
  if (cancel == nullptr) return false;
  __shared__ int cancelled;
  if (threadIdx.x == 0 && threadIdx.y == 0)
    cancelled = *static_cast<const volatile uint64_t*>(cancel) != 0 ? 1 : 0;
  __syncthreads();
  return cancelled != 0;
}

}  // namespace ulysses::kernels::internal
