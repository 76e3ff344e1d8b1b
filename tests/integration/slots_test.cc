// Receive-slot lifetimes against a real daemon: a held slot is never overwritten, the call that
// needs it waits for its release, results copied out release at once.
#include <cstring>
#include <thread>

#include "cluster_util.h"
#include "demo_lib.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "ulysses/client/client.h"
#include "ulysses/v1/admin.grpc.pb.h"

namespace ulysses {
namespace {

using ::testing::HasSubstr;

class Slots : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok());
    dir_ = *dir;
    auto d = demo::StartDaemon(ULYSSESD_PATH, dir_, 0, "host",
                               {"--call-timeout-ms", std::to_string(call_timeout_ms_)});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    client::ConnectOptions options{daemon_.socket(), "slots"};
    options.use_rings = use_rings_;
    auto c = client::Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto g = client_->JoinGroup({"slots", 1, 0, {daemon_.socket()}, "auto", 0});
    ASSERT_TRUE(g.ok()) << g.status();
    auto s = client_->CreateSession(*g, {kH, kD, DType::kFloat32, kTokens, 2, {}, 0});
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
    for (int i = 0; i < 4; ++i) {
      auto b = client_->AllocBuffer(kBytes);
      ASSERT_TRUE(b.ok());
      // Distinct content per buffer: with W=1, scatter_heads returns its input unchanged.
      for (uint64_t e = 0; e < kBytes / 4; ++e) {
        const float v = static_cast<float>(i * 1000000 + e);
        std::memcpy(static_cast<uint8_t*>(b->data) + e * 4, &v, 4);
      }
      x_.push_back(*b);
    }
  }
  void TearDown() override {
    session_.reset();
    client_.reset();
    daemon_ = demo::DaemonProcess();
    demo::RemoveRunDir(dir_);
  }

  bool Same(const client::Result& r, int buffer) const {
    return r.data != nullptr && std::memcmp(r.data, x_[buffer].data, kBytes) == 0;
  }
  std::vector<v1::SlotState> ListSlots() {
    auto stub = testing_util::AdminStub(daemon_.socket());
    v1::ListSlotsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->ListSlots(&ctx, {}, &resp).ok());
    return {resp.slots().begin(), resp.slots().end()};
  }

  int call_timeout_ms_ = 300;
  bool use_rings_ = true;  // ring clients release through their segment, others by RPC
  static constexpr int32_t kH = 4, kD = 8;
  static constexpr int64_t kTokens = 16;
  static constexpr uint64_t kBytes = kTokens * kH * kD * 4;
  std::string dir_;
  demo::DaemonProcess daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
  std::vector<client::Buffer> x_;
};

TEST_F(Slots, HeldSlotBlocksReuseAndIsNeverOverwritten) {
  auto poisoned = session_->PoisonSlots();
  ASSERT_TRUE(poisoned.ok());
  EXPECT_EQ(*poisoned, 2);
  auto r1 = session_->ScatterHeads(x_[0].Ref(), 1, kTokens);
  ASSERT_TRUE(r1.ok()) << r1.status();
  auto r2 = session_->ScatterHeads(x_[1].Ref(), 1, kTokens);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r1->slot, 0);
  EXPECT_EQ(r2->slot, 1);
  EXPECT_TRUE(Same(*r1, 0));
  EXPECT_TRUE(Same(*r2, 1));
  auto slots = ListSlots();
  ASSERT_EQ(slots.size(), 2u);
  for (const auto& s : slots) {
    EXPECT_EQ(s.state(), "held");
    EXPECT_EQ(s.owner_client_id(), client_->client_id());
    EXPECT_EQ(s.session_id(), session_->id());
    EXPECT_EQ(s.epoch(), static_cast<uint64_t>(s.slot() + 1));
  }
  // Poison leaves held slots alone.
  poisoned = session_->PoisonSlots();
  ASSERT_TRUE(poisoned.ok());
  EXPECT_EQ(*poisoned, 0);
  // Call 3 needs slot 0, which r1 holds: it waits (bounded by the call timeout) and fails
  // without writing anything.
  auto r3 = session_->ScatterHeads(x_[2].Ref(), 1, kTokens);
  EXPECT_EQ(r3.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(r3.status().message()), HasSubstr("release it"));
  EXPECT_TRUE(Same(*r1, 0)) << "a held slot was overwritten";
  EXPECT_TRUE(Same(*r2, 1));
  // Released, the slot serves call 3; r2 is intact.
  ASSERT_TRUE(r1->Release().ok());
  EXPECT_FALSE(r1->held());
  r3 = session_->ScatterHeads(x_[2].Ref(), 1, kTokens);
  ASSERT_TRUE(r3.ok()) << r3.status();
  EXPECT_EQ(r3->epoch, 3u);  // the refused call consumed no epoch
  EXPECT_EQ(r3->slot, 0);
  EXPECT_TRUE(Same(*r3, 2));
  EXPECT_TRUE(Same(*r2, 1));
}

