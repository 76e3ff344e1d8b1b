// The rendezvous table's answers (none holds a thread), and whom they end for when an arriving
// daemon goes away. The rendezvous client's channels: one per member address was kept for
// ever (10 MB more per 300 addresses a client made the daemon dial). And the address it dials for a member: that
// daemon's node socket, whatever form of unix address names its control socket.
#include "rendezvous.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

TEST(ChannelCacheTest, HoldsAtMostItsCapacityDroppingTheLeastRecentlyUsed) {
  ChannelCache cache(4, absl::Minutes(5));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto kept = cache.Get("/run/a.sock", t0);
  for (int i = 0; i < 300; ++i) {
    (void)cache.Get(StrCat("/tmp/member-", i, ".sock"), t0 + absl::Seconds(i + 1));
    (void)cache.Get("/run/a.sock", t0 + absl::Seconds(i + 1));  // in use all along
    EXPECT_LE(cache.size(), 4u);
  }
  EXPECT_TRUE(cache.contains("/run/a.sock"));
  EXPECT_FALSE(cache.contains("/tmp/member-0.sock"));
  EXPECT_TRUE(cache.contains("/tmp/member-299.sock"));
  // The same address gets the same channel while it is kept.
  EXPECT_EQ(cache.Get("/run/a.sock", t0 + absl::Seconds(301)), kept);
}

TEST(ChannelCacheTest, ChannelsUnusedPastTheIdleTimeAreDropped) {
  ChannelCache cache(64, absl::Minutes(5));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 10; ++i) (void)cache.Get(StrCat("/tmp/m", i, ".sock"), t0);
  (void)cache.Get("/run/b.sock", t0 + absl::Minutes(4));
  EXPECT_EQ(cache.size(), 11u);
  (void)cache.Get("/run/b.sock", t0 + absl::Minutes(6));
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_TRUE(cache.contains("/run/b.sock"));
}

TEST(ChannelCacheTest, ClearDropsEveryChannelAndAHeldOneStaysUsable) {
  ChannelCache cache(8, absl::Minutes(5));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::shared_ptr<grpc::Channel> held = cache.Get("/run/c.sock", t0);
  (void)cache.Get("/run/d.sock", t0);
  cache.clear();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_FALSE(cache.contains("/run/c.sock"));
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held.use_count(), 1);  // the cache let go of it; the caller's copy is whole
  (void)held->GetState(false);
  // The next use makes a new channel.
  EXPECT_NE(cache.Get("/run/c.sock", t0 + absl::Seconds(1)), held);
}

TEST(NodeSocketAddressTest, EachUnixFormGetsTheSuffixOnItsPath) {
  struct Case {
    const char* member;
    const char* node;
    const char* target;
  };
  const Case cases[] = {
      {"/run/ulysses/gpu0.sock", "/run/ulysses/gpu0.sock.node",
       "unix:///run/ulysses/gpu0.sock.node"},
      {"unix:///run/ulysses/gpu0.sock", "unix:///run/ulysses/gpu0.sock.node",
       "unix:///run/ulysses/gpu0.sock.node"},
      {"unix:/run/ulysses/gpu0.sock", "unix:/run/ulysses/gpu0.sock.node",
       "unix:/run/ulysses/gpu0.sock.node"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> node = NodeSocketAddress(c.member);
    ASSERT_TRUE(node.ok()) << c.member << ": " << node.status();
    EXPECT_EQ(*node, c.node);
    EXPECT_EQ(GrpcTarget(*node), c.target);
  }
}

TEST(NodeSocketAddressTest, AnAddressThatIsNoUnixSocketHasNone) {
  for (const char* member : {"127.0.0.1:9", "dns:///example.org:80", ""}) {
    absl::StatusOr<std::string> node = NodeSocketAddress(member);
    EXPECT_EQ(node.status().code(), absl::StatusCode::kInvalidArgument) << member;
  }
  RendezvousClient client;
  absl::StatusOr<std::vector<std::string>> out =
      client.Rendezvous("127.0.0.1:9", "k", 1, 0, "a", "p", absl::Seconds(1));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_EQ(client.Abort("127.0.0.1:9", "k", "r").code(), absl::StatusCode::kInvalidArgument);
}

// The table's waits. None holds a thread: each arrival is answered through its callback, by
// whoever decides the step. Most waits here have an hour's deadline, so that only what the
// test does can end them. ctest bounds these tests.
using Verdict = RendezvousTable::Verdict;

// One arrival's answers, as the table gives them to its callback.
class Answer {
 public:
  RendezvousTable::Done Callback() {
    return [this](Verdict v) {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      verdict_ = std::move(v);
      cv_.notify_all();
    };
  }
  // The verdict, waiting at most 20 s for one (for the deadline thread's).
  Verdict Get() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(20), [&] { return verdict_.has_value(); });
    return verdict_.value_or(absl::UnknownError("no verdict"));
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Verdict> verdict_;
  int calls_ = 0;
};

