// Layout of a session segment: the control block (readiness words) followed by the receive
// slots. Shared by the daemons of a group (peers map each other's segments) and by the owning
// client (which maps it read-only). Trivially laid out: only 64-bit lock-free atomics.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "ulysses/common/geometry.h"

namespace ulysses {

inline constexpr uint64_t kSessionMagic = 0x554c595353455331ull;  // "ULYSSES1"
inline constexpr uint32_t kSessionLayoutVersion = 2;
inline constexpr uint64_t kSegmentAlign = 4096;

/// Words of one receive slot. Epochs are per-session call numbers (1, 2, ...); slot s serves
/// the epochs e with (e-1) % num_slots == s.
struct SlotWords {
  /// Written by the owning daemon: peers may write epoch `open` into this slot. Set when the
  /// owner's client issues that call, so a result stays intact until the client's call
  /// num_slots later.
  std::atomic<uint64_t> open;
  /// Written by the owning daemon when the result of epoch `done` is complete.
  std::atomic<uint64_t> done;
  /// Written by the owning daemon when its client gives back the result of epoch `released`:
  /// a ring client by a store into its client segment's release words, a client without
  /// rings by the Release RPC, or at once when the result was copied to `out`.
  std::atomic<uint64_t> released;
  /// Epoch of the last failed call on this slot (0: none).
  std::atomic<uint64_t> error;
  /// The call the owner issued for epoch `open`, written before `open`: (batch << 32 | seq_local)
  /// and (op << 48 | head_offset << 24 | head_count). Writers compare it with their own call,
  /// so ranks that issue different calls at one epoch fail instead of mixing data.
  std::atomic<uint64_t> call_shape;
  std::atomic<uint64_t> call_op;
  /// arrive[j] = e: source rank j finished writing its block of epoch e into this slot.
  std::atomic<uint64_t> arrive[kMaxWorldSize];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(SlotWords) == 8 * (6 + kMaxWorldSize));

/// Header of a session segment.
struct SessionControlBlock {
  uint64_t magic;
  uint32_t version;
  uint32_t world_size;
  uint32_t rank;
  uint32_t num_slots;
  uint64_t slot_bytes;
  uint64_t slot_stride_bytes;
  uint64_t slots_offset_bytes;
  /// Nonzero once the owner's session is gone or broken: every wait on this segment ends with
  /// ABORTED. Values: kAbortClosed, kAbortClientGone, kAbortCallFailed, kAbortPeerGone.
  std::atomic<uint64_t> abort;
  uint64_t reserved[2];
  SlotWords slots[kMaxSlots];
};
static_assert(offsetof(SessionControlBlock, abort) == 48);
static_assert(offsetof(SessionControlBlock, slots) == 72);

inline constexpr uint64_t kAbortClosed = 1;
inline constexpr uint64_t kAbortClientGone = 2;
inline constexpr uint64_t kAbortCallFailed = 3;
/// The daemon of another rank of the group died (its peer link hung up).
inline constexpr uint64_t kAbortPeerGone = 4;

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/// Byte layout of a session segment for `slot_bytes` per slot.
struct SegmentLayout {
  uint64_t slot_bytes = 0;
  uint64_t slot_stride_bytes = 0;
  uint64_t slots_offset_bytes = 0;
  uint64_t total_bytes = 0;
  static SegmentLayout For(uint64_t slot_bytes, int32_t num_slots) {
    SegmentLayout l;
    l.slot_bytes = slot_bytes;
    l.slot_stride_bytes = AlignUp(slot_bytes, kSegmentAlign);
    l.slots_offset_bytes = AlignUp(sizeof(SessionControlBlock), kSegmentAlign);
    l.total_bytes = l.slots_offset_bytes + l.slot_stride_bytes * static_cast<uint64_t>(num_slots);
    return l;
  }
};

}  // namespace ulysses
