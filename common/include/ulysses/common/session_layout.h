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
// 5: a GPU session's daemon words (DeviceWords) are an allocation of their own.
inline constexpr uint32_t kSessionLayoutVersion = 5;
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

/// Stream-ordered sessions: the call a rank issued at `epoch`, kept for the last
/// kSignatureRing epochs (entry epoch % kSignatureRing). The owner writes shape and op, then
/// the epoch (release); a peer checks its own call against it when the call completes (a rank
/// never runs more than num_slots epochs ahead of another, so the entry is still there).
struct CallSignature {
  std::atomic<uint64_t> epoch;
  std::atomic<uint64_t> call_shape;
  std::atomic<uint64_t> call_op;
};
inline constexpr int kSignatureRing = 4 * kMaxSlots;

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
  /// Nonzero once the owner's session is gone or broken. Values: kAbortClosed,
  /// kAbortClientGone, kAbortCallFailed. A wait on this rank for epoch e ends with ABORTED when
  /// `abort` is set and `completed` is below e (AbortEnds).
  std::atomic<uint64_t> abort;
  /// The last epoch whose call this rank completed; written by the owning daemon after every
  /// other word of that epoch (its `open`, its arrivals in the peers' slots, its `done`). A rank
  /// that completed epoch e owes nothing more for e, so its abort (or its daemon's exit) after
  /// that does not fail the peers' calls of e.
  std::atomic<uint64_t> completed;
  uint64_t reserved;
  SlotWords slots[kMaxSlots];
  CallSignature signatures[kSignatureRing];
};
static_assert(offsetof(SessionControlBlock, abort) == 48);
static_assert(offsetof(SessionControlBlock, completed) == 56);
static_assert(offsetof(SessionControlBlock, slots) == 72);

inline constexpr uint64_t kAbortClosed = 1;
inline constexpr uint64_t kAbortClientGone = 2;
inline constexpr uint64_t kAbortCallFailed = 3;

/// Whether the rank owning `cb` ends a wait for its words of epoch `epoch`: its session is gone
/// or broken (or, with `gone`, its daemon is) before it completed that epoch. Read after the
/// word waited for, so that a rank that wrote its words and then left is never mistaken for one
/// that left without them.
inline bool AbortEnds(const SessionControlBlock& cb, uint64_t epoch, bool gone = false) {
  if (!gone && cb.abort.load(std::memory_order_acquire) == 0) return false;
  return cb.completed.load(std::memory_order_acquire) < epoch;
}

/// GPU backends: the stream-ordered words of one receive slot that the daemons alone use, in
/// an allocation of each rank's daemon that peer daemons map and no client ever receives (so
/// no client can forge a word another rank relies on: a forged grant would let its daemon
/// store into a peer's slot that still holds a result). The daemons' streams write and wait
/// on them with 64-bit stream memory operations (wait: cyclic "value - epoch >= 0").
/// docs/protocol.md section 9 is the protocol.
struct DeviceSlotWords {
  /// grant[d] = e: rank d opened its slot for epoch e, so this rank may store its block of e
  /// there. Written by rank d's stream into this rank's words.
  uint64_t grant[kMaxWorldSize];
  /// arrive[j] = e: source rank j's block of epoch e is complete in this rank's slot. Written by
  /// rank j's stream after its stores (the write's memory barrier orders them first).
  uint64_t arrive[kMaxWorldSize];
};
static_assert(sizeof(DeviceSlotWords) == 8 * 2 * kMaxWorldSize);

struct DeviceWords {
  /// Nonzero once this rank's session was cancelled (a failed call, a timeout, close): the
  /// exchange kernels read it first and store nothing, so waits passed by a cancel never write
  /// into a slot its owner did not open.
  uint64_t cancel;
  uint64_t reserved[15];
  DeviceSlotWords slots[kMaxSlots];
};
static_assert(offsetof(DeviceWords, slots) == 128);

/// The words the owning client's stream waits on, at the start of the rank's slot allocation
/// (which the client maps to read its results; what it could write there is its own): done[s]
/// = e once the result of epoch e is complete in slot s, written by the daemon's stream (or,
/// after a cancel, kUnblockEpoch: the call failed and the error travels on the host).
struct ResultWords {
  uint64_t done[kMaxSlots];
};

/// The words the owning client writes, in a device allocation of its own (so a client can
/// write nothing its daemon or the peers rely on): ready[s] = e once the client's stream has
/// produced the inputs of its call of epoch e; released[s] = e once its stream has finished
/// reading the result of epoch e in slot s (the daemon's stream waits for it before the slot's
/// next call stores into the slot).
struct ClientDeviceWords {
  uint64_t ready[kMaxSlots];
  uint64_t released[kMaxSlots];
};

/// What a cancel writes into every word its stream may wait on: any epoch of a session is
/// below it, so each wait passes at once.
inline constexpr uint64_t kUnblockEpoch = uint64_t{1} << 62;

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
