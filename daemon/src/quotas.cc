#include "quotas.h"

#include <algorithm>

#include "daemon.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

struct LimitTraits {
  Limit limit;
  std::string_view name;
  uint64_t (*value)(const DaemonLimits&);
};

constexpr std::array<LimitTraits, kNumLimits> kLimits = {{
    {Limit::kMaxClients, "max_clients",
     [](const DaemonLimits& l) -> uint64_t { return static_cast<uint64_t>(l.max_clients); }},
    {Limit::kClientsPerUid, "clients_per_uid",
     [](const DaemonLimits& l) -> uint64_t { return static_cast<uint64_t>(l.clients_per_uid); }},
    {Limit::kBuffersPerClient, "buffers_per_client",
     [](const DaemonLimits& l) -> uint64_t { return static_cast<uint64_t>(l.buffers_per_client); }},
    {Limit::kBuffersPerUid, "buffers_per_uid",
     [](const DaemonLimits& l) -> uint64_t { return static_cast<uint64_t>(l.buffers_per_uid); }},
    {Limit::kBufferBytesPerClient, "buffer_bytes_per_client",
     [](const DaemonLimits& l) -> uint64_t { return l.buffer_bytes_per_client; }},
    {Limit::kBufferBytesPerUid, "buffer_bytes_per_uid",
     [](const DaemonLimits& l) -> uint64_t { return l.buffer_bytes_per_uid; }},
    {Limit::kPendingFdsPerClient, "pending_fds_per_client",
     [](const DaemonLimits& l) -> uint64_t {
       return static_cast<uint64_t>(l.pending_fds_per_client);
     }},
    {Limit::kCallsInProgressPerClient, "calls_in_progress_per_client",
     [](const DaemonLimits& l) -> uint64_t {
       return static_cast<uint64_t>(l.calls_in_progress_per_client);
     }},
    {Limit::kCallsInProgressPerUid, "calls_in_progress_per_uid",
     [](const DaemonLimits& l) -> uint64_t {
       return static_cast<uint64_t>(l.calls_in_progress_per_uid);
     }},
    {Limit::kAdminCallsInProgress, "admin_calls_in_progress",
     [](const DaemonLimits& l) -> uint64_t {
       return static_cast<uint64_t>(l.admin_calls_in_progress);
     }},
}};

constexpr bool InLimitOrder() {
  for (size_t i = 0; i < kNumLimits; ++i)
    if (static_cast<size_t>(kLimits[i].limit) != i) return false;
  return true;
}
static_assert(InLimitOrder(), "kLimits lists the limits in the order of enum Limit");

const LimitTraits& Traits(Limit limit) { return kLimits[static_cast<size_t>(limit)]; }

}  // namespace

absl::Status CheckName(std::string_view field, std::string_view value) {
  if (value.size() > kMaxNameBytes)
    return absl::InvalidArgumentError(
        StrCat(field, ": ", value.size(), " bytes exceed ", kMaxNameBytes));
  return absl::OkStatus();
}

std::string_view LimitName(Limit limit) { return Traits(limit).name; }

uint64_t LimitValue(const DaemonLimits& limits, Limit limit) { return Traits(limit).value(limits); }

absl::Status Daemon::RefuseOverLimit(Limit limit, const std::string& what) {
  refusals_[static_cast<size_t>(limit)].fetch_add(1, std::memory_order_relaxed);
  return absl::ResourceExhaustedError(StrCat(what, " (limits.", LimitName(limit), " = ",
                                             LimitValue(config_.limits, limit), ")"));
}

absl::Status Daemon::AdmitToUidLocked(ClientRecord& c, uid_t uid) {
  std::lock_guard<std::mutex> lock(quota_mu_);
  UidUsage& u = uid_usage_[uid];
  if (u.clients >= config_.limits.clients_per_uid) {
    if (u.Unused()) uid_usage_.erase(uid);
    return RefuseOverLimit(Limit::kClientsPerUid,
                           StrCat("uid ", uid, " has ", u.clients, " clients bound already"));
  }
  ++u.clients;
  c.counted_in_uid = true;
  return absl::OkStatus();
}

void Daemon::ReleaseQuotaLocked(ClientRecord& c) {
  std::lock_guard<std::mutex> lock(quota_mu_);
  auto it = uid_usage_.find(c.uid);
  if (it != uid_usage_.end()) {
    UidUsage& u = it->second;
    if (c.counted_in_uid && u.clients > 0) --u.clients;
    u.buffer_bytes -= std::min(u.buffer_bytes, c.charged_bytes);
    u.buffers -= std::min(u.buffers, c.charged_buffers);
    if (u.Unused()) uid_usage_.erase(it);
  }
  c.counted_in_uid = false;
  c.charged_bytes = 0;
  c.charged_buffers = 0;
}

