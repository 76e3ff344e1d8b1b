#include "quotas.h"

#include <unistd.h>

#include <algorithm>

#include "daemon.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {

absl::Status CheckName(std::string_view field, std::string_view value) {
  if (value.size() > kMaxNameBytes)
    return absl::InvalidArgumentError(
        StrCat(field, ": ", value.size(), " bytes exceed ", kMaxNameBytes));
  return absl::OkStatus();
}

std::string_view LimitName(Limit limit) { return kLimitFields[static_cast<size_t>(limit)].key; }

uint64_t LimitValue(const DaemonLimits& limits, Limit limit) {
  return kLimitFields[static_cast<size_t>(limit)].value(limits);
}

absl::Status Daemon::RefuseOverLimit(Limit limit, const std::string& what) {
  refusals_[static_cast<size_t>(limit)].fetch_add(1, std::memory_order_relaxed);
  return absl::ResourceExhaustedError(StrCat(what, " (limits.", LimitName(limit), " = ",
                                             LimitValue(config_.limits, limit), ")"));
}

absl::Status Daemon::AdmitToUidLocked(ClientRecord& c, uid_t uid) {
  std::lock_guard<std::mutex> lock(quotas_->mu);
  UidUsage& u = quotas_->uids[uid];
  if (u.clients >= config_.limits.clients_per_uid) {
    if (u.Unused()) quotas_->uids.erase(uid);
    return RefuseOverLimit(Limit::kClientsPerUid,
                           StrCat("uid ", uid, " has ", u.clients, " clients bound already"));
  }
  ++u.clients;
  c.counted_in_uid = true;
  return absl::OkStatus();
}

absl::Status Daemon::ChargeUnboundLocked(ClientRecord& c, uid_t uid) {
  std::lock_guard<std::mutex> lock(quotas_->mu);
  UidUsage& u = quotas_->uids[uid];
  if (u.unbound >= config_.limits.unbound_clients_per_uid) {
    const int32_t unbound = u.unbound;
    if (u.Unused()) quotas_->uids.erase(uid);
    return RefuseOverLimit(Limit::kUnboundClientsPerUid,
                           StrCat("uid ", uid, " has ", unbound,
                                  " attached clients that have not bound their fd socket yet"));
  }
  ++u.unbound;
  c.unbound_uid = uid;
  return absl::OkStatus();
}

void Daemon::ReleaseUnboundLocked(ClientRecord& c) {
  if (!c.unbound_uid) return;
  std::lock_guard<std::mutex> lock(quotas_->mu);
  auto it = quotas_->uids.find(*c.unbound_uid);
  if (it != quotas_->uids.end()) {
    if (it->second.unbound > 0) --it->second.unbound;
    if (it->second.Unused()) quotas_->uids.erase(it);
  }
  c.unbound_uid.reset();
}

