// Session's bookkeeping of stream-ordered calls, against a stand-in transport (no GPU): the
// calls a GPU transport would enqueue on its stream are recorded, and the test says when each
// finished on the "device". What is checked is Session's, the same on every GPU backend:
// PoisonSlots leaves a slot whose call is still running alone, and one whose result is given
// back on the client's stream; a call whose enqueue failed
// part way keeps its buffers until the session goes; a transport whose device work does not
// end when the session goes is kept, with the buffers of its calls, instead of destroyed; a
// call in flight fails as soon as a peer took its epoch with another call; a call that finished
// before its session went is not failed by that end.
#include <atomic>
#include <chrono>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "fd_exports.h"
#include "gtest/gtest.h"
#include "session.h"
#include "transport.h"
#include "ulysses/common/geometry.h"

namespace ulysses::daemon {
namespace {

// What the stand-in transport was asked to do, and what the test lets it answer.
struct DeviceScript {
  std::mutex mu;
  std::set<std::pair<int, uint64_t>> finished;  // (slot, epoch) done on the "device"
  std::vector<StreamCall> enqueued;
  std::vector<int> poisoned;
  absl::Status enqueue_result = absl::OkStatus();
  bool drains = true;
  bool destroyed = false;
  int cancels = 0;
  bool make_fails = false;  // the backend cannot make the session's transport
  std::string stuck_words;  // what DescribeStuck answers
};

class StandInStreamTransport final : public Transport {
 public:
  explicit StandInStreamTransport(std::shared_ptr<DeviceScript> script)
      : script_(std::move(script)) {}
  ~StandInStreamTransport() override {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->destroyed = true;
  }
  std::string LocalHandle() const override { return "stand-in"; }
  absl::Status Connect(const std::vector<std::string>&, const std::vector<std::string>&,
                       const std::vector<uint8_t*>&, absl::Duration) override {
    return absl::OkStatus();
  }
  absl::Status Push(const CallPlan&, const CallOperands&, int, int) override {
    return absl::UnimplementedError("stream-ordered");
  }
  absl::Status Flush() override { return absl::OkStatus(); }
  absl::Status Finish(const CallPlan&, const CallOperands&, int) override {
    return absl::OkStatus();
  }
  absl::Status Poison(int slot) override {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->poisoned.push_back(slot);
    return absl::OkStatus();
  }
  uint64_t SlotOffset(int) const override { return 0; }
  ClientSlotMapping ClientMapping() const override { return {}; }
  uint64_t DeviceBytes() const override { return 4096; }
  std::string Describe() const override { return "stand-in"; }
  bool StreamOrdered() const override { return true; }
  absl::Status Enqueue(const CallPlan&, const CallOperands&, const StreamCall& call) override {
    std::lock_guard<std::mutex> lock(script_->mu);
    if (!script_->enqueue_result.ok()) return script_->enqueue_result;
    script_->enqueued.push_back(call);
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Completed(int slot, uint64_t epoch) override {
    std::lock_guard<std::mutex> lock(script_->mu);
    return script_->finished.count({slot, epoch}) > 0;
  }
  void Cancel() override {
    std::lock_guard<std::mutex> lock(script_->mu);
    ++script_->cancels;
  }
  bool Drain() override {
    std::lock_guard<std::mutex> lock(script_->mu);
    return script_->drains;
  }
  std::string DescribeStuck(int, uint64_t) override {
    std::lock_guard<std::mutex> lock(script_->mu);
    return script_->stuck_words;
  }

 private:
  std::shared_ptr<DeviceScript> script_;
};

class StandInStreamBackend final : public Backend {
 public:
  explicit StandInStreamBackend(std::shared_ptr<DeviceScript> script)
      : script_(std::move(script)) {}
  std::string_view name() const override { return "stand-in"; }
  bool slots_in_segment() const override { return false; }
  absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransportSetup&) override {
    {
      std::lock_guard<std::mutex> lock(script_->mu);
      if (script_->make_fails) return absl::ResourceExhaustedError("device memory: stand-in");
    }
    return std::unique_ptr<Transport>(new StandInStreamTransport(script_));
  }
  absl::StatusOr<std::shared_ptr<Buffer>> AllocBuffer(uint64_t) override {
    return absl::UnimplementedError("stand-in");
  }
  absl::StatusOr<std::shared_ptr<Buffer>> ImportIpcBuffer(const std::string&, uint64_t) override {
    return absl::UnimplementedError("stand-in");
  }
  absl::StatusOr<std::shared_ptr<Buffer>> ImportVmmBuffer(
      std::span<const ipc::cuda::VmmMapping::Part>) override {
    return absl::UnimplementedError("stand-in");
  }
  absl::StatusOr<bool> CanReach(int) const override { return true; }
  std::string_view mps_mode() const override { return "none"; }

