// The limits on what one client, and the clients of one uid, may hold at once (config object
// `limits`): their names, the one table the config, the refusals and the metrics share, and
// the bound on the names clients give.
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

/// One limit of DaemonLimits.
enum class Limit : int {
  kMaxClients = 0,
  kClientsPerUid,
  kBuffersPerClient,
  kBuffersPerUid,
  kBufferBytesPerClient,
  kBufferBytesPerUid,
  kPendingFdsPerClient,
  kCallsInProgressPerClient,
  kCallsInProgressPerUid,
  kAdminCallsInProgress,
};
inline constexpr size_t kNumLimits = 10;

/// The config key under `limits` ("buffer_bytes_per_uid").
std::string_view LimitName(Limit limit);
/// Its configured value.
uint64_t LimitValue(const DaemonLimits& limits, Limit limit);

}  // namespace ulysses::daemon
