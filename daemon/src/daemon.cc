#include "daemon.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "host_allocations.h"
#include "httplib.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "absl/strings/numbers.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/failpoint.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/sockets.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/pidfd.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::daemon {
namespace {

// A view into `ctx`'s metadata: valid while the request is.
std::string_view MetadataValue(const grpc::ServerContextBase* ctx, const char* key) {
  auto range = ctx->client_metadata().equal_range(key);
  if (range.first == range.second) return {};
  return std::string_view(range.first->second.data(), range.first->second.size());
}

// A gRPC socket's path while gRPC binds it: `<dir>/.XXXXXX/s` in a directory of mode 0700
// beside the final path (same filesystem, so rename(2) can move it). The directory goes with
// this object.
class StagedSocket {
 public:
  static absl::StatusOr<StagedSocket> Make(const std::string& final_path) {
    const size_t slash = final_path.rfind('/');
    const std::string parent = slash == std::string::npos ? "." : final_path.substr(0, slash + 1);
    std::string dir = parent + ".XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr)
      return ErrnoError(StrCat("mkdtemp(", dir, ") to stage the socket ", final_path), errno);
    StagedSocket s(dir, final_path);
    if (s.path().size() >= sizeof(sockaddr_un::sun_path))
      return absl::InvalidArgumentError(StrCat("socket: staging path ", s.path(),
                                               " is too long; use a shorter socket path"));
    return s;
  }
  StagedSocket(StagedSocket&& o) noexcept : dir_(std::move(o.dir_)), final_(std::move(o.final_)) {
    o.dir_.clear();
  }
  StagedSocket(const StagedSocket&) = delete;
  StagedSocket& operator=(const StagedSocket&) = delete;
  StagedSocket& operator=(StagedSocket&&) = delete;
  ~StagedSocket() {
    if (dir_.empty()) return;
    ::unlink(path().c_str());
    ::rmdir(dir_.c_str());
  }

  std::string path() const { return dir_ + "/s"; }

  /// Gives the socket `mode` (and group `gid`, unless -1), moves it to its final path and
  /// checks what is there now.
  absl::Status Publish(mode_t mode, gid_t gid = static_cast<gid_t>(-1)) {
    if (gid != static_cast<gid_t>(-1) && ::chown(path().c_str(), static_cast<uid_t>(-1), gid) != 0)
      return ErrnoError(StrCat("chown(", path(), ", group ", gid, ") of the socket ", final_), errno);
    if (::chmod(path().c_str(), mode) != 0)
      return ErrnoError(StrCat("chmod(", path(), ") of the socket ", final_), errno);
    if (::rename(path().c_str(), final_.c_str()) != 0)
      return ErrnoError(StrCat("rename(", path(), ", ", final_, ")"), errno);
    struct stat st {};
    if (::lstat(final_.c_str(), &st) != 0)
      return ErrnoError(StrCat("lstat(", final_, ")"), errno);
    if (!S_ISSOCK(st.st_mode) || (st.st_mode & 07777) != mode) {
      char octal[16];
      std::snprintf(octal, sizeof octal, "0%o", static_cast<unsigned>(mode));
      return absl::InternalError(
          StrCat("socket: ", final_, " is not the socket of mode ", octal, " just published"));
    }
    return absl::OkStatus();
  }

 private:
  StagedSocket(std::string dir, std::string final_path)
      : dir_(std::move(dir)), final_(std::move(final_path)) {}
  std::string dir_;
  std::string final_;
};

// Takes server reflection off one server (linking gRPC's reflection library offers it to every
// server). Its stream (ServerReflectionInfo) is served by the synchronous API, a thread for each
// stream for as long as its caller keeps it open, so only the operator socket has it.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(p.get()) != nullptr;
    });
  }
};

