// SIGKILL of a client at each phase, and at random moments of its whole life: its daemon
// reclaims everything (clients, sessions, slots, buffers, shared segments, descriptors), peers
// waiting on it get ABORTED rather than time out, and the other clients' results stay exact.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <thread>

#include "../util/fd_count.h"
#include "absl/cleanup/cleanup.h"
#include "cluster_util.h"
#include "demo_lib.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pair_round.h"
#include "ulysses/client/client.h"
#include "ulysses/common/strings.h"
#include "ulysses/v1/admin.grpc.pb.h"

namespace ulysses {
namespace {

using testing_util::Eventually;

// Session segments (memfds) process `pid` maps: one line of /proc/<pid>/maps each.
int CountSessionMappings(pid_t pid) {
  std::ifstream maps(StrCat("/proc/", pid, "/maps"));
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find("/memfd:ulysses-session-") != std::string::npos) ++n;
  return n;
}

class KillFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok());
    dir_ = *dir;
    for (int r = 0; r < 2; ++r) {
      auto d = demo::StartDaemon(ULYSSESD_PATH, dir_, r, "host", {"--call-timeout-ms", "30000"});
      ASSERT_TRUE(d.ok()) << d.status();
      daemons_.push_back(std::move(*d));
    }
    // Warm up the daemons' channels to each other with a group that comes and goes, so the
    // descriptor baseline below counts only per-client resources.
    {
      auto c0 = Connect(0, "warm0");
      auto c1 = Connect(1, "warm1");
      absl::StatusOr<client::Group> g0, g1;
      std::thread t([&] { g0 = c0->JoinGroup({"warm", 2, 0, Members(), "auto", 10000}); });
      g1 = c1->JoinGroup({"warm", 2, 1, Members(), "auto", 10000});
      t.join();
      ASSERT_TRUE(g0.ok() && g1.ok());
    }
    ASSERT_TRUE(Eventually([&] { return Clients(1) == 0; }));
    // A bystander on daemon 1 with its own one-rank session.
    bystander_ = Connect(1, "bystander");
    auto g = bystander_->JoinGroup({"bystander", 1, 0, {daemons_[1].socket()}, "auto", 0});
    ASSERT_TRUE(g.ok());
    auto s = bystander_->CreateSession(*g, {4, 8, DType::kFloat32, 16, 2, {}, 0});
    ASSERT_TRUE(s.ok());
    bystander_session_ = std::move(*s);
    auto x = bystander_->AllocBuffer(16 * 4 * 8 * 4);
    ASSERT_TRUE(x.ok());
    bx_ = *x;
    for (int i = 0; i < 16 * 4 * 8; ++i) static_cast<float*>(bx_.data)[i] = static_cast<float>(i);
    ASSERT_TRUE(BystanderExact());
    baseline_fds_ = CountFdsButPipes(daemons_[1].pid());
    baseline_shm_ = CountSessionMappings(daemons_[1].pid());
    EXPECT_EQ(baseline_shm_, 1);  // the bystander's session
  }
  void TearDown() override {
    bystander_session_.reset();
    bystander_.reset();
    daemons_.clear();
    demo::RemoveRunDir(dir_);
  }

  std::vector<std::string> Members() const { return {daemons_[0].socket(), daemons_[1].socket()}; }
  std::unique_ptr<client::Client> Connect(int r, const std::string& name) {
    auto c = client::Client::Connect({daemons_[r].socket(), name});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  std::unique_ptr<v1::Admin::Stub> Admin(int r) {
    return testing_util::AdminStub(daemons_[r].socket());
  }
  int Clients(int r) {
    v1::ListClientsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(Admin(r)->ListClients(&ctx, {}, &resp).ok());
    return resp.clients_size();
  }
  int Slots(int r) {
    v1::ListSlotsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(Admin(r)->ListSlots(&ctx, {}, &resp).ok());
    return resp.slots_size();
  }
  bool BystanderExact() {
    auto r = bystander_session_->ScatterHeads(bx_.Ref(), 1, 16);
    return r.ok() && std::memcmp(r->data, bx_.data, 16 * 4 * 8 * 4) == 0;
  }
  // Daemon 1 is back to its baseline (only the bystander, its two slots, its session mapping
  // and the descriptors counted in SetUp) and the bystander's results are exact. `what` names
  // the moment in the failure messages.
  void BackToBaseline(const std::string& what) {
    ASSERT_TRUE(Eventually([&] { return Clients(1) == 1; })) << what << ": clients";
    ASSERT_TRUE(Eventually([&] { return Slots(1) == 2; })) << what << ": slots";
    ASSERT_TRUE(Eventually([&] {
      return CountSessionMappings(daemons_[1].pid()) == baseline_shm_;
    })) << what << ": a session segment of the killed client is still mapped";
    // At most the baseline: a descriptor the daemon held only for a moment when SetUp counted
    // (seen once under TSan: 28 against 29) is not one the killed client left behind.
    ASSERT_TRUE(Eventually([&] {
      return CountFdsButPipes(daemons_[1].pid()) <= baseline_fds_;
    })) << what << ": descriptors "
        << CountFdsButPipes(daemons_[1].pid()) << " vs baseline "
        << baseline_fds_;
    ASSERT_TRUE(BystanderExact()) << what;
  }
  pid_t SpawnPhaseClient(const std::string& phase, const std::vector<std::string>& members,
                         int rank, const std::string& ready, const std::string& tag = "-") {
    std::string m = members[0];
    for (size_t i = 1; i < members.size(); ++i) m += "," + members[i];
    const std::string rank_text = std::to_string(rank);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::execl(PHASE_CLIENT_PATH, PHASE_CLIENT_PATH, "--socket", daemons_[1].socket().c_str(),
              "--members", m.c_str(), "--rank", rank_text.c_str(), "--phase", phase.c_str(),
              "--ready", ready.c_str(), "--tag", tag.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    return pid;
  }

  std::string dir_;
  std::vector<demo::DaemonProcess> daemons_;
  std::unique_ptr<client::Client> bystander_;
  std::unique_ptr<client::Session> bystander_session_;
  client::Buffer bx_;
  int baseline_fds_ = 0, baseline_shm_ = 0;
};

class KillAtPhase : public KillFixture, public ::testing::WithParamInterface<std::string> {};

TEST_P(KillAtPhase, DaemonReclaimsEverythingAndPeersAbort) {
  const std::string phase = GetParam();
  const bool two_ranks =
      phase == "joined" || phase == "session" || phase == "queued" || phase == "exchange";
  const std::string ready = StrCat(dir_, "/phase.ready");
  // Rank 0 of the two-rank group lives in this process, on daemon 0.
  std::unique_ptr<client::Client> peer;
  absl::StatusOr<client::Group> pg;
  absl::StatusOr<std::unique_ptr<client::Session>> ps;
  std::thread peer_setup;
  if (two_ranks) {
    peer = Connect(0, "peer");
    peer_setup = std::thread([&] {
      pg = peer->JoinGroup({"phase", 2, 0, Members(), "auto", 20000});
      if (pg.ok() && phase != "joined")
        ps = peer->CreateSession(*pg, {4, 8, DType::kFloat32, 16, 2, {}, 20000});
    });
  }
  const pid_t pid = SpawnPhaseClient(
      phase, two_ranks ? Members() : std::vector<std::string>{daemons_[1].socket()},
      two_ranks ? 1 : 0, ready);
  if (peer_setup.joinable()) peer_setup.join();
  if (two_ranks) {
    ASSERT_TRUE(pg.ok()) << pg.status();
    if (phase != "joined") {
      ASSERT_TRUE(ps.ok()) << ps.status();
    }
  }
  ASSERT_TRUE(Eventually([&] { return ::access(ready.c_str(), F_OK) == 0; })) << "phase client not ready";
  EXPECT_EQ(Clients(1), 2);

  // In the exchange phase, rank 0 calls and waits for rank 1, which never comes.
  absl::StatusOr<client::Result> peer_call;
  std::thread caller;
  client::Buffer px;
  if (phase == "exchange") {
    auto x = peer->AllocBuffer(16 * 4 * 8 * 4);
    ASSERT_TRUE(x.ok());
    px = *x;
    caller = std::thread([&] { peer_call = (*ps)->ScatterHeads(px.Ref(), 1, 16); });
    ASSERT_TRUE(Eventually([&] {
      v1::DaemonState st;
      grpc::ClientContext ctx;
      return Admin(0)->GetState(&ctx, {}, &st).ok() && st.active_calls() == 1;
    }));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);

  // Daemon 1 is back to its baseline: only the bystander and its two slots remain.
  EXPECT_TRUE(Eventually([&] { return Clients(1) == 1; }));
  EXPECT_TRUE(Eventually([&] { return Slots(1) == 2; }));
  EXPECT_TRUE(Eventually([&] {
    return CountSessionMappings(daemons_[1].pid()) == baseline_shm_;
  })) << "a session segment of the killed client is still mapped";
  EXPECT_TRUE(Eventually([&] {
    return CountFdsButPipes(daemons_[1].pid()) <= baseline_fds_;  // as BackToBaseline
  })) << "descriptors: " << CountFdsButPipes(daemons_[1].pid())
      << " vs baseline " << baseline_fds_;
  if (phase == "exchange") {
    caller.join();
    // Ended by rank 1's abort, not by the 30 s call timeout.
    EXPECT_EQ(peer_call.status().code(), absl::StatusCode::kAborted) << peer_call.status();
  }
  if (phase == "joined") {
    // Rank 1 died after the join, before its first session: the survivor's session ends
    // ABORTED by the group's end (its daemon told rank 0's table), not at the minute's timeout.
    auto s = peer->CreateSession(*pg, {4, 8, DType::kFloat32, 16, 2, {}, 60000});
    EXPECT_EQ(s.status().code(), absl::StatusCode::kAborted) << s.status();
    EXPECT_NE(s.status().message().find("rank 1's client went away"), std::string::npos)
        << s.status();
  } else if (two_ranks && phase != "exchange") {
    // The surviving rank's next call learns of the abort at once.
    auto x = peer->AllocBuffer(16 * 4 * 8 * 4);
    ASSERT_TRUE(x.ok());
    auto r = (*ps)->ScatterHeads(x->Ref(), 1, 16);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  }
  EXPECT_TRUE(BystanderExact());
}

INSTANTIATE_TEST_SUITE_P(Phases, KillAtPhase,
                         ::testing::Values("attach", "buffer", "joined", "session", "held",
                                           "queued", "exchange"));

// A rank that leaves its group (LeaveGroup) ends the group's later sessions for the other
// ranks at once: the session the other rank asks for then is ABORTED naming the rank that
// left, not refused at the minute's rendezvous timeout. A new group of the same name, made by
// both ranks afterwards, serves: the end named only the group that was left.
TEST_F(KillFixture, ARankThatLeftItsGroupEndsTheOtherRanksNextSessionAtOnce) {
  auto c0 = Connect(0, "rank0");
  auto c1 = Connect(1, "rank1");
  ASSERT_NE(c0, nullptr);
  ASSERT_NE(c1, nullptr);
  auto join_both = [&]() -> std::pair<absl::StatusOr<client::Group>, absl::StatusOr<client::Group>> {
    absl::StatusOr<client::Group> g1 = absl::UnknownError("not joined");
    std::thread t([&] { g1 = c1->JoinGroup({"leave", 2, 1, Members(), "auto", 20000}); });
    absl::StatusOr<client::Group> g0 = c0->JoinGroup({"leave", 2, 0, Members(), "auto", 20000});
    t.join();
    return {std::move(g0), std::move(g1)};
  };
  auto first = join_both();
  absl::StatusOr<client::Group>& g0 = first.first;
  absl::StatusOr<client::Group>& g1 = first.second;
  ASSERT_TRUE(g0.ok()) << g0.status();
  ASSERT_TRUE(g1.ok()) << g1.status();
  ASSERT_TRUE(c1->LeaveGroup(*g1).ok());
  auto s = c0->CreateSession(*g0, {4, 8, DType::kFloat32, 16, 2, {}, 60000});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAborted) << s.status();
  EXPECT_NE(s.status().message().find("rank 1 left the group"), std::string::npos) << s.status();
  ASSERT_TRUE(c0->LeaveGroup(*g0).ok());
  auto again = join_both();  // (no structured bindings: clang 14 cannot capture them)
  absl::StatusOr<client::Group>& h0 = again.first;
  absl::StatusOr<client::Group>& h1 = again.second;
  ASSERT_TRUE(h0.ok()) << h0.status();
  ASSERT_TRUE(h1.ok()) << h1.status();
  absl::StatusOr<std::unique_ptr<client::Session>> s1;
  std::thread t([&] { s1 = c1->CreateSession(*h1, {4, 8, DType::kFloat32, 16, 2, {}, 20000}); });
  auto s0 = c0->CreateSession(*h0, {4, 8, DType::kFloat32, 16, 2, {}, 20000});
  t.join();
  EXPECT_TRUE(s0.ok()) << s0.status();
  EXPECT_TRUE(s1.ok()) << s1.status();
  EXPECT_TRUE(BystanderExact());
}

