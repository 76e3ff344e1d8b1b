// ulyssesd: one daemon per GPU (or simulated GPU on the host backend).
#include <signal.h>

#include <cstdio>
#include <iostream>

#include "CLI/CLI.hpp"
#include "daemon.h"
#include "ulysses/common/config.h"
#include "ulysses/common/logging.h"

int main(int argc, char** argv) {
  CLI::App app{"ulyssesd: communication daemon for Ulysses sequence parallelism"};
  int device = 0;
  std::string socket, backend, config_path, log_level, ready_file, check_config;
  int64_t call_timeout_ms = 0, peer_timeout_ms = 0, drain_timeout_ms = -1;
  std::string metrics_address;
  app.add_option("--device", device, "Device index this daemon serves")->check(CLI::NonNegativeNumber);
  app.add_option("--socket", socket, "Control socket path (default /run/ulysses/gpu<N>.sock)");
  app.add_option("--backend", backend, "host | nccl | nvlink | auto");
  app.add_option("--config", config_path, "Node config file (JSON); flags override it");
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error | off");
  app.add_option("--ready-file", ready_file, "File written once the daemon serves");
  app.add_option("--call-timeout-ms", call_timeout_ms, "Bound on every wait inside a call");
  app.add_option("--peer-timeout-ms", peer_timeout_ms, "Bound on group and session rendezvous");
  app.add_option("--drain-timeout-ms", drain_timeout_ms,
                 "On SIGTERM, how long running calls may take to finish");
  app.add_option("--metrics-address", metrics_address,
                 "Serve Prometheus metrics on host:port (e.g. 127.0.0.1:9400; port 0 picks one)");
  app.add_option("--check-config", check_config, "Validate a config file and exit");
  app.add_flag_callback("--version", [] {
    std::cout << "ulyssesd " << ULYSSES_VERSION << "\n";
    std::exit(0);
  }, "Print the version and exit");
  CLI11_PARSE(app, argc, argv);

  if (!check_config.empty()) {
    absl::StatusOr<ulysses::DaemonConfig> c = ulysses::LoadDaemonConfig(check_config, device);
    if (!c.ok()) {
      std::cerr << "ulyssesd: " << c.status().message() << "\n";
      return 1;
    }
    std::cout << check_config << ": ok\n";
    return 0;
  }

  ulysses::DaemonConfig config;
  if (!config_path.empty()) {
    absl::StatusOr<ulysses::DaemonConfig> c = ulysses::LoadDaemonConfig(config_path, device);
    if (!c.ok()) {
      std::cerr << "ulyssesd: " << c.status().message() << "\n";
      return 1;
    }
    config = std::move(*c);
  }
  config.device = device;
  if (config.socket.empty()) config.socket = ulysses::DefaultSocketPath(device);
  if (!socket.empty()) config.socket = socket;
  if (!backend.empty()) config.backend = backend;
  if (!log_level.empty()) config.log_level = log_level;
  if (!ready_file.empty()) config.ready_file = ready_file;
  if (call_timeout_ms > 0) config.call_timeout_ms = call_timeout_ms;
  if (peer_timeout_ms > 0) config.peer_timeout_ms = peer_timeout_ms;
  if (drain_timeout_ms >= 0) config.drain_timeout_ms = drain_timeout_ms;
  if (!metrics_address.empty()) config.metrics_address = metrics_address;
  if (absl::Status s = ulysses::ValidateDaemonConfig(config); !s.ok()) {
    std::cerr << "ulyssesd: " << s.message() << "\n";
    return 1;
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