 private:
  std::shared_ptr<DeviceScript> script_;
};

class SessionStreamTest : public ::testing::Test {
 protected:
  static constexpr int kH = 4, kD = 8, kS = 16;

  void SetUp() override {
    char tmpl[] = "/tmp/ulysses-session-stream.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_TRUE(exports_.Start(dir_ + "/peer").ok());
    geometry_.world_size = 1;
    geometry_.rank = 0;
    geometry_.num_heads = kH;
    geometry_.head_dim = kD;
    geometry_.dtype = DType::kFloat32;
    geometry_.max_tokens = kS;
    geometry_.num_slots = 2;
    auto s = Session::Create(1, 1, 1, geometry_, exports_, backend_);
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
    plan_.op = OpKind::kScatterHeads;
    plan_.batch = 1;
    plan_.seq_local = kS;
    plan_.num_inputs = 1;
    plan_.out_shape = {1, kS, kH, kD};
    plan_.slot_elems = int64_t{kS} * kH * kD;
  }
  void TearDown() override {
    session_.reset();
    exports_.Stop();
    std::filesystem::remove_all(dir_);
  }

  // Enqueues one call on the ring path (returns once enqueued), its operands held by `keep`.
  absl::StatusOr<CallOutcome> Submit(std::shared_ptr<const void> keep = nullptr,
                                     bool released_in_order = false,
                                     absl::Duration timeout = absl::Seconds(30),
                                     uint64_t expected_epoch = 0) {
    CallOperands ops;
    ops.keep[0] = std::move(keep);
    return session_->Execute(plan_, ops, timeout, expected_epoch,
                             ExecuteMode{.async = true, .wait_ready = true,
                                         .released_in_order = released_in_order});
  }
  // The calls finished since the last take, once at least one did (bounded).
  std::vector<FinishedCall> Collect() {
    for (int i = 0; i < 5000; ++i) {
      session_->Poll();
      std::vector<FinishedCall> done;
      session_->TakeFinished(&done);
      if (!done.empty()) return done;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ADD_FAILURE() << "no call finished";
    return {};
  }
  int Cancels() {
    std::lock_guard<std::mutex> lock(script_->mu);
    return script_->cancels;
  }
  void Finish(int slot, uint64_t epoch) {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->finished.insert({slot, epoch});
  }
  Session::SlotState StateOf(int slot) {
    for (const Session::SlotView& v : session_->Slots())
      if (v.slot == slot) return v.state;
    ADD_FAILURE() << "no slot " << slot;
    return Session::SlotState::kFree;
  }

  std::shared_ptr<DeviceScript> script_ = std::make_shared<DeviceScript>();
  StandInStreamBackend backend_{script_};
  std::string dir_;
  SessionGeometry geometry_;
  FdExports exports_;
  std::unique_ptr<Session> session_;
  CallPlan plan_;
};

TEST_F(SessionStreamTest, PoisonLeavesTheSlotOfARunningCallAloneAndDoesNotWaitForIt) {
  auto first = Submit(std::make_shared<int>(1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->pending);
  ASSERT_EQ(first->slot, 0);
  ASSERT_EQ(StateOf(0), Session::SlotState::kWriting);
  // The call has not finished on the device, and Poison does not wait for it.
  EXPECT_EQ(session_->Poison(), 1);
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    EXPECT_EQ(script_->poisoned, std::vector<int>{1});
  }
  Finish(0, 1);
  session_->Poll();
  std::vector<FinishedCall> done;
  session_->TakeFinished(&done);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].epoch, 1u);
  EXPECT_TRUE(done[0].outcome.ok()) << done[0].outcome.status();
  EXPECT_EQ(StateOf(0), Session::SlotState::kHeld);
  // Held now: still left alone.
  EXPECT_EQ(session_->Poison(), 1);
  std::lock_guard<std::mutex> lock(script_->mu);
  EXPECT_EQ(script_->poisoned, (std::vector<int>{1, 1}));
}

// A result given back on the client's stream is marked released in the client's host word at
// once, while the client's stream may still read it: PoisonSlots used to take that word as
// leave to fill the slot, on the daemon's stream, with nothing ordering the fill after the read.
TEST_F(SessionStreamTest, PoisonLeavesAResultGivenBackOnTheClientsStreamAlone) {
  auto first = Submit();
  ASSERT_TRUE(first.ok()) << first.status();
  Finish(first->slot, 1);
  const std::vector<FinishedCall> done = Collect();
  ASSERT_EQ(done.size(), 1u);
  ASSERT_TRUE(done[0].outcome.ok()) << done[0].outcome.status();
  ASSERT_EQ(StateOf(0), Session::SlotState::kHeld);
  // The client's host words say epoch 1 was given back.
  auto words = std::make_shared<std::vector<std::atomic<uint64_t>>>(kMaxSlots);
  (*words)[0].store(1);
  session_->UseClientReleaseWords(0, words->data(), words);
  EXPECT_EQ(session_->Poison(), 1);  // slot 1 only
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    EXPECT_EQ(script_->poisoned, std::vector<int>{1});
  }
  // The slot still serves the next call, which waits for the release on the stream.
  auto second = Submit();  // epoch 2, slot 1
  ASSERT_TRUE(second.ok()) << second.status();
  Finish(1, 2);
  ASSERT_EQ(Collect().size(), 1u);
  auto third = Submit();  // epoch 3, slot 0
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->slot, 0);
  std::lock_guard<std::mutex> lock(script_->mu);
  ASSERT_EQ(script_->enqueued.size(), 3u);
  EXPECT_EQ(script_->enqueued[2].wait_released, 1u);
}

