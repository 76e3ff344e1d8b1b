// Geometry of sessions and calls, shared by the client and the daemon so that both reach the
// same verdict on every input (DESIGN.md section 4).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses {

/// Largest element count or offset a 32-bit kernel index may address (2^31 - 1).
inline constexpr int64_t kInt32Max = 2147483647;
/// Most ranks a group may have.
inline constexpr int32_t kMaxWorldSize = 64;
/// Most receive slots a session may have.
inline constexpr int32_t kMaxSlots = 8;

/// Element type of a session's operands. Values match proto ulysses.v1.DType.
enum class DType : int32_t { kUnspecified = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3 };

/// Bytes per element; 0 for kUnspecified.
int32_t ItemSize(DType dtype);
/// "float16", "bfloat16", "float32" or "unspecified".
std::string_view DTypeName(DType dtype);
/// Parses "float16"/"fp16"/"half", "bfloat16"/"bf16", "float32"/"fp32"/"float".
absl::StatusOr<DType> ParseDType(std::string_view name);

/// The operations of a head-exchange session. Values match proto ulysses.v1.OpKind.
enum class OpKind : int32_t {
  kUnspecified = 0,
  kScatterHeads = 1,           ///< x[B,S_l,H,D] -> out[B,S_g,H_l,D]
  kGatherHeads = 2,            ///< y[B,S_g,H_l,D] -> out[B,S_l,H,D]
  kScatterQkvHeadChunk = 3,    ///< q,k,v[B,S_l,H,D] -> out[B,S_g,HC,3D]
  kGatherOutputHeadChunk = 4,  ///< x[B,S_g,HC,D] -> band of out[B,S_l,H,D] (out required)
  /// x[B,S_l,hidden], positions[B,S_l] -> q,k,v head band over S_g (fused session only)
  kQkvNormRopeExchange = 5,
};
/// OpKind values, kUnspecified included (sizes per-op tables such as the metrics).
inline constexpr int32_t kNumOpKinds = 6;

/// What an op is, described once for the client, validation and every backend. With H heads
/// of D, W ranks, H_l = H/W local heads, and HC the band of a head-chunk op (H_l otherwise):
/// - input:  [B, S_g, HC, D] when `input_global` (the gather side), else [B, S_l, H, D];
/// - result: [B, S_l, H, D] when `input_global`, else [B, S_g, HC, width * D];
/// - the receive slot holds the result, or for `merges_into_out` the input-shaped blocks that
///   the merge then writes into the caller's out.
struct OpTraits {
  OpKind op = OpKind::kUnspecified;
  std::string_view name = "unspecified";
  std::array<std::string_view, 3> inputs{};  ///< the operands' names, in order
  int num_inputs = 0;
  bool head_chunk = false;       ///< takes head_offset and head_count (a band of local heads)
  bool input_global = false;     ///< the input spans S_g (seq is S_g and divides by W)
  int width = 1;                 ///< the result's last axis in units of D
  bool merges_into_out = false;  ///< writes a band of a caller's out (which is then required)
  bool fused = false;            ///< the op of a qkv_norm_rope_exchange session alone
};
/// The traits of `op`; an op that is none of the five gets the kUnspecified entry.
const OpTraits& Traits(OpKind op);
/// Whether `op` is one of the head-exchange session's four ops.
bool IsHeadExchangeOp(OpKind op);
std::string_view OpName(OpKind op);

/// What a session runs. Values match proto ulysses.v1.SessionKind (whose UNSPECIFIED means
/// head exchange).
enum class SessionKind : int32_t {
  kHeadExchange = 1,         ///< the four exchange ops over a SessionGeometry
  kQkvNormRopeExchange = 2,  ///< the fused QKV op over a FusedGeometry (common/fused.h)
};
/// "head_exchange" or "qkv_norm_rope_exchange".
std::string_view SessionKindName(SessionKind kind);

/// A session's geometry on one rank. Every rank of the group passes the same values except
/// `rank`.
struct SessionGeometry {
  int32_t world_size = 0;       ///< W
  int32_t rank = 0;             ///< this rank, in [0, W)
  int32_t num_heads = 0;        ///< H (global)
  int32_t head_dim = 0;         ///< D
  DType dtype = DType::kUnspecified;
  int64_t max_tokens = 0;       ///< bound on B*S_l of every call
  int32_t num_slots = 2;        ///< receive slots cycled by consecutive calls
  std::vector<int32_t> schedule;  ///< optional head-chunk schedule; sums to H/W

