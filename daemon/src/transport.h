// The backend seam. A Backend is what one daemon runs (host memory and CPU references, or its
// GPU with symmetric device memory): it probes its device, imports client buffers and makes one
// Transport per session. A Transport owns one rank's receive slots and moves a call's blocks
// into the destinations' slots. Everything else about a call (epochs, the control words and
// their waits, the slot table, call agreement between ranks, release, poison bookkeeping,
// metrics, the flight recorder) is backend-neutral and lives in Session and Daemon.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "queue_lanes.h"
#include "ulysses/common/fused.h"
#include "ulysses/common/geometry.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::daemon {

/// Pointers of a planned call's operands in this daemon's address space (host memory on the
/// host backend, device memory on a GPU backend).
struct CallOperands {
  const void* inputs[3] = {nullptr, nullptr, nullptr};
  void* out = nullptr;
  /// The operands' buffers (inputs, then out), held until the call completes: a FreeBuffer
  /// while a stream-ordered call is still queued on the GPU does not unmap its memory.
  std::shared_ptr<const void> keep[4];
};

/// What the owning client maps to read its results: the fd and its byte size. `device` is
/// true when the fd is a VMM handle of device memory (else a memfd / shm fd mapped with mmap).
struct ClientSlotMapping {
  int fd = -1;
  uint64_t bytes = 0;
  bool device = false;
  /// Stream-ordered transports: the client-writable words (ClientDeviceWords), a second VMM
  /// handle the client maps read-write. -1: none.
  int words_fd = -1;
  uint64_t words_bytes = 0;
};

/// One call as a stream-ordered transport enqueues it.
struct StreamCall {
  int slot = 0;
  uint64_t epoch = 0;
  /// The client's stream writes ready[slot] = epoch once the call's inputs are produced; the
  /// daemon's stream waits for it. False when the client ordered its inputs on the host.
  bool wait_ready = false;
  /// Nonzero: the slot holds the result of this epoch, which the client's stream gives back by
  /// writing released[slot]; the daemon's stream waits for that before it grants the slot.
  uint64_t wait_released = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  /// What the peers need to reach this rank's slots; travels in the session rendezvous. Opaque
  /// to everyone but the same backend's Connect.
  virtual std::string LocalHandle() const = 0;
  /// After the rendezvous's first round delivered every rank's LocalHandle (`handles`, index
  /// = rank; this rank's own is empty): FAILED_PRECONDITION when a peer runs another backend.
  /// Its verdict travels in the second round, so every rank fails alike.
  virtual absl::Status CheckPeers(const std::vector<std::string>& handles) {
    return absl::OkStatus();
  }
  /// Whether Connect needs what every rank makes only once every rank has mapped its peers
  /// (the second round passed): a third round carries each rank's ConnectHandle. Rank 0's NCCL
  /// unique id is such: making it starts NCCL's bootstrap root, a thread and a listening
  /// socket that wait until every rank has joined, so it is made only when every rank is
  /// about to. The same on every rank of one backend.
  virtual bool HasConnectHandle() const { return false; }
  virtual absl::StatusOr<std::string> ConnectHandle() { return std::string(); }
  /// Maps every peer's slots from their handles (index = rank; this rank's own is ignored):
  /// `handles` from the first round, `connect_handles` every rank's ConnectHandle (empty
  /// without a third round).
  /// `peer_segments[r]` is rank r's session control segment mapped here (host backend slots
  /// live in it).
  virtual absl::Status Connect(const std::vector<std::string>& handles,
                               const std::vector<std::string>& connect_handles,
                               const std::vector<uint8_t*>& peer_segments,
                               absl::Duration timeout) = 0;

  /// Writes this rank's block of `plan` into destination `dst`'s slot `slot`. May complete
  /// asynchronously; Flush() makes every push issued so far visible to the destinations.
  virtual absl::Status Push(const CallPlan& plan, const CallOperands& ops, int dst, int slot) = 0;
  /// Whether this transport writes all of its blocks of `plan` in one pass (PushAll, after
  /// every destination opened the slot) instead of one Push per destination: the fused op
  /// computes every destination's band from one projection.
  virtual bool PushesAtOnce(const CallPlan& plan) const { return false; }
  /// Writes this rank's block of `plan` into slot `slot` of every destination (epoch `epoch`).
  /// Same completion rules as Push.
  virtual absl::Status PushAll(const CallPlan& plan, const CallOperands& ops, int slot,
                               uint64_t epoch) {
    return absl::UnimplementedError("this transport pushes per destination");
  }
  virtual absl::Status Flush() = 0;
  /// The local end of a call once every source's block is in `slot`: the `out=` copy or the
  /// head-chunk merge. Complete (visible to the client) when it returns.
  virtual absl::Status Finish(const CallPlan& plan, const CallOperands& ops, int slot) = 0;
  /// Fills `slot` with all-ones bytes (NaN in every supported dtype).
  virtual absl::Status Poison(int slot) = 0;

