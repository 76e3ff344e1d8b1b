// The group's backend verdict: the same offers give the same verdict on every rank.
#include "ulysses/common/backend_choice.h"

#include <set>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "status_matchers.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kRefused = absl::StatusCode::kFailedPrecondition;

// Devices reach each other unless the ordered pair (from, to) is listed as blocked.
DeviceReach ReachExcept(std::set<std::pair<int32_t, int32_t>> blocked) {
  return [blocked](int32_t from, int32_t to) -> absl::StatusOr<bool> {
    return from == to || blocked.count({from, to}) == 0;
  };
}

std::vector<BackendOffer> Offers(const std::string& backend, bool nccl, int n) {
  std::vector<BackendOffer> out;
  for (int r = 0; r < n; ++r) out.push_back({backend, nccl, r, {}});
  return out;
}

TEST(BackendOfferTest, RoundTripsAndRefusesMalformedPayloadsNamingTheRank) {
  for (const BackendOffer& o : {BackendOffer{"nvlink", true, 3, {}}, BackendOffer{"nvlink", false, 0, {}},
                                BackendOffer{"host", false, 7, {}}, BackendOffer{"nccl", false, 1, {}}}) {
    auto back = DecodeOffer(EncodeOffer(o), 2);
    ASSERT_THAT(back.status(), IsOk()) << EncodeOffer(o);
    EXPECT_EQ(back->backend, o.backend);
    EXPECT_EQ(back->nccl, o.nccl);
    EXPECT_EQ(back->device, o.device);
  }
  EXPECT_EQ(EncodeOffer({"nvlink", true, 3, {}}), "nvlink+nccl:3");
  for (const char* bad : {"", "nvlink", "nvlink:", ":3", "+nccl:3", "nvlink:x", "nvlink:3/",
                          "nvlink:3/XYZ", "nvlink:3/0a/0b", "nvlink/0a:3"})
    EXPECT_THAT(DecodeOffer(bad, 2).status(),
                StatusIs(kRefused, HasSubstr("rank 2 sent a malformed join payload")))
        << bad;
}

TEST(BackendOfferTest, ANonceOfTheJoinTravelsWithTheOffer) {
  const BackendOffer o{"nvlink", true, 3, "00ff1234abcd"};
  EXPECT_EQ(EncodeOffer(o), "nvlink+nccl:3/00ff1234abcd");
  auto back = DecodeOffer(EncodeOffer(o), 0);
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ(back->instance, "00ff1234abcd");
  EXPECT_EQ(back->device, 3);
  EXPECT_TRUE(back->nccl);
  // An offer without one (a daemon of a release before it) still decodes.
  auto old = DecodeOffer("host:1", 0);
  ASSERT_THAT(old.status(), IsOk());
  EXPECT_EQ(old->instance, "");
  EXPECT_THAT(DecodeOffer(StrCat("host:1/", std::string(kMaxOfferInstanceChars + 1, 'a')), 1).status(),
              StatusIs(kRefused, HasSubstr("rank 1 sent a malformed join payload")));
}

TEST(GroupBackendTest, PeersThatAllReachRunNvlink) {
  auto v = ChooseGroupBackend("auto", Offers("nvlink", true, 4), ReachExcept({}));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_EQ(v->backend, "nvlink");
  EXPECT_THAT(v->reason, HasSubstr("auto: every pair of ranks' devices maps"));
  v = ChooseGroupBackend("nvlink", Offers("nvlink", false, 2), ReachExcept({}));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_EQ(v->backend, "nvlink");
}

TEST(GroupBackendTest, AutoFallsBackToNcclNamingThePairThatDoesNotReach) {
  // One direction of one pair is enough.
  auto v = ChooseGroupBackend("auto", Offers("nvlink", true, 4), ReachExcept({{1, 3}}));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_EQ(v->backend, "nccl");
  EXPECT_EQ(v->reason,
            "auto: rank 3's device 3 cannot map rank 1's device 1 (no peer access), so nccl");
}

TEST(GroupBackendTest, NoFallbackWhenARankHasNoNccl) {
  std::vector<BackendOffer> offers = Offers("nvlink", true, 3);
  offers[2].nccl = false;
  EXPECT_THAT(ChooseGroupBackend("auto", offers, ReachExcept({{0, 1}})).status(),
              StatusIs(kRefused, AllOf(HasSubstr("nvlink cannot run this group"),
                                       HasSubstr("rank 2's daemon has no nccl backend"))));
  EXPECT_THAT(ChooseGroupBackend("nccl", offers, ReachExcept({})).status(),
              StatusIs(kRefused, HasSubstr("rank 2's daemon runs nvlink without nccl")));
  // All reachable: nvlink needs no fallback.
  auto v = ChooseGroupBackend("auto", offers, ReachExcept({}));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_EQ(v->backend, "nvlink");
}

TEST(GroupBackendTest, ForcedNvlinkThatCannotReachIsRefused) {
  EXPECT_THAT(
      ChooseGroupBackend("nvlink", Offers("nvlink", true, 2), ReachExcept({{0, 1}})).status(),
      StatusIs(kRefused, HasSubstr("nvlink cannot run this group: rank 1's device 1 "
                                   "cannot map rank 0's device 0")));
}

TEST(GroupBackendTest, NcclAskedForRunsOnEveryDaemonThatOffersIt) {
  auto v = ChooseGroupBackend("nccl", Offers("nvlink", true, 2), ReachExcept({}));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_EQ(v->backend, "nccl");
  EXPECT_EQ(v->reason, "requested nccl: every rank's daemon also runs nccl");
  v = ChooseGroupBackend("auto", Offers("nccl", false, 2), ReachExcept({{0, 1}}));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_EQ(v->backend, "nccl");
}

TEST(GroupBackendTest, RanksOnDifferentBackendsOrAnUnofferedOneAreRefused) {
  std::vector<BackendOffer> offers = Offers("nvlink", true, 3);
  offers[1].backend = "host";
  EXPECT_THAT(ChooseGroupBackend("auto", offers, ReachExcept({})).status(),
              StatusIs(kRefused, HasSubstr("rank 1 runs 'host', rank 0 'nvlink'")));
  EXPECT_THAT(
      ChooseGroupBackend("nvlink", Offers("host", false, 2), ReachExcept({})).status(),
      StatusIs(kRefused, HasSubstr("'nvlink' asked for, but every rank's daemon runs host")));
  EXPECT_THAT(
      ChooseGroupBackend("host", Offers("nvlink", true, 2), ReachExcept({})).status(),
      StatusIs(kRefused, HasSubstr("'host' asked for, but every rank's daemon runs nvlink")));
}

TEST(GroupBackendTest, AReachProbeErrorIsReturned) {
  const DeviceReach broken = [](int32_t, int32_t) -> absl::StatusOr<bool> {
    return absl::InternalError("cudaDeviceCanAccessPeer failed");
  };
  EXPECT_EQ(ChooseGroupBackend("auto", Offers("nvlink", true, 2), broken).status().code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace ulysses