// A call that times out waiting for its slot, which still holds the client's result of an
// earlier call (given back by the host word only), never owned that slot: it used to mark it
// free as it failed, and PoisonSlots then filled the result the client still read.
TEST_F(SessionStreamTest, ACallThatNeverGotItsSlotLeavesTheResultThereHeld) {
  // No ready word from a client stream: results are given back by the host word.
  auto submit = [&](absl::Duration timeout) {
    CallOperands ops;
    return session_->Execute(plan_, ops, timeout, 0,
                             ExecuteMode{.async = true, .wait_ready = false});
  };
  for (uint64_t e = 1; e <= 2; ++e) {
    auto out = submit(absl::Seconds(30));
    ASSERT_TRUE(out.ok()) << out.status();
    Finish(out->slot, e);
    ASSERT_EQ(Collect().size(), 1u);
  }
  ASSERT_EQ(StateOf(0), Session::SlotState::kHeld);
  auto third = submit(absl::Milliseconds(20));  // epoch 3 needs slot 0, still held
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kDeadlineExceeded) << third.status();
  EXPECT_EQ(StateOf(0), Session::SlotState::kHeld);
  EXPECT_EQ(session_->Poison(), 0);  // both slots hold results
  std::lock_guard<std::mutex> lock(script_->mu);
  EXPECT_TRUE(script_->poisoned.empty());
}

TEST_F(SessionStreamTest, AFailedEnqueueKeepsItsBuffersUntilTheSessionGoes) {
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->enqueue_result = absl::InternalError("the launch failed");
  }
  auto buffer = std::make_shared<int>(7);
  auto failed = Submit(buffer);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  // Part of the call may be on the stream: the session holds its buffer.
  EXPECT_EQ(buffer.use_count(), 2);
  EXPECT_TRUE(session_->broken());
  session_.reset();
  EXPECT_EQ(buffer.use_count(), 1);
  std::lock_guard<std::mutex> lock(script_->mu);
  EXPECT_TRUE(script_->destroyed);
}

TEST_F(SessionStreamTest, ASessionWhoseDeviceWorkEndsFreesItsTransportAndBuffers) {
  auto buffer = std::make_shared<int>(7);
  ASSERT_TRUE(Submit(buffer).ok());
  EXPECT_EQ(buffer.use_count(), 2);  // held by the call in flight
  const size_t undrained = Session::UndrainedCount();
  session_.reset();
  EXPECT_EQ(buffer.use_count(), 1);
  EXPECT_EQ(Session::UndrainedCount(), undrained);
  std::lock_guard<std::mutex> lock(script_->mu);
  EXPECT_TRUE(script_->destroyed);
}

