// The GPU backend ("nvlink"): each rank's receive slots are one CUDA VMM allocation on its GPU
// with a POSIX-fd handle. The node's daemons lend each other these fds (FdExports) and map every
// peer's slots, so the exchange kernels store straight into the destination's slot, over NVLink
// between GPUs or within one GPU when several ranks share it. Client tensors come through CUDA
// IPC handles or daemon-allocated VMM buffers. Built only with CUDA.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "call_views.h"
#include "fd_exports.h"
#include "fused_runner.h"
#include "out_write_cuda.h"
#include "queue_lanes.h"
#include "stream_ordered.h"
#include "transport.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/protocol_words.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/queue_probe.h"
#include "ulysses/kernels/exchange_cuda.h"
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/gemm.h"

namespace ulysses::daemon {
namespace {

// CUDA's current device is per thread, and calls arrive on gRPC and ring-worker threads.
absl::Status UseDevice(int device) { return CudaStatus("cudaSetDevice", cudaSetDevice(device)); }

// Slots are 256-byte aligned inside the allocation (16-byte vector stores need 16).
constexpr uint64_t kSlotAlign = 256;

// The streams of this daemon's sessions on its device, by hardware queue (QueueLanes).
//
// A stream maps to one of the context's hardware queues, and a wait on a stream blocks its
// whole queue: a session stream waiting for its peer holds back every other stream of that
// queue (another session's call, a fused plan's second stream, a cancel). So at start the
// daemon makes its streams and probes which share a queue (ulysses/ipc/queue_probe.h), groups
// them by queue (a lane per queue), uses none on the rescue stream's queue, and hands each lane
// to one user at a time while one is free (queues.probe_streams, queues.sharing).
//
// A queue that has run work stays counted after its stream is destroyed, and each such queue
// beyond the first can double how long a blocked stream of the context takes to resume once
// its word is written (2.0 against 3.9 us a hand-off, docs/benchmarks.md, "what slows a
// context's hand-offs"). So a closed session's lane, drained, serves the next session: sessions
// opened in turn do not spread the daemon's work over ever more queues.
//
// The rescue stream writes and copies words and never waits, so one serves every session, and
// with the probe no session stream shares its queue: a cancel always runs (without the probe,
// nothing keeps a session stream off its queue). It runs work for a session whose stream is
// blocked (a failed call, a timeout, a close with calls in flight, DescribeStuck), and, with
// the probe, zeroes new buffers and runs cuBLASLt's warm-up at start.
//
// The device's pinned host memory that DescribeStuck's copies land in is here too, made once:
// freeing pinned memory can wait for the whole device, so a session's close frees none.
class DeviceStreams {
 public:
  // The most a DescribeStuck reads at once: every rank's slot words and done word, then at most
  // four more (the client's ready and released, the cancel word, and nccl's done word).
  static constexpr size_t kHostWordsBytes =
      kMaxWorldSize * (sizeof(DeviceSlotWords) + sizeof(uint64_t)) + 4 * sizeof(uint64_t);

  // `probe_streams` default-priority streams (and a quarter as many, at least one, at the
  // greatest priority) are probed; 0: none, streams are made as sessions come. A probe that
  // fails leaves the daemon serving without lanes, as with none.
  static absl::StatusOr<std::shared_ptr<DeviceStreams>> Create(int device, int probe_streams,
                                                               bool sharing) {
    ULY_RETURN_IF_ERROR(UseDevice(device));
    std::shared_ptr<DeviceStreams> d(new DeviceStreams(device));
    ULY_RETURN_IF_ERROR(CudaStatus("cudaDeviceGetStreamPriorityRange",
                                   cudaDeviceGetStreamPriorityRange(&d->least_, &d->greatest_)));
    ULY_ASSIGN_OR_RETURN(d->rescue_, d->MakeStream(false));
    // Without it the daemon works; stuck calls' words then go unread.
    if (cudaHostAlloc(&d->host_words_, kHostWordsBytes, cudaHostAllocDefault) != cudaSuccess) {
      d->host_words_ = nullptr;
      (void)cudaGetLastError();
    }
    // Without it a cancel copies from pageable memory, which the driver may stage by waiting
    // for the stream.
    if (cudaHostAlloc(&d->unblock_words_, kUnblockWordCount * sizeof(uint64_t),
                      cudaHostAllocDefault) == cudaSuccess) {
      std::fill_n(static_cast<uint64_t*>(d->unblock_words_), kUnblockWordCount, kUnblockEpoch);
    } else {
      d->unblock_words_ = nullptr;
      (void)cudaGetLastError();
    }
    auto make = [device, raw = d.get()](bool greatest) -> absl::StatusOr<void*> {
      ULY_RETURN_IF_ERROR(UseDevice(device));
      ULY_ASSIGN_OR_RETURN(cudaStream_t s, raw->MakeStream(greatest));
      return static_cast<void*>(s);
    };
    if (probe_streams > 0) {
      absl::Status probed = d->ProbeLanes(probe_streams, sharing, make);
      if (!probed.ok())
        Logger("main")->warn(
            "device {}: hardware queue probe failed ({}); session streams are made as sessions "
            "come and may share a queue with another session's, and the rescue stream was "
            "replaced by one not probed",
            device, std::string(probed.message()));
    }
    if (!d->lanes_) d->lanes_ = std::make_unique<QueueLanes>(make);
    Logger("main")->info("device {}: {}", device, d->lanes_->Describe());
    return d;
  }
  ~DeviceStreams() {
    (void)UseDevice(device_);
    if (lanes_)
      for (void* s : lanes_->AllStreams()) cudaStreamDestroy(static_cast<cudaStream_t>(s));
    if (rescue_ != nullptr) {
      cudaStreamSynchronize(rescue_);
      cudaStreamDestroy(rescue_);
    }
    if (host_words_ != nullptr) cudaFreeHost(host_words_);
    if (unblock_words_ != nullptr) cudaFreeHost(unblock_words_);
  }
  DeviceStreams(const DeviceStreams&) = delete;
  DeviceStreams& operator=(const DeviceStreams&) = delete;

