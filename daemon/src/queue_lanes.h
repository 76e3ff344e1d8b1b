// The daemon's streams of one device by hardware queue (docs/architecture.md, section 1.3).
//
// A wait enqueued on a stream blocks the stream's hardware queue, so a session stream that
// waits for its peer holds back every other stream on that queue: another session's call,
// a fused plan's second stream, a cancel. The probe at start (ulysses/ipc/queue_probe.h) finds
// which of a set of streams share a queue; QueueLanes keeps one stream per queue (a lane),
// none on the rescue stream's queue, and hands each lane to one user at a time, so no two
// sessions' streams share a queue while a free one is left. Past the lanes, `sharing` says
// whether a further stream is made (it may share a queue with a session's) or the request is
// refused. Without a probe every stream is such a further one. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses::daemon {

/// What a stream serves: a session's calls, or a fused plan's second stream (made at the
/// device's greatest priority, so that its stores get SMs as the GEMM's blocks retire).
enum class StreamRole { kSession, kSecond };

/// A probed stream: its handle, its priority, and its queue class (streams of one class share
/// a queue).
struct ProbedStream {
  void* stream = nullptr;
  bool greatest = false;
  int queue = 0;
};

/// Counts for GetState and the metrics.
struct QueueLaneCounts {
  bool probed = false;          ///< lanes come from a probe
  int32_t queues = 0;           ///< queues the probe found, the rescue stream's included
  int32_t lanes = 0;            ///< queues that serve sessions (all but the rescue stream's)
  int32_t lanes_in_use = 0;     ///< lanes handed out now
  uint64_t streams_used = 0;    ///< distinct streams handed out since start
  uint64_t shared_streams = 0;  ///< streams made past the lanes (may share a queue)
  uint64_t refused = 0;         ///< takes refused past the lanes (`sharing` false)
};

class QueueLanes {
 public:
  /// Makes a stream past the lanes (`greatest`: at the greatest priority).
  using MakeStream = std::function<absl::StatusOr<void*>(bool greatest)>;

  /// Lanes from a probe: `probed` every probed stream, `rescue_queue` the rescue stream's
  /// class. Streams not kept as a lane's are listed by surplus() (the owner destroys them).
  /// `sharing`: past the lanes, make streams (true) or refuse (false).
  QueueLanes(const std::vector<ProbedStream>& probed, int rescue_queue, bool sharing,
             MakeStream make);
  /// No probe: every stream is made on demand, and one given back serves the next take.
  explicit QueueLanes(MakeStream make);

  /// A stream for `role`: a free lane (the one given back last, with a stream of the role's
  /// priority if one has it), else past the lanes as `sharing` says: RESOURCE_EXHAUSTED
  /// naming queues.sharing when refused.
  absl::StatusOr<void*> Take(StreamRole role);
  /// A free lane's stream, or none (nothing is made).
  std::optional<void*> TakeFree(StreamRole role);
  /// Gives back a stream Take or TakeFree handed out, with no work left on it.
  void Give(void* stream);

  /// Streams the probe made that no lane keeps.
  const std::vector<void*>& surplus() const { return surplus_; }
  /// Every stream this holds (lanes' and those made past them), for the owner to destroy.
  std::vector<void*> AllStreams() const;
  QueueLaneCounts counts() const;
  /// One line for the log: the queues found and how they serve.
  std::string Describe() const;

 private:
  struct Lane {
    void* normal = nullptr;    // the class's first stream at the default priority
    void* greatest = nullptr;  // the class's first stream at the greatest priority
    void* in_use = nullptr;    // the stream handed out (null: free)
    uint64_t given_back = 0;   // order of the last give-back (0: never taken)
    bool used = false;
  };
  std::optional<void*> TakeFreeLocked(StreamRole role);

  mutable std::mutex mu_;
  const bool probed_ = false;
  const bool sharing_ = true;
  const MakeStream make_;
  int32_t queues_ = 0;
  std::vector<Lane> lanes_;
  std::vector<void*> surplus_;
  std::vector<std::pair<void*, bool>> extra_idle_;  // made past the lanes, free: (stream, greatest)
  std::vector<std::pair<void*, bool>> extra_all_;
  uint64_t order_ = 0;
  uint64_t streams_used_ = 0;
  uint64_t refused_ = 0;
};

}  // namespace ulysses::daemon
