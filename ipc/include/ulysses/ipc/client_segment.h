// The per-client shared segment: the call fast path between one client and its daemon.
//
//   [ ClientSegmentHeader | submit ring: CallDescriptor x kRingCapacity |
//     completion ring: Completion x kRingCapacity ]
//
// The daemon creates it (a memfd) when the client's fd socket is bound and passes it with the
// client's ends of two doorbells (ipc::Doorbell): the submit doorbell (client rings after
// pushing a descriptor) and the completion doorbell (daemon rings after posting a completion). Writers: the client writes only the
// submit ring's records and tail and the completion ring's head; the daemon writes everything
// else, plus its release words. No lock lives here, so a dead client cannot leave anything
// locked.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "absl/status/statusor.h"
#include "ulysses/common/geometry.h"
#include "ulysses/ipc/ring.h"

namespace ulysses::ipc {

inline constexpr uint64_t kClientSegmentMagic = 0x554c5953434c4931ull;  // "ULYSCLI1"
// 4: a GPU session's done words lead its slot mapping (ResultWords), apart from the daemons'.
// 5: the doorbells that come with it are socket pairs (Doorbell), not eventfds.
inline constexpr uint32_t kClientSegmentVersion = 5;
inline constexpr uint32_t kRingCapacity = 64;
/// Sessions per client that can release slots through the segment (more use the RPC).
inline constexpr uint32_t kMaxReleaseSessions = 64;
/// Slots per session (matches kMaxSlots of the session geometry).
inline constexpr uint32_t kMaxReleaseSlots = 8;

/// One operand of a call: a strided view into one of the client's buffers (0 = absent).
struct OperandDescriptor {
  uint64_t buffer_id;
  uint64_t offset_bytes;
  int64_t strides[4];  ///< elements; all zero = contiguous
};
static_assert(sizeof(OperandDescriptor) == 48);

/// A call as the client submits it. The daemon re-validates every field.
/// CallDescriptor::flags: the client's stream writes the call's ready word once its inputs are
/// produced (GPU sessions; the daemon's stream waits for it). Without it the client ordered
/// its inputs on the host before submitting.
inline constexpr uint16_t kDescriptorStreamOrdered = 1;
/// With kDescriptorStreamOrdered: the result the call's slot held before (epoch - num_slots)
/// was given back by a release word written on this call's stream before its ready word, so
/// the ready word implies the release and the daemon's stream does not wait for the release
/// word. A client that claims it falsely can only overwrite its own view of that slot.
inline constexpr uint16_t kDescriptorReleasedInOrder = 2;

struct CallDescriptor {
  uint64_t session_id;
  uint64_t epoch;      ///< the session's next epoch as the client counts it (1, 2, ...)
  uint32_t op;         ///< OpKind
  int32_t head_offset;
  int32_t head_count;
  uint16_t num_inputs;
  uint16_t flags;      ///< kDescriptor* bits
  int64_t batch;
  int64_t seq;         ///< S_l for the scatter ops, S_g for the gather ops
  OperandDescriptor inputs[3];
  OperandDescriptor out;  ///< buffer_id 0: no out
};
static_assert(std::is_trivially_copyable_v<CallDescriptor>);
static_assert(sizeof(CallDescriptor) == 240);
static_assert(offsetof(CallDescriptor, inputs) == 48);

/// The call a descriptor copied out of the submit ring asks for. Its bytes are the client's, so
/// only what the conversion itself needs is checked here, INVALID_ARGUMENT naming the field:
/// `epoch` >= 1 (epochs count from 1; 0 never names a call), `op` a known OpKind, `num_inputs`
/// at most 3. Inputs past `num_inputs` are ignored. Everything else (shapes, buffers, bounds) is
/// PlanCall's, which the daemon runs next. Thread-safe.
absl::StatusOr<CallArgs> CallArgsFromDescriptor(const CallDescriptor& d);

/// The daemon's answer to one descriptor.
struct Completion {
  uint64_t session_id;
  uint64_t epoch;
  int32_t code;        ///< absl::StatusCode; 0 = OK
  int32_t slot;
  uint64_t slot_offset_bytes;
  uint64_t result_bytes;
  int64_t elapsed_us;
  int64_t out_shape[4];
  uint64_t next_epoch; ///< the epoch the session expects next (a refused call consumes none)
  char message[168];   ///< NUL-terminated error message (truncated)
};
static_assert(std::is_trivially_copyable_v<Completion>);
static_assert(sizeof(Completion) == 256);

struct ClientSegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t ring_capacity;
  uint64_t client_id;
  /// Nonzero once the daemon has dropped this client; waits on the segment end.
  std::atomic<uint64_t> abort;
  uint64_t reserved[3];
  /// released[i][s] = e: the client gave back the result of epoch e in slot s of the session
  /// whose release index is i (SessionInfo.release_index). Written only by the client, with
  /// release order, epochs only growing; the daemon reads it before it reuses a held slot.
  alignas(64) std::atomic<uint64_t> released[kMaxReleaseSessions][kMaxReleaseSlots];
};
static_assert(offsetof(ClientSegmentHeader, released) == 64);

using SubmitRing = SpscRing<CallDescriptor, kRingCapacity>;
using CompletionRing = SpscRing<Completion, kRingCapacity>;

/// Byte offsets of the parts of a client segment.
struct ClientSegmentLayout {
  static constexpr size_t kHeader = 0;
  static constexpr size_t kSubmit = ((sizeof(ClientSegmentHeader) + 63) / 64) * 64;
  static constexpr size_t kComplete = kSubmit + ((sizeof(SubmitRing) + 63) / 64) * 64;
  static constexpr size_t kTotal = kComplete + ((sizeof(CompletionRing) + 63) / 64) * 64;
};
static_assert(sizeof(ClientSegmentHeader) <= ClientSegmentLayout::kSubmit);

}  // namespace ulysses::ipc
