// FusedRunner's refusals, which come before any device work (so they run without a GPU): a
// transport that moves the result itself (nccl) runs the per-operator path only, and refuses
// the paths whose kernels store straight into the destinations' slots, naming `path`.
#include "fused_runner.h"

#include "gtest/gtest.h"
#include "ulysses/common/fused.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

FusedSetup SetupFor(FusedPath path) {
  FusedSetup s;
  s.geometry.world_size = 2;
  s.geometry.rank = 0;
  s.geometry.num_heads = 4;
  s.geometry.head_dim = kFusedGpuHeadDim;
  s.geometry.hidden = 4 * kFusedGpuHeadDim;
  s.geometry.max_pos = 64;
  s.geometry.max_tokens = 16;
  s.geometry.layout = QkvLayout::kBshd;
  s.path = path;
  return s;
}

TEST(FusedRunnerTest, ATransportThatMovesTheResultRefusesThePathsThatStoreIntoPeers) {
  for (FusedPath path : {FusedPath::kChunked, FusedPath::kEpilogue}) {
    SCOPED_TRACE(FusedPathName(path));
    auto runner = FusedRunner::Create(SetupFor(path), FusedExchange::kTransportMoves);
    ASSERT_FALSE(runner.ok());
    EXPECT_EQ(runner.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(runner.status().message().rfind(StrCat("path: ", FusedPathName(path)), 0), 0u)
        << runner.status();
  }
}

TEST(FusedRunnerTest, ThePerOperatorPathIsNotRefusedForItsPath) {
  // Without a device the plan itself cannot be made; what matters here is that the refusal
  // above is not what stops it.
  for (FusedPath path : {FusedPath::kAuto, FusedPath::kPerOperator}) {
    SCOPED_TRACE(FusedPathName(path));
    auto runner = FusedRunner::Create(SetupFor(path), FusedExchange::kTransportMoves);
    if (runner.ok()) continue;  // a machine with a GPU made the plan
    EXPECT_EQ(runner.status().message().find("path: "), std::string::npos) << runner.status();
  }
}

}  // namespace
}  // namespace ulysses::daemon
