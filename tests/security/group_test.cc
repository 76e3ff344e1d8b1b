// Attacks and faults that need a group: two real daemons (host backend), one client per rank.
// Session counters that must stay in step when one rank refuses a session, session segments a
// client must not be able to cut short or write, and peers that die.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "hostile_client.h"
#include "ulysses/client/client.h"
#include "ulysses/common/sockets.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::security {
namespace {

/// A client that speaks the Control protocol by hand: attached, bound, and nothing more, so
/// that it can send what the library would refuse to.
struct RawClient {
  std::unique_ptr<v1::Control::Stub> control;
  Attached a;
  ipc::UniqueFd fd_socket;

  void Connect(const std::string& socket) {
    control = v1::Control::NewStub(
        grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials()));
    v1::AttachRequest req;
    req.set_client_name("raw");
    v1::AttachResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s = control->Attach(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    a = Attached{resp.client_id(), resp.token(), resp.fd_socket()};
    absl::StatusOr<ipc::UniqueFd> sock = ipc::ConnectUnix(a.fd_socket);
    ASSERT_TRUE(sock.ok()) << sock.status();
    ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeHello({a.client_id, a.token})).ok());
    absl::StatusOr<ipc::ReceivedMessage> ack = ipc::RecvMessage(sock->get(), 4096, 4);
    ASSERT_TRUE(ack.ok()) << ack.status();
    ASSERT_NE(ack->payload.find("true"), std::string::npos) << ack->payload;
    fd_socket = std::move(*sock);
  }
  void Prepare(grpc::ClientContext* ctx) const {
    ctx->AddMetadata("ulysses-client-id", std::to_string(a.client_id));
    ctx->AddMetadata("ulysses-token", a.token);
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  }
  grpc::Status JoinGroup(const std::string& name, int rank, const std::vector<std::string>& members,
                         v1::GroupInfo* out) {
    v1::JoinGroupRequest req;
    req.set_name(name);
    req.set_world_size(static_cast<int32_t>(members.size()));
    req.set_rank(rank);
    for (const std::string& m : members) req.add_members(m);
    req.set_timeout_ms(10000);
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return control->JoinGroup(&ctx, req, out);
  }
};