  /// Stream-ordered transports (GPU backends) enqueue a whole call on the session's stream,
  /// waits and all (docs/protocol.md section 9): the daemon's host thread validates, enqueues
  /// and returns; Completed() reports the end. Others run the host protocol (Push, Flush,
  /// Finish) under Session's waits.
  virtual bool StreamOrdered() const { return false; }
  virtual absl::Status Enqueue(const CallPlan& plan, const CallOperands& ops,
                               const StreamCall& call) {
    return absl::UnimplementedError("this transport runs the host protocol");
  }
  /// Whether the call enqueued as `epoch` in `slot` finished on the device. Never blocks.
  virtual absl::StatusOr<bool> Completed(int slot, uint64_t epoch) { return true; }
  /// Makes every wait of this rank's stream pass and its kernels store nothing, so the stream
  /// drains without its client or peers (a failed call, a timeout, close). Idempotent; call it
  /// again to unblock waits a late peer write re-armed.
  virtual void Cancel() {}
  /// Before the transport goes: ends this rank's device work (a stream-ordered transport
  /// cancels and waits, bounded, until its stream is idle; nccl first lets its peers get past
  /// its last completed call, also bounded). False when the work did not end:
  /// the caller then keeps the transport, and what the calls used, for the process's life.
  virtual bool Drain() { return true; }
  /// For a stream-ordered call that did not finish in time: the protocol words it waits on, as
  /// the device holds them now (which hand-off never came). Bounded; empty when not applicable.
  virtual std::string DescribeStuck(int slot, uint64_t epoch) { return {}; }

  /// Byte offset of `slot` inside the client's mapping.
  virtual uint64_t SlotOffset(int slot) const = 0;
  virtual ClientSlotMapping ClientMapping() const = 0;
  /// Device memory (bytes) this transport allocated (a fused session's plan included), charged
  /// to the slot budget: 0 on the host backend.
  virtual uint64_t DeviceBytes() const = 0;
  /// describe(): how this session's calls run (kernels, path per prepared row count and why).
  virtual std::string Describe() const = 0;
};

/// For CheckPeers: FAILED_PRECONDITION naming the first rank but `me` whose slot handle
/// `ours` refuses (it runs another backend), with `advice` appended; OK when every one is ours.
absl::Status CheckPeersRunThisBackend(const std::vector<std::string>& handles, int me,
                                      const std::function<bool(int, const std::string&)>& ours,
                                      std::string_view advice = {});

/// A client buffer as the daemon holds it.
struct Buffer {
  uint64_t id = 0;
  std::string name;
  uint64_t size = 0;
  bool device = false;  ///< device memory (CUDA IPC or VMM), else a memfd mapping
  void* data = nullptr; ///< where the daemon addresses it
  /// Keeps the memory mapped (the memfd mapping, the IPC or VMM mapping).
  std::shared_ptr<void> keep;
  /// AllocBuffer's descriptor (memfd / VMM fd) until it is sent to the client; closed then.
  ipc::UniqueFd fd;
  uint64_t allocation_id = 0;  ///< CUDA buffer id of a registered allocation (0: none)
};

/// A fused session as this daemon runs it: its geometry, the path asked for, and its weights
/// as this daemon addresses them (host or device pointers into the owner's registered
/// buffers, which the Session keeps mapped for the transport's lifetime).
struct FusedSetup {
  FusedGeometry geometry;
  FusedPath path = FusedPath::kAuto;
  kernels::QkvWeights weights{};
  /// GPU backends: project on the epilogue path's CUTLASS GEMM where it exists
  /// (fused.projection cutlass; FusedRunner).
  bool cutlass_projection = false;
};

