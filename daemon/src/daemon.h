// ulyssesd: the per-GPU daemon. Serves Control (clients), Admin (operators) and Peer (other
// daemons) over gRPC on a unix socket, and passes file descriptors on a second socket.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <array>
#include <map>
#include <optional>
#include <span>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "ulysses/common/config.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/logging.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/doorbell.h"
#include "ulysses/ipc/eventfd.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"
#include "connection_gate.h"
#include "fd_exports.h"
#include "headroom.h"
#include "quotas.h"
#include "rendezvous.h"
#include "session.h"
#include "telemetry.h"
#include "reaper.h"
#include "worker_watch.h"

namespace httplib {
class Server;
}

namespace ulysses::daemon {

/// Longest a send on a client's fd socket waits for the client to read (SendToClient).
inline constexpr int kClientSendTimeoutMs = 1000;
/// How long a client's ring worker waits for a descriptor, with no call in flight, before it
/// ends; the fd thread starts it again at the client's next ring of the submit bell.
inline constexpr absl::Duration kRingWorkerIdle = absl::Seconds(1);

/// A group as one client of this daemon joined it.
struct Group {
  uint64_t id = 0;
  std::string name;
  int32_t world_size = 0;
  int32_t rank = 0;
  std::vector<std::string> members;
  std::string backend;
  std::string backend_reason;
  Backend* impl = nullptr;  ///< the daemon's backend that runs it (Daemon::backend_impl or nccl_backend)
  uint64_t owner_client = 0;
  std::atomic<uint64_t> sessions_created{0};  // collective counter: same on every rank
  std::string instance;  ///< rank 0's join nonce: the same on every rank, new for every join
};

/// The start of every session rendezvous key of group instance `g`: "session/<name>/<instance>/".
std::string SessionKeyPrefix(const Group& g);

/// The call fast path of one client: its shared segment, rings and doorbells.
struct ClientRings {
  ipc::UniqueFd memfd;
  ipc::Mapping mapping;
  ipc::ClientSegmentHeader* header = nullptr;
  ipc::SubmitRing* submit = nullptr;
  ipc::CompletionRing* complete = nullptr;
  // Doorbells (docs/protocol.md section 2.5): the waiting end of the one the client rings
  // after pushing a descriptor, and the ringing end of the one the daemon rings after posting
  // a completion. The client's ends go to it in the hello's answer, and the daemon keeps
  // them too: the submit bell's ringing end wakes the worker at a reclaim, and with both held
  // neither bell hangs up, whatever the client closes (a client that does not use the rings
  // closes them), and the daemon's descriptors do not change once the answer is sent.
  ipc::Doorbell submit_bell;
  ipc::Doorbell submit_ring;
  ipc::Doorbell complete_bell;
  ipc::Doorbell complete_wait;
  /// Set when the client is reclaimed or the daemon stops: the ring worker's stop word. The
  /// segment's abort word tells the client; the client can write that one, so the worker does
  /// not take its orders from it.
  std::atomic<uint64_t> stop{0};
  /// Whether a ring worker serves these rings now; written under Daemon::workers_mu_. While it
  /// is false, the fd thread watches submit_bell and starts one at the next ring.
  std::atomic<bool> worker_running{false};
  /// The ring worker's current step, for the stall watchdog (timeouts.worker_stall_ms).
  WorkerWatch watch;
};

/// One attached client process.
struct ClientRecord {
  uint64_t id = 0;
  std::string token;
  std::string name;
  pid_t pid = 0;  // from SO_PEERCRED of the fd socket
  int64_t reported_pid = 0;  // as the client reported it at Attach (shown, never acted on)
  uid_t uid = 0;
  absl::Time since;
  std::atomic<uint64_t> calls{0};
  /// Control requests in progress (limits.calls_in_progress_per_client; RequestPlace).
  std::atomic<int32_t> requests_in_progress{0};
  /// CreateSession requests refused a place that still arrive at the rendezvous (at most
  /// limits.calls_in_progress_per_client).
  std::atomic<int32_t> refused_arriving{0};
  /// The warnings this client can cause at will (bad fd frames), rate-limited.
  LogBudget log_budget;

