// ulyssesd's command-line flags that override the node config: one definition for the
// program (main.cc) and the config fuzz target (fuzz/).
#pragma once

#include <cstdint>
#include <string>

#include "CLI/CLI.hpp"
#include "ulysses/common/config.h"

namespace ulysses::daemon {

/// The values of the flags; each applies only when given.
struct DaemonFlags {
  int device = 0;
  std::string socket, backend, log_level, ready_file, metrics_address, operator_group,
      queue_sharing, fused_projection;
  int64_t call_timeout_ms = 0, peer_timeout_ms = 0, drain_timeout_ms = 0, ring_spin_us = 0;
  int32_t queue_probe_streams = 0;
  CLI::Option *backend_opt = nullptr, *log_level_opt = nullptr, *call_opt = nullptr,
              *peer_opt = nullptr, *drain_opt = nullptr, *metrics_opt = nullptr,
              *ready_opt = nullptr, *socket_opt = nullptr, *ring_spin_opt = nullptr,
              *operator_group_opt = nullptr, *queue_probe_opt = nullptr,
              *queue_sharing_opt = nullptr, *fused_projection_opt = nullptr;

  /// Sets `c.device`, the default socket of that device when `c` names none, and every flag
  /// given.
  void ApplyTo(DaemonConfig& c) const;
};

/// Adds the flags to `app`, bound to `f` (which must outlive the parse), with the defaults of
/// DaemonConfig shown in --help.
void AddDaemonFlags(CLI::App& app, DaemonFlags& f);

}  // namespace ulysses::daemon