// A server of `services`, listening on `port` ("unix:PATH") unless it is empty. Where
// `close_idle`, a connection without a call for 5 minutes is closed (its client reconnects at
// its next call): one that never says anything gives its place back
// (limits.connections_per_uid); and a connection carries at most 1024 calls at once.
absl::StatusOr<std::unique_ptr<grpc::Server>> BuildServer(
    const std::string& port, const std::vector<grpc::Service*>& services, bool reflection,
    bool close_idle = false) {
  grpc::ServerBuilder builder;
  if (close_idle) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 5 * 60 * 1000);
    // And calls at once on one connection: each stream holds memory of the server's (a
    // client's own calls are bounded apart, limits.calls_in_progress_per_client).
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 1024);
  }
  int bound_port = 0;
  if (!port.empty())
    builder.AddListeningPort(port, grpc::InsecureServerCredentials(), &bound_port);
  for (grpc::Service* s : services) builder.RegisterService(s);
  // Every request is small (names are bounded at 256 bytes); this bounds what one can cost.
  builder.SetMaxReceiveMessageSize(4 << 20);
  if (!reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return absl::UnavailableError(StrCat("socket: cannot serve gRPC on ", port));
  return server;
}

// gRPC binds a unix socket itself, with the permissions the umask leaves, and serves it at
// once. So each server binds inside a fresh directory of mode 0700, where nobody else can
// connect; the socket gets `mode` there and is renamed to `path` only then. No connection is
// ever accepted under looser permissions than `mode`. `path` was claimed before.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeStaged(
    const std::string& path, mode_t mode, const std::vector<grpc::Service*>& services,
    gid_t gid = static_cast<gid_t>(-1), bool reflection = false) {
  ULY_ASSIGN_OR_RETURN(StagedSocket staged, StagedSocket::Make(path));
  ULY_ASSIGN_OR_RETURN(std::unique_ptr<grpc::Server> server,
                       BuildServer("unix:" + staged.path(), services, reflection));
  ULY_RETURN_IF_ERROR(staged.Publish(mode, gid));
  return server;
}

}  // namespace

absl::Duration DrainLimitFor(absl::Duration call_timeout) {
  return std::min(std::max(absl::Seconds(30), call_timeout + absl::Seconds(5)), absl::Hours(24));
}

Daemon::Daemon(DaemonConfig config)
    : config_(std::move(config)),
      recorder_(std::make_unique<FlightRecorder>(static_cast<size_t>(
          std::max<int32_t>(1, config_.flight_recorder_size)))) {}

Daemon::~Daemon() {
  Shutdown();
  // The gRPC server's threads, which read the budget (GetState), are joined inside gRPC, where
  // ThreadSanitizer does not see it; taking the budget's lock once orders their last use before
  // this daemon's reference goes (the memory itself lives on while a session holds a part).
  std::lock_guard<std::mutex> lock(slot_budget_->mu);
  // The same for the limits' book, which their requests' places used (RequestPlace).
  std::lock_guard<std::mutex> quota(quotas_->mu);
}

