#include "ulysses/ipc/wait.h"

#include <sched.h>
#include <time.h>

#include <string>

#include "ulysses/common/strings.h"

namespace ulysses::ipc {
namespace {

// Phases of the wait: a writer on another core usually publishes within a few microseconds, so
// spin first; then give the core away; then sleep, doubling up to kMaxSleepNs so a long wait
// costs little CPU while a late store is still seen within ~100 us.
constexpr int kSpinIterations = 2000;
constexpr int kYieldIterations = 64;
constexpr long kFirstSleepNs = 1'000;
constexpr long kMaxSleepNs = 100'000;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

WaitOutcome WaitFor(const std::atomic<uint64_t>& word, uint64_t target, absl::Time deadline,
                    const std::atomic<uint64_t>* abort_word) {
  long sleep_ns = kFirstSleepNs;
  for (int iteration = 0;; ++iteration) {
    // Acquire pairs with the writer's release store: data published before the word is visible.
    const uint64_t have = word.load(std::memory_order_acquire);
    if (have >= target) return {WaitOutcome::kReached, have, 0};
    if (abort_word != nullptr) {
      const uint64_t code = abort_word->load(std::memory_order_acquire);
      if (code != 0) return {WaitOutcome::kAborted, have, code};
    }
    // Reading the clock costs a vDSO call; during the spin phase look only every 64 rounds.
    if ((iteration >= kSpinIterations || iteration % 64 == 0) && absl::Now() >= deadline)
      return {WaitOutcome::kDeadline, have, 0};
    if (iteration < kSpinIterations) {
      CpuRelax();
    } else if (iteration < kSpinIterations + kYieldIterations) {
      sched_yield();
    } else {
      timespec ts{0, sleep_ns};
      nanosleep(&ts, nullptr);  // an early wake-up (EINTR) only shortens this round
      sleep_ns = sleep_ns * 2 > kMaxSleepNs ? kMaxSleepNs : sleep_ns * 2;
    }
  }
}

absl::Status WaitAtLeast(const std::atomic<uint64_t>& word, uint64_t target, absl::Time deadline,
                         const std::atomic<uint64_t>* abort_word, std::string_view what) {
  const std::string_view label = what.empty() ? std::string_view("wait") : what;
  const WaitOutcome w = WaitFor(word, target, deadline, abort_word);
  switch (w.end) {
    case WaitOutcome::kReached:
      return absl::OkStatus();
    case WaitOutcome::kAborted:
      return absl::AbortedError(ulysses::StrCat(label, ": aborted (code ", w.abort_code, ")"));
    case WaitOutcome::kDeadline:
      break;
  }
  return absl::DeadlineExceededError(
      ulysses::StrCat(label, ": timed out waiting for epoch ", target, " (have ", w.have, ")"));
}

}  // namespace ulysses::ipc
