// The limits on what one client, the clients of one uid, and all clients together may hold at
// once (config object `limits`, kLimitFields): the daemon's names for them, and the bound on
// the names clients give.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "ulysses/common/config.h"

namespace ulysses::daemon {

/// Most bytes of a name a client gives (client_name, buffer and group names): enough for any
/// honest name, and it keeps every listing small.
inline constexpr size_t kMaxNameBytes = 256;

/// INVALID_ARGUMENT naming `field` when `value` is longer than kMaxNameBytes.
absl::Status CheckName(std::string_view field, std::string_view value);

/// The index of the limit named `key` in kLimitFields; not a constant expression (so a
/// compile error where one is needed) for a name that is not there.
constexpr int LimitIndex(std::string_view key) {
  for (size_t i = 0; i < kLimitFields.size(); ++i)
    if (kLimitFields[i].key == key) return static_cast<int>(i);
  throw "no such limit";
}

/// One limit of DaemonLimits: its index in kLimitFields.
enum class Limit : int {
  kMaxClients = LimitIndex("max_clients"),
  kConnectionsPerUid = LimitIndex("connections_per_uid"),
  kMaxConnections = LimitIndex("max_connections"),
  kClientsPerUid = LimitIndex("clients_per_uid"),
  kUnboundClientsPerUid = LimitIndex("unbound_clients_per_uid"),
  kBuffersPerClient = LimitIndex("buffers_per_client"),
  kBuffersPerUid = LimitIndex("buffers_per_uid"),
  kMaxBuffers = LimitIndex("max_buffers"),
  kBufferBytesPerClient = LimitIndex("buffer_bytes_per_client"),
  kBufferBytesPerUid = LimitIndex("buffer_bytes_per_uid"),
  kMaxBufferBytes = LimitIndex("max_buffer_bytes"),
  kPendingFdsPerClient = LimitIndex("pending_fds_per_client"),
  kPendingFdsPerUid = LimitIndex("pending_fds_per_uid"),
  kMaxPendingFds = LimitIndex("max_pending_fds"),
  kGroupsPerClient = LimitIndex("groups_per_client"),
  kSessionsPerClient = LimitIndex("sessions_per_client"),
  kSessionsPerUid = LimitIndex("sessions_per_uid"),
  kMaxSessions = LimitIndex("max_sessions"),
  kCallsInProgressPerClient = LimitIndex("calls_in_progress_per_client"),
  kCallsInProgressPerUid = LimitIndex("calls_in_progress_per_uid"),
  kAdminCallsInProgress = LimitIndex("admin_calls_in_progress"),
};
inline constexpr size_t kNumLimits = kLimitFields.size();

/// The config key under `limits` ("buffer_bytes_per_uid").
std::string_view LimitName(Limit limit);
/// Its configured value.
uint64_t LimitValue(const DaemonLimits& limits, Limit limit);

}  // namespace ulysses::daemon