class SlotsPatient : public Slots {
 protected:
  SlotsPatient() { call_timeout_ms_ = 60000; }
  int ActiveCalls() {
    auto stub = testing_util::AdminStub(daemon_.socket());
    v1::DaemonState st;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->GetState(&ctx, {}, &st).ok());
    return st.active_calls();
  }
};

TEST_F(SlotsPatient, CallWaitingForAHeldSlotProceedsOnceReleased) {
  auto r1 = session_->ScatterHeads(x_[0].Ref(), 1, kTokens);
  auto r2 = session_->ScatterHeads(x_[1].Ref(), 1, kTokens);
  ASSERT_TRUE(r1.ok() && r2.ok());
  // Call 3 needs slot 0 and waits in the daemon while r1 holds it.
  absl::StatusOr<client::Result> r3;
  std::thread caller([&] { r3 = session_->ScatterHeads(x_[2].Ref(), 1, kTokens); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ActiveCalls() == 0 && absl::Now() < deadline) {
  }
  ASSERT_EQ(ActiveCalls(), 1);
  EXPECT_TRUE(Same(*r1, 0));  // still intact while the call waits
  EXPECT_TRUE(r1->Release().ok());
  caller.join();
  ASSERT_TRUE(r3.ok()) << r3.status();
  EXPECT_EQ(r3->slot, 0);
  EXPECT_TRUE(Same(*r3, 2));
  EXPECT_TRUE(Same(*r2, 1));
}

TEST_F(Slots, DroppingTheResultReleasesAndOutCopiesHoldNothing) {
  {
    auto r1 = session_->ScatterHeads(x_[0].Ref(), 1, kTokens);
    ASSERT_TRUE(r1.ok());
    EXPECT_TRUE(r1->held());
  }  // dropped: released
  EXPECT_EQ(ListSlots()[0].state(), "free");
  auto r2 = session_->ScatterHeads(x_[1].Ref(), 1, kTokens, x_[3].Ref());
  ASSERT_TRUE(r2.ok());
  EXPECT_FALSE(r2->held());
  EXPECT_EQ(std::memcmp(x_[3].data, x_[1].data, kBytes), 0);
  EXPECT_EQ(ListSlots()[1].state(), "free");
  // Both slots free: two more calls need no release.
  auto r3 = session_->ScatterHeads(x_[2].Ref(), 1, kTokens);
  ASSERT_TRUE(r3.ok());
  auto r4 = session_->ScatterHeads(x_[0].Ref(), 1, kTokens, x_[3].Ref());
  ASSERT_TRUE(r4.ok());
  EXPECT_TRUE(Same(*r3, 2));
  // Releasing twice is harmless for the client; the slot is free once.
  EXPECT_TRUE(r3->Release().ok());
  EXPECT_TRUE(r3->Release().ok());
  // Poison now fills both (none held).
  auto poisoned = session_->PoisonSlots();
  ASSERT_TRUE(poisoned.ok());
  EXPECT_EQ(*poisoned, 2);
}

}  // namespace
}  // namespace ulysses

namespace ulysses {
namespace {

TEST_F(Slots, AsynchronousErrorIsRaisedAtTheNextCallAndAtWait) {
  ASSERT_TRUE(client_->uses_rings());
  auto r1 = session_->ScatterHeads(x_[0].Ref(), 1, kTokens);
  auto r2 = session_->ScatterHeads(x_[1].Ref(), 1, kTokens);
  ASSERT_TRUE(r1.ok() && r2.ok());
  CallArgs a;
  a.op = OpKind::kScatterHeads;
  a.batch = 1;
  a.seq = kTokens;
  a.inputs[0] = x_[2].Ref();
  // Epoch 3 needs slot 0, which r1 holds: the daemon gives up after the call timeout, after
  // Submit has returned.
  auto e3 = session_->Submit(a);
  ASSERT_TRUE(e3.ok());
  EXPECT_EQ(*e3, 3u);
  auto stub = testing_util::AdminStub(daemon_.socket());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  bool failed = false;
  while (!failed && absl::Now() < deadline) {
    v1::ListRecentCallsResponse recent;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->ListRecentCalls(&ctx, {}, &recent).ok());
    failed = recent.calls_size() > 0 && recent.calls(0).status() == "DEADLINE_EXCEEDED";
  }
  ASSERT_TRUE(failed);
  ASSERT_TRUE(r1->Release().ok());
  // The next call raises the earlier failure with its code and message...
  auto next = session_->Submit(a);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("earlier call (epoch 3)"));
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("release it"));
  // ...and so does waiting for that call.
  auto w3 = session_->Wait(3);
  EXPECT_EQ(w3.status().code(), absl::StatusCode::kDeadlineExceeded);
  // The refused call used no epoch: the session goes on at epoch 3.
  auto ok = session_->Call(a);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->epoch, 3u);
  EXPECT_TRUE(Same(*ok, 2));
}

}  // namespace
}  // namespace ulysses