  int32_t local_heads() const { return world_size > 0 ? num_heads / world_size : 0; }
  int32_t itemsize() const { return ItemSize(dtype); }
  /// Elements of one receive slot: the largest output of any op at max_tokens
  /// (scatter_qkv_head_chunk's [B,S_g,H_l,3D] with the whole band).
  int64_t SlotElems() const;
  int64_t SlotBytes() const { return SlotElems() * itemsize(); }
  /// Offsets (head_offset) of each band of the schedule: prefix sums.
  std::vector<int32_t> ScheduleOffsets() const;
};

/// Checks a session geometry: W in [1, kMaxWorldSize], rank in range, H % W == 0 ("divisible"),
/// D > 0, dtype set, max_tokens > 0, num_slots in [1, kMaxSlots], the schedule's counts positive
/// and summing to H/W, and the slot within int32 element limits. INVALID_ARGUMENT names the
/// argument.
absl::Status ValidateSessionGeometry(const SessionGeometry& g);

/// A 4-D strided view into a registered buffer, in elements of the session dtype.
struct OperandRef {
  uint64_t buffer_id = 0;      ///< 0 = absent
  uint64_t offset_bytes = 0;   ///< byte offset of element [0,0,0,0] in the buffer
  std::array<int64_t, 4> strides{};  ///< element strides; all zero = contiguous
  bool present() const { return buffer_id != 0; }
};

/// One call as a client describes it. `seq` is the sequence extent of the *input*: S_l for the
/// scatter ops, S_g for the gather ops.
struct CallArgs {
  OpKind op = OpKind::kUnspecified;
  int64_t batch = 0;
  int64_t seq = 0;
  int32_t head_offset = 0;  ///< head-chunk ops: first local head of the band
  int32_t head_count = 0;   ///< head-chunk ops: heads in the band (HC)
  std::array<OperandRef, 3> inputs{};  ///< x | y | q,k,v | x
  OperandRef out;           ///< optional for ops 1-3 (copy out of the slot), required for op 4
};

/// Size and owner of a buffer as the validator sees it.
struct BufferInfo {
  uint64_t size_bytes = 0;
  /// The buffer's bytes where the validator's process can read them (host memory), else null.
  /// Lets validation check values, not only bounds (the fused op's positions).
  const void* host_data = nullptr;
};

/// Resolves buffer ids for validation. The client resolves its own buffers; the daemon the
/// calling client's buffers (and answers PERMISSION_DENIED for another client's).
class BufferResolver {
 public:
  virtual ~BufferResolver() = default;
  virtual absl::StatusOr<BufferInfo> Resolve(uint64_t buffer_id) const = 0;
};

/// A validated operand: shape, strides (resolved), and the byte range it touches.
struct ResolvedOperand {
  uint64_t buffer_id = 0;
  uint64_t offset_bytes = 0;
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> strides{};
  uint64_t span_bytes = 0;  ///< bytes from offset_bytes to one past the last element
};

/// The verdict on a call: every operand resolved and the output geometry.
struct CallPlan {
  OpKind op = OpKind::kUnspecified;
  int64_t batch = 0;
  int64_t seq_local = 0;
  int32_t head_offset = 0;
  int32_t head_count = 0;
  int num_inputs = 0;
  std::array<ResolvedOperand, 3> inputs{};
  bool has_out = false;
  ResolvedOperand out;
  std::array<int64_t, 4> out_shape{};  ///< shape of the result in the receive slot
  int64_t slot_elems = 0;              ///< elements the call writes into the receive slot
};

/// Validates a call against its session and the caller's buffers; same verdict on every rank
/// and on both sides of the socket. Nothing is launched or written when this fails.
absl::StatusOr<CallPlan> PlanCall(const SessionGeometry& g, const CallArgs& args,
                                  const BufferResolver& buffers);

/// Names of the input operands of `op` ("x"; "y"; "q","k","v"; "x").
std::vector<std::string_view> InputNames(OpKind op);

}  // namespace ulysses
