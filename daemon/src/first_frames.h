// Connections whose first frame (a client's hello, a peer daemon's fetch request) has not fully
// arrived, for a poll(2) loop that must never wait on one of them: each is read as its bytes
// come, closed at its deadline, and a new one beyond the bound drops the oldest, so a flood of
// silent connections cannot keep out those that send their frame at once.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "ulysses/common/logging.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::daemon {

/// poll(2)'s timeout for a loop that wakes at `deadline` (rounded up to a millisecond) or at
/// least once a second.
int PollMillis(absl::Time deadline, absl::Time now);

class FirstFrames {
 public:
  /// `what` names the socket in the log lines, which go to the logger `logger`; each connection
  /// has `wait` from its accept to send a frame of at most `max_payload` bytes (no
  /// descriptors); at most `max_waiting` wait.
  FirstFrames(std::string logger, std::string what, size_t max_waiting, size_t max_payload,
              absl::Duration wait);

  /// A frame that has arrived whole, and the connection it came on.
  struct Frame {
    ipc::UniqueFd sock;
    std::string payload;
  };

  /// Closes the connections past their deadline. Returns the earliest deadline left
  /// (InfiniteFuture when none waits), and while accepts are paused, that pause's end if sooner.
  absl::Time Expire(absl::Time now);
  /// Whether the listener should be polled this round (accepts pause after an accept error).
  [[nodiscard]] bool accepting(absl::Time now) const { return now >= accept_paused_until_; }

  size_t size() const { return waiting_.size(); }
  int fd(size_t i) const { return waiting_[i].sock.get(); }
  /// Reads what connection `i` has sent. A complete frame is returned and the connection is
  /// done with; so is one that hung up or sent a frame over the limit (nullopt). Indices stay
  /// valid until Compact().
  std::optional<Frame> Read(size_t i);
  /// Forgets the connections Read was done with.
  void Compact();

  /// Accepts up to `burst` connections waiting on `listener`. `admit` sees each new socket and
  /// may refuse it (the socket is then closed). After an accept error other than CANCELLED
  /// (EMFILE leaves the connection queued and the listener readable) accepts pause for 100 ms.
  void AcceptFrom(ipc::UnixListener& listener, int burst,
                  const std::function<bool(int sock)>& admit);
  /// The budget of the warnings about this socket's connections (any process that can
  /// connect causes them), for `admit`'s too.
  LogBudget& log_budget() { return log_budget_; }

 private:
  struct Waiting {
    ipc::UniqueFd sock;
    ipc::FrameReader reader;
    absl::Time deadline;
    bool done = false;
  };
  std::string logger_;
  std::string what_;
  size_t max_waiting_;
  size_t max_payload_;
  absl::Duration wait_;
  std::deque<Waiting> waiting_;  // in accept order, so also in deadline order
  absl::Time accept_paused_until_ = absl::InfinitePast();
  LogBudget log_budget_;
};

}  // namespace ulysses::daemon