TEST_F(SessionStreamTest, ATransportWhoseDeviceWorkDoesNotEndIsKeptWithItsCallsBuffers) {
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->drains = false;
  }
  auto buffer = std::make_shared<int>(7);
  ASSERT_TRUE(Submit(buffer).ok());
  const size_t undrained = Session::UndrainedCount();
  const uint64_t undrained_bytes = Session::UndrainedBytes();
  session_.reset();
  // The call's work may still run: neither its buffer nor the transport goes, and its device
  // memory stays counted.
  EXPECT_EQ(buffer.use_count(), 2);
  EXPECT_EQ(Session::UndrainedCount(), undrained + 1);
  EXPECT_EQ(Session::UndrainedBytes(), undrained_bytes + 4096);
  std::lock_guard<std::mutex> lock(script_->mu);
  EXPECT_FALSE(script_->destroyed);
}

// The daemon's stream waits for the release of a slot's previous result, unless the client
// says its ready word comes after that release on its stream (docs/protocol.md 9.2 step 3).
TEST_F(SessionStreamTest, AHeldResultsReleaseIsWaitedForOnTheStreamUnlessTheReadyWordCarriesIt) {
  for (uint64_t e = 1; e <= 4; ++e) {
    // Epochs 3 and 4 reuse the slots of 1 and 2, whose results the client still holds on its
    // stream; only epoch 4's descriptor says the release came before its ready word.
    auto out = Submit(nullptr, /*released_in_order=*/e == 4);
    ASSERT_TRUE(out.ok()) << out.status();
    Finish(out->slot, e);
    const std::vector<FinishedCall> done = Collect();
    ASSERT_EQ(done.size(), 1u);
    ASSERT_TRUE(done[0].outcome.ok()) << done[0].outcome.status();
  }
  std::lock_guard<std::mutex> lock(script_->mu);
  ASSERT_EQ(script_->enqueued.size(), 4u);
  EXPECT_EQ(script_->enqueued[0].wait_released, 0u);  // fresh slots
  EXPECT_EQ(script_->enqueued[1].wait_released, 0u);
  EXPECT_EQ(script_->enqueued[2].wait_released, 1u);  // waits for epoch 1's release
  EXPECT_EQ(script_->enqueued[3].wait_released, 0u);  // its ready word implies epoch 2's
  for (const StreamCall& c : script_->enqueued) EXPECT_TRUE(c.wait_ready);
}

// Callers that wait for their call (the Control.Call path) each get their own call's
// outcome, call after call past the number of slots, where the session reuses the map nodes
// that carry the outcomes; a failure reaches its own caller too.
TEST_F(SessionStreamTest, WaitingCallersGetTheirOwnOutcomesPastTheSlotCount) {
  CallPlan plan = plan_;
  plan.has_out = true;  // each result copied out: its slot is free at once
  const ExecuteMode waits{.async = false, .wait_ready = true};
  for (uint64_t e = 1; e <= 7; ++e) {
    const int slot = static_cast<int>((e - 1) % 2);
    Finish(slot, e);  // done on the "device" as soon as it is enqueued
    auto out = session_->Execute(plan, CallOperands{}, absl::Seconds(30), 0, waits);
    ASSERT_TRUE(out.ok()) << "epoch " << e << ": " << out.status();
    EXPECT_EQ(out->epoch, e);
    EXPECT_EQ(out->slot, slot);
  }
  auto late = session_->Execute(plan, CallOperands{}, absl::Milliseconds(1), 0, waits);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
}

TEST_F(SessionStreamTest, ACallPastItsTimeoutFailsBreaksTheSessionAndCancelsTheStream) {
  auto out = Submit(nullptr, false, absl::Milliseconds(1));
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<FinishedCall> done = Collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].outcome.status().code(), absl::StatusCode::kDeadlineExceeded)
      << done[0].outcome.status();
  EXPECT_TRUE(session_->broken());
  EXPECT_GE(Cancels(), 1);
  EXPECT_EQ(StateOf(0), Session::SlotState::kFree);
  // A broken session refuses the next call (its epochs no longer line up across ranks).
  auto next = Submit();
  EXPECT_EQ(next.status().code(), absl::StatusCode::kFailedPrecondition) << next.status();
}

