// The budget of log lines a client or a socket can make the daemon write.
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "ulysses/common/logging.h"

namespace ulysses {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000000);

TEST(LogBudget, WritesItsBurstThenCountsWhatItDrops) {
  LogBudget budget(3, absl::Seconds(10));
  const uint64_t before = LogLinesDropped();
  uint64_t dropped = 99;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(budget.Take(&dropped, kStart)) << i;
    EXPECT_EQ(dropped, 0u);
  }
  for (int i = 0; i < 7; ++i) EXPECT_FALSE(budget.Take(&dropped, kStart + absl::Seconds(i)));
  EXPECT_EQ(LogLinesDropped() - before, 7u);
  // One line's worth back after `every`: the line says how many were dropped before it.
  ASSERT_TRUE(budget.Take(&dropped, kStart + absl::Seconds(10)));
  EXPECT_EQ(dropped, 7u);
  EXPECT_FALSE(budget.Take(&dropped, kStart + absl::Seconds(11)));
  ASSERT_TRUE(budget.Take(&dropped, kStart + absl::Seconds(20)));
  EXPECT_EQ(dropped, 1u);
}

TEST(LogBudget, RefillsNoFurtherThanItsBurst) {
  LogBudget budget(2, absl::Seconds(1));
  EXPECT_TRUE(budget.Take(nullptr, kStart));
  EXPECT_TRUE(budget.Take(nullptr, kStart));
  // An hour quiet gives back the burst, not an hour of lines.
  const absl::Time later = kStart + absl::Hours(1);
  EXPECT_TRUE(budget.Take(nullptr, later));
  EXPECT_TRUE(budget.Take(nullptr, later));
  EXPECT_FALSE(budget.Take(nullptr, later));
}

TEST(LogBudget, AClockThatStepsBackGivesNothingBack) {
  LogBudget budget(1, absl::Seconds(1));
  EXPECT_TRUE(budget.Take(nullptr, kStart));
  EXPECT_FALSE(budget.Take(nullptr, kStart - absl::Hours(1)));
  EXPECT_FALSE(budget.Take(nullptr, kStart + absl::Milliseconds(500)));
  EXPECT_TRUE(budget.Take(nullptr, kStart + absl::Seconds(1)));
}

TEST(LogBudget, ThreadsShareOneBudget) {
  LogBudget budget(5, absl::Hours(1));
  std::atomic<int> written{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i)
        if (budget.Take(nullptr, kStart)) written.fetch_add(1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(written.load(), 5);
}

TEST(DroppedNote, SaysHowManyOnlyWhenAny) {
  EXPECT_EQ(DroppedNote(0), "");
  EXPECT_EQ(DroppedNote(12), " (12 more such lines not logged)");
}

}  // namespace
}  // namespace ulysses
