// A daemon killed with SIGKILL leaves its ready file behind, and the next daemon of the same
// device removes it before it serves; its session segments (memfds) leave nothing in /dev/shm. And the control socket is
// never connectable under looser permissions than 0660, whatever the umask.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "hostile_client.h"
#include "nlohmann/json.hpp"
#include "ulysses/client/client.h"
#include "ulysses/common/status.h"

namespace ulysses::security {
namespace {

// Names in /dev/shm that start with `prefix`.
std::vector<std::string> ShmNames(const std::string& prefix) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// Runs ulyssesd to its end (it is expected to fail at start-up); returns its exit status.
int RunToExit(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) ::dup2(fd, 2);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  for (int i = 0; i < 3000 && ::waitpid(pid, &status, WNOHANG) == 0; ++i)
    absl::SleepFor(absl::Milliseconds(10));
  if (::waitpid(pid, &status, WNOHANG) == 0) {  // still running after 30 s: not expected
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

using RestartTest = DaemonTest;

// A one-rank group `name` on `socket`.
absl::StatusOr<client::Group> JoinSolo(client::Client& c, const std::string& socket,
                                       const std::string& name) {
  client::GroupSpec g;
  g.name = name;
  g.members = {socket};
  return c.JoinGroup(g);
}

TEST_F(RestartTest, ARestartRemovesWhatAKilledInstanceLeft) {
  const std::string ready = dir_ + "/gpu0.ready";
  const pid_t old_pid = daemon_.pid();
  const std::string prefix = StrCat("ulysses-", old_pid, "-");
  {
    auto c = client::Client::Connect({daemon_.socket(), "victim", absl::Seconds(10)});
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<client::Group> group = JoinSolo(**c, daemon_.socket(), "solo");
    ASSERT_TRUE(group.ok()) << group.status();
    client::SessionSpec spec;
    spec.num_heads = 2;
    spec.head_dim = 4;
    spec.max_tokens = 8;
    auto session = (*c)->CreateSession(*group, spec);
    ASSERT_TRUE(session.ok()) << session.status();
    // Session segments are memfds: nothing in /dev/shm to leave behind, or to collide with.
    EXPECT_TRUE(ShmNames(prefix).empty()) << "a session segment has a name in /dev/shm";
    daemon_.Kill();  // SIGKILL: nothing is cleaned up
  }
  ASSERT_TRUE(Exists(ready));
  EXPECT_TRUE(ShmNames(prefix).empty());

  // The next start fails late (its metrics port is taken), after the point where a restart
  // cleans up: the dead instance's leftovers are gone all the same, and no ready file says it
  // serves.
  const int taken = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(taken, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(taken, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(taken, 1), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(taken, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int code = RunToExit({ULYSSESD_PATH, "--device", "0", "--socket", dir_ + "/gpu0.sock",
                              "--backend", "host", "--ready-file", ready, "--metrics-address",
                              StrCat("127.0.0.1:", ntohs(addr.sin_port))},
                             dir_ + "/failed.log");
  ::close(taken);
  EXPECT_NE(code, 0);
  EXPECT_FALSE(Exists(ready)) << "the dead instance's ready file survived a restart";
  EXPECT_TRUE(ShmNames(prefix).empty()) << "the dead instance left a segment in /dev/shm";

  // A good restart serves.
  StartDaemon({});
  EXPECT_TRUE(Serving());
}

// A client of the daemon at `socket`, named and grouped `name`, with a one-rank session of
// [1, 8, 2, 4] fp32 and its input x.
struct Solo {
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  client::Buffer x;
  CallArgs Scatter() const {
    CallArgs a;
    a.op = OpKind::kScatterHeads;
    a.batch = 1;
    a.seq = 8;
    a.inputs[0] = x.Ref();
    return a;
  }
};
absl::StatusOr<Solo> OpenSolo(const std::string& socket, const std::string& name) {
  Solo s;
  ULY_ASSIGN_OR_RETURN(s.client, client::Client::Connect({socket, name, absl::Seconds(10)}));
  ULY_ASSIGN_OR_RETURN(const client::Group group, JoinSolo(*s.client, socket, name));
  ULY_ASSIGN_OR_RETURN(s.session, s.client->CreateSession(group, {2, 4, DType::kFloat32, 8, 2, {}, 0}));
  ULY_ASSIGN_OR_RETURN(s.x, s.client->AllocBuffer(8 * 2 * 4 * 4));
  return s;
}

// A client attached across its daemon's death and restart: its next call ends with
// UNAVAILABLE (not at its deadline), it never talks to the new instance with the old one's
// ids, and a new connection to the restarted daemon is served, results exact.
TEST_F(RestartTest, AClientAttachedAcrossARestartFailsAtOnceAndANewConnectionIsServed) {
  auto run_call = [](client::Client& c, const std::string& socket)
      -> absl::StatusOr<std::vector<float>> {
    ULY_ASSIGN_OR_RETURN(client::Group group, JoinSolo(c, socket, "solo"));
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<client::Session> s,
                         c.CreateSession(group, {2, 4, DType::kFloat32, 8, 2, {}, 0}));
    ULY_ASSIGN_OR_RETURN(client::Buffer x, c.AllocBuffer(8 * 2 * 4 * 4));
    float* p = static_cast<float*>(x.data);
    for (int i = 0; i < 8 * 2 * 4; ++i) p[i] = static_cast<float>(i);
    ULY_ASSIGN_OR_RETURN(client::Result r, s->ScatterHeads(x.Ref(), 1, 8));
    const float* out = static_cast<const float*>(r.data);
    std::vector<float> v(out, out + r.bytes / sizeof(float));
    ULY_RETURN_IF_ERROR(r.Release());
    return v;
  };
  absl::StatusOr<Solo> solo = OpenSolo(daemon_.socket(), "survivor");
  ASSERT_TRUE(solo.ok()) << solo.status();
  ASSERT_TRUE(solo->session->ScatterHeads(solo->x.Ref(), 1, 8).ok());

  daemon_.Kill();  // SIGKILL
  auto after_death = solo->session->ScatterHeads(solo->x.Ref(), 1, 8);
  EXPECT_EQ(after_death.status().code(), absl::StatusCode::kUnavailable) << after_death.status();
  // Once the client's watch thread saw the daemon die (its socket closed without the abort
  // word: not a reclaim), Synchronize and Submit fail at once, before the ring.
  absl::Status synced;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10); absl::Now() < give_up;
       absl::SleepFor(absl::Milliseconds(10))) {
    synced = solo->session->Synchronize();
    if (!synced.ok()) break;
  }
  EXPECT_EQ(synced.code(), absl::StatusCode::kUnavailable) << synced;
  EXPECT_NE(std::string(synced.message()).find("the daemon is gone"), std::string::npos) << synced;
  const CallArgs args = solo->Scatter();
  auto submitted = solo->session->Submit(args);
  EXPECT_EQ(submitted.status().code(), absl::StatusCode::kUnavailable) << submitted.status();
  StartDaemon({});
  {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    const grpc::Status gs = admin_->GetState(&ctx, {}, &st);
    ASSERT_TRUE(gs.ok()) << gs.error_code() << " " << gs.error_message();
  }
  // The old connection stays dead: no call of it reaches the new instance as if it were its own.
  auto after_restart = solo->session->ScatterHeads(solo->x.Ref(), 1, 8);
  EXPECT_FALSE(after_restart.ok());
  EXPECT_FALSE(solo->client->AllocBuffer(4096).ok());
  EXPECT_EQ(NumClients(), 0);
  // A new connection is served, and its result is exact: with W = 1, scatter_heads is the
  // identity on a contiguous [1, 8, 2, 4] input.
  auto fresh = client::Client::Connect({daemon_.socket(), "fresh", absl::Seconds(10)});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::StatusOr<std::vector<float>> v = run_call(**fresh, daemon_.socket());
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->size(), 64u);
  for (int i = 0; i < 64; ++i) EXPECT_EQ((*v)[i], static_cast<float>(i)) << i;
}

// A daemon that shuts down drops its clients: it sets each client's abort word before it closes
// their sockets, so a client tells that from a daemon that died. Its Submit and Synchronize
// then fail ABORTED ("dropped"), not UNAVAILABLE, and it writes no done words of its own.
TEST_F(RestartTest, AClientItsDaemonDropsAtShutdownIsToldSoAndNotThatItDied) {
  absl::StatusOr<Solo> solo = OpenSolo(daemon_.socket(), "dropped");
  ASSERT_TRUE(solo.ok()) << solo.status();
  ASSERT_TRUE(solo->session->ScatterHeads(solo->x.Ref(), 1, 8).ok());
  absl::StatusOr<int> exited = daemon_.Stop();  // SIGTERM: it reclaims every client, then exits
  ASSERT_TRUE(exited.ok()) << exited.status();
  const CallArgs args = solo->Scatter();
  // The client's watch thread has seen the socket close by now or soon; either way the answer
  // stays "dropped".
  for (int i = 0; i < 20; ++i) {
    absl::Status synced = solo->session->Synchronize();
    EXPECT_EQ(synced.code(), absl::StatusCode::kAborted) << synced;
    auto submitted = solo->session->Submit(args);
    EXPECT_EQ(submitted.status().code(), absl::StatusCode::kAborted) << submitted.status();
    absl::SleepFor(absl::Milliseconds(10));
  }
}

TEST_F(RestartTest, TheControlSocketIsNeverLooserThan0660) {
  daemon_ = demo::DaemonProcess();  // the fixture's daemon; this test starts its own
  const std::string socket = dir_ + "/gpu0.sock";
  ASSERT_FALSE(Exists(socket));
  // Watch the path from before the daemon starts: the first mode anyone could see is the mode.
  std::atomic<bool> stop{false};
  mode_t first_mode = 0;
  std::thread watcher([&] {
    struct stat st {};
    for (bool last = false; !last;) {
      last = stop.load();  // one more look after the daemon is up, if this thread was starved
      if (::lstat(socket.c_str(), &st) == 0) {
        first_mode = st.st_mode & 07777;
        return;
      }
    }
  });
  const mode_t old_umask = ::umask(0);  // the daemon inherits it: bind(2) would make 0777
  StartDaemon({});
  ::umask(old_umask);
  stop.store(true);
  watcher.join();
  EXPECT_EQ(first_mode, 0660u) << "the control socket was first seen with mode 0" << std::oct
                               << first_mode;
  struct stat st {};
  ASSERT_EQ(::lstat(socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_TRUE(Serving());
}

}  // namespace
}  // namespace ulysses::security
