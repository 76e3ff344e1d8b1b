// Descriptors this daemon lends to the other daemons of its node: the POSIX-fd handles of its
// receive slots in device memory. Served on `<socket>.peer` (mode 0600: only the daemons' uid
// can connect, and the server also checks the caller's uid). A peer asks for an export by id
// and secret, both learnt from the session rendezvous; one frame in, one frame (with the fd)
// out, then the connection closes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ulysses/ipc/eventfd.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::daemon {

/// 128 random bits from the system's entropy source, as 32 hex digits: client tokens and export
/// secrets.
std::string RandomToken();

/// What a peer needs to fetch one export: the exporting daemon's peer socket, id and secret.
struct ExportTicket {
  std::string socket;
  uint64_t id = 0;
  std::string secret;
};

class FdExports {
 public:
  FdExports() = default;
  ~FdExports() { Stop(); }
  FdExports(const FdExports&) = delete;
  FdExports& operator=(const FdExports&) = delete;

  /// Listens on `path` (mode 0600) and starts the serving thread.
  absl::Status Start(const std::string& path);
  /// Stops serving; joins the thread. Idempotent.
  void Stop();

  /// Lends `fd` (a duplicate is kept) until Withdraw. Returns the ticket peers use.
  absl::StatusOr<ExportTicket> Lend(int fd);
  void Withdraw(uint64_t id);
  size_t size() const;

  /// Fetches the fd behind `ticket` from its daemon. Bounded by `timeout`.
  static absl::StatusOr<ipc::UniqueFd> Fetch(const ExportTicket& ticket, absl::Duration timeout);

 private:
  void Serve();
  void Answer(ipc::UniqueFd conn);

  std::string path_;
  ipc::UnixListener listener_;
  std::unique_ptr<ipc::EventFd> wake_;
  std::thread thread_;
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  struct Entry {
    std::string secret;
    ipc::UniqueFd fd;
  };
  std::map<uint64_t, Entry> entries_;
  bool running_ = false;
};

}  // namespace ulysses::daemon
