// libulysses: the client library of ulyssesd. A framework process connects to its GPU's daemon,
// allocates (or registers) shared buffers, joins a group with the other ranks, creates a
// session, and runs the head-exchange calls or the fused QKV call (qkv_norm_rope_exchange). Results land in daemon-owned receive slots that
// are mapped into this process (zero-copy views), or are copied into a caller buffer (`out`).
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ulysses/common/fused.h"
#include "ulysses/common/geometry.h"

namespace ulysses::v1 {
class CreateSessionRequest;
}

namespace ulysses::client {

class ClientImpl;

/// How to reach a daemon.
struct ConnectOptions {
  std::string socket;             ///< control socket path, e.g. /run/ulysses/gpu0.sock
  std::string name;               ///< shown to operators (ulyssesctl clients)
  absl::Duration connect_timeout = absl::Seconds(10);
  /// Submit calls through the shared-memory rings (no RPC per call). When false, or when the
  /// daemon offers no rings, every call is a Call RPC; results are the same.
  bool use_rings = true;
};

/// A shared buffer mapped into this process. Owned by the Client; valid until FreeBuffer or
/// Close.
struct Buffer {
  uint64_t id = 0;
  /// Host memory (host backend), or a device pointer (GPU backends: AllocBuffer's device memory,
  /// or the pointer given to RegisterDeviceBuffer).
  void* data = nullptr;
  uint64_t size = 0;
  /// Whether `data` is device memory.
  bool device = false;
  /// Offset of `data` inside the registration `id` names (a device pointer registered inside a
  /// larger allocation shares the allocation's registration).
  uint64_t base_offset = 0;
  /// Device memory: the CUDA device it is on, and the size of the whole registration `id`
  /// names (the allocation holding `data`). -1 and 0 for host memory.
  int device_index = -1;
  uint64_t registration_size = 0;
  /// A reference to this buffer at `offset_bytes` from `data` (contiguous unless strides given).
  OperandRef Ref(uint64_t offset_bytes = 0, std::array<int64_t, 4> strides = {}) const {
    return OperandRef{id, base_offset + offset_bytes, strides};
  }
  /// A dense tensor of `dtype` and `shape` (at most 4 extents) at `offset_bytes` from `data`,
  /// as a fused session's weights are registered.
  FusedTensorRef Tensor(DType dtype, std::initializer_list<int64_t> shape,
                        uint64_t offset_bytes = 0) const {
    FusedTensorRef t;
    t.buffer_id = id;
    t.offset_bytes = base_offset + offset_bytes;
    t.dtype = dtype;
    t.rank = static_cast<int32_t>(shape.size());
    int i = 0;
    for (int64_t d : shape)
      if (i < 4) t.shape[i++] = d;
    return t;
  }
};

/// What JoinGroup needs. Every rank passes the same name, world size and members.
struct GroupSpec {
  std::string name;
  int32_t world_size = 1;
  int32_t rank = 0;
  std::vector<std::string> members;  ///< each rank's daemon socket path, index = rank
  std::string backend = "auto";
  int64_t timeout_ms = 0;            ///< 0: the daemon's peer timeout
};

/// A joined group.
struct Group {
  uint64_t id = 0;
  std::string name;
  int32_t world_size = 0;
  int32_t rank = 0;
  std::string backend;
  std::string backend_reason;
};

/// A session's geometry (world size and rank come from the group).
struct SessionSpec {
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kBFloat16;
  int64_t max_tokens = 0;
  int32_t num_slots = 2;
  std::vector<int32_t> schedule;
  int64_t timeout_ms = 0;
};

/// A qkv_norm_rope_exchange session: the fused QKV projection + QK-RMSNorm + RoPE + head
/// exchange (docs/api.md section 2.1). World size and rank come from the group. The weights are
/// tensors in this client's registered buffers (host memory on the host backend, device memory
/// on a GPU backend); the daemon keeps them mapped for the session's lifetime and reads them at
/// every call, so they must stay unchanged while calls run.
struct FusedSessionSpec {
  int32_t hidden = 0;                    ///< = num_heads * head_dim, a multiple of 64
  int32_t num_heads = 0;                 ///< H, divisible by the world size
  int32_t head_dim = kFusedGpuHeadDim;   ///< D: even; 128 on the GPU backend
  QkvLayout layout = QkvLayout::kBshd;
  int64_t max_tokens = 0;                ///< bound on B*S_l of every call
  int32_t num_slots = 2;
  int32_t max_pos = 0;                   ///< rows of the cos/sin table
  DType dtype = DType::kBFloat16;        ///< only bfloat16
  FusedPath path = FusedPath::kAuto;     ///< GPU path; auto: the daemon's rule per row count
  /// w_qkv bf16 [3*H*D, hidden], q_norm/k_norm bf16 [D], cos_sin fp32 [max_pos, D], each
  /// 32-byte aligned (Buffer::Tensor makes them).
  FusedWeightsArgs weights;
  int64_t timeout_ms = 0;
};

class SlotHold;
class StreamWords;

/// The result of a call: a read-only view of this rank's receive slot. The slot stays held
/// (the daemon never overwrites it) while any copy of this Result lives or until Release(); the
/// session's call that needs the slot next waits for that. A result copied to `out` holds
/// nothing.
struct Result {
  uint64_t epoch = 0;
  int32_t slot = 0;
  std::array<int64_t, 4> shape{};
  /// The result in the receive slot: host memory, or device memory (read-only) when `device`.
  const void* data = nullptr;
  bool device = false;
  uint64_t bytes = 0;
  int64_t daemon_us = 0;  ///< time the daemon spent on the call
  /// Gives the slot back now; `data` must not be read afterwards. Idempotent.
  absl::Status Release();
  /// Whether this result still holds its slot.
  bool held() const { return hold_ != nullptr; }

