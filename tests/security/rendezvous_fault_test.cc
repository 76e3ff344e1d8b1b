// Daemons that die or hang during a rendezvous (item 14). Rank 0's daemon hosts a group's JoinGroup and
// CreateSession rendezvous; each other rank's daemon waits in a Peer.Rendezvous call to it. The
// daemons here have a peer timeout of 600 s, and ctest gives each test 120 s: a test passes
// only when the survivors learn of the death long before that timeout.
#include <signal.h>

#include <chrono>
#include <initializer_list>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hostile_client.h"
#include "ulysses/client/client.h"

namespace ulysses::security {
namespace {

class RendezvousFaultTest : public ::testing::Test {
 protected:
  static constexpr int kRanks = 3;

  void SetUp() override {
    absl::StatusOr<std::string> dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<demo::DaemonProcess> d =
          demo::StartDaemon(ULYSSESD_PATH, dir_, r, "host", {"--peer-timeout-ms", "600000"});
      ASSERT_TRUE(d.ok()) << d.status();
      daemons_.push_back(std::move(*d));
    }
  }
  void TearDown() override {
    for (auto& c : clients_) c.reset();
    daemons_.clear();
    if (!dir_.empty()) demo::RemoveRunDir(dir_);
  }

  std::vector<std::string> Members(std::initializer_list<int> ranks) const {
    std::vector<std::string> m;
    for (int r : ranks) m.push_back(daemons_[r].socket());
    return m;
  }

  /// Rank `r`'s daemon state; nullopt when it does not answer.
  std::optional<v1::DaemonState> State(int r) {
    auto admin = v1::Admin::NewStub(
        grpc::CreateChannel("unix://" + daemons_[r].socket(), grpc::InsecureChannelCredentials()));
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!admin->GetState(&ctx, {}, &st).ok()) return std::nullopt;
    return st;
  }
  /// Arrivals waiting in rank `r`'s rendezvous table, -1 when it does not answer.
  int Arrivals(int r) {
    std::optional<v1::DaemonState> st = State(r);
    return st ? st->rendezvous_arrivals() : -1;
  }
  bool TableEmpty(int r) {
    std::optional<v1::DaemonState> st = State(r);
    return st && st->pending_rendezvous() == 0 && st->rendezvous_arrivals() == 0;
  }

  client::Client& ClientOf(int r) {
    if (!clients_[r]) {
      auto c = client::Client::Connect({daemons_[r].socket(), "rank", absl::Seconds(10)});
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) clients_[r] = std::move(*c);
    }
    return *clients_[r];
  }

  /// JoinGroup of `name` by the daemons `ranks` (rank i of the group on daemon ranks[i]) in
  /// threads; the rendezvous timeout is `timeout_ms`, 0: the daemons' (600 s).
  struct Joins {
    std::vector<absl::Status> status;
    std::vector<std::thread> threads;
    void Join() {
      for (std::thread& t : threads) t.join();
      threads.clear();
    }
    ~Joins() { Join(); }
  };
  void StartJoins(Joins& j, const std::string& name, int world_size,
                  const std::vector<std::string>& members, std::initializer_list<int> group_ranks,
                  std::initializer_list<int> daemons, int64_t timeout_ms = 0) {
    j.status.assign(group_ranks.size(), absl::UnknownError("not run"));
    auto d = daemons.begin();
    size_t i = 0;
    for (int rank : group_ranks) {
      client::Client& c = ClientOf(*d++);
      j.threads.emplace_back([&j, &c, i, name, world_size, members, rank, timeout_ms] {
        j.status[i] = c.JoinGroup({name, world_size, rank, members, "host", timeout_ms}).status();
      });
      ++i;
    }
  }

  /// Waits until `n` arrivals wait in daemon `host`'s table; when they never do, kills every
  /// daemon so that no join is left waiting.
  void AwaitArrivals(int host, int n) {
    if (Eventually([&] { return Arrivals(host) == n; })) return;
    ADD_FAILURE() << "the arrivals never reached " << n << " (" << Arrivals(host) << ")";
    for (demo::DaemonProcess& d : daemons_) d.Kill();
  }

  std::string dir_;
  std::vector<demo::DaemonProcess> daemons_;
  std::unique_ptr<client::Client> clients_[kRanks];
};

