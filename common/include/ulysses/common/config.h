// The daemon's configuration: one JSON file per node, overridden by command-line flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses {

/// One GPU (or simulated GPU) of the node and the socket its daemon serves.
struct DeviceEntry {
  int32_t index = 0;
  std::string socket;  ///< control socket path; the fd socket is `socket + ".fd"`
};

/// Everything a daemon needs to run. Defaults are usable as is.
struct DaemonConfig {
  int32_t device = 0;                 ///< device index this daemon serves
  std::string socket;                 ///< control socket path (default /run/ulysses/gpu<N>.sock)
  std::string backend = "auto";       ///< host | nccl | nvlink | auto
  std::string log_level = "info";
  int64_t call_timeout_ms = 30000;    ///< bound on every wait inside a call (peers, slots)
  int64_t peer_timeout_ms = 30000;    ///< bound on group/session rendezvous
  int64_t drain_timeout_ms = 30000;   ///< SIGTERM: how long running calls may take to finish
  int32_t flight_recorder_size = 1024;  ///< calls the flight recorder keeps
  uint64_t slot_memory_budget_bytes = 8ull << 30;  ///< receive-slot memory this daemon may hold
  std::string ready_file;             ///< written once the daemon serves (empty: none)
  std::string metrics_address;        ///< host:port of the metrics endpoint (empty: off)
  std::vector<DeviceEntry> devices;   ///< the node's daemons, for node-local rendezvous
};

/// Default control socket path of device `index`.
std::string DefaultSocketPath(int32_t index);

/// Parses a node config (JSON text) for device `device`. Unknown keys and wrong types are
/// INVALID_ARGUMENT naming the key (e.g. "timeouts.call_ms: expected an integer").
absl::StatusOr<DaemonConfig> ParseDaemonConfig(const std::string& json_text, int32_t device);

/// Reads and parses `path`; NOT_FOUND when it cannot be read.
absl::StatusOr<DaemonConfig> LoadDaemonConfig(const std::string& path, int32_t device);

/// Checks the values of a config (after flags are applied): backend name, positive timeouts,
/// socket path length. INVALID_ARGUMENT names the key.
absl::Status ValidateDaemonConfig(const DaemonConfig& config);

}  // namespace ulysses
