// What the stream-ordered GPU transports (nvlink, nccl) share: the events that tell a call
// finished on the device, the cancel's writes, which let every wait of the session's stream
// and of its client's stream pass, and the drain before the session's memory goes
// (docs/protocol.md sections 9.2 to 9.4). CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"

namespace ulysses::daemon {

/// OK for cudaSuccess, else INTERNAL naming `what` and the error.
inline absl::Status CudaStatus(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

/// One event per slot, recorded after the done write of the slot's latest call: whether the
/// call of an epoch finished on the device, asked without blocking.
class SlotEvents {
 public:
  SlotEvents() = default;
  ~SlotEvents() {
    for (cudaEvent_t ev : events_)
      if (ev != nullptr) cudaEventDestroy(ev);
  }
  SlotEvents(const SlotEvents&) = delete;
  SlotEvents& operator=(const SlotEvents&) = delete;

  /// Makes the events of `num_slots` slots (on the current device).
  absl::Status Create(int num_slots) {
    events_.assign(num_slots, nullptr);
    epochs_.assign(num_slots, 0);
    for (cudaEvent_t& ev : events_)
      ULY_RETURN_IF_ERROR(
          CudaStatus("cudaEventCreate", cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)));
    return absl::OkStatus();
  }
  /// Records `slot`'s event on `stream` for the call of `epoch`.
  absl::Status Record(int slot, uint64_t epoch, cudaStream_t stream) {
    epochs_[slot] = epoch;
    return CudaStatus("cudaEventRecord", cudaEventRecord(events_[slot], stream));
  }
  /// Whether the call recorded as `epoch` in `slot` finished. INTERNAL when none was, or when
  /// the device reports an error.
  absl::StatusOr<bool> Finished(int slot, uint64_t epoch) const {
    if (slot < 0 || slot >= static_cast<int>(events_.size()) || epochs_[slot] != epoch)
      return absl::InternalError(
          StrCat("slot ", slot, " has no call of epoch ", epoch, " enqueued"));
    const cudaError_t q = cudaEventQuery(events_[slot]);
    if (q == cudaErrorNotReady) return false;
    ULY_RETURN_IF_ERROR(CudaStatus("cudaEventQuery", q));
    return true;
  }

 private:
  std::vector<cudaEvent_t> events_;
  std::vector<uint64_t> epochs_;  // the epoch each slot's event was recorded for
};

/// The most words one range of a cancel covers (a rank's slot words, every slot).
inline constexpr size_t kUnblockWordCount = sizeof(DeviceSlotWords) / sizeof(uint64_t) * kMaxSlots;

/// The words a cancel copies over the waited words: kUnblockWordCount of kUnblockEpoch, the
/// device's pinned ones where it has them (made once, never written again), else a copy of
/// this object's own (pageable: the driver may stage the copy by waiting for the stream).
class UnblockWords {
 public:
  explicit UnblockWords(const uint64_t* pinned) : at_(pinned) {
    if (at_ == nullptr) {
      own_.assign(kUnblockWordCount, kUnblockEpoch);
      at_ = own_.data();
    }
  }
  // A copy would point at the original's own words.
  UnblockWords(const UnblockWords&) = delete;
  UnblockWords& operator=(const UnblockWords&) = delete;
  const uint64_t* data() const { return at_; }

 private:
  const uint64_t* at_;
  std::vector<uint64_t> own_;
};

/// `count` consecutive device words a cancel sets to kUnblockEpoch (at most kUnblockWordCount).
struct UnblockRange {
  uint64_t* words;
  size_t count;
};

/// Enqueues a session's cancel on `on`, a stream that none of the session's waits holds back:
/// `*cancel` = 1 first (kernels that pass a wait after it store nothing), then `unblock` copied
/// over every range (every wait on those words passes).
inline absl::Status EnqueueCancel(cudaStream_t on, uint64_t* cancel, const UnblockWords& unblock,
                                  std::initializer_list<UnblockRange> ranges) {
  ULY_RETURN_IF_ERROR(ipc::cuda::StreamWrite64(on, cancel, 1));
  for (const UnblockRange& r : ranges) {
    ULY_RETURN_IF_ERROR(CudaStatus("cudaMemcpyAsync",
                                   cudaMemcpyAsync(r.words, unblock.data(),
                                                   r.count * sizeof(uint64_t),
                                                   cudaMemcpyHostToDevice, on)));
  }
  return absl::OkStatus();
}

/// Ends a stream-ordered session's device work before its mappings go, within `limit`.
///
/// Calls still enqueued on `stream` may wait for a client or peer that will never come:
/// `cancel()` enqueues a cancel on `rescue` (and marks it used), again every millisecond while
/// late peer writes (or the client's, to its own words) re-arm a wait, but never while the last
/// one, marked by `rescue_mark`, has not run (a rescue stream that cannot run would otherwise
/// collect thousands of them until an enqueue waits for room). Once `stream` is idle,
/// `cancel_on(stream)` cancels once more on it, since its last done write may have landed after
/// the last cancel. Then the session's work on the rescue stream (cancels, copies of its words)
/// is waited for when `used_rescue` says there is some. False past `limit`: the caller keeps
/// the session's memory and stream for the process's life.
template <typename Cancel, typename CancelOn>
bool DrainSessionStream(cudaStream_t stream, cudaStream_t rescue, cudaEvent_t rescue_mark,
                        const std::atomic<bool>& used_rescue, absl::Duration limit, Cancel cancel,
                        CancelOn cancel_on) {
  const auto give_up = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(limit);
  auto idle_by_then = [&](auto query, std::chrono::microseconds poll) {
    while (query() == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > give_up) return false;
      std::this_thread::sleep_for(poll);
    }
    return true;  // done, or an error that leaves nothing to wait for
  };
  constexpr std::chrono::microseconds kCancelEvery(1000), kPoll(100);
  bool cancel_marked = false;
  bool drained = idle_by_then([&] {
    if (cudaStreamQuery(stream) != cudaErrorNotReady) return cudaSuccess;
    if (!cancel_marked || cudaEventQuery(rescue_mark) != cudaErrorNotReady) {
      cancel();
      cancel_marked = cudaEventRecord(rescue_mark, rescue) == cudaSuccess;
    }
    return cudaErrorNotReady;
  }, kCancelEvery);
  if (drained) {
    cancel_on(stream);  // idle: after its last write of a done word
    drained = idle_by_then([&] { return cudaStreamQuery(stream); }, kPoll);
  }
  if (drained && used_rescue.load()) {
    drained = cudaEventRecord(rescue_mark, rescue) == cudaSuccess &&
              idle_by_then([&] { return cudaEventQuery(rescue_mark); }, kPoll);
  }
  return drained;
}

}  // namespace ulysses::daemon
