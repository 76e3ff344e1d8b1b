#include "requests.h"

#include <sys/stat.h>

#include "quotas.h"
#include "rendezvous.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"

namespace ulysses::daemon {
namespace {

OperandRef ToOperand(const v1::TensorRef& t) {
  OperandRef r;
  r.buffer_id = t.buffer_id();
  r.offset_bytes = t.offset_bytes();
  for (int i = 0; i < t.strides_size() && i < 4; ++i) r.strides[i] = t.strides(i);
  return r;
}

}  // namespace

absl::Status CheckAllocRequest(const v1::AllocBufferRequest& req) {
  ULY_RETURN_IF_ERROR(CheckName("name", req.name()));
  if (req.size_bytes() == 0 || req.size_bytes() > kMaxBufferBytes)
    return absl::InvalidArgumentError(
        StrCat("size_bytes: ", req.size_bytes(), " is not in [1, ", kMaxBufferBytes, "]"));
  return absl::OkStatus();
}

absl::Status CheckRegisterRequest(const v1::RegisterBufferRequest& req) {
  ULY_RETURN_IF_ERROR(CheckName("name", req.name()));
  if (req.vmm_mappings_size() == 0) return absl::OkStatus();
  if (!req.cuda_ipc_handle().empty())
    return absl::InvalidArgumentError("vmm_mappings: give them or cuda_ipc_handle, not both");
  if (static_cast<size_t>(req.vmm_mappings_size()) > ipc::cuda::kMaxVmmMappings)
    return absl::InvalidArgumentError(StrCat("vmm_mappings: ", req.vmm_mappings_size(),
                                             " mappings, more than ", ipc::cuda::kMaxVmmMappings));
  uint64_t total = 0;
  for (int i = 0; i < req.vmm_mappings_size(); ++i) {
    const uint64_t size = req.vmm_mappings(i).size_bytes();
    if (size == 0 || size > kMaxBufferBytes - total)
      return absl::InvalidArgumentError(StrCat("vmm_mappings[", i, "].size_bytes: ", size,
                                               size == 0 ? " is 0" : " brings the buffer past 1 TiB"));
    total += size;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RendezvousTimeoutMs(int64_t timeout_ms, int64_t default_ms) {
  if (timeout_ms > kMaxRendezvousTimeoutMs)
    return absl::InvalidArgumentError(
        StrCat("timeout_ms: ", timeout_ms, " exceeds ", kMaxRendezvousTimeoutMs));
  return timeout_ms > 0 ? timeout_ms : default_ms;
}

namespace {

// The socket path of a unix member address, empty for anything else.
std::string UnixPath(const std::string& address) {
  if (address.rfind("unix://", 0) == 0) return address.substr(7);
  if (address.rfind("unix:", 0) == 0) return address.substr(5);
  if (!address.empty() && address[0] == '/') return address;
  return "";
}

}  // namespace

absl::Status CheckMembers(const v1::JoinGroupRequest& req, const std::vector<DeviceEntry>& devices) {
  for (int i = 0; i < req.members_size(); ++i) {
    const std::string path = UnixPath(req.members(i));
    bool allowed = !path.empty() && path[0] == '/';
    if (allowed && !devices.empty()) {
      allowed = false;
      for (const DeviceEntry& d : devices) allowed = allowed || d.socket == path;
    }
    if (!allowed)
      return absl::InvalidArgumentError(StrCat(
          "members[", i, "]: '", req.members(i), "' is not ",
          devices.empty() ? "a unix socket path (this daemon dials node-local daemons only)"
                          : "the socket of a daemon in the node config's devices[]"));
  }
  return absl::OkStatus();
}

absl::Status CheckOwnRank(const v1::JoinGroupRequest& req, const std::string& own_socket) {
  const std::string& named = req.members(req.rank());
  const std::string path = UnixPath(named);
  struct stat theirs {}, mine {};
  if (!path.empty() && ::stat(path.c_str(), &theirs) == 0 &&
      ::stat(own_socket.c_str(), &mine) == 0 && theirs.st_dev == mine.st_dev &&
      theirs.st_ino == mine.st_ino)
    return absl::OkStatus();
  return absl::InvalidArgumentError(
      StrCat("members[", req.rank(), "]: '", named, "' is not this daemon's socket (", own_socket,
             "); a client joins as rank r through the daemon of members[r]"));
}

absl::StatusOr<std::string> CheckJoinRequest(const v1::JoinGroupRequest& req) {
  ULY_RETURN_IF_ERROR(CheckName("name", req.name()));
  if (req.name().empty()) return absl::InvalidArgumentError("name: must not be empty");
  if (req.world_size() < 1 || req.world_size() > kMaxWorldSize)
    return absl::InvalidArgumentError(
        StrCat("world_size: ", req.world_size(), " is not in [1, ", kMaxWorldSize, "]"));
  if (req.rank() < 0 || req.rank() >= req.world_size())
    return absl::InvalidArgumentError(
        StrCat("rank: ", req.rank(), " is not in [0, world_size=", req.world_size(), ")"));
  if (req.members_size() != req.world_size())
    return absl::InvalidArgumentError(StrCat("members: expected ", req.world_size(),
                                             " addresses (one per rank), got ",
                                             req.members_size()));
  for (int i = 0; i < req.members_size(); ++i) {
    if (req.members(i).empty())
      return absl::InvalidArgumentError(StrCat("members[", i, "]: empty address"));
    ULY_RETURN_IF_ERROR(CheckName(StrCat("members[", i, "]"), req.members(i)));
  }
  const std::string requested = req.backend().empty() ? "auto" : req.backend();
  if (requested != "auto" && requested != "host" && requested != "nccl" && requested != "nvlink")
    return absl::InvalidArgumentError(
        StrCat("backend: '", requested.substr(0, kMaxNameBytes),
               "' is not one of auto, host, nccl, nvlink"));
  ULY_RETURN_IF_ERROR(RendezvousTimeoutMs(req.timeout_ms(), 1).status());
  return requested;
}

absl::Status CheckCreateSessionRequest(const v1::CreateSessionRequest& req, int32_t world_size,
                                       int32_t rank, bool reference_kernels,
                                       int64_t default_timeout_ms, SessionRequest* out) {
  absl::StatusOr<int64_t> timeout = RendezvousTimeoutMs(req.timeout_ms(), default_timeout_ms);
  out->timeout_ms = timeout.ok() ? *timeout : default_timeout_ms;
  SessionGeometry& geo = out->geometry;
  if (req.kind() == v1::SESSION_KIND_QKV_NORM_ROPE_EXCHANGE) {
    out->fused = FusedSessionFromProto(req.fused(), world_size, rank);
    const FusedSessionArgs& fused = *out->fused;
    ULY_RETURN_IF_ERROR(ValidateFusedGeometry(
        fused.geometry, reference_kernels ? FusedImpl::kReference : FusedImpl::kCuda));
    if (fused.path != FusedPath::kAuto && fused.path != FusedPath::kPerOperator &&
        fused.path != FusedPath::kChunked && fused.path != FusedPath::kEpilogue)
      return absl::InvalidArgumentError(
          StrCat("path: unknown path ", static_cast<int>(fused.path)));
    geo = SlotGeometry(fused.geometry);
  } else if (IsHeadExchange(req.kind())) {
    geo.world_size = world_size;
    geo.rank = rank;
    geo.num_heads = req.spec().num_heads();
    geo.head_dim = req.spec().head_dim();
    geo.dtype = static_cast<DType>(req.spec().dtype());
    geo.max_tokens = req.spec().max_tokens();
    geo.num_slots = req.spec().num_slots() == 0 ? 2 : req.spec().num_slots();
    geo.schedule.assign(req.spec().schedule().begin(), req.spec().schedule().end());
  } else {
    return absl::InvalidArgumentError(StrCat("kind: unknown session kind ", req.kind()));
  }
  ULY_RETURN_IF_ERROR(ValidateSessionGeometry(geo));
  return timeout.status();
}

absl::StatusOr<CallArgs> CallArgsFromRequest(const v1::CallRequest& req) {
  CallArgs args;
  args.op = static_cast<OpKind>(req.op());
  args.batch = req.batch();
  args.seq = req.seq();
  args.head_offset = req.head_offset();
  args.head_count = req.head_count();
  if (req.inputs_size() > 3)
    return absl::InvalidArgumentError(StrCat("inputs: at most 3, got ", req.inputs_size()));
  for (int i = 0; i < req.inputs_size(); ++i) args.inputs[i] = ToOperand(req.inputs(i));
  if (req.has_out()) args.out = ToOperand(req.out());
  return args;
}

size_t RecentCallsLimit(const v1::ListRecentCallsRequest& req) {
  return req.limit() > 0 ? static_cast<size_t>(req.limit()) : 0;
}

absl::StatusOr<int64_t> CheckRendezvousRequest(const v1::RendezvousRequest& req,
                                               int64_t default_ms) {
  ULY_ASSIGN_OR_RETURN(int64_t ms, RendezvousTimeoutMs(req.timeout_ms(), default_ms));
  ULY_RETURN_IF_ERROR(
      ValidateArrival(req.key(), req.world_size(), req.rank(), req.agreement(), req.payload()));
  return ms;
}

}  // namespace ulysses::daemon
