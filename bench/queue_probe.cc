// ulysses-queue-probe: which of a process's streams share a hardware queue (docs/benchmarks.md,
// "which streams share a hardware queue").
//
// A CUDA context maps its streams onto a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS asks
// for how many; under MPS the clients of one server share a pool of them, and the driver may
// give a client fewer than it asks). Work behind a stream's blocked wait holds back every
// other stream on that queue, which is how one session of the daemon could stall another.
// This program makes --streams streams and runs the probe the daemon runs at start
// (ulysses/ipc/queue_probe.h) with every stream held in turn, so that every pair is seen: a
// write that does not land within --settle-ms sits behind the held stream's wait. (An event
// recorded on an idle stream is no probe: it can complete without reaching the queue.)
// --greatest makes the listed streams at the device's greatest priority, as the fused plan's
// second stream is. It prints the pairs and the classes (streams that share a queue,
// transitively) as JSON. --hold-ms keeps the context alive afterwards, so that several copies
// run at once show what concurrent clients of one MPS server get.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "nlohmann/json.hpp"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/queue_probe.h"
#include "die.h"

namespace {

namespace cu = ulysses::ipc::cuda;

using ulysses::bench::Check;
using ulysses::bench::Die;

}  // namespace

int main(int argc, char** argv) {
  ulysses::bench::ProgramName() = "ulysses-queue-probe";
  CLI::App app{"ulysses-queue-probe: which streams of this process share a hardware queue"};
  int streams = 12, settle_ms = 20, hold_ms = 0, device = 0;
  std::vector<int> greatest;
  std::string json_path, label;
  app.add_option("--streams", streams, "streams to make and probe")->check(CLI::Range(2, 64));
  app.add_option("--settle-ms", settle_ms,
                 "how long a word write on a free queue may take before it counts as held")
      ->check(CLI::Range(1, 10000));
  app.add_option("--hold-ms", hold_ms, "keep the context this long after probing")
      ->check(CLI::Range(0, 600000));
  app.add_option("--device", device, "the GPU")->check(CLI::NonNegativeNumber);
  app.add_option("--greatest", greatest, "indices of the streams made at the greatest priority")
      ->check(CLI::Range(0, 63));
  app.add_option("--json", json_path, "also write the JSON here");
  app.add_option("--label", label, "recorded in the JSON as is");
  CLI11_PARSE(app, argc, argv);
  for (int g : greatest)
    if (g >= streams) Die("--greatest: " + std::to_string(g) + " is not below --streams");

  if (cu::DeviceCount() == 0) {
    std::printf("no CUDA device; nothing to measure\n");
    return 0;
  }
  Check(cudaSetDevice(device), "cudaSetDevice");
  int least = 0, most = 0;
  Check(cudaDeviceGetStreamPriorityRange(&least, &most), "cudaDeviceGetStreamPriorityRange");
  std::vector<cudaStream_t> s(streams);
  std::vector<void*> handles(streams);
  for (int i = 0; i < streams; ++i) {
    const bool high = std::find(greatest.begin(), greatest.end(), i) != greatest.end();
    Check(cudaStreamCreateWithPriority(&s[i], cudaStreamNonBlocking, high ? most : least),
          "cudaStreamCreateWithPriority");
    handles[i] = s[i];
  }
  ulysses::ipc::QueueProbeOptions options;
  options.settle = std::chrono::milliseconds(settle_ms);
  options.every_stream = true;  // every pair, for the report
  absl::StatusOr<ulysses::ipc::QueueProbeResult> probe =
      cu::ProbeStreamQueues(handles, options);
  Check(probe.status());
  const std::vector<std::vector<int>>& classes = probe->classes;
  const std::vector<std::vector<int>>& shared = probe->held_back;
  const double probe_ms = probe->probe_ms;
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  nlohmann::json j = {{"bench", "queue_probe"},
                      {"label", label},
                      {"pid", static_cast<int>(::getpid())},
                      {"streams", streams},
                      {"greatest_priority", greatest},
                      {"settle_ms", settle_ms},
                      {"max_connections_env", conn ? conn : ""},
                      {"queues_seen", classes.size()},
                      {"classes", classes},
                      {"shared_with_later", shared},
                      {"slow_writes", probe->slow_writes},
                      {"probe_ms", probe_ms}};
  const std::string out = j.dump();
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) Die("cannot write " + json_path);
    std::fprintf(f, "%s\n", out.c_str());
    std::fclose(f);
  }
  if (hold_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
  for (int i = 0; i < streams; ++i) cudaStreamDestroy(s[i]);
  return 0;
}
