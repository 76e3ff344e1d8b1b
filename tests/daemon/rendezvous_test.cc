// The rendezvous table's waits, and whom they end for when an arriving daemon goes away. The
// rendezvous client's channels: one per member address was kept for ever (10 MB more per
// 300 addresses a client made the daemon dial). And the address it dials for a member: that
// daemon's node socket, whatever form of unix address names its control socket.
#include "rendezvous.h"

#include <atomic>
#include <functional>
#include <thread>

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

// The table's waits: an hour's deadline each, so that only the sender's departure (a call
// cancelled when its daemon dies) can end them. ctest bounds these tests.
using Arrival = absl::StatusOr<std::vector<std::string>>;

bool AwaitWaiting(const RendezvousTable& t, size_t n) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (t.waiting() != n && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  return t.waiting() == n;
}

TEST(RendezvousTableTest, AnArrivalWhoseSenderWentAwayAbortsTheKeyForEveryRankNamingIt) {
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  std::atomic<bool> gone{false};
  const std::function<bool()> rank1_gone = [&] { return gone.load(); };
  Arrival r0 = absl::UnknownError("not run"), r1 = r0;
  std::thread t0([&] { r0 = table.Arrive("join/g", 3, 0, "a", "p0", hour); });
  std::thread t1([&] { r1 = table.Arrive("join/g", 3, 1, "a", "p1", hour, rank1_gone); });
  const bool both = AwaitWaiting(table, 2);
  EXPECT_TRUE(both);
  gone = true;
  if (!both) (void)table.Abort("join/g", "the ranks never arrived");
  t0.join();
  t1.join();
  for (const Arrival* r : {&r0, &r1}) {
    EXPECT_EQ(r->status().code(), absl::StatusCode::kAborted) << r->status();
    EXPECT_NE(r->status().message().find("rank 1's daemon went away"), std::string::npos)
        << r->status();
  }
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_EQ(table.waiting(), 0u);
  // The key is free again: rank 2, arriving late, meets a new step and not the aborted one.
  Arrival late = table.Arrive("join/g", 1, 0, "a", "p", hour);
  EXPECT_TRUE(late.ok()) << late.status();
}

TEST(RendezvousTableTest, ASenderThatWentAwayChangesNothingOnceTheVerdictIsIn) {
  RendezvousTable table;
  const absl::Time hour = absl::Now() + absl::Hours(1);
  const std::function<bool()> gone = [] { return true; };
  // Its arrival completes the step: every rank has the payloads.
  Arrival r0 = absl::UnknownError("not run");
  std::thread t0([&] { r0 = table.Arrive("k", 2, 0, "a", "p0", hour); });
  ASSERT_TRUE(AwaitWaiting(table, 1));
  Arrival r1 = table.Arrive("k", 2, 1, "a", "p1", hour, gone);
  t0.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(*r0, (std::vector<std::string>{"p0", "p1"}));
  EXPECT_EQ(*r1, *r0);
  // Its arrival gives the step another verdict: that one stands for every rank.
  std::thread t2([&] { r0 = table.Arrive("m", 2, 0, "a", "p0", hour); });
  ASSERT_TRUE(AwaitWaiting(table, 1));
  r1 = table.Arrive("m", 2, 1, "b", "p1", hour, gone);
  t2.join();
  for (const Arrival* r : {&r0, &r1}) {
    EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument) << r->status();
    EXPECT_NE(r->status().message().find("mismatch"), std::string::npos) << r->status();
  }
  // An arrival refused on its fields never waits, so never asks.
  int asked = 0;
  const std::function<bool()> counting = [&] { return ++asked > 0; };
  EXPECT_EQ(table.Arrive("k", 2, 5, "a", "p", hour, counting).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(RendezvousTableTest, AWaitWithoutASenderCheckEndsAtItsDeadlineNamingTheMissingRanks) {
  RendezvousTable table;
  const std::function<bool()> alive = [] { return false; };
  Arrival r = table.Arrive("k", 3, 1, "a", "p", absl::Now() + absl::Milliseconds(50), alive);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("ranks [0,2]"), std::string::npos) << r.status();
  r = table.Arrive("k", 3, 1, "a", "p", absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_EQ(table.pending(), 0u);
}

}  // namespace
}  // namespace ulysses::daemon