/// Fixture: two daemons of one node, each serving one rank of a group.
class GroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::string> dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    if (StartsOwnDaemons()) return;
    for (int r = 0; r < 2; ++r) StartDaemon(r);
  }
  virtual bool StartsOwnDaemons() const { return false; }

  /// A script that runs ulyssesd inside fresh namespaces: `unshare_args` for unshare(1), then
  /// `setup` (shell) before the exec. Empty when this machine cannot make them (not root, or
  /// namespaces off): the test then skips.
  std::string NamespaceWrapper(const std::string& name, const std::string& unshare_args,
                               const std::string& setup) {
    if (std::system(StrCat("unshare ", unshare_args, " -- sh -c '", setup, " true' >/dev/null 2>&1").c_str()) != 0)
      return "";
    const std::string path = StrCat(dir_, "/", name);
    std::ofstream f(path);
    f << "#!/bin/sh\nexec unshare " << unshare_args << " -- sh -c '" << setup
      << " exec \"$0\" \"$@\"' " << Ulyssesd() << " \"$@\"\n";
    f.close();
    ::chmod(path.c_str(), 0755);
    return path;
  }
  void TearDown() override {
    clients_.clear();
    daemons_.clear();
    if (!dir_.empty()) demo::RemoveRunDir(dir_);
  }

  void StartDaemon(int r, const std::vector<std::string>& extra = {}) {
    StartDaemonWith(Ulyssesd(), r, extra);
  }

  /// The daemon the tests run: $ULYSSESD when set (to run them against another build), else
  /// this build's.
  static std::string Ulyssesd() {
    const char* e = std::getenv("ULYSSESD");
    return e != nullptr && *e != '\0' ? e : ULYSSESD_PATH;
  }

  /// Starts daemon `r` through `program` (ulyssesd, or a script that execs it).
  void StartDaemonWith(const std::string& program, int r, const std::vector<std::string>& extra = {}) {
    absl::StatusOr<demo::DaemonProcess> d = demo::StartDaemon(program, dir_, r, "host", extra);
    ASSERT_TRUE(d.ok()) << d.status();
    if (daemons_.size() <= static_cast<size_t>(r)) daemons_.resize(r + 1);
    daemons_[r] = std::move(*d);
  }

  std::vector<std::string> Members() const {
    return {daemons_[0].socket(), daemons_[1].socket()};
  }

  std::unique_ptr<v1::Admin::Stub> Admin(int r) {
    return v1::Admin::NewStub(
        grpc::CreateChannel("unix://" + daemons_[r].socket(), grpc::InsecureChannelCredentials()));
  }
  /// Admin on rank `r`'s operator socket, where Drain and Undrain are allowed.
  std::unique_ptr<v1::Admin::Stub> Operator(int r) {
    return v1::Admin::NewStub(grpc::CreateChannel(
        "unix://" + daemons_[r].socket() + std::string(kOperatorSocketSuffix),
        grpc::InsecureChannelCredentials()));
  }

  /// One client per rank, joined to group `name`.
  void Join(const std::string& name, int64_t timeout_ms = 10000) {
    clients_.clear();
    for (int r = 0; r < 2; ++r) {
      auto c = client::Client::Connect({daemons_[r].socket(), StrCat("rank", r), absl::Seconds(10)});
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(std::move(*c));
    }
    absl::StatusOr<client::Group> g[2];
    OnBothRanks([&](int r) {
      g[r] = clients_[r]->JoinGroup({name, 2, r, Members(), "auto", timeout_ms});
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(g[r].ok()) << "rank " << r << ": " << g[r].status();
      groups_[r] = *g[r];
    }
  }

  /// Runs `f(rank)` for both ranks at once (collective calls block until every rank arrives).
  static void OnBothRanks(const std::function<void(int)>& f) {
    std::thread t([&] { f(0); });
    f(1);
    t.join();
  }

  /// Both ranks create a head-exchange session; returns each rank's outcome.
  std::array<absl::StatusOr<std::unique_ptr<client::Session>>, 2> CreateSessions(
      client::SessionSpec spec) {
    std::array<absl::StatusOr<std::unique_ptr<client::Session>>, 2> s{
        absl::UnknownError("not run"), absl::UnknownError("not run")};
    OnBothRanks([&](int r) { s[r] = clients_[r]->CreateSession(groups_[r], spec); });
    return s;
  }

  static client::SessionSpec SmallSpec(int64_t timeout_ms = 10000) {
    client::SessionSpec spec;
    spec.num_heads = 4;
    spec.head_dim = 8;
    spec.dtype = DType::kFloat32;
    spec.max_tokens = 16;
    spec.timeout_ms = timeout_ms;
    return spec;
  }

  void Drain(int r, bool on) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s;
    if (on) {
      v1::DrainResponse resp;
      s = Operator(r)->Drain(&ctx, {}, &resp);
    } else {
      v1::UndrainResponse resp;
      s = Operator(r)->Undrain(&ctx, {}, &resp);
    }
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  std::string dir_;
  std::vector<demo::DaemonProcess> daemons_;
  std::vector<std::unique_ptr<client::Client>> clients_;
  client::Group groups_[2];
};

