// Building blocks of ulysses-demo and of the integration tests: starting real daemons as
// processes, and one rank's workload (a layer's exchanges, verified against the reference).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/geometry.h"

namespace ulysses::demo {

/// A ulyssesd child process. Stopped (SIGTERM, then SIGKILL after a grace period) on
/// destruction.
class DaemonProcess {
 public:
  DaemonProcess() = default;
  DaemonProcess(pid_t pid, std::string socket) : pid_(pid), socket_(std::move(socket)) {}
  ~DaemonProcess();
  DaemonProcess(DaemonProcess&& o) noexcept : pid_(o.pid_), socket_(std::move(o.socket_)) { o.pid_ = -1; }
  DaemonProcess& operator=(DaemonProcess&& o) noexcept;
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  /// SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit status as waitpid reports it.
  absl::StatusOr<int> Stop(absl::Duration grace = absl::Seconds(10));
  /// SIGKILL and reap.
  void Kill();
  /// Waits up to `timeout` for the daemon to exit on its own (sends nothing) and reaps it:
  /// the exit status as waitpid reports it, or DEADLINE_EXCEEDED while it still runs.
  absl::StatusOr<int> WaitExit(absl::Duration timeout);
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }

 private:
  pid_t pid_ = -1;
  std::string socket_;
};

/// Starts `ulyssesd --device N --socket DIR/gpuN.sock --backend B --ready-file ...` and waits
/// for its ready file (bounded by `timeout`). `env` ("NAME=value") is added to the daemon's
/// environment only. The daemon gets SIGTERM when the thread that started it ends
/// (PR_SET_PDEATHSIG), so a launcher killed by a timeout leaves no daemon behind: start it
/// from a thread that lives as long as the daemon should (the main thread).
absl::StatusOr<DaemonProcess> StartDaemon(const std::string& ulyssesd, const std::string& dir,
                                          int device, const std::string& backend,
                                          const std::vector<std::string>& extra_args = {},
                                          absl::Duration timeout = absl::Seconds(30),
                                          const std::vector<std::string>& env = {});

/// Finds a sibling program (same folder as the running executable), else `name` on PATH.
std::string SiblingProgram(const std::string& name);

/// A fresh private directory for sockets (short path: unix socket paths are limited).
absl::StatusOr<std::string> MakeRunDir();
/// Removes a directory made by MakeRunDir and what is inside.
void RemoveRunDir(const std::string& dir);

/// Deterministic, finite element bits for (rank, tensor, flat index): same on every rank, so
/// any rank can compute any other rank's inputs.
uint32_t PatternBits(int rank, int tensor, uint64_t index, int itemsize);

/// One rank's part of the demo: a layer's exchanges on its daemon.
struct Workload {
  std::string socket;               ///< this rank's daemon
  std::vector<std::string> members; ///< every rank's daemon, index = rank
  std::string group = "demo";
  std::string backend = "auto";
  int32_t world_size = 1;
  int32_t rank = 0;
  int64_t batch = 1;
  int64_t seq_local = 64;
  int32_t num_heads = 16;
  int32_t head_dim = 64;
  DType dtype = DType::kBFloat16;
  std::vector<int32_t> schedule;    ///< empty: (l, H_l-2l, l) as FlashInfer's benchmark picks
  int32_t iterations = 3;           ///< layers to run
  double hold_seconds = 0;          ///< keep the session open this long after the last layer
};

/// What one rank found.
struct RankReport {
  int32_t rank = 0;
  bool ok = false;
  std::string error;
  int64_t checks = 0;     ///< verified elements
  int64_t calls = 0;
  double p50_us = 0;      ///< median wall time of a call
  double max_us = 0;
  std::string backend;
  std::string mps;  ///< the daemon's MPS mode
  nlohmann::json ToJson() const;
};

/// Runs the workload: scatter_heads -> identity attention -> gather_heads, then the head-chunk
/// path (scatter_qkv_head_chunk per band -> identity attention -> gather_output_head_chunk into
/// a NaN-filled output), `iterations` times, verifying every result bit for bit.
RankReport RunRank(const Workload& w);

/// The default head-chunk schedule for H_l local heads.
std::vector<int32_t> DefaultSchedule(int32_t local_heads);

}  // namespace ulysses::demo
