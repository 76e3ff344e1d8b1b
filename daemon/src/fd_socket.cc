// The fd socket: one thread accepts connections, reads hellos and client frames, watches
// pidfds, and watches the submit bell of each client whose ring worker is idle (starting one
// when it rings), all from one poll(2) set of non-blocking descriptors. Nothing in it waits on
// one peer: a connection that sends half a frame only keeps its own buffered bytes, a
// connection that never says hello is closed at its deadline, and an attached client that
// never binds is reclaimed (docs/protocol.md section 1.2).
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "daemon.h"
#include "first_frames.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/frames.h"
#include "ulysses/ipc/pidfd.h"

namespace ulysses::daemon {
namespace {

// Connections waiting for their hello at once; a new one beyond it drops the oldest, so a flood
// of silent connections cannot keep honest clients (who say hello at once) out.
constexpr size_t kMaxPendingConnections = 1024;
// Connections accepted, and frames read from one client, per round of the loop: a burst from
// one source cannot starve the others.
constexpr int kAcceptsPerRound = 64;
constexpr int kFramesPerRound = 8;
// The fd thread's own sends (hello answers) go to a fresh connection whose buffer is empty.
constexpr int kHelloAnswerTimeoutMs = 100;

// The answer to a hello that binds nothing: {"ok": false, "error": "..."}.
std::string ErrorFrame(const absl::Status& why) {
  return nlohmann::json{{"ok", false}, {"error", std::string(why.message())}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

absl::Status Daemon::SendToClient(ClientRecord& c, const std::string& header, int fd) {
  int fds[1] = {fd};
  return SendToClient(c, header, fd >= 0 ? std::span<const int>(fds, 1) : std::span<const int>());
}

absl::Status Daemon::SendToClient(ClientRecord& c, const std::string& header,
                                  std::span<const int> fds) {
  absl::Status sent;
  {
    std::lock_guard<std::mutex> send_lock(c.send_mu);
    int sock = -1;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (!c.fd_socket.valid())
        return absl::FailedPreconditionError(
            StrCat("client ", c.id, ": fd socket not connected; connect it right after Attach"));
      sock = c.fd_socket.get();
    }
    sent = ipc::SendMessage(sock, header, fds, kClientSendTimeoutMs);
  }
  if (sent.ok()) return sent;
  // The frame may be half out: the stream is out of step, and the client is done for.
  Reclaim(c.id, StrCat("fd socket: ", sent.message()));
  return absl::UnavailableError(StrCat("client ", c.id, ": fd socket: ", sent.message()));
}

absl::StatusOr<ipc::UniqueFd> Daemon::TakeIncomingFd(ClientRecord& c, uint64_t tag,
                                                     absl::Duration wait) {
  std::unique_lock<std::mutex> lock(c.mu);
  const bool arrived = c.fd_cv.wait_for(lock, absl::ToChronoNanoseconds(wait), [&] {
    return c.incoming_fds.count(tag) > 0 || !c.fd_socket.valid() || c.gone;
  });
  auto it = c.incoming_fds.find(tag);
  if (!arrived || it == c.incoming_fds.end())
    return absl::InvalidArgumentError(
        StrCat("tag: no fd arrived on the fd socket under tag ", tag));
  ipc::UniqueFd fd = std::move(it->second);
  c.incoming_fds.erase(it);
  UnchargePendingFdsLocked(c, 1);
  return fd;
}

void Daemon::HandleHello(ipc::UniqueFd sock, const std::string& payload) {
  auto log = Logger("ipc");
  absl::StatusOr<ipc::PeerCred> cred = ipc::GetPeerCred(sock.get());
  if (!cred.ok()) return;
  auto refuse = [&](const absl::Status& why) {
    log->debug("fd socket: hello from pid {} refused: {}", cred->pid, std::string(why.message()));
    (void)ipc::SendMessage(sock.get(), ErrorFrame(why), {}, kHelloAnswerTimeoutMs);
  };
  absl::StatusOr<ipc::HelloFrame> hello = ipc::DecodeHello(payload);
  if (!hello.ok()) return refuse(hello.status());
  std::shared_ptr<ClientRecord> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = clients_.find(hello->client_id);
    if (it != clients_.end() && EqualInConstantTime(it->second->token, hello->token))
      c = it->second;
  }
  if (!c) return refuse(absl::PermissionDeniedError("unknown client or bad token"));
  absl::Status admitted;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->gone) {
      admitted = absl::PermissionDeniedError("unknown client or bad token");
    } else if (c->fd_socket.valid()) {
      admitted = absl::AlreadyExistsError(StrCat("client ", c->id, " is bound already"));
    } else {
      admitted = AdmitToUidLocked(*c, cred->uid);
    }
    if (admitted.ok()) {
      ReleaseUnboundLocked(*c);
      c->pid = cred->pid;
      c->uid = cred->uid;
      c->fd_socket = std::move(sock);
      // A process in another pid namespace may show as pid 0: then the sockets alone tell.
      if (c->pid > 0) {
        absl::StatusOr<ipc::UniqueFd> pidfd = ipc::PidfdOpen(c->pid);
        if (pidfd.ok()) c->pidfd = std::move(*pidfd);
      }
    }
  }
  if (!admitted.ok()) {
    refuse(admitted);
    // Over its uid's limit the client cannot be served; a bound or gone one is left as it is.
    if (admitted.code() == absl::StatusCode::kResourceExhausted)
      Reclaim(c->id, StrCat("refused at bind: ", admitted.message()));
    return;
  }
  // The ack carries the call fast path: the client segment and the two doorbells.
  absl::StatusOr<std::shared_ptr<ClientRings>> rings = CreateRings(c);
  if (!rings.ok()) {
    log->warn("client {}: no call rings: {}", c->id, std::string(rings.status().message()));
    (void)SendToClient(*c, R"({"ok": true})", -1);
  } else {
    {
      std::lock_guard<std::mutex> lock(c->mu);
      c->rings = *rings;
    }
    absl::Status sent;
    {
      std::lock_guard<std::mutex> send_lock(c->send_mu);
      int fds[3] = {(*rings)->memfd.get(), (*rings)->submit_ring.fd(),
                    (*rings)->complete_wait.fd()};
      int client_sock;
      {
        std::lock_guard<std::mutex> lock(c->mu);
        client_sock = c->fd_socket.get();
      }
      sent = ipc::SendMessage(client_sock,
                              StrCat("{\"ok\": true, \"client_segment_bytes\": ",
                                     ipc::ClientSegmentLayout::kTotal, "}"),
                              std::span<const int>(fds, 3), kHelloAnswerTimeoutMs);
    }
    if (!sent.ok()) Reclaim(c->id, StrCat("fd socket: ack: ", sent.message()));
  }
  log->debug("client {} bound its fd socket (pid {}, uid {})", c->id, c->pid, c->uid);
}