 private:
  friend class Session;
  std::shared_ptr<SlotHold> hold_;
};

/// A prepared head exchange on a group. Calls are collective: every rank issues the same calls
/// in the same order. Not thread-safe (one call at a time, like a CUDA stream's order).
class Session {
 public:
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// x[B,S_l,H,D] -> [B,S_g,H/W,D]: this rank's head band over the whole sequence.
  absl::StatusOr<Result> ScatterHeads(const OperandRef& x, int64_t batch, int64_t seq_local,
                                      const OperandRef& out = {});
  /// y[B,S_g,H/W,D] -> [B,S_l,H,D]: the inverse.
  absl::StatusOr<Result> GatherHeads(const OperandRef& y, int64_t batch, int64_t seq_global,
                                     const OperandRef& out = {});
  /// q,k,v[B,S_l,H,D] (strided views allowed) -> [B,S_g,HC,3D] for local heads
  /// [head_offset, head_offset+head_count).
  absl::StatusOr<Result> ScatterQkvHeadChunk(const OperandRef& q, const OperandRef& k,
                                             const OperandRef& v, int64_t batch,
                                             int64_t seq_local, int32_t head_offset,
                                             int32_t head_count, const OperandRef& out = {});
  /// x[B,S_g,HC,D] -> writes only the band of out[B,S_l,H,D]; other heads stay untouched.
  absl::StatusOr<Result> GatherOutputHeadChunk(const OperandRef& x, int64_t batch,
                                               int64_t seq_global, int32_t head_offset,
                                               int32_t head_count, const OperandRef& out);
  /// The fused call of a qkv_norm_rope_exchange session: x bf16 [B,S_l,hidden] and positions
  /// int32 [B,S_l] (both contiguous, x 32-byte aligned) -> this rank's head band over S_g.
  /// bshd: three Results q, k, v, each [B,S_g,H_l,D]; fused: one [B,S_g,H_l,3D]. The views
  /// share one receive slot, held until every one of them is dropped or any one is released
  /// (Release() gives the slot back for all). With `out`
  /// (contiguous, 3*B*S_g*H_l*D bf16: the planes one after the other for bshd), the result is
  /// copied there, the slot released at once, and the views point into `out`.
  absl::StatusOr<std::vector<Result>> QkvNormRopeExchange(const OperandRef& x,
                                                          const OperandRef& positions,
                                                          int64_t batch, int64_t seq_local,
                                                          const OperandRef& out = {});
  /// QkvNormRopeExchange through the call rings: queues the call and returns its epoch at once
  /// (UNIMPLEMENTED without rings). WaitQkvNormRopeExchange gives its views, as the call would
  /// have returned them. x, positions and out must stay unchanged until then.
  absl::StatusOr<uint64_t> SubmitQkvNormRopeExchange(const OperandRef& x,
                                                     const OperandRef& positions, int64_t batch,
                                                     int64_t seq_local, const OperandRef& out = {});
  absl::StatusOr<std::vector<Result>> WaitQkvNormRopeExchange(
      uint64_t epoch, absl::Duration timeout = absl::Minutes(5));
  /// Any call, as CallArgs. Validated here first (the same verdict the daemon reaches).
  absl::StatusOr<Result> Call(const CallArgs& args);
  /// Submits a call through the ring and returns its epoch at once; Wait(epoch) gives its
  /// result. Calls complete in submission order. UNIMPLEMENTED without rings.
  absl::StatusOr<uint64_t> Submit(const CallArgs& args);
  /// Waits for the result of a submitted call. An error the daemon found after submission
  /// (the asynchronous kind) is returned here with its code and message.
  absl::StatusOr<Result> Wait(uint64_t epoch, absl::Duration timeout = absl::Minutes(5));
  /// Waits until every call issued so far finished on the daemon (and, on a GPU session, the
  /// stream reached them), and returns the first error the daemon found in calls nobody waited
  /// for (stream-ordered calls report their errors here or at the next call).
  absl::Status Synchronize(absl::Duration timeout = absl::Minutes(5));
  /// Closes the session on this rank. Idempotent. On a GPU session the calls already pushed
  /// run to their end first (waited for up to 10 s; past that the close aborts them), so their
  /// results stay readable after the close.
  absl::Status Close();
  /// The views the last call of this session that returned gave (a fused call's q, k, v or
  /// its one band; any other call's one Result), for code that did not keep them. They share
  /// that call's hold: valid while a view the call returned still holds the slot, or always
  /// when the call copied into `out` (they point into it). The session's own record never
  /// holds a slot. FAILED_PRECONDITION when no call returned yet, or when that result was
  /// given back (every view dropped, or one released): its slot may be reused by then.
  absl::StatusOr<std::vector<Result>> LastOutputs() const;
  /// Fills this rank's receive slots that are not held with NaN (all bits set); for tests.
  /// Returns how many slots were filled.
  absl::StatusOr<int> PoisonSlots();

