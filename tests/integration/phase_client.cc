// A client that stops at a chosen phase and waits there to be killed (SIGKILL tests).
//   phase_client --socket S --members S0,S1 --rank R --phase P --ready FILE
// Phases: attach, buffer, session, held (a result held), queued (calls submitted; the first
// waits for the peer, the others sit in the ring), exchange (the peer's call waits for this
// rank).
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "phase_args.h"
#include "ulysses/client/client.h"

using namespace ulysses;

int main(int argc, char** argv) {
  const testing_util::PhaseArgs args = testing_util::ParsePhaseArgs(argc, argv);
  const std::string& socket = args.socket;
  const std::string& phase = args.phase;
  const std::vector<std::string>& members = args.members;
  const int rank = args.rank;
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "phase_client: %s\n", s.ToString().c_str());
    return 1;
  };
  auto done = [&] { testing_util::StopAtPhase(args.ready); };
  auto c = client::Client::Connect({socket, "phase-" + phase});
  if (!c.ok()) return fail(c.status());
  if (phase == "attach") done();
  auto x = (*c)->AllocBuffer(16 * 4 * 8 * 4, "x");
  if (!x.ok()) return fail(x.status());
  if (phase == "buffer") done();
  auto g = (*c)->JoinGroup({"phase", static_cast<int32_t>(members.size()), rank, members, "auto", 20000});
  if (!g.ok()) return fail(g.status());
  auto s = (*c)->CreateSession(*g, {4, 8, DType::kFloat32, 16, 2, {}, 20000});
  if (!s.ok()) return fail(s.status());
  // exchange: the peer (in the test) calls and waits for this rank, which is killed instead.
  if (phase == "session" || phase == "exchange") done();
  CallArgs a;
  a.op = OpKind::kScatterHeads;
  a.batch = 1;
  a.seq = 16;
  a.inputs[0] = x->Ref();
  if (phase == "held") {  // a one-rank group: the call completes, the result stays held
    auto r = (*s)->Call(a);
    if (!r.ok()) return fail(r.status());
    done();
  }
  if (phase == "queued") {  // the first call waits for rank 0; the others wait in the ring
    for (int i = 0; i < 3; ++i) {
      auto e = (*s)->Submit(a);
      if (!e.ok()) return fail(e.status());
    }
    done();
  }
  return fail(absl::InvalidArgumentError("phase: unknown " + phase));
}
