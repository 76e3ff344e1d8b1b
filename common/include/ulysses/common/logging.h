// Logging setup: one named spdlog logger per subsystem (main, grpc, ipc, exec, kern, peer).
#pragma once

#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace ulysses {

/// Sets the level of every logger ("trace", "debug", "info", "warn", "error", "off").
/// Thread-safe. INVALID_ARGUMENT names `log_level` for an unknown level.
absl::Status SetLogLevel(std::string_view level);

/// Returns the named logger, creating it (stderr, shared format) on first use. Thread-safe.
std::shared_ptr<spdlog::logger> Logger(std::string_view subsystem);

}  // namespace ulysses