  std::mutex mu;  // guards everything below
  bool gone = false;  // reclaimed: nothing may be added any more
  grpc::CallbackServerContext* watch = nullptr;  // the open Watch stream, cancelled by Reclaim
  std::condition_variable fd_cv;
  ipc::UniqueFd fd_socket;  // bound once the client's hello arrives
  ipc::UniqueFd pidfd;      // readable once the client's process has exited
  std::map<uint64_t, ipc::UniqueFd> incoming_fds;  // tag -> fd, sent by the client
  std::map<uint64_t, std::shared_ptr<Buffer>> buffers;
  std::map<uint64_t, std::shared_ptr<Group>> groups;
  std::map<uint64_t, std::shared_ptr<Session>> sessions;
  std::mutex send_mu;  // serializes frames sent to the client
  std::shared_ptr<ClientRings> rings;  // set once the fd socket is bound
  // Charged against limits.*: the buffers' bytes and count, and whether this client counts
  // among its uid's bound clients.
  uint64_t charged_bytes = 0;
  int32_t charged_buffers = 0;
  bool counted_in_uid = false;
  /// The uid of the control connection Attach came on, counted among its unbound clients
  /// (limits.unbound_clients_per_uid) until the client binds or goes; unset when not counted.
  std::optional<uid_t> unbound_uid;
  int32_t groups_joining = 0;  // JoinGroup requests in progress (limits.groups_per_client)
  /// Sessions open or being created (limits.sessions_per_client): shared with their charges,
  /// which end with the sessions themselves.
  std::shared_ptr<std::atomic<int32_t>> sessions_charged =
      std::make_shared<std::atomic<int32_t>>(0);
  // Rows of the segment's release words handed out so far; rows are never reused, so a late
  // write for a closed session cannot release a slot of a newer one.
  int32_t release_rows_used = 0;

  /// The sessions open now, in id order, for a reader that must not hold `mu` while it looks
  /// into them (takes `mu` for the copy).
  std::vector<std::shared_ptr<Session>> SessionsNow() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::shared_ptr<Session>> out;
    out.reserve(sessions.size());
    for (const auto& [id, s] : sessions) out.push_back(s);
    return out;
  }
  /// Its uid once its fd socket is bound (the uid is known only from then on); takes `mu`.
  std::optional<uint32_t> BoundUid() {
    std::lock_guard<std::mutex> lock(mu);
    if (!fd_socket.valid()) return std::nullopt;
    return static_cast<uint32_t>(uid);
  }
};

/// A fused session's weights resolved against its owner's buffers: the pointers the kernels
/// read and the buffers that keep them mapped.
struct FusedWeightsHeld {
  kernels::QkvWeights weights{};
  std::vector<std::shared_ptr<Buffer>> buffers;
};

/// What a call produced, for either path (RPC or ring).
struct CallResult {
  CallOutcome outcome;
  std::array<int64_t, 4> out_shape{};
  int64_t elapsed_us = 0;
};

/// A ring call enqueued on a stream-ordered session and not finished yet: what its completion
/// needs once Session::TakeFinished reports it.
struct PendingCall {
  std::weak_ptr<Session> session;
  uint64_t session_id = 0;
  uint64_t epoch = 0;
  std::array<int64_t, 4> out_shape{};
  CallRecord record;
};

class Daemon {
 public:
  explicit Daemon(DaemonConfig config);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  /// Binds the sockets, starts the gRPC server and the fd-socket threads, writes the ready file.
  absl::Status Start();
  /// Stops serving, reclaims every client, removes the sockets and the ready file. Idempotent.
  void Shutdown();

  const DaemonConfig& config() const { return config_; }
  const std::string& backend() const { return backend_; }
  /// Why this backend runs (the probe's verdict, or the flag that forced it).
  const std::string& backend_reason() const { return backend_reason_; }
  Backend& backend_impl() { return *backend_impl_; }
  /// An nvlink daemon started with `auto` also holds the nccl backend, for groups whose
  /// devices cannot all map each other's memory; null otherwise.
  Backend* nccl_backend() { return nccl_impl_.get(); }

