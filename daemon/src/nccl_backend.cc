// The NCCL backend ("nccl"): for groups whose daemons cannot map each other's device memory.
// Each rank's receive slots are one CUDA VMM allocation on its GPU that only this daemon and
// its client map. A call packs this rank's block for every peer into a send staging buffer,
// moves the blocks with one group of ncclSend/ncclRecv, and unpacks what arrived into the
// local slot with the same destination-side plans the nvlink kernels store with, so the slot
// ends bit-identical. A qkv_norm_rope_exchange session's call first computes this rank's
// normalized projection (the per-operator path's GEMM and norm + RoPE), then moves it the same
// way, as the head-chunk exchange of its q, k and v (layout fused) or as three head scatters,
// one per plane (layout bshd). Calls are stream-ordered as on nvlink: the whole call goes on
// the session's stream behind the client's ready word and ends in its done word, and the
// daemon's host enqueues it and returns. Client buffers are the GPU backend's (CUDA IPC, VMM).
// Built only with CUDA and NCCL.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/escaping.h"
#include "call_views.h"
#include "fused_runner.h"
#include "helper_process.h"
#include "out_write_cuda.h"
#include "stream_ordered.h"
#include "transport.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/protocol_words.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/kernels/exchange_cuda.h"

namespace ulysses::daemon {
namespace {

// A peer that went away or failed shows up as a remote or system error of the communicator:
// that is the group's failure (ABORTED), not this daemon's.
absl::Status NcclStatus(const char* what, ncclResult_t r, ncclComm_t comm) {
  if (r == ncclSuccess) return absl::OkStatus();
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  std::string msg = StrCat(what, ": ", ncclGetErrorString(r),
                           last != nullptr && *last != '\0' ? StrCat(" (", last, ")") : "");
  if (r == ncclRemoteError || r == ncclSystemError) return absl::AbortedError(std::move(msg));
  return absl::InternalError(std::move(msg));
}

absl::Status UseDevice(int device) { return CudaStatus("cudaSetDevice", cudaSetDevice(device)); }

// How long rank 0 waits for its bootstrap-root helper to start and answer.
constexpr absl::Duration kRootAnswerWithin = absl::Seconds(30);
// How long a cancel waits for its words to land before the communicator is aborted.
constexpr absl::Duration kCancelLandsWithin = absl::Seconds(1);

// Slots and staged blocks are 256-byte aligned (the pack and unpack kernels need 16).
constexpr uint64_t kAlign = 256;
std::string HandlePrefix(int rank) { return StrCat("nccl|", rank, "|"); }

std::string NcclVersion() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return StrCat(v / 10000, ".", v / 100 % 100, ".", v % 100);
}

bool IsHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; });
}

// An NCCL unique id from its hex form; false (and `id` untouched) where `hex` is not one.
bool IdFromHex(const std::string& hex, ncclUniqueId* id) {
  if (hex.size() != 2 * sizeof id->internal || !IsHex(hex)) return false;
  const std::string bytes = absl::HexStringToBytes(hex);
  std::memcpy(id->internal, bytes.data(), sizeof id->internal);
  return true;
}

