// The control socket's connections, accepted by the daemon itself and handed to its gRPC
// server one by one. gRPC accepts whatever connects to a socket it listens on, and each
// connection holds a descriptor of the daemon's: a process that can reach the socket could
// open connections until the daemon had none left for anyone. Accepting them here gives each
// its uid (SO_PEERCRED) before gRPC sees it, so that they can be bounded per uid and in all.
//
// Each admitted connection is handed to the server (grpc::AddInsecureChannelFromFd, which
// takes a non-blocking socket) and a duplicate of it is kept, watched for the hang-up alone
// (POLLHUP: both directions shut down): the client closing its end, or gRPC shutting the
// connection down (it shuts a socket down both ways before it closes it), ends the
// connection's place. A client that only shuts down its sending side keeps it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "ulysses/common/logging.h"
#include "ulysses/ipc/eventfd.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::daemon {

class ConnectionGate {
 public:
  /// Decides on a connection of `uid` and counts it when OK; a refusal's message is logged.
  using Admit = std::function<absl::Status(uid_t uid)>;
  /// Gives back an admitted connection's place once it ended.
  using Ended = std::function<void(uid_t uid)>;

  ConnectionGate() = default;
  ~ConnectionGate() { Stop(); }
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  /// Serves `listener`'s connections to `server` (started, outliving the gate's thread) from a
  /// thread of its own.
  absl::Status Start(ipc::UnixListener listener, grpc::Server* server, Admit admit, Ended ended);
  /// Stops accepting (new connections are refused), joins the thread, and gives back every
  /// place still held. The connections themselves stay gRPC's. Idempotent.
  void Stop();
  /// Connections admitted and not ended.
  size_t size() const;
  /// The uid of the admitted connection a gRPC call came on, from the call's peer
  /// (grpc::ServerContext::peer(), "fd:N" for a connection handed over by descriptor);
  /// nullopt for any other peer, or one no longer held.
  std::optional<uid_t> UidOfPeer(std::string_view peer) const;

 private:
  struct Held {
    ipc::UniqueFd watch;  // the duplicate, polled for POLLHUP
    uid_t uid;
    int grpc_fd;  // the descriptor handed to gRPC (its calls' peer is "fd:<grpc_fd>")
  };
  void Loop();
  void AcceptBurst();

  ipc::UnixListener listener_;
  grpc::Server* server_ = nullptr;
  Admit admit_;
  Ended ended_;
  std::unique_ptr<ipc::EventFd> wake_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;  // guards held_ (read by size())
  std::vector<Held> held_;
  LogBudget log_budget_;  // the gate's warnings, which any process that reaches it can cause
};

}  // namespace ulysses::daemon
