// Bounded waits on 64-bit words in shared memory (readiness / epoch words).
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace ulysses::ipc {

// The words live in memory shared between processes: the atomic must be the bare 64-bit word,
// with no lock beside it.
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "std::atomic<uint64_t> must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t),
              "std::atomic<uint64_t> must have the size of uint64_t to live in shared memory");
static_assert(alignof(std::atomic<uint64_t>) == alignof(uint64_t),
              "std::atomic<uint64_t> must have the alignment of uint64_t");

/// How a wait on a word ended (WaitFor), and what it saw last.
struct WaitOutcome {
  enum End { kReached, kAborted, kDeadline };
  End end = kReached;
  uint64_t have = 0;        // the word's last value seen
  uint64_t abort_code = 0;  // the abort word's value, when kAborted
};

/// WaitAtLeast without its status: the same wait and the same order of checks, ending in a
/// plain outcome. It builds no message, so a caller that only needs to know how the wait ended
/// allocates nothing.
WaitOutcome WaitFor(const std::atomic<uint64_t>& word, uint64_t target, absl::Time deadline,
                    const std::atomic<uint64_t>* abort_word = nullptr);

/// Waits until `word` >= `target` (epochs only grow), bounded by `deadline`.
///
/// Loads are acquire loads, so whatever the writer published before its release store of the
/// word is visible once this returns OK. The wait spins briefly, then yields the CPU, then sleeps
/// with exponential backoff capped at about 100 us; it never blocks longer than that between
/// checks, so a writer needs no wake-up call.
///
/// Result, checked in this order on every iteration:
/// - OK when `word` >= `target` (a satisfied word wins over an abort or an elapsed deadline);
/// - ABORTED "<what>: aborted (code N)" as soon as `abort_word` (if not null) is non-zero, N
///   being its value;
/// - DEADLINE_EXCEEDED "<what>: timed out waiting for epoch T (have V)" once `deadline` passed
///   (absl::InfiniteFuture() waits forever; a past deadline checks once).
/// `what` names the wait in messages (e.g. "slot 3 ready"); "wait" when empty.
/// Thread-safe; any number of waiters may watch one word.
absl::Status WaitAtLeast(const std::atomic<uint64_t>& word, uint64_t target, absl::Time deadline,
                         const std::atomic<uint64_t>* abort_word = nullptr,
                         std::string_view what = "");

}  // namespace ulysses::ipc