// A client that goes round its whole life (attach, buffers, a one-rank group, a session,
// submitted, waited, held and out= calls, close) again and again, SIGKILLed 100 times at a
// random moment (0 to 30 ms after its first attach): after every kill the daemon is back to
// its baseline and the bystander's results stay exact.
TEST_F(KillFixture, AClientKilledAtRandomMomentsLeavesNothingBehind) {
  constexpr int kKills = 100;
  const uint32_t seed = 20261201;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> delay_us(0, 30000);
  std::cout << "seed " << seed << "\n";
  int attached_at_kill = 0;
  for (int i = 0; i < kKills; ++i) {
    const std::string ready = StrCat(dir_, "/cycle", i, ".ready");
    const pid_t pid = SpawnPhaseClient("cycle", {daemons_[1].socket()}, 0, ready);
    ASSERT_TRUE(Eventually([&] { return ::access(ready.c_str(), F_OK) == 0; }))
        << "kill " << i << ": the client did not start";
    // From its first attach on (a slow start would otherwise take the whole window).
    ASSERT_TRUE(Eventually([&] { return Clients(1) == 2; })) << "kill " << i << ": never attached";
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
    if (Clients(1) == 2) ++attached_at_kill;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ASSERT_NO_FATAL_FAILURE(BackToBaseline(StrCat("kill ", i)));
  }
  std::cout << kKills << " kills, " << attached_at_kill
            << " of them while the client was attached (the others between its rounds)\n";
}