/// How a session's rank addresses its own control segment and slots; filled by Session.
struct TransportSetup {
  SessionGeometry geometry;  ///< a fused session's slots: SlotGeometry(fused->geometry)
  std::optional<FusedSetup> fused;  ///< set for a qkv_norm_rope_exchange session
  uint64_t slot_bytes = 0;
  uint8_t* own_segment = nullptr;  ///< this rank's control segment
  uint64_t slots_offset_bytes = 0; ///< host backend: slots start here in every rank's segment
  uint64_t slot_stride_bytes = 0;
  int segment_fd = -1;             ///< this rank's control segment fd
  uint64_t segment_bytes = 0;
  /// OK while a call of the given epoch can still complete (Session::CanComplete): transports
  /// that wait on the host ask it between polls.
  std::function<absl::Status(uint64_t epoch)> can_complete;
  /// True once no peer can still be working on `epoch`: each completed it, or left (its
  /// session gone or broken, its daemon gone) (Session::PeersPast). A transport whose peers may
  /// still be receiving what this rank sent asks it before its connections go.
  std::function<bool(uint64_t epoch)> peers_past;
};

/// The GPU a daemon serves, as operators and the device plugin name it. Empty on the host.
struct DeviceIdentity {
  std::string uuid;        ///< "GPU-..."
  std::string pci_bus_id;  ///< "0000:18:00.0"
  int numa_node = -1;
};

/// Device memory a stuck call's report reads, and where on the host it goes
/// (Backend::ReadDeviceWords).
struct DeviceRead {
  const void* from = nullptr;
  void* to = nullptr;
  size_t bytes = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  /// "host", "nvlink" or "nccl".
  virtual std::string_view name() const = 0;
  /// Whether receive slots live in the control segment (host) or apart (device memory).
  virtual bool slots_in_segment() const = 0;
  /// A new Transport for one session on this rank.
  virtual absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransportSetup& setup) = 0;
  /// Device memory a transport of a `world_size`-rank session with slots of `slot_bytes` holds
  /// beyond its slots (NCCL's send and receive staging), for the slot budget.
  virtual uint64_t StagingBytes(int world_size, uint64_t slot_bytes) const { return 0; }
  /// Device memory a fused session's plan of `setup` holds (GEMM workspace, projection
  /// buffer), for the slot budget: 0 where the plan is not in device memory.
  virtual uint64_t FusedPlanBytes(const FusedSetup& setup) const { return 0; }
  /// A zero-filled buffer the daemon allocates for a client; its `fd` is what the client maps.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> AllocBuffer(uint64_t bytes) = 0;
  /// A client's device allocation opened from its cudaIpcMemHandle_t bytes; `size_bytes` is the
  /// size the client claims, checked against the allocation. FAILED_PRECONDITION on the host.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> ImportIpcBuffer(const std::string& handle,
                                                                  uint64_t size_bytes) = 0;
  /// A client's device memory made of CUDA VMM allocations mapped back to back (their fds and
  /// sizes, in address order), mapped here the same way. FAILED_PRECONDITION on the host.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> ImportVmmBuffer(
      std::span<const ipc::cuda::VmmMapping::Part> parts) = 0;
  /// Whether `peer_device` can exchange with this daemon's device through this backend.
  virtual absl::StatusOr<bool> CanReach(int peer_device) const = 0;
  /// MPS mode: "mps", "no-mps" or "none".
  virtual std::string_view mps_mode() const = 0;
  /// OK while the device still serves this daemon; else why not (a GPU backend whose CUDA
  /// context took a sticky error, or whose MPS server tore it down). Cheap and non-blocking:
  /// the daemon asks about once a second.
  virtual absl::Status DeviceHealth() const { return absl::OkStatus(); }
  virtual DeviceIdentity identity() const { return {}; }
  /// GPU backends: the device's streams by hardware queue (the probe's lanes, those in use,
  /// the distinct streams handed out since start, those handed out on a shared queue, the
  /// sessions refused).
  virtual QueueLaneCounts Queues() const { return {}; }
  /// GPU backends: a stream (a cudaStream_t) for `role` from the device's hardware queue lanes
  /// (QueueLanes::Take; `apart` as there), for another backend's sessions on the same device;
  /// given back idle with GiveStream, or retired with RetireStream when its work never ended.
  /// UNIMPLEMENTED elsewhere.
  virtual absl::StatusOr<void*> TakeStream(StreamRole role, void* apart) {
    return absl::UnimplementedError("this backend has no device streams");
  }
  virtual void GiveStream(void* stream) {}
  virtual void RetireStream(void* stream) {}
  /// The session `stream` was taken for finished the setup work its thread waited for there:
  /// until then no later session shares its queue while another lane can serve it.
  virtual void SetupDone(void* stream) {}
  /// Where setup work beside `stream` that a host thread waits for goes: `stream`, or a stream
  /// no session's wait holds back where `stream` shares its queue with another session's.
  virtual void* SetupStreamFor(void* stream) { return stream; }
  /// GPU backends: the device's rescue stream (a cudaStream_t that no session's wait holds
  /// back, which runs cancels), for another backend's sessions on the same device. Null
  /// elsewhere.
  virtual void* RescueStream() { return nullptr; }
  /// GPU backends: the device's pinned words of kUnblockEpoch that cancels copy (null where
  /// there are none).
  virtual const uint64_t* UnblockWordsOfDevice() { return nullptr; }
  /// GPU backends: makes each of `reads`, through the rescue stream (which no session's wait
  /// holds back) and the device's pinned memory; one ReadDeviceWords at a time, waited for at
  /// most a second (a rescue stream that cannot run is itself the finding: DEADLINE_EXCEEDED).
  /// What a stuck call's report reads (DescribeStuck). UNIMPLEMENTED elsewhere.
  virtual absl::Status ReadDeviceWords(std::span<const DeviceRead> reads) {
    return absl::UnimplementedError("this backend has no device memory");
  }
  /// GPU backends: which hardware queue `stream` (a cudaStream_t of TakeStream) is on and
  /// whether another session's stream shares it ("hardware queue 3, its own"); empty
  /// elsewhere.
  virtual std::string StreamPlace(void* stream) const { return {}; }
};