// Spins briefly, then sleeps: the waits below poll a stream and a communicator.
void Pause(int round) {
  if (round < 64)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// Every op's slot holds W equal blocks, so a block is at most slot_bytes / W.
uint64_t BlockCapacity(int world_size, uint64_t slot_bytes) {
  const auto w = static_cast<uint64_t>(world_size);
  return AlignUp((slot_bytes + w - 1) / w, kAlign);
}

// What leads this rank's slot allocation, before the slots: its client's done words (as on
// nvlink), then the cancel word the call's kernels read. The client maps the allocation and
// could write there: what it could change harms only its own results.
struct NcclSlotsHead {
  ResultWords results;
  uint64_t cancel;
};
// The client finds its done words at the start of the allocation, as on nvlink.
static_assert(offsetof(NcclSlotsHead, results) == 0);
static_assert(offsetof(NcclSlotsHead, cancel) == sizeof(ResultWords));

class NcclTransport final : public Transport {
 public:
  // `gpu`: the device's backend, whose hardware queue lanes the session's streams come from
  // (shared with the device's nvlink sessions, so that none shares a queue unknowingly) and
  // whose rescue stream runs this session's cancels.
  static absl::StatusOr<std::unique_ptr<Transport>> Create(int device, absl::Duration call_timeout,
                                                           const TransportSetup& setup,
                                                           Backend* gpu) {
    ULY_RETURN_IF_ERROR(UseDevice(device));
    std::unique_ptr<NcclTransport> t(new NcclTransport(device, call_timeout, setup, gpu));
    t->rescue_ = static_cast<cudaStream_t>(gpu->RescueStream());
    if (t->rescue_ == nullptr)
      return absl::FailedPreconditionError("the nccl backend needs the device's rescue stream");
    ULY_ASSIGN_OR_RETURN(void* taken, gpu->TakeStream(StreamRole::kSession, nullptr));
    t->stream_ = static_cast<cudaStream_t>(taken);
    const cudaStream_t stream = t->stream_;
    // Setup work is waited for on the session's own stream (idle when taken), or, where it
    // shares a hardware queue with another session's, on one no session's wait holds back.
    const auto setup_stream = static_cast<cudaStream_t>(gpu->SetupStreamFor(stream));
    if (setup.fused) {
      // Per-operator only (the transport moves the result), so the plan's second stream never
      // runs work: it borrows the session's stream as that, and takes no lane of its own.
      ULY_ASSIGN_OR_RETURN(t->fused_, FusedRunner::Create(*setup.fused,
                                                          FusedExchange::kTransportMoves, stream,
                                                          setup_stream));
    }
    const int W = setup.geometry.world_size;
    t->stride_ = AlignUp(setup.slot_bytes, kAlign);
    t->head_bytes_ = AlignUp(sizeof(NcclSlotsHead), kAlign);
    // Zeroed on the setup stream, never the legacy one: a wait on the legacy stream could wait
    // behind another session's stream that shares its hardware queue. Every word starts at 0
    // (no epoch reached) before the client can see it.
    ULY_ASSIGN_OR_RETURN(t->slots_,
                         ipc::cuda::VmmMapping::Create(
                             device, t->head_bytes_ + t->stride_ * setup.geometry.num_slots,
                             setup_stream));
    ULY_ASSIGN_OR_RETURN(t->client_fd_, t->slots_.Export());
    ULY_ASSIGN_OR_RETURN(t->client_words_, ipc::cuda::VmmMapping::Create(
                                               device, sizeof(ClientDeviceWords), setup_stream));
    ULY_ASSIGN_OR_RETURN(t->client_words_fd_, t->client_words_.Export());
    if (W > 1) {
      // Staging is made once here: a call allocates nothing.
      t->block_capacity_ = BlockCapacity(W, setup.slot_bytes);
      ULY_ASSIGN_OR_RETURN(t->send_, ipc::cuda::VmmMapping::Create(
                                         device, t->block_capacity_ * W, setup_stream));
      ULY_ASSIGN_OR_RETURN(t->recv_, ipc::cuda::VmmMapping::Create(
                                         device, t->block_capacity_ * W, setup_stream));
    }
    ULY_RETURN_IF_ERROR(t->events_.Create(setup.geometry.num_slots));
    for (cudaEvent_t* ev : {&t->rescue_mark_, &t->cancel_mark_})
      ULY_RETURN_IF_ERROR(
          CudaStatus("cudaEventCreate", cudaEventCreateWithFlags(ev, cudaEventDisableTiming)));
    // The plan's GEMMs' kernels are loaded here, while no call of this session is in flight,
    // and waited for (the setup stream alone, also on failure), as the nvlink backend does.
    if (t->fused_) {
      const absl::Status loaded = t->fused_->LoadKernels(setup_stream);
      ULY_RETURN_IF_ERROR(
          CudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(setup_stream)));
      ULY_RETURN_IF_ERROR(loaded);
    }
    // The setup waits go on in Connect (the peers' first transfers), whose end lets a session
    // past the free lanes share this stream's queue.
    return std::unique_ptr<Transport>(std::move(t));
  }

  // Session drains every transport it made (Drain: the stream idle, the cancels on the rescue
  // stream run) and keeps for the process's life one whose Drain failed; one never drained
  // comes from a failed Create, which ran no call.
  ~NcclTransport() override {
    (void)UseDevice(device_);
    // Abort, never destroy: destroying waits for the peers, which may be gone.
    AbortComm();
    // The plan's work was ordered before the stream's end, and what the plan frees goes on
    // the session's stream or the setup stream, after that; the stream then goes back to the
    // device's lanes.
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    fused_.reset();
    if (stream_ != nullptr) gpu_->GiveStream(stream_);
    for (cudaEvent_t ev : {rescue_mark_, cancel_mark_})
      if (ev != nullptr) cudaEventDestroy(ev);
  }

  // First, with every call completed, the wait for the peers to be past the last one
  // (WaitForPeersPastLastCall). Then, while the stream runs, cancels (the words on the rescue
  // stream, then the communicator's abort, which ends NCCL's kernels once the stream reaches
  // them), and waits, bounded by the drain limit the nvlink backend uses (DrainLimitFor), for
  // it to be idle and for the cancels to have run: a stream whose queue another session's
  // stuck work holds may never be. Then it is retired and the transport kept. An idle stream
  // gets the cancel's words on itself; the destructor aborts the communicator.
  bool Drain() override {
    if (stream_ == nullptr) return true;
    if (!UseDevice(device_).ok()) return false;
    WaitForPeersPastLastCall();
    const absl::Duration limit = DrainLimitFor(call_timeout_);
    const bool drained = DrainSessionStream(stream_, rescue_, rescue_mark_, used_rescue_, limit,
                                            [this] { Cancel(); },
                                            [this](cudaStream_t on) { CancelOn(on); });
    if (!drained) {
      Logger("exec")->error(
          "device {}: an nccl session's device work did not end within {} of its cancel; its "
          "stream and device memory ({} bytes) stay in place for the daemon's life",
          device_, absl::FormatDuration(limit), DeviceBytes());
      gpu_->RetireStream(stream_);
    }
    return drained;
  }

  // A call that completed here may still be on its way to a peer: this rank's send kernels end
  // once the data is handed to NCCL's connection (its proxy thread, the peer's buffers), not
  // once the peer has it. So while every call of the session has completed, the connections
  // stay until every peer is past the last one (completed it, or left), bounded by the call
  // timeout; a call still in flight is cancelled instead, and so is the peers' epoch.
  void WaitForPeersPastLastCall() {
    uint64_t last = 0;
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      // A cancelled session's communicator is gone already: nothing left to keep.
      if (comm_ == nullptr) return;
      last = last_enqueued_;
    }
    if (last == 0 || !setup_.peers_past || cudaStreamQuery(stream_) != cudaSuccess) return;
    const absl::Time give_up = absl::Now() + call_timeout_;
    while (!setup_.peers_past(last)) {
      if (absl::Now() > give_up) {
        Logger("exec")->warn("device {}: an nccl session closes while a peer has not finished "
                             "epoch {} within {}; that peer's call may fail",
                             device_, last, absl::FormatDuration(call_timeout_));
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // nccl|<rank>|: rank 0's unique id travels in the third round (ConnectHandle).
  std::string LocalHandle() const override { return HandlePrefix(setup_.geometry.rank); }

  absl::Status CheckPeers(const std::vector<std::string>& handles) override {
    return CheckPeersRunThisBackend(
        handles, setup_.geometry.rank,
        [](int r, const std::string& h) { return h == HandlePrefix(r); },
        "; every rank of an nccl group must run nccl");
  }

  // Rank 0 makes the unique id here, once every rank has mapped its peers (the second round
  // passed). Making it starts NCCL's bootstrap root (a thread and a listening socket), which
  // lives until every rank has joined the communicator, and a rank may fail before it joins:
  // so the root runs in a helper process of this daemon, ended once this rank's Connect is
  // over or the transport goes, whatever happened.
  bool HasConnectHandle() const override { return true; }
  absl::StatusOr<std::string> ConnectHandle() override {
    if (setup_.geometry.rank != 0) return std::string();
    ULY_ASSIGN_OR_RETURN(root_, HelperProcess::Start({SelfExecutable(), kNcclRootHelperArg},
                                                     kRootAnswerWithin));
    const std::string& answer = root_.answer();
    const std::string hex = answer.rfind("ok ", 0) == 0 ? answer.substr(3) : std::string();
    if (!IdFromHex(hex, &id_)) {
      root_.Stop();
      return absl::FailedPreconditionError(
          StrCat("NCCL bootstrap root: ",
                 answer.rfind("error ", 0) == 0 ? answer.substr(6)
                                                : StrCat("unexpected answer \"", answer, "\"")));
    }
    return hex;
  }

  absl::Status Connect(const std::vector<std::string>&,
                       const std::vector<std::string>& connect_handles,
                       const std::vector<uint8_t*>& /*peer_segments*/,
                       absl::Duration timeout) override {
    // Rank 0's init is complete only once every rank has had its ring neighbour from the
    // root: the root's work is over when this returns, whatever happened.
    absl::Cleanup stop_root = [this] { root_.Stop(); };
    // The session's stream waits here for the peers' first transfers: until that is over no
    // later session shares its hardware queue while another lane can serve it.
    absl::Cleanup setup_done = [this] { gpu_->SetupDone(stream_); };
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    const int W = setup_.geometry.world_size;
    const int me = setup_.geometry.rank;
    if (me != 0) {
      if (connect_handles.size() != static_cast<size_t>(W))
        return absl::InternalError("the nccl transport connects with every rank's connect handle");
      if (!IdFromHex(connect_handles[0], &id_))
        return absl::FailedPreconditionError("rank 0 sent a malformed NCCL unique id");
    }
    std::lock_guard<std::mutex> lock(comm_mu_);
    // A session that failed to connect runs no call: its communicator goes now.
    absl::Status connected = ConnectLocked(me, absl::Now() + timeout);
    if (!connected.ok()) CancelLocked();
    return connected;
  }

  // Host-protocol entry points: this transport enqueues whole calls (Enqueue).
  absl::Status Push(const CallPlan&, const CallOperands&, int, int) override {
    return absl::InternalError("the nccl transport enqueues whole calls on its stream");
  }
  absl::Status Flush() override {
    return absl::InternalError("the nccl transport enqueues whole calls on its stream");
  }
  absl::Status Finish(const CallPlan&, const CallOperands&, int) override {
    return absl::InternalError("the nccl transport enqueues whole calls on its stream");
  }

  bool StreamOrdered() const override { return true; }

  // The whole call on the session's stream (docs/protocol.md sections 8.5 and 9): wait for the
  // client's inputs (and the slot's release where its ready word does not imply it); a fused
  // call's projection and norm + RoPE; this rank's own block straight into its slot; every
  // peer's block packed into send staging; one group of ncclSend/ncclRecv; every received
  // block unpacked into the slot; the out= copy or the merge; done. The host waits only for
  // NCCL to have enqueued the group, never for the device.
  absl::Status Enqueue(const CallPlan& plan, const CallOperands& ops,
                       const StreamCall& call) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (comm_ == nullptr)
      return absl::FailedPreconditionError(
          "the NCCL communicator is gone (the session was cancelled)");
    const int s = call.slot;
    const uint64_t e = call.epoch;
    deadline_ = absl::Now() + call_timeout_;
    epoch_ = e;
    last_enqueued_ = e;
    ipc::cuda::StreamOps memops(stream_);
    if (call.wait_ready) ULY_RETURN_IF_ERROR(memops.Wait(&ClientWords()->ready[s], e));
    if (call.wait_released != 0)
      ULY_RETURN_IF_ERROR(memops.Wait(&ClientWords()->released[s], call.wait_released));
    ULY_RETURN_IF_ERROR(memops.Flush());
    ULY_RETURN_IF_ERROR(EnqueueMoves(plan, ops, s));
    ULY_RETURN_IF_ERROR(
        EnqueueOutWrite(setup_.geometry, plan, ops, Slot(s), stream_, cancel()).status());
    ULY_RETURN_IF_ERROR(memops.Write(&Head()->results.done[s], e));
    ULY_RETURN_IF_ERROR(memops.Flush());
    return events_.Record(s, e, stream_);
  }

  // The call's event, and NCCL's own verdict meanwhile: a remote or system error (a peer gone)
  // fails the call at once rather than at its timeout.
  absl::StatusOr<bool> Completed(int slot, uint64_t epoch) override {
    ULY_ASSIGN_OR_RETURN(const bool finished, events_.Finished(slot, epoch));
    if (finished) return true;
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (comm_ != nullptr) ULY_RETURN_IF_ERROR(CommBusy("NCCL").status());
    return false;
  }

  // The words first, on the rescue stream (the session's stream passes every wait and its
  // kernels store nothing), then the communicator's abort: NCCL's kernels already on the
  // stream, or reached once the cancel let the stream on, end at once.
  void Cancel() override {
    std::lock_guard<std::mutex> lock(comm_mu_);
    CancelLocked();
  }

  // This rank's words of the slot as the device holds them (no daemon maps a peer's words
  // here: Session adds where the peers stood), the communicator's state, and the stream's
  // hardware queue.
  std::string DescribeStuck(int slot, uint64_t epoch) override {
    if (slot < 0 || slot >= setup_.geometry.num_slots || stream_ == nullptr) return {};
    used_rescue_ = true;
    uint64_t w[4] = {};  // ready, released, cancel, done
    const DeviceRead reads[] = {{&ClientWords()->ready[slot], &w[0], sizeof(uint64_t)},
                                {&ClientWords()->released[slot], &w[1], sizeof(uint64_t)},
                                {cancel(), &w[2], sizeof(uint64_t)},
                                {&Head()->results.done[slot], &w[3], sizeof(uint64_t)}};
    if (absl::Status st = gpu_->ReadDeviceWords(reads); !st.ok())
      return StrCat("unreadable (", st.message(), ")");
    const SlotWordsReport report{setup_.geometry.rank, slot, epoch, w[0], w[1], w[2], w[3], {}};
    std::string comm;
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      if (comm_ == nullptr) {
        comm = "aborted";
      } else {
        const absl::StatusOr<bool> busy = CommBusy("NCCL");
        comm = !busy.ok() ? std::string(busy.status().message())
               : *busy    ? "an operation still being posted"
                          : "no error";
      }
    }
    return StrCat(FormatSlotWords(report), "; communicator: ", comm, "; its stream on ",
                  gpu_->StreamPlace(stream_));
  }

  absl::Status Poison(int slot) override {
    ULY_RETURN_IF_ERROR(UseDevice(device_));
    // Stream-ordered like the calls, and not waited for: a call before it may wait for its
    // client or a peer.
    return CudaStatus("cudaMemsetAsync",
                      cudaMemsetAsync(Slot(slot), 0xff, setup_.slot_bytes, stream_));
  }

  uint64_t SlotOffset(int slot) const override {
    return head_bytes_ + stride_ * static_cast<uint64_t>(slot);
  }
  ClientSlotMapping ClientMapping() const override {
    return ClientSlotMapping{client_fd_.get(), slots_.size(), true, client_words_fd_.get(),
                             client_words_.size()};
  }
  // The slots, as on nvlink (what the slot budget charged), the client's words and the
  // staging.
  uint64_t DeviceBytes() const override {
    return slots_.size() + client_words_.size() + send_.size() + recv_.size() +
           (fused_ ? fused_->plan().device_bytes() : 0);
  }
  std::string Describe() const override {
    std::string out = StrCat("nccl: NCCL ", NcclVersion(), ", communicator of ",
                             setup_.geometry.world_size, " ranks on device ", device_,
                             "; per call, on the session's stream after the client's ready word: ");
    if (fused_)
      out += StrCat("FusedQkvPlan's projection (bf16 GEMM) and norm_rope kernel in "
                    "place, then its ",
                    QkvLayoutName(setup_.fused->geometry.layout), " layout's ",
                    setup_.fused->geometry.layout == QkvLayout::kBshd
                        ? "three head scatters (one per plane): "
                        : "head-chunk scatter: ");
    out += "pack kernels (one per peer) into send staging, one group of ncclSend/ncclRecv, "
           "unpack kernels into the slot, then the done word; the own block is stored straight "
           "into the slot";
    if (fused_) out += StrCat("; ", fused_->Describe());
    return out;
  }

 private:
  NcclTransport(int device, absl::Duration call_timeout, const TransportSetup& setup,
                Backend* gpu)
      : device_(device),
        call_timeout_(call_timeout),
        setup_(setup),
        gpu_(gpu),
        unblock_(gpu->UnblockWordsOfDevice()) {}

  NcclSlotsHead* Head() const { return static_cast<NcclSlotsHead*>(slots_.data()); }
  uint64_t* cancel() const { return &Head()->cancel; }
  ClientDeviceWords* ClientWords() const {
    return static_cast<ClientDeviceWords*>(client_words_.data());
  }
  uint8_t* Slot(int slot) const { return static_cast<uint8_t*>(slots_.data()) + SlotOffset(slot); }

  // The communicator (non-blocking init: a rank that never joins ends in DEADLINE_EXCEEDED
  // here, not a hang), then the connection to every peer.
  absl::Status ConnectLocked(int me, absl::Time deadline) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r =
        ncclCommInitRankConfig(&comm_, setup_.geometry.world_size, id_, me, &config);
    if (r != ncclSuccess && r != ncclInProgress)
      return NcclStatus("ncclCommInitRankConfig", r, comm_);
    ULY_RETURN_IF_ERROR(
        WaitComm("ncclCommInitRank (every rank joining the communicator)", deadline));
    return ConnectPeers(deadline);
  }

  // Every connection to a peer is made now, while every rank is here: one byte each way with
  // every peer, waited for. NCCL makes a pair's connection at its first transfer, and a call's
  // group that had to make it would hold this daemon's host until the peer's daemon reached
  // the same call.
  absl::Status ConnectPeers(absl::Time deadline) {
    if (setup_.geometry.world_size == 1) return absl::OkStatus();
    ULY_RETURN_IF_ERROR(SendReceive(1, "the connection to every peer", deadline));
    for (int round = 0;; ++round) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return CudaStatus("cudaStreamQuery", q);
      ULY_RETURN_IF_ERROR(CommBusy("the first transfer with every peer").status());
      ULY_RETURN_IF_ERROR(Interrupted("the first transfer with every peer", deadline));
      Pause(round);
    }
  }

  // One group of an ncclSend of `bytes` from send_[peer] and an ncclRecv of as many into
  // recv_[peer] for every peer, on the session's stream, and the wait (bounded by `deadline`)
  // until the non-blocking communicator has enqueued it: nothing else may go on the stream
  // before. With every peer connected at the session's start that is NCCL's own host work,
  // not a wait for a peer.
  absl::Status SendReceive(uint64_t bytes, const char* what, absl::Time deadline) {
    const int W = setup_.geometry.world_size;
    const int me = setup_.geometry.rank;
    const size_t n = static_cast<size_t>(bytes);
    ULY_RETURN_IF_ERROR(NcclStatus("ncclGroupStart", ncclGroupStart(), comm_));
    for (int k = 1; k < W; ++k) {
      const int peer = (me + k) % W;
      ncclResult_t r = ncclSend(Staged(send_, peer), n, ncclUint8, peer, comm_, stream_);
      if (r == ncclSuccess || r == ncclInProgress)
        r = ncclRecv(Staged(recv_, peer), n, ncclUint8, peer, comm_, stream_);
      if (r != ncclSuccess && r != ncclInProgress) {
        (void)ncclGroupEnd();
        return NcclStatus("ncclSend/ncclRecv", r, comm_);
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    if (end != ncclSuccess && end != ncclInProgress)
      return NcclStatus("ncclGroupEnd", end, comm_);
    return WaitComm(what, deadline);
  }

  // Everything of a call after its waits, on the session's stream: a fused call's projection
  // and norm + RoPE, the own block, the packs, the group, the unpacks. The kernels that store
  // into the slot read the cancel word.
  absl::Status EnqueueMoves(const CallPlan& plan, const CallOperands& ops, int slot) {
    ULY_ASSIGN_OR_RETURN(const Exchange x, ExchangeOf(plan, ops));
    const int W = setup_.geometry.world_size;
    const int me = setup_.geometry.rank;
    uint8_t* out = Slot(slot);
    for (const Part& p : x.parts) {
      void* outs[kMaxWorldSize] = {};
      outs[me] = out + p.out_offset;
      ULY_RETURN_IF_ERROR(kernels::LaunchBlocks(x.shape, p.ops, me, outs, stream_, cancel()));
    }
    if (W == 1) return absl::OkStatus();
    uint64_t bytes = 0;  // one peer's staged block: its parts back to back
    for (const Part& p : x.parts) bytes += p.packed_bytes;
    if (bytes > block_capacity_)
      return absl::InternalError(StrCat("a block of ", bytes, " bytes exceeds the staging of ",
                                        block_capacity_, " bytes per rank"));
    for (int k = 1; k < W; ++k) {
      const int dst = (me + k) % W;
      uint8_t* at = Staged(send_, dst);
      for (const Part& p : x.parts) {
        ULY_RETURN_IF_ERROR(kernels::LaunchPackBlock(x.shape, p.ops, me, dst, at, stream_));
        at += p.packed_bytes;
      }
    }
    ULY_RETURN_IF_ERROR(SendReceive(bytes, "ncclGroupEnd", deadline_));
    for (int k = 1; k < W; ++k) {
      const int src = (me + k) % W;
      const uint8_t* at = Staged(recv_, src);
      for (const Part& p : x.parts) {
        ULY_RETURN_IF_ERROR(kernels::LaunchUnpackBlock(x.shape, p.ops, src, me, at,
                                                       out + p.out_offset, stream_, cancel()));
        at += p.packed_bytes;
      }
    }
    return absl::OkStatus();
  }

  // A call's data as the block, pack and unpack kernels take it: one exchange (a head-exchange
  // op), or for a fused call the exchanges of its normalized projection. A part's blocks land
  // out_offset bytes into the slot; a peer's staged block holds the parts back to back.
  struct Part {
    kernels::BlockOperands ops;
    uint64_t out_offset = 0;
    uint64_t packed_bytes = 0;  // one block of it, packed
  };
  struct Exchange {
    kernels::ExchangeShape shape;
    // At most three parts (a bshd fused call's planes), kept in place: a call allocates nothing.
    absl::InlinedVector<Part, 3> parts;
  };

  // A fused call's projection and norm + RoPE are enqueued here, on the session's stream.
  absl::StatusOr<Exchange> ExchangeOf(const CallPlan& plan, const CallOperands& ops) {
    Exchange x;
    if (!Traits(plan.op).fused) {
      x.shape = ShapeOf(setup_.geometry, plan);
      ULY_ASSIGN_OR_RETURN(const kernels::BlockOperands bops, BlockOperandsOf(plan, ops));
      x.parts.push_back(Part{bops, 0, 0});
    } else {
      if (!fused_)
        return absl::InvalidArgumentError(StrCat("op: ", OpName(plan.op), " needs a fused session"));
      ULY_RETURN_IF_ERROR(fused_->PreparedPath(plan.batch * plan.seq_local).status());
      ULY_RETURN_IF_ERROR(fused_->plan().RunNormRope(ops.inputs[0],
                                                     static_cast<const int32_t*>(ops.inputs[1]),
                                                     plan.batch, plan.seq_local, stream_));
      const FusedGeometry& g = setup_.fused->geometry;
      x.shape = kernels::ExchangeShape{g.world_size, plan.batch, plan.seq_local, g.num_heads,
                                       g.head_dim,   2};
      // q, k and v of the projection [B * S_l, 3*H*D]: [B, S_l, H, D] views of its planes.
      const int64_t hd = int64_t{g.num_heads} * g.head_dim, features = 3 * hd;
      const auto* proj = static_cast<const uint16_t*>(fused_->plan().projection());
      kernels::ConstView planes[3];
      for (int p = 0; p < 3; ++p)
        planes[p] = kernels::ConstView{proj + p * hd,
                                       {plan.seq_local * features, features, g.head_dim, 1}};
      const int32_t local_heads = g.num_heads / g.world_size;
      if (g.layout == QkvLayout::kFused) {
        // [B, S_g, H_l, 3D]: the head-chunk scatter of the whole band.
        x.parts.push_back(Part{{kernels::BlockKind::kScatterQkvHeadChunk,
                                {planes[0], planes[1], planes[2]}, 0, local_heads}, 0, 0});
      } else {
        // Three [B, S_g, H_l, D] planes one after the other: a head scatter into each.
        const uint64_t plane_bytes = static_cast<uint64_t>(kernels::QkvPlaneElems(
                                         {g.world_size, g.num_heads, g.head_dim, g.max_pos,
                                          plan.batch, plan.seq_local})) *
                                     2;
        for (int p = 0; p < 3; ++p)
          x.parts.push_back(Part{{kernels::BlockKind::kScatterHeads,
                                  {planes[p], planes[p], planes[p]}, 0, 0},
                                 p * plane_bytes, 0});
      }
    }
    for (Part& p : x.parts) {
      ULY_ASSIGN_OR_RETURN(const int64_t n, kernels::PackedBlockBytes(x.shape, p.ops));
      p.packed_bytes = static_cast<uint64_t>(n);
    }
    return x;
  }
  uint8_t* Staged(const ipc::cuda::VmmMapping& m, int rank) const {
    return static_cast<uint8_t*>(m.data()) + block_capacity_ * static_cast<uint64_t>(rank);
  }

  // ABORTED when this session or a peer's is gone; DEADLINE_EXCEEDED past `deadline`.
  absl::Status Interrupted(const char* what, absl::Time deadline) {
    if (setup_.can_complete) {
      if (absl::Status end = setup_.can_complete(epoch_); !end.ok())
        return absl::AbortedError(StrCat(end.message(), " while waiting for ", what));
    }
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(StrCat("timed out waiting for ", what));
    return absl::OkStatus();
  }

  // The communicator's (held, not null) state: true while an operation (init, a group's
  // enqueue) is still in progress, false once done; NCCL's asynchronous error as a status (a
  // peer gone is ABORTED).
  absl::StatusOr<bool> CommBusy(const char* what) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return NcclStatus(what, r, comm_);
    if (state != ncclSuccess && state != ncclInProgress) return NcclStatus(what, state, comm_);
    return state == ncclInProgress;
  }

  // Polls the communicator until its pending operation (init, group end) is done.
  absl::Status WaitComm(const char* what, absl::Time deadline) {
    for (int round = 0;; ++round) {
      if (comm_ == nullptr) return absl::FailedPreconditionError("the NCCL communicator is gone");
      ULY_ASSIGN_OR_RETURN(const bool busy, CommBusy(what));
      if (!busy) return absl::OkStatus();
      ULY_RETURN_IF_ERROR(Interrupted(what, deadline));
      Pause(round);
    }
  }

  // The words, then the abort. The abort ends NCCL's kernels at once, and the stream may then
  // reach the unpacks and the out= copy: the cancel word must be in place first, so the abort
  // waits for the rescue stream's writes (bounded: a rescue stream that cannot run, as in a
  // daemon without the queue probe, is logged and the abort goes ahead).
  void CancelLocked() {
    used_rescue_ = true;
    CancelOn(rescue_);
    if (comm_ == nullptr) return;
    if (cudaEventRecord(cancel_mark_, rescue_) == cudaSuccess) {
      const absl::Time give_up = absl::Now() + kCancelLandsWithin;
      while (cudaEventQuery(cancel_mark_) == cudaErrorNotReady) {
        if (absl::Now() > give_up) {
          Logger("exec")->warn(
              "device {}: an nccl session's cancel did not run on the rescue stream within {}; "
              "its communicator is aborted anyway, and the call's unpacks may store what "
              "arrived before the abort",
              device_, absl::FormatDuration(kCancelLandsWithin));
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    AbortCommLocked();
  }

  // The cancel word, then every word this session's stream or its client's waits on, past
  // every epoch, enqueued on `on`: a stream no wait of this session blocks (the rescue stream,
  // or this session's stream when idle), so this completes.
  void CancelOn(cudaStream_t on) {
    if (!UseDevice(device_).ok()) return;
    const size_t n = static_cast<size_t>(setup_.geometry.num_slots);
    const absl::Status st =
        EnqueueCancel(on, cancel(), unblock_,
                      {{ClientWords()->ready, n}, {ClientWords()->released, n},
                       {Head()->results.done, n}});
    if (!st.ok())
      Logger("exec")->error("device {}: cancel of an nccl session's stream: {}", device_,
                            std::string(st.message()));
  }

  void AbortComm() {
    std::lock_guard<std::mutex> lock(comm_mu_);
    AbortCommLocked();
  }

  void AbortCommLocked() {
    if (comm_ == nullptr) return;
    // On a non-blocking communicator the abort answers ncclInProgress and NCCL's own thread
    // finishes freeing it once the kernels on the stream have ended; the handle is not to be
    // used again. (A communicator aborted in its bootstrap keeps two listening sockets NCCL
    // never closes: docs/architecture.md, section 8.)
    if (ncclResult_t r = ncclCommAbort(comm_); r != ncclSuccess && r != ncclInProgress)
      Logger("exec")->warn("ncclCommAbort: {}", ncclGetErrorString(r));
    comm_ = nullptr;
  }

  const int device_;
  const absl::Duration call_timeout_;
  const TransportSetup setup_;
  uint64_t stride_ = 0;
  uint64_t head_bytes_ = 0;        // NcclSlotsHead, before the slots
  ipc::cuda::VmmMapping slots_;    // this rank's head and slots; only its client maps them too
  ipc::UniqueFd client_fd_;
  ipc::cuda::VmmMapping client_words_;  // ClientDeviceWords, written by the client
  ipc::UniqueFd client_words_fd_;
  // Staging, W blocks of block_capacity_ bytes each, indexed by peer rank: send_[dst] is this
  // rank's packed block for dst, recv_[src] the block src sent here. Empty at W = 1.
  uint64_t block_capacity_ = 0;
  ipc::cuda::VmmMapping send_;
  ipc::cuda::VmmMapping recv_;
  Backend* const gpu_;              // the device's lanes: stream_ comes from there
  const UnblockWords unblock_;      // what a cancel copies over the waited words
  cudaStream_t stream_ = nullptr;   // a lane of the device (also a fused plan's second stream)
  cudaStream_t rescue_ = nullptr;   // the device's, shared: cancels, never waits
  SlotEvents events_;                  // per slot: recorded after the call's done write
  std::atomic<bool> used_rescue_{false};  // Cancel or DescribeStuck enqueued on rescue_
  cudaEvent_t rescue_mark_ = nullptr;     // Drain's mark after this session's rescue work
  cudaEvent_t cancel_mark_ = nullptr;     // after a cancel's words, waited for before the abort
  std::unique_ptr<FusedRunner> fused_;  // fused sessions only
  ncclUniqueId id_{};  // rank 0's, made in ConnectHandle; the others' from its connect handle
  HelperProcess root_;  // rank 0's NCCL bootstrap root, from ConnectHandle to Connect's end
  // Held while comm_ is used or aborted: a cancel may come from another thread than the
  // call's.
  std::mutex comm_mu_;
  ncclComm_t comm_ = nullptr;
  absl::Time deadline_ = absl::InfinitePast();
  // The epoch the transport works on: its waits end when a peer left before completing it.
  // Set by Enqueue; the communicator's setup counts as the first call's.
  uint64_t epoch_ = 1;
  uint64_t last_enqueued_ = 0;  // the last epoch Enqueue took (0: none)
};

// Client buffers, MPS and identity are the GPU backend's (`device`); sessions are NCCL's.
class NcclBackend final : public Backend {
 public:
  NcclBackend(int device, absl::Duration call_timeout, std::unique_ptr<Backend> device_backend)
      : device_(device), call_timeout_(call_timeout), gpu_(std::move(device_backend)) {}

  std::string_view name() const override { return "nccl"; }
  bool slots_in_segment() const override { return false; }
  absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransportSetup& setup) override {
    return NcclTransport::Create(device_, call_timeout_, setup, gpu_.get());
  }
  // A send and a receive block per rank (none at W = 1).
  uint64_t FusedPlanBytes(const FusedSetup& setup) const override {
    return FusedRunner::DeviceBytesFor(setup);
  }
  uint64_t StagingBytes(int world_size, uint64_t slot_bytes) const override {
    if (world_size <= 1) return 0;
    return 2 * BlockCapacity(world_size, slot_bytes) * static_cast<uint64_t>(world_size);
  }
  absl::StatusOr<std::shared_ptr<Buffer>> AllocBuffer(uint64_t bytes) override {
    return gpu_->AllocBuffer(bytes);
  }
  absl::StatusOr<std::shared_ptr<Buffer>> ImportIpcBuffer(const std::string& handle,
                                                          uint64_t size_bytes) override {
    return gpu_->ImportIpcBuffer(handle, size_bytes);
  }
  absl::StatusOr<std::shared_ptr<Buffer>> ImportVmmBuffer(
      std::span<const ipc::cuda::VmmMapping::Part> parts) override {
    return gpu_->ImportVmmBuffer(parts);
  }
  // NCCL picks a transport for any pair of devices (peer access, host memory, network).
  absl::StatusOr<bool> CanReach(int) const override { return true; }
  std::string_view mps_mode() const override { return gpu_->mps_mode(); }
  QueueLaneCounts Queues() const override { return gpu_->Queues(); }
  absl::Status DeviceHealth() const override { return gpu_->DeviceHealth(); }
  DeviceIdentity identity() const override { return gpu_->identity(); }
  absl::Status ReadDeviceWords(std::span<const DeviceRead> reads) override {
    return gpu_->ReadDeviceWords(reads);
  }
  std::string StreamPlace(void* stream) const override { return gpu_->StreamPlace(stream); }

 private:
  const int device_;
  const absl::Duration call_timeout_;
  std::unique_ptr<Backend> gpu_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeNcclBackend(int device, absl::Duration call_timeout,
                                                         std::unique_ptr<Backend> device_backend) {
  int version = 0;
  ULY_RETURN_IF_ERROR(NcclStatus("ncclGetVersion", ncclGetVersion(&version), nullptr));
  Logger("main")->info("device {}: NCCL {} (nccl backend)", device, NcclVersion());
  return std::unique_ptr<Backend>(new NcclBackend(device, call_timeout, std::move(device_backend)));
}

int RunNcclRootHelper() {
  // NCCL's own messages go to standard output; the answer gets a descriptor of its own and
  // standard output becomes standard error.
  const int answer_fd = dup(1);
  if (answer_fd < 0 || dup2(2, 1) < 0) return 1;
  FILE* answer = fdopen(answer_fd, "w");
  if (answer == nullptr) return 1;
  ncclUniqueId id{};
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    std::fprintf(answer, "error ncclGetUniqueId: %s\n", ncclGetErrorString(r));
    std::fclose(answer);
    return 1;
  }
  std::fprintf(answer, "ok %s\n",
               absl::BytesToHexString(absl::string_view(id.internal, sizeof id.internal)).c_str());
  std::fflush(answer);
  // The root's thread serves the ranks until this daemon closes standard input.
  char buf[64];
  for (;;) {
    const ssize_t n = read(0, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EINTR)) break;
  }
  // Not a return from main: no static destructor runs under the root's thread.
  std::_Exit(0);
}

}  // namespace ulysses::daemon