// Rank 1 of a two-rank group (phase_client pair-cycle on daemon 1) goes round join, session,
// three calls and close in step with rank 0 (this test, on daemon 0), and is SIGKILLed 30
// times at a random moment (0 to 40 ms after it announced itself). Each time the survivor's
// round ends in an error; a session or call ends ABORTED by the peer's death, never at a
// timeout, also when the peer died before it reached the session's rendezvous (its daemon
// ends the group at rank 0's table). Only a join that the peer never began ends at the 2 s
// rendezvous timeout: no daemon knew it would come. Both daemons are then back to their baselines, the survivor's next group works,
// and the bystander's results stay exact.
TEST_F(KillFixture, APeerRankKilledAtRandomMomentsAbortsTheSurvivorAndLeavesNothingBehind) {
  constexpr int kKills = 30;
  const uint32_t seed = 20261202;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> delay_us(0, 40000);
  std::cout << "seed " << seed << "\n";
  auto survivor = Connect(0, "survivor");
  ASSERT_NE(survivor, nullptr);
  auto x = survivor->AllocBuffer(16 * 4 * 8 * 4, "x");
  ASSERT_TRUE(x.ok()) << x.status();
  std::map<std::string, int> ended;  // the step at which the survivor's round ended
  for (int k = 0; k < kKills; ++k) {
    const std::string tag = StrCat("pair", k);
    const std::string ready = StrCat(dir_, "/", tag, ".ready");
    const pid_t pid = SpawnPhaseClient("pair-cycle", Members(), 1, ready, tag);
    absl::Status survivor_end;
    std::thread rank0([&] {
      for (int i = 0;; ++i) {
        survivor_end = testing_util::PairRound(*survivor, Members(), 0, StrCat(tag, "-", i), *x);
        if (!survivor_end.ok()) return;
      }
    });
    const bool announced = Eventually([&] { return ::access(ready.c_str(), F_OK) == 0; });
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    rank0.join();
    ASSERT_TRUE(announced) << "kill " << k << ": rank 1 did not start";
    ASSERT_FALSE(survivor_end.ok()) << "kill " << k;
    const std::string msg(survivor_end.message());
    const std::string step = msg.substr(0, msg.find(':'));
    ++ended[StrCat(step, " ", absl::StatusCodeToString(survivor_end.code()))];
    if (step != "join") {
      EXPECT_NE(survivor_end.code(), absl::StatusCode::kDeadlineExceeded)
          << "kill " << k << ": the peer's death was seen only at a timeout: " << survivor_end;
    }
    ASSERT_TRUE(Eventually([&] { return Slots(0) == 0; })) << "kill " << k << ": daemon 0 slots";
    ASSERT_NO_FATAL_FAILURE(BackToBaseline(StrCat("kill ", k)));
  }
  // The survivor is still served: a one-rank group of its own.
  auto g = survivor->JoinGroup({"after", 1, 0, {daemons_[0].socket()}, "auto", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  auto s = survivor->CreateSession(*g, {4, 8, DType::kFloat32, 16, 2, {}, 0});
  ASSERT_TRUE(s.ok()) << s.status();
  auto r = (*s)->ScatterHeads(x->Ref(), 1, 16);
  EXPECT_TRUE(r.ok()) << r.status();
  std::cout << kKills << " kills; the survivor's round ended at:";
  for (const auto& [where, n] : ended) std::cout << " " << where << " x" << n;
  std::cout << "\n";
}

// Pids of the processes whose command line names `needle` (the daemons of one run folder).
// Empty for a process that is gone, also while it is read: a stream read of a process that
// exits meanwhile fails with ESRCH, which libstdc++'s filebuf throws.
std::string Cmdline(const std::filesystem::path& proc_dir) {
  const int fd = ::open((proc_dir / "cmdline").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      out.clear();
      break;
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// Processes whose command line names `needle`; `copies` counts those among them whose command
// line is `launcher`'s (the launcher itself, and a child it forked that has not run its own
// program yet).
std::vector<pid_t> ProcessesNaming(const std::string& needle, pid_t launcher, int* copies) {
  const std::string launcher_cmd = Cmdline(std::filesystem::path("/proc") / std::to_string(launcher));
  std::vector<pid_t> out;
  *copies = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmd = Cmdline(e.path());
    if (cmd.find(needle) == std::string::npos) continue;
    out.push_back(std::stoi(name));
    if (cmd == launcher_cmd) ++*copies;
  }
  return out;
}

// A dead client's sessions are let go off the fd thread. Letting a GPU session go drains its
// stream, which can take its cancel's drain limit; here a failpoint holds the reclaimed
// session's destruction instead (`session.destroy`). Meanwhile the fd thread, which found the
// dead client, serves the others: a new client binds its fd socket, registers a memfd (an fd
// frame), opens a session and calls (its ring worker started by the fd thread). Once let go,
// the dead client's session segment goes too.
TEST(Reclaim, ADeadClientsSessionsGoWithoutHoldingUpTheOtherClients) {
  auto dir = demo::MakeRunDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string release = StrCat(*dir, "/release"), ready = StrCat(*dir, "/phase.ready");
  auto daemon = demo::StartDaemon(ULYSSESD_PATH, *dir, 0, "host", {}, absl::Seconds(30),
                                  {StrCat("ULYSSES_FAILPOINTS=session.destroy=", release)});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(PHASE_CLIENT_PATH, PHASE_CLIENT_PATH, "--socket", daemon->socket().c_str(),
            "--members", daemon->socket().c_str(), "--rank", "0", "--phase", "session",
            "--ready", ready.c_str(), "--tag", "-", static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_TRUE(Eventually([&] { return ::access(ready.c_str(), F_OK) == 0; }))
      << "phase client not ready";
  EXPECT_EQ(CountSessionMappings(daemon->pid()), 1);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  auto admin = testing_util::AdminStub(daemon->socket());
  EXPECT_TRUE(Eventually([&] {
    v1::ListClientsResponse resp;
    grpc::ClientContext ctx;
    return admin->ListClients(&ctx, {}, &resp).ok() && resp.clients_size() == 0;
  })) << "the killed client was not reclaimed";

  auto c = client::Client::Connect({daemon->socket(), "after"});
  ASSERT_TRUE(c.ok()) << c.status();
  constexpr size_t kBytes = 16 * 4 * 8 * 4;
  const int memfd = ::memfd_create("after-x", MFD_ALLOW_SEALING | MFD_CLOEXEC);
  ASSERT_GE(memfd, 0) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(memfd, kBytes), 0);
  ASSERT_EQ(::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  auto x = (*c)->RegisterBuffer(memfd, "x");
  ::close(memfd);
  ASSERT_TRUE(x.ok()) << x.status();
  for (size_t i = 0; i < kBytes / 4; ++i) static_cast<float*>(x->data)[i] = static_cast<float>(i);
  auto g = (*c)->JoinGroup({"after", 1, 0, {daemon->socket()}, "auto", 10000});
  ASSERT_TRUE(g.ok()) << g.status();
  auto s = (*c)->CreateSession(*g, {4, 8, DType::kFloat32, 16, 2, {}, 10000});
  ASSERT_TRUE(s.ok()) << s.status();
  auto r = (*s)->ScatterHeads(x->Ref(), 1, 16);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::memcmp(r->data, x->data, kBytes), 0);
  ASSERT_TRUE(r->Release().ok());
  // The dead client's session is still held in its destruction: its segment is still mapped.
  EXPECT_EQ(CountSessionMappings(daemon->pid()), 2);

  { std::ofstream(release) << "go\n"; }
  EXPECT_TRUE(Eventually([&] { return CountSessionMappings(daemon->pid()) == 1; }))
      << "the dead client's session segment is still mapped";
  ASSERT_TRUE((*s)->Close().ok());
  s->reset();
  c->reset();
  auto stopped = daemon->Stop();
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << *stopped;
  demo::RemoveRunDir(*dir);
}

// A client that goes away between the rounds of the session rendezvous (rank 1's daemon
// held by the failpoint `session.connect_round` before its second arrival) ends the later
// rounds for every rank (its daemon ends the group, and the request's cancel aborts the
// round): rank 0's CreateSession fails with ABORTED naming the rank, instead of creating a
// session whose peer has none, and neither daemon keeps a rendezvous or a session.
TEST(Reclaim, AClientGoneBetweenTheSessionRoundsAbortsTheSecondForEveryRank) {
  auto dir = demo::MakeRunDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  pid_t pid = -1;
  std::vector<demo::DaemonProcess> daemons;
  const absl::Cleanup cleanup = [&] {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    daemons.clear();
    demo::RemoveRunDir(*dir);
  };
  const std::string release = StrCat(*dir, "/release"), ready = StrCat(*dir, "/phase.ready");
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> env;
    if (r == 1) env.push_back(StrCat("ULYSSES_FAILPOINTS=session.connect_round=", release));
    auto d = demo::StartDaemon(ULYSSESD_PATH, *dir, r, "host", {}, absl::Seconds(30), env);
    ASSERT_TRUE(d.ok()) << d.status();
    daemons.push_back(std::move(*d));
  }
  const std::string members = StrCat(daemons[0].socket(), ",", daemons[1].socket());
  pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(PHASE_CLIENT_PATH, PHASE_CLIENT_PATH, "--socket", daemons[1].socket().c_str(),
            "--members", members.c_str(), "--rank", "1", "--phase", "session", "--ready",
            ready.c_str(), "--tag", "-", static_cast<char*>(nullptr));
    _exit(127);
  }
  auto c = client::Client::Connect({daemons[0].socket(), "rank0"});
  ASSERT_TRUE(c.ok()) << c.status();
  auto g = (*c)->JoinGroup(
      {"phase", 2, 0, {daemons[0].socket(), daemons[1].socket()}, "auto", 20000});
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<std::unique_ptr<client::Session>> s;
  std::thread create([&] { s = (*c)->CreateSession(*g, {4, 8, DType::kFloat32, 16, 2, {}, 20000}); });
  // Rank 1's daemon waits before its second arrival: the first round is over.
  const bool held = Eventually([&] { return ::access((release + ".reached").c_str(), F_OK) == 0; });
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  pid = -1;
  auto admin1 = testing_util::AdminStub(daemons[1].socket());
  EXPECT_TRUE(Eventually([&] {
    v1::ListClientsResponse resp;
    grpc::ClientContext ctx;
    return admin1->ListClients(&ctx, {}, &resp).ok() && resp.clients_size() == 0;
  })) << "the killed client was not reclaimed";
  { std::ofstream(release) << "go\n"; }
  create.join();
  ASSERT_TRUE(held) << "rank 1's daemon never reached the second round";
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAborted) << s.status();
  EXPECT_NE(s.status().message().find("rank 1"), std::string::npos) << s.status();
  for (int r = 0; r < 2; ++r) {
    auto admin = testing_util::AdminStub(daemons[r].socket());
    EXPECT_TRUE(Eventually([&] {
      v1::DaemonState st;
      grpc::ClientContext ctx;
      return admin->GetState(&ctx, {}, &st).ok() && st.pending_rendezvous() == 0 &&
             st.rendezvous_arrivals() == 0;
    })) << "rank " << r << " still holds a rendezvous";
    v1::ListSessionsResponse sessions;
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin->ListSessions(&ctx, {}, &sessions).ok());
    EXPECT_EQ(sessions.sessions_size(), 0) << "rank " << r;
  }
  c->reset();
}