// Item 16: a rank that refuses CreateSession before the rendezvous (draining, a bad geometry)
// used to return at once; its peer waited out the timeout, and that rank's session counter
// lagged for good, so every later session of the group timed out too.
TEST_F(GroupTest, ARankThatRefusesASessionStillArrivesAndTheCountersStayInStep) {
  Join("drained");
  Drain(1, true);
  auto refused = CreateSessions(SmallSpec(/*timeout_ms=*/4000));
  EXPECT_EQ(refused[1].status().code(), absl::StatusCode::kUnavailable) << refused[1].status();
  // The peer learns why from the rendezvous, instead of a DEADLINE_EXCEEDED after 4 s.
  EXPECT_EQ(refused[0].status().code(), absl::StatusCode::kFailedPrecondition) << refused[0].status();
  EXPECT_NE(refused[0].status().message().find("rank 1 could not create its session: daemon is draining"),
            std::string::npos)
      << refused[0].status();

  // A geometry that only one rank's daemon refuses (a raw client skips the library's check):
  // both ranks get an error at once, not a DEADLINE_EXCEEDED after 4 s.
  Drain(1, false);
  RawClient raw;
  ASSERT_NO_FATAL_FAILURE(raw.Connect(daemons_[1].socket()));
  absl::StatusOr<std::unique_ptr<client::Session>> good = absl::UnknownError("not run");
  grpc::Status bad_status;
  {
    // Rank 0 with the library, rank 1 raw, in a group of their own.
    auto c0 = client::Client::Connect({daemons_[0].socket(), "geo0", absl::Seconds(10)});
    ASSERT_TRUE(c0.ok()) << c0.status();
    absl::StatusOr<client::Group> g0 = absl::UnknownError("not run");
    v1::GroupInfo g1;
    grpc::Status joined;
    std::thread t([&] { g0 = (*c0)->JoinGroup({"geo", 2, 0, Members(), "auto", 10000}); });
    joined = raw.JoinGroup("geo", 1, Members(), &g1);
    t.join();
    ASSERT_TRUE(g0.ok()) << g0.status();
    ASSERT_TRUE(joined.ok()) << joined.error_message();
    std::thread t2([&] { good = (*c0)->CreateSession(*g0, SmallSpec(4000)); });
    v1::CreateSessionRequest req;
    req.set_group_id(g1.group_id());
    req.mutable_spec()->set_num_heads(3);  // not divisible by the world size
    req.mutable_spec()->set_head_dim(8);
    req.mutable_spec()->set_dtype(v1::DTYPE_FLOAT32);
    req.mutable_spec()->set_max_tokens(16);
    req.set_timeout_ms(4000);
    v1::SessionInfo info;
    grpc::ClientContext ctx;
    raw.Prepare(&ctx);
    bad_status = raw.control->CreateSession(&ctx, req, &info);
    t2.join();
  }
  EXPECT_EQ(bad_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad_status.error_message();
  EXPECT_FALSE(good.ok());
  EXPECT_NE(good.status().code(), absl::StatusCode::kDeadlineExceeded) << good.status();

  // Every rank's counter moved on together: the next session forms and runs.
  auto ok = CreateSessions(SmallSpec());
  ASSERT_TRUE(ok[0].ok()) << ok[0].status();
  ASSERT_TRUE(ok[1].ok()) << ok[1].status();
  absl::StatusOr<client::Result> results[2];
  client::Buffer x[2];
  for (int r = 0; r < 2; ++r) {
    auto b = clients_[r]->AllocBuffer(16 * 4 * 8 * 4);
    ASSERT_TRUE(b.ok()) << b.status();
    x[r] = *b;
  }
  OnBothRanks([&](int r) { results[r] = (*ok[r])->ScatterHeads(x[r].Ref(), 1, 8); });
  EXPECT_TRUE(results[0].ok()) << results[0].status();
  EXPECT_TRUE(results[1].ok()) << results[1].status();
}

// Item 3: the session segment a client gets was its daemon's read-write shm descriptor. A
// client that cut it short (ftruncate) made the next call of its daemon, and of the peer daemon
// writing into it, die with SIGBUS; one that mapped it writable could forge the control words
// both daemons trust.
// Rank 0 takes each daemon that arrives as the rank it says. A client therefore joins as rank r
// only through the daemon of members[r]: a client of daemon 0 cannot take rank 1 of a group
// whose rank 1 is daemon 1's, and nothing of the group is left at either daemon.
TEST_F(GroupTest, AClientJoinsAsARankOnlyThroughThatRanksDaemon) {
  auto c = client::Client::Connect({daemons_[0].socket(), "intruder", absl::Seconds(10)});
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<client::Group> g = (*c)->JoinGroup({"victim", 2, 1, Members(), "auto", 2000});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
  EXPECT_NE(g.status().message().find("members[1]"), std::string::npos) << g.status();
  for (int r = 0; r < 2; ++r) {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ASSERT_TRUE(Admin(r)->GetState(&ctx, {}, &st).ok());
    EXPECT_EQ(st.num_groups(), 0) << r;
  }
  // Its own daemon, in another spelling of the same socket, is fine.
  absl::StatusOr<client::Group> own =
      (*c)->JoinGroup({"own", 1, 0, {"unix://" + daemons_[0].socket()}, "auto", 2000});
  EXPECT_TRUE(own.ok()) << own.status();
}

TEST_F(GroupTest, TheSessionSegmentAClientGetsCannotBeResizedOrWritten) {
  RawClient raw;
  ASSERT_NO_FATAL_FAILURE(raw.Connect(daemons_[0].socket()));
  auto peer = client::Client::Connect({daemons_[1].socket(), "peer", absl::Seconds(10)});
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<client::Group> g1 = absl::UnknownError("not run");
  v1::GroupInfo g0;
  std::thread t([&] { g1 = (*peer)->JoinGroup({"seg", 2, 1, Members(), "auto", 10000}); });
  grpc::Status joined = raw.JoinGroup("seg", 0, Members(), &g0);
  t.join();
  ASSERT_TRUE(joined.ok()) << joined.error_message();
  ASSERT_TRUE(g1.ok()) << g1.status();

  absl::StatusOr<std::unique_ptr<client::Session>> s1 = absl::UnknownError("not run");
  std::thread t2([&] { s1 = (*peer)->CreateSession(*g1, SmallSpec()); });
  v1::CreateSessionRequest req;
  req.set_group_id(g0.group_id());
  req.mutable_spec()->set_num_heads(4);
  req.mutable_spec()->set_head_dim(8);
  req.mutable_spec()->set_dtype(v1::DTYPE_FLOAT32);
  req.mutable_spec()->set_max_tokens(16);
  req.set_timeout_ms(10000);
  v1::SessionInfo info;
  grpc::Status created;
  {
    grpc::ClientContext ctx;
    raw.Prepare(&ctx);
    created = raw.control->CreateSession(&ctx, req, &info);
  }
  t2.join();
  ASSERT_TRUE(created.ok()) << created.error_message();
  ASSERT_TRUE(s1.ok()) << s1.status();
  absl::StatusOr<ipc::ReceivedMessage> frame = ipc::RecvMessage(raw.fd_socket.get(), 4096, 2);
  ASSERT_TRUE(frame.ok()) << frame.status();
  ASSERT_EQ(frame->fds.size(), 1u) << frame->payload;
  const int seg = frame->fds[0].get();
  const size_t bytes = info.segment_bytes();

  // The attacks: cut it short, grow it, map it writable, write it, punch a hole.
  EXPECT_NE(::ftruncate(seg, 0), 0) << "the client shrank its session segment";
  EXPECT_NE(::ftruncate(seg, static_cast<off_t>(bytes) * 2), 0) << "the client grew it";
  void* w = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, seg, 0);
  EXPECT_EQ(w, MAP_FAILED) << "the client mapped its session segment writable";
  if (w != MAP_FAILED) ::munmap(w, bytes);
  const char junk[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_LT(::pwrite(seg, junk, sizeof junk, 48), 0) << "the client wrote the abort word";
  EXPECT_NE(::fallocate(seg, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  // Reading is what it is for.
  void* r = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, seg, 0);
  ASSERT_NE(r, MAP_FAILED) << std::strerror(errno);
  ::munmap(r, bytes);
  // A process of another uid holding the descriptor cannot reopen it writable through /proc.
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0) _exit(2);
    ::prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);  // let it see its own /proc/self/fd
    const int rw = ::open(StrCat("/proc/self/fd/", seg).c_str(), O_RDWR);
    _exit(rw >= 0 ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "another uid reopened the session segment read-write (exit " << WEXITSTATUS(status) << ")";

  // Both daemons still serve the session: a call on both ranks succeeds.
  v1::AllocBufferRequest alloc;
  alloc.set_size_bytes(16 * 4 * 8 * 4);
  v1::BufferInfo buf;
  {
    grpc::ClientContext ctx;
    raw.Prepare(&ctx);
    ASSERT_TRUE(raw.control->AllocBuffer(&ctx, alloc, &buf).ok());
  }
  absl::StatusOr<ipc::ReceivedMessage> buf_frame = ipc::RecvMessage(raw.fd_socket.get(), 4096, 2);
  ASSERT_TRUE(buf_frame.ok()) << buf_frame.status();
  auto x1 = (*peer)->AllocBuffer(16 * 4 * 8 * 4);
  ASSERT_TRUE(x1.ok()) << x1.status();
  grpc::Status call0;
  absl::StatusOr<client::Result> call1 = absl::UnknownError("not run");
  std::thread t3([&] { call1 = (*s1)->ScatterHeads(x1->Ref(), 1, 8); });
  {
    v1::CallRequest call;
    call.set_session_id(info.session_id());
    call.set_op(v1::OP_KIND_SCATTER_HEADS);
    call.set_batch(1);
    call.set_seq(8);
    call.add_inputs()->set_buffer_id(buf.buffer_id());
    v1::CallResponse resp;
    grpc::ClientContext ctx;
    raw.Prepare(&ctx);
    call0 = raw.control->Call(&ctx, call, &resp);
  }
  t3.join();
  EXPECT_TRUE(call0.ok()) << call0.error_message();
  EXPECT_TRUE(call1.ok()) << call1.status();
  for (int d = 0; d < 2; ++d) {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    EXPECT_TRUE(Admin(d)->GetState(&ctx, {}, &st).ok()) << "daemon " << d << " died";
  }
}

/// Runs a call on rank 0 only; rank 1 never comes, so the call waits on it until something
/// ends it. Returns once the call waits in daemon 0.
struct LonelyCall {
  absl::StatusOr<client::Result> result = absl::UnknownError("not run");
  std::thread thread;
  client::Buffer x;
};

// Daemons of its own: rank 1's with one request in progress per client.
class GroupPlaceTest : public GroupTest {
 protected:
  bool StartsOwnDaemons() const override { return true; }
};

// A rank whose client has no place left among its requests in progress is refused
// CreateSession, but still arrives at the rendezvous: the other rank learns why at once, and
// the group's session counter moves on alike on both ranks, so the next session forms.
TEST_F(GroupPlaceTest, ARankPastItsRequestsInProgressStillArrivesAndTheCountersStayInStep) {
  StartDaemon(0);
  const std::string config = dir_ + "/one-request.json";
  std::ofstream(config) << R"({"limits": {"calls_in_progress_per_client": 1}})";
  StartDaemon(1, {"--config", config});
  RawClient raw;
  ASSERT_NO_FATAL_FAILURE(raw.Connect(daemons_[1].socket()));
  auto c0 = client::Client::Connect({daemons_[0].socket(), "rank0", absl::Seconds(10)});
  ASSERT_TRUE(c0.ok()) << c0.status();
  absl::StatusOr<client::Group> g0 = absl::UnknownError("not run");
  v1::GroupInfo g1;
  std::thread join([&] { g0 = (*c0)->JoinGroup({"place", 2, 0, Members(), "auto", 10000}); });
  const grpc::Status joined = raw.JoinGroup("place", 1, Members(), &g1);
  join.join();
  ASSERT_TRUE(g0.ok()) << g0.status();
  ASSERT_TRUE(joined.ok()) << joined.error_message();

  // Rank 1's one place: a RegisterBuffer that waits for a descriptor sent later. (A probe
  // that took the place first refuses it at once; it is then sent again.)
  auto unary = [&](auto call) {
    grpc::ClientContext ctx;
    raw.Prepare(&ctx);
    return call(ctx);
  };
  std::atomic<bool> holder_done{false};
  grpc::Status held;
  std::thread holder;
  auto hold = [&] {
    holder_done = false;
    holder = std::thread([&] {
      held = unary([&](grpc::ClientContext& ctx) {
        v1::RegisterBufferRequest req;
        req.set_tag(7);
        req.set_name("waits");
        v1::BufferInfo info;
        return raw.control->RegisterBuffer(&ctx, req, &info);
      });
      holder_done = true;
    });
  };
  hold();
  ASSERT_TRUE(Eventually([&] {
    const grpc::Status probe = unary([&](grpc::ClientContext& ctx) {
      v1::FreeBufferRequest req;
      req.set_buffer_id(987654321);
      v1::FreeBufferResponse resp;
      return raw.control->FreeBuffer(&ctx, req, &resp);
    });
    if (probe.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) return true;
    if (holder_done) {  // refused while the probe held the place
      holder.join();
      hold();
    }
    return false;
  }));

  absl::StatusOr<std::unique_ptr<client::Session>> s0 = absl::UnknownError("not run");
  std::thread create([&] { s0 = (*c0)->CreateSession(*g0, SmallSpec(4000)); });
  v1::CreateSessionRequest req;
  req.set_group_id(g1.group_id());
  req.mutable_spec()->set_num_heads(4);
  req.mutable_spec()->set_head_dim(8);
  req.mutable_spec()->set_dtype(v1::DTYPE_FLOAT32);
  req.mutable_spec()->set_max_tokens(16);
  req.set_timeout_ms(4000);
  v1::SessionInfo info;
  const grpc::Status refused = unary([&](grpc::ClientContext& ctx) {
    return raw.control->CreateSession(&ctx, req, &info);
  });
  create.join();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("limits.calls_in_progress_per_client"), std::string::npos)
      << refused.error_message();
  ASSERT_FALSE(s0.ok());
  EXPECT_EQ(s0.status().code(), absl::StatusCode::kFailedPrecondition) << s0.status();
  EXPECT_NE(s0.status().message().find("calls_in_progress_per_client"), std::string::npos)
      << s0.status();

  // The descriptor comes: the place is free, and the next session forms on both ranks.
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("late", 4096);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  const int one[1] = {memfd->get()};
  ASSERT_TRUE(ipc::SendMessage(raw.fd_socket.get(), ipc::EncodeFdFrame({7}), one).ok());
  holder.join();
  EXPECT_TRUE(held.ok()) << held.error_message();
  std::thread again([&] { s0 = (*c0)->CreateSession(*g0, SmallSpec(4000)); });
  const grpc::Status formed = unary([&](grpc::ClientContext& ctx) {
    return raw.control->CreateSession(&ctx, req, &info);
  });
  again.join();
  EXPECT_TRUE(formed.ok()) << formed.error_message();
  EXPECT_TRUE(s0.ok()) << s0.status();
}