absl::Status Daemon::Start() {
  ULY_RETURN_IF_ERROR(ValidateDaemonConfig(config_));
  // Every client's state takes descriptors: as many as the hard limit lets the process have.
  if (absl::StatusOr<std::pair<int64_t, int64_t>> raised = RaiseDescriptorLimit(); !raised.ok())
    Logger("main")->warn("descriptor limit not raised: {}", std::string(raised.status().message()));
  else if (raised->first != raised->second)
    Logger("main")->info("descriptor limit (RLIMIT_NOFILE) raised from {} to {}", raised->first,
                         raised->second);
  ULY_RETURN_IF_ERROR(ChooseBackend());
  ULY_ASSIGN_OR_RETURN(fd_listener_, ipc::UnixListener::Listen(config_.socket + ".fd", 0660));
  ULY_ASSIGN_OR_RETURN(ipc::EventFd wake, ipc::EventFd::Create());
  poll_wake_ = std::make_unique<ipc::EventFd>(std::move(wake));

  control_ = MakeControlService(this);
  admin_ = MakeAdminService(this, /*operator_socket=*/false);
  operator_admin_ = MakeAdminService(this, /*operator_socket=*/true);
  peer_ = MakePeerService(this, /*node_socket=*/false);
  node_peer_ = MakePeerService(this, /*node_socket=*/true);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // The control socket: a stale file from a crashed daemon is removed, a live one is refused.
  ULY_RETURN_IF_ERROR(ipc::ClaimSocketPath(config_.socket));
  const std::string operator_socket = config_.socket + std::string(kOperatorSocketSuffix);
  ULY_RETURN_IF_ERROR(ipc::ClaimSocketPath(operator_socket));
  const std::string node_socket = config_.socket + std::string(kNodeSocketSuffix);
  ULY_RETURN_IF_ERROR(ipc::ClaimSocketPath(node_socket));
  // Every socket was free: no instance of this device is alive, and what a dead one left may go.
  RemoveLeftovers();
  // The node socket first: a daemon whose control socket can be seen serves its peers already.
  // A server of its own for each socket, so that a call knows which socket it came on.
  ULY_ASSIGN_OR_RETURN(node_server_, ServeStaged(node_socket, 0600, {node_peer_.get()}));
  // Before serving: GetState reads it from the server's threads (ThreadSanitizer saw the write
  // race with them when it came after).
  started_ = absl::Now();
  // The control socket's connections are accepted by the gate (connection_gate.h), which
  // bounds them per uid and in all before it hands them to the server.
  ULY_ASSIGN_OR_RETURN(server_, BuildServer("", {control_.get(), admin_.get(), peer_.get()},
                                            /*reflection=*/false, /*close_idle=*/true));
  ULY_ASSIGN_OR_RETURN(ipc::UnixListener control_listener,
                       ipc::UnixListener::Listen(config_.socket, 0660));
  ULY_RETURN_IF_ERROR(control_gate_.Start(
      std::move(control_listener), server_.get(),
      [this](uid_t uid) { return AdmitConnection(uid); },
      [this](uid_t uid) { ConnectionEnded(uid); }));
  // The operators' group, when one is named, may use the operator socket too.
  gid_t operators = static_cast<gid_t>(-1);
  if (!config_.operator_group.empty()) {
    ULY_ASSIGN_OR_RETURN(const uint32_t gid, ResolveGroup(config_.operator_group));
    operators = static_cast<gid_t>(gid);
  }
  ULY_ASSIGN_OR_RETURN(operator_server_,
                       ServeStaged(operator_socket, operators == static_cast<gid_t>(-1) ? 0600 : 0660,
                                   {operator_admin_.get()}, operators, /*reflection=*/true));
  server_->GetHealthCheckService()->SetServingStatus(true);
  started_ok_ = true;
  if (absl::Status m = StartMetricsServer(); !m.ok()) return m;
  reaper_.Start();  // before any thread that reclaims clients
  fd_thread_ = std::thread([this] { FdLoop(); });
  if (!config_.ready_file.empty()) {
    std::string tmp = config_.ready_file + ".tmp";
    {
      std::ofstream f(tmp);
      nlohmann::json ready = {{"pid", ::getpid()},
                              {"socket", config_.socket},
                              {"metrics_address", metrics_bound_}};
      f << ready.dump() << "\n";
    }
    if (::rename(tmp.c_str(), config_.ready_file.c_str()) != 0)
      return ErrnoError(StrCat("rename ", tmp), errno);
  }
  Logger("main")->info("ulyssesd {} serving device {} on {} (backend {})", ULYSSES_VERSION,
                       config_.device, config_.socket, backend_);
  return absl::OkStatus();
}

