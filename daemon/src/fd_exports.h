// Descriptors this daemon lends to the other daemons of its node: its session segments (memfds)
// and the POSIX-fd handles of its receive slots in device memory. Served on `<socket>.peer`
// (mode 0600: only the daemons' uid can connect, and the server also checks the caller's uid;
// the fetcher checks the server's). A peer asks for an export by id and secret, both learnt
// from the session rendezvous; one frame in, one frame (with the fd) out. A fetch that asks to
// hold the connection keeps it open until the export is withdrawn: the connection is then the
// fetcher's view of the exporting daemon's liveness (it hangs up the moment that daemon dies,
// whatever pid namespace it runs in), watched by Watch.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>
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

/// "id|secret|socket", as it travels in a rendezvous payload (the socket path last: it may hold
/// '|').
std::string EncodeTicket(const ExportTicket& t);
/// The inverse of EncodeTicket; FAILED_PRECONDITION naming what is wrong. Never throws.
absl::StatusOr<ExportTicket> DecodeTicket(std::string_view text);

/// A fetched descriptor and, when the fetch asked to hold it, the open connection to the
/// exporting daemon (it hangs up when that daemon dies or withdraws the export).
struct FetchedExport {
  ipc::UniqueFd fd;
  ipc::UniqueFd link;
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
  /// Fetches as Fetch does and keeps the connection: FetchedExport::link.
  static absl::StatusOr<FetchedExport> FetchAndHold(const ExportTicket& ticket,
                                                    absl::Duration timeout);

  /// Watches `link` (a FetchedExport::link) from the serving thread: once it hangs up (or
  /// carries anything), `lost` runs once, on that thread, and the watch ends. Returns the id
  /// for Unwatch. FAILED_PRECONDITION when not serving.
  absl::StatusOr<uint64_t> Watch(ipc::UniqueFd link, std::function<void()> lost);
  /// Ends a watch and closes its link. Once it returns, its `lost` is not running and never
  /// will. Idempotent.
  void Unwatch(uint64_t id);

 private:
  void Serve();
  // Answers one complete request; returns the connection when the request asked to hold it.
  std::optional<std::pair<uint64_t, ipc::UniqueFd>> Answer(ipc::UniqueFd conn,
                                                           const std::string& request);
  static absl::StatusOr<FetchedExport> FetchImpl(const ExportTicket& ticket,
                                                 absl::Duration timeout, bool hold);

  std::string path_;
  ipc::UnixListener listener_;
  std::unique_ptr<ipc::EventFd> wake_;
  std::thread thread_;
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  struct Entry {
    std::string secret;
    ipc::UniqueFd fd;
    std::map<uint64_t, ipc::UniqueFd> held;  // fetchers' connections, closed on Withdraw
  };
  std::map<uint64_t, Entry> entries_;
  struct Watched {
    ipc::UniqueFd link;
    std::function<void()> lost;
  };
  std::map<uint64_t, Watched> watched_;
  uint64_t next_watch_ = 1;
  uint64_t next_held_ = 1;
  // Held while a `lost` callback runs, so Unwatch can wait for it. Taken before mu_, never
  // after.
  std::mutex lost_mu_;
  std::atomic<bool> running_{false};
};

}  // namespace ulysses::daemon
