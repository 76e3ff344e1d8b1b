// A client that speaks the daemon's protocols by hand, to send what the client library never
// would: malformed frames, partial frames, silence. Each test starts its own daemon.
#pragma once

#include <dirent.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "../util/fd_count.h"
#include "demo_lib.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "ulysses/common/happens_before.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/ipc/frames.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses::security {


/// Open descriptors of process `pid` (from /proc), -1 when unreadable.
inline int CountFds(pid_t pid) {
  DIR* d = ::opendir(StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}


/// What each open descriptor of process `pid` refers to (readlink of /proc/PID/fd/N), one per
/// line, for failure messages.
inline std::string DescribeFds(pid_t pid) {
  const std::string dir = StrCat("/proc/", pid, "/fd");
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return "(unreadable)";
  std::string out;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char target[256] = {};
    const ssize_t n = ::readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    out += StrCat(e->d_name, " -> ", n > 0 ? std::string(target, n) : "?", "\n");
  }
  ::closedir(d);
  return out;
}

/// Threads of process `pid` (from /proc/PID/status), -1 when unreadable.
inline int CountThreads(pid_t pid) {
  std::ifstream status(StrCat("/proc/", pid, "/status"));
  std::string key;
  while (status >> key) {
    if (key == "Threads:") {
      int n = -1;
      status >> n;
      return n;
    }
  }
  return -1;
}

/// Threads of process `pid` whose name (/proc/PID/task/TID/comm) is `name`.
inline int CountThreadsNamed(pid_t pid, const std::string& name) {
  const std::string dir = StrCat("/proc/", pid, "/task");
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::string comm;
    std::getline(std::ifstream(StrCat(dir, "/", e->d_name, "/comm")), comm);
    if (comm == name) ++n;
  }
  ::closedir(d);
  return n;
}

/// CountThreads less gRPC's timer threads, which gRPC starts whenever its timers need another
/// (whatever the daemon serves), so that a count before and after an attack compares threads
/// the attack could hold.
inline int CountThreadsOutsideTimers(pid_t pid) {
  return CountThreads(pid) - CountThreadsNamed(pid, "grpc_global_tim");
}

/// Connects to the unix socket `path` from a child process of uid and gid `uid` (the caller
/// must be root): 0 when it connected, else the errno of the failed connect; -1 when the child
/// could not be made or become `uid`. The child makes only system calls (the parent has
/// threads); the address is built before the fork.
inline int ConnectErrnoAs(uid_t uid, const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return -1;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const pid_t child = ::fork();
  if (child < 0) return -1;
  if (child == 0) {
    if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(255);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) ::_exit(255);
    const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    ::_exit(rc == 0 ? 0 : (errno > 0 && errno < 255 ? errno : 255));
  }
  int status = 0;
  if (::waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status) == 255 ? -1 : WEXITSTATUS(status);
}

/// Polls `cond` for up to 20 s; for state the daemon reaches on its own, never for readiness.
template <typename F>
bool Eventually(F cond) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return cond();
}

/// An attached client as the Attach RPC made it, with nothing else done.
struct Attached {
  uint64_t client_id = 0;
  std::string token;
  std::string fd_socket;
};

/// A client's liveness stream, held open by gRPC's callback API (no thread of this process
/// waits on it) until Cancel or its end. Its end is kept apart from it (OnDone may still be
/// returning when the stream's owner sees the end and destroys it).
class Watcher final : public grpc::ClientBidiReactor<v1::WatchRequest, v1::WatchEvent> {
 public:
  Watcher(v1::Control::Stub& stub, const Attached& a) {
    ctx_.AddMetadata("ulysses-client-id", std::to_string(a.client_id));
    ctx_.AddMetadata("ulysses-token", a.token);
    stub.async()->Watch(&ctx_, this);
    StartRead(&event_);
    HappensBefore(this);  // gRPC orders its reactions after StartCall, unseen by TSan
    StartCall();
  }
  ~Watcher() {  // gRPC holds this object until the stream's end
    if (!done()) Cancel();
    AwaitEnd();
  }
  void Cancel() { ctx_.TryCancel(); }
  /// Waits (at most 20 s) for the stream's end.
  bool AwaitEnd() {
    std::unique_lock<std::mutex> lock(end_->mu);
    return end_->cv.wait_for(lock, std::chrono::seconds(20), [&] { return end_->done; });
  }
  /// Whether the stream ended, and how.
  bool done() {
    std::lock_guard<std::mutex> lock(end_->mu);
    return end_->done;
  }
  grpc::StatusCode code() {
    std::lock_guard<std::mutex> lock(end_->mu);
    return end_->status.error_code();
  }