// `auto` takes the GPU backend when this build has CUDA and the device works, else the host
// backend; a forced backend that cannot run refuses to start, naming why. An `auto` daemon on
// nvlink also makes the nccl backend when it can, which JoinGroup picks for a group whose
// devices cannot all map each other's memory.
absl::Status Daemon::ChooseBackend() {
  const std::string& want = config_.backend;
  // Every backend lends its session segments to the node's other daemons through it.
  ULY_RETURN_IF_ERROR(peer_exports_.Start(config_.socket + ".peer"));
  if (want == "host") {
    backend_impl_ = MakeHostBackend();
    backend_reason_ = "requested host";
  } else {
    // Load every kernel module when the context is made: a lazily loaded kernel's first launch
    // waits for the context to go idle, which stream waits can make never happen.
    ::setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
    const bool nccl = want == "nccl";
    absl::Status cuda = absl::OkStatus();
    if (ipc::cuda::DeviceCount() == 0)
      cuda = absl::FailedPreconditionError(ipc::cuda::Built() ? "no CUDA device is visible"
                                                              : "this build has no CUDA support");
    if (cuda.ok()) {
      // The device's queue lanes serve every backend's sessions, the nccl backend's too.
      CudaBackendOptions options;
      options.queue_probe_streams = config_.queue_probe_streams;
      options.queue_sharing = config_.queue_sharing == "allow";
      options.drain_limit = DrainLimitFor(absl::Milliseconds(config_.call_timeout_ms));
      absl::StatusOr<std::unique_ptr<Backend>> gpu =
          MakeCudaBackend(config_.device, &peer_exports_, options);
      if (gpu.ok() && nccl)
        gpu = MakeNcclBackend(config_.device, absl::Milliseconds(config_.call_timeout_ms),
                              std::move(*gpu));
      if (gpu.ok()) backend_impl_ = std::move(*gpu);
      else cuda = gpu.status();
    }
    if (!cuda.ok()) {
      if (want == "nvlink" || nccl)
        return absl::FailedPreconditionError(
            StrCat("backend: '", want, "' cannot run: ", cuda.message()));
      backend_impl_ = MakeHostBackend();
      backend_reason_ = StrCat("auto: no GPU backend (", cuda.message(), ")");
    } else if (nccl) {
      backend_reason_ = StrCat("requested nccl: blocks packed on device ", config_.device,
                               " and moved by NCCL (grouped send/recv)");
    } else {
      backend_reason_ = StrCat(want == "auto" ? "auto" : "requested nvlink",
                               ": device memory shared through CUDA VMM fds on device ",
                               config_.device);
      if (want == "auto") {
        absl::StatusOr<std::unique_ptr<Backend>> alt =
            MakeCudaBackend(config_.device, &peer_exports_);
        if (alt.ok())
          alt = MakeNcclBackend(config_.device, absl::Milliseconds(config_.call_timeout_ms),
                                std::move(*alt));
        if (alt.ok()) nccl_impl_ = std::move(*alt);
        else Logger("main")->info("no nccl backend beside nvlink: {}", std::string(alt.status().message()));
      }
    }
  }
  backend_ = std::string(backend_impl_->name());
  mps_mode_ = std::string(backend_impl_->mps_mode());
  if (mps_mode_ == "no-mps")
    Logger("main")->warn(
        "device {} is not under MPS: every hand-off between this daemon and its clients is "
        "time-sliced (slow); run nvidia-cuda-mps-control -d first (docs/operations.md)",
        config_.device);
  return absl::OkStatus();
}

