// Lock-free single-producer single-consumer ring of fixed-size records in shared memory, with an
// eventfd doorbell so the consumer can sleep.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ulysses/common/status.h"
#include "ulysses/ipc/eventfd.h"

namespace ulysses::ipc {

// Positions are bare 64-bit words shared between processes: no lock may sit beside them.
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "std::atomic<uint64_t> must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t) &&
                  alignof(std::atomic<uint64_t>) == alignof(uint64_t),
              "std::atomic<uint64_t> must be laid out as uint64_t to live in shared memory");

/// Cache-line size the ring's fields are aligned to (producer and consumer words never share a
/// line, and neither shares one with the records).
inline constexpr size_t kRingLineBytes = 64;

namespace ring_internal {

/// DATA_LOSS: the ring's positions cannot come from an honest peer (`side` is "producer" or
/// "consumer", the side that noticed).
absl::Status CorruptPositions(const char* side, uint64_t head, uint64_t tail, uint64_t capacity);
/// INVALID_ARGUMENT naming `memory` (null or not 64-byte aligned) or `size` (< `need`), or OK.
absl::Status CheckRingMemory(const void* memory, size_t size, size_t need);
/// ABORTED "ring: aborted (code N)".
absl::Status Aborted(uint64_t code);
/// Milliseconds to pass to EventFd::Wait so that it returns by `deadline` (rounded up, so the
/// final wait ends at or after it), capped at kMaxDoorbellWaitMs. 0 when `deadline` has passed.
int DoorbellWaitMs(absl::Time deadline);
/// Longest single doorbell wait in PopWait: the ring and the abort word are re-checked at least
/// this often even when nobody rings (a producer that died between its push and its Signal, or an
/// abort set without a ring).
inline constexpr int kMaxDoorbellWaitMs = 100;

}  // namespace ring_internal

/// How long a waiter polls its ring before it sleeps on the doorbell. A call's hand-off is a
/// few microseconds of work on each side; a sleep on the eventfd and the wake-up cost about as
/// much again, so a waiter that is about to be served keeps polling for this long first.
inline constexpr absl::Duration kRingSpin = absl::Microseconds(50);

