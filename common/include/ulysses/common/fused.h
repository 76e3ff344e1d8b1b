// Geometry and validation of the fused session (QKV projection + QK-RMSNorm + RoPE + head
// exchange, DESIGN.md section 4), shared by the client and the daemon so that both reach the
// same verdict. Compiles as C++17 (the CUDA kernels include the layout enum).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/common/geometry.h"

namespace ulysses {

/// How a destination rank receives its head band of q, k, v.
enum class QkvLayout : int32_t {
  kUnspecified = 0,
  /// q, k, v each [B, S_g, H_l, D], stored one after the other in the receive slot: q at
  /// element 0, k at P, v at 2P, with P = B * S_g * H_l * D of the call.
  kBshd = 1,
  /// One [B, S_g, H_l, 3D] tensor: q in [0, D), k in [D, 2D), v in [2D, 3D) of each head.
  kFused = 2,
};

/// "bshd", "fused" or "unspecified".
std::string_view QkvLayoutName(QkvLayout layout);
/// Parses "bshd" or "fused".
absl::StatusOr<QkvLayout> ParseQkvLayout(std::string_view name);

/// Which GPU path runs a fused session's calls. Values match proto ulysses.v1.FusedPath.
enum class FusedPath : int32_t {
  kAuto = 0,         ///< picked per row count by the daemon's rule
  kPerOperator = 1,  ///< GEMM -> norm+RoPE in place -> stores into the destinations' slots
  kChunked = 2,      ///< GEMM by token block; each block's norm+RoPE+stores overlap the next GEMM
  kEpilogue = 3,     ///< one GEMM whose epilogue does the norm+RoPE and the stores (sm_90a)
};
/// "auto", "per_operator", "chunked" or "epilogue".
std::string_view FusedPathName(FusedPath path);
/// Parses "auto", "per_operator", "chunked" or "epilogue".
absl::StatusOr<FusedPath> ParseFusedPath(std::string_view name);

/// Which kernels run the session. The CUDA kernels are specialized for kFusedGpuHeadDim.
enum class FusedImpl : int32_t { kReference = 0, kCuda = 1 };

/// head_dim of the CUDA kernels.
inline constexpr int32_t kFusedGpuHeadDim = 128;
/// hidden must be a multiple of this (GEMM tiles and 16-byte vectors).
inline constexpr int32_t kFusedHiddenMultiple = 64;
/// Byte alignment of x, W_qkv, the norm weights and the cos/sin table (wide loads).
inline constexpr uint64_t kFusedAlignBytes = 32;
/// RMSNorm epsilon of the fused op.
inline constexpr float kFusedRmsEps = 1e-6f;

/// A fused session's geometry on one rank. Every rank of the group passes the same values
/// except `rank`.
struct FusedGeometry {
  int32_t world_size = 0;          ///< W
  int32_t rank = 0;                ///< this rank, in [0, W)
  int32_t hidden = 0;              ///< input features; must equal num_heads * head_dim
  int32_t num_heads = 0;           ///< H (global), divisible by W
  int32_t head_dim = 0;            ///< D, even (RoPE pairs); kFusedGpuHeadDim for the CUDA kernels
  DType dtype = DType::kBFloat16;  ///< operand type; only bfloat16
  QkvLayout layout = QkvLayout::kUnspecified;
  int64_t max_tokens = 0;  ///< bound on B * S_l of every call; sizes the receive slots once
  int32_t num_slots = 2;   ///< receive slots cycled by consecutive calls
  int32_t max_pos = 0;     ///< rows of the cos/sin table; positions lie in [0, max_pos)

