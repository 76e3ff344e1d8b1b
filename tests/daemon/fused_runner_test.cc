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

// What a session loads when it opens: every path its calls of 1 to max_tokens rows take, each
// up to the most rows it takes (the auto rule switches from per_operator to epilogue at 512
// rows with the epilogue GEMM, and takes per_operator alone without it).
TEST(FusedRunnerTest, PathsUpToAreEveryPathTheRuleGivesWithItsMostRows) {
  using P = std::vector<std::pair<FusedPath, int64_t>>;
  const std::string none, unavailable = "not sm_90";
  const FusedExchange stores = FusedExchange::kPlanStores;
  EXPECT_EQ(FusedRunner::PathsUpTo(FusedPath::kAuto, stores, none, 16384),
            P({{FusedPath::kPerOperator, 511}, {FusedPath::kEpilogue, 16384}}));
  EXPECT_EQ(FusedRunner::PathsUpTo(FusedPath::kAuto, stores, none, 512),
            P({{FusedPath::kPerOperator, 511}, {FusedPath::kEpilogue, 512}}));
  EXPECT_EQ(FusedRunner::PathsUpTo(FusedPath::kAuto, stores, none, 500),
            P({{FusedPath::kPerOperator, 500}}));
  EXPECT_EQ(FusedRunner::PathsUpTo(FusedPath::kAuto, stores, unavailable, 16384),
            P({{FusedPath::kPerOperator, 16384}}));
  EXPECT_EQ(FusedRunner::PathsUpTo(FusedPath::kAuto, FusedExchange::kTransportMoves, none, 9000),
            P({{FusedPath::kPerOperator, 9000}}));
  for (FusedPath asked : {FusedPath::kPerOperator, FusedPath::kChunked, FusedPath::kEpilogue}) {
    SCOPED_TRACE(FusedPathName(asked));
    EXPECT_EQ(FusedRunner::PathsUpTo(asked, stores, none, 3000), P({{asked, 3000}}));
  }
  // The rule itself at each side of its threshold, and where no epilogue GEMM exists.
  EXPECT_EQ(FusedRunner::Rule(FusedPath::kAuto, stores, none, 1).path, FusedPath::kPerOperator);
  EXPECT_EQ(FusedRunner::Rule(FusedPath::kAuto, stores, none, 511).path, FusedPath::kPerOperator);
  EXPECT_EQ(FusedRunner::Rule(FusedPath::kAuto, stores, none, 512).path, FusedPath::kEpilogue);
  EXPECT_EQ(FusedRunner::Rule(FusedPath::kAuto, stores, unavailable, 4095).path,
            FusedPath::kPerOperator);
  const FusedRunner::Prepared large = FusedRunner::Rule(FusedPath::kAuto, stores, unavailable, 32768);
  EXPECT_EQ(large.path, FusedPath::kPerOperator);
  EXPECT_NE(large.why.find("no epilogue GEMM (not sm_90)"), std::string::npos) << large.why;
}

// Auto never takes the chunked path, at any row count, with the epilogue GEMM or without it;
// a session asking for it gets it, and the reason says so.
TEST(FusedRunnerTest, AutoNeverTakesTheChunkedPathButASessionMayAskForIt) {
  const FusedExchange stores = FusedExchange::kPlanStores;
  for (const std::string& no_epilogue : {std::string(), std::string("not sm_90")}) {
    for (int64_t rows = 1; rows <= 65536; rows += rows < 4096 ? 1 : 97) {
      ASSERT_NE(FusedRunner::Rule(FusedPath::kAuto, stores, no_epilogue, rows).path,
                FusedPath::kChunked)
          << rows << " rows, no_epilogue \"" << no_epilogue << "\"";
    }
  }
  const FusedRunner::Prepared asked = FusedRunner::Rule(FusedPath::kChunked, stores, "", 777);
  EXPECT_EQ(asked.path, FusedPath::kChunked);
  EXPECT_EQ(asked.why, "the session asks for chunked");
  // RunsChunked (whether a session's plan takes a second stream) agrees with the rule.
  for (FusedExchange exchange : {stores, FusedExchange::kTransportMoves}) {
    for (FusedPath path : {FusedPath::kAuto, FusedPath::kPerOperator, FusedPath::kChunked,
                           FusedPath::kEpilogue}) {
      for (const std::string& no_epilogue : {std::string(), std::string("not sm_90")}) {
        bool chunked = false;
        for (const auto& [p, most] : FusedRunner::PathsUpTo(path, exchange, no_epilogue, 65536))
          chunked = chunked || p == FusedPath::kChunked;
        EXPECT_EQ(FusedRunner::RunsChunked(path, exchange), chunked)
            << FusedPathName(path) << ", no_epilogue \"" << no_epilogue << "\"";
      }
    }
  }
}

}  // namespace
}  // namespace ulysses::daemon