  /// A stream for `role`: a free lane (the one given back last), else past the lanes as
  /// queues.sharing says.
  absl::StatusOr<cudaStream_t> Take(StreamRole role = StreamRole::kSession,
                                    cudaStream_t apart = nullptr) {
    ULY_ASSIGN_OR_RETURN(void* s, lanes_->Take(role, apart));
    return static_cast<cudaStream_t>(s);
  }
  /// Gives back a stream that has no work left.
  void Give(cudaStream_t s) { lanes_->Give(s); }
  /// The session `s` serves finished its setup on it (QueueLanes::SetupDone).
  void SetupDone(cudaStream_t s) { lanes_->SetupDone(s); }
  /// A stream whose work never ended: its queue serves no session again (QueueLanes::Retire).
  void Retire(cudaStream_t s) {
    if (lanes_->Retire(s))
      Logger("exec")->warn("device {}: {} is held by work that did not end; it serves no "
                           "session from now on",
                           device_, lanes_->Where(s));
  }
  /// A new zero-filled VMM allocation, zeroed and waited for on a setup stream (OnSetupStream).
  absl::StatusOr<ipc::cuda::VmmMapping> ZeroedMapping(uint64_t bytes) {
    return OnSetupStream(
        [&](cudaStream_t s) { return ipc::cuda::VmmMapping::Create(device_, bytes, s); });
  }
  /// `work(stream)`, which waits for what it enqueues, on a stream that no session's wait holds
  /// back, never the legacy stream: with the probe, the rescue stream (whose queue the probe
  /// ran work on anyway, and which a lane taken for it would keep from a session being made at
  /// the same time); without, an idle stream of the pool (one made when none is, which then
  /// serves the next session), so that no other queue runs work.
  template <typename Work>
  auto OnSetupStream(Work work) -> decltype(work(cudaStream_t{})) {
    if (lanes_->probed()) return work(rescue_);
    ULY_ASSIGN_OR_RETURN(cudaStream_t on, Take());
    auto done = work(on);
    Give(on);
    return done;
  }
  cudaStream_t rescue() const { return rescue_; }
  /// Where a new session on `session` does the setup work its thread waits for (zeroing its
  /// allocations, loading its kernels): `session` itself, idle when taken, unless the probe
  /// found it on a queue another session's stream uses (queues.sharing allow, past the free
  /// lanes), where that wait could sit behind the other session's waiting call; then the
  /// rescue stream, which no session's wait holds back.
  cudaStream_t SetupStreamFor(cudaStream_t session) const {
    return lanes_->probed() && lanes_->Shared(session) ? rescue_ : session;
  }
  /// Backend::ReadDeviceWords: `reads` copied on the rescue stream into the pinned words (at
  /// most kHostWordsBytes in all), then each to its destination.
  absl::Status ReadWords(std::span<const DeviceRead> reads) {
    std::lock_guard<std::mutex> lock(host_mu_);
    if (host_words_ == nullptr)
      return absl::FailedPreconditionError("no pinned host memory to read them into");
    size_t total = 0;
    for (const DeviceRead& r : reads) total += r.bytes;
    if (total > kHostWordsBytes)
      return absl::InvalidArgumentError(
          StrCat("reads: ", total, " bytes, more than the ", kHostWordsBytes, " read at once"));
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    auto* host = static_cast<uint8_t*>(host_words_);
    size_t at = 0;
    for (const DeviceRead& r : reads) {
      ULY_RETURN_IF_ERROR(CudaStatus("cudaMemcpyAsync",
                                     cudaMemcpyAsync(host + at, r.from, r.bytes,
                                                     cudaMemcpyDeviceToHost, rescue_)));
      at += r.bytes;
    }
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    cudaError_t err;
    while ((err = cudaStreamQuery(rescue_)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > give_up)
        return absl::DeadlineExceededError("the rescue stream's copies did not run within 1 s");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    ULY_RETURN_IF_ERROR(CudaStatus("cudaStreamQuery", err));
    at = 0;
    for (const DeviceRead& r : reads) {
      std::memcpy(r.to, host + at, r.bytes);
      at += r.bytes;
    }
    return absl::OkStatus();
  }
  /// Words a cancel copies over a session's slot and client words: kUnblockWordCount of
  /// kUnblockEpoch in pinned memory, made once and never written again (null when there is
  /// none).
  const uint64_t* unblock_words() const { return static_cast<const uint64_t*>(unblock_words_); }
  QueueLaneCounts counts() const { return lanes_->counts(); }
  std::string Where(cudaStream_t s) const { return lanes_->Where(s); }

 private:
  explicit DeviceStreams(int device) : device_(device) {}

  absl::StatusOr<cudaStream_t> MakeStream(bool greatest) {
    cudaStream_t s = nullptr;
    ULY_RETURN_IF_ERROR(CudaStatus("cudaStreamCreate",
                                   cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking,
                                                                greatest ? greatest_ : least_)));
    return s;
  }

