// The call rings: a client that keeps its completion ring full stalls only itself, and its
// ring worker waits with a backoff instead of spinning; ring descriptors are checked before
// they reach a session (epoch 0 means nothing); what the client can write (its segment's abort
// word, its ends of the doorbells) neither stops nor holds its worker or the daemon.
#include <fcntl.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hostile_client.h"
#include "ulysses/client/client.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/doorbell.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::security {
namespace {

// CPU time (user + system) process `pid` has used, from /proc/PID/stat.
absl::Duration CpuTime(pid_t pid) {
  std::ifstream in(StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start after the last ')'.
  std::istringstream rest(text.substr(text.rfind(')') + 2));
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stol(field);
    if (i == 15) stime = std::stol(field);
  }
  return absl::Seconds(static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK)));
}

// A bound client that maps its segment and drives the rings by hand.
struct RingClient {
  Attached attached;
  ipc::UniqueFd sock;
  ipc::Mapping segment;
  ipc::SubmitRing* submit = nullptr;
  ipc::CompletionRing* complete = nullptr;
  ipc::UniqueFd submit_bell, complete_bell;  // this client's ends of the doorbells

  ipc::ClientSegmentHeader* header() {
    return reinterpret_cast<ipc::ClientSegmentHeader*>(static_cast<uint8_t*>(segment.data()) +
                                                       ipc::ClientSegmentLayout::kHeader);
  }

  // Pushes `d`, waiting for room, and rings the daemon.
  void Push(const ipc::CallDescriptor& d) {
    for (;;) {
      absl::StatusOr<bool> pushed = submit->TryPush(d);
      ASSERT_TRUE(pushed.ok()) << pushed.status();
      if (*pushed) break;
      absl::SleepFor(absl::Milliseconds(1));
    }
    const uint64_t one = 1;
    ASSERT_EQ(::write(submit_bell.get(), &one, sizeof one), static_cast<ssize_t>(sizeof one));
  }
};

class RingTest : public DaemonTest {
 protected:
  std::unique_ptr<RingClient> BindRings() {
    auto rc = std::make_unique<RingClient>();
    absl::StatusOr<Attached> a = Attach("ring");
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return nullptr;
    rc->attached = *a;
    ipc::ReceivedMessage ack;
    absl::StatusOr<ipc::UniqueFd> sock = Bind(*a, &ack);
    EXPECT_TRUE(sock.ok()) << sock.status();
    if (!sock.ok() || ack.fds.size() != 3) return nullptr;
    rc->sock = std::move(*sock);
    absl::StatusOr<ipc::Mapping> m =
        ipc::Mapping::Map(ack.fds[0].get(), ipc::ClientSegmentLayout::kTotal, true);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    rc->segment = std::move(*m);
    auto* base = static_cast<uint8_t*>(rc->segment.data());
    rc->submit = *ipc::SubmitRing::Attach(base + ipc::ClientSegmentLayout::kSubmit,
                                          sizeof(ipc::SubmitRing));
    rc->complete = *ipc::CompletionRing::Attach(base + ipc::ClientSegmentLayout::kComplete,
                                                sizeof(ipc::CompletionRing));
    rc->submit_bell = std::move(ack.fds[1]);
    rc->complete_bell = std::move(ack.fds[2]);
    return rc;
  }
};

// A descriptor for a session that does not exist: the daemon answers it at once with an error.
ipc::CallDescriptor Bogus(uint64_t epoch) {
  ipc::CallDescriptor d{};
  d.session_id = 999999999;
  d.epoch = epoch;
  d.op = 1;
  return d;
}

TEST_F(RingTest, AFullCompletionRingMakesTheWorkerBackOffNotSpin) {
  constexpr int kClients = 8;
  std::vector<std::unique_ptr<RingClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(BindRings());
    ASSERT_NE(clients.back(), nullptr);
  }
  // Each client submits one descriptor more than its completion ring holds, and never drains.
  for (auto& rc : clients)
    for (uint64_t e = 1; e <= ipc::kRingCapacity + 1; ++e) rc->Push(Bogus(e));
  for (auto& rc : clients)
    ASSERT_TRUE(Eventually([&] {
      return rc->complete->size() == ipc::kRingCapacity && rc->submit->empty();
    }));
  // Every worker now holds a completion it cannot post. Over a second of that, the daemon's
  // CPU time stays a small fraction of the wall time: 10 ms (one clock tick) with the
  // backoff, 180 ms when each worker retried every 50 us.
  const absl::Duration cpu0 = CpuTime(daemon_.pid());
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(1));
  const absl::Duration cpu = CpuTime(daemon_.pid()) - cpu0;
  const absl::Duration wall = absl::Now() - t0;
  EXPECT_LT(cpu, wall * 0.1) << "daemon used " << cpu << " of CPU in " << wall;
  // A client that drains gets its last completion, and everyone else is served.
  auto& rc = clients.front();
  ipc::Completion c{};
  for (uint32_t i = 0; i < ipc::kRingCapacity; ++i) ASSERT_TRUE(rc->complete->TryPop(&c).value());
  EXPECT_TRUE(Eventually([&] { return rc->complete->size() == 1; }));
  auto bystander = client::Client::Connect({daemon_.socket(), "bystander", absl::Seconds(10)});
  ASSERT_TRUE(bystander.ok()) << bystander.status();
  EXPECT_TRUE((*bystander)->AllocBuffer(4096, "b").ok());
}

