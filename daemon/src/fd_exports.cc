#include "fd_exports.h"

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <random>
#include <sys/socket.h>
#include <unistd.h>


#include "absl/strings/numbers.h"
#include "first_frames.h"
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

// How long a connection has to send its whole request, and the fetcher's bound on each read
// and write once connected.
constexpr absl::Duration kPeerIo = absl::Seconds(2);
// The answer goes to a fresh connection whose send buffer is empty.
constexpr int kAnswerTimeoutMs = 100;
// A request is one small JSON object.
constexpr size_t kMaxRequestBytes = 512;
// Requests read at once; a new connection beyond it drops the oldest, so a flood of silent
// connections cannot keep the node's daemons (who send their request at once) out.
constexpr size_t kMaxPendingRequests = 256;
// Connections accepted per round of the loop, so a burst cannot starve the held connections.
constexpr int kAcceptsPerRound = 64;

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

// One thread serves every request and watches every held connection and link, from one
// poll(2) set of non-blocking descriptors. Nothing in it waits on one connection: a request is
// read as it arrives and kept until complete, a connection that has not sent a whole request
// within kPeerIo is closed, and at most kMaxPendingRequests wait at once (a new one drops the
// oldest). What it polls is rebuilt each round from the maps, by id, so a descriptor closed
// meanwhile is never confused with a new one of the same number.
void FdExports::Serve() {
  auto log = Logger("peer");
  enum class Kind { kListener, kWake, kPending, kHeld, kWatched };
  struct Polled {
    Kind kind;
    uint64_t id = 0;   // export id (kHeld), watch id (kWatched), pending index (kPending)
    uint64_t sub = 0;  // the held connection's id within its export
  };
  FirstFrames requests("peer", "peer fd socket", kMaxPendingRequests, kMaxRequestBytes, kPeerIo);
  while (running_) {
    const absl::Time now = absl::Now();
    const absl::Time next = std::min(now + absl::Seconds(1), requests.Expire(now));
    std::vector<pollfd> p = {{wake_->fd(), POLLIN, 0}};
    std::vector<Polled> what = {{Kind::kWake}};
    if (requests.accepting(now)) {
      p.push_back({listener_.fd(), POLLIN, 0});
      what.push_back({Kind::kListener});
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      p.push_back({requests.fd(i), POLLIN, 0});
      what.push_back({Kind::kPending, i});
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, e] : entries_)
        for (auto& [sub, conn] : e.held) {
          p.push_back({conn.get(), POLLIN, 0});
          what.push_back({Kind::kHeld, id, sub});
        }
      for (auto& [id, w] : watched_) {
        p.push_back({w.link.get(), POLLIN, 0});
        what.push_back({Kind::kWatched, id});
      }
    }
    const int n = ::poll(p.data(), p.size(), PollMillis(next, now));
    if (!running_) return;
    if (n <= 0) continue;

    bool accept_now = false;
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i].revents == 0) continue;
      switch (what[i].kind) {
        case Kind::kWake:
          (void)wake_->Wait(0);
          break;
        case Kind::kListener:
          accept_now = true;
          break;
        case Kind::kPending: {
          std::optional<FirstFrames::Frame> request = requests.Read(what[i].id);
          if (!request) break;
          std::optional<std::pair<uint64_t, ipc::UniqueFd>> held =
              Answer(std::move(request->sock), request->payload);
          if (!held) break;
          std::lock_guard<std::mutex> lock(mu_);
          auto it = entries_.find(held->first);
          if (it != entries_.end()) it->second.held.emplace(next_held_++, std::move(held->second));
          break;
        }
        case Kind::kHeld: {
          // The fetcher closed its end (its session is gone) or wrote to it: done with it.
          ipc::UniqueFd gone;  // closed outside the lock
          std::lock_guard<std::mutex> lock(mu_);
          auto it = entries_.find(what[i].id);
          if (it == entries_.end()) break;
          auto h = it->second.held.find(what[i].sub);
          if (h == it->second.held.end()) break;
          gone = std::move(h->second);
          it->second.held.erase(h);
          break;
        }
        case Kind::kWatched: {
          std::lock_guard<std::mutex> lost_lock(lost_mu_);
          Watched w;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = watched_.find(what[i].id);
            if (it == watched_.end()) break;
            w = std::move(it->second);
            watched_.erase(it);
          }
          if (w.lost) w.lost();
          break;
        }
      }
    }
    requests.Compact();
    if (!accept_now) continue;
    requests.AcceptFrom(listener_, kAcceptsPerRound, [&](int sock) {
      absl::StatusOr<ipc::PeerCred> cred = ipc::GetPeerCred(sock);
      if (cred.ok() && cred->uid == ::geteuid()) return true;
      WarnWithin(requests.log_budget(), *log, "peer fd socket: refused a connection from uid {}",
                 cred.ok() ? static_cast<int64_t>(cred->uid) : -1);
      return false;
    });
  }
}

std::optional<std::pair<uint64_t, ipc::UniqueFd>> FdExports::Answer(ipc::UniqueFd conn,
                                                                    const std::string& request) {
  // The connection is fresh and its send buffer empty: one small answer never waits long.
  auto answer = [&](std::string_view text, std::span<const int> fds = {}) {
    return ipc::SendMessage(conn.get(), text, fds, kAnswerTimeoutMs);
  };
  const nlohmann::json j = nlohmann::json::parse(request, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("id") || !j["id"].is_number_unsigned() ||
      !j.contains("secret") || !j["secret"].is_string() ||
      (j.contains("hold") && !j["hold"].is_boolean())) {
    (void)answer(R"({"ok": false, "error": "malformed request"})");
    return std::nullopt;
  }
  const uint64_t id = j["id"].get<uint64_t>();
  const bool hold = j.contains("hold") && j["hold"].get<bool>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it != entries_.end() && it->second.secret == j["secret"].get<std::string>()) {
      int fds[1] = {it->second.fd.get()};
      if (!answer(R"({"ok": true})", std::span<const int>(fds, 1)).ok()) return std::nullopt;
      if (!hold) return std::nullopt;
      return std::make_pair(id, std::move(conn));
    }
  }
  (void)answer(R"({"ok": false, "error": "no such export"})");
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
  ULY_ASSIGN_OR_RETURN(ipc::UniqueFd conn, ipc::ConnectUnix(t.socket, timeout));
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
