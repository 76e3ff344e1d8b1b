// Control requests: the bytes of one request (the first byte picks which), parsed as its
// protobuf message as the gRPC server does, then checked as ControlService checks it
// (requests.h). A call is planned against a geometry and buffers drawn from the input, as the
// daemon plans it; a fused session's weights are checked against those buffers. What is
// admitted must be safe to run (fuzz::CheckPlan).
#include "fuzz_util.h"
#include "proto_fuzz.h"
#include "quotas.h"
#include "rendezvous.h"
#include "requests.h"
#include "ulysses/proto/fused_spec.h"

using namespace ulysses;

namespace {

template <typename M>
bool Parse(FuzzedDataProvider& in, M* msg) {
  const std::string bytes = in.ConsumeRandomLengthString(1 << 16);
  return msg->ParseFromString(bytes);
}

void FuzzCreateSession(FuzzedDataProvider& in) {
  const int32_t world_size = in.ConsumeIntegralInRange<int32_t>(1, kMaxWorldSize);
  const int32_t rank = in.ConsumeIntegralInRange<int32_t>(0, world_size - 1);
  const bool reference = in.ConsumeBool();
  fuzz::FuzzBuffers buffers(in);
  v1::CreateSessionRequest req;
  if (!Parse(in, &req)) return;
  daemon::SessionRequest s;
  const absl::Status checked =
      daemon::CheckCreateSessionRequest(req, world_size, rank, reference, 30000, &s);
  // Refused or not, the rank arrives at the rendezvous with this timeout.
  if (s.timeout_ms <= 0 || s.timeout_ms > daemon::kMaxRendezvousTimeoutMs)
    fuzz::Fail("a session timeout out of its bounds");
  if (checked.ok() && s.fused)
    (void)ValidateFusedWeights(s.fused->geometry, s.fused->weights, buffers);
}

void FuzzCall(FuzzedDataProvider& in) {
  const SessionGeometry g = fuzz::DrawGeometry(in);
  if (!ValidateSessionGeometry(g).ok()) return;
  fuzz::FuzzBuffers buffers(in);
  v1::CallRequest req;
  if (!Parse(in, &req)) return;
  absl::StatusOr<CallArgs> args = daemon::CallArgsFromRequest(req);
  if (!args.ok()) return;
  absl::StatusOr<CallPlan> plan = PlanCall(g, *args, buffers);
  if (plan.ok()) fuzz::CheckPlan(*plan, g, buffers);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange<int>(0, 11)) {
    case 0: {
      v1::AttachRequest req;
      if (Parse(in, &req)) (void)daemon::CheckName("client_name", req.client_name());
      break;
    }
    case 1: {
      v1::AllocBufferRequest req;
      if (Parse(in, &req) && daemon::CheckAllocRequest(req).ok() &&
          (req.size_bytes() == 0 || req.size_bytes() > daemon::kMaxBufferBytes))
        fuzz::Fail("an admitted buffer size out of its bounds");
      break;
    }
    case 2: {
      v1::RegisterBufferRequest req;
      if (Parse(in, &req)) (void)daemon::CheckRegisterRequest(req);
      break;
    }
    case 3: {
      v1::JoinGroupRequest req;
      if (!Parse(in, &req)) break;
      absl::StatusOr<std::string> backend = daemon::CheckJoinRequest(req);
      if (backend.ok() && (req.members_size() != req.world_size() || req.rank() < 0 ||
                           req.rank() >= req.world_size()))
        fuzz::Fail("an admitted group whose rank or members do not fit its world size");
      break;
    }
    case 4: FuzzCreateSession(in); break;
    case 5: FuzzCall(in); break;
    // The others carry ids only, looked up in the daemon's maps: parsing is their decoder.
    case 6: { v1::FreeBufferRequest req; (void)Parse(in, &req); break; }
    case 7: { v1::LeaveGroupRequest req; (void)Parse(in, &req); break; }
    case 8: { v1::CloseSessionRequest req; (void)Parse(in, &req); break; }
    case 9: { v1::ReleaseRequest req; (void)Parse(in, &req); break; }
    case 10: { v1::PoisonSlotsRequest req; (void)Parse(in, &req); break; }
    default: { v1::DescribeSessionRequest req; (void)Parse(in, &req); break; }
  }
  return 0;
}