  // --- used by the services ---
  absl::StatusOr<std::shared_ptr<ClientRecord>> Authenticate(const grpc::ServerContextBase* ctx);
  /// `connection_uid`: the uid of the control connection Attach came on (the gate's), against
  /// which the client counts until it binds.
  absl::StatusOr<std::shared_ptr<ClientRecord>> AttachClient(const std::string& name,
                                                             int64_t reported_pid,
                                                             uid_t connection_uid);
  /// The uid of the control connection a call came on (ConnectionGate::UidOfPeer).
  std::optional<uid_t> ConnectionUid(const grpc::ServerContextBase& ctx) const {
    return control_gate_.UidOfPeer(ctx.peer());
  }
  /// Forgets a client and releases everything it held. Idempotent; logs one line.
  void Reclaim(uint64_t client_id, const std::string& reason);
  /// Sends a frame (JSON header + optional fd) to the client over its fd socket. Waits at most
  /// kClientSendTimeoutMs for a client that reads nothing; such a client is reclaimed (its
  /// stream is out of step) and the result is UNAVAILABLE.
  absl::Status SendToClient(ClientRecord& c, const std::string& header, int fd);
  absl::Status SendToClient(ClientRecord& c, const std::string& header, std::span<const int> fds);
  /// Charges one more buffer of `bytes` to the bound client `c` and to its uid, against
  /// limits.buffers_per_client, buffers_per_uid, buffer_bytes_per_client and
  /// buffer_bytes_per_uid:
  /// RESOURCE_EXHAUSTED naming the limit; FAILED_PRECONDITION before the client bound its fd
  /// socket (its uid is not known yet).
  absl::Status ChargeBuffer(ClientRecord& c, uint64_t bytes);
  /// Gives back one buffer's charge (at most what `c` still has charged).
  void UnchargeBuffer(ClientRecord& c, uint64_t bytes);
  /// Charges one more session to the bound client `c`, to its uid and to the daemon, against
  /// limits.sessions_per_client, sessions_per_uid and max_sessions: the charge comes back when
  /// the returned hold goes (the session keeps it: Session::Hold). RESOURCE_EXHAUSTED naming
  /// the limit; FAILED_PRECONDITION before the client bound its fd socket.
  absl::StatusOr<std::shared_ptr<const void>> ChargeSession(ClientRecord& c);
  /// Counts one more group `c` joins against limits.groups_per_client (those it joined and
  /// those it is joining, ClientRecord::groups_joining); the caller gives a counted join back
  /// once its verdict came, under c.mu, as the group is added to c.groups.
  absl::Status StartGroupJoin(ClientRecord& c);
  /// Waits (up to `wait`) for the fd the client sent under `tag`, and takes it.
  absl::StatusOr<ipc::UniqueFd> TakeIncomingFd(ClientRecord& c, uint64_t tag,
                                               absl::Duration wait = absl::Seconds(10));
  uint64_t NextId() { return next_id_.fetch_add(1); }
  RendezvousTable& rendezvous_table() { return rendezvous_table_; }
  /// What this daemon lends the node's other daemons (session segments, device slots).
  FdExports& peer_exports() { return peer_exports_; }
  RendezvousClient& rendezvous_client() { return rendezvous_client_; }
  /// RESOURCE_EXHAUSTED while no more than a headroom of the process's descriptors or
  /// mappings is left, for a request that would add to them for long (Attach, CreateSession).
  HeadroomGuard& headroom() { return headroom_; }
  /// Counts a refusal by `limit` and returns RESOURCE_EXHAUSTED: "<what> (limits.<name> = N)".
  absl::Status RefuseOverLimit(Limit limit, const std::string& what);
  /// Counts one more Control request in progress for the uid of the bound client `c`
  /// (limits.calls_in_progress_per_uid): true when counted, false for a client not bound yet
  /// (nothing counted), RESOURCE_EXHAUSTED when its uid has that many in progress. A counted
  /// request ends with LeaveUidRequest(c.uid). With `refused_arrival`, the same for a
  /// CreateSession refused its place that still arrives at its rendezvous (counted apart,
  /// against the same limit).
  absl::StatusOr<bool> EnterUidRequest(ClientRecord& c, bool refused_arrival = false);
  void LeaveUidRequest(uid_t uid, bool refused_arrival = false);
  /// A rank of group instance `g` left it (`why`): its session rendezvous fail at once for
  /// every rank, at rank 0's table (RendezvousClient::EndGroup; asynchronous, a failure is
  /// logged). Nothing for a group of one.
  void EndGroup(const Group& g, const std::string& why);
  std::vector<std::shared_ptr<ClientRecord>> Clients();
  /// Reserves receive-slot memory for a session of a client of `uid`, against the budget and
  /// against the uid's share of it; RESOURCE_EXHAUSTED naming the one it would pass.
  absl::Status ReserveSlotMemory(uid_t uid, uint64_t bytes);
  void ReleaseSlotMemory(uid_t uid, uint64_t bytes);
  /// Takes over `bytes` reserved by ReserveSlotMemory: they are given back when the last copy
  /// of the returned hold goes (a session holds its share until it is destroyed, after its
  /// device work ended, not when it is closed).
  std::shared_ptr<const void> SlotMemoryHold(uid_t uid, uint64_t bytes);
  /// What ReserveSlotMemory holds now, with what undrained sessions keep (Session::UndrainedBytes).
  uint64_t slot_memory_reserved() const;
  absl::Time started() const { return started_; }
  bool draining() const { return draining_.load(); }
  /// Refuses new clients and sessions from now on and turns health to NOT_SERVING.
  void Drain();
  /// Takes new clients and sessions again.
  void Undrain();
  /// Waits until no call runs (or `timeout`); true when idle.
  bool WaitIdle(absl::Duration timeout);
  /// Whether the device still serves this daemon (Backend::DeviceHealth, or the failpoint
  /// "device.lost" fired). The first failure logs it and turns health to NOT_SERVING; the
  /// caller then stops the daemon, for a supervisor to start it again.
  absl::Status CheckDevice();
  int active_calls() const { return active_calls_.load(); }
  /// "mps", "no-mps" or "none" (host backend).
  const std::string& mps_mode() const { return mps_mode_; }
  /// host:port the metrics endpoint listens on (the resolved port), empty when off.
  const std::string& metrics_address() const { return metrics_bound_; }