/// The host backend: buffers are memfds, slots live in the session segments, the CPU
/// references move the data.
std::unique_ptr<Backend> MakeHostBackend();

class FdExports;
/// How the GPU backend keeps its streams (config object `queues`).
struct CudaBackendOptions {
  /// Streams probed at start for shared hardware queues; 0: no probe (QueueLanes).
  int queue_probe_streams = 0;
  /// Past the probed queues: make streams that may share one (true) or refuse (false).
  bool queue_sharing = true;
  /// How long a closing session's device work may take to end after its cancel before the
  /// session is kept, undrained, for the daemon's life (Transport::Drain). A session whose
  /// stream shares a queue can sit behind another session's wait until that call times out,
  /// so the daemon sets this past its call timeout (DrainLimitFor).
  absl::Duration drain_limit = absl::Seconds(30);
};
/// The drain limit for a daemon whose calls time out after `call_timeout`: 30 s, or the call
/// timeout and 5 s more where that is longer, at most a day (a deadline that stays a time).
absl::Duration DrainLimitFor(absl::Duration call_timeout);
/// The GPU backend on `device` (symmetric device memory shared through VMM fds, the CUDA
/// exchange kernels). FAILED_PRECONDITION when this build or machine has no usable GPU.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, FdExports* exports,
                                                         const CudaBackendOptions& options = {});

/// The NCCL backend on `device`: receive slots in device memory that only this daemon and its
/// client map; each call packs the blocks, moves them with grouped ncclSend/ncclRecv and unpacks
/// them into the slot. Client buffers go through `device_backend` (MakeCudaBackend's). Waits on
/// NCCL inside a call are bounded by `call_timeout`. FAILED_PRECONDITION when this build has no
/// NCCL.
absl::StatusOr<std::unique_ptr<Backend>> MakeNcclBackend(int device, absl::Duration call_timeout,
                                                         std::unique_ptr<Backend> device_backend);

/// The argument that starts ulyssesd as the nccl backend's bootstrap-root helper.
inline constexpr char kNcclRootHelperArg[] = "--nccl-root-helper";

/// The helper's whole run (`ulyssesd --nccl-root-helper`): makes an NCCL unique id, which
/// starts NCCL's bootstrap root (a thread and a listening socket) in this process, writes
/// "ok <id in hex>" or "error <why>" as one line on standard output, and returns once standard
/// input is closed (its daemon is done with the root, or gone). Returns the exit status.
int RunNcclRootHelper();

}  // namespace ulysses::daemon