  // The rescue stream first, then the candidates: lanes from the probe's classes, the streams
  // on the rescue stream's queue destroyed.
  absl::Status ProbeLanes(int probe_streams, bool sharing, const QueueLanes::MakeStream& make) {
    const int high = std::max(1, probe_streams / 4);
    std::vector<void*> streams{rescue_};
    std::vector<ProbedStream> probed;
    absl::Status made;
    for (int i = 0; i < probe_streams + high; ++i) {
      const bool greatest = i >= probe_streams;
      absl::StatusOr<cudaStream_t> s = MakeStream(greatest);
      made = s.status();
      if (!s.ok()) break;
      streams.push_back(*s);
      probed.push_back(ProbedStream{*s, greatest, 0});
    }
    // Destroying a stream with work left is safe: its resources go once the work is done.
    auto give_up = [&](absl::Status why) {
      for (const ProbedStream& p : probed) cudaStreamDestroy(static_cast<cudaStream_t>(p.stream));
      return why;
    };
    if (!made.ok()) return give_up(std::move(made));
    absl::StatusOr<ipc::QueueProbeResult> result = ipc::cuda::ProbeStreamQueues(streams);
    if (!result.ok()) {
      // The probe ran on the rescue stream too, which may now be the stream that never goes
      // on: a new one serves the cancels (not probed: it may land on that same queue, which
      // the warning below leaves to the operator).
      absl::StatusOr<cudaStream_t> fresh = MakeStream(false);
      if (fresh.ok()) {
        cudaStreamDestroy(rescue_);
        rescue_ = *fresh;
      }
      return give_up(result.status());
    }
    for (size_t i = 0; i < probed.size(); ++i) probed[i].queue = result->class_of[i + 1];
    auto lanes = std::make_unique<QueueLanes>(probed, result->class_of[0], sharing, make);
    if (lanes->counts().lanes == 0)
      return give_up(absl::FailedPreconditionError(
          StrCat("all ", probed.size() + 1, " streams share the rescue stream's one queue")));
    lanes_ = std::move(lanes);
    for (void* s : lanes_->surplus()) cudaStreamDestroy(static_cast<cudaStream_t>(s));
    Logger("main")->debug("device {}: queue probe of {} streams took {:.1f} ms", device_,
                          streams.size(), result->probe_ms);
    return absl::OkStatus();
  }

  const int device_;
  int least_ = 0, greatest_ = 0;  // stream priorities
  cudaStream_t rescue_ = nullptr;
  std::mutex host_mu_;  // one DescribeStuck at a time
  void* host_words_ = nullptr;
  void* unblock_words_ = nullptr;  // pinned kUnblockWordCount of kUnblockEpoch, never written again
  std::unique_ptr<QueueLanes> lanes_;
};

class CudaTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<Transport>> Create(int device, FdExports* exports,
                                                           std::shared_ptr<DeviceStreams> streams,
                                                           absl::Duration drain_limit,
                                                           const TransportSetup& setup) {
    ULY_RETURN_IF_ERROR(UseDevice(device));
    std::unique_ptr<CudaTransport> t(
        new CudaTransport(device, exports, std::move(streams), drain_limit, setup));
    t->stride_ = AlignUp(setup.slot_bytes, kSlotAlign);
    // The client's done words first (ResultWords), then the slots: one allocation, lent to
    // the peers (they store into the slots) and mapped by the client. The words only daemons
    // use (DeviceWords) are an allocation of their own, lent to the peers alone.
    t->words_bytes_ = AlignUp(sizeof(ResultWords), kSlotAlign);
    // The session's stream (idle: fresh, or drained when given back) zeroes its allocations,
    // so the daemon's context runs work on no queue but its sessions' own: work on another
    // queue slows this context's hand-offs (DeviceStreams), and a wait on the legacy stream
    // could wait behind another session's stream that shares its queue. (A session stream
    // that itself shares a queue with another session's hands this to the rescue stream:
    // SetupStreamFor.)
    ULY_ASSIGN_OR_RETURN(t->stream_, t->streams_->Take());
    t->rescue_ = t->streams_->rescue();
    const cudaStream_t setup_stream = t->streams_->SetupStreamFor(t->stream_);
    ULY_ASSIGN_OR_RETURN(t->slots_,
                         ipc::cuda::VmmMapping::Create(
                             device, t->words_bytes_ + t->stride_ * setup.geometry.num_slots,
                             setup_stream));
    ULY_ASSIGN_OR_RETURN(t->client_fd_, t->slots_.Export());
    ULY_ASSIGN_OR_RETURN(t->ticket_, exports->Lend(t->client_fd_.get()));
    ULY_ASSIGN_OR_RETURN(t->daemon_words_,
                         ipc::cuda::VmmMapping::Create(device, sizeof(DeviceWords), setup_stream));
    {
      ULY_ASSIGN_OR_RETURN(ipc::UniqueFd fd, t->daemon_words_.Export());
      // FdExports keeps its own duplicate of a lent fd.
      ULY_ASSIGN_OR_RETURN(t->words_ticket_, exports->Lend(fd.get()));
    }
    ULY_ASSIGN_OR_RETURN(t->client_words_,
                         ipc::cuda::VmmMapping::Create(device, sizeof(ClientDeviceWords),
                                                       setup_stream));
    ULY_ASSIGN_OR_RETURN(t->client_words_fd_, t->client_words_.Export());
    ULY_RETURN_IF_ERROR(t->events_.Create(setup.geometry.num_slots));
    ULY_RETURN_IF_ERROR(CudaStatus(
        "cudaEventCreate", cudaEventCreateWithFlags(&t->rescue_mark_, cudaEventDisableTiming)));
    // Every word starts at 0 (no epoch reached) before any peer or client can see it:
    // VmmMapping::Create zero-fills each allocation on the session's stream and waits for that.
    if (setup.fused) {
      // Everything a fused call needs is made here (GEMM workspace, projection buffer, events);
      // a call at a row count seen before allocates nothing. Only the chunked path, which a
      // session must ask for (auto never takes it), runs work on a second stream, a lane of
      // its own so that no other session's waiting call holds back its stores; the other
      // paths run on the session's stream alone, and such a session takes no second hardware
      // queue (each queue of this context that runs work slows its hand-offs, and lanes are
      // few).
      // Without a second lane the plan's second stream is the session's own (it makes none of
      // its own: a stream outside the lanes could land on any queue). The plan allocates and
      // waits on its second stream, or on the session's setup stream without a lane; on the
      // rescue stream where that stream shares a queue with another session's, as above.
      // What it frees at its end goes on the same stream.
      cudaStream_t plan_second = t->stream_, plan_setup = setup_stream;
      if (FusedRunner::RunsChunked(setup.fused->path, FusedExchange::kPlanStores)) {
        ULY_ASSIGN_OR_RETURN(t->second_, t->streams_->Take(StreamRole::kSecond, t->stream_));
        plan_second = t->second_;
        plan_setup = t->streams_->SetupStreamFor(t->second_);
      }
      ULY_ASSIGN_OR_RETURN(t->fused_, FusedRunner::Create(*setup.fused, FusedExchange::kPlanStores,
                                                          plan_second, plan_setup));
      // Its GEMMs' kernels are loaded here, while no call of this session is in flight, and
      // waited for (this stream alone): the session opens with its kernels loaded and run, so
      // nothing of the load is left to meet another session's wait later. On failure, what
      // was launched ends before the plan's memory goes.
      const absl::Status loaded = t->fused_->LoadKernels(setup_stream);
      const cudaError_t synced = cudaStreamSynchronize(setup_stream);
      ULY_RETURN_IF_ERROR(loaded);
      ULY_RETURN_IF_ERROR(CudaStatus("cudaStreamSynchronize", synced));
      if (t->second_ != nullptr) t->streams_->SetupDone(t->second_);
    }
    // From here a session past the free lanes may share these streams' queues.
    t->streams_->SetupDone(t->stream_);
    return std::unique_ptr<Transport>(std::move(t));
  }

