#include "daemon.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "httplib.h"
#include "grpcpp/health_check_service_interface.h"
#include "absl/strings/numbers.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/frames.h"
#include "ulysses/ipc/pidfd.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::daemon {
namespace {

std::string RandomToken() {
  std::random_device rd;
  std::uniform_int_distribution<uint64_t> dist;
  char buf[33];
  snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(dist(rd)),
           static_cast<unsigned long long>(dist(rd)));
  return buf;
}

std::string MetadataValue(const grpc::ServerContext* ctx, const char* key) {
  auto range = ctx->client_metadata().equal_range(key);
  if (range.first == range.second) return "";
  return std::string(range.first->second.data(), range.first->second.size());
}

// The answer to a hello that binds nothing: {"ok": false, "error": "..."}.
std::string ErrorFrame(const absl::Status& why) {
  return nlohmann::json{{"ok", false}, {"error", std::string(why.message())}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

Daemon::Daemon(DaemonConfig config)
    : config_(std::move(config)),
      recorder_(std::make_unique<FlightRecorder>(static_cast<size_t>(
          std::max<int32_t>(1, config_.flight_recorder_size)))) {}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::Start() {
  ULY_RETURN_IF_ERROR(ValidateDaemonConfig(config_));
  ULY_RETURN_IF_ERROR(ChooseBackend());
  ULY_ASSIGN_OR_RETURN(fd_listener_, ipc::UnixListener::Listen(config_.socket + ".fd", 0660));
  ULY_ASSIGN_OR_RETURN(ipc::EventFd wake, ipc::EventFd::Create());
  poll_wake_ = std::make_unique<ipc::EventFd>(std::move(wake));

  control_ = MakeControlService(this);
  admin_ = MakeAdminService(this);
  peer_ = MakePeerService(this);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // The control socket: a stale file from a crashed daemon is removed, a live one is refused.
  {
    absl::StatusOr<ipc::UnixListener> probe = ipc::UnixListener::Listen(config_.socket, 0660);
    if (!probe.ok()) return probe.status();
    // gRPC binds the path itself; the probe only proved it is free.
  }
  int bound_port = 0;
  builder.AddListeningPort("unix:" + config_.socket, grpc::InsecureServerCredentials(), &bound_port);
  builder.RegisterService(control_.get());
  builder.RegisterService(admin_.get());
  builder.RegisterService(peer_.get());
  builder.SetMaxReceiveMessageSize(16 << 20);
  server_ = builder.BuildAndStart();
  if (!server_) return absl::UnavailableError(StrCat("socket: cannot serve gRPC on ", config_.socket));
  ::chmod(config_.socket.c_str(), 0660);
  server_->GetHealthCheckService()->SetServingStatus(true);
  started_ = absl::Now();
  started_ok_ = true;
  if (absl::Status m = StartMetricsServer(); !m.ok()) return m;
  fd_accept_thread_ = std::thread([this] { FdAcceptLoop(); });
  fd_poll_thread_ = std::thread([this] { FdPollLoop(); });
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
// backend; a forced backend that cannot run refuses to start, naming why.
absl::Status Daemon::ChooseBackend() {
  const std::string& want = config_.backend;
  if (want == "nccl")
    return absl::FailedPreconditionError(
        "backend: 'nccl' is not available in this build yet; use nvlink, host or auto");
  if (want == "host") {
    backend_impl_ = MakeHostBackend();
    backend_reason_ = "requested host";
  } else {
    absl::Status cuda = absl::OkStatus();
    if (ipc::cuda::DeviceCount() == 0)
      cuda = absl::FailedPreconditionError(ipc::cuda::Built() ? "no CUDA device is visible"
                                                              : "this build has no CUDA support");
    if (cuda.ok()) cuda = peer_exports_.Start(config_.socket + ".peer");
    if (cuda.ok()) {
      absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeCudaBackend(config_.device, &peer_exports_);
      if (gpu.ok()) backend_impl_ = std::move(*gpu);
      else cuda = gpu.status();
    }
    if (!cuda.ok()) {
      peer_exports_.Stop();
      if (want == "nvlink")
        return absl::FailedPreconditionError(
            StrCat("backend: 'nvlink' cannot run: ", cuda.message()));
      backend_impl_ = MakeHostBackend();
      backend_reason_ = StrCat("auto: no GPU backend (", cuda.message(), ")");
    } else {
      backend_reason_ = StrCat(want == "auto" ? "auto" : "requested nvlink",
                               ": device memory shared through CUDA VMM fds on device ",
                               config_.device);
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
  fd_listener_.Shutdown();
  if (metrics_http_) metrics_http_->stop();
  if (metrics_thread_.joinable()) metrics_thread_.join();
  if (poll_wake_) (void)poll_wake_->Signal();
  if (fd_accept_thread_.joinable()) fd_accept_thread_.join();
  if (fd_poll_thread_.joinable()) fd_poll_thread_.join();
  for (auto& c : Clients()) Reclaim(c->id, "daemon shutting down");
  peer_exports_.Stop();
  {
    std::unique_lock<std::mutex> lock(workers_mu_);
    workers_cv_.wait_for(lock, std::chrono::seconds(5), [this] { return workers_ == 0; });
  }
  if (server_) server_->Wait();
  ::unlink(config_.socket.c_str());
  if (!config_.ready_file.empty()) ::unlink(config_.ready_file.c_str());
  Logger("main")->info("ulyssesd stopped");
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

void Daemon::Undrain() {
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
    std::lock_guard<std::mutex> lock(c->mu);
    g.sessions += static_cast<int64_t>(c->sessions.size());
    for (auto& [id, s] : c->sessions)
      for (const Session::SlotView& v : s->Slots()) ++g.slots_by_state[static_cast<int>(v.state)];
  }
  g.active_calls = active_calls_.load();
  g.draining = draining_.load();
  g.mps = mps_mode_ == "mps";
  g.uptime_s = absl::ToDoubleSeconds(absl::Now() - started_);
  const ipc::cuda::AllocationStats a = ipc::cuda::Stats();
  g.device_bytes = a.live_bytes;
  g.device_allocations = a.created + a.imported + a.ipc_opened;
  return g;
}

std::string Daemon::RenderMetrics() {
  const DeviceIdentity identity = backend_impl_ ? backend_impl_->identity() : DeviceIdentity{};
  return metrics_.Render(ULYSSES_VERSION, config_.device, backend_, identity, Gauges());
}

absl::StatusOr<std::shared_ptr<ClientRecord>> Daemon::AttachClient(const std::string& name) {
  auto c = std::make_shared<ClientRecord>();
  c->id = NextId();
  c->token = RandomToken();
  c->name = name;
  c->since = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  clients_[c->id] = c;
  return c;
}

absl::StatusOr<std::shared_ptr<ClientRecord>> Daemon::Authenticate(const grpc::ServerContext* ctx) {
  const std::string id_text = MetadataValue(ctx, "ulysses-client-id");
  const std::string token = MetadataValue(ctx, "ulysses-token");
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
  if (c->token != token) return absl::UnauthenticatedError(StrCat("client ", id, ": bad token"));
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
    c->incoming_fds.clear();
    if (c->fd_socket.valid()) ::shutdown(c->fd_socket.get(), SHUT_RDWR);
    c->pidfd.reset();
    if (c->rings) {
      // Ends the ring worker and any client wait on the segment.
      c->rings->header->abort.store(1, std::memory_order_release);
      (void)c->rings->submit_bell.Signal();
      (void)c->rings->complete_bell.Signal();
    }
  }
  // Abort first: a call of this client blocked on peers ends now, and peers waiting on this
  // rank see ABORTED instead of timing out. The session itself goes when its last in-flight
  // call drops its reference.
  uint64_t slot_bytes = 0;
  for (auto& [id, s] : sessions) {
    s->Abort(kAbortClientGone);
    slot_bytes += s->reserved_bytes();
  }
  ReleaseSlotMemory(slot_bytes);
  if (poll_wake_) (void)poll_wake_->Signal();
  Logger("main")->info("client {} ({}, pid {}) gone: {}; released {} session(s), {} buffer(s)",
                       c->id, c->name, c->pid, reason, sessions.size(), buffers.size());
}

absl::Status Daemon::SendToClient(ClientRecord& c, const std::string& header, int fd) {
  int fds[1] = {fd};
  return SendToClient(c, header, fd >= 0 ? std::span<const int>(fds, 1) : std::span<const int>());
}

absl::Status Daemon::SendToClient(ClientRecord& c, const std::string& header,
                                  std::span<const int> fds) {
  std::lock_guard<std::mutex> send_lock(c.send_mu);
  int sock = -1;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (!c.fd_socket.valid())
      return absl::FailedPreconditionError(
          StrCat("client ", c.id, ": fd socket not connected; connect it right after Attach"));
    sock = c.fd_socket.get();
  }
  return ipc::SendMessage(sock, header, fds);
}

absl::StatusOr<ipc::UniqueFd> Daemon::TakeIncomingFd(ClientRecord& c, uint64_t tag) {
  std::unique_lock<std::mutex> lock(c.mu);
  const bool arrived = c.fd_cv.wait_for(lock, std::chrono::seconds(10), [&] {
    return c.incoming_fds.count(tag) > 0 || !c.fd_socket.valid();
  });
  auto it = c.incoming_fds.find(tag);
  if (!arrived || it == c.incoming_fds.end())
    return absl::InvalidArgumentError(
        StrCat("tag: no fd arrived on the fd socket under tag ", tag));
  ipc::UniqueFd fd = std::move(it->second);
  c.incoming_fds.erase(it);
  return fd;
}

absl::Status Daemon::ReserveSlotMemory(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot_bytes_reserved_ + bytes > config_.slot_memory_budget_bytes)
    return absl::ResourceExhaustedError(StrCat(
        "slot memory: session needs ", bytes, " bytes, ", slot_bytes_reserved_, " of the budget ",
        config_.slot_memory_budget_bytes, " are in use (slots.memory_budget_bytes)"));
  slot_bytes_reserved_ += bytes;
  return absl::OkStatus();
}

void Daemon::ReleaseSlotMemory(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  slot_bytes_reserved_ -= std::min(bytes, slot_bytes_reserved_);
}

// The fd socket: a client connects right after Attach and sends {"client_id", "token"}. The
// kernel's SO_PEERCRED on this connection is what identifies the client's process.
void Daemon::FdAcceptLoop() {
  for (;;) {
    absl::StatusOr<ipc::UniqueFd> sock = fd_listener_.Accept();
    if (!sock.ok()) {
      if (stopping_.load()) return;
      Logger("ipc")->warn("fd socket accept: {}", std::string(sock.status().message()));
      continue;
    }
    BindFdSocket(std::move(*sock));
  }
}

void Daemon::BindFdSocket(ipc::UniqueFd sock) {
  auto log = Logger("ipc");
  absl::StatusOr<bool> ready = ipc::WaitReadable(sock.get(), 5000);
  if (!ready.ok() || !*ready) {
    log->warn("fd socket: no hello within 5 s; closing");
    return;
  }
  absl::StatusOr<ipc::ReceivedMessage> frame =
      ipc::RecvMessage(sock.get(), ipc::kMaxClientFrameBytes, /*max_fds=*/0);
  absl::StatusOr<ipc::PeerCred> cred = ipc::GetPeerCred(sock.get());
  if (!frame.ok() || !cred.ok()) return;
  absl::StatusOr<ipc::HelloFrame> hello = ipc::DecodeHello(frame->payload);
  if (!hello.ok()) {
    log->warn("fd socket: bad hello from pid {}: {}", cred->pid,
              std::string(hello.status().message()));
    (void)ipc::SendMessage(sock.get(), ErrorFrame(hello.status()));
    return;
  }
  std::shared_ptr<ClientRecord> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = clients_.find(hello->client_id);
    if (it != clients_.end() && it->second->token == hello->token) c = it->second;
  }
  if (!c) {
    (void)ipc::SendMessage(sock.get(), ErrorFrame(absl::PermissionDeniedError(
                                           "unknown client or bad token")));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->fd_socket.valid()) return;  // bound already: a second hello is ignored
    c->pid = cred->pid;
    c->uid = cred->uid;
    c->fd_socket = std::move(sock);
    // A process in another pid namespace may show as pid 0: then the sockets alone tell.
    if (c->pid > 0) {
      absl::StatusOr<ipc::UniqueFd> pidfd = ipc::PidfdOpen(c->pid);
      if (pidfd.ok()) c->pidfd = std::move(*pidfd);
    }
  }
  // The ack carries the call fast path: the client segment and the two doorbells.
  absl::StatusOr<std::shared_ptr<ClientRings>> rings = CreateRings(c);
  if (!rings.ok()) {
    log->warn("client {}: no call rings: {}", c->id, std::string(rings.status().message()));
    (void)SendToClient(*c, R"({"ok": true})", -1);
  } else {
    {
      std::lock_guard<std::mutex> lock(c->mu);
      c->rings = *rings;
    }
    std::lock_guard<std::mutex> send_lock(c->send_mu);
    int fds[3] = {(*rings)->memfd.get(), (*rings)->submit_bell.fd(), (*rings)->complete_bell.fd()};
    int sock;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      sock = c->fd_socket.get();
    }
    (void)ipc::SendMessage(sock, StrCat("{\"ok\": true, \"client_segment_bytes\": ",
                                        ipc::ClientSegmentLayout::kTotal, "}"),
                           std::span<const int>(fds, 3));
  }
  (void)poll_wake_->Signal();
  log->debug("client {} bound its fd socket (pid {}, uid {})", c->id, c->pid, c->uid);
}

