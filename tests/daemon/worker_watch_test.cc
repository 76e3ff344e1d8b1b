// WorkerWatch: the stall watchdog's view of one ring worker (timeouts.worker_stall_ms).
#include "worker_watch.h"

#include "gtest/gtest.h"

namespace ulysses::daemon {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);
constexpr absl::Duration kLimit = absl::Seconds(10);

TEST(WorkerWatchTest, AStepPastTheLimitIsReportedOnceWithWhatItIs) {
  WorkerWatch w;
  w.Begin("executing a call", 42, kT0);
  EXPECT_FALSE(w.Check(kT0 + absl::Seconds(5), kLimit)) << "within the limit";
  EXPECT_FALSE(w.Check(kT0 + kLimit, kLimit)) << "at the limit exactly";
  std::optional<WorkerWatch::Stall> s = w.Check(kT0 + absl::Seconds(11), kLimit);
  ASSERT_TRUE(s);
  EXPECT_STREQ(s->what, "executing a call");
  EXPECT_EQ(s->session_id, 42u);
  EXPECT_EQ(s->running, absl::Seconds(11));
  EXPECT_FALSE(w.Check(kT0 + absl::Seconds(30), kLimit)) << "the same step again";
  // Its end says how long it ran, once.
  std::optional<absl::Duration> ran = w.End(kT0 + absl::Seconds(31));
  ASSERT_TRUE(ran);
  EXPECT_EQ(*ran, absl::Seconds(31));
  EXPECT_FALSE(w.End(kT0 + absl::Seconds(32))) << "said once";
}

TEST(WorkerWatchTest, AStepThatEndsInTimeIsNeverReported) {
  WorkerWatch w;
  w.Begin("polling its calls in flight", 7, kT0);
  EXPECT_FALSE(w.End(kT0 + absl::Seconds(3)));
  EXPECT_FALSE(w.Check(kT0 + absl::Hours(1), kLimit)) << "between steps nothing runs";
}

TEST(WorkerWatchTest, EachNewStepIsWatchedAfresh) {
  WorkerWatch w;
  w.Begin("executing a call", 1, kT0);
  ASSERT_TRUE(w.Check(kT0 + absl::Seconds(20), kLimit));
  ASSERT_TRUE(w.End(kT0 + absl::Seconds(21)));
  // The next step starts its own clock and is reported on its own.
  w.Begin("executing a call", 2, kT0 + absl::Seconds(22));
  EXPECT_FALSE(w.Check(kT0 + absl::Seconds(30), kLimit));
  std::optional<WorkerWatch::Stall> s = w.Check(kT0 + absl::Seconds(33), kLimit);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->session_id, 2u);
  EXPECT_EQ(s->running, absl::Seconds(11));
}

TEST(WorkerWatchTest, ALimitOfZeroWatchesNothing) {
  WorkerWatch w;
  w.Begin("executing a call", 1, kT0);
  EXPECT_FALSE(w.Check(kT0 + absl::Hours(1), absl::ZeroDuration()));
  EXPECT_FALSE(w.End(kT0 + absl::Hours(1)));
}

}  // namespace
}  // namespace ulysses::daemon