  /// describe(): how this session's calls run on the daemon (for a fused session the path per
  /// prepared row count and why), as the daemon reports it now.
  absl::StatusOr<std::string> Describe();

  uint64_t id() const { return id_; }
  SessionKind kind() const {
    return fused_ ? SessionKind::kQkvNormRopeExchange : SessionKind::kHeadExchange;
  }
  /// The slots' geometry (for a fused session: SlotGeometry of fused_geometry()).
  const SessionGeometry& geometry() const { return geometry_; }
  /// A fused session's geometry; null for a head-exchange session.
  const FusedGeometry* fused_geometry() const { return fused_ ? &*fused_ : nullptr; }
  const std::string& backend() const { return backend_; }
  /// GPU backends: the CUDA stream (a cudaStream_t; nullptr is the legacy default stream)
  /// whose work produces this session's inputs and consumes its results. Once it is set, calls
  /// through the rings are stream-ordered (docs/protocol.md section 9): the call is enqueued
  /// after the work already on the stream and returns at once; its result is valid for work
  /// enqueued on the stream afterwards; releasing it is ordered after that work too. An error
  /// the daemon finds later is raised by the next call or by Synchronize(). Without
  /// set_stream, a call waits on the host and its result is complete when it returns.
  void set_stream(void* stream) {
    stream_ = stream;
    stream_ordered_ = true;
  }
  void* stream() const { return stream_; }

