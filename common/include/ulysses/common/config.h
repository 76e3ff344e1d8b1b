// The daemon's configuration: one JSON file per node, overridden by command-line flags.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses {

/// One GPU (or simulated GPU) of the node and the socket its daemon serves.
struct DeviceEntry {
  int32_t index = 0;
  std::string socket;  ///< control socket path; the fd socket is `socket + ".fd"`
};

/// What one client, the clients of one uid, and all clients together may hold at once (config
/// object `limits`). Past a limit the request is RESOURCE_EXHAUSTED naming it
/// ("limits.buffer_bytes_per_uid").
struct DaemonLimits {
  int32_t max_clients = 1024;            ///< attached clients, bound or not
  /// Connections to the control socket of one uid (SO_PEERCRED), and of all uids together:
  /// each holds descriptors of the daemon's, whether it ever attaches or not.
  int32_t connections_per_uid = 512;
  int32_t max_connections = 2048;
  int32_t clients_per_uid = 256;         ///< bound clients of one uid
  /// Attached clients of one uid (the uid of the control connection their Attach came on)
  /// that have not bound their fd socket yet: Attach needs no proof, so without it one uid
  /// could hold every place of max_clients, again each timeouts.bind_ms.
  int32_t unbound_clients_per_uid = 128;
  int32_t buffers_per_client = 4096;     ///< buffers one client holds
  /// Buffers all clients of one uid hold together. Each holds a mapping of the daemon's (a
  /// memfd's, or device memory's), and the kernel allows a process only so many
  /// (vm.max_map_count, 65530 by default): without this, one uid's clients could use them up
  /// for every client of the daemon.
  int32_t buffers_per_uid = 16384;
  /// Buffers all clients together hold: the daemon's mappings stay below vm.max_map_count
  /// whatever number of uids its clients run as.
  int32_t max_buffers = 32768;
  uint64_t buffer_bytes_per_client = 256ull << 30;  ///< bytes of those buffers
  uint64_t buffer_bytes_per_uid = 512ull << 30;     ///< bytes of all buffers of one uid
  uint64_t max_buffer_bytes = 1ull << 40;           ///< bytes of all buffers of all clients
  int32_t pending_fds_per_client = 64;   ///< descriptors sent but not yet claimed by RegisterBuffer
  /// The same for all clients of one uid together, and for all clients together: unclaimed
  /// descriptors are the daemon's own.
  int32_t pending_fds_per_uid = 1024;
  int32_t max_pending_fds = 4096;
  /// Groups one client has joined, or is joining.
  int32_t groups_per_client = 64;
  /// Sessions one client has open, or is creating. Each holds descriptors of the daemon's (its
  /// segment, its loan to the peers, a link to each peer) and mappings: without a bound, one
  /// client could use up the daemon's descriptors for every client.
  int32_t sessions_per_client = 64;
  /// The same for all clients of one uid together.
  int32_t sessions_per_uid = 256;
  /// The same for all clients together.
  int32_t max_sessions = 1024;
  /// Unary Control requests of one client in progress at once, and its JoinGroup and
  /// CreateSession requests: each holds a thread of the daemon's synchronous gRPC server, or a
  /// place in a rendezvous, while it runs (a Call may wait for its peers).
  int32_t calls_in_progress_per_client = 32;
  /// The same for all bound clients of one uid together.
  int32_t calls_in_progress_per_uid = 128;
  /// Admin requests in progress at once on one socket (the control socket's read-only Admin,
  /// and apart from it the operator socket's): each holds a thread of the synchronous server,
  /// and no client identity comes with them.
  int32_t admin_calls_in_progress = 16;
};

/// One limit of DaemonLimits: its key under `limits` and the field that holds it (one of the
/// two member pointers is set).
struct LimitField {
  std::string_view key;
  int32_t DaemonLimits::*count = nullptr;
  uint64_t DaemonLimits::*bytes = nullptr;
  uint64_t value(const DaemonLimits& l) const {
    return count != nullptr ? static_cast<uint64_t>(l.*count) : l.*bytes;
  }
};

