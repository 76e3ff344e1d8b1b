// Ring descriptors: the 240 bytes a client writes into its submit ring, converted and planned
// as the daemon's ring worker does (ipc::CallArgsFromDescriptor, then PlanCall or, on a fused
// session, PlanQkvCall), against a geometry and buffers drawn from the rest of the input. A
// plan that is admitted must be safe to run (fuzz::CheckPlan).
#include <cstring>

#include "fuzz_util.h"
#include "ulysses/ipc/client_segment.h"

using namespace ulysses;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  ipc::CallDescriptor d;
  std::vector<uint8_t> raw = in.ConsumeBytes<uint8_t>(sizeof d);
  raw.resize(sizeof d);
  std::memcpy(&d, raw.data(), sizeof d);
  const bool fused = in.ConsumeBool();
  SessionGeometry g;
  FusedGeometry fg;
  if (fused) {
    fg = fuzz::DrawFusedGeometry(in);
    if (!ValidateFusedGeometry(fg, in.ConsumeBool() ? FusedImpl::kReference : FusedImpl::kCuda)
             .ok())
      return 0;
    g = SlotGeometry(fg);
  } else {
    g = fuzz::DrawGeometry(in);
    if (!ValidateSessionGeometry(g).ok()) return 0;
  }
  fuzz::FuzzBuffers buffers(in);
  absl::StatusOr<CallArgs> args = ipc::CallArgsFromDescriptor(d);
  if (!args.ok()) return 0;
  absl::StatusOr<CallPlan> plan = fused ? PlanQkvCall(fg, *args, buffers) : PlanCall(g, *args, buffers);
  if (plan.ok()) fuzz::CheckPlan(*plan, g, buffers);
  return 0;
}
