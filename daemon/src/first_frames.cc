#include "first_frames.h"

#include <algorithm>
#include <utility>

#include "ulysses/common/logging.h"

namespace ulysses::daemon {
namespace {

// After EMFILE the listener stays readable; stop watching it for this long instead of spinning.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

}  // namespace

int PollMillis(absl::Time deadline, absl::Time now) {
  if (deadline <= now) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(deadline - now, absl::Milliseconds(1))), 1000));
}

FirstFrames::FirstFrames(std::string logger, std::string what, size_t max_waiting,
                         size_t max_payload, absl::Duration wait)
    : logger_(std::move(logger)),
      what_(std::move(what)), max_waiting_(max_waiting), max_payload_(max_payload), wait_(wait) {}

absl::Time FirstFrames::Expire(absl::Time now) {
  while (!waiting_.empty() && waiting_.front().deadline <= now) {
    Logger(logger_)->debug("{}: a connection sent no whole frame within {}; closed", what_,
                         absl::FormatDuration(wait_));
    waiting_.pop_front();
  }
  absl::Time next = waiting_.empty() ? absl::InfiniteFuture() : waiting_.front().deadline;
  if (!accepting(now)) next = std::min(next, accept_paused_until_);
  return next;
}

std::optional<FirstFrames::Frame> FirstFrames::Read(size_t i) {
  Waiting& w = waiting_[i];
  absl::StatusOr<bool> complete = w.reader.Read(w.sock.get());
  if (complete.ok() && !*complete) return std::nullopt;  // the rest comes later
  w.done = true;
  if (!complete.ok()) {
    Logger(logger_)->debug("{}: first frame not readable: {}", what_,
                         std::string(complete.status().message()));
    return std::nullopt;
  }
  return Frame{std::move(w.sock), w.reader.Take().payload};
}

void FirstFrames::Compact() {
  std::erase_if(waiting_, [](const Waiting& w) { return w.done; });
}

void FirstFrames::AcceptFrom(ipc::UnixListener& listener, int burst,
                             const std::function<bool(int sock)>& admit) {
  auto log = Logger(logger_);
  for (int k = 0; k < burst; ++k) {
    absl::StatusOr<ipc::UniqueFd> sock = listener.TryAccept();
    if (!sock.ok()) {
      if (sock.status().code() == absl::StatusCode::kCancelled) return;  // shutting down
      WarnWithin(log_budget_, *log, "{}: accept: {}; pausing accepts for {}", what_,
                 std::string(sock.status().message()), absl::FormatDuration(kAcceptBackoff));
      accept_paused_until_ = absl::Now() + kAcceptBackoff;
      return;
    }
    if (!sock->valid()) return;  // none left
    if (!admit(sock->get())) continue;
    if (waiting_.size() >= max_waiting_) {
      WarnWithin(log_budget_, *log,
                 "{}: {} connections wait for their first frame; dropping the oldest", what_,
                 waiting_.size());
      waiting_.pop_front();
    }
    waiting_.push_back(Waiting{std::move(*sock), ipc::FrameReader(max_payload_, /*max_fds=*/0),
                               absl::Now() + wait_});
  }
}

}  // namespace ulysses::daemon