/// Every limit, once: the config reads and checks them from here, and the daemon's refusals
/// and metrics name them from here (in this order).
inline constexpr std::array<LimitField, 21> kLimitFields = {{
    {"max_clients", &DaemonLimits::max_clients},
    {"connections_per_uid", &DaemonLimits::connections_per_uid},
    {"max_connections", &DaemonLimits::max_connections},
    {"clients_per_uid", &DaemonLimits::clients_per_uid},
    {"unbound_clients_per_uid", &DaemonLimits::unbound_clients_per_uid},
    {"buffers_per_client", &DaemonLimits::buffers_per_client},
    {"buffers_per_uid", &DaemonLimits::buffers_per_uid},
    {"max_buffers", &DaemonLimits::max_buffers},
    {"buffer_bytes_per_client", nullptr, &DaemonLimits::buffer_bytes_per_client},
    {"buffer_bytes_per_uid", nullptr, &DaemonLimits::buffer_bytes_per_uid},
    {"max_buffer_bytes", nullptr, &DaemonLimits::max_buffer_bytes},
    {"pending_fds_per_client", &DaemonLimits::pending_fds_per_client},
    {"pending_fds_per_uid", &DaemonLimits::pending_fds_per_uid},
    {"max_pending_fds", &DaemonLimits::max_pending_fds},
    {"groups_per_client", &DaemonLimits::groups_per_client},
    {"sessions_per_client", &DaemonLimits::sessions_per_client},
    {"sessions_per_uid", &DaemonLimits::sessions_per_uid},
    {"max_sessions", &DaemonLimits::max_sessions},
    {"calls_in_progress_per_client", &DaemonLimits::calls_in_progress_per_client},
    {"calls_in_progress_per_uid", &DaemonLimits::calls_in_progress_per_uid},
    {"admin_calls_in_progress", &DaemonLimits::admin_calls_in_progress},
}};

/// Everything a daemon needs to run. Defaults are usable as is.
struct DaemonConfig {
  int32_t device = 0;                 ///< device index this daemon serves
  std::string socket;                 ///< control socket path (default /run/ulysses/gpu<N>.sock)
  std::string backend = "auto";       ///< host | nccl | nvlink | auto
  std::string log_level = "info";
  int64_t call_timeout_ms = 30000;    ///< bound on every wait inside a call (peers, slots)
  int64_t peer_timeout_ms = 30000;    ///< bound on group/session rendezvous
  int64_t drain_timeout_ms = 30000;   ///< SIGTERM: how long running calls may take to finish
  int64_t bind_timeout_ms = 10000;    ///< an attached client must bind its fd socket by then
  /// A ring worker inside one step of a call (executing it, polling it) for longer than
  /// call_timeout_ms plus this is reported once per step (a warning naming the step,
  /// ulyssesd_worker_stalls_total): every wait of a step is bounded by the call timeout, but a
  /// CUDA call that waits for the device is not. 0: not watched (timeouts.worker_stall_ms).
  int64_t worker_stall_ms = 10000;
  int32_t flight_recorder_size = 1024;  ///< calls the flight recorder keeps
  /// How long a client's ring worker polls its submission ring after its last call before it
  /// sleeps on the doorbell (rings.worker_spin_us): a call that comes within it costs no
  /// wake-up; the worker's core is busy meanwhile.
  int64_t ring_spin_us = 50;
  uint64_t slot_memory_budget_bytes = 8ull << 30;  ///< receive-slot memory this daemon may hold
  /// The part of that budget the sessions of one uid's clients may hold together, in percent
  /// (slots.uid_share_percent): below 100, no uid can take the whole budget from the others.
  int32_t slot_uid_share_percent = 100;
  /// GPU backends: streams probed at start to learn which share a hardware queue (a wait on
  /// one blocks the others), at the default priority; a quarter as many (at least one) more at
  /// the greatest priority, for fused plans' second streams; past them sessions are refused.
  /// 0: no probe, streams are made as sessions come (queues.probe_streams).
  int32_t queue_probe_streams = 16;
  /// When every probed queue serves a session: "allow" hands out a spare stream of the least
  /// used queue, shared with another session's stream (whose waiting call can then hold it
  /// back until the call timeout), "refuse" answers RESOURCE_EXHAUSTED (queues.sharing).
  std::string queue_sharing = "allow";
  /// GPU backends: the GEMM of fused sessions' per-operator and chunked paths (fused.projection):
  /// "cublaslt", or "cutlass" (the epilogue path's CUTLASS GEMM storing the projection only,
  /// where the build and device have it, cuBLASLt elsewhere), with which a fused session loads
  /// no cuBLASLt kernel when it opens.
  std::string fused_projection = "cublaslt";
  std::string ready_file;             ///< written once the daemon serves (empty: none)
  std::string metrics_address;        ///< host:port of the metrics endpoint (empty: off)
  /// The group (a name or a numeric gid) whose members may use the operator socket, which then
  /// has mode 0660 and that group (admin.operator_group); empty: the daemon's uid alone (0600).
  std::string operator_group;
  std::vector<DeviceEntry> devices;   ///< the node's daemons, for node-local rendezvous
  DaemonLimits limits;
};

