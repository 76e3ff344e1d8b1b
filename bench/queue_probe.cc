// ulysses-queue-probe: which of a process's streams share a hardware queue (docs/benchmarks.md,
// "which streams share a hardware queue").
//
// A CUDA context maps its streams onto a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS asks
// for how many; under MPS the clients of one server share a pool of them, and the driver may
// give a client fewer than it asks). Work behind a stream's blocked wait holds back every
// other stream on that queue, which is how one session of the daemon could stall another.
// This program makes --streams streams, then for each stream i holds it at a wait on a word of
// mapped host memory (the gate) and has every later stream j write its own word of mapped host
// memory (a stream memory operation, which the queue must carry out): a write that does not
// land within --settle-ms sits behind i's wait, so i and j share a queue. The gate then opens.
// (An event recorded on an idle stream is no probe: it can complete without reaching the
// queue.) --greatest makes the listed streams at the device's greatest priority, as the fused
// plan's second stream is. It prints the pairs and the classes (streams that share a queue, transitively) as
// JSON. --hold-ms keeps the context alive afterwards, so that several copies run at once show
// what concurrent clients of one MPS server get.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "nlohmann/json.hpp"
#include "ulysses/ipc/cuda_memory.h"
#include "die.h"

namespace {

namespace cu = ulysses::ipc::cuda;

using ulysses::bench::Check;
using ulysses::bench::Die;

// Whether the host word `word` reaches `value` within `settle`.
bool LandsWithin(const uint64_t* word, uint64_t value, std::chrono::milliseconds settle) {
  const auto deadline = std::chrono::steady_clock::now() + settle;
  for (;;) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= value) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

int Find(std::vector<int>& parent, int x) {
  while (parent[x] != x) x = parent[x] = parent[parent[x]];
  return x;
}

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
  // Word 0: the gate; word 1 + j: what stream j writes.
  uint64_t* host = nullptr;
  uint64_t* dev = nullptr;
  const size_t bytes = sizeof(uint64_t) * (1 + static_cast<size_t>(streams));
  Check(cudaHostAlloc(reinterpret_cast<void**>(&host), bytes, cudaHostAllocMapped), "cudaHostAlloc");
  std::fill(host, host + 1 + streams, 0);
  Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0),
        "cudaHostGetDevicePointer");
  int least = 0, most = 0;
  Check(cudaDeviceGetStreamPriorityRange(&least, &most), "cudaDeviceGetStreamPriorityRange");
  std::vector<cudaStream_t> s(streams);
  for (int i = 0; i < streams; ++i) {
    const bool high = std::find(greatest.begin(), greatest.end(), i) != greatest.end();
    Check(cudaStreamCreateWithPriority(&s[i], cudaStreamNonBlocking, high ? most : least),
          "cudaStreamCreateWithPriority");
  }
  const auto settle = std::chrono::milliseconds(settle_ms);
  // Every stream first writes its word once and is waited for, so that a stream's first
  // operation, which may start slowly, is not taken for a held one.
  // want[j]: the value stream j's latest write stores (marks only grow).
  uint64_t mark = 1;
  std::vector<uint64_t> want(streams, mark);
  for (int i = 0; i < streams; ++i) Check(cu::StreamWrite64(s[i], &dev[1 + i], mark));
  for (int i = 0; i < streams; ++i)
    if (!LandsWithin(&host[1 + i], want[i], std::chrono::milliseconds(10000)))
      Die("stream " + std::to_string(i) + " did not write its word within 10 s");
  std::vector<std::vector<int>> shared(streams);
  std::vector<int> parent(streams);
  std::iota(parent.begin(), parent.end(), 0);
  uint64_t gate = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < streams; ++i) {
    Check(cu::StreamWait64(s[i], &dev[0], ++gate));
    for (int j = i + 1; j < streams; ++j) {
      want[j] = ++mark;
      Check(cu::StreamWrite64(s[j], &dev[1 + j], want[j]));
      if (!LandsWithin(&host[1 + j], want[j], settle)) {
        shared[i].push_back(j);
        parent[Find(parent, j)] = Find(parent, i);
      }
    }
    __atomic_store_n(&host[0], gate, __ATOMIC_RELEASE);
    // Every held write lands once the gate is open: each stream ends with its own write.
    for (int j = i + 1; j < streams; ++j)
      if (!LandsWithin(&host[1 + j], want[j], std::chrono::milliseconds(10000)))
        Die("stream " + std::to_string(j) + " did not go on within 10 s of the gate opening");
  }
  const double probe_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  std::vector<std::vector<int>> classes;
  std::vector<int> class_of(streams, -1);
  for (int i = 0; i < streams; ++i) {
    const int root = Find(parent, i);
    if (class_of[root] < 0) {
      class_of[root] = static_cast<int>(classes.size());
      classes.emplace_back();
    }
    classes[class_of[root]].push_back(i);
  }
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
  cudaFreeHost(host);
  return 0;
}