// Ranks 0 and 1 of a group of 3 wait for rank 2, which never comes; rank 1's daemon is
// SIGKILLed. Rank 0's table sees rank 1's Peer.Rendezvous call cancelled (its connection
// broke) and aborts the step at once for every rank, naming rank 1, instead of waiting out
// the peer timeout; nothing is left in the table, and rank 0 then forms a new group.
TEST_F(RendezvousFaultTest, ANonHostingDaemonKilledAfterItArrivedAbortsTheOthersNamingIt) {
  Joins j;
  StartJoins(j, "gone", 3, Members({0, 1, 2}), {0, 1}, {0, 1});
  AwaitArrivals(0, 2);
  daemons_[1].Kill();
  j.Join();
  EXPECT_EQ(j.status[0].code(), absl::StatusCode::kAborted) << j.status[0];
  EXPECT_NE(j.status[0].message().find("rank 1's daemon went away"), std::string::npos)
      << j.status[0];
  EXPECT_EQ(j.status[1].code(), absl::StatusCode::kUnavailable) << j.status[1];
  EXPECT_TRUE(Eventually([&] { return TableEmpty(0); }));

  Joins after;
  StartJoins(after, "after", 2, Members({0, 2}), {0, 1}, {0, 2});
  after.Join();
  EXPECT_TRUE(after.status[0].ok()) << after.status[0];
  EXPECT_TRUE(after.status[1].ok()) << after.status[1];
}

// The reverse: ranks 1 and 2 wait in rank 0's table (rank 0's client never comes) and rank 0's
// daemon, the host, is SIGKILLed. Their Peer.Rendezvous calls fail with the connection, so their
// JoinGroups end at once with UNAVAILABLE naming rank 0; their daemons then form a new group.
TEST_F(RendezvousFaultTest, AHostingDaemonKilledEndsTheWaitingRanksJoinGroupNamingIt) {
  Joins j;
  StartJoins(j, "headless", 3, Members({0, 1, 2}), {1, 2}, {1, 2});
  AwaitArrivals(0, 2);
  daemons_[0].Kill();
  j.Join();
  for (const absl::Status& s : j.status) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("rank 0's daemon"), std::string::npos) << s;
  }
  EXPECT_TRUE(TableEmpty(1));
  EXPECT_TRUE(TableEmpty(2));

  Joins after;
  StartJoins(after, "after", 2, Members({1, 2}), {0, 1}, {1, 2});
  after.Join();
  EXPECT_TRUE(after.status[0].ok()) << after.status[0];
  EXPECT_TRUE(after.status[1].ok()) << after.status[1];
}

// A daemon that hangs (SIGSTOP) is not dead: its connections stay open, so the others wait for
// the timeout the rendezvous asked for (2 s here) and fail DEADLINE_EXCEEDED. The daemon stays
// stopped past that timeout; once it runs again nothing of that step is left in any table, and
// the three daemons form a group. First the host (ranks 1 and 2 wait in its table, rank 0's
// client never comes), then a rank that arrived (ranks 0 and 1 wait, rank 2 never comes).
TEST_F(RendezvousFaultTest, AStoppedDaemonEndsTheRendezvousAtItsTimeoutAndRecovers) {
  for (int stopped : {0, 1}) {
    SCOPED_TRACE(stopped == 0 ? "the host stopped" : "rank 1's daemon stopped");
    {
      Joins j;
      if (stopped == 0)
        StartJoins(j, "hung-host", 3, Members({0, 1, 2}), {1, 2}, {1, 2}, 2000);
      else
        StartJoins(j, "hung-rank", 3, Members({0, 1, 2}), {0, 1}, {0, 1}, 2000);
      AwaitArrivals(0, 2);
      ASSERT_EQ(::kill(daemons_[stopped].pid(), SIGSTOP), 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past the timeout
      ASSERT_EQ(::kill(daemons_[stopped].pid(), SIGCONT), 0);
      j.Join();
      for (size_t i = 0; i < j.status.size(); ++i)
        EXPECT_EQ(j.status[i].code(), absl::StatusCode::kDeadlineExceeded)
            << "rank " << i << ": " << j.status[i];
    }
    for (int r = 0; r < kRanks; ++r)
      EXPECT_TRUE(Eventually([&] { return TableEmpty(r); })) << "daemon " << r;
    Joins after;
    StartJoins(after, StrCat("after-", stopped), 3, Members({0, 1, 2}), {0, 1, 2}, {0, 1, 2});
    after.Join();
    for (const absl::Status& st : after.status) EXPECT_TRUE(st.ok()) << st;
  }
}

}  // namespace
}  // namespace ulysses::security