/// The gid of `group`: a group name the system knows, or a decimal gid. INVALID_ARGUMENT
/// stating the rule (no key prefix) otherwise.
absl::StatusOr<uint32_t> ResolveGroup(std::string_view group);

/// The most streams queues.probe_streams may ask for.
inline constexpr int32_t kMaxQueueProbeStreams = 64;

/// Every backend name a config or flag may give.
/// The longest rings.worker_spin_us: one second.
inline constexpr int64_t kMaxRingSpinUs = 1000000;

inline constexpr std::array<std::string_view, 4> kBackendNames = {"auto", "host", "nccl",
                                                                  "nvlink"};
/// The backends this build's daemon runs (`auto` resolves among them). A name in
/// kBackendNames but not here is refused by ValidateDaemonConfig, so that --check-config,
/// the flags and start-up give one verdict. A backend joins this list when it lands.
inline constexpr std::array<std::string_view, 4> kRunnableBackends = {"auto", "host", "nccl",
                                                                     "nvlink"};

/// A TCP endpoint as the config writes it: `HOST:PORT`, HOST a name or an IPv4 address, or an
/// IPv6 address in brackets (`[::1]:9500`).
struct HostPort {
  std::string host;  ///< without the brackets of an IPv6 address
  int port = 0;      ///< 0..65535; 0 asks for any free port
  /// `HOST:PORT`, brackets around an IPv6 host.
  std::string ToString() const;
  /// `host:port` with `port` instead of this->port (the bound port of a port-0 request).
  std::string WithPort(int bound_port) const;
};

/// Parses `HOST:PORT`. INVALID_ARGUMENT with a message that states the rule (no key prefix):
/// an empty host, an unbracketed IPv6 address, a port that is not 0..65535 in decimal.
absl::StatusOr<HostPort> ParseHostPort(std::string_view text);

/// The command-line flag that sets config `key` ("timeouts.call_ms" -> "--call-timeout-ms"),
/// empty when none does. Errors about such a key name both.
std::string_view FlagOfKey(std::string_view key);

/// Default control socket path of device `index`.
std::string DefaultSocketPath(int32_t index);

/// Parses a node config (JSON text) for device `device`. Unknown keys and wrong types are
/// INVALID_ARGUMENT naming the key (e.g. "timeouts.call_ms: expected an integer").
absl::StatusOr<DaemonConfig> ParseDaemonConfig(const std::string& json_text, int32_t device);

/// Reads and parses `path`; NOT_FOUND when it cannot be read.
absl::StatusOr<DaemonConfig> LoadDaemonConfig(const std::string& path, int32_t device);

/// Checks the values of a config, after flags are applied: the one validation of the config
/// file (ParseDaemonConfig calls it), the flags and start-up (Daemon::Start calls it). Backend
/// known and runnable in this build, device and indexes >= 0, positive timeouts, metrics
/// address, socket path lengths of every devices[] entry, log level. INVALID_ARGUMENT whose
/// message starts with the key and, when a flag sets it, the flag:
/// "timeouts.call_ms (--call-timeout-ms): must be > 0, got 0".
absl::Status ValidateDaemonConfig(const DaemonConfig& config);

}  // namespace ulysses