  // Session drains every transport it made and keeps for the process's life one whose Drain
  // failed; one never drained comes from a failed Create, whose work on its stream (the zeroing
  // of its allocations, a fused plan's kernel loads) was waited for there. So nothing of this
  // session runs on the device any more, and nothing here waits.
  ~CudaTransport() override {
    // A failed Create lent its allocations before it failed: no peer fetches them any more.
    for (ExportTicket* t : {&ticket_, &words_ticket_})
      if (t->id != 0) exports_->Withdraw(std::exchange(t->id, 0));
    (void)UseDevice(device_);
    // The plan's work was ordered before this stream's end, which Drain saw; what it frees
    // goes on the stream it was set up on: its second stream (which then serves another
    // session), the session's stream (given back below, after it), or the rescue stream.
    fused_.reset();
    if (second_ != nullptr) streams_->Give(second_);
    if (stream_ != nullptr) streams_->Give(stream_);
    if (rescue_mark_ != nullptr) cudaEventDestroy(rescue_mark_);
  }

  // Cancels even when the stream is idle: a client stream may wait for the done word of a call
  // this daemon never enqueued (its descriptor still in the ring at the close), and only the
  // cancel's words end that wait. An idle stream takes that cancel itself (its writes wait
  // for nothing): the rescue stream, another hardware queue, then runs no work when sessions
  // close in order, and work on a second queue is what slows this context's hand-offs
  // (DeviceStreams). Calls still enqueued may wait for a client or peer that will never come:
  // cancel on the rescue stream, again while late peer writes (or the client's, to its own
  // words) re-arm a wait, until the stream is idle, then once more on the idle stream itself,
  // since its last done write may have landed after the last cancel. The mappings may go only
  // once that cancel, and this session's work on the rescue stream (cancels, DescribeStuck's
  // copies), have run: both are waited for, within the same drain limit; past it, give up
  // (false).
  bool Drain() override {
    for (ExportTicket* t : {&ticket_, &words_ticket_})
      if (t->id != 0) exports_->Withdraw(std::exchange(t->id, 0));
    if (stream_ == nullptr) return true;
    // Its work cannot be asked about: keep everything rather than free it under that work.
    if (!UseDevice(device_).ok()) return false;
    const bool drained = DrainSessionStream(stream_, rescue_, rescue_mark_, used_rescue_,
                                            drain_limit_, [this] { Cancel(); },
                                            [this](cudaStream_t on) { CancelOn(on); });
    if (!drained) {
      Logger("exec")->error(
          "device {}: a session's device work did not end within {} of its cancel; its stream "
          "and device memory ({} bytes) stay in place for the daemon's life, not reused",
          device_, absl::FormatDuration(drain_limit_), DeviceBytes());
      // Its streams are never given back; their queues, which that work may hold, serve no
      // later session either.
      streams_->Retire(stream_);
      if (second_ != nullptr) streams_->Retire(second_);
    }
    return drained;
  }

  // cuda|device|slot allocation bytes|words bytes|slots id|slots secret|words id|words secret|
  // socket (the socket path may hold '|', so it comes last).
  std::string LocalHandle() const override {
    return StrCat("cuda|", device_, "|", slots_.size(), "|", daemon_words_.size(), "|", ticket_.id,
                  "|", ticket_.secret, "|", words_ticket_.id, "|", words_ticket_.secret, "|",
                  ticket_.socket);
  }

  absl::Status CheckPeers(const std::vector<std::string>& handles) override {
    return CheckPeersRunThisBackend(
        handles, setup_.geometry.rank,
        [](int, const std::string& h) { return h.rfind("cuda|", 0) == 0; });
  }

  absl::Status Connect(const std::vector<std::string>& handles, const std::vector<std::string>&,
                       const std::vector<uint8_t*>&, absl::Duration timeout) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    const int W = setup_.geometry.world_size;
    peers_.resize(W);
    peer_words_.resize(W);
    slot_base_.assign(W, nullptr);
    slot_base_[setup_.geometry.rank] = static_cast<uint8_t*>(slots_.data());
    words_.assign(W, nullptr);
    words_[setup_.geometry.rank] = static_cast<DeviceWords*>(daemon_words_.data());
    for (int r = 0; r < W; ++r) {
      if (r == setup_.geometry.rank) continue;
      std::vector<std::string> f = absl::StrSplit(handles[r], absl::MaxSplits('|', 8));
      uint64_t bytes = 0, words_bytes = 0, id = 0, words_id = 0;
      int device = -1;
      if (f.size() != 9 || f[0] != "cuda" || !absl::SimpleAtoi(f[1], &device) ||
          !absl::SimpleAtoi(f[2], &bytes) || !absl::SimpleAtoi(f[3], &words_bytes) ||
          !absl::SimpleAtoi(f[4], &id) || !absl::SimpleAtoi(f[6], &words_id) ||
          bytes != slots_.size() || words_bytes != daemon_words_.size())
        return absl::FailedPreconditionError(
            StrCat("rank ", r, " sent a slot handle this backend cannot use ('",
                   handles[r].substr(0, 64), "')"));
      ULY_ASSIGN_OR_RETURN(ipc::UniqueFd fd,
                           FdExports::Fetch(ExportTicket{f[8], id, f[5]}, timeout));
      ULY_ASSIGN_OR_RETURN(peers_[r],
                           ipc::cuda::VmmMapping::Import(device_, fd.get(), bytes, true));
      ULY_ASSIGN_OR_RETURN(ipc::UniqueFd words_fd,
                           FdExports::Fetch(ExportTicket{f[8], words_id, f[7]}, timeout));
      ULY_ASSIGN_OR_RETURN(peer_words_[r], ipc::cuda::VmmMapping::Import(device_, words_fd.get(),
                                                                         words_bytes, true));
      slot_base_[r] = static_cast<uint8_t*>(peers_[r].data());
      words_[r] = static_cast<DeviceWords*>(peer_words_[r].data());
    }
    return absl::OkStatus();
  }

