// The demo's workload as the GPU tests of every backend run it: W daemons, one client thread
// per rank, every result checked bit for bit against the index semantics.
#pragma once

#include <string>
#include <thread>
#include <vector>

#include "demo_lib.h"
#include "gtest/gtest.h"
#include "ulysses/common/strings.h"

namespace ulysses::testing_util {

struct WorkloadShape {
  int world;
  int batch;
  int seq_local;
  int heads_per_rank;
  int head_dim;
  DType dtype;
  std::vector<int32_t> schedule;
};

inline std::string WorkloadName(const ::testing::TestParamInfo<WorkloadShape>& p) {
  const WorkloadShape& s = p.param;
  return StrCat("W", s.world, "_B", s.batch, "_S", s.seq_local, "_Hl", s.heads_per_rank, "_D",
                s.head_dim, "_", DTypeName(s.dtype));
}

/// scatter_heads, gather_heads (out=), the head-chunk path over the schedule with strided
/// q/k/v views, merged into a NaN-filled output, twice, on every rank of `members` at once.
/// Expects every rank to pass its checks on `backend`.
inline void RunWorkloadOnEveryRank(const std::vector<std::string>& members,
                                   const WorkloadShape& sh, const std::string& backend) {
  std::vector<demo::RankReport> reports(sh.world);
  std::vector<std::thread> threads;
  for (int r = 0; r < sh.world; ++r) {
    threads.emplace_back([&, r] {
      demo::Workload w;
      w.members = members;
      w.socket = members[r];
      w.world_size = sh.world;
      w.rank = r;
      w.group = backend;
      w.backend = backend;
      w.batch = sh.batch;
      w.seq_local = sh.seq_local;
      w.num_heads = sh.heads_per_rank * sh.world;
      w.head_dim = sh.head_dim;
      w.dtype = sh.dtype;
      w.schedule = sh.schedule;
      w.iterations = 2;
      reports[r] = demo::RunRank(w);
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& rep : reports) {
    EXPECT_TRUE(rep.ok) << "rank " << rep.rank << ": " << rep.error;
    EXPECT_EQ(rep.backend, backend);
    EXPECT_GT(rep.checks, 0);
  }
}

/// Checks a scatter_heads result [1, 2S, HL, D] whose token stride is `token_stride` elements
/// (HL * D: the slot as is; 2 * HL * D: out= into a view with the token stride doubled), as
/// read back, on rank `r` of 2 ranks whose inputs held x[s, h, d] = rank * 100000 +
/// (s * H + h) * D + d. "" or the first wrong element.
inline std::string CheckScatterOut(const std::vector<float>& out, int r, int S, int H, int HL,
                                   int D, int token_stride) {
  for (int g = 0; g < 2 * S; ++g)
    for (int h = 0; h < HL; ++h)
      for (int d = 0; d < D; ++d) {
        const int src = g / S, s = g % S;
        const float want = static_cast<float>(src * 100000 + (s * H + r * HL + h) * D + d);
        const float have = out[static_cast<size_t>(g) * token_stride + h * D + d];
        if (have != want) return StrCat("out[", g, ",", h, ",", d, "] = ", have);
      }
  return "";
}

}  // namespace ulysses::testing_util