  /// The caller's session; another client's id is PERMISSION_DENIED, an unknown one NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Session>> FindSession(ClientRecord& c, uint64_t session_id);
  /// Validates a fused session's weights against client `c`'s buffers (ValidateFusedWeights,
  /// and memory of the kind this backend's kernels read) and resolves them. Nothing is kept on
  /// failure.
  absl::StatusOr<FusedWeightsHeld> ResolveFusedWeights(ClientRecord& c, const FusedGeometry& g,
                                                       const FusedWeightsArgs& w);
  /// Runs one call of client `c` (validation, execution, accounting, flight recorder). Used by
  /// the Call RPC (`expected_epoch` 0: the session's next epoch, whatever it is) and by the ring
  /// worker (the descriptor's epoch, never 0: ipc::CallArgsFromDescriptor refuses it).
  /// A ring call on a stream-ordered session (`mode.async`) may return with
  /// outcome.pending: then `pending` holds what FinishPending needs once it finished, and the
  /// call is still counted as active.
  absl::StatusOr<CallResult> Call(ClientRecord& c, uint64_t session_id, const CallArgs& args,
                                  uint64_t expected_epoch, ExecuteMode mode = {},
                                  PendingCall* pending = nullptr);
  /// Accounts a pending call's end (telemetry, flight recorder) and gives its result.
  absl::StatusOr<CallResult> FinishPending(PendingCall& p, absl::StatusOr<CallOutcome> outcome);

  /// Brackets a call for drain accounting and telemetry.
  void CallStarted();
  void CallFinished(CallRecord record);
  Metrics& metrics() { return metrics_; }
  FlightRecorder& recorder() { return *recorder_; }
  GaugeSnapshot Gauges();
  std::string RenderMetrics();

