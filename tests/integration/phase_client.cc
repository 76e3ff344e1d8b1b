// A client that stops at a chosen phase and waits there to be killed (SIGKILL tests).
//   phase_client --socket S --members S0,S1 --rank R --phase P --ready FILE
// Phases: attach, buffer, session, held (a result held), queued (calls submitted; the first
// waits for the peer, the others sit in the ring), exchange (the peer's call waits for this
// rank), cycle (announces itself at once, then goes round its whole life until killed),
// pair-cycle (rank 1 of two-rank groups named after --tag: announces itself, then goes round
// PairRound with the test as rank 0 until killed).
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "pair_round.h"
#include "phase_args.h"
#include "ulysses/client/client.h"
#include "ulysses/common/status.h"

using namespace ulysses;

namespace {

// One round of a client's whole life on a one-rank group: attach, two buffers, a session,
// two submitted calls and their waits, a held result, an out= call, the releases, the close.
absl::Status Cycle(const std::string& socket, int round) {
  ULY_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c,
                       client::Client::Connect({socket, "phase-cycle"}));
  ULY_ASSIGN_OR_RETURN(client::Buffer x, c->AllocBuffer(16 * 4 * 8 * 4, "x"));
  ULY_ASSIGN_OR_RETURN(client::Buffer out, c->AllocBuffer(16 * 4 * 8 * 4, "out"));
  ULY_ASSIGN_OR_RETURN(client::Group g,
                       c->JoinGroup({"cycle" + std::to_string(round), 1, 0, {socket}, "auto", 20000}));
  ULY_ASSIGN_OR_RETURN(std::unique_ptr<client::Session> s,
                       c->CreateSession(g, {4, 8, DType::kFloat32, 16, 2, {}, 20000}));
  CallArgs a;
  a.op = OpKind::kScatterHeads;
  a.batch = 1;
  a.seq = 16;
  a.inputs[0] = x.Ref();
  ULY_ASSIGN_OR_RETURN(uint64_t e1, s->Submit(a));
  ULY_ASSIGN_OR_RETURN(uint64_t e2, s->Submit(a));
  ULY_ASSIGN_OR_RETURN(client::Result r1, s->Wait(e1));
  ULY_RETURN_IF_ERROR(r1.Release());
  ULY_ASSIGN_OR_RETURN(client::Result held, s->Wait(e2));
  a.out = out.Ref();
  ULY_RETURN_IF_ERROR(s->Call(a).status());
  ULY_RETURN_IF_ERROR(held.Release());
  ULY_RETURN_IF_ERROR(s->Close());
  ULY_RETURN_IF_ERROR(c->FreeBuffer(out.id));
  return c->Close();
}

}  // namespace

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
  if (phase == "cycle") {
    testing_util::Announce(args.ready);
    for (int i = 0;; ++i)
      if (absl::Status st = Cycle(socket, i); !st.ok()) return fail(st);
  }
  if (phase == "pair-cycle") {
    testing_util::Announce(args.ready);
    auto pc = client::Client::Connect({socket, "phase-pair"});
    if (!pc.ok()) return fail(pc.status());
    auto x = (*pc)->AllocBuffer(16 * 4 * 8 * 4, "x");
    if (!x.ok()) return fail(x.status());
    for (int i = 0;; ++i)
      if (absl::Status st = testing_util::PairRound(**pc, members, rank,
                                                    args.tag + "-" + std::to_string(i), *x);
          !st.ok())
        return fail(st);
  }
  auto c = client::Client::Connect({socket, "phase-" + phase});
  if (!c.ok()) return fail(c.status());
  if (phase == "attach") done();
  auto x = (*c)->AllocBuffer(16 * 4 * 8 * 4, "x");
  if (!x.ok()) return fail(x.status());
  if (phase == "buffer") done();
  auto g = (*c)->JoinGroup({"phase", static_cast<int32_t>(members.size()), rank, members, "auto", 20000});
  if (!g.ok()) return fail(g.status());
  // joined: a member of a two-rank group that dies before its first session.
  if (phase == "joined") done();
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