// Waits for the next completion on `rc`'s ring.
ipc::Completion NextCompletion(RingClient& rc) {
  ipc::Completion c{};
  EXPECT_TRUE(Eventually([&] { return rc.complete->TryPop(&c).value_or(false); }));
  return c;
}

TEST_F(RingTest, EpochZeroOnTheRingNamesNoCall) {
  auto rc = BindRings();
  ASSERT_NE(rc, nullptr);
  // A one-rank group, a session and a buffer, by hand.
  v1::JoinGroupRequest join;
  join.set_name("solo");
  join.set_world_size(1);
  join.set_rank(0);
  join.add_members(daemon_.socket());
  v1::GroupInfo group;
  {
    grpc::ClientContext ctx;
    Authenticate(&ctx, rc->attached);
    grpc::Status s = control_->JoinGroup(&ctx, join, &group);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  v1::CreateSessionRequest create;
  create.set_group_id(group.group_id());
  create.mutable_spec()->set_num_heads(2);
  create.mutable_spec()->set_head_dim(4);
  create.mutable_spec()->set_dtype(static_cast<v1::DType>(DType::kFloat32));
  create.mutable_spec()->set_max_tokens(8);
  v1::SessionInfo session;
  {
    grpc::ClientContext ctx;
    Authenticate(&ctx, rc->attached);
    grpc::Status s = control_->CreateSession(&ctx, create, &session);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_TRUE(ipc::RecvMessage(rc->sock.get()).ok());  // the session's segment
  v1::AllocBufferRequest alloc;
  alloc.set_size_bytes(4096);
  v1::BufferInfo buffer;
  {
    grpc::ClientContext ctx;
    Authenticate(&ctx, rc->attached);
    grpc::Status s = control_->AllocBuffer(&ctx, alloc, &buffer);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_TRUE(ipc::RecvMessage(rc->sock.get()).ok());  // the buffer's memfd

  ipc::CallDescriptor d{};
  d.session_id = session.session_id();
  d.op = static_cast<uint32_t>(OpKind::kScatterHeads);
  d.num_inputs = 1;
  d.batch = 1;
  d.seq = 8;
  d.inputs[0].buffer_id = buffer.buffer_id();
  d.epoch = 0;
  rc->Push(d);
  ipc::Completion zero = NextCompletion(*rc);
  EXPECT_EQ(zero.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument)) << zero.message;
  EXPECT_NE(std::string(zero.message).find("epoch"), std::string::npos) << zero.message;
  EXPECT_EQ(zero.next_epoch, 1u) << "epoch 0 spent an epoch";
  // The same call under its real epoch runs.
  d.epoch = 1;
  rc->Push(d);
  ipc::Completion one = NextCompletion(*rc);
  EXPECT_EQ(one.code, 0) << one.message;
  EXPECT_EQ(one.next_epoch, 2u);
}

// The segment's abort word is the client's to write: a client that sets it is still served
// (its worker does not take its orders from that word, so it neither stops nor restarts in a
// loop), and one that clears it after it hung up does not keep its worker alive: the daemon
// reclaims it, its worker ends (in PushBackoff here, behind a completion ring kept full) and
// the daemon stops on time. Its ends of the doorbells made blocking change nothing of the
// daemon's.
TEST_F(RingTest, TheAbortWordAndTheBellsAClientWritesNeitherStopNorHoldItsWorker) {
  auto rc = BindRings();
  ASSERT_NE(rc, nullptr);
  const int threads = CountThreadsOutsideTimers(daemon_.pid());  // no ring worker yet
  for (int fd : {rc->submit_bell.get(), rc->complete_bell.get()})
    ASSERT_EQ(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK), 0);
  rc->header()->abort.store(1, std::memory_order_release);
  rc->Push(Bogus(1));
  const ipc::Completion first = NextCompletion(*rc);
  EXPECT_EQ(first.epoch, 1u);
  EXPECT_NE(first.code, 0) << "a descriptor of no session was answered OK";
  // Now a completion ring kept full, so that the worker sits in its backoff.
  for (uint64_t e = 2; e <= ipc::kRingCapacity + 2; ++e) rc->Push(Bogus(e));
  ASSERT_TRUE(Eventually([&] {
    return rc->complete->size() == ipc::kRingCapacity && rc->submit->empty();
  }));
  std::atomic<bool> done{false};
  std::thread clearer([&] {
    while (!done.load()) rc->header()->abort.store(0, std::memory_order_release);
  });
  ::shutdown(rc->sock.get(), SHUT_RDWR);  // hangs up: the daemon reclaims it
  EXPECT_TRUE(Eventually([&] { return NumClients() == 0; }));
  EXPECT_TRUE(Eventually([&] { return CountThreadsOutsideTimers(daemon_.pid()) <= threads; }))
      << CountThreadsOutsideTimers(daemon_.pid()) << " threads, " << threads << " before";
  done.store(true);
  clearer.join();
  auto bystander = client::Client::Connect({daemon_.socket(), "bystander", absl::Seconds(10)});
  ASSERT_TRUE(bystander.ok()) << bystander.status();
  EXPECT_TRUE((*bystander)->AllocBuffer(4096, "b").ok());
}

}  // namespace
}  // namespace ulysses::security