 private:
  /// The fd socket's one thread (fd_socket.cc): accepts, reads hellos and client frames
  /// without ever waiting on one peer, watches pidfds, reclaims clients that never bind.
  void FdLoop();
  /// Binds the connection `sock` to the client its hello names and sends the ack.
  void HandleHello(ipc::UniqueFd sock, const std::string& payload);
  /// A frame a bound client sent: a descriptor for RegisterBuffer.
  void HandleClientFrame(ClientRecord& c, ipc::ReceivedMessage frame);
  absl::Status StartMetricsServer();
  /// Removes what a dead instance of this device left: its ready file, which would claim this
  /// daemon serves before it does. (Session segments are memfds: they go with the last process
  /// that maps them, and leave nothing in /dev/shm.) Called only once this device's sockets
  /// proved free (nobody listens on them).
  void RemoveLeftovers();
  /// Counts `c`, about to bind as `uid`, among that uid's clients (limits.clients_per_uid).
  /// Caller holds c.mu.
  absl::Status AdmitToUidLocked(ClientRecord& c, uid_t uid);
  /// Takes `c` out of its uid's counts and drops its charges (Reclaim). Caller holds c.mu.
  void ReleaseQuotaLocked(ClientRecord& c);
  /// Counts `c` among the unbound clients of `uid` (limits.unbound_clients_per_uid), and takes
  /// it out of them once it bound or went (c.mu held, or `c` not shared yet).
  absl::Status ChargeUnboundLocked(ClientRecord& c, uid_t uid);
  void ReleaseUnboundLocked(ClientRecord& c);
  // A descriptor the bound client `c` sent and nobody claimed yet, against
  // limits.pending_fds_per_client, pending_fds_per_uid and max_pending_fds (c.mu held; only
  // the fd thread charges); given back n at a time as they are claimed or closed.
  absl::Status ChargePendingFdLocked(ClientRecord& c);
  void UnchargePendingFdsLocked(ClientRecord& c, int32_t n);
  // The control socket's connections (ConnectionGate): counted against
  // limits.connections_per_uid and max_connections, and given back once they ended.
  absl::Status AdmitConnection(uid_t uid);
  void ConnectionEnded(uid_t uid);
  void FillQuotaGauges(GaugeSnapshot& g);
  absl::Status ChooseBackend();
  /// A ring descriptor that cannot become a call: refused as a call that fails validation is,
  /// so that its epoch, when it is the session's next, is spent and the peers see the session
  /// break instead of waiting out their timeout.
  absl::Status RefuseDescriptor(ClientRecord& c, uint64_t session_id, uint64_t epoch,
                                absl::Status why);
  absl::StatusOr<CallResult> RunCall(ClientRecord& c, uint64_t session_id, const CallArgs& args,
                                     uint64_t expected_epoch, ExecuteMode mode, CallRecord* rec,
                                     std::shared_ptr<Session>* session);
  /// Creates the client's segment and doorbells. No worker runs until the client rings.
  absl::StatusOr<std::shared_ptr<ClientRings>> CreateRings(const std::shared_ptr<ClientRecord>& c);
  /// Starts the ring worker of `c` unless one runs (the fd thread, at a ring of its submit bell).
  void StartRingWorker(const std::shared_ptr<ClientRecord>& c,
                       const std::shared_ptr<ClientRings>& rings);
  /// Serves `c`'s rings in order until the client is reclaimed, or until kRingWorkerIdle passes
  /// with nothing to do.
  void RingWorker(std::shared_ptr<ClientRecord> c, std::shared_ptr<ClientRings> rings);

  DaemonConfig config_;
  std::string backend_;
  std::string backend_reason_;
  FdExports peer_exports_;  // declared before backend_impl_: the backend lends through it
  std::unique_ptr<Backend> backend_impl_;
  std::unique_ptr<Backend> nccl_impl_;  // see nccl_backend()
  absl::Time started_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<bool> draining_{false};
  std::atomic<bool> device_lost_{false};
  std::atomic<int> active_calls_{0};
  std::atomic<uint64_t> worker_stalls_{0};  // ring-worker steps past timeouts.worker_stall_ms
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::string mps_mode_ = "none";
  Metrics metrics_;
  std::unique_ptr<FlightRecorder> recorder_;
  std::unique_ptr<httplib::Server> metrics_http_;
  std::thread metrics_thread_;
  std::string metrics_bound_;
  // Ring workers by client id, at most one per client, running while the client has calls.
  // Every one is joined, none detached: a worker that ends puts its id in workers_done_, and
  // the fd thread (or Shutdown, or the client's next worker) joins it; Shutdown joins the rest
  // once Reclaim has set their abort words.
  std::mutex workers_mu_;
  std::map<uint64_t, std::thread> workers_;
  std::vector<uint64_t> workers_done_;
  void JoinFinishedWorkers();
  /// Warns, once per step, of each client whose ring worker has been inside one step longer
  /// than timeouts.worker_stall_ms (WorkerWatch); the fd thread calls it about once a second.
  void ReportStalledWorkers(const std::vector<std::shared_ptr<ClientRecord>>& clients,
                            absl::Time now);
  std::atomic<bool> stopping_{false};
  bool started_ok_ = false;
  // Lets reclaimed clients' sessions, buffers and groups go (Reclaim); stopped by Shutdown.
  Reaper reaper_;

