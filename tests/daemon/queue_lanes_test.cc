// QueueLanes: the daemon's streams of a device by hardware queue, from a probe's classes.
#include "queue_lanes.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <set>
#include <thread>

namespace ulysses::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

// Stream handles are opaque: small integers stand for them.
void* S(uintptr_t i) { return reinterpret_cast<void*>(i); }

// Makes streams 1000, 1001, ... and records each one's priority.
struct Maker {
  uintptr_t next = 1000;
  std::vector<bool> greatest;
  bool fail = false;
  QueueLanes::MakeStream Fn() {
    return [this](bool g) -> absl::StatusOr<void*> {
      if (fail) return absl::InternalError("cudaStreamCreate: out of resources");
      greatest.push_back(g);
      return S(next++);
    };
  }
};

// Queues 0..3; the rescue stream is on queue 0. Default-priority streams 1..6, greatest 11..12.
std::vector<ProbedStream> FourQueues() {
  return {{S(1), false, 1}, {S(2), false, 2}, {S(3), false, 3}, {S(4), false, 0},
          {S(5), false, 1}, {S(6), false, 2}, {S(11), true, 3},  {S(12), true, 1}};
}

TEST(QueueLanesTest, GroupsTheStreamsByQueueAndKeepsNoneOnTheRescueQueue) {
  Maker m;
  QueueLanes lanes(FourQueues(), /*rescue_queue=*/0, /*sharing=*/true, m.Fn());
  const QueueLaneCounts c = lanes.counts();
  EXPECT_TRUE(c.probed);
  EXPECT_EQ(c.queues, 4);
  EXPECT_EQ(c.lanes, 3);
  // Stream 4 shares the rescue stream's queue: it serves nobody.
  EXPECT_THAT(lanes.surplus(), UnorderedElementsAre(S(4)));
  EXPECT_THAT(lanes.AllStreams(),
              UnorderedElementsAre(S(1), S(2), S(3), S(5), S(6), S(11), S(12)));
  EXPECT_THAT(lanes.Describe(), HasSubstr("4 hardware queues found"));
}

TEST(QueueLanesTest, SessionsOpenAtOnceGetDistinctQueues) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, true, m.Fn());
  std::set<void*> taken;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<void*> s = lanes.Take(StreamRole::kSession);
    ASSERT_TRUE(s.ok()) << s.status();
    taken.insert(*s);
  }
  EXPECT_EQ(taken, (std::set<void*>{S(1), S(2), S(3)}));
  EXPECT_EQ(lanes.counts().lanes_in_use, 3);
  EXPECT_EQ(lanes.counts().shared_streams, 0u);
  EXPECT_EQ(lanes.Where(S(2)), "hardware queue 2 of the 3 for sessions, its own");
  EXPECT_FALSE(lanes.Shared(S(2)));
}

TEST(QueueLanesTest, ASecondStreamTakesAGreatestPriorityStreamOnAFreeQueue) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, true, m.Fn());
  auto session = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(session.ok());
  EXPECT_EQ(*session, S(1));  // lanes never taken go in queue order
  // Queue 1 is in use: its greatest-priority stream 12 is not handed out; queue 3's 11 is.
  auto second = lanes.Take(StreamRole::kSecond);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, S(11));
  // Queue 3 is in use now as well: the last free lane, queue 2, has no greatest-priority
  // stream, so a second stream gets its default-priority one (its own queue before priority).
  auto another = lanes.Take(StreamRole::kSecond);
  ASSERT_TRUE(another.ok());
  EXPECT_EQ(*another, S(2));
}

TEST(QueueLanesTest, AStreamGivenBackServesTheNextSession) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, true, m.Fn());
  auto a = lanes.Take(StreamRole::kSession);
  auto b = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(a.ok() && b.ok());
  lanes.Give(*a);
  lanes.Give(*b);
  // Sessions in turn reuse the lane given back last: no further queue runs work.
  for (int i = 0; i < 3; ++i) {
    auto s = lanes.Take(StreamRole::kSession);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*s, *b);
    lanes.Give(*s);
  }
  EXPECT_EQ(lanes.counts().streams_used, 2u);
  EXPECT_EQ(lanes.counts().lanes_in_use, 0);
}