void Daemon::ReleaseQuotaLocked(ClientRecord& c) {
  ReleaseUnboundLocked(c);
  std::lock_guard<std::mutex> lock(quotas_->mu);
  quotas_->buffers -= std::min(quotas_->buffers, c.charged_buffers);
  quotas_->buffer_bytes -= std::min(quotas_->buffer_bytes, c.charged_bytes);
  auto it = quotas_->uids.find(c.uid);
  if (it != quotas_->uids.end()) {
    UidUsage& u = it->second;
    if (c.counted_in_uid && u.clients > 0) --u.clients;
    u.buffer_bytes -= std::min(u.buffer_bytes, c.charged_bytes);
    u.buffers -= std::min(u.buffers, c.charged_buffers);
    if (u.Unused()) quotas_->uids.erase(it);
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
    std::lock_guard<std::mutex> quota(quotas_->mu);
    if (quotas_->buffers >= l.max_buffers)
      return RefuseOverLimit(Limit::kMaxBuffers,
                             StrCat("the daemon's clients hold ", quotas_->buffers, " buffers"));
    if (bytes > l.max_buffer_bytes - std::min(quotas_->buffer_bytes, l.max_buffer_bytes))
      return RefuseOverLimit(Limit::kMaxBufferBytes,
                             StrCat("the daemon's clients hold ", quotas_->buffer_bytes,
                                    " buffer bytes; ", bytes, " more do not fit"));
    auto it = quotas_->uids.try_emplace(c.uid).first;
    UidUsage& u = it->second;
    absl::Status refused;
    if (u.buffers >= l.buffers_per_uid)
      refused = RefuseOverLimit(Limit::kBuffersPerUid,
                                StrCat("uid ", c.uid, " holds ", u.buffers, " buffers"));
    else if (bytes > l.buffer_bytes_per_uid - std::min(u.buffer_bytes, l.buffer_bytes_per_uid))
      refused = RefuseOverLimit(Limit::kBufferBytesPerUid,
                                StrCat("uid ", c.uid, " holds ", u.buffer_bytes,
                                       " buffer bytes; ", bytes, " more do not fit"));
    if (!refused.ok()) {
      if (u.Unused()) quotas_->uids.erase(it);
      return refused;
    }
    u.buffer_bytes += bytes;
    ++u.buffers;
    ++quotas_->buffers;
    quotas_->buffer_bytes += bytes;
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
  std::lock_guard<std::mutex> quota(quotas_->mu);
  if (had_buffer && quotas_->buffers > 0) --quotas_->buffers;
  quotas_->buffer_bytes -= std::min(quotas_->buffer_bytes, n);
  auto it = quotas_->uids.find(c.uid);
  if (it == quotas_->uids.end()) return;
  it->second.buffer_bytes -= std::min(it->second.buffer_bytes, n);
  if (had_buffer && it->second.buffers > 0) --it->second.buffers;
  if (it->second.Unused()) quotas_->uids.erase(it);
}

absl::StatusOr<bool> Daemon::EnterUidRequest(ClientRecord& c, bool refused_arrival) {
  uid_t uid = 0;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (!c.counted_in_uid) return false;  // not bound yet: its uid is not known
    uid = c.uid;
  }
  int32_t UidUsage::*const count =
      refused_arrival ? &UidUsage::refused_arriving : &UidUsage::requests;
  std::lock_guard<std::mutex> lock(quotas_->mu);
  UidUsage& u = quotas_->uids[uid];
  if (u.*count >= config_.limits.calls_in_progress_per_uid) {
    const int32_t held = u.*count;
    if (u.Unused()) quotas_->uids.erase(uid);
    return RefuseOverLimit(Limit::kCallsInProgressPerUid,
                           StrCat("uid ", uid, " has ", held,
                                  refused_arrival ? " refused requests still arriving"
                                                  : " requests in progress already"));
  }
  ++(u.*count);
  return true;
}

void Daemon::LeaveUidRequest(uid_t uid, bool refused_arrival) {
  int32_t UidUsage::*const count =
      refused_arrival ? &UidUsage::refused_arriving : &UidUsage::requests;
  std::lock_guard<std::mutex> lock(quotas_->mu);
  auto it = quotas_->uids.find(uid);
  if (it == quotas_->uids.end()) return;
  if (it->second.*count > 0) --(it->second.*count);
  if (it->second.Unused()) quotas_->uids.erase(it);
}

absl::StatusOr<std::shared_ptr<const void>> Daemon::ChargeSession(ClientRecord& c) {
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.gone) return absl::UnavailableError(StrCat("client ", c.id, " is gone"));
  if (!c.fd_socket.valid() || !c.counted_in_uid)
    return absl::FailedPreconditionError(
        StrCat("client ", c.id, ": fd socket not connected; connect it right after Attach"));
  const DaemonLimits& l = config_.limits;
  const int32_t held = c.sessions_charged->load();
  if (held >= l.sessions_per_client)
    return RefuseOverLimit(Limit::kSessionsPerClient,
                           StrCat("client ", c.id, " has ", held, " sessions open or opening"));
  {
    std::lock_guard<std::mutex> quota(quotas_->mu);
    if (quotas_->sessions >= l.max_sessions)
      return RefuseOverLimit(Limit::kMaxSessions, StrCat("the daemon's clients have ",
                                                         quotas_->sessions,
                                                         " sessions open or opening"));
    UidUsage& u = quotas_->uids[c.uid];
    if (u.sessions >= l.sessions_per_uid)
      return RefuseOverLimit(Limit::kSessionsPerUid,
                             StrCat("uid ", c.uid, " has ", u.sessions,
                                    " sessions open or opening"));
    ++u.sessions;
    ++quotas_->sessions;
  }
  c.sessions_charged->fetch_add(1);
  return std::shared_ptr<const void>(
      nullptr, [book = quotas_, client = c.sessions_charged, uid = c.uid](const void*) {
        client->fetch_sub(1);
        book->UnchargeSession(uid);
      });
}

void Daemon::QuotaBook::UnchargeSession(uid_t uid) {
  std::lock_guard<std::mutex> lock(mu);
  if (sessions > 0) --sessions;
  auto it = uids.find(uid);
  if (it == uids.end()) return;
  if (it->second.sessions > 0) --it->second.sessions;
  if (it->second.Unused()) uids.erase(it);
}

