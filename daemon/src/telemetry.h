// What the daemon counts and remembers about its calls: the metrics (Prometheus text) and the
// flight recorder (the last N calls). Both are cheap enough for every call: atomics for the
// counters, one short mutex-protected ring write per call.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "transport.h"
#include "ulysses/common/geometry.h"

namespace ulysses::daemon {

/// One call as the flight recorder keeps it.
struct CallRecord {
  uint64_t client_id = 0;
  uint64_t session_id = 0;
  uint64_t epoch = 0;
  OpKind op = OpKind::kUnspecified;
  int64_t batch = 0;
  int64_t seq = 0;
  absl::Time queued;
  absl::Time started;
  absl::Time enqueued;  ///< stream-ordered: on the daemon's stream (else unset)
  absl::Time done;
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message;
  uint64_t bytes_sent = 0;
};

/// Ring of the most recent calls. Thread-safe.
class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity) : ring_(capacity) {}
  void Add(CallRecord record);
  /// Newest first, at most `limit` (0: all).
  std::vector<CallRecord> Recent(size_t limit) const;
  size_t capacity() const { return ring_.size(); }

 private:
  mutable std::mutex mu_;
  std::vector<CallRecord> ring_;
  size_t next_ = 0;
  size_t count_ = 0;
};

/// Gauges sampled when the metrics are rendered.
struct GaugeSnapshot {
  int64_t clients = 0;
  int64_t sessions = 0;
  int64_t active_calls = 0;
  bool draining = false;
  bool mps = false;
  double uptime_s = 0;
  std::array<int64_t, 3> slots_by_state{};  // free, writing, held
  uint64_t device_bytes = 0;        // device memory the daemon holds (GPU backends)
  uint64_t device_allocations = 0;  // device allocations made or opened since start
  uint64_t call_path_host_allocations = 0;  // operator new on the ring workers' call path
  uint64_t grpc_call_host_allocations = 0;  // operator new in the Control.Call handlers
  uint64_t device_streams = 0;      // distinct streams handed to sessions since start (GPU)
  int32_t hardware_queues = 0;      // probed queues that serve sessions (0: not probed)
  int32_t hardware_queues_in_use = 0;
  uint64_t queue_shared_streams = 0;  // streams made past the probed queues (may share one)
  uint64_t queue_refusals = 0;        // takes refused past them (queues.sharing refuse)
  uint64_t sessions_undrained = 0;  // sessions whose device work did not end when they went
  uint64_t worker_stalls = 0;       // ring-worker steps past timeouts.worker_stall_ms
  /// The process's descriptors and mappings and their bounds (-1: unreadable), and the
  /// requests refused for want of headroom in either (headroom.h).
  int64_t open_fds = -1, max_fds = -1, mappings = -1, max_mappings = -1;
  uint64_t headroom_refusals = 0;
  uint64_t log_lines_dropped = 0;  // warnings kept from the log by a LogBudget
  /// Each configured limit (config object `limits`) and how many requests it refused.
  struct LimitGauge {
    std::string name;
    uint64_t value = 0;
    uint64_t refusals = 0;
  };
  std::vector<LimitGauge> limits;
  /// What each uid with a bound client, a buffer, a session or a connection holds.
  struct UidGauge {
    uint32_t uid = 0;
    int64_t clients = 0;
    uint64_t buffer_bytes = 0;
    int32_t buffers = 0;
    int32_t sessions = 0;  ///< open or being created
    int32_t connections = 0;  ///< to the control socket
    int32_t pending_fds = 0;  ///< sent and not claimed
    uint64_t slot_bytes = 0;  ///< receive-slot memory of its sessions (slots.uid_share_percent)
    int32_t unbound = 0;  ///< attached on its connections, fd socket not bound yet
  };
  std::vector<UidGauge> uids;
};

/// Counters of the daemon's calls. Thread-safe, lock-free on the call path.
class Metrics {
 public:
  /// Upper bounds (seconds) of the call-duration histogram buckets.
  static constexpr std::array<double, 14> kBuckets = {
      25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 1.0, 10.0};

  void RecordCall(OpKind op, absl::StatusCode code, absl::Duration elapsed, uint64_t bytes_sent);
  /// Prometheus text exposition format 0.0.4.
  /// `identity` labels ulyssesd_info (UUID, pci_bus_id, numa_node; empty when unknown).
  std::string Render(const std::string& version, int device, const std::string& backend,
                     const DeviceIdentity& identity, const GaugeSnapshot& g) const;
  uint64_t calls_total() const;
  uint64_t calls_failed() const;

 private:
  std::array<std::atomic<uint64_t>, kNumOpKinds> calls_by_op_{};
  std::array<std::atomic<uint64_t>, 17> errors_by_code_{};
  std::atomic<uint64_t> bytes_sent_{0};
  std::array<std::atomic<uint64_t>, kBuckets.size() + 1> buckets_{};  // last: +Inf
  std::atomic<uint64_t> duration_ns_sum_{0};
};

}  // namespace ulysses::daemon