  void OnReadDone(bool ok) override {
    if (ok) StartRead(&event_);
  }
  void OnDone(const grpc::Status& s) override {
    HappensAfter(this);
    const std::shared_ptr<End> end = end_;  // this object may go once `done` is set
    std::lock_guard<std::mutex> lock(end->mu);
    end->done = true;
    end->status = s;
    end->cv.notify_all();
  }

 private:
  struct End {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
  };
  grpc::ClientContext ctx_;
  v1::WatchEvent event_;
  const std::shared_ptr<End> end_ = std::make_shared<End>();
};

/// Fixture: one real daemon (host backend) in a fresh run directory.
class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon({}); }
  void TearDown() override {
    daemon_ = demo::DaemonProcess();
    if (!dir_.empty()) demo::RemoveRunDir(dir_);
  }

  /// (Re)starts the daemon with `extra` arguments and extra environment ("NAME=value").
  void StartDaemon(const std::vector<std::string>& extra, const std::vector<std::string>& env = {}) {
    daemon_ = demo::DaemonProcess();
    if (dir_.empty()) {
      absl::StatusOr<std::string> dir = demo::MakeRunDir();
      ASSERT_TRUE(dir.ok()) << dir.status();
      dir_ = *dir;
    }
    absl::StatusOr<demo::DaemonProcess> d = demo::StartDaemon(ULYSSESD_PATH, dir_, 0, "host", extra,
                                                                absl::Seconds(30), env);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    channel_ = grpc::CreateChannel("unix://" + daemon_.socket(), grpc::InsecureChannelCredentials());
    control_ = v1::Control::NewStub(channel_);
    admin_ = v1::Admin::NewStub(channel_);
  }

  /// The daemon answers Admin.GetState (it is alive and serving).
  bool Serving() {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return admin_->GetState(&ctx, {}, &st).ok();
  }

  // Attached clients, bound or not (GetState: a listing comes in pages).
  int NumClients() {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!admin_->GetState(&ctx, {}, &st).ok()) return -1;
    return st.num_clients();
  }

  absl::StatusOr<Attached> Attach(const std::string& name = "hostile") {
    v1::AttachRequest req;
    req.set_client_name(name);
    v1::AttachResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s = control_->Attach(&ctx, req, &resp);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return Attached{resp.client_id(), resp.token(), resp.fd_socket()};
  }

  /// Metadata an authenticated Control call of `a` carries.
  static void Authenticate(grpc::ClientContext* ctx, const Attached& a) {
    ctx->AddMetadata("ulysses-client-id", std::to_string(a.client_id));
    ctx->AddMetadata("ulysses-token", a.token);
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  }

  /// Connects to the fd socket, sends a correct hello for `a`, and reads the daemon's answer.
  absl::StatusOr<ipc::UniqueFd> Bind(const Attached& a, ipc::ReceivedMessage* ack_out = nullptr) {
    absl::StatusOr<ipc::UniqueFd> sock = ipc::ConnectUnix(a.fd_socket);
    if (!sock.ok()) return sock.status();
    absl::Status sent = ipc::SendMessage(sock->get(), ipc::EncodeHello({a.client_id, a.token}));
    if (!sent.ok()) return sent;
    absl::StatusOr<ipc::ReceivedMessage> ack = ipc::RecvMessage(sock->get());
    if (!ack.ok()) return ack.status();
    if (ack->payload.find("\"ok\": true") == std::string::npos &&
        ack->payload.find("\"ok\":true") == std::string::npos)
      return absl::PermissionDeniedError(ack->payload);
    if (ack_out != nullptr) *ack_out = std::move(*ack);
    return std::move(*sock);
  }

  std::string dir_;
  demo::DaemonProcess daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

}  // namespace ulysses::security
