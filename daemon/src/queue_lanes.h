// The daemon's streams of one device by hardware queue (docs/architecture.md, section 1.3).
//
// A wait enqueued on a stream blocks the stream's hardware queue, so a session stream that
// waits for its peer holds back every other stream on that queue: another session's call,
// a fused plan's second stream, a cancel. The probe at start (ulysses/ipc/queue_probe.h) finds
// which of a set of streams share a queue; QueueLanes groups them by queue (a lane per queue),
// keeps none on the rescue stream's queue, and hands each lane to one user at a time, so no
// two sessions' streams share a queue while a free one is left. Past the free lanes,
// `sharing` says whether a spare stream of the least used lane is handed out (it shares that
// lane's queue, never the rescue stream's) or the request is refused; past the spares every
// request is refused, since a stream made then could land on the rescue stream's queue.
// Without a probe every stream is made as needed, of the priority asked for, and may share
// any queue. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
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
  int32_t lanes_in_use = 0;     ///< lanes with a stream handed out now
  uint64_t streams_used = 0;    ///< distinct streams handed out since start
  uint64_t shared_streams = 0;  ///< takes past the free lanes: a queue shared with another user
  uint64_t refused = 0;         ///< takes refused past the free lanes (`sharing` false)
};

class QueueLanes {
 public:
  /// Makes a stream past the lanes (`greatest`: at the greatest priority).
  using MakeStream = std::function<absl::StatusOr<void*>(bool greatest)>;

  /// Lanes from a probe: `probed` every probed stream, `rescue_queue` the rescue stream's
  /// class. The streams on the rescue stream's queue are listed by surplus() (the owner
  /// destroys them). `sharing`: past the free lanes, share one (true) or refuse (false).
  QueueLanes(const std::vector<ProbedStream>& probed, int rescue_queue, bool sharing,
             MakeStream make);
  /// No probe: every stream is made on demand, and one given back serves the next take.
  explicit QueueLanes(MakeStream make);

  /// A stream for `role`: a free lane (the one given back last, with a stream of the role's
  /// priority if one has it), else as `sharing` says: an idle stream of the lane with the
  /// fewest streams in use, or RESOURCE_EXHAUSTED naming queues.sharing; RESOURCE_EXHAUSTED
  /// naming queues.probe_streams when no probed stream is idle. `apart` (a stream handed out
  /// earlier, or null): a shared queue is never that stream's (a fused plan's second stream
  /// would otherwise wait behind its own session's stream).
  absl::StatusOr<void*> Take(StreamRole role, void* apart = nullptr);
  /// A free lane's stream, or none (nothing is made).
  std::optional<void*> TakeFree(StreamRole role);
  /// Gives back a stream Take or TakeFree handed out, with no work left on it.
  void Give(void* stream);
  /// The session `stream` was handed to finished its setup (the work its thread waits for on
  /// that stream). Until then, past the free lanes, a lane whose stream is in its setup is
  /// shared only when every other lane with a spare is too: a session that came to share it
  /// would put its waiting call ahead of that setup's wait. Give ends the setup too.
  void SetupDone(void* stream);
  /// A stream handed out whose work never ended (a session's drain gave up on it): it is never
  /// given back, and its lane's queue, held by that work, is never handed out again, not even
  /// shared. Returns whether a lane was retired (false for a stream made without the probe,
  /// which is simply never handed out again).
  bool Retire(void* stream);

  /// Streams the probe made on the rescue stream's queue.
  const std::vector<void*>& surplus() const { return surplus_; }
  /// Every stream this holds (lanes' and those made as needed), for the owner to destroy.
  std::vector<void*> AllStreams() const;
  QueueLaneCounts counts() const;
  /// Whether the lanes come from a probe (fixed when made).
  bool probed() const { return probed_; }
  /// Whether `stream`, handed out, shares its queue with another stream handed out (or is one
  /// made without the probe, whose queue is not known): work a host thread waits for should
  /// then not go on it.
  bool Shared(void* stream) const;
  /// Where `stream` runs, for a session's description: "hardware queue 2 of the 7 for
  /// sessions, its own", "hardware queue 2 of the 7 for sessions, shared with 1 more stream",
  /// or that it was made unprobed.
  std::string Where(void* stream) const;
  /// One line for the log: the queues found and how they serve.
  std::string Describe() const;

 private:
  struct Member {
    void* stream = nullptr;
    bool greatest = false;
    bool in_use = false;
    bool used = false;  // handed out at least once
    bool in_setup = false;  // handed out, its session's setup not done (SetupDone)
  };
  struct Lane {
    std::vector<Member> members;  // the queue's streams, in probe order
    int in_use = 0;
    uint64_t given_back = 0;  // order of the last give-back to a free lane (0: never)
    bool retired = false;     // its queue is held by work that never ends (Retire)
    // The first idle member of `greatest` priority, else (`any`) the first idle one.
    Member* Idle(bool greatest, bool any);
    // Whether a member handed out is still in its session's setup.
    bool InSetup() const;
  };
  // Marks `m` handed out, and in its setup when it is a lane's (`in_lane`).
  Member* Hand(Member* m, bool in_lane);
  // The lane and member of `stream`, handed out from a lane, or nulls. Caller holds mu_.
  std::pair<Lane*, Member*> HandedLocked(void* stream);
  std::optional<void*> TakeFreeLocked(StreamRole role);

  mutable std::mutex mu_;
  const bool probed_ = false;
  const bool sharing_ = true;
  const MakeStream make_;
  int32_t queues_ = 0;
  std::vector<Lane> lanes_;  // one per probed queue but the rescue stream's
  Lane made_;                // without a probe, the streams made as needed
  std::vector<void*> surplus_;
  uint64_t order_ = 0;
  uint64_t streams_used_ = 0;
  uint64_t shared_ = 0;
  uint64_t refused_ = 0;
};

}  // namespace ulysses::daemon