// A rank that cannot make its second-round payload (the failpoint `session.connect_handle`
// makes rank 1's an error, as a backend's ConnectHandle fails for a peer of another backend
// or NCCL's unique id) fails the session on every rank with the same FAILED_PRECONDITION
// naming it, leaves no session and no rendezvous behind, and keeps the ranks' session
// counters in step: once the point no longer fires, the next session opens and calls.
TEST(SessionRounds, ARankThatCannotConnectFailsTheSessionOnEveryRankNamingIt) {
  auto dir = demo::MakeRunDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string fire = StrCat(*dir, "/fire");
  { std::ofstream(fire) << "on\n"; }
  std::vector<demo::DaemonProcess> daemons;
  const absl::Cleanup cleanup = [&] {
    daemons.clear();
    demo::RemoveRunDir(*dir);
  };
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> env;
    if (r == 1) env.push_back(StrCat("ULYSSES_FAILPOINTS=session.connect_handle=", fire));
    auto d = demo::StartDaemon(ULYSSESD_PATH, *dir, r, "host", {}, absl::Seconds(30), env);
    ASSERT_TRUE(d.ok()) << d.status();
    daemons.push_back(std::move(*d));
  }
  const std::vector<std::string> members = {daemons[0].socket(), daemons[1].socket()};
  std::unique_ptr<client::Client> c[2];
  client::Group g[2];
  {
    absl::StatusOr<client::Group> joined[2];
    std::thread t[2];
    for (int r = 0; r < 2; ++r) {
      auto connected = client::Client::Connect({daemons[r].socket(), StrCat("rank", r)});
      ASSERT_TRUE(connected.ok()) << connected.status();
      c[r] = std::move(*connected);
    }
    for (int r = 0; r < 2; ++r)
      t[r] = std::thread([&, r] { joined[r] = c[r]->JoinGroup({"rounds", 2, r, members, "auto", 20000}); });
    for (auto& th : t) th.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(joined[r].ok()) << joined[r].status();
      g[r] = *joined[r];
    }
  }
  auto create_both = [&] {
    std::array<absl::StatusOr<std::unique_ptr<client::Session>>, 2> s;
    std::thread t([&] { s[1] = c[1]->CreateSession(g[1], {4, 8, DType::kFloat32, 16, 2, {}, 20000}); });
    s[0] = c[0]->CreateSession(g[0], {4, 8, DType::kFloat32, 16, 2, {}, 20000});
    t.join();
    return s;
  };
  auto failed = create_both();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(failed[r].status().code(), absl::StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << failed[r].status();
    EXPECT_THAT(std::string(failed[r].status().message()),
                ::testing::HasSubstr("rank 1 could not connect its session: the failpoint "
                                     "session.connect_handle fired"))
        << "rank " << r;
  }
  for (int r = 0; r < 2; ++r) {
    auto admin = testing_util::AdminStub(daemons[r].socket());
    EXPECT_TRUE(Eventually([&] {
      v1::DaemonState st;
      grpc::ClientContext ctx;
      v1::ListSessionsResponse sessions;
      grpc::ClientContext ctx2;
      return admin->GetState(&ctx, {}, &st).ok() && st.pending_rendezvous() == 0 &&
             admin->ListSessions(&ctx2, {}, &sessions).ok() && sessions.sessions_size() == 0;
    })) << "rank " << r << " still holds a session or a rendezvous";
  }
  ASSERT_EQ(::unlink(fire.c_str()), 0);
  auto opened = create_both();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(opened[r].ok()) << "rank " << r << ": " << opened[r].status();
  std::string errors[2];
  std::thread t([&] {
    auto x = c[1]->AllocBuffer(16 * 4 * 8 * 4, "x");
    if (!x.ok()) errors[1] = x.status().ToString();
    else if (auto res = (*opened[1])->ScatterHeads(x->Ref(), 1, 8); !res.ok())
      errors[1] = res.status().ToString();
  });
  auto x = c[0]->AllocBuffer(16 * 4 * 8 * 4, "x");
  if (!x.ok()) errors[0] = x.status().ToString();
  else if (auto res = (*opened[0])->ScatterHeads(x->Ref(), 1, 8); !res.ok())
    errors[0] = res.status().ToString();
  t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  for (auto& s : opened) s->reset();
  for (auto& client : c) client.reset();
}