void Daemon::HandleClientFrame(ClientRecord& c, ipc::ReceivedMessage m) {
  // A frame that is not taken is dropped with its descriptors (they close with `m`); the
  // stream stays in step (frames are length-prefixed), so the client keeps being served.
  auto ignored = [&c](const std::string& why) {
    WarnWithin(c.log_budget, *Logger("ipc"), "client {}: fd frame ignored: {}", c.id, why);
  };
  absl::StatusOr<ipc::FdFrame> f = ipc::DecodeFdFrame(m.payload);
  if (!f.ok() || m.fds.size() != 1) {
    ignored(f.ok() ? StrCat("carries ", m.fds.size(), " descriptors, expected 1")
                   : std::string(f.status().message()));
    return;
  }
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.gone) return;
  if (absl::Status charged = ChargePendingFdLocked(c); !charged.ok()) {
    ignored(std::string(charged.message()));
    return;
  }
  if (!c.incoming_fds.emplace(f->tag, std::move(m.fds[0])).second) {
    UnchargePendingFdsLocked(c, 1);
    ignored(StrCat("tag ", f->tag, " is already pending"));
    return;
  }
  c.fd_cv.notify_all();
}

// One round: build the poll set from the pending connections and the bound clients, wait until
// something is readable or the next deadline, then serve each ready descriptor a bounded amount.
void Daemon::FdLoop() {
  auto log = Logger("ipc");
  const absl::Duration bind_timeout = absl::Milliseconds(config_.bind_timeout_ms);
  FirstFrames hellos("ipc", "fd socket", kMaxPendingConnections, ipc::kMaxClientFrameBytes,
                     bind_timeout);
  std::map<uint64_t, ipc::FrameReader> readers;  // bound clients' partial frames, by client id

  enum class Kind { kWake, kListener, kPending, kSocket, kPidfd, kSubmitBell };
  struct Watched {
    Kind kind;
    size_t pending_index = 0;
    std::shared_ptr<ClientRecord> client;
  };

  while (!stopping_.load()) {
    const absl::Time now = absl::Now();
    absl::Time next = std::min(now + absl::Seconds(1), hellos.Expire(now));

    std::vector<pollfd> fds;
    std::vector<Watched> watched;
    fds.push_back(pollfd{poll_wake_->fd(), POLLIN, 0});
    watched.push_back({Kind::kWake, 0, nullptr});
    if (hellos.accepting(now)) {
      fds.push_back(pollfd{fd_listener_.fd(), POLLIN, 0});
      watched.push_back({Kind::kListener, 0, nullptr});
    }
    for (size_t i = 0; i < hellos.size(); ++i) {
      fds.push_back(pollfd{hellos.fd(i), POLLIN, 0});
      watched.push_back({Kind::kPending, i, nullptr});
    }
    std::set<uint64_t> bound;
    std::vector<uint64_t> never_bound;
    const std::vector<std::shared_ptr<ClientRecord>> clients = Clients();
    ReportStalledWorkers(clients, now);
    for (auto& c : clients) {
      std::lock_guard<std::mutex> lock(c->mu);
      if (!c->fd_socket.valid()) {
        const absl::Time due = c->since + bind_timeout;
        if (due <= now) never_bound.push_back(c->id);
        else next = std::min(next, due);
        continue;
      }
      bound.insert(c->id);
      fds.push_back(pollfd{c->fd_socket.get(), POLLIN, 0});
      watched.push_back({Kind::kSocket, 0, c});
      if (c->pidfd.valid()) {
        fds.push_back(pollfd{c->pidfd.get(), POLLIN, 0});
        watched.push_back({Kind::kPidfd, 0, c});
      }
      // A client whose ring worker is idle: its next ring starts one (never read here).
      if (c->rings && !c->rings->worker_running.load()) {
        fds.push_back(pollfd{c->rings->submit_bell.fd(), POLLIN, 0});
        watched.push_back({Kind::kSubmitBell, 0, c});
      }
    }
    JoinFinishedWorkers();
    for (uint64_t id : never_bound)
      Reclaim(id, StrCat("did not bind its fd socket within ", config_.bind_timeout_ms,
                         " ms (timeouts.bind_ms)"));
    std::erase_if(readers, [&](const auto& r) { return bound.count(r.first) == 0; });

    const int n = ::poll(fds.data(), fds.size(), PollMillis(next, now));
    if (n < 0 && errno != EINTR) {
      log->error("fd socket: poll: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (n <= 0) continue;

    bool accept_now = false;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Watched& w = watched[i];
      switch (w.kind) {
        case Kind::kWake:
          (void)poll_wake_->Wait(0);
          break;
        case Kind::kListener:
          accept_now = true;
          break;
        case Kind::kPending: {
          std::optional<FirstFrames::Frame> hello = hellos.Read(w.pending_index);
          if (hello) HandleHello(std::move(hello->sock), hello->payload);
          break;
        }
        case Kind::kSocket: {
          ClientRecord& c = *w.client;
          ipc::FrameReader& reader =
              readers.try_emplace(c.id, ipc::kMaxClientFrameBytes).first->second;
          for (int k = 0; k < kFramesPerRound; ++k) {
            absl::StatusOr<bool> complete = reader.Read(fds[i].fd);
            if (!complete.ok()) {
              // Hung up, or a frame the stream cannot skip (over the size limit).
              Reclaim(c.id, StrCat("fd socket: ", complete.status().message()));
              break;
            }
            if (!*complete) break;
            HandleClientFrame(c, reader.Take());
          }
          break;
        }
        case Kind::kPidfd:
          Reclaim(w.client->id, "process exited");
          break;
        case Kind::kSubmitBell: {
          std::shared_ptr<ClientRings> rings;
          {
            std::lock_guard<std::mutex> lock(w.client->mu);
            if (!w.client->gone) rings = w.client->rings;
          }
          if (rings) StartRingWorker(w.client, rings);
          break;
        }
      }
    }
    hellos.Compact();
    if (accept_now) hellos.AcceptFrom(fd_listener_, kAcceptsPerRound, [](int) { return true; });
  }
}

}  // namespace ulysses::daemon
