// The rendezvous client's channels: one per member address was kept for ever (10 MB more per
// 300 addresses a client made the daemon dial).
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

}  // namespace
}  // namespace ulysses::daemon
