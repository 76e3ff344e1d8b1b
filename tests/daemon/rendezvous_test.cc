// The rendezvous client's channels: one per member address was kept for ever (10 MB more per
// 300 addresses a client made the daemon dial). And the address it dials for a member: that
// daemon's node socket, whatever form of unix address names its control socket.
#include "rendezvous.h"

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

}  // namespace
}  // namespace ulysses::daemon
