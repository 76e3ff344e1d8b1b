// ulyssesd: one daemon per GPU (or simulated GPU on the host backend).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <string_view>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "daemon.h"
#include "flags.h"
#include "transport.h"
#include "ulysses/common/cli.h"
#include "ulysses/common/config.h"
#include "ulysses/common/logging.h"

// The exit status of a daemon that stopped because its device no longer serves it.
constexpr int kExitDeviceLost = 3;

int main(int argc, char** argv) {
  // The nccl backend's bootstrap-root helper, a child of a daemon: nothing else of the daemon.
  if (argc == 2 && std::string_view(argv[1]) == ulysses::daemon::kNcclRootHelperArg)
    return ulysses::daemon::RunNcclRootHelper();
  // A fatal signal prints the faulting thread's stack on stderr before the process dies.
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  CLI::App app{"ulyssesd: communication daemon for Ulysses sequence parallelism"};
  ulysses::cli::Setup(app);
  ulysses::daemon::DaemonFlags f;
  std::string config_path, check_config;
  ulysses::daemon::AddDaemonFlags(app, f);
  app.add_option("--config", config_path, "Node config file (JSON); flags override it");
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
  // Wait for a signal, asking every second whether the device still serves this daemon. A
  // lost one (a sticky CUDA error, an MPS server that tore the context down) cannot come back
  // in this process: stop, with kExitDeviceLost, for the supervisor to start a new one. If the
  // broken context makes the shutdown hang, a watchdog ends the process with the same code.
  int sig = 0;
  for (;;) {
    const timespec tick{1, 0};
    sig = sigtimedwait(&set, nullptr, &tick);
    if (sig > 0) break;
    if (absl::Status lost = daemon.CheckDevice(); !lost.ok()) {
      ulysses::Logger("main")->error("stopping (exit status {}) for a supervisor to restart it",
                                     kExitDeviceLost);
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(30));
        std::_Exit(kExitDeviceLost);
      }).detach();
      daemon.Shutdown();
      return kExitDeviceLost;
    }
  }
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