TEST_F(SessionStreamTest, ADescriptorForAnotherEpochIsRefusedAndCancelsTheStream) {
  auto out = Submit(nullptr, false, absl::Seconds(30), /*expected_epoch=*/5);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition) << out.status();
  EXPECT_NE(std::string(out.status().message()).find("out of order"), std::string::npos)
      << out.status();
  EXPECT_TRUE(session_->broken());
  EXPECT_GE(Cancels(), 1);
  std::lock_guard<std::mutex> lock(script_->mu);
  EXPECT_TRUE(script_->enqueued.empty());
}

TEST_F(SessionStreamTest, ASessionWhoseTransportCannotBeMadeIsAClearErrorAndLeavesNothing) {
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->make_fails = true;
  }
  const size_t undrained = Session::UndrainedCount();
  auto s = Session::Create(2, 1, 1, geometry_, exports_, backend_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_EQ(Session::UndrainedCount(), undrained);
}

// Two ranks in this process that take epoch 1 with different calls (rank 1 with fewer
// tokens), neither of which ever finishes on the "device" (as NCCL transfers of different
// sizes may not): each rank's call fails with the mismatch while it is in flight, long before
// its hour-long timeout, and its stream is cancelled.
// Two ranks of one session in this process on the stand-in backend, connected to each other.
void OpenTwoRanks(const SessionGeometry& geometry, FdExports& exports, Backend& backend,
                  std::unique_ptr<Session> (&ranks)[2]) {
  SessionGeometry g = geometry;
  g.world_size = 2;
  for (int r = 0; r < 2; ++r) {
    g.rank = r;
    auto s = Session::Create(10 + r, 2, 1, g, exports, backend);
    ASSERT_TRUE(s.ok()) << s.status();
    ranks[r] = std::move(*s);
  }
  const std::vector<std::string> payloads = {ranks[0]->RendezvousPayload(),
                                             ranks[1]->RendezvousPayload()};
  for (auto& s : ranks) {
    ASSERT_TRUE(s->MapPeers(payloads, absl::Seconds(5)).ok());
    ASSERT_TRUE(s->ConnectTransport({}, absl::Seconds(5)).ok());
  }
}

// Rank r's call of `seq_local` tokens, enqueued (not waited for), with an hour's timeout
// unless `timeout` says otherwise.
void SubmitOnRank(Session& rank, const CallPlan& base, int64_t seq_local,
                  absl::Duration timeout = absl::Hours(1)) {
  CallPlan plan = base;
  plan.seq_local = seq_local;
  plan.slot_elems = int64_t{2} * seq_local * (base.out_shape[2] / 2) * base.out_shape[3];
  auto out = rank.Execute(plan, CallOperands{}, timeout, 0,
                          ExecuteMode{.async = true, .wait_ready = true});
  ASSERT_TRUE(out.ok()) << out.status();
}

// The rank's first finished call, polled for up to 5 s; none when it is still in flight.
std::vector<FinishedCall> CollectOnRank(Session& rank) {
  std::vector<FinishedCall> done;
  for (int i = 0; i < 5000 && done.empty(); ++i) {
    rank.Poll();
    rank.TakeFinished(&done);
    if (done.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done;
}

TEST_F(SessionStreamTest, ACallInFlightFailsAsSoonAsAPeerTookItsEpochWithAnotherCall) {
  std::unique_ptr<Session> ranks[2];
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanks(geometry_, exports_, backend_, ranks));
  for (int r = 0; r < 2; ++r)
    ASSERT_NO_FATAL_FAILURE(SubmitOnRank(*ranks[r], plan_, r == 0 ? kS : kS - 4));
  for (int r = 0; r < 2; ++r) {
    const std::vector<FinishedCall> done = CollectOnRank(*ranks[r]);
    ASSERT_EQ(done.size(), 1u) << "rank " << r << "'s call is still in flight";
    const absl::Status& got = done[0].outcome.status();
    // The first rank to look finds the mismatch; the other may find that rank's failure.
    EXPECT_TRUE(got.code() == absl::StatusCode::kInvalidArgument ||
                got.code() == absl::StatusCode::kAborted)
        << "rank " << r << ": " << got;
    if (r == 0) {
      EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument) << got;
      EXPECT_NE(std::string(got.message()).find("ranks issued different calls"), std::string::npos)
          << got;
    }
    EXPECT_TRUE(ranks[r]->broken()) << "rank " << r;
  }
  EXPECT_GE(Cancels(), 2);
}