absl::Status Daemon::ChargePendingFdLocked(ClientRecord& c) {
  const DaemonLimits& l = config_.limits;
  // Descriptors nobody claims would pile up to RLIMIT_NOFILE and starve every client.
  if (c.incoming_fds.size() >= static_cast<size_t>(l.pending_fds_per_client))
    return RefuseOverLimit(Limit::kPendingFdsPerClient,
                           StrCat("client ", c.id, " has ", c.incoming_fds.size(),
                                  " unclaimed descriptors"));
  std::lock_guard<std::mutex> quota(quotas_->mu);
  if (quotas_->pending_fds >= l.max_pending_fds)
    return RefuseOverLimit(Limit::kMaxPendingFds, StrCat("the daemon's clients have ",
                                                         quotas_->pending_fds,
                                                         " unclaimed descriptors"));
  UidUsage& u = quotas_->uids[c.uid];
  if (u.pending_fds >= l.pending_fds_per_uid)
    return RefuseOverLimit(Limit::kPendingFdsPerUid, StrCat("uid ", c.uid, " has ", u.pending_fds,
                                                            " unclaimed descriptors"));
  ++u.pending_fds;
  ++quotas_->pending_fds;
  return absl::OkStatus();
}

void Daemon::UnchargePendingFdsLocked(ClientRecord& c, int32_t n) {
  std::lock_guard<std::mutex> quota(quotas_->mu);
  quotas_->pending_fds -= std::min(quotas_->pending_fds, n);
  auto it = quotas_->uids.find(c.uid);
  if (it == quotas_->uids.end()) return;
  it->second.pending_fds -= std::min(it->second.pending_fds, n);
  if (it->second.Unused()) quotas_->uids.erase(it);
}

absl::Status Daemon::AdmitConnection(uid_t uid) {
  const DaemonLimits& l = config_.limits;
  // The last eighth of the places is kept for the daemon's own uid: its probes and tools
  // (ulyssesctl status, health) connect whatever other uids hold.
  const int32_t others = l.max_connections - std::max(1, l.max_connections / 8);
  const int32_t bound = uid == ::geteuid() ? l.max_connections : others;
  std::lock_guard<std::mutex> lock(quotas_->mu);
  if (quotas_->connections >= bound)
    return RefuseOverLimit(Limit::kMaxConnections,
                           StrCat(quotas_->connections, " connections are open already",
                                  bound < l.max_connections
                                      ? StrCat("; the last ", l.max_connections - bound,
                                               " are kept for the daemon's uid")
                                      : ""));
  UidUsage& u = quotas_->uids[uid];
  if (u.connections >= l.connections_per_uid) {
    return RefuseOverLimit(Limit::kConnectionsPerUid,
                           StrCat("uid ", uid, " has ", u.connections, " connections open"));
  }
  ++u.connections;
  ++quotas_->connections;
  return absl::OkStatus();
}

void Daemon::ConnectionEnded(uid_t uid) {
  std::lock_guard<std::mutex> lock(quotas_->mu);
  if (quotas_->connections > 0) --quotas_->connections;
  auto it = quotas_->uids.find(uid);
  if (it == quotas_->uids.end()) return;
  if (it->second.connections > 0) --it->second.connections;
  if (it->second.Unused()) quotas_->uids.erase(it);
}

absl::Status Daemon::StartGroupJoin(ClientRecord& c) {
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.gone) return absl::UnavailableError(StrCat("client ", c.id, " is gone"));
  const size_t held = c.groups.size() + static_cast<size_t>(c.groups_joining);
  if (held >= static_cast<size_t>(config_.limits.groups_per_client))
    return RefuseOverLimit(Limit::kGroupsPerClient,
                           StrCat("client ", c.id, " has ", held, " groups joined or joining"));
  ++c.groups_joining;
  return absl::OkStatus();
}

void Daemon::FillQuotaGauges(GaugeSnapshot& g) {
  for (size_t i = 0; i < kNumLimits; ++i)
    g.limits.push_back({std::string(kLimitFields[i].key), kLimitFields[i].value(config_.limits),
                        refusals_[i].load(std::memory_order_relaxed)});
  std::map<uid_t, uint64_t> slot_bytes;
  {
    std::lock_guard<std::mutex> lock(slot_budget_->mu);
    slot_bytes = slot_budget_->by_uid;
  }
  std::lock_guard<std::mutex> lock(quotas_->mu);
  for (const auto& [uid, u] : quotas_->uids) {
    auto slots = slot_bytes.find(uid);
    g.uids.push_back({static_cast<uint32_t>(uid), u.clients, u.buffer_bytes, u.buffers,
                      u.sessions, u.connections, u.pending_fds,
                      slots == slot_bytes.end() ? 0 : slots->second, u.unbound});
  }
}

}  // namespace ulysses::daemon
