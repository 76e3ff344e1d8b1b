#include "fd_exports.h"

#include <fcntl.h>
#include <poll.h>
#include <random>
#include <sys/socket.h>
#include <unistd.h>


#include "nlohmann/json.hpp"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

// Bounds every read and write on a peer connection, so a stalled peer cannot hold the thread.
void SetTimeouts(int fd, absl::Duration d) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(d));
  tv.tv_usec = static_cast<suseconds_t>(absl::ToInt64Microseconds(d) % 1000000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

constexpr absl::Duration kPeerIo = absl::Seconds(2);

}  // namespace

std::string RandomToken() {
  std::random_device rd;
  std::uniform_int_distribution<uint64_t> dist;
  char buf[33];
  snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(dist(rd)),
           static_cast<unsigned long long>(dist(rd)));
  return buf;
}

absl::Status FdExports::Start(const std::string& path) {
  ULY_ASSIGN_OR_RETURN(listener_, ipc::UnixListener::Listen(path, 0600));
  ULY_ASSIGN_OR_RETURN(ipc::EventFd wake, ipc::EventFd::Create());
  wake_ = std::make_unique<ipc::EventFd>(std::move(wake));
  path_ = path;
  running_ = true;
  thread_ = std::thread([this] { Serve(); });
  return absl::OkStatus();
}

void FdExports::Stop() {
  if (!running_) return;
  running_ = false;
  (void)wake_->Signal();
  listener_.Shutdown();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

absl::StatusOr<ExportTicket> FdExports::Lend(int fd) {
  if (!running_) return absl::FailedPreconditionError("peer fd socket is not serving");
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) return ErrnoError("dup", errno);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  Entry e{RandomToken(), ipc::UniqueFd(dup)};
  ExportTicket t{path_, id, e.secret};
  entries_.emplace(id, std::move(e));
  return t;
}

void FdExports::Withdraw(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(id);
}

size_t FdExports::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void FdExports::Serve() {
  for (;;) {
    pollfd p[2] = {{listener_.fd(), POLLIN, 0}, {wake_->fd(), POLLIN, 0}};
    const int n = ::poll(p, 2, 1000);
    if (!running_) return;
    if (n <= 0 || !(p[0].revents & POLLIN)) continue;
    absl::StatusOr<ipc::UniqueFd> conn = listener_.Accept();
    if (!conn.ok()) {
      if (!running_) return;
      continue;
    }
    Answer(std::move(*conn));
  }
}

void FdExports::Answer(ipc::UniqueFd conn) {
  auto log = Logger("peer");
  absl::StatusOr<ipc::PeerCred> cred = ipc::GetPeerCred(conn.get());
  if (!cred.ok() || cred->uid != ::geteuid()) {
    log->warn("peer fd socket: refused a connection from uid {}", cred.ok() ? cred->uid : -1);
    return;
  }
  SetTimeouts(conn.get(), kPeerIo);
  absl::StatusOr<bool> ready = ipc::WaitReadable(conn.get(), absl::ToInt64Milliseconds(kPeerIo));
  if (!ready.ok() || !*ready) return;
  absl::StatusOr<ipc::ReceivedMessage> req = ipc::RecvMessage(conn.get(), 512, 0);
  if (!req.ok()) return;
  const nlohmann::json j = nlohmann::json::parse(req->payload, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("id") || !j["id"].is_number_unsigned() ||
      !j.contains("secret") || !j["secret"].is_string()) {
    (void)ipc::SendMessage(conn.get(), R"({"ok": false, "error": "malformed request"})");
    return;
  }
  const uint64_t id = j["id"].get<uint64_t>();
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it != entries_.end() && it->second.secret == j["secret"].get<std::string>())
      fd = it->second.fd.get();
    if (fd >= 0) {
      int fds[1] = {fd};
      (void)ipc::SendMessage(conn.get(), R"({"ok": true})", std::span<const int>(fds, 1));
      return;
    }
  }
  (void)ipc::SendMessage(conn.get(), R"({"ok": false, "error": "no such export"})");
}

absl::StatusOr<ipc::UniqueFd> FdExports::Fetch(const ExportTicket& t, absl::Duration timeout) {
  ULY_ASSIGN_OR_RETURN(ipc::UniqueFd conn, ipc::ConnectUnix(t.socket));
  SetTimeouts(conn.get(), timeout);
  const nlohmann::json req = {{"id", t.id}, {"secret", t.secret}};
  ULY_RETURN_IF_ERROR(ipc::SendMessage(conn.get(), req.dump()));
  ULY_ASSIGN_OR_RETURN(bool ready, ipc::WaitReadable(conn.get(), absl::ToInt64Milliseconds(timeout)));
  if (!ready)
    return absl::DeadlineExceededError(StrCat("peer fd socket ", t.socket, ": no answer"));
  ULY_ASSIGN_OR_RETURN(ipc::ReceivedMessage m, ipc::RecvMessage(conn.get(), 512, 1));
  if (m.fds.size() != 1)
    return absl::FailedPreconditionError(
        StrCat("peer fd socket ", t.socket, ": export ", t.id, " refused: ", m.payload));
  return std::move(m.fds[0]);
}

}  // namespace ulysses::daemon