// A stream whose work never ended (a session kept after its drain gave up) retires its queue:
// never handed out again, free or shared, though its spares are idle; the other queues serve.
TEST(QueueLanesTest, ARetiredStreamsQueueServesNoLaterSession) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, /*sharing=*/true, m.Fn());
  auto held = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(*held, S(1));  // queue 1, with spares 5 and 12
  EXPECT_TRUE(lanes.Retire(*held));
  std::set<void*> later;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<void*> s = lanes.Take(i % 2 == 0 ? StreamRole::kSession : StreamRole::kSecond);
    if (s.ok()) later.insert(*s);
  }
  // Queues 2 and 3 alone: 2, 3, then their spares 6 and 11; none of queue 1's.
  EXPECT_EQ(later, (std::set<void*>{S(2), S(3), S(6), S(11)}));
  EXPECT_FALSE(lanes.Take(StreamRole::kSession).ok()) << "queue 1's spare 5 was handed out";
  for (void* s : later) lanes.Give(s);
  auto again = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, S(5));
  EXPECT_EQ(lanes.counts().lanes_in_use, 2);  // the retired queue, and `again`'s
  // A stream not handed out, or made without the probe, retires nothing.
  EXPECT_FALSE(lanes.Retire(S(99)));
}

TEST(QueueLanesTest, PastTheFreeLanesSharingTakesASpareOfTheLeastUsedQueue) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, /*sharing=*/true, m.Fn());
  std::vector<void*> sessions;
  for (int i = 0; i < 3; ++i) sessions.push_back(*lanes.Take(StreamRole::kSession));
  // Every queue has a user: spares share a queue (queue 1's stream 5, then queue 2's 6), never
  // the rescue stream's (stream 4), and no stream is made while a spare is idle.
  auto a = lanes.Take(StreamRole::kSession);
  auto b = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, S(5));
  EXPECT_EQ(*b, S(6));
  EXPECT_EQ(lanes.counts().shared_streams, 2u);
  EXPECT_EQ(lanes.Where(S(5)), "hardware queue 1 of the 3 for sessions, shared with 1 more stream");
  EXPECT_TRUE(lanes.Shared(S(5)));
  EXPECT_TRUE(lanes.Shared(S(1)));  // the first user of queue 1 now shares it too
  EXPECT_FALSE(lanes.Shared(S(3)));
  // Second streams: queue 3 has one user, queue 1 two, so queue 3's stream 11 goes first,
  // then queue 1's 12.
  auto c = lanes.Take(StreamRole::kSecond);
  auto d = lanes.Take(StreamRole::kSecond);
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_EQ(*c, S(11));
  EXPECT_EQ(*d, S(12));
  // No spare left: refused (a stream made now could share the rescue stream's queue), naming
  // the setting that gives more.
  auto none = lanes.Take(StreamRole::kSession);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(none.status().message(), HasSubstr("queues.probe_streams"));
  EXPECT_TRUE(m.greatest.empty()) << "a stream was made";
  EXPECT_EQ(lanes.counts().shared_streams, 4u);
  EXPECT_EQ(lanes.counts().refused, 1u);
  EXPECT_EQ(lanes.counts().lanes_in_use, 3);
  // Queue 2's users go: it is free again, and the next session has it to itself.
  lanes.Give(sessions[1]);
  lanes.Give(*b);
  EXPECT_EQ(lanes.counts().lanes_in_use, 2);
  auto alone = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(alone.ok());
  EXPECT_TRUE(*alone == S(2) || *alone == S(6)) << *alone;
  EXPECT_EQ(lanes.counts().shared_streams, 4u);
}

// Past the free lanes, a session shares a lane whose session finished its setup rather than
// one whose session is still in it (its setup's wait would sit behind the newcomer's waiting
// call), even where that lane is the more used; only when every lane is in a setup does it
// share one of those. A stream given back ends its setup too.
TEST(QueueLanesTest, PastTheFreeLanesASessionInItsSetupIsSharedLast) {
  Maker m;
  // Two queues besides the rescue stream's, queue 1 with two spares, queue 2 with one.
  QueueLanes lanes({{S(1), false, 1}, {S(2), false, 2}, {S(3), false, 1}, {S(4), false, 2},
                    {S(5), false, 1}},
                   0, true, m.Fn());
  auto a = lanes.Take(StreamRole::kSession);  // queue 1
  auto b = lanes.Take(StreamRole::kSession);  // queue 2
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(*a, S(1));
  ASSERT_EQ(*b, S(2));
  lanes.SetupDone(*b);
  // Both queues have one user; queue 1's is in its setup, so queue 2 is shared.
  auto c = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, S(4));
  EXPECT_FALSE(lanes.Shared(*a));
  EXPECT_TRUE(lanes.Shared(*b));
  // Queue 2 has no spare left and queue 1's session is still in its setup: it is shared now,
  // there being no other.
  auto d = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, S(3));
  EXPECT_TRUE(lanes.Shared(*a));
  // Giving a stream back ends its setup: a's goes, and queue 1's one user is d, in its
  // setup; queue 2's one user is b, set up (c given back). Queue 2 is shared again.
  lanes.Give(*a);
  lanes.Give(*c);
  auto e = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(*e, S(4));
  EXPECT_EQ(lanes.counts().shared_streams, 3u);
}

