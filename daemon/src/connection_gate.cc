#include "connection_gate.h"

#include <fcntl.h>
#include <poll.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <utility>

#include "grpcpp/server_posix.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

// Connections accepted per round of the loop, and how long accepts pause after one failed
// (EMFILE: the pending connection stays queued).
constexpr int kAcceptsPerRound = 64;
constexpr int kAcceptBackoffMs = 100;

}  // namespace

absl::Status ConnectionGate::Start(ipc::UnixListener listener, grpc::Server* server, Admit admit,
                                   Ended ended) {
  ULY_ASSIGN_OR_RETURN(ipc::EventFd wake, ipc::EventFd::Create());
  wake_ = std::make_unique<ipc::EventFd>(std::move(wake));
  listener_ = std::move(listener);
  server_ = server;
  admit_ = std::move(admit);
  ended_ = std::move(ended);
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void ConnectionGate::Stop() {
  if (stopping_.exchange(true) || !thread_.joinable()) return;
  listener_.Shutdown();
  (void)wake_->Signal();
  thread_.join();
  std::vector<Held> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held.swap(held_);
  }
  for (const Held& h : held) ended_(h.uid);
}

size_t ConnectionGate::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size();
}

std::optional<uid_t> ConnectionGate::UidOfPeer(std::string_view peer) const {
  constexpr std::string_view kPrefix = "fd:";
  if (peer.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  peer.remove_prefix(kPrefix.size());
  int fd = -1;
  const auto [end, ec] = std::from_chars(peer.data(), peer.data() + peer.size(), fd);
  if (ec != std::errc() || end != peer.data() + peer.size()) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  // The newest first: a number gRPC closed and the kernel gave to a newer connection may
  // still be held for the older one until the gate sees that one's hang-up.
  for (auto it = held_.rbegin(); it != held_.rend(); ++it)
    if (it->grpc_fd == fd) return it->uid;
  return std::nullopt;
}

void ConnectionGate::AcceptBurst() {
  auto log = Logger("main");
  for (int k = 0; k < kAcceptsPerRound; ++k) {
    absl::StatusOr<ipc::UniqueFd> sock = listener_.TryAccept();
    if (!sock.ok()) {
      if (sock.status().code() == absl::StatusCode::kCancelled) return;
      WarnWithin(log_budget_, *log, "control socket: accept: {}; pausing accepts for {} ms",
                 std::string(sock.status().message()), kAcceptBackoffMs);
      ::poll(nullptr, 0, kAcceptBackoffMs);
      return;
    }
    if (!sock->valid()) return;  // none left
    absl::StatusOr<ipc::PeerCred> cred = ipc::GetPeerCred(sock->get());
    if (!cred.ok()) continue;  // closed: whoever it was is gone
    if (absl::Status admitted = admit_(cred->uid); !admitted.ok()) {
      WarnWithin(log_budget_, *log, "control socket: connection of uid {} (pid {}) refused: {}",
                 cred->uid, cred->pid, std::string(admitted.message()));
      continue;
    }
    ipc::UniqueFd watch(::fcntl(sock->get(), F_DUPFD_CLOEXEC, 0));
    if (!watch.valid()) {
      log->warn("control socket: connection of uid {} dropped: dup: {}", cred->uid,
                std::strerror(errno));
      ended_(cred->uid);
      continue;
    }
    const int grpc_fd = sock->release();
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_.push_back(Held{std::move(watch), cred->uid, grpc_fd});
    }
    grpc::AddInsecureChannelFromFd(server_, grpc_fd);
  }
}

void ConnectionGate::Loop() {
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back({wake_->fd(), POLLIN, 0});
    fds.push_back({listener_.fd(), POLLIN, 0});
    {
      std::lock_guard<std::mutex> lock(mu_);
      // No event asked for: POLLHUP comes alone, once both directions are shut down (the
      // client closed, or gRPC shut the connection down). POLLRDHUP would come at a client's
      // shutdown(SHUT_WR) already, while gRPC may still hold the socket.
      for (const Held& h : held_) fds.push_back({h.watch.get(), 0, 0});
    }
    const int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      Logger("main")->error("control socket: poll: {}", std::strerror(errno));
      ::poll(nullptr, 0, kAcceptBackoffMs);
      continue;
    }
    if (fds[0].revents != 0) (void)wake_->Wait(0);
    if (stopping_.load()) break;
    // Ended connections first: their places are free for the ones accepted next. held_ only
    // grows at its end on this thread, so the entries polled keep their positions.
    std::vector<uid_t> ended;
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t kept = 0;
      for (size_t i = 0; i < held_.size(); ++i) {
        if (fds[2 + i].revents != 0) {
          ended.push_back(held_[i].uid);
          continue;  // its duplicate closes with the entry
        }
        if (kept != i) held_[kept] = std::move(held_[i]);
        ++kept;
      }
      held_.resize(kept);
    }
    for (uid_t uid : ended) ended_(uid);
    if (fds[1].revents != 0) AcceptBurst();
  }
}

}  // namespace ulysses::daemon
