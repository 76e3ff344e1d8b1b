// CUDA launchers of the fused QKV op's kernels: the RMSNorm + RoPE step in place, the scatter
// of a rank's result into its W destinations' receive slots, and the two fused into one pass
// that also publishes readiness words. Usable from host C++ without CUDA headers (the stream
// type is forward-declared as in exchange_cuda.h). Without CUDA every launcher returns
// FAILED_PRECONDITION.
//
// The kernels take head_dim == kFusedGpuHeadDim (128): a half-warp holds one head, 16 bytes a
// lane. Semantics are those of qkv_norm_rope.h (NormRopeRef, ScatterQkvBlockRef), restricted to
// the token rows [row_begin, row_end) of the calling rank `src`; `qkv` is the rank's
// [B*S_l, 3*H*D] projection, indexed by absolute row. Every launcher checks its arguments
// first (INVALID_ARGUMENT naming the argument; nothing is enqueued), enqueues asynchronously on
// `stream` and returns INTERNAL if the launch fails. Pointers are device pointers (outputs may
// be a peer GPU's memory); qkv, the destinations, the norm weights and cos_sin must be 16-byte
// aligned. Positions outside [0, max_pos) are clamped on the device (validate them where they
// are host-visible: CheckFusedPositions).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "ulysses/kernels/qkv_norm_rope.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;  // same declaration as the CUDA runtime's

namespace ulysses::kernels {

/// Where a source rank's result goes: `out[dst]` is destination dst's result buffer of 3P
/// elements (QkvPlaneElems), for dst in [0, world). `ready[dst]`, when `ready` is non-null,
/// is a 64-bit readiness word in dst's memory that the launch sets to `epoch` once every store
/// of the launch to every destination is visible system-wide (release order: a reader that
/// acquires the word sees the data).
struct QkvDestinations {
  void* const* out;        ///< [world] device pointers
  uint64_t* const* ready;  ///< [world] device pointers, or nullptr for no readiness words
  uint64_t epoch;          ///< value written to each ready word
  /// A device word read before any store: nonzero, the launch stores nothing (a cancelled
  /// session). nullptr: always store.
  const uint64_t* cancel = nullptr;
};

/// Tuning of a launch. `max_blocks` caps the grid (0: enough blocks to fill the GPU), so a
/// launch that runs beside a GEMM can be kept to a few SMs.
struct QkvLaunchOptions {
  int32_t max_blocks = 0;
};

/// NormRopeRef on the GPU for rows [row_begin, row_end): Q and K heads of `qkv` in place; V
/// untouched. Reads w.q_norm, w.k_norm, w.cos_sin.
absl::Status LaunchNormRope(const QkvNormRopeShape& shape, const QkvWeights& w,
                            const int32_t* positions, int64_t row_begin, int64_t row_end, void* qkv,
                            cudaStream_t stream, QkvLaunchOptions options = {});

/// ScatterQkvBlockRef on the GPU for every destination at once, rows [row_begin, row_end)
/// only: copies rank `src`'s processed `qkv` into dests.out[0..W), then publishes
/// dests.ready. `counter` is a device word that is zero before the launch and zero after it
/// (the launch's blocks count themselves on it); required when dests.ready is set.
absl::Status LaunchQkvScatter(const QkvNormRopeShape& shape, QkvLayout layout, const void* qkv,
                              int src, int64_t row_begin, int64_t row_end,
                              const QkvDestinations& dests, unsigned int* counter,
                              cudaStream_t stream, QkvLaunchOptions options = {});

/// The fused pass on rows [row_begin, row_end): reads the raw projection `qkv` (not modified),
/// applies RMSNorm + RoPE to Q and K heads in registers and stores q, k and v of each head
/// straight into its destination's buffer, then publishes dests.ready. Equal, bit for bit, to
/// LaunchNormRope followed by LaunchQkvScatter.
absl::Status LaunchNormRopeScatter(const QkvNormRopeShape& shape, QkvLayout layout,
                                   const QkvWeights& w, const int32_t* positions, const void* qkv,
                                   int src, int64_t row_begin, int64_t row_end,
                                   const QkvDestinations& dests, unsigned int* counter,
                                   cudaStream_t stream, QkvLaunchOptions options = {});

}  // namespace ulysses::kernels