class PeerFaultTest : public GroupTest {
 protected:
  bool StartsOwnDaemons() const override { return true; }
  void SetUp() override {
    GroupTest::SetUp();
    // A call timeout short enough that a run against a build without peer liveness ends in
    // seconds, long enough that no death below is seen through it.
    for (int r = 0; r < 2; ++r) StartDaemon(r, {"--call-timeout-ms", "10000"});
    Join("faults");
    auto s = CreateSessions(SmallSpec());
    ASSERT_TRUE(s[0].ok()) << s[0].status();
    ASSERT_TRUE(s[1].ok()) << s[1].status();
    sessions_[0] = std::move(*s[0]);
    sessions_[1] = std::move(*s[1]);
  }
  void TearDown() override {
    if (call_.thread.joinable()) call_.thread.join();
    sessions_[0].reset();
    sessions_[1].reset();
    GroupTest::TearDown();
  }

  int ActiveCalls(int r) {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    return Admin(r)->GetState(&ctx, {}, &st).ok() ? st.active_calls() : -1;
  }

  /// Rank 0 submits a call and waits for it (`wait` bounds the client's wait).
  void StartLonelyCall(absl::Duration wait) {
    auto x = clients_[0]->AllocBuffer(16 * 4 * 8 * 4);
    ASSERT_TRUE(x.ok()) << x.status();
    call_.x = *x;
    CallArgs a;
    a.op = OpKind::kScatterHeads;
    a.batch = 1;
    a.seq = 8;
    a.inputs[0] = call_.x.Ref();
    absl::StatusOr<uint64_t> epoch = sessions_[0]->Submit(a);
    ASSERT_TRUE(epoch.ok()) << epoch.status();
    call_.thread = std::thread([this, e = *epoch, wait] { call_.result = sessions_[0]->Wait(e, wait); });
    ASSERT_TRUE(Eventually([&] { return ActiveCalls(0) == 1; })) << "the call never started";
  }