// A call that times out names where its stream stood (the transport's words) and where each
// peer stood at its epoch, from the peers' session segments: whether it took the epoch, what
// it completed, and why it left.
TEST_F(SessionStreamTest, ATimedOutCallNamesThePeersThatNeverTookItsEpoch) {
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->stuck_words = "rank 0 slot 0 epoch 1: ready 1";
  }
  std::unique_ptr<Session> ranks[2];
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanks(geometry_, exports_, backend_, ranks));
  // Rank 1 never calls.
  ASSERT_NO_FATAL_FAILURE(SubmitOnRank(*ranks[0], plan_, kS, absl::Milliseconds(1)));
  std::vector<FinishedCall> done = CollectOnRank(*ranks[0]);
  ASSERT_EQ(done.size(), 1u) << "rank 0's call is still in flight";
  const absl::Status& got = done[0].outcome.status();
  EXPECT_EQ(got.code(), absl::StatusCode::kDeadlineExceeded) << got;
  EXPECT_TRUE(absl::StrContains(got.message(),
                                "; protocol words: rank 0 slot 0 epoch 1: ready 1; peers at epoch "
                                "1: rank 1 has not taken it, completed 0"))
      << got;
  // Rank 0's failure broke its session: rank 1's next call is failed by it, and says so.
  ranks[0].reset();
  ASSERT_NO_FATAL_FAILURE(SubmitOnRank(*ranks[1], plan_, kS, absl::Milliseconds(1)));
  done = CollectOnRank(*ranks[1]);
  ASSERT_EQ(done.size(), 1u) << "rank 1's call is still in flight";
  EXPECT_EQ(done[0].outcome.status().code(), absl::StatusCode::kAborted)
      << done[0].outcome.status();
}

// Both ranks took the epoch and the "device" never finishes: the report says so.
TEST_F(SessionStreamTest, ATimedOutCallWhosePeersTookItsEpochSaysSo) {
  {
    std::lock_guard<std::mutex> lock(script_->mu);
    script_->stuck_words = "words";
  }
  std::unique_ptr<Session> ranks[2];
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanks(geometry_, exports_, backend_, ranks));
  ASSERT_NO_FATAL_FAILURE(SubmitOnRank(*ranks[1], plan_, kS));
  ASSERT_NO_FATAL_FAILURE(SubmitOnRank(*ranks[0], plan_, kS, absl::Milliseconds(1)));
  const std::vector<FinishedCall> done = CollectOnRank(*ranks[0]);
  ASSERT_EQ(done.size(), 1u) << "rank 0's call is still in flight";
  EXPECT_TRUE(absl::StrContains(done[0].outcome.status().message(),
                                "; protocol words: words; peers at epoch 1: rank 1 took it, "
                                "completed 0"))
      << done[0].outcome.status();
}

// A session that goes while its last call finished on the "device" but was not collected yet
// completes that call rather than failing it: the peer, which completed the same epoch over
// this rank's blocks, finds no failure recorded for it.
TEST_F(SessionStreamTest, ACallFinishedBeforeTheSessionGoesIsNotFailedByItsEnd) {
  std::unique_ptr<Session> ranks[2];
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanks(geometry_, exports_, backend_, ranks));
  for (auto& rank : ranks) ASSERT_NO_FATAL_FAILURE(SubmitOnRank(*rank, plan_, kS));
  Finish(0, 1);  // both ranks' slot 0, epoch 1
  ranks[0].reset();
  const std::vector<FinishedCall> done = CollectOnRank(*ranks[1]);
  ASSERT_EQ(done.size(), 1u) << "rank 1's call is still in flight";
  EXPECT_TRUE(done[0].outcome.ok()) << done[0].outcome.status();
}

// A closing session's device work may sit behind another session's wait (a shared queue)
// until that call times out: the drain bound stays past the call timeout, and never under 30 s.
TEST(DrainLimitTest, OutlastsTheCallTimeout) {
  EXPECT_EQ(DrainLimitFor(absl::Seconds(10)), absl::Seconds(30));
  EXPECT_EQ(DrainLimitFor(absl::Seconds(25)), absl::Seconds(30));
  EXPECT_EQ(DrainLimitFor(absl::Seconds(30)), absl::Seconds(35));
  EXPECT_EQ(DrainLimitFor(absl::Minutes(2)), absl::Seconds(125));
  EXPECT_EQ(DrainLimitFor(absl::Milliseconds(std::numeric_limits<int64_t>::max())),
            absl::Hours(24));
}

}  // namespace
}  // namespace ulysses::daemon
