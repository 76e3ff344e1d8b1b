#include "flags.h"

#include <limits>
#include <string_view>

#include "ulysses/common/cli.h"

namespace ulysses::daemon {

void DaemonFlags::ApplyTo(DaemonConfig& c) const {
  c.device = device;
  if (c.socket.empty()) c.socket = DefaultSocketPath(device);
  if (socket_opt->count()) c.socket = socket;
  if (backend_opt->count()) c.backend = backend;
  if (log_level_opt->count()) c.log_level = log_level;
  if (ready_opt->count()) c.ready_file = ready_file;
  if (call_opt->count()) c.call_timeout_ms = call_timeout_ms;
  if (peer_opt->count()) c.peer_timeout_ms = peer_timeout_ms;
  if (drain_opt->count()) c.drain_timeout_ms = drain_timeout_ms;
  if (metrics_opt->count()) c.metrics_address = metrics_address;
  if (ring_spin_opt->count()) c.ring_spin_us = ring_spin_us;
  if (operator_group_opt->count()) c.operator_group = operator_group;
  if (queue_probe_opt->count()) c.queue_probe_streams = queue_probe_streams;
  if (queue_sharing_opt->count()) c.queue_sharing = queue_sharing;
  if (fused_projection_opt->count()) c.fused_projection = fused_projection;
}

void AddDaemonFlags(CLI::App& app, DaemonFlags& f) {
  const DaemonConfig defaults;
  f.backend = defaults.backend;
  f.log_level = defaults.log_level;
  f.call_timeout_ms = defaults.call_timeout_ms;
  f.peer_timeout_ms = defaults.peer_timeout_ms;
  f.drain_timeout_ms = defaults.drain_timeout_ms;
  f.queue_probe_streams = defaults.queue_probe_streams;
  f.queue_sharing = defaults.queue_sharing;
  f.fused_projection = defaults.fused_projection;
  app.add_option("--device", f.device, "Device index this daemon serves")
      ->check(cli::IntIn(0, std::numeric_limits<int32_t>::max()));
  f.socket_opt = app.add_option(
      "--socket", f.socket,
      "Control socket path (default: the config's devices[] entry, else /run/ulysses/gpu<N>.sock)");
  std::string backends;
  for (std::string_view b : kRunnableBackends)
    backends += (backends.empty() ? "" : " | ") + std::string(b);
  f.backend_opt = app.add_option("--backend", f.backend, backends + " (config: backend)");
  f.log_level_opt = app.add_option(
      "--log-level", f.log_level,
      "trace | debug | info | warn | error | critical | off (config: log_level)");
  f.ready_opt = app.add_option("--ready-file", f.ready_file,
                               "File written once the daemon serves (config: ready_file)");
  f.call_opt = app.add_option("--call-timeout-ms", f.call_timeout_ms,
                              "Bound on every wait inside a call, > 0 (config: timeouts.call_ms)")
                   ->check(cli::Integer());
  f.peer_opt = app.add_option("--peer-timeout-ms", f.peer_timeout_ms,
                              "Bound on group and session rendezvous, > 0 (config: timeouts.peer_ms)")
                   ->check(cli::Integer());
  f.drain_opt = app.add_option("--drain-timeout-ms", f.drain_timeout_ms,
                               "On SIGTERM, how long running calls may take to finish, >= 0 "
                               "(config: timeouts.drain_ms)")
                    ->check(cli::Integer());
  f.metrics_opt = app.add_option("--metrics-address", f.metrics_address,
                                 "Serve Prometheus metrics on HOST:PORT, e.g. 127.0.0.1:9500 or "
                                 "[::1]:9500; port 0 picks one (config: metrics.address; default off)");
  f.ring_spin_opt = app.add_option("--ring-spin-us", f.ring_spin_us,
                                   "How long a ring worker polls after its last call before it "
                                   "sleeps, 0 to 1000000 (config: rings.worker_spin_us; default 50)")
                        ->check(cli::Integer());
  f.operator_group_opt = app.add_option("--operator-group", f.operator_group,
                                        "A group (name or gid) whose members may use the "
                                        "operator socket, then mode 0660 (config: "
                                        "admin.operator_group; default: the daemon's uid alone)");
  f.queue_probe_opt =
      app.add_option("--queue-probe-streams", f.queue_probe_streams,
                     "GPU: streams probed at start for shared hardware queues, 0 to 64; 0 no "
                     "probe (config: queues.probe_streams; default 16)")
          ->check(cli::Integer());
  f.queue_sharing_opt = app.add_option(
      "--queue-sharing", f.queue_sharing,
      "GPU: when every probed hardware queue serves a session, allow a stream on a shared "
      "queue or refuse the session: allow | refuse (config: queues.sharing; default allow)");
  f.fused_projection_opt = app.add_option(
      "--fused-projection", f.fused_projection,
      "GPU: the GEMM of fused sessions' per-operator and chunked paths: cublaslt | cutlass "
      "(the epilogue GEMM, where the device has it) (config: fused.projection; default "
      "cublaslt)");
}

}  // namespace ulysses::daemon