TEST(RendezvousTableTest, TheArrivalThatCompletesTheStepAnswersEveryRankBeforeItReturns) {
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  Answer a0, a1;
  ASSERT_TRUE(table.Arrive("k", 2, 1, "a", "p1", hour, a1.Callback()).ok());
  EXPECT_EQ(a1.calls(), 0);
  EXPECT_EQ(table.waiting(), 1u);
  EXPECT_EQ(table.pending(), 1u);
  ASSERT_TRUE(table.Arrive("k", 2, 0, "a", "p0", hour, a0.Callback()).ok());
  EXPECT_EQ(a0.calls(), 1);
  EXPECT_EQ(a1.calls(), 1);
  for (Answer* a : {&a0, &a1}) {
    Verdict v = a->Get();
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, (std::vector<std::string>{"p0", "p1"}));
  }
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_EQ(table.waiting(), 0u);
}

// One uid's clients may open a quarter of the keys the table holds pending; other uids, and
// arrivals at keys already open, are still taken, and a key decided gives its place back.
TEST(RendezvousTableTest, OneUidOpensNoMoreThanItsShareOfTheTable) {
  std::vector<std::unique_ptr<Answer>> answers;  // outlives the table, which answers them last
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  auto arrive = [&](const std::string& key, int rank, std::optional<uint32_t> uid) {
    answers.push_back(std::make_unique<Answer>());
    return table.Arrive(key, 2, rank, "a", "p", hour, answers.back()->Callback(), uid);
  };
  for (size_t i = 0; i < kMaxPendingRendezvousPerUid; ++i)
    ASSERT_TRUE(arrive(StrCat("join/a", i), 0, 1000).ok()) << i;
  absl::StatusOr<uint64_t> past = arrive("join/one-more", 0, 1000);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kResourceExhausted) << past.status();
  EXPECT_NE(past.status().message().find("uid 1000"), std::string::npos) << past.status();
  EXPECT_EQ(table.pending(), kMaxPendingRendezvousPerUid);
  // Another uid, an arrival of no known uid, and uid 1000 at a key another opened: all taken.
  EXPECT_TRUE(arrive("join/b", 0, 2000).ok());
  EXPECT_TRUE(arrive("join/c", 0, std::nullopt).ok());
  EXPECT_TRUE(arrive("join/b", 1, 1000).ok());  // completes join/b
  EXPECT_TRUE(arrive("join/a0", 1, 1000).ok());  // completes join/a0: its place comes back
  EXPECT_TRUE(arrive("join/one-more", 0, 1000).ok());
  EXPECT_EQ(arrive("join/two-more", 0, 1000).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(RendezvousTableTest, AnArrivalWhoseSenderWentAwayAbortsTheKeyForEveryRankNamingIt) {
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  Answer a0, a1;
  ASSERT_TRUE(table.Arrive("join/g", 3, 0, "a", "p0", hour, a0.Callback()).ok());
  absl::StatusOr<uint64_t> rank1 = table.Arrive("join/g", 3, 1, "a", "p1", hour, a1.Callback());
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  EXPECT_EQ(table.waiting(), 2u);
  table.Cancel(*rank1);
  for (Answer* a : {&a0, &a1}) {
    ASSERT_EQ(a->calls(), 1);
    Verdict v = a->Get();
    EXPECT_EQ(v.status().code(), absl::StatusCode::kAborted) << v.status();
    EXPECT_NE(v.status().message().find("rank 1's daemon went away"), std::string::npos)
        << v.status();
  }
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_EQ(table.waiting(), 0u);
  // The key is free again: rank 2, arriving late, meets a new step and not the aborted one.
  Answer late;
  ASSERT_TRUE(table.Arrive("join/g", 1, 0, "a", "p", hour, late.Callback()).ok());
  EXPECT_TRUE(late.Get().ok()) << late.Get().status();
}

TEST(RendezvousTableTest, ASenderThatWentAwayChangesNothingOnceTheVerdictIsIn) {
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  // Its arrival completes the step: every rank has the payloads.
  Answer a0, a1;
  absl::StatusOr<uint64_t> r0 = table.Arrive("k", 2, 0, "a", "p0", hour, a0.Callback());
  absl::StatusOr<uint64_t> r1 = table.Arrive("k", 2, 1, "a", "p1", hour, a1.Callback());
  ASSERT_TRUE(r0.ok() && r1.ok());
  table.Cancel(*r1);
  table.Cancel(*r0);
  for (Answer* a : {&a0, &a1}) {
    EXPECT_EQ(a->calls(), 1);
    ASSERT_TRUE(a->Get().ok()) << a->Get().status();
    EXPECT_EQ(*a->Get(), (std::vector<std::string>{"p0", "p1"}));
  }
  // Its arrival gives the step another verdict: that one stands for every rank.
  Answer m0, m1;
  r0 = table.Arrive("m", 2, 0, "a", "p0", hour, m0.Callback());
  r1 = table.Arrive("m", 2, 1, "b", "p1", hour, m1.Callback());
  ASSERT_TRUE(r0.ok() && r1.ok());
  table.Cancel(*r1);
  for (Answer* a : {&m0, &m1}) {
    EXPECT_EQ(a->calls(), 1);
    EXPECT_EQ(a->Get().status().code(), absl::StatusCode::kInvalidArgument) << a->Get().status();
    EXPECT_NE(a->Get().status().message().find("mismatch"), std::string::npos)
        << a->Get().status();
  }
  // An arrival refused on its fields never waits, so is never answered.
  Answer refused;
  EXPECT_EQ(table.Arrive("k", 2, 5, "a", "p", hour, refused.Callback()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.calls(), 0);
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(RendezvousTableTest, AWaitEndsAtTheEarliestDeadlineNamingTheMissingRanks) {
  RendezvousTable table;
  Answer a;
  ASSERT_TRUE(table.Arrive("k", 3, 1, "a", "p", absl::Now() + absl::Milliseconds(50), a.Callback())
                  .ok());
  Verdict v = a.Get();
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded) << v.status();
  EXPECT_NE(v.status().message().find("ranks [0,2]"), std::string::npos) << v.status();
  EXPECT_EQ(table.pending(), 0u);
  // Rank 0 would wait an hour; rank 1's deadline ends the step for both.
  Answer b0, b1;
  ASSERT_TRUE(table.Arrive("k", 3, 0, "a", "p", absl::Now() + absl::Hours(1), b0.Callback()).ok());
  ASSERT_TRUE(
      table.Arrive("k", 3, 1, "a", "p", absl::Now() + absl::Milliseconds(50), b1.Callback()).ok());
  for (Answer* x : {&b0, &b1}) {
    Verdict w = x->Get();
    EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
    EXPECT_NE(w.status().message().find("ranks [2]"), std::string::npos) << w.status();
  }
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(RendezvousTableTest, AbortAndTheTablesEndAnswerEveryRankWaiting) {
  const absl::Time hour = absl::Now() + absl::Hours(1);
  Answer a0, a1, left;
  {
    RendezvousTable table;
    ASSERT_TRUE(table.Arrive("k", 3, 0, "a", "p", hour, a0.Callback()).ok());
    ASSERT_TRUE(table.Arrive("k", 3, 2, "a", "p", hour, a1.Callback()).ok());
    ASSERT_TRUE(table.Abort("k", "rank 1's client went away").ok());
    for (Answer* a : {&a0, &a1}) {
      EXPECT_EQ(a->Get().status().code(), absl::StatusCode::kAborted);
      EXPECT_NE(a->Get().status().message().find("rank 1's client went away"), std::string::npos);
    }
    EXPECT_EQ(table.pending(), 0u);
    ASSERT_TRUE(table.Arrive("other", 2, 0, "a", "p", hour, left.Callback()).ok());
  }
  EXPECT_EQ(left.calls(), 1);
  EXPECT_EQ(left.Get().status().code(), absl::StatusCode::kAborted) << left.Get().status();
}

TEST(RendezvousTableTest, AnEndedGroupFailsItsWaitingAndItsLaterStepsButNoOtherGroups) {
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  Answer waiting, sibling, other, later;
  ASSERT_TRUE(table.Arrive("session/g/a1/0", 2, 0, "a", "p", hour, waiting.Callback()).ok());
  ASSERT_TRUE(table.Arrive("session/g/a1b/0", 2, 0, "a", "p", hour, sibling.Callback()).ok());
  ASSERT_TRUE(table.Arrive("session/h/a1/0", 2, 0, "a", "p", hour, other.Callback()).ok());
  ASSERT_TRUE(table.EndGroup("session/g/a1/", "group g ended: rank 1's client went away").ok());
  // The waiting step of that instance ends at once, naming why.
  EXPECT_EQ(waiting.calls(), 1);
  EXPECT_EQ(waiting.Get().status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(waiting.Get().status().message().find("rank 1's client went away"), std::string::npos)
      << waiting.Get().status();
  // Another instance whose key merely starts with the same characters, and another group, wait on.
  EXPECT_EQ(sibling.calls(), 0);
  EXPECT_EQ(other.calls(), 0);
  EXPECT_EQ(table.pending(), 2u);
  EXPECT_EQ(table.ended_groups(), 1u);
  // A later step of the ended instance is refused before it waits, and leaves no entry.
  absl::StatusOr<uint64_t> refused =
      table.Arrive("session/g/a1/1", 2, 0, "a", "p", hour, later.Callback());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_NE(refused.status().message().find("group g ended"), std::string::npos)
      << refused.status();
  EXPECT_EQ(later.calls(), 0);
  EXPECT_EQ(table.pending(), 2u);
  // The other keys still complete.
  Answer sibling1, other1;
  ASSERT_TRUE(table.Arrive("session/g/a1b/0", 2, 1, "a", "q", hour, sibling1.Callback()).ok());
  ASSERT_TRUE(table.Arrive("session/h/a1/0", 2, 1, "a", "q", hour, other1.Callback()).ok());
  EXPECT_TRUE(sibling.Get().ok()) << sibling.Get().status();
  EXPECT_TRUE(other.Get().ok()) << other.Get().status();
  EXPECT_EQ(table.pending(), 0u);
}

TEST(RendezvousTableTest, EndGroupChecksItsFieldsAndRemembersAtMostItsBound) {
  RendezvousTable table;
  EXPECT_EQ(table.EndGroup("session/g/a1", "r").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.EndGroup("", "r").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.EndGroup(std::string(kMaxRendezvousKeyBytes, '/') + "/", "r").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.EndGroup("session/g/a1/", std::string(kMaxRendezvousReasonBytes + 1, 'r')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.ended_groups(), 0u);
  for (size_t i = 0; i < kMaxEndedGroups + 10; ++i)
    ASSERT_TRUE(table.EndGroup(StrCat("session/g/", i, "/"), "r").ok());
  EXPECT_EQ(table.ended_groups(), kMaxEndedGroups);
  // The newest are kept.
  Answer a;
  EXPECT_EQ(table.Arrive(StrCat("session/g/", kMaxEndedGroups + 9, "/0"), 2, 0, "a", "p",
                         absl::Now() + absl::Hours(1), a.Callback())
                .status()
                .code(),
            absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace ulysses::daemon