  std::unique_ptr<client::Session> sessions_[2];
  LonelyCall call_;
};

// Item 14: a peer daemon that dies ends the survivor's call at once, through the link each
// session holds to its peers' daemons; before, the call waited out timeouts.call_ms.
TEST_F(PeerFaultTest, APeerDaemonKilledMidCallEndsTheCallWithAborted) {
  ASSERT_NO_FATAL_FAILURE(StartLonelyCall(absl::Seconds(60)));
  daemons_[1].Kill();
  call_.thread.join();
  EXPECT_EQ(call_.result.status().code(), absl::StatusCode::kAborted) << call_.result.status();
  EXPECT_NE(call_.result.status().message().find("rank 1"), std::string::npos)
      << call_.result.status();
}

// A peer that hangs (SIGSTOP) is not dead: its link stays open, and the call ends at the
// configured call timeout.
TEST_F(PeerFaultTest, AStoppedPeerDaemonEndsTheCallAtTheCallTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartLonelyCall(absl::Seconds(60)));
  ASSERT_EQ(::kill(daemons_[1].pid(), SIGSTOP), 0);
  call_.thread.join();
  ::kill(daemons_[1].pid(), SIGCONT);
  EXPECT_EQ(call_.result.status().code(), absl::StatusCode::kDeadlineExceeded)
      << call_.result.status();
}