void Daemon::Shutdown() {
  if (stopping_.exchange(true)) return;
  // First, and also when the start failed after the gate began: no new connection, and every
  // place given back while the limits' book is alive.
  control_gate_.Stop();
  if (!started_ok_) return;
  if (server_) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    // Abort every session first so calls blocked on peers end now instead of at their timeout.
    for (auto& c : Clients()) {
      std::lock_guard<std::mutex> lock(c->mu);
      for (auto& [id, s] : c->sessions) s->Abort(kAbortClosed);
    }
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  }
  for (grpc::Server* other : {operator_server_.get(), node_server_.get()})
    if (other != nullptr)
      other->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  fd_listener_.Shutdown();
  if (metrics_http_) metrics_http_->stop();
  if (metrics_thread_.joinable()) metrics_thread_.join();
  if (poll_wake_) (void)poll_wake_->Signal();
  if (fd_thread_.joinable()) fd_thread_.join();
  for (auto& c : Clients()) Reclaim(c->id, "daemon shutting down");
  {
    // Reclaim set every worker's abort word and aborted every session, so each ends at its
    // next check; none may outlive this object. Joined first: a call in flight holds its
    // session, which then goes with the reaper's, before the exports stop.
    std::map<uint64_t, std::thread> workers;
    {
      std::lock_guard<std::mutex> lock(workers_mu_);
      workers.swap(workers_);
      workers_done_.clear();
    }
    for (auto& [id, t] : workers) t.join();
  }
  reaper_.Stop();
  peer_exports_.Stop();
  for (grpc::Server* server : {server_.get(), operator_server_.get(), node_server_.get()})
    if (server != nullptr) server->Wait();
  ::unlink(config_.socket.c_str());
  ::unlink((config_.socket + std::string(kOperatorSocketSuffix)).c_str());
  ::unlink((config_.socket + std::string(kNodeSocketSuffix)).c_str());
  if (!config_.ready_file.empty()) ::unlink(config_.ready_file.c_str());
  Logger("main")->info("ulyssesd stopped");
}

void Daemon::RemoveLeftovers() {
  if (config_.ready_file.empty()) return;
  if (::unlink(config_.ready_file.c_str()) == 0)
    Logger("main")->info("a dead instance left the ready file {}; removed", config_.ready_file);
}

absl::Status Daemon::StartMetricsServer() {
  if (config_.metrics_address.empty()) return absl::OkStatus();
  ULY_ASSIGN_OR_RETURN(const HostPort address, ParseHostPort(config_.metrics_address));
  metrics_http_ = std::make_unique<httplib::Server>();
  // cpp-httplib's default socket options add SO_REUSEPORT, with which a second daemon given
  // the same port binds it too and the kernel splits the scrapes between them. SO_REUSEADDR
  // alone still restarts at once over a port in TIME_WAIT, and refuses a port in use.
  metrics_http_->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  metrics_http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(RenderMetrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  metrics_http_->Get("/healthz", [this](const httplib::Request&, httplib::Response& res) {
    res.status = draining() ? 503 : 200;
    res.set_content(draining() ? "draining\n" : "serving\n", "text/plain");
  });
  int bound = address.port;
  if (address.port == 0) {
    bound = metrics_http_->bind_to_any_port(address.host);
  } else if (!metrics_http_->bind_to_port(address.host, address.port)) {
    bound = -1;
  }
  if (bound <= 0)
    return absl::UnavailableError(
        StrCat("metrics.address: cannot listen on ", address.ToString(),
               " (the port is taken, e.g. by another daemon, or the host is not an address of "
               "this machine)"));
  metrics_bound_ = address.WithPort(bound);
  metrics_thread_ = std::thread([this] { metrics_http_->listen_after_bind(); });
  Logger("main")->info("metrics on http://{}/metrics", metrics_bound_);
  return absl::OkStatus();
}

void Daemon::Drain() {
  if (draining_.exchange(true)) return;
  if (server_) server_->GetHealthCheckService()->SetServingStatus(false);
  Logger("main")->info("draining: new clients and sessions are refused; {} call(s) running",
                       active_calls_.load());
}

absl::Status Daemon::CheckDevice() {
  absl::Status health = FailpointFired("device.lost")
                            ? absl::InternalError("the failpoint device.lost fired")
                            : (backend_impl_ ? backend_impl_->DeviceHealth() : absl::OkStatus());
  if (health.ok() || device_lost_.exchange(true)) return health;
  draining_.store(true);
  if (server_) server_->GetHealthCheckService()->SetServingStatus(false);
  Logger("main")->error("device {}: lost ({}); its sessions cannot run any more",
                        config_.device, std::string(health.message()));
  return health;
}

void Daemon::Undrain() {
  if (device_lost_.load()) return;  // stopping: the device is gone
  if (!draining_.exchange(false)) return;
  if (server_ && !stopping_.load()) server_->GetHealthCheckService()->SetServingStatus(true);
  Logger("main")->info("serving again");
}

bool Daemon::WaitIdle(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                           [this] { return active_calls_.load() == 0; });
}

