// ulyssesd: one daemon per GPU (or simulated GPU on the host backend).
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>

#include "CLI/CLI.hpp"
#include "daemon.h"
#include "ulysses/common/cli.h"
#include "ulysses/common/config.h"
#include "ulysses/common/logging.h"

namespace {

// Flags that override the config; each applies only when given.
struct Flags {
  int device = 0;
  std::string socket, backend, log_level, ready_file, metrics_address;
  int64_t call_timeout_ms = 0, peer_timeout_ms = 0, drain_timeout_ms = 0;
  CLI::Option *backend_opt = nullptr, *log_level_opt = nullptr, *call_opt = nullptr,
              *peer_opt = nullptr, *drain_opt = nullptr, *metrics_opt = nullptr,
              *ready_opt = nullptr, *socket_opt = nullptr;

  void ApplyTo(ulysses::DaemonConfig& c) const {
    c.device = device;
    if (c.socket.empty()) c.socket = ulysses::DefaultSocketPath(device);
    if (socket_opt->count()) c.socket = socket;
    if (backend_opt->count()) c.backend = backend;
    if (log_level_opt->count()) c.log_level = log_level;
    if (ready_opt->count()) c.ready_file = ready_file;
    if (call_opt->count()) c.call_timeout_ms = call_timeout_ms;
    if (peer_opt->count()) c.peer_timeout_ms = peer_timeout_ms;
    if (drain_opt->count()) c.drain_timeout_ms = drain_timeout_ms;
    if (metrics_opt->count()) c.metrics_address = metrics_address;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ulyssesd: communication daemon for Ulysses sequence parallelism"};
  ulysses::cli::Setup(app);
  const ulysses::DaemonConfig defaults;
  Flags f;
  f.backend = defaults.backend;
  f.log_level = defaults.log_level;
  f.call_timeout_ms = defaults.call_timeout_ms;
  f.peer_timeout_ms = defaults.peer_timeout_ms;
  f.drain_timeout_ms = defaults.drain_timeout_ms;
  std::string config_path, check_config;
  app.add_option("--device", f.device, "Device index this daemon serves")
      ->check(ulysses::cli::IntIn(0, std::numeric_limits<int32_t>::max()));
  f.socket_opt = app.add_option(
      "--socket", f.socket,
      "Control socket path (default: the config's devices[] entry, else /run/ulysses/gpu<N>.sock)");
  std::string backends;
  for (std::string_view b : ulysses::kRunnableBackends)
    backends += (backends.empty() ? "" : " | ") + std::string(b);
  f.backend_opt = app.add_option("--backend", f.backend, backends + " (config: backend)");
  app.add_option("--config", config_path, "Node config file (JSON); flags override it");
  f.log_level_opt = app.add_option(
      "--log-level", f.log_level,
      "trace | debug | info | warn | error | critical | off (config: log_level)");
  f.ready_opt = app.add_option("--ready-file", f.ready_file,
                               "File written once the daemon serves (config: ready_file)");
  f.call_opt = app.add_option("--call-timeout-ms", f.call_timeout_ms,
                              "Bound on every wait inside a call, > 0 (config: timeouts.call_ms)")
                   ->check(ulysses::cli::Integer());
  f.peer_opt = app.add_option("--peer-timeout-ms", f.peer_timeout_ms,
                              "Bound on group and session rendezvous, > 0 (config: timeouts.peer_ms)")
                   ->check(ulysses::cli::Integer());
  f.drain_opt = app.add_option("--drain-timeout-ms", f.drain_timeout_ms,
                               "On SIGTERM, how long running calls may take to finish, >= 0 "
                               "(config: timeouts.drain_ms)")
                    ->check(ulysses::cli::Integer());
  f.metrics_opt = app.add_option("--metrics-address", f.metrics_address,
                                 "Serve Prometheus metrics on HOST:PORT, e.g. 127.0.0.1:9500 or "
                                 "[::1]:9500; port 0 picks one (config: metrics.address; default off)");
  app.add_option("--check-config", check_config,
                 "Validate a config file (with the other flags applied) and exit");
  app.add_flag_callback("--version", [] {
    std::cout << "ulyssesd " << ULYSSES_VERSION << "\n";
    std::exit(0);
  }, "Print the version and exit");
  if (std::optional<int> rc = ulysses::cli::Parse(app, argc, argv, "ulyssesd")) return *rc;
  if (!check_config.empty() && !config_path.empty())
    return ulysses::cli::UsageError("ulyssesd", "--check-config FILE and --config FILE: give one");

  // One validation for flags, --check-config and start-up: the flags alone over the defaults
  // first (a failure there is bad usage), then the file, then the file with the flags applied.
  {
    ulysses::DaemonConfig flags_only;
    f.ApplyTo(flags_only);
    if (absl::Status s = ulysses::ValidateDaemonConfig(flags_only); !s.ok())
      return ulysses::cli::UsageError("ulyssesd", std::string(s.message()));
  }
  const std::string& file = check_config.empty() ? config_path : check_config;
  ulysses::DaemonConfig config;
  if (!file.empty()) {
    absl::StatusOr<ulysses::DaemonConfig> c = ulysses::LoadDaemonConfig(file, f.device);
    if (!c.ok()) {
      std::cerr << "ulyssesd: " << c.status().message() << "\n";
      return 1;
    }
    config = std::move(*c);
  }
  f.ApplyTo(config);
  if (absl::Status s = ulysses::ValidateDaemonConfig(config); !s.ok()) {
    std::cerr << "ulyssesd: " << (file.empty() ? "" : file + ": ") << s.message() << "\n";
    return 1;
  }
  if (!check_config.empty()) {
    std::cout << check_config << ": ok\n";
    return 0;
  }
  (void)ulysses::SetLogLevel(config.log_level);

  // Signals go to this thread alone (blocked everywhere else, including gRPC's threads).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);

  ulysses::daemon::Daemon daemon(config);
  if (absl::Status s = daemon.Start(); !s.ok()) {
    ulysses::Logger("main")->error("cannot start: {}", std::string(s.message()));
    daemon.Shutdown();
    return 1;
  }
  int sig = 0;
  sigwait(&set, &sig);
  // Drain: refuse new clients and sessions, let running calls finish (bounded), then stop. A
  // second signal stops at once.
  ulysses::Logger("main")->info("signal {}: draining before shutdown", sig);
  daemon.Drain();
  const absl::Time deadline = absl::Now() + absl::Milliseconds(config.drain_timeout_ms);
  bool idle = false;
  while (!(idle = daemon.WaitIdle(absl::Milliseconds(100))) && absl::Now() < deadline) {
    timespec zero{0, 0};
    if (sigtimedwait(&set, nullptr, &zero) > 0) break;
  }
  if (!idle)
    ulysses::Logger("main")->warn("stopping with {} call(s) still running", daemon.active_calls());
  daemon.Shutdown();
  return 0;
}