absl::Status Daemon::ChargeBuffer(ClientRecord& c, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.gone) return absl::UnavailableError(StrCat("client ", c.id, " is gone"));
  if (!c.fd_socket.valid())
    return absl::FailedPreconditionError(
        StrCat("client ", c.id, ": fd socket not connected; connect it right after Attach"));
  const DaemonLimits& l = config_.limits;
  if (c.charged_buffers >= l.buffers_per_client)
    return RefuseOverLimit(Limit::kBuffersPerClient,
                           StrCat("client ", c.id, " holds ", c.charged_buffers, " buffers"));
  if (bytes > l.buffer_bytes_per_client - std::min(c.charged_bytes, l.buffer_bytes_per_client))
    return RefuseOverLimit(Limit::kBufferBytesPerClient,
                           StrCat("client ", c.id, " holds ", c.charged_bytes,
                                  " buffer bytes; ", bytes, " more do not fit"));
  {
    std::lock_guard<std::mutex> quota(quota_mu_);
    UidUsage& u = uid_usage_[c.uid];
    if (u.buffers >= l.buffers_per_uid)
      return RefuseOverLimit(Limit::kBuffersPerUid,
                             StrCat("uid ", c.uid, " holds ", u.buffers, " buffers"));
    if (bytes > l.buffer_bytes_per_uid - std::min(u.buffer_bytes, l.buffer_bytes_per_uid))
      return RefuseOverLimit(Limit::kBufferBytesPerUid,
                             StrCat("uid ", c.uid, " holds ", u.buffer_bytes,
                                    " buffer bytes; ", bytes, " more do not fit"));
    u.buffer_bytes += bytes;
    ++u.buffers;
  }
  c.charged_bytes += bytes;
  ++c.charged_buffers;
  return absl::OkStatus();
}

void Daemon::UnchargeBuffer(ClientRecord& c, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(c.mu);
  // A reclaimed client gave everything back at once; what is left to return is at most what it
  // still has charged.
  const uint64_t n = std::min(bytes, c.charged_bytes);
  c.charged_bytes -= n;
  const bool had_buffer = c.charged_buffers > 0;
  if (had_buffer) --c.charged_buffers;
  std::lock_guard<std::mutex> quota(quota_mu_);
  auto it = uid_usage_.find(c.uid);
  if (it == uid_usage_.end()) return;
  it->second.buffer_bytes -= std::min(it->second.buffer_bytes, n);
  if (had_buffer && it->second.buffers > 0) --it->second.buffers;
  if (it->second.Unused()) uid_usage_.erase(it);
}

absl::StatusOr<bool> Daemon::EnterUidRequest(ClientRecord& c) {
  uid_t uid = 0;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (!c.counted_in_uid) return false;  // not bound yet: its uid is not known
    uid = c.uid;
  }
  std::lock_guard<std::mutex> lock(quota_mu_);
  UidUsage& u = uid_usage_[uid];
  if (u.requests >= config_.limits.calls_in_progress_per_uid) {
    if (u.Unused()) uid_usage_.erase(uid);
    return RefuseOverLimit(Limit::kCallsInProgressPerUid,
                           StrCat("uid ", uid, " has ", u.requests, " requests in progress already"));
  }
  ++u.requests;
  return true;
}

void Daemon::LeaveUidRequest(uid_t uid) {
  std::lock_guard<std::mutex> lock(quota_mu_);
  auto it = uid_usage_.find(uid);
  if (it == uid_usage_.end()) return;
  if (it->second.requests > 0) --it->second.requests;
  if (it->second.Unused()) uid_usage_.erase(it);
}

void Daemon::FillQuotaGauges(GaugeSnapshot& g) {
  for (const LimitTraits& t : kLimits)
    g.limits.push_back({std::string(t.name), t.value(config_.limits),
                        refusals_[static_cast<size_t>(t.limit)].load(std::memory_order_relaxed)});
  std::lock_guard<std::mutex> lock(quota_mu_);
  for (const auto& [uid, u] : uid_usage_)
    g.uids.push_back({static_cast<uint32_t>(uid), u.clients, u.buffer_bytes, u.buffers});
}

}  // namespace ulysses::daemon