void Daemon::CallStarted() { active_calls_.fetch_add(1); }

void Daemon::CallFinished(CallRecord record) {
  metrics_.RecordCall(record.op, record.code, record.done - record.queued, record.bytes_sent);
  recorder_->Add(std::move(record));
  if (active_calls_.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> lock(idle_mu_);
    idle_cv_.notify_all();
    if (draining_.load()) Logger("main")->info("drained: idle");
  }
}

GaugeSnapshot Daemon::Gauges() {
  GaugeSnapshot g;
  auto clients = Clients();
  g.clients = static_cast<int64_t>(clients.size());
  for (auto& c : clients) {
    // The slots are read with the client's lock let go: a session's slot lock can be held
    // for as long as a poison fill of its slots takes, and the fd thread takes every client's
    // lock at each round.
    for (const auto& s : c->SessionsNow()) {
      ++g.sessions;
      for (const Session::SlotView& v : s->Slots()) ++g.slots_by_state[static_cast<int>(v.state)];
    }
  }
  g.active_calls = active_calls_.load();
  g.draining = draining_.load();
  g.mps = mps_mode_ == "mps";
  g.uptime_s = absl::ToDoubleSeconds(absl::Now() - started_);
  const ipc::cuda::AllocationStats a = ipc::cuda::Stats();
  g.device_bytes = a.live_bytes;
  g.device_allocations = a.created + a.imported + a.ipc_opened;
  g.call_path_host_allocations = host_allocations::Counted();
  g.grpc_call_host_allocations = host_allocations::GrpcCounted();
  if (backend_impl_) {
    const QueueLaneCounts q = backend_impl_->Queues();
    g.device_streams = q.streams_used;
    g.hardware_queues = q.lanes;
    g.hardware_queues_in_use = q.lanes_in_use;
    g.queue_shared_streams = q.shared_streams;
    g.queue_refusals = q.refused;
  }
  g.sessions_undrained = Session::UndrainedCount();
  g.worker_stalls = worker_stalls_.load();
  const ProcessUse use = headroom_.Use();
  g.open_fds = use.descriptors;
  g.max_fds = use.descriptor_limit;
  g.mappings = use.mappings;
  g.max_mappings = use.mapping_limit;
  g.headroom_refusals = headroom_.refusals();
  g.log_lines_dropped = LogLinesDropped();
  FillQuotaGauges(g);
  return g;
}

std::string Daemon::RenderMetrics() {
  const DeviceIdentity identity = backend_impl_ ? backend_impl_->identity() : DeviceIdentity{};
  return metrics_.Render(ULYSSES_VERSION, config_.device, backend_, identity, Gauges());
}

absl::StatusOr<std::shared_ptr<ClientRecord>> Daemon::AttachClient(
    const std::string& name, int64_t reported_pid, uid_t connection_uid) {
  ULY_RETURN_IF_ERROR(CheckName("client_name", name));
  // Linux pids are below 2^22 (PID_MAX_LIMIT).
  if (reported_pid < 0 || reported_pid >= (int64_t{1} << 22))
    return absl::InvalidArgumentError(
        StrCat("reported_pid: ", reported_pid, " is not a pid (0, or 1 to 4194303)"));
  auto c = std::make_shared<ClientRecord>();
  c->reported_pid = reported_pid;
  c->id = NextId();
  c->token = RandomToken();
  c->name = name;
  c->since = absl::Now();
  // Attach needs no proof, so this bounds what anyone who reaches the socket can hold; clients
  // that never bind leave after timeouts.bind_ms. Checked first (cheap), then the headroom
  // (which lists the daemon's descriptors), then again when the client is added.
  auto refuse_if_full = [&]() -> absl::Status {
    if (clients_.size() >= static_cast<size_t>(config_.limits.max_clients))
      return RefuseOverLimit(Limit::kMaxClients,
                             StrCat(clients_.size(), " clients are attached already"));
    return absl::OkStatus();
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    ULY_RETURN_IF_ERROR(refuse_if_full());
  }
  ULY_RETURN_IF_ERROR(headroom_.Check("Attach"));
  // Counted against its connection's uid until it binds: c is not shared yet.
  ULY_RETURN_IF_ERROR(ChargeUnboundLocked(*c, connection_uid));
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status full = refuse_if_full(); !full.ok()) {
    ReleaseUnboundLocked(*c);
    return full;
  }
  clients_[c->id] = c;
  return c;
}