  absl::Status Push(const CallPlan& plan, const CallOperands& ops, int dst, int slot) override {
    void* outs[kMaxWorldSize] = {};
    outs[dst] = slot_base_[dst] + SlotOffset(slot);
    return LaunchBlocksTo(plan, ops, outs);
  }

  // This rank's blocks of the call into the destinations' slots `outs` (null: none), one launch.
  absl::Status LaunchBlocksTo(const CallPlan& plan, const CallOperands& ops, void* const* outs) {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    ULY_ASSIGN_OR_RETURN(const kernels::BlockOperands bops, BlockOperandsOf(plan, ops));
    return kernels::LaunchBlocks(ShapeOf(setup_.geometry, plan), bops, setup_.geometry.rank, outs,
                                 stream_, cancel());
  }

  bool PushesAtOnce(const CallPlan& plan) const override {
    return Traits(plan.op).fused;
  }

  // The fused call: the plan's GEMM, norm + RoPE and stores write this rank's band of every
  // destination straight into that destination's mapped slot, on this session's stream.
  // Readiness is the stream protocol's (Enqueue's arrival words), so no per-launch words.
  absl::Status PushAll(const CallPlan& plan, const CallOperands& ops, int slot,
                       uint64_t epoch) override {
    if (!Traits(plan.op).fused || !fused_)
      return absl::InvalidArgumentError(StrCat("op: ", OpName(plan.op), " is pushed per destination"));
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    const int64_t rows = plan.batch * plan.seq_local;
    ULY_ASSIGN_OR_RETURN(const FusedPath path, fused_->PreparedPath(rows));
    kernels::FusedQkvPlan& fused = fused_->plan();
    void* outs[kMaxWorldSize] = {};
    for (int r = 0; r < setup_.geometry.world_size; ++r) outs[r] = slot_base_[r] + SlotOffset(slot);
    const kernels::QkvDestinations dests{outs, nullptr, epoch, cancel()};
    const auto* positions = static_cast<const int32_t*>(ops.inputs[1]);
    if (path == FusedPath::kChunked)
      return fused.RunChunked(ops.inputs[0], positions, plan.batch, plan.seq_local, dests,
                                     stream_);
    if (path == FusedPath::kEpilogue)
      return fused.RunEpilogue(ops.inputs[0], positions, plan.batch, plan.seq_local, dests,
                                      stream_);
    return fused.RunPerOperator(ops.inputs[0], positions, plan.batch, plan.seq_local, dests,
                                stream_);
  }

