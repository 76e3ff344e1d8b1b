// A GPU-backend client that stops mid-call and waits there to be killed (SIGKILL tests).
//   gpu_phase_client --members S0,S1 --rank R --phase P --ready FILE
// Phases:
//   session  the session exists and this rank never calls: the peer's call waits for it;
//   gated    this rank's call is on the ring (stream-ordered) and its stream is held before
//            the ready word, so this rank's daemon has the call enqueued on its stream, waiting
//            for inputs that never come.
// The ready file gets this process's pid once it is there.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "phase_args.h"
#include "ulysses/client/client.h"

using namespace ulysses;

namespace {

// Holds the stream's later work for good: the process is killed while it waits.
void HoldForever(void*) {
  for (;;) pause();
}

}  // namespace

int main(int argc, char** argv) {
  const testing_util::PhaseArgs args = testing_util::ParsePhaseArgs(argc, argv);
  const std::string& phase = args.phase;
  const std::vector<std::string>& members = args.members;
  const int rank = args.rank;
  if (phase != "session" && phase != "gated") {
    std::fprintf(stderr, "gpu_phase_client: --phase: '%s' is not session or gated\n", phase.c_str());
    return 64;
  }
  if (members.empty() || rank < 0 || rank >= static_cast<int>(members.size())) {
    std::fprintf(stderr, "gpu_phase_client: --rank %d is not a rank of --members\n", rank);
    return 64;
  }
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "gpu_phase_client: %s\n", s.ToString().c_str());
    return 1;
  };
  auto done = [&] { testing_util::StopAtPhase(args.ready); };
  auto c = client::Client::Connect({members[rank], "gpu-phase-" + phase});
  if (!c.ok()) return fail(c.status());
  const int world = static_cast<int>(members.size());
  auto g = (*c)->JoinGroup({"gpu-phase", world, rank, members, "nvlink", 0});
  if (!g.ok()) return fail(g.status());
  auto s = (*c)->CreateSession(*g, {8, 64, DType::kBFloat16, testing_util::kGpuPhaseMaxTokens, 2,
                                    {}, 0});
  if (!s.ok()) return fail(s.status());
  auto x = (*c)->AllocBuffer(64 * 8 * 64 * 2, "x");
  if (!x.ok()) return fail(x.status());
  if (phase == "session") done();
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return fail(absl::InternalError("cudaStreamCreateWithFlags"));
  if (cudaLaunchHostFunc(stream, &HoldForever, nullptr) != cudaSuccess)
    return fail(absl::InternalError("cudaLaunchHostFunc"));
  (*s)->set_stream(stream);
  auto r = (*s)->ScatterHeads(x->Ref(), 1, 64);  // returns at once: the stream has it
  if (!r.ok()) return fail(r.status());
  done();
}