absl::StatusOr<std::shared_ptr<ClientRecord>> Daemon::Authenticate(
    const grpc::ServerContextBase* ctx) {
  const std::string_view id_text = MetadataValue(ctx, "ulysses-client-id");
  const std::string_view token = MetadataValue(ctx, "ulysses-token");
  uint64_t id = 0;
  if (id_text.empty() || !absl::SimpleAtoi(AbslView(id_text), &id))
    return absl::UnauthenticatedError("ulysses-client-id: missing; call Attach first");
  std::shared_ptr<ClientRecord> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = clients_.find(id);
    if (it != clients_.end()) c = it->second;
  }
  if (!c) return absl::UnauthenticatedError(StrCat("client ", id, " is not attached"));
  if (!EqualInConstantTime(c->token, token))
    return absl::UnauthenticatedError(StrCat("client ", id, ": bad token"));
  return c;
}

std::vector<std::shared_ptr<ClientRecord>> Daemon::Clients() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<ClientRecord>> out;
  for (auto& [id, c] : clients_) out.push_back(c);
  return out;
}

void Daemon::Reclaim(uint64_t client_id, const std::string& reason) {
  std::shared_ptr<ClientRecord> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = clients_.find(client_id);
    if (it == clients_.end()) return;
    c = it->second;
    clients_.erase(it);
  }
  std::map<uint64_t, std::shared_ptr<Session>> sessions;
  std::map<uint64_t, std::shared_ptr<Buffer>> buffers;
  std::map<uint64_t, std::shared_ptr<Group>> groups;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    sessions.swap(c->sessions);
    buffers.swap(c->buffers);
    groups.swap(c->groups);
    UnchargePendingFdsLocked(*c, static_cast<int32_t>(c->incoming_fds.size()));
    c->incoming_fds.clear();
    c->gone = true;
    ReleaseQuotaLocked(*c);
    c->fd_cv.notify_all();  // a RegisterBuffer waiting for a descriptor ends now
    if (c->rings) {
      // Ends the ring worker and any client wait on the segment. Before the socket closes: a
      // client that finds its socket closed and this word unset takes its daemon for dead and
      // lets its streams go itself (docs/protocol.md section 9.4).
      c->rings->stop.store(1, std::memory_order_release);
      c->rings->header->abort.store(1, std::memory_order_release);
      (void)c->rings->submit_ring.Signal();
      (void)c->rings->complete_bell.Signal();
    }
    if (c->watch != nullptr) c->watch->TryCancel();  // ends the Watch stream
    if (c->fd_socket.valid()) ::shutdown(c->fd_socket.get(), SHUT_RDWR);
    c->pidfd.reset();
  }
  // Abort first: a call of this client blocked on peers ends now, and peers waiting on this
  // rank see ABORTED instead of timing out. The session itself goes when its last in-flight
  // call drops its reference.
  // Each gives its share of the slot budget back when it is destroyed.
  for (auto& [id, s] : sessions) s->Abort(kAbortClientGone);
  // Its groups' other ranks would otherwise wait out their next session's rendezvous.
  for (auto& [id, g] : groups) EndGroup(*g, StrCat("rank ", g->rank, "'s client went away"));
  if (poll_wake_) (void)poll_wake_->Signal();
  Logger("main")->info("client {} ({}, pid {}) gone: {}; released {} session(s), {} buffer(s)",
                       c->id, c->name, PidText(c->pid, c->reported_pid), reason, sessions.size(),
                       buffers.size());
  // Let go on the reaper's thread: a GPU session drains its stream as it goes, which may take
  // its cancel's drain limit, and this may be the fd thread, which serves every client.
  struct Held {
    std::map<uint64_t, std::shared_ptr<Session>> sessions;
    std::map<uint64_t, std::shared_ptr<Buffer>> buffers;
    std::map<uint64_t, std::shared_ptr<Group>> groups;
  };
  reaper_.Post(std::make_shared<Held>(
      Held{std::move(sessions), std::move(buffers), std::move(groups)}));
}

