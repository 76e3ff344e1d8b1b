// One round of a two-rank group's life, run in step by both of its ranks: the SIGKILL tests
// run rank 1 as phase_client's pair-cycle phase and rank 0 in the test itself. Each step's
// error names the step ("join: ", "session: ", "call: ", "close: ").
#pragma once

#include <string>
#include <vector>

#include "ulysses/client/client.h"
#include "ulysses/common/strings.h"

namespace ulysses::testing_util {

/// Rendezvous timeout of a pair round's group and session (ms).
inline constexpr int32_t kPairTimeoutMs = 2000;

/// Joins the two-rank group `name` as `rank`, makes a session, runs three scatter_heads of `x`
/// (16 tokens of 4 heads of 8 floats), closes the session, and leaves the group (also when a
/// step after the join failed: a client's groups count against limits.groups_per_client).
inline absl::Status PairRound(client::Client& c, const std::vector<std::string>& members, int rank,
                              const std::string& name, const client::Buffer& x) {
  auto step = [](const char* what, const absl::Status& st) {
    return absl::Status(st.code(), StrCat(what, ": ", st.message()));
  };
  absl::StatusOr<client::Group> g = c.JoinGroup({name, 2, rank, members, "auto", kPairTimeoutMs});
  if (!g.ok()) return step("join", g.status());
  struct Leave {
    client::Client& c;
    const client::Group& g;
    ~Leave() { (void)c.LeaveGroup(g); }
  } leave{c, *g};
  absl::StatusOr<std::unique_ptr<client::Session>> s =
      c.CreateSession(*g, {4, 8, DType::kFloat32, 16, 2, {}, kPairTimeoutMs});
  if (!s.ok()) return step("session", s.status());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<client::Result> r = (*s)->ScatterHeads(x.Ref(), 1, 16);
    if (!r.ok()) return step("call", r.status());
    if (absl::Status st = r->Release(); !st.ok()) return step("call", st);
  }
  if (absl::Status st = (*s)->Close(); !st.ok()) return step("close", st);
  return absl::OkStatus();
}

}  // namespace ulysses::testing_util
