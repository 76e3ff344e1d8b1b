// The fused QKV op's epilogue-fused GEMM (path 4b of the fused session): a Hopper (sm_90a)
// CUTLASS GEMM, 128x128 tiles (ping-pong) or 128x256 (cooperative), whose epilogue takes each
// tile (128 token rows of one or two 128-wide heads of Q, K or V) from the accumulators, rounds
// it to bf16, applies RMSNorm + interleaved RoPE to Q and K heads, stores every row straight
// into its destination rank's slot and counts the tile towards its chunks' readiness words. The projection is not written to
// memory, except on request (for tests), or alone (EpilogueCall::projection_only: the
// per-operator and chunked paths' GEMM of a plan with cutlass_projection). Internal to ulysses::kernels; host-visible, no CUDA
// or CUTLASS headers.
//
// Built only with CUTLASS's headers (ULYSSES_CUTLASS_DIR) and sm_90a among the CUDA
// architectures; otherwise Create returns FAILED_PRECONDITION saying which is missing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/kernels/exchange.h"  // ULY_HOST_DEVICE
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/qkv_norm_rope.h"
#include "ulysses/kernels/qkv_norm_rope_cuda.h"

namespace ulysses::kernels::internal {

/// Rows of a readiness unit (and of a ping-pong GEMM tile): chunk boundaries of a call fall
/// on multiples of it.
inline constexpr int64_t kEpilogueTileRows = 128;

/// The tile scheduler's largest swizzle (8, 4, 2 or 1) for a call of `m_tiles` x `n_tiles`
/// output tiles in clusters of `cluster_m` along M. CUTLASS's persistent scheduler rounds the
/// tile grid up to whole swizzle groups (M to a multiple of swizzle x cluster, N to a multiple
/// of the swizzle), taking a smaller swizzle than the largest allowed on a short side (below 6
/// tiles for 8, 3 for 4, 2 for 2), and it runs the mainloop of every tile of the rounded grid,
/// in the problem or not. So this is the largest swizzle whose rounded grid is the smallest:
/// 8 x 72 tiles in clusters of 2 take 4, as swizzle 8 would round them to 16 x 72.
int EpilogueSwizzle(int64_t m_tiles, int64_t n_tiles, int cluster_m);

/// Where unit `unit` (rows [128 unit, 128 unit + 128)) of a call of `units` units arrives:
/// its readiness chunk (chunks of `chunk_units` units), and the arrivals that chunk takes
/// before its word is published (one per unit of the chunk and tile across the features).
struct UnitArrival {
  int32_t chunk;
  uint32_t arrivals;
};
ULY_HOST_DEVICE constexpr UnitArrival ArrivalOf(int32_t unit, int32_t units, int32_t chunk_units,
                                                int32_t n_tiles) {
  const int32_t chunk = unit / chunk_units, first = chunk * chunk_units;
  const int32_t end = units < first + chunk_units ? units : first + chunk_units;
  return {chunk, static_cast<uint32_t>((end - first) * n_tiles)};
}

/// The register epilogue's 4 x 4 transpose across a quad (lanes 4k .. 4k + 3 of a warp, `q`
/// = lane % 4). The MMA leaves quad lane q with columns 2q, 2q + 1 of each 8-column block;
/// after the transpose lane q holds the whole block 4g + q of each group g of 4 blocks (16
/// bytes to store, 8 elements of one partial of the head's sum of squares). Before, a[j] is
/// element (q, j) of the quad's 4 x 4 matrix; after, a[j] is element (j, q). Two exchanges
/// of two values each, with lane q ^ 1 (step 1) and then q ^ 2 (step 2): QuadSend gives what
/// lane q sends, QuadReceive stores what its partner sent.
/// (Constant indices only, selected by the lane: an index that depends on the lane would put
/// the array in local memory.)
ULY_HOST_DEVICE constexpr void QuadSend(const uint32_t (&a)[4], int q, int step,
                                        uint32_t (&send)[2]) {
  if (step == 1) {  // the even lane sends its odd columns, the odd lane its even ones
    const bool even = (q & 1) == 0;
    send[0] = even ? a[1] : a[0];
    send[1] = even ? a[3] : a[2];
  } else {  // lanes 0, 1 send columns 2, 3; lanes 2, 3 columns 0, 1
    const bool low = (q & 2) == 0;
    send[0] = low ? a[2] : a[0];
    send[1] = low ? a[3] : a[1];
  }
}
ULY_HOST_DEVICE constexpr void QuadReceive(uint32_t (&a)[4], int q, int step,
                                           const uint32_t (&got)[2]) {
  if (step == 1) {  // into the places of what was sent
    const bool even = (q & 1) == 0;
    a[0] = even ? a[0] : got[0];
    a[1] = even ? got[0] : a[1];
    a[2] = even ? a[2] : got[1];
    a[3] = even ? got[1] : a[3];
  } else {
    const bool low = (q & 2) == 0;
    a[0] = low ? a[0] : got[0];
    a[1] = low ? a[1] : got[1];
    a[2] = low ? got[0] : a[2];
    a[3] = low ? got[1] : a[3];
  }
}

/// The head's sum of squares in the reference's order (HeadSumSquares: 16 partials of 8
/// elements, then halved by strides 8, 4, 2, 1) from quad lane q's partials p[g] of blocks
/// 4g + q: this lane's part of strides 8 and 4 here; strides 2 and 1 are the quad's xor
/// exchanges with lanes q ^ 2 and then q ^ 1, each adding its partner's value.
ULY_HOST_DEVICE constexpr float QuadPartialSum(const float (&p)[4]) {
  return (p[0] + p[2]) + (p[1] + p[3]);
}

/// One call: rows [0, B*S_l) of source rank `src` (shape.world ranks).
struct EpilogueCall {
  QkvNormRopeShape shape{};
  QkvLayout layout = QkvLayout::kUnspecified;
  int32_t src = 0;
  const void* x = nullptr;  ///< [B*S_l, hidden] bf16
  const int32_t* positions = nullptr;
  QkvWeights weights{};
  QkvDestinations dests{};  ///< dests.ready[dst][i]: chunk i's word (NumChunks per destination)
  int64_t chunk_rows = 0;   ///< rows per readiness chunk, a multiple of kEpilogueTileRows
  /// Device words, one per chunk, zero before the call and zero after it (the tiles of a
  /// chunk count themselves on it); required when dests.ready is set.
  unsigned int* chunk_counters = nullptr;
  /// Non-null: every tile also stores its raw bf16 projection here ([B*S_l, 3*H*D]).
  void* projection = nullptr;
  /// The mainloop alone: every tile's epilogue returns at once (nothing stored, no readiness
  /// words; positions, weights other than w_qkv and dests are not read). The benchmark's
  /// measure of this kernel's GEMM.
  bool gemm_alone = false;
  /// The projection alone: every tile stores its raw bf16 projection into `projection`
  /// (required) and nothing else (no norm, no RoPE, no destination stores, no readiness
  /// words; positions, weights other than w_qkv, dests and layout are not read). The
  /// per-operator and chunked paths' GEMM when a plan projects on this kernel.
  bool projection_only = false;
};

class EpilogueGemm {
 public:
  /// Why the kernel is not in this build, or empty when it is.
  static std::string Unavailable();

  /// The GEMM for `features` = 3*H*D outputs of `hidden` inputs (both multiples of 128) on the
  /// current device, which must be sm_90, with the mainloop schedule `schedule` (kAuto: the
  /// default, EpilogueSchedule::kPingpong). FAILED_PRECONDITION when not built or not Hopper.
  static absl::StatusOr<std::unique_ptr<EpilogueGemm>> Create(int64_t features, int64_t hidden,
                                                              EpilogueSchedule schedule);
  virtual ~EpilogueGemm() = default;

  /// Checks the call (INVALID_ARGUMENT naming the argument; nothing enqueued) and enqueues it
  /// on `stream`. Allocates nothing.
  virtual absl::Status Run(const EpilogueCall& call, cudaStream_t stream) = 0;

  /// The kernel's tile shape, cluster, schedule and stage count, for describe().
  virtual std::string Description() const = 0;
};

}  // namespace ulysses::kernels::internal