namespace ulysses {
namespace {

class SlotsRpc : public Slots {
 protected:
  SlotsRpc() { use_rings_ = false; }
};

TEST_F(SlotsRpc, WithoutRingsHeldSlotsAreReleasedByRpc) {
  EXPECT_FALSE(client_->uses_rings());
  auto r1 = session_->ScatterHeads(x_[0].Ref(), 1, kTokens);
  auto r2 = session_->ScatterHeads(x_[1].Ref(), 1, kTokens);
  ASSERT_TRUE(r1.ok() && r2.ok());
  auto r3 = session_->ScatterHeads(x_[2].Ref(), 1, kTokens);
  EXPECT_EQ(r3.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Same(*r1, 0));
  ASSERT_TRUE(r1->Release().ok());
  EXPECT_EQ(ListSlots()[0].state(), "free");
  r3 = session_->ScatterHeads(x_[2].Ref(), 1, kTokens);
  ASSERT_TRUE(r3.ok()) << r3.status();
  EXPECT_TRUE(Same(*r3, 2));
  EXPECT_TRUE(Same(*r2, 1));
}

// The slot budget: a session takes its share when it is made and gives back exactly that when
// it goes, whether its client closes it or goes away; one that does not fit is refused, naming
// the budget, and takes nothing. (The share now goes back when the session is destroyed, after
// its device work ended, instead of at the close request: a closed session whose stream was
// still draining no longer let new sessions past the budget.)
TEST_F(Slots, ASessionsShareOfTheSlotBudgetComesBackWhenItGoes) {
  auto used = [&] {
    auto stub = testing_util::AdminStub(daemon_.socket());
    v1::DaemonState st;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->GetState(&ctx, {}, &st).ok());
    return st.slot_budget_used_bytes();
  };
  const uint64_t base = used();
  ASSERT_GT(base, 0u);  // the fixture's session
  auto g = client_->JoinGroup({"budget", 1, 0, {daemon_.socket()}, "auto", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  auto s = client_->CreateSession(*g, {kH, kD, DType::kFloat32, kTokens, 2, {}, 0});
  ASSERT_TRUE(s.ok()) << s.status();
  const uint64_t share = used() - base;
  EXPECT_GT(share, 0u);
  ASSERT_TRUE((*s)->Close().ok());
  EXPECT_TRUE(testing_util::Eventually([&] { return used() == base; })) << used();

  // A session too large for what is left is refused and takes nothing.
  auto big = client_->CreateSession(*g, {kH, kD, DType::kFloat32, int64_t{1} << 24, 8, {}, 0});
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_THAT(std::string(big.status().message()), HasSubstr("slots.memory_budget_bytes"));
  EXPECT_EQ(used(), base);

  // A client that goes away gives back its sessions' shares.
  auto other = client::Client::Connect({daemon_.socket(), "budget-other"});
  ASSERT_TRUE(other.ok()) << other.status();
  auto og = (*other)->JoinGroup({"budget-other", 1, 0, {daemon_.socket()}, "auto", 0});
  ASSERT_TRUE(og.ok()) << og.status();
  auto os = (*other)->CreateSession(*og, {kH, kD, DType::kFloat32, kTokens, 2, {}, 0});
  ASSERT_TRUE(os.ok()) << os.status();
  EXPECT_EQ(used(), base + share);
  other->reset();  // detaches: the daemon reclaims the client, its session open
  EXPECT_TRUE(testing_util::Eventually([&] { return used() == base; })) << used();
  os->reset();
  EXPECT_EQ(used(), base);
}

}  // namespace
}  // namespace ulysses