  absl::Status Flush() override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    return CudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }

  absl::Status Finish(const CallPlan& plan, const CallOperands& ops, int slot) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    ULY_RETURN_IF_ERROR(EnqueueFinish(plan, ops, slot));
    return Flush();
  }

  bool StreamOrdered() const override { return true; }

  // The whole call on the session's stream (docs/protocol.md section 9): wait for the client's
  // inputs, grant this rank's slot to every source, store each block once its destination
  // granted, announce the blocks, wait for every source's, finish, publish done.
  absl::Status Enqueue(const CallPlan& plan, const CallOperands& ops,
                       const StreamCall& call) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    const int W = setup_.geometry.world_size;
    const int me = setup_.geometry.rank;
    const int s = call.slot;
    const uint64_t e = call.epoch;
    DeviceSlotWords& mine = words_[me]->slots[s];
    // The words go on the stream in batches, one driver call each between the launches.
    ipc::cuda::StreamOps memops(stream_);
    if (call.wait_ready) ULY_RETURN_IF_ERROR(memops.Wait(&ClientWords()->ready[s], e));
    // Ordered after this slot's previous result was read: its Finish is earlier on this stream,
    // and the client's stream gave the result back (or its host did, before this call came).
    // This rank's own grant and arrival are this stream's order itself: no word.
    if (call.wait_released != 0)
      ULY_RETURN_IF_ERROR(memops.Wait(&ClientWords()->released[s], call.wait_released));
    for (int r = 0; r < W; ++r)
      if (r != me) ULY_RETURN_IF_ERROR(memops.Write(&words_[r]->slots[s].grant[me], e));
    // One launch stores every block (the fused path: its GEMM, norm + RoPE and stores), once
    // every destination granted its slot: a launch and a flush per destination cost more host
    // time than the grants' skew costs the stream.
    void* outs[kMaxWorldSize] = {};
    for (int r = 0; r < W; ++r) {
      if (r != me) ULY_RETURN_IF_ERROR(memops.Wait(&mine.grant[r], e));
      outs[r] = slot_base_[r] + SlotOffset(s);
    }
    ULY_RETURN_IF_ERROR(memops.Flush());
    ULY_RETURN_IF_ERROR(PushesAtOnce(plan) ? PushAll(plan, ops, s, e)
                                           : LaunchBlocksTo(plan, ops, outs));
    // Each write's memory barrier makes this stream's stores visible before the word.
    for (int r = 0; r < W; ++r)
      if (r != me) ULY_RETURN_IF_ERROR(memops.Write(&words_[r]->slots[s].arrive[me], e));
    for (int r = 0; r < W; ++r)
      if (r != me) ULY_RETURN_IF_ERROR(memops.Wait(&mine.arrive[r], e));
    ULY_RETURN_IF_ERROR(memops.Flush());
    ULY_RETURN_IF_ERROR(EnqueueFinish(plan, ops, s));
    ULY_RETURN_IF_ERROR(memops.Write(&Results(me)->done[s], e));
    ULY_RETURN_IF_ERROR(memops.Flush());
    return events_.Record(s, e, stream_);
  }

  absl::StatusOr<bool> Completed(int slot, uint64_t epoch) override {
    return events_.Finished(slot, epoch);
  }

  void Cancel() override {
    used_rescue_ = true;
    CancelOn(rescue_);
  }

  // Every rank's words of the slot as the device holds them, read through the rescue stream.
  std::string DescribeStuck(int slot, uint64_t epoch) override {
    const int W = setup_.geometry.world_size;
    // Only a connected transport has calls in flight (every rank's words mapped).
    if (slot < 0 || slot >= setup_.geometry.num_slots || words_.size() != static_cast<size_t>(W))
      return {};
    const int me = setup_.geometry.rank;
    used_rescue_ = true;
    // Every rank's slot words and done word of the slot, the client's two and the cancel
    // word. (Made only for a call that did not finish: the call path's count of allocations is
    // about calls that do.)
    std::vector<DeviceSlotWords> slots(W);
    std::vector<uint64_t> done(W);
    uint64_t client[3] = {};
    std::vector<DeviceRead> reads;
    for (int r = 0; r < W; ++r) {
      reads.push_back({&words_[r]->slots[slot], &slots[r], sizeof(DeviceSlotWords)});
      reads.push_back({&Results(r)->done[slot], &done[r], sizeof(uint64_t)});
    }
    reads.push_back({&ClientWords()->ready[slot], &client[0], sizeof(uint64_t)});
    reads.push_back({&ClientWords()->released[slot], &client[1], sizeof(uint64_t)});
    reads.push_back({cancel(), &client[2], sizeof(uint64_t)});
    if (absl::Status st = streams_->ReadWords(reads); !st.ok())
      return StrCat("unreadable (", st.message(), ")");
    SlotWordsReport report{me, slot, epoch, client[0], client[1], client[2], done[me], {}};
    for (int r = 0; r < W; ++r)
      if (r != me)
        report.peers.push_back({r, slots[me].grant[r], slots[me].arrive[r], slots[r].grant[me],
                                slots[r].arrive[me], done[r]});
    // A stream on a shared queue may wait behind another session's call, not for a word.
    return StrCat(FormatSlotWords(report), "; its stream on ", streams_->Where(stream_));
  }

  absl::Status Poison(int slot) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    ULY_RETURN_IF_ERROR(CudaStatus(
        "cudaMemsetAsync",
        cudaMemsetAsync(static_cast<uint8_t*>(slots_.data()) + SlotOffset(slot), 0xff,
                        setup_.slot_bytes, stream_)));
    // Stream-ordered like the calls: after the calls enqueued before, before any later one.
    // Not waited for: a call before it may wait for its client or a peer (docs/protocol.md).
    return absl::OkStatus();
  }

  uint64_t SlotOffset(int slot) const override {
    return words_bytes_ + stride_ * static_cast<uint64_t>(slot);
  }
  ClientSlotMapping ClientMapping() const override {
    return ClientSlotMapping{client_fd_.get(), slots_.size(), true, client_words_fd_.get(),
                             client_words_.size()};
  }
  uint64_t DeviceBytes() const override {
    return slots_.size() + daemon_words_.size() + client_words_.size() +
           (fused_ ? fused_->plan().device_bytes() : 0);
  }
  std::string Describe() const override {
    const std::string stream = StrCat("stream on ", streams_->Where(stream_));
    if (!fused_)
      return StrCat("nvlink: CUDA exchange kernels storing into every destination's slot, one "
                    "launch per call; ", stream);
    const std::string no_epilogue = fused_->plan().EpilogueUnavailable();
    return StrCat("nvlink: FusedQkvPlan on device ", device_,
                  " (bf16 projection GEMM, norm_rope kernels; epilogue GEMM: ",
                  no_epilogue.empty() ? "CUTLASS sm_90a" : no_epilogue, "), ",
                  QkvLayoutName(setup_.fused->geometry.layout),
                  " layout, stores straight into the W destinations' slots; ", stream,
                  second_ != nullptr ? StrCat(", second stream on ", streams_->Where(second_))
                                     : std::string(", no second stream (path not chunked)"),
                  "; ", fused_->Describe());
  }

 private:
  // Cancel()'s writes, enqueued on `on`: a stream no wait of this session blocks.
  void CancelOn(cudaStream_t on) {
    if (UseDevice(device_).ok() == false) return;
    auto* mine = static_cast<DeviceWords*>(daemon_words_.data());
    // `on` is never blocked (the rescue stream, or this session's stream when idle), so this
    // completes.
    const size_t n = static_cast<size_t>(setup_.geometry.num_slots);
    const absl::Status st = EnqueueCancel(
        on, &mine->cancel, unblock_,
        {{&mine->slots[0].grant[0], n * sizeof(DeviceSlotWords) / sizeof(uint64_t)},
         {ClientWords()->ready, n},
         {ClientWords()->released, n},
         {Results(setup_.geometry.rank)->done, n}});
    if (!st.ok())
      Logger("exec")->error("device {}: cancel of a session stream: {}", device_,
                            std::string(st.message()));
  }

  CudaTransport(int device, FdExports* exports, std::shared_ptr<DeviceStreams> streams,
                absl::Duration drain_limit, const TransportSetup& setup)
      : device_(device),
        exports_(exports),
        streams_(std::move(streams)),
        setup_(setup),
        drain_limit_(drain_limit),
        unblock_(streams_->unblock_words()) {}

  const uint64_t* cancel() const {
    return &static_cast<const DeviceWords*>(daemon_words_.data())->cancel;
  }
  // Rank r's done words, at the start of its slot allocation as mapped here (connected
  // transports only, except this rank's).
  ResultWords* Results(int r) const {
    return reinterpret_cast<ResultWords*>(r == setup_.geometry.rank ? slots_.data()
                                                                     : slot_base_[r]);
  }
  ClientDeviceWords* ClientWords() const {
    return static_cast<ClientDeviceWords*>(client_words_.data());
  }

  // The local end of a call on the stream, not waited for: the out= copy or the merge.
  absl::Status EnqueueFinish(const CallPlan& plan, const CallOperands& ops, int slot) {
    const uint8_t* data = slot_base_[setup_.geometry.rank] + SlotOffset(slot);
    return EnqueueOutWrite(setup_.geometry, plan, ops, data, stream_, cancel()).status();
  }

  const int device_;
  FdExports* const exports_;
  const std::shared_ptr<DeviceStreams> streams_;  // stream_ comes from and goes back there
  const TransportSetup setup_;
  const absl::Duration drain_limit_;  // Drain's bound (CudaBackendOptions)
  uint64_t stride_ = 0;
  uint64_t words_bytes_ = 0;               // ResultWords, before the slots
  ipc::cuda::VmmMapping slots_;            // this rank's done words and slots
  ipc::UniqueFd client_fd_;                // its exported handle (client and peers map it)
  ExportTicket ticket_;
  ipc::cuda::VmmMapping daemon_words_;     // this rank's DeviceWords: peer daemons map it
  ExportTicket words_ticket_;
  std::vector<ipc::cuda::VmmMapping> peers_;       // index = rank; this rank's entry is empty
  std::vector<ipc::cuda::VmmMapping> peer_words_;  // likewise, each peer's DeviceWords
  std::vector<uint8_t*> slot_base_;                // every rank's slots as mapped here
  std::vector<DeviceWords*> words_;                // every rank's DeviceWords as mapped here
  ipc::cuda::VmmMapping client_words_;         // ClientDeviceWords, written by the client
  ipc::UniqueFd client_words_fd_;
  cudaStream_t stream_ = nullptr;  // this session's alone while it is open
  cudaStream_t rescue_ = nullptr;  // the device's, shared: Cancel's writes, never waits
  SlotEvents events_;                    // per slot: recorded after the call's done write
  const UnblockWords unblock_;          // what a cancel copies over the waited words
  std::unique_ptr<FusedRunner> fused_;  // fused sessions only
  cudaStream_t second_ = nullptr;       // its plan's second stream, a lane of the device
  std::atomic<bool> used_rescue_{false};  // Cancel or DescribeStuck enqueued on rescue_
  cudaEvent_t rescue_mark_ = nullptr;     // Drain's mark after this session's rescue work
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, FdExports* exports, ipc::cuda::DeviceInfo info,
              std::shared_ptr<DeviceStreams> streams, absl::Duration drain_limit)
      : device_(device),
        exports_(exports),
        info_(std::move(info)),
        streams_(std::move(streams)),
        drain_limit_(drain_limit) {}

  std::string_view name() const override { return "nvlink"; }
  bool slots_in_segment() const override { return false; }

  absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransportSetup& setup) override {
    if (info_.mps && setup.fused &&
        FusedRunner::RunsChunked(setup.fused->path, FusedExchange::kPlanStores))
      Logger("exec")->warn(
          "device {}: a fused session asks for the chunked path, whose calls were seen to wait "
          "on the GPU for another session's call blocked on its peer under MPS (up to the call "
          "timeout); path auto never takes it (docs/architecture.md, section 6.2)",
          device_);
    return CudaTransport::Create(device_, exports_, streams_, drain_limit_, setup);
  }
  QueueLaneCounts Queues() const override { return streams_->counts(); }
  absl::StatusOr<void*> TakeStream(StreamRole role, void* apart) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    ULY_ASSIGN_OR_RETURN(cudaStream_t s, streams_->Take(role, static_cast<cudaStream_t>(apart)));
    return static_cast<void*>(s);
  }
  void GiveStream(void* stream) override { streams_->Give(static_cast<cudaStream_t>(stream)); }
  void RetireStream(void* stream) override {
    streams_->Retire(static_cast<cudaStream_t>(stream));
  }
  void SetupDone(void* stream) override { streams_->SetupDone(static_cast<cudaStream_t>(stream)); }
  void* SetupStreamFor(void* stream) override {
    return streams_->SetupStreamFor(static_cast<cudaStream_t>(stream));
  }
  void* RescueStream() override { return streams_->rescue(); }
  const uint64_t* UnblockWordsOfDevice() override { return streams_->unblock_words(); }
  absl::Status ReadDeviceWords(std::span<const DeviceRead> reads) override {
    return streams_->ReadWords(reads);
  }
  std::string StreamPlace(void* stream) const override {
    return streams_->Where(static_cast<cudaStream_t>(stream));
  }
  uint64_t FusedPlanBytes(const FusedSetup& setup) const override {
    return FusedRunner::DeviceBytesFor(setup);
  }

  absl::StatusOr<std::shared_ptr<Buffer>> AllocBuffer(uint64_t bytes) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    ULY_ASSIGN_OR_RETURN(ipc::cuda::VmmMapping m, streams_->ZeroedMapping(bytes));
    auto b = std::make_shared<Buffer>();
    b->size = bytes;
    b->device = true;
    ULY_ASSIGN_OR_RETURN(b->fd, m.Export());
    auto keep = std::make_shared<ipc::cuda::VmmMapping>(std::move(m));
    b->data = keep->data();
    b->keep = keep;
    return b;
  }

  absl::StatusOr<std::shared_ptr<Buffer>> ImportIpcBuffer(const std::string& handle,
                                                          uint64_t size_bytes) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    if (size_bytes == 0) return absl::InvalidArgumentError("size_bytes: must be > 0");
    std::shared_ptr<ipc::cuda::IpcMapping> m;
    {
      // One open per allocation: a handle already open here is shared, not opened again.
      std::lock_guard<std::mutex> lock(ipc_mu_);
      for (auto it = ipc_open_.begin(); it != ipc_open_.end();)
        it = it->second.expired() ? ipc_open_.erase(it) : std::next(it);
      auto it = ipc_open_.find(handle);
      if (it != ipc_open_.end()) m = it->second.lock();
      if (!m) {
        ULY_ASSIGN_OR_RETURN(ipc::cuda::IpcMapping opened, ipc::cuda::IpcMapping::Open(handle));
        m = std::make_shared<ipc::cuda::IpcMapping>(std::move(opened));
        ipc_open_[handle] = m;
      }
    }
    absl::StatusOr<ipc::cuda::AllocationInfo> queried = ipc::cuda::QueryAllocation(m->data());
    if (!queried.ok())
      return absl::Status(queried.status().code(),
                          StrCat("cuda_ipc_handle: the opened allocation cannot be queried: ",
                                 queried.status().message()));
    const ipc::cuda::AllocationInfo& info = *queried;
    // The bytes from the opened address to the allocation's end (the address is its base).
    const uint64_t past = static_cast<uint64_t>(static_cast<const uint8_t*>(m->data()) -
                                                static_cast<const uint8_t*>(info.base));
    const uint64_t room = past < info.size ? info.size - past : 0;
    if (size_bytes > room)
      return absl::InvalidArgumentError(StrCat("size_bytes: ", size_bytes,
                                               " exceeds the allocation's ", room, " bytes"));
    auto b = std::make_shared<Buffer>();
    b->size = size_bytes;
    b->device = true;
    b->data = m->data();
    b->keep = m;
    return b;
  }

  absl::StatusOr<std::shared_ptr<Buffer>> ImportVmmBuffer(
      std::span<const ipc::cuda::VmmMapping::Part> parts) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    ULY_ASSIGN_OR_RETURN(ipc::cuda::VmmMapping m,
                         ipc::cuda::VmmMapping::ImportParts(device_, parts, /*writable=*/true,
                                                                            "vmm_mappings"));
    auto mapping = std::make_shared<ipc::cuda::VmmMapping>(std::move(m));
    auto b = std::make_shared<Buffer>();
    b->size = mapping->size();
    b->device = true;
    b->data = mapping->data();
    b->keep = mapping;
    return b;
  }

  absl::StatusOr<bool> CanReach(int peer_device) const override {
    if (peer_device == device_) return true;
    if (peer_device < 0 || peer_device >= ipc::cuda::DeviceCount()) return false;
    return ipc::cuda::CanAccessPeer(device_, peer_device);
  }

  std::string_view mps_mode() const override { return info_.mps ? "mps" : "no-mps"; }
  // A context that took a sticky error (an illegal address, a launch failure, an ECC error)
  // or that its MPS server tore down answers every call with that error, this one included.
  absl::Status DeviceHealth() const override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    size_t free_bytes = 0, total_bytes = 0;
    return CudaStatus("cudaMemGetInfo", cudaMemGetInfo(&free_bytes, &total_bytes));
  }
  DeviceIdentity identity() const override {
    return DeviceIdentity{info_.uuid, info_.pci_bus_id, info_.numa_node};
  }

 private:
  const int device_;
  FdExports* const exports_;
  const ipc::cuda::DeviceInfo info_;
  const std::shared_ptr<DeviceStreams> streams_;  // the sessions' (each transport holds it too)
  const absl::Duration drain_limit_;               // each transport's Drain bound
  std::mutex ipc_mu_;
  std::map<std::string, std::weak_ptr<ipc::cuda::IpcMapping>> ipc_open_;
};

