// Which backend a group runs: one verdict that every rank reaches from the same JoinGroup
// payloads, so that a group either forms on one backend everywhere or fails everywhere.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses {

/// Longest BackendOffer::instance.
inline constexpr size_t kMaxOfferInstanceChars = 64;

/// What one rank's daemon offers a group; its JoinGroup rendezvous payload.
struct BackendOffer {
  std::string backend;  ///< the backend the daemon runs: host, nvlink or nccl
  bool nccl = false;    ///< an nvlink daemon that can also run nccl for groups that need it
  int32_t device = -1;  ///< the daemon's device
  /// A nonce of this join, hex digits; rank 0's names the group instance that the join makes
  /// (its session keys), so that a later group of the same name never shares them.
  std::string instance;
};

/// "<backend>[+nccl]:<device>[/<instance>]".
std::string EncodeOffer(const BackendOffer& offer);
/// The offer of rank `rank`; FAILED_PRECONDITION naming the rank when the payload is malformed.
absl::StatusOr<BackendOffer> DecodeOffer(std::string_view payload, int rank);

/// The backend a group runs and why (Group.backend_reason).
struct BackendVerdict {
  std::string backend;
  std::string reason;
};

/// Whether a process on device `to` can map memory of device `from` (the same device, or peer
/// access between them).
using DeviceReach = std::function<absl::StatusOr<bool>(int32_t from, int32_t to)>;

/// The group's backend from every rank's offer (index = rank) and the backend asked for
/// ("auto" or a backend name). The same offers give the same verdict on every rank:
/// - every rank must run the same backend (FAILED_PRECONDITION naming the first that differs);
/// - host and nccl daemons run their backend;
/// - nvlink daemons run nvlink when every ordered pair of ranks' devices reaches; else `auto`
///   takes nccl when every rank also offers it, and the reason names the pair that does not
///   reach; `nccl` asked for runs when every rank offers it;
/// - anything else is FAILED_PRECONDITION naming the rank or the pair of devices.
absl::StatusOr<BackendVerdict> ChooseGroupBackend(std::string_view requested,
                                                  const std::vector<BackendOffer>& offers,
                                                  const DeviceReach& reach);

}  // namespace ulysses