 private:
  friend class Client;
  Session() = default;
  absl::StatusOr<CallPlan> Plan(const CallArgs& args) const;
  absl::StatusOr<Result> CallImpl(const CallArgs& args);
  absl::StatusOr<Result> WaitImpl(uint64_t epoch, absl::Duration timeout);
  // Records the views a call returned for LastOutputs (without their hold).
  void Remember(const Result* views, size_t count);
  absl::StatusOr<CallArgs> FusedCallArgs(const OperandRef& x, const OperandRef& positions,
                                         int64_t batch, int64_t seq_local,
                                         const OperandRef& out) const;
  absl::StatusOr<std::vector<Result>> FusedViews(Result whole, const OperandRef& out) const;
  absl::StatusOr<uint64_t> SubmitPlanned(const CallArgs& args, CallPlan* plan);
  std::shared_ptr<SlotHold> NewHold(uint64_t epoch, int32_t slot);
  bool stream_protocol() const;
  std::shared_ptr<ClientImpl> client_;
  uint64_t id_ = 0;
  SessionGeometry geometry_;
  std::optional<FusedGeometry> fused_;
  FusedWeightsArgs fused_weights_;
  std::string backend_;
  std::shared_ptr<void> segment_;  // read-only mapping of the session segment
  std::shared_ptr<void> device_slots_;  // GPU backends: read-only mapping of the device slots
  bool device_ = false;
  void* stream_ = nullptr;
  bool stream_ordered_ = false;
  // The stream-ordered protocol (GPU sessions): this client's device words (ready and
  // released, written by its streams; shared with the results handed out), the daemon's device
  // words at the start of the slots mapping, and the slots' place in that mapping.
  std::shared_ptr<StreamWords> stream_words_;
  const void* device_words_ = nullptr;
  uint64_t slot_offset_ = 0;
  uint64_t slot_stride_ = 0;
  std::vector<std::weak_ptr<SlotHold>> holds_;  // per slot: the last result handed out
  // LastOutputs: the last call's views without their hold, that hold (weak), and whether the
  // call held a slot at all (false: it copied into out).
  std::vector<Result> last_;
  std::weak_ptr<SlotHold> last_hold_;
  bool last_held_ = false;
  absl::Status OrderAfterStream() const;
  const uint8_t* base_ = nullptr;
  bool closed_ = false;
  // The client-segment word that releases `slot`, or null (release through the RPC).
  std::atomic<uint64_t>* ReleaseWord(int32_t slot) const;
  int32_t release_index_ = -1;
  uint64_t next_epoch_ = 1;  // ring path: the epoch the next submitted call gets
  std::map<uint64_t, bool> has_out_;  // ring path: submitted epochs -> whether out= was given
  std::map<uint64_t, OperandRef> fused_out_;  // submitted fused calls with out: their out
};

/// One attached client process. Thread-safe, except that each Session is used by one thread.
class Client {
 public:
  /// Connects, attaches and binds the fd socket. UNAVAILABLE when no daemon answers.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ConnectOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// A new shared buffer of `size_bytes`, zero-filled, mapped here and in the daemon.
  absl::StatusOr<Buffer> AllocBuffer(uint64_t size_bytes, const std::string& name = "");
  /// Registers a memfd this process created (its size must be sealed: F_SEAL_SHRINK|GROW).
  absl::StatusOr<Buffer> RegisterBuffer(int memfd, const std::string& name = "");
  /// GPU backends: registers `bytes` of device memory at `ptr` (e.g. a tensor from a caching
  /// allocator). The allocation containing it is handed to the daemon through its CUDA IPC
  /// handle once and cached (keyed by the allocation's CUDA buffer id, so a freed and re-made
  /// allocation at the same address is registered afresh); later calls for the same allocation
  /// cost no RPC, and one driver query. Memory of CUDA VMM allocations (cuMemCreate with a
  /// POSIX-fd handle type, such as torch's expandable segments) goes as the fds of the mappings
  /// that cover [ptr, ptr + bytes), at most 64 of them, each mapping
  /// its allocation whole; it is cached by the mappings' CUDA buffer ids, so a piece unmapped
  /// and mapped again is registered afresh. The returned Buffer's Ref() addresses `ptr`. With
  /// `device` >= 0 the memory must be on that CUDA device (INVALID_ARGUMENT otherwise, before
  /// anything is registered).
  absl::StatusOr<Buffer> RegisterDeviceBuffer(void* ptr, uint64_t bytes, const std::string& name = "",
                                              int device = -1);
  /// Whether `buffer_id` is a buffer this client holds (registered or allocated, not freed).
  bool HoldsBuffer(uint64_t buffer_id) const;
  absl::Status FreeBuffer(uint64_t buffer_id);
  /// Collective: joins (forms) a group with the other ranks' daemons.
  absl::StatusOr<Group> JoinGroup(const GroupSpec& spec);
  /// Leaves a joined group whose sessions are all closed (FAILED_PRECONDITION naming one that
  /// is not; NOT_FOUND for a group this client did not join). The other ranks' later sessions
  /// of the group then fail at once with ABORTED naming this rank.
  absl::Status LeaveGroup(const Group& group);
  /// Collective over the group: every rank passes the same spec.
  absl::StatusOr<std::unique_ptr<Session>> CreateSession(const Group& group,
                                                         const SessionSpec& spec);
  /// Collective over the group: a qkv_norm_rope_exchange session. Every rank passes the same
  /// geometry and path, and its own weights (validated here and by the daemon before the
  /// rendezvous; a rank whose weights are refused fails every rank).
  absl::StatusOr<std::unique_ptr<Session>> CreateFusedSession(const Group& group,
                                                              const FusedSessionSpec& spec);
  /// Detaches: the daemon releases everything this client holds. Idempotent.
  absl::Status Close();

  uint64_t client_id() const;
  /// Backend the daemon runs.
  const std::string& daemon_backend() const;
  /// The daemon's MPS mode: "mps", "no-mps" (GPU without MPS) or "none" (host backend).
  const std::string& daemon_mps_mode() const;
  /// Whether calls go through the shared-memory rings.
  bool uses_rings() const;

 private:
  explicit Client(std::shared_ptr<ClientImpl> impl) : impl_(std::move(impl)) {}
  // RegisterDeviceBuffer for memory of CUDA VMM allocations (their mappings' fds).
  absl::StatusOr<Buffer> RegisterVmmBuffer(void* ptr, uint64_t bytes, const std::string& name,
                                           int device);
  // Sends CreateSession and maps the new session's segment and slots.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const v1::CreateSessionRequest& request,
                                                       const SessionGeometry& g);
  std::shared_ptr<ClientImpl> impl_;
};

}  // namespace ulysses::client
