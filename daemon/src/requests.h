// The checks of a request's own fields that the services run before they touch any daemon
// state, allocate anything or ask a peer: one function per request that carries fields. Pure
// (no daemon state), so the fuzz targets (fuzz/) run exactly what the services run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "ulysses/common/config.h"
#include "ulysses/common/fused.h"
#include "ulysses/common/geometry.h"
#include "ulysses/proto/fused_spec.h"
#include "ulysses/v1/admin.pb.h"
#include "ulysses/v1/control.pb.h"
#include "ulysses/v1/peer.pb.h"

namespace ulysses::daemon {

/// Largest buffer one AllocBuffer may ask for.
inline constexpr uint64_t kMaxBufferBytes = 1ull << 40;

/// AllocBuffer: `name` within kMaxNameBytes, `size_bytes` in [1, kMaxBufferBytes].
absl::Status CheckAllocRequest(const v1::AllocBufferRequest& req);

/// RegisterBuffer: `name` within kMaxNameBytes; at most ipc::cuda::kMaxVmmMappings VMM
/// mappings, each of a nonzero size, and not together with an IPC handle (the descriptors
/// and handles themselves are checked when they are taken).
absl::Status CheckRegisterRequest(const v1::RegisterBufferRequest& req);

/// JoinGroup: `name` of 1..kMaxNameBytes bytes, `world_size` in [1, kMaxWorldSize], `rank` in
/// [0, world_size), one non-empty address of at most kMaxNameBytes bytes per rank, `backend`
/// one of auto, host, nccl, nvlink (empty: auto), `timeout_ms` at most
/// kMaxRendezvousTimeoutMs. Returns the backend asked for ("auto" when empty).
absl::StatusOr<std::string> CheckJoinRequest(const v1::JoinGroupRequest& req);

/// The member addresses a JoinGroup may name, which the daemon dials: the control sockets of
/// the node config's `devices[]` when it lists any (in any spelling GrpcTarget takes: "/p",
/// "unix:/p", "unix:///p"); without a list, unix socket paths only (never a TCP address).
/// INVALID_ARGUMENT naming the first member that is not allowed.
absl::Status CheckMembers(const v1::JoinGroupRequest& req, const std::vector<DeviceEntry>& devices);

/// A client joins as rank r through the daemon of members[r] only: INVALID_ARGUMENT naming
/// members[rank] unless it is the socket at `own_socket` (the same file, in any spelling).
/// Rank 0 takes each arriving daemon as the rank it says (the daemons trust one another), so
/// without this a client of any daemon could take a rank of another tenant's group.
absl::Status CheckOwnRank(const v1::JoinGroupRequest& req, const std::string& own_socket);

/// The rendezvous timeout a JoinGroup or CreateSession asks for: `timeout_ms` when > 0 (at most
/// kMaxRendezvousTimeoutMs, else INVALID_ARGUMENT naming timeout_ms), else `default_ms`.
absl::StatusOr<int64_t> RendezvousTimeoutMs(int64_t timeout_ms, int64_t default_ms);

/// True for the kinds of a head_exchange session (SESSION_KIND_UNSPECIFIED included).
inline bool IsHeadExchange(v1::SessionKind kind) {
  return kind == v1::SESSION_KIND_UNSPECIFIED || kind == v1::SESSION_KIND_HEAD_EXCHANGE;
}

/// What a CreateSession asks for, as far as its fields go.
struct SessionRequest {
  SessionGeometry geometry;                ///< the receive slots' geometry
  std::optional<FusedSessionArgs> fused;   ///< set for the fused kind
  int64_t timeout_ms = 0;                  ///< the rendezvous timeout, always within its bounds
};

/// CreateSession for rank `rank` of a group of `world_size`: the kind, the spec (or the fused
/// spec, checked for the kernels the daemon runs: `reference_kernels` on the host backend)
/// and the timeout. INVALID_ARGUMENT naming the field. `out` is filled even on an error, so
/// that a refusing rank still arrives at the rendezvous under the right agreement and
/// timeout: `fused` is set for the fused kind even when its geometry is refused, and
/// `timeout_ms` is `default_timeout_ms` when the request's is refused or absent. The fused
/// weights are resolved against the caller's buffers later (ValidateFusedWeights).
absl::Status CheckCreateSessionRequest(const v1::CreateSessionRequest& req, int32_t world_size,
                                       int32_t rank, bool reference_kernels,
                                       int64_t default_timeout_ms, SessionRequest* out);

/// Call: the arguments as PlanCall takes them (at most 3 inputs; PlanCall checks the rest).
absl::StatusOr<CallArgs> CallArgsFromRequest(const v1::CallRequest& req);

/// Admin.ListRecentCalls: how many records to return (0: all the recorder holds).
size_t RecentCallsLimit(const v1::ListRecentCallsRequest& req);

/// Peer.Rendezvous: `timeout_ms` at most kMaxRendezvousTimeoutMs, then ValidateArrival of the
/// other fields. Returns the wait in milliseconds (`default_ms` when timeout_ms <= 0).
absl::StatusOr<int64_t> CheckRendezvousRequest(const v1::RendezvousRequest& req,
                                               int64_t default_ms);

}  // namespace ulysses::daemon