/// Calls `ready()` until it returns true or `spin` has passed, with a CPU pause between polls.
/// Returns the last result.
template <typename F>
bool SpinFor(absl::Duration spin, F&& ready) {
  const absl::Time end = absl::Now() + spin;
  for (;;) {
    if (ready()) return true;
    if (absl::Now() >= end) return false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

/// A single-producer single-consumer ring of `kCapacity` fixed-size records that lives in memory
/// shared by two processes (e.g. a memfd mapped by both): the client's submission ring (client
/// produces call descriptors, daemon consumes) and its completion ring (daemon produces, client
/// consumes).
///
/// Layout (fixed, checked by static_asserts): `head` at byte 0, `tail` at byte 64, `records` at
/// byte 128, each on its own cache line(s); sizeof is 128 + sizeof(records) rounded up to 64.
/// `head` and `tail` are 64-bit positions that only grow (record i of the stream lives at index
/// i & (kCapacity - 1)), so they never wrap in practice; the arithmetic is modulo 2^64 anyway.
/// Zero-filled memory (a fresh memfd) is a valid empty ring.
///
/// Roles and thread-safety: exactly one producer (TryPush; the only writer of `tail`) and one
/// consumer (TryPop; the only writer of `head`), in any two threads or processes. size() and
/// empty() may be called by either. There is no lock anywhere, so a peer that dies at any
/// instruction leaves a ring the survivor can keep using or discard.
///
/// Mistrust: each side checks the positions before touching a record. A peer that writes the
/// other side's position (all of the ring is writable by both mappings) makes the next TryPush or
/// TryPop return DATA_LOSS when the positions are impossible (tail - head > kCapacity, which
/// includes head > tail); indices are always masked, so no position can send either side outside
/// `records`. Record contents are the peer's: the consumer copies a record out before anyone
/// looks at it, and must validate the copy.
///
/// Doorbell protocol (PopWait implements the consumer half): the producer pushes, then rings the
/// consumer's EventFd (once per push, or once after a batch of pushes). The consumer drains with
/// TryPop until it returns false, then waits on the EventFd with a timeout and checks the ring
/// again whenever Wait returns, rung or timed out. No wake-up is lost: a ring made after the
/// consumer's last empty check leaves the eventfd counter non-zero, so its next Wait returns at
/// once; a ring made before it comes after a push the check already saw. A spurious wake-up only
/// costs an empty TryPop.
template <typename Record, uint32_t kCapacity>
struct SpscRing {
  static_assert(kCapacity > 0 && (kCapacity & (kCapacity - 1)) == 0,
                "kCapacity must be a power of two");
  static_assert(std::is_trivially_copyable_v<Record> && std::is_trivially_copy_assignable_v<Record>,
                "ring records are copied through shared memory and must be trivially copyable");
  static_assert(alignof(Record) <= kRingLineBytes, "records may be aligned to at most 64 bytes");

  /// The record type.
  using RecordType = Record;
  /// Index of stream position p: p & kMask.
  static constexpr uint64_t kMask = kCapacity - 1;

  /// Consumer position: records [head, tail) are queued. Written only by the consumer (release),
  /// read by the producer (acquire) to learn which slots are free again.
  alignas(kRingLineBytes) std::atomic<uint64_t> head;
  /// Producer position: the next record goes to records[tail & kMask]. Written only by the
  /// producer (release), read by the consumer (acquire) to learn which records are complete.
  alignas(kRingLineBytes) std::atomic<uint64_t> tail;
  /// records[p & kMask] holds stream record p for head <= p < tail.
  alignas(kRingLineBytes) Record records[kCapacity];

  /// Constructs an empty ring (head = tail = 0) at `memory`, which must be 64-byte aligned and
  /// hold at least sizeof(SpscRing) bytes (a page-aligned mapping is). For the side that creates
  /// the segment, before it is shared; the peer uses Attach(). Errors: INVALID_ARGUMENT naming
  /// `memory` or `size`.
  static absl::StatusOr<SpscRing*> Create(void* memory, size_t size) {
    ULY_RETURN_IF_ERROR(ring_internal::CheckRingMemory(memory, size, sizeof(SpscRing)));
    auto* ring = ::new (memory) SpscRing;
    ring->head.store(0, std::memory_order_relaxed);
    ring->tail.store(0, std::memory_order_relaxed);
    return ring;
  }

  /// The ring another party created at `memory` (or zero-filled memory), without changing it.
  /// Same requirements and errors as Create(). The positions are not trusted: TryPush/TryPop
  /// check them on every call.
  static absl::StatusOr<SpscRing*> Attach(void* memory, size_t size) {
    ULY_RETURN_IF_ERROR(ring_internal::CheckRingMemory(memory, size, sizeof(SpscRing)));
    return std::launder(static_cast<SpscRing*>(memory));
  }

  /// Producer only. Appends a copy of `record`: true when queued, false when the ring is full.
  /// DATA_LOSS when the positions are impossible (the consumer's head is past the tail or more
  /// than kCapacity behind it); nothing is written then.
  absl::StatusOr<bool> TryPush(const Record& record) {
    static_assert(LayoutIsFixed());
    // Only this side writes tail. Acquire on head pairs with the consumer's release store: its
    // copy out of a slot is complete before the slot is overwritten here.
    const uint64_t t = tail.load(std::memory_order_relaxed);
    const uint64_t h = head.load(std::memory_order_acquire);
    if (t - h > kCapacity) return ring_internal::CorruptPositions("producer", h, t, kCapacity);
    if (t - h == kCapacity) return false;
    // Assignment rather than memcpy: GCC's -fsanitize=thread does not see an inlined memcpy, and
    // the record copies are what the sanitizer must check against the positions' ordering.
    records[t & kMask] = record;
    // Release publishes the record together with the new tail.
    tail.store(t + 1, std::memory_order_release);
    return true;
  }

  /// Consumer only. Moves the oldest record into `*out`: true when one was taken, false when the
  /// ring is empty. DATA_LOSS when the positions are impossible (a corrupted or forged tail past
  /// head + kCapacity, or behind head); neither `*out` nor any record is read or written then.
  absl::StatusOr<bool> TryPop(Record* out) {
    static_assert(LayoutIsFixed());
    // Acquire on tail pairs with the producer's release store: the record is complete.
    const uint64_t h = head.load(std::memory_order_relaxed);
    const uint64_t t = tail.load(std::memory_order_acquire);
    if (t - h > kCapacity) return ring_internal::CorruptPositions("consumer", h, t, kCapacity);
    if (t == h) return false;
    *out = records[h & kMask];
    // Release: the copy above is done before the producer may reuse the slot.
    head.store(h + 1, std::memory_order_release);
    return true;
  }

  /// Records queued (tail - head), a snapshot. From the producer or the consumer it lies in
  /// [0, kCapacity] unless the positions are corrupted; from a third thread it is approximate.
  [[nodiscard]] uint64_t size() const noexcept {
    // head first: tail only grows, so an honest ring never reads as negative.
    const uint64_t h = head.load(std::memory_order_acquire);
    const uint64_t t = tail.load(std::memory_order_acquire);
    return t - h;
  }
  /// Whether size() == 0 (same caveats).
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  /// kCapacity.
  [[nodiscard]] static constexpr uint32_t capacity() noexcept { return kCapacity; }

 private:
  // Checked here rather than after the class because the class is complete only inside member
  // function bodies; every ring instantiates TryPush or TryPop.
  static constexpr bool LayoutIsFixed() {
    static_assert(std::is_standard_layout_v<SpscRing>, "SpscRing must be standard-layout");
    static_assert(offsetof(SpscRing, head) == 0);
    static_assert(offsetof(SpscRing, tail) == kRingLineBytes);
    static_assert(offsetof(SpscRing, records) == 2 * kRingLineBytes);
    static_assert(alignof(SpscRing) == kRingLineBytes);
    static_assert(sizeof(SpscRing) ==
                  2 * kRingLineBytes + (sizeof(Record) * kCapacity + kRingLineBytes - 1) /
                                           kRingLineBytes * kRingLineBytes);
    return true;
  }
};

/// Consumer side of the doorbell protocol: takes the oldest record of `ring` into `*out`,
/// sleeping on `bell` (the producer rings it after pushing) while the ring is empty.
///
/// Result, checked in this order on every round:
/// - ABORTED "ring: aborted (code N)" as soon as `abort` (if not null) is non-zero, N being its
///   value. An abort wins over queued records, so a producer that keeps the ring full cannot hold
///   it off. Whoever sets the word should ring `bell` afterwards to wake a sleeping consumer at
///   once; otherwise the abort is seen within kMaxDoorbellWaitMs.
/// - true with `*out` filled when a record was queued (a queued record wins over an elapsed
///   deadline; a past deadline checks once);
/// - false once `deadline` has passed (absl::InfiniteFuture(): never);
/// - DATA_LOSS from TryPop (corrupted positions), or the errno of the eventfd wait.
/// It first polls the ring for `spin` (at most until the deadline); between rounds after that
/// it waits on `bell` for at most kMaxDoorbellWaitMs, and re-checks the ring whether or not
/// the bell rang. Consumes the bell's pending rings. Call it from the consumer
/// only; `bell` must be the ring's doorbell (its rings are consumed here): an EventFd, or the
/// waiting end of a Doorbell.
template <typename Record, uint32_t kCapacity, typename Bell>
absl::StatusOr<bool> PopWait(SpscRing<Record, kCapacity>& ring, Record* out, Bell& bell,
                             absl::Time deadline, const std::atomic<uint64_t>* abort = nullptr,
                             absl::Duration spin = kRingSpin) {
  bool spun = false;
  for (;;) {
    if (abort != nullptr) {
      const uint64_t code = abort->load(std::memory_order_acquire);
      if (code != 0) return ring_internal::Aborted(code);
    }
    ULY_ASSIGN_OR_RETURN(const bool popped, ring.TryPop(out));
    if (popped) return true;
    if (!spun) {
      // Poll briefly before sleeping: a record that arrives within `spin` costs no wake-up.
      spun = true;
      absl::Status error;
      bool got = false;
      SpinFor(std::min(spin, std::max(absl::ZeroDuration(), deadline - absl::Now())), [&] {
        if (abort != nullptr && abort->load(std::memory_order_acquire) != 0) return true;
        absl::StatusOr<bool> p = ring.TryPop(out);
        if (!p.ok()) error = p.status();
        got = p.ok() && *p;
        return !p.ok() || got;
      });
      ULY_RETURN_IF_ERROR(error);
      if (got) return true;
      continue;  // re-check the abort word
    }
    const int wait_ms = ring_internal::DoorbellWaitMs(deadline);
    if (wait_ms == 0) return false;
    // Rung or timed out, the next round checks the abort word and the ring again.
    ULY_RETURN_IF_ERROR(bell.Wait(wait_ms).status());
  }
}

/// First and longest sleep of PushBackoff while the ring stays full.
inline constexpr absl::Duration kPushBackoffMin = absl::Microseconds(50);
inline constexpr absl::Duration kPushBackoffMax = absl::Milliseconds(20);

/// The sleep before try `attempt` (0-based) of PushBackoff: kPushBackoffMin doubled per
/// attempt, capped at kPushBackoffMax.
inline absl::Duration PushBackoffDelay(int attempt) {
  absl::Duration d = kPushBackoffMin;
  for (int i = 0; i < attempt && d < kPushBackoffMax; ++i) d *= 2;
  return std::min(d, kPushBackoffMax);
}

/// Producer side for a consumer that may stop reading (the daemon posting completions to a
/// client that does not drain them): pushes `record`, sleeping between tries while the ring
/// is full, for PushBackoffDelay(0), (1), ... So a ring kept full costs its producer about
/// 1 / kPushBackoffMax wake-ups a second instead of a spinning thread, and a consumer that
/// drains late waits at most kPushBackoffMax more for its record. The consumer rings no bell
/// when it frees space, so there is nothing to sleep on but time.
/// OK once pushed; ABORTED as soon as `abort` (if not null) is non-zero, checked before every
/// try; DATA_LOSS from TryPush. `waits`, if not null, counts the sleeps.
template <typename Record, uint32_t kCapacity>
absl::Status PushBackoff(SpscRing<Record, kCapacity>& ring, const Record& record,
                         const std::atomic<uint64_t>* abort = nullptr,
                         std::atomic<uint64_t>* waits = nullptr) {
  for (int attempt = 0;; ++attempt) {
    if (abort != nullptr) {
      const uint64_t code = abort->load(std::memory_order_acquire);
      if (code != 0) return ring_internal::Aborted(code);
    }
    ULY_ASSIGN_OR_RETURN(const bool pushed, ring.TryPush(record));
    if (pushed) return absl::OkStatus();
    if (waits != nullptr) waits->fetch_add(1, std::memory_order_relaxed);
    absl::SleepFor(PushBackoffDelay(attempt));
  }
}

}  // namespace ulysses::ipc