// A launcher killed outright (the demo here; a bench or a test run past its timeout alike)
// takes its daemons and client processes with it: each gets SIGTERM, drains and exits, and
// nothing is left holding the sockets. This process adopts the orphans (a subreaper) to see
// how they end.
TEST(Launcher, TheDemosDaemonsAndClientsEndWithIt) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0) << std::strerror(errno);
  auto dir = demo::MakeRunDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  std::vector<std::string> args = {ULYSSES_DEMO_PATH, "--ranks", "2", "--backend", "host",
                                   "--run-dir", *dir, "--hold-seconds", "600"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  // Both daemons serve and the clients hold their sessions: two processes per rank name the
  // run folder besides the demo (a daemon's socket, a client's --run-dir), each running its
  // own program (a child forked but not yet started carries the demo's command line; killed
  // then, it exits 127 without having been a daemon or a client).
  std::vector<pid_t> named;
  int launcher_copies = 0;
  EXPECT_TRUE(Eventually(
      [&] {
        named = ProcessesNaming(*dir, launcher, &launcher_copies);
        return named.size() == 5 && launcher_copies == 1;
      },
      absl::Seconds(60)))
      << named.size() << " processes name " << *dir << ", " << launcher_copies
      << " with the demo's command line";
  ASSERT_EQ(::kill(launcher, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(launcher, &status, 0), launcher);
  // Every orphan comes here; each must end on its own, by the SIGTERM of its death signal.
  std::map<pid_t, int> ended;
  auto all_ended = [&] {
    for (pid_t p; (p = ::waitpid(-1, &status, WNOHANG)) > 0;) ended[p] = status;
    for (pid_t p : named)
      if (p != launcher && ended.count(p) == 0) return false;
    return true;
  };
  EXPECT_TRUE(Eventually(all_ended, absl::Seconds(60)))
      << ended.size() << " of the " << named.size() - 1 << " processes ended";
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  for (pid_t p : named) {
    if (p == launcher) continue;
    auto it = ended.find(p);
    if (it == ended.end()) {
      ::kill(p, SIGKILL);  // not to outlive the test
      continue;
    }
    const int st = it->second;
    EXPECT_TRUE((WIFEXITED(st) && WEXITSTATUS(st) == 0) ||
                (WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM))
        << "process " << p << ": status " << st;
  }
  demo::RemoveRunDir(*dir);
}

}  // namespace
}  // namespace ulysses