  int32_t local_heads() const { return world_size > 0 ? num_heads / world_size : 0; }
  /// Output features of the projection: 3 * H * D.
  int64_t qkv_features() const { return int64_t{3} * num_heads * head_dim; }
  /// Elements of one receive slot: [max_tokens * W, H_l, 3D] = 3 * max_tokens * H * D (both
  /// layouts hold the same elements).
  int64_t SlotElems() const { return max_tokens * qkv_features(); }
  int64_t SlotBytes() const { return SlotElems() * ItemSize(dtype); }
};

/// The receive slots of a fused session as a head-exchange geometry sizes them: the same W,
/// rank, H, D, max_tokens and num_slots, dtype bfloat16, so that SlotElems() agree.
SessionGeometry SlotGeometry(const FusedGeometry& g);

/// Checks a fused geometry: W in [1, kMaxWorldSize], rank in range, H > 0 and H % W == 0
/// ("divisible"), D > 0 and even (kFusedGpuHeadDim for kCuda), hidden == H * D and a multiple
/// of kFusedHiddenMultiple, dtype bfloat16, layout set, max_tokens > 0, num_slots in
/// [1, kMaxSlots], max_pos > 0, and a receive slot within the int32 element limit.
/// INVALID_ARGUMENT names the argument.
absl::Status ValidateFusedGeometry(const FusedGeometry& g, FusedImpl impl);

/// A contiguous tensor as the caller declares it: element type, extents, and where it starts.
/// `offset_bytes` is the byte offset of element 0 in the registered buffer `buffer_id`
/// (registered buffers start page-aligned, so alignment is checked on the offset).
struct FusedTensorRef {
  uint64_t buffer_id = 0;  ///< 0 = absent
  uint64_t offset_bytes = 0;
  DType dtype = DType::kUnspecified;
  std::array<int64_t, 4> shape{};  ///< the first `rank` extents are used
  int32_t rank = 0;
};

/// The per-session weights, registered once.
struct FusedWeightsArgs {
  FusedTensorRef w_qkv;    ///< bfloat16 [3*H*D, hidden]: Q, K, V planes in order, head-major
  FusedTensorRef q_norm;   ///< bfloat16 [D]
  FusedTensorRef k_norm;   ///< bfloat16 [D]
  FusedTensorRef cos_sin;  ///< float32 [max_pos, D]: cos in [0, D/2), sin in [D/2, D)
};

/// Checks the weights against the geometry: presence, dtype, exact shape, kFusedAlignBytes
/// alignment and bounds inside their buffers. INVALID_ARGUMENT names the weight ("w_qkv",
/// "q_norm", "k_norm", "cos_sin"); buffer errors keep their code, prefixed with the name.
absl::Status ValidateFusedWeights(const FusedGeometry& g, const FusedWeightsArgs& w,
                                  const BufferResolver& buffers);

/// One call: x [B, S_l, hidden] bfloat16 and positions int32 [B, S_l], both contiguous.
struct FusedCallArgs {
  int64_t batch = 0;
  int64_t seq_local = 0;
  OperandRef x;          ///< strides must be zero (contiguous)
  OperandRef positions;  ///< strides must be zero (contiguous); int32 by definition
};

/// The verdict on a call and the geometry of its result.
struct FusedCallPlan {
  int64_t batch = 0;
  int64_t seq_local = 0;
  int64_t rows = 0;         ///< B * S_l: rows of this rank's projection
  int64_t global_seq = 0;   ///< S_g = W * S_l
  int64_t plane_elems = 0;  ///< P = B * S_g * H_l * D: elements of one of q, k, v
  int64_t out_elems = 0;    ///< 3P: elements of the receive slot the call fills
  /// Result shape: [B, S_g, H_l, D] per plane for bshd, [B, S_g, H_l, 3D] for fused.
  std::array<int64_t, 4> out_shape{};
};

/// Validates a call: batch and seq_local positive, B * S_l <= max_tokens (RESOURCE_EXHAUSTED
/// "capacity"), the exchanged payload within the int32 limit, x and positions present,
/// contiguous, aligned (x to kFusedAlignBytes, positions to 4) and inside their buffers.
/// Nothing is launched or written when this fails.
absl::StatusOr<FusedCallPlan> PlanFusedCall(const FusedGeometry& g, const FusedCallArgs& args,
                                            const BufferResolver& buffers);

/// A fused call as the shared call path (client rings, Call RPC, daemon) carries it: `args.op`
/// kQkvNormRopeExchange, `args.seq` = S_l, inputs {x, positions}, no head band, and an
/// optional `out`: contiguous, itemsize-aligned, the slot's 3P elements as they lie there (bshd:
/// q, k, v planes one after the other), overlapping neither input nor a weight (`weights`, when
/// given). PlanFusedCall's rules come first; positions are range-checked where the resolver
/// exposes their bytes (BufferInfo::host_data). The plan's inputs and out are contiguous views,
/// `out_shape` is FusedCallPlan::out_shape and `slot_elems` its out_elems.
absl::StatusOr<CallPlan> PlanQkvCall(const FusedGeometry& g, const CallArgs& args,
                                     const BufferResolver& buffers,
                                     const FusedWeightsArgs* weights = nullptr);

/// Checks host-visible positions: every one of the `count` values in [0, max_pos). The error
/// names the first bad one ("positions[i]").
absl::Status CheckFusedPositions(const FusedGeometry& g, const int32_t* positions, int64_t count);

}  // namespace ulysses
