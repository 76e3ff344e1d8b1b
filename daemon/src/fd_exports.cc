#include "fd_exports.h"

#include <fcntl.h>
#include <poll.h>
#include <random>
#include <sys/socket.h>
#include <unistd.h>


#include "absl/strings/numbers.h"
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
  watched_.clear();
}

absl::StatusOr<ExportTicket> FdExports::Lend(int fd) {
  if (!running_) return absl::FailedPreconditionError("peer fd socket is not serving");
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) return ErrnoError("dup", errno);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  Entry e{RandomToken(), ipc::UniqueFd(dup), {}};
  ExportTicket t{path_, id, e.secret};
  entries_.emplace(id, std::move(e));
  return t;
}

void FdExports::Withdraw(uint64_t id) {
  Entry gone;  // closed outside the lock: the fetchers holding it see the hang-up
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    gone = std::move(it->second);
    entries_.erase(it);
  }
  if (wake_) (void)wake_->Signal();
}

size_t FdExports::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

absl::StatusOr<uint64_t> FdExports::Watch(ipc::UniqueFd link, std::function<void()> lost) {
  if (!running_) return absl::FailedPreconditionError("peer fd socket is not serving");
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_watch_++;
    watched_.emplace(id, Watched{std::move(link), std::move(lost)});
  }
  (void)wake_->Signal();  // the serving thread polls the new link from its next round
  return id;
}

void FdExports::Unwatch(uint64_t id) {
  Watched gone;
  {
    std::lock_guard<std::mutex> lost_lock(lost_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = watched_.find(id);
    if (it == watched_.end()) return;
    gone = std::move(it->second);
    watched_.erase(it);
  }
  if (wake_) (void)wake_->Signal();
}

// One thread serves every request and watches every held connection and link. What it polls is
// rebuilt each round from the maps, by id, so a descriptor closed meanwhile is never confused
// with a new one of the same number.
void FdExports::Serve() {
  enum class Kind { kHeld, kWatched };
  struct Polled {
    Kind kind;
    uint64_t id;   // export id (kHeld) or watch id (kWatched)
    uint64_t sub;  // the held connection's id within its export
  };
  for (;;) {
    std::vector<pollfd> p = {{listener_.fd(), POLLIN, 0}, {wake_->fd(), POLLIN, 0}};
    std::vector<Polled> what = {{Kind::kHeld, 0, 0}, {Kind::kHeld, 0, 0}};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, e] : entries_)
        for (auto& [sub, conn] : e.held) {
          p.push_back({conn.get(), POLLIN, 0});
          what.push_back({Kind::kHeld, id, sub});
        }
      for (auto& [id, w] : watched_) {
        p.push_back({w.link.get(), POLLIN, 0});
        what.push_back({Kind::kWatched, id, 0});
      }
    }
    const int n = ::poll(p.data(), p.size(), 1000);
    if (!running_) return;
    if (n <= 0) continue;
    if (p[1].revents != 0) (void)wake_->Wait(0);
    for (size_t i = 2; i < p.size(); ++i) {
      if (p[i].revents == 0) continue;
      if (what[i].kind == Kind::kHeld) {
        // The fetcher closed its end (its session is gone) or wrote to it: done with it.
        ipc::UniqueFd gone;
        std::lock_guard<std::mutex> lock(mu_);
        auto it = entries_.find(what[i].id);
        if (it == entries_.end()) continue;
        auto h = it->second.held.find(what[i].sub);
        if (h == it->second.held.end()) continue;
        gone = std::move(h->second);
        it->second.held.erase(h);
        continue;
      }
      std::lock_guard<std::mutex> lost_lock(lost_mu_);
      Watched w;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = watched_.find(what[i].id);
        if (it == watched_.end()) continue;
        w = std::move(it->second);
        watched_.erase(it);
      }
      if (w.lost) w.lost();
    }
    if (!(p[0].revents & POLLIN)) continue;
    absl::StatusOr<ipc::UniqueFd> conn = listener_.Accept();
    if (!conn.ok()) {
      if (!running_) return;
      continue;
    }
    std::optional<std::pair<uint64_t, ipc::UniqueFd>> held = Answer(std::move(*conn));
    if (!held) continue;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(held->first);
    if (it != entries_.end()) it->second.held.emplace(next_held_++, std::move(held->second));
  }
}

