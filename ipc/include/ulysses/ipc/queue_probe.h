// Which streams of a CUDA context share a hardware queue.
//
// A context maps its streams onto a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS asks for
// how many; under MPS a client was measured with 2 whatever it asked, and whether clients of
// one server share queues is what `ulysses-queue-probe --across` asks). A wait enqueued on a
// stream blocks its whole queue: every other stream on that queue stops behind it. The probe finds the classes of streams that share a queue: it holds
// one stream at a wait on a gate word and has every later stream write a word of its own; a
// write that does not land within the settle time, nor within a second one (a held write
// cannot land while the gate is shut; a slow one can), sits behind the held wait. The gate then
// opens and every held write must land.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses::ipc {

/// Streams joined into classes (union-find): streams that share a queue, transitively.
class QueueClasses {
 public:
  explicit QueueClasses(int streams);
  /// Records that streams `a` and `b` share a queue.
  void Join(int a, int b);
  /// The class root of `i` (the lowest index of its class).
  int Root(int i);
  /// The classes, each ascending, in the order of their lowest stream.
  std::vector<std::vector<int>> Classes();
  int size() const { return static_cast<int>(parent_.size()); }

 private:
  std::vector<int> parent_;
};

/// What a probe drives: streams by index, a gate word the host opens, and one word per stream
/// that the stream writes and the host reads. The CUDA implementation enqueues stream memory
/// operations on mapped host memory; tests give a model of queues.
class QueueProbeTarget {
 public:
  virtual ~QueueProbeTarget() = default;
  virtual int streams() const = 0;
  /// Enqueues on stream `i` a wait until the gate word reaches `gate`.
  virtual absl::Status Hold(int i, uint64_t gate) = 0;
  /// Enqueues on stream `j` a write of `mark` into its word.
  virtual absl::Status Write(int j, uint64_t mark) = 0;
  /// Stream `j`'s word as the host sees it now.
  virtual uint64_t Word(int j) const = 0;
  /// Stores `gate` into the gate word from the host.
  virtual void Open(uint64_t gate) = 0;
};

struct QueueProbeOptions {
  /// How long a write on a free queue may take to land before it is looked at again; one
  /// still out a second settle time later counts as held (a round that finds one takes two).
  std::chrono::milliseconds settle{20};
  /// How long a stream's first write, and a held write once the gate opened, may take before
  /// the probe fails: such a stream does not run at all.
  std::chrono::milliseconds give_up{10000};
  /// Hold every stream in turn (every pair is seen: a benchmark's report). Otherwise only the
  /// lowest stream of each class found so far is held, which finds the same classes in as
  /// many rounds as there are queues.
  bool every_stream = false;
};

struct QueueProbeResult {
  std::vector<std::vector<int>> classes;  ///< streams that share a queue, each ascending
  std::vector<int> class_of;              ///< index into classes, per stream
  /// Per stream i that was held: the later streams whose writes it held back.
  std::vector<std::vector<int>> held_back;
  int rounds = 0;  ///< streams held
  /// Writes that missed the settle time but had landed a second settle time later (the gate
  /// still shut): slow, not held.
  int slow_writes = 0;
  double probe_ms = 0;
};

/// Writes just enqueued (stream j's word to reach want[j], for each j in `written`) sorted by a
/// gate that stays shut throughout: a write still out after `settle` is looked at again a
/// second `settle` later; out then, it is held (a held write cannot land while the gate is
/// shut), landed, it was only slow (a busy device, a time slice). `word(j)`: stream j's word as
/// the host sees it now. The probe's rounds and `ulysses-queue-probe --across` use it.
struct SettledWrites {
  std::vector<int> held;  ///< ascending as in `written`
  int slow = 0;
};
SettledWrites SettleWrites(const std::function<uint64_t(int)>& word,
                           const std::vector<int>& written, const std::vector<uint64_t>& want,
                           std::chrono::milliseconds settle);

/// Runs the probe. Every stream first writes its word once (a first operation may start
/// slowly); then the rounds. FAILED_PRECONDITION when a stream's write never lands (its first,
/// or a held one after the gate opened): the streams are then in no known state. The target's
/// words must start below 1 and the gate at 0.
absl::StatusOr<QueueProbeResult> ProbeQueues(QueueProbeTarget& target,
                                             const QueueProbeOptions& options = {});

namespace cuda {
/// The probe on `streams` (cudaStream_t each) of the current device, through stream memory
/// operations on mapped host memory. Each stream's queue must be idle, or the probe takes its
/// earlier work for a held one. FAILED_PRECONDITION without CUDA.
absl::StatusOr<QueueProbeResult> ProbeStreamQueues(std::span<void* const> streams,
                                                   const QueueProbeOptions& options = {});
}  // namespace cuda

}  // namespace ulysses::ipc
