// What one ring worker is doing, for the stall watchdog (timeouts.worker_stall_ms).
//
// A ring worker's steps call into the backend. Every wait of theirs is bounded by the call
// timeout, but on a GPU backend a step also calls into the CUDA driver, which can wait for the
// device without bound (a kernel module loaded lazily behind a blocked stream, work queued
// behind a stream that waits for its peer). Such a worker is silent: it neither serves its
// client nor times its calls out. So the worker marks each step, and the fd thread, about once
// a second, reports a step that has outlasted the call timeout by the threshold, once per
// step; the worker says so again when the step returns.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>

#include "absl/time/time.h"

namespace ulysses::daemon {

class WorkerWatch {
 public:
  /// A step that ran past the threshold.
  struct Stall {
    const char* what = nullptr;
    uint64_t session_id = 0;
    absl::Duration running;
  };

  void Begin(const char* what, uint64_t session_id, absl::Time now) {
    std::lock_guard<std::mutex> lock(mu_);
    what_ = what;
    session_id_ = session_id;
    since_ = now;
    reported_ = false;
  }
  /// Ends the step. Returns how long it ran when it had been reported as stalled.
  std::optional<absl::Duration> End(absl::Time now) {
    std::lock_guard<std::mutex> lock(mu_);
    what_ = nullptr;
    if (!reported_) return std::nullopt;
    reported_ = false;
    return now - since_;
  }
  /// The running step when it has lasted longer than `limit` and was not reported yet (it is
  /// then marked reported). A limit of zero or less watches nothing.
  std::optional<Stall> Check(absl::Time now, absl::Duration limit) {
    std::lock_guard<std::mutex> lock(mu_);
    if (limit <= absl::ZeroDuration() || what_ == nullptr || reported_ || now - since_ <= limit)
      return std::nullopt;
    reported_ = true;
    return Stall{what_, session_id_, now - since_};
  }
 private:
  mutable std::mutex mu_;
  const char* what_ = nullptr;  // null: between steps (waiting on its ring)
  uint64_t session_id_ = 0;
  absl::Time since_;
  bool reported_ = false;
};

}  // namespace ulysses::daemon