// Item 14: a client whose own daemon is SIGKILLed learns it at once (UNAVAILABLE), instead of
// waiting out its Wait timeout; its fd socket hung up the moment the daemon died.
TEST_F(PeerFaultTest, AClientWhoseDaemonIsKilledGetsUnavailable) {
  ASSERT_NO_FATAL_FAILURE(StartLonelyCall(absl::Seconds(20)));
  daemons_[0].Kill();
  call_.thread.join();
  EXPECT_EQ(call_.result.status().code(), absl::StatusCode::kUnavailable) << call_.result.status();
}

class NamespaceTest : public GroupTest {
 protected:
  bool StartsOwnDaemons() const override { return true; }
};

// Item 4: with /dev/shm smaller than a session (Docker's default is 64 MiB), CreateSession used
// to succeed and the first call died with SIGBUS. Session segments no longer live in /dev/shm,
// and their memory is reserved when the session is made.
TEST_F(NamespaceTest, ASmallDevShmDoesNotKillTheDaemon) {
  const std::string wrapper =
      NamespaceWrapper("small-shm", "-m", "mount -t tmpfs -o size=1m tmpfs /dev/shm &&");
  if (wrapper.empty()) GTEST_SKIP() << "cannot make a mount namespace here (needs root)";
  ASSERT_NO_FATAL_FAILURE(StartDaemonWith(wrapper, 0));
  auto c = client::Client::Connect({daemons_[0].socket(), "big", absl::Seconds(10)});
  ASSERT_TRUE(c.ok()) << c.status();
  auto g = (*c)->JoinGroup({"big", 1, 0, {daemons_[0].socket()}, "auto", 10000});
  ASSERT_TRUE(g.ok()) << g.status();
  client::SessionSpec spec;  // 2 slots of 1 MiB: twice what /dev/shm holds
  spec.num_heads = 4;
  spec.head_dim = 64;
  spec.dtype = DType::kFloat32;
  spec.max_tokens = 1024;
  auto s = (*c)->CreateSession(*g, spec);
  ASSERT_TRUE(s.ok()) << s.status();
  auto x = (*c)->AllocBuffer(1024 * 4 * 64 * 4);
  ASSERT_TRUE(x.ok()) << x.status();
  for (int i = 0; i < 2; ++i) {
    auto r = (*s)->ScatterHeads(x->Ref(), 1, 1024);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  v1::DaemonState st;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  EXPECT_TRUE(Admin(0)->GetState(&ctx, {}, &st).ok()) << "the daemon died";
}

// Item 8: daemons in separate pid namespaces sharing /dev/shm (one container per GPU) are all
// pid 1. Segments named after the pid collided: CreateSession failed, and one daemon unlinked
// the other's segment. Memfd segments have no name to collide.
TEST_F(NamespaceTest, DaemonsInSeparatePidNamespacesFormSessions) {
  const std::string wrapper = NamespaceWrapper("pid-ns", "-p -f --kill-child", "");
  if (wrapper.empty()) GTEST_SKIP() << "cannot make a pid namespace here (needs root)";
  for (int r = 0; r < 2; ++r) ASSERT_NO_FATAL_FAILURE(StartDaemonWith(wrapper, r));
  Join("pidns");
  for (int i = 0; i < 3; ++i) {
    auto s = CreateSessions(SmallSpec());
    ASSERT_TRUE(s[0].ok()) << "session " << i << ", rank 0: " << s[0].status();
    ASSERT_TRUE(s[1].ok()) << "session " << i << ", rank 1: " << s[1].status();
    client::Buffer x[2];
    absl::StatusOr<client::Result> r[2];
    for (int k = 0; k < 2; ++k) {
      auto b = clients_[k]->AllocBuffer(16 * 4 * 8 * 4);
      ASSERT_TRUE(b.ok()) << b.status();
      x[k] = *b;
    }
    OnBothRanks([&](int k) { r[k] = (*s[k])->ScatterHeads(x[k].Ref(), 1, 8); });
    EXPECT_TRUE(r[0].ok()) << r[0].status();
    EXPECT_TRUE(r[1].ok()) << r[1].status();
  }
}

}  // namespace
}  // namespace ulysses::security