// One DeviceStreams per device in the process: every backend of the device (an nvlink daemon's
// own, and the one its nccl backend wraps) hands out streams from the same lanes, so that no
// two of their sessions share a hardware queue unknowingly. The first backend's options make
// it; later ones share it as it is.
absl::StatusOr<std::shared_ptr<DeviceStreams>> SharedDeviceStreams(
    int device, const CudaBackendOptions& options) {
  static std::mutex* mu = new std::mutex;
  static auto* made = new std::map<int, std::weak_ptr<DeviceStreams>>;
  std::lock_guard<std::mutex> lock(*mu);
  if (std::shared_ptr<DeviceStreams> existing = (*made)[device].lock()) return existing;
  ULY_ASSIGN_OR_RETURN(
      std::shared_ptr<DeviceStreams> streams,
      DeviceStreams::Create(device, options.queue_probe_streams, options.queue_sharing));
  (*made)[device] = streams;
  return streams;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, FdExports* exports,
                                                         const CudaBackendOptions& options) {
  ULY_RETURN_IF_ERROR(ipc::cuda::SetDevice(device));
  ULY_ASSIGN_OR_RETURN(ipc::cuda::DeviceInfo info, ipc::cuda::Describe(device));
  ULY_ASSIGN_OR_RETURN(std::shared_ptr<DeviceStreams> streams,
                       SharedDeviceStreams(device, options));
  // Probe the VMM path once: a device or driver without POSIX-fd VMM cannot serve sessions.
  // Zeroed as every buffer is (DeviceStreams::ZeroedMapping): without the queue probe on the
  // stream the first session will take, so no other queue runs work.
  ULY_ASSIGN_OR_RETURN(ipc::cuda::VmmMapping probe, streams->ZeroedMapping(1));
  ULY_ASSIGN_OR_RETURN(ipc::UniqueFd probe_fd, probe.Export());
  // cuBLASLt's one-time work (its first handle and first algorithm query wait for the whole
  // device) is done now, not beside another session's waiting call; fused sessions' GEMMs then
  // lease the handle made here. Without it the daemon serves the plain ops, and a fused
  // session's first call may wait for another session's call that waits for its peer.
  if (absl::Status warm = streams->OnSetupStream(kernels::Bf16Gemm::WarmUp); !warm.ok())
    Logger("main")->warn(
        "device {}: cuBLASLt warm-up failed ({}); a fused session's first call may wait for "
        "another session's call that waits on the GPU",
        device, std::string(warm.message()));
  Logger("main")->info("device {}: {} ({}, {}), MPS {}", device, info.name, info.uuid,
                       info.pci_bus_id, info.mps ? "on" : "off");
  return std::unique_ptr<Backend>(
      new CudaBackend(device, exports, std::move(info), std::move(streams), options.drain_limit));
}

}  // namespace ulysses::daemon