// Watches every bound fd socket: frames carrying fds from clients, and hang-ups (the client
// process is gone).
void Daemon::FdPollLoop() {
  while (!stopping_.load()) {
    std::vector<std::shared_ptr<ClientRecord>> clients = Clients();
    std::vector<pollfd> fds;
    std::vector<std::shared_ptr<ClientRecord>> owners;
    std::vector<bool> is_pidfd;
    fds.push_back(pollfd{poll_wake_->fd(), POLLIN, 0});
    for (auto& c : clients) {
      std::lock_guard<std::mutex> lock(c->mu);
      if (!c->fd_socket.valid()) continue;
      fds.push_back(pollfd{c->fd_socket.get(), POLLIN, 0});
      owners.push_back(c);
      is_pidfd.push_back(false);
      if (c->pidfd.valid()) {
        fds.push_back(pollfd{c->pidfd.get(), POLLIN, 0});
        owners.push_back(c);
        is_pidfd.push_back(true);
      }
    }
    int n = ::poll(fds.data(), fds.size(), 1000);
    if (n <= 0) continue;
    if (fds[0].revents) (void)poll_wake_->Wait(0);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      ClientRecord& c = *owners[i - 1];
      if (is_pidfd[i - 1]) {
        Reclaim(c.id, "process exited");
        continue;
      }
      absl::StatusOr<ipc::ReceivedMessage> m =
          ipc::RecvMessage(fds[i].fd, ipc::kMaxClientFrameBytes);
      if (!m.ok()) {
        // A closed socket, or a frame the stream cannot skip (over the size limit).
        Reclaim(c.id, StrCat("fd socket: ", m.status().message()));
        continue;
      }
      absl::StatusOr<ipc::FdFrame> f = ipc::DecodeFdFrame(m->payload);
      if (!f.ok() || m->fds.size() != 1) {
        // The frame's descriptors close with `m`; the stream stays in step (frames are
        // length-prefixed), so the client keeps being served.
        Logger("ipc")->warn("client {}: fd frame ignored: {}", c.id,
                            f.ok() ? StrCat("carries ", m->fds.size(), " descriptors, expected 1")
                                   : std::string(f.status().message()));
        continue;
      }
      std::lock_guard<std::mutex> lock(c.mu);
      if (!c.incoming_fds.emplace(f->tag, std::move(m->fds[0])).second)
        Logger("ipc")->warn("client {}: fd frame ignored: tag {} is already pending", c.id, f->tag);
      c.fd_cv.notify_all();
    }
  }
}

}  // namespace ulysses::daemon