  // On the control socket; peer_ refuses every call there (the node socket's is node_peer_).
  std::unique_ptr<grpc::Service> control_, admin_, peer_;
  std::unique_ptr<grpc::Server> server_;
  ConnectionGate control_gate_;  // the control socket's connections, handed to server_
  std::unique_ptr<grpc::Service> operator_admin_;  // Admin on the operator socket
  std::unique_ptr<grpc::Server> operator_server_;
  std::unique_ptr<grpc::Service> node_peer_;  // Peer on the node socket
  std::unique_ptr<grpc::Server> node_server_;
  ipc::UnixListener fd_listener_;
  std::thread fd_thread_;
  std::unique_ptr<ipc::EventFd> poll_wake_;

  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<ClientRecord>> clients_;
  // Per uid: bound clients and the bytes of their buffers.
  struct UidUsage {
    int32_t clients = 0;
    uint64_t buffer_bytes = 0;
    int32_t buffers = 0;   // limits.buffers_per_uid
    int32_t requests = 0;  // Control requests in progress (limits.calls_in_progress_per_uid)
    int32_t sessions = 0;  // open or being created (limits.sessions_per_uid)
    int32_t connections = 0;  // on the control socket (limits.connections_per_uid)
    int32_t pending_fds = 0;  // sent and not claimed (limits.pending_fds_per_uid)
    int32_t refused_arriving = 0;  // CreateSession refused a place, arriving all the same
    int32_t unbound = 0;  // attached, fd socket not bound (limits.unbound_clients_per_uid)
    bool Unused() const {
      return clients == 0 && buffer_bytes == 0 && buffers == 0 && requests == 0 &&
             sessions == 0 && connections == 0 && pending_fds == 0 && refused_arriving == 0 &&
             unbound == 0;
    }
  };
  // What clients hold against the limits, per uid and all together. A session's charge
  // (ChargeSession) shares it, since the session may outlive this object. mu is the innermost
  // lock.
  struct QuotaBook {
    std::mutex mu;
    std::map<uid_t, UidUsage> uids;
    int32_t buffers = 0;   // limits.max_buffers
    uint64_t buffer_bytes = 0;  // limits.max_buffer_bytes
    int32_t sessions = 0;  // limits.max_sessions
    int32_t connections = 0;  // limits.max_connections
    int32_t pending_fds = 0;  // limits.max_pending_fds
    void UnchargeSession(uid_t uid);
  };
  const std::shared_ptr<QuotaBook> quotas_ = std::make_shared<QuotaBook>();
  HeadroomGuard headroom_;
  std::array<std::atomic<uint64_t>, kNumLimits> refusals_{};
  struct SlotBudget {
    std::mutex mu;
    uint64_t reserved = 0;
    std::map<uid_t, uint64_t> by_uid;  // the part of `reserved` each uid's sessions hold
    void Give(uid_t uid, uint64_t bytes);
  };
  const std::shared_ptr<SlotBudget> slot_budget_ = std::make_shared<SlotBudget>();

  RendezvousTable rendezvous_table_;
  RendezvousClient rendezvous_client_;
};

/// Services, defined in services.cc.
std::unique_ptr<grpc::Service> MakeControlService(Daemon* d);
/// Admin; `operator_socket`: the instance of the operator socket, which alone allows the calls
/// that change the daemon's state (ulysses/common/sockets.h).
std::unique_ptr<grpc::Service> MakeAdminService(Daemon* d, bool operator_socket);
/// Peer; `node_socket`: the instance of the node socket, which alone serves its calls (the
/// control socket's refuses each with PERMISSION_DENIED; ulysses/common/sockets.h).
std::unique_ptr<grpc::Service> MakePeerService(Daemon* d, bool node_socket);

}  // namespace ulysses::daemon