std::optional<std::pair<uint64_t, ipc::UniqueFd>> FdExports::Answer(ipc::UniqueFd conn) {
  auto log = Logger("peer");
  absl::StatusOr<ipc::PeerCred> cred = ipc::GetPeerCred(conn.get());
  if (!cred.ok() || cred->uid != ::geteuid()) {
    log->warn("peer fd socket: refused a connection from uid {}", cred.ok() ? cred->uid : -1);
    return std::nullopt;
  }
  SetTimeouts(conn.get(), kPeerIo);
  absl::StatusOr<bool> ready = ipc::WaitReadable(conn.get(), absl::ToInt64Milliseconds(kPeerIo));
  if (!ready.ok() || !*ready) return std::nullopt;
  absl::StatusOr<ipc::ReceivedMessage> req = ipc::RecvMessage(conn.get(), 512, 0);
  if (!req.ok()) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(req->payload, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("id") || !j["id"].is_number_unsigned() ||
      !j.contains("secret") || !j["secret"].is_string() ||
      (j.contains("hold") && !j["hold"].is_boolean())) {
    (void)ipc::SendMessage(conn.get(), R"({"ok": false, "error": "malformed request"})");
    return std::nullopt;
  }
  const uint64_t id = j["id"].get<uint64_t>();
  const bool hold = j.contains("hold") && j["hold"].get<bool>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it != entries_.end() && it->second.secret == j["secret"].get<std::string>()) {
      int fds[1] = {it->second.fd.get()};
      if (!ipc::SendMessage(conn.get(), R"({"ok": true})", std::span<const int>(fds, 1)).ok())
        return std::nullopt;
      if (!hold) return std::nullopt;
      return std::make_pair(id, std::move(conn));
    }
  }
  (void)ipc::SendMessage(conn.get(), R"({"ok": false, "error": "no such export"})");
  return std::nullopt;
}

absl::StatusOr<ipc::UniqueFd> FdExports::Fetch(const ExportTicket& t, absl::Duration timeout) {
  ULY_ASSIGN_OR_RETURN(FetchedExport f, FetchImpl(t, timeout, /*hold=*/false));
  return std::move(f.fd);
}

absl::StatusOr<FetchedExport> FdExports::FetchAndHold(const ExportTicket& t,
                                                      absl::Duration timeout) {
  return FetchImpl(t, timeout, /*hold=*/true);
}

absl::StatusOr<FetchedExport> FdExports::FetchImpl(const ExportTicket& t, absl::Duration timeout,
                                                   bool hold) {
  ULY_ASSIGN_OR_RETURN(ipc::UniqueFd conn, ipc::ConnectUnix(t.socket));
  // Only a daemon of this uid may hand this daemon memory to map.
  ULY_ASSIGN_OR_RETURN(ipc::PeerCred cred, ipc::GetPeerCred(conn.get()));
  if (cred.uid != ::geteuid())
    return absl::PermissionDeniedError(StrCat("peer fd socket ", t.socket, " is served by uid ",
                                              cred.uid, ", not this daemon's uid ", ::geteuid()));
  SetTimeouts(conn.get(), timeout);
  nlohmann::json req = {{"id", t.id}, {"secret", t.secret}};
  if (hold) req["hold"] = true;
  ULY_RETURN_IF_ERROR(ipc::SendMessage(conn.get(), req.dump()));
  ULY_ASSIGN_OR_RETURN(bool ready, ipc::WaitReadable(conn.get(), absl::ToInt64Milliseconds(timeout)));
  if (!ready)
    return absl::DeadlineExceededError(StrCat("peer fd socket ", t.socket, ": no answer"));
  ULY_ASSIGN_OR_RETURN(ipc::ReceivedMessage m, ipc::RecvMessage(conn.get(), 512, 1));
  if (m.fds.size() != 1)
    return absl::FailedPreconditionError(
        StrCat("peer fd socket ", t.socket, ": export ", t.id, " refused: ", m.payload));
  FetchedExport out;
  out.fd = std::move(m.fds[0]);
  if (hold) out.link = std::move(conn);
  return out;
}

std::string EncodeTicket(const ExportTicket& t) { return StrCat(t.id, "|", t.secret, "|", t.socket); }

absl::StatusOr<ExportTicket> DecodeTicket(std::string_view text) {
  const size_t a = text.find('|');
  const size_t b = a == std::string_view::npos ? a : text.find('|', a + 1);
  ExportTicket t;
  if (b == std::string_view::npos || !absl::SimpleAtoi(AbslView(text.substr(0, a)), &t.id) || t.id == 0 ||
      b == a + 1 || b + 1 >= text.size())
    return absl::FailedPreconditionError(
        StrCat("malformed export ticket '", text.substr(0, 64), "'"));
  t.secret = std::string(text.substr(a + 1, b - a - 1));
  t.socket = std::string(text.substr(b + 1));
  return t;
}

}  // namespace ulysses::daemon