TEST(QueueLanesTest, ASecondStreamNeverSharesItsOwnSessionsQueue) {
  Maker m;
  // Two queues besides the rescue stream's, each with a spare.
  QueueLanes lanes({{S(1), false, 1}, {S(2), false, 2}, {S(3), false, 1}, {S(4), true, 2}}, 0,
                   true, m.Fn());
  auto other = lanes.Take(StreamRole::kSession);  // queue 1
  auto mine = lanes.Take(StreamRole::kSession);   // queue 2
  ASSERT_TRUE(other.ok() && mine.ok());
  ASSERT_EQ(*other, S(1));
  ASSERT_EQ(*mine, S(2));
  // Queue 2's greatest-priority spare would match the role, but it is the session's own
  // queue: queue 1's spare is taken instead.
  auto second = lanes.Take(StreamRole::kSecond, *mine);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, S(3));
  // Only the session's own queue has a spare left: refused rather than shared with it.
  EXPECT_FALSE(lanes.Take(StreamRole::kSecond, *mine).ok());
  EXPECT_TRUE(lanes.Take(StreamRole::kSecond).ok());
}

TEST(QueueLanesTest, PastTheLanesRefuseNamesTheSettingAndMakesNothing) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, /*sharing=*/false, m.Fn());
  std::vector<void*> held;
  for (int i = 0; i < 3; ++i) held.push_back(*lanes.Take(StreamRole::kSession));
  auto refused = lanes.Take(StreamRole::kSession);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("queues.sharing"));
  EXPECT_TRUE(m.greatest.empty()) << "a stream was made";
  EXPECT_EQ(lanes.counts().refused, 1u);
  EXPECT_FALSE(lanes.TakeFree(StreamRole::kSession).has_value());
  // A lane given back serves again.
  lanes.Give(held[1]);
  auto s = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, held[1]);
}

TEST(QueueLanesTest, AStreamThatCannotBeMadeIsTheError) {
  Maker m;
  m.fail = true;
  QueueLanes lanes(m.Fn());
  auto s = lanes.Take(StreamRole::kSession);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("out of resources"));
  EXPECT_EQ(lanes.counts().streams_used, 0u);
}

TEST(QueueLanesTest, WithoutAProbeStreamsAreMadeAsNeededAndReused) {
  Maker m;
  QueueLanes lanes(m.Fn());
  EXPECT_FALSE(lanes.counts().probed);
  EXPECT_FALSE(lanes.TakeFree(StreamRole::kSession).has_value());
  auto a = lanes.Take(StreamRole::kSession);
  auto b = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  lanes.Give(*a);
  auto c = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, *a);
  EXPECT_EQ(lanes.counts().streams_used, 2u);
  EXPECT_EQ(lanes.counts().lanes, 0);
  EXPECT_THAT(lanes.Describe(), HasSubstr("not probed"));
  EXPECT_THAT(lanes.Where(*a), HasSubstr("without the hardware queue probe"));
  EXPECT_TRUE(lanes.Shared(*a));  // its queue is not known
}

TEST(QueueLanesTest, WithoutAProbeAStreamIsReusedOnlyForItsOwnPriority) {
  Maker m;
  QueueLanes lanes(m.Fn());
  auto session = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(session.ok());
  lanes.Give(*session);
  // A fused plan's second stream is made at the greatest priority, not the idle session
  // stream, as the plan made its own before.
  auto second = lanes.Take(StreamRole::kSecond);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(*second, *session);
  EXPECT_EQ(m.greatest, (std::vector<bool>{false, true}));
  lanes.Give(*second);
  auto again = lanes.Take(StreamRole::kSession);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *session);
  EXPECT_FALSE(lanes.TakeFree(StreamRole::kSession).has_value());
  EXPECT_EQ(*lanes.TakeFree(StreamRole::kSecond), *second);
}

TEST(QueueLanesTest, ThreadsTakingAndGivingAtOnceNeverHoldOneStreamTwice) {
  Maker m;
  QueueLanes lanes(FourQueues(), 0, /*sharing=*/true, m.Fn());
  std::mutex mu;
  std::map<void*, int> holders;  // stream -> threads holding it now
  std::atomic<int> twice{0}, taken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const StreamRole role = (i + t) % 3 == 0 ? StreamRole::kSecond : StreamRole::kSession;
        absl::StatusOr<void*> s = lanes.Take(role);
        if (!s.ok()) continue;  // every probed stream in use at that moment
        taken.fetch_add(1);
        {
          std::lock_guard<std::mutex> lock(mu);
          if (++holders[*s] > 1) twice.fetch_add(1);
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          --holders[*s];
        }
        lanes.Give(*s);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(twice.load(), 0) << "a stream was handed to two holders at once";
  EXPECT_GT(taken.load(), 0);
  EXPECT_EQ(lanes.counts().lanes_in_use, 0);
  EXPECT_TRUE(m.greatest.empty()) << "a probed daemon made a stream";
}

}  // namespace
}  // namespace ulysses::daemon