std::string SessionKeyPrefix(const Group& g) {
  return StrCat("session/", g.name, "/", g.instance.empty() ? "-" : g.instance, "/");
}

void Daemon::EndGroup(const Group& g, const std::string& why) {
  if (g.world_size <= 1 || g.members.empty()) return;
  const absl::Status s = rendezvous_client_.EndGroup(
      g.members[0], SessionKeyPrefix(g), StrCat("group ", g.name, " ended: ", why));
  if (!s.ok())
    Logger("peer")->warn("group {}: its end could not be told to rank 0: {}", g.name,
                         std::string(s.message()));
}

// What sessions whose device work never ended hold stays in use: a client that keeps its
// sessions' streams from draining uses up the budget, not the device behind it.
absl::Status Daemon::ReserveSlotMemory(uid_t uid, uint64_t bytes) {
  const uint64_t undrained = Session::UndrainedBytes();
  const uint64_t budget = config_.slot_memory_budget_bytes;
  std::lock_guard<std::mutex> lock(slot_budget_->mu);
  uint64_t& reserved = slot_budget_->reserved;
  const uint64_t used = reserved + undrained;
  if (used + bytes > budget)
    return absl::ResourceExhaustedError(StrCat(
        "slot memory: session needs ", bytes, " bytes, ", used, " of the budget ", budget,
        " are in use (slots.memory_budget_bytes",
        undrained > 0 ? StrCat("; ", undrained, " of them kept by sessions whose device work "
                               "did not end, ulyssesd_sessions_undrained_total")
                      : "",
        ")"));
  auto mine = slot_budget_->by_uid.try_emplace(uid, 0).first;
  const auto percent = static_cast<uint64_t>(config_.slot_uid_share_percent);
  const uint64_t share = budget / 100 * percent + budget % 100 * percent / 100;
  if (mine->second + bytes > share) {
    const uint64_t held = mine->second;
    if (held == 0) slot_budget_->by_uid.erase(mine);
    return absl::ResourceExhaustedError(StrCat(
        "slot memory: session needs ", bytes, " bytes, and the sessions of uid ", uid,
        " hold ", held, " of its share ", share, " (slots.uid_share_percent = ",
        config_.slot_uid_share_percent, " of slots.memory_budget_bytes)"));
  }
  reserved += bytes;
  mine->second += bytes;
  return absl::OkStatus();
}

uint64_t Daemon::slot_memory_reserved() const {
  const uint64_t undrained = Session::UndrainedBytes();
  std::lock_guard<std::mutex> lock(slot_budget_->mu);
  return slot_budget_->reserved + undrained;
}

void Daemon::ReleaseSlotMemory(uid_t uid, uint64_t bytes) { slot_budget_->Give(uid, bytes); }

void Daemon::SlotBudget::Give(uid_t uid, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  reserved -= std::min(bytes, reserved);
  auto it = by_uid.find(uid);
  if (it == by_uid.end()) return;
  it->second -= std::min(bytes, it->second);
  if (it->second == 0) by_uid.erase(it);
}

// The hold shares the budget, so a session that outlives the daemon object gives back safely.
std::shared_ptr<const void> Daemon::SlotMemoryHold(uid_t uid, uint64_t bytes) {
  std::shared_ptr<SlotBudget> budget = slot_budget_;
  return std::shared_ptr<const void>(
      nullptr, [budget, uid, bytes](const void*) { budget->Give(uid, bytes); });
}

}  // namespace ulysses::daemon
