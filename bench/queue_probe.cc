// ulysses-queue-probe: which of a process's streams share a hardware queue (docs/benchmarks.md,
// "which streams share a hardware queue").
//
// A CUDA context maps its streams onto a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS asks
// for how many; under MPS a client was measured with 2 whatever it asked, and whether the
// clients of one server share queues is what --across asks). Work behind a stream's blocked
// wait holds back every other stream on that queue, which is how one session of the daemon
// could stall another.
// This program makes --streams streams and runs the probe the daemon runs at start
// (ulysses/ipc/queue_probe.h) with every stream held in turn, so that every pair is seen: a
// write that does not land within --settle-ms sits behind the held stream's wait. (An event
// recorded on an idle stream is no probe: it can complete without reaching the queue.)
// --greatest makes the listed streams at the device's greatest priority, as the fused plan's
// second stream is. It prints the pairs and the classes (streams that share a queue,
// transitively) as JSON. --hold-ms keeps the context alive afterwards, so that several copies
// run at once show what concurrent clients of one MPS server get.
//
// --across asks whether two processes share queues (clients of one MPS server, a daemon and
// its clients): a second process holds each of its --streams streams at a wait, so that every
// queue it has is blocked; then each of this process's streams writes a word, and a write that
// does not land within --settle-ms (nor a second settle time) sits behind the other process's
// wait. Then the other process opens its gate and every write must land.
#include <cuda_runtime.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
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

// Prints the run's JSON on stdout, and into `path` when one is given.
void Emit(const nlohmann::json& j, const std::string& path) {
  const std::string out = j.dump();
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
  if (path.empty()) return;
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) Die("cannot write " + path);
  std::fprintf(f, "%s\n", out.c_str());
  std::fclose(f);
}

// Mapped pinned words, one per stream, written by the streams and read by the host.
uint64_t* MappedWords(int n) {
  void* p = nullptr;
  Check(cudaHostAlloc(&p, sizeof(uint64_t) * n, cudaHostAllocMapped), "cudaHostAlloc");
  auto* w = static_cast<uint64_t*>(p);
  for (int i = 0; i < n; ++i) w[i] = 0;
  return w;
}

std::vector<cudaStream_t> MakeStreams(int n) {
  std::vector<cudaStream_t> s(n);
  for (cudaStream_t& x : s)
    Check(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}

// One byte from `fd`, or 0 when none comes within `ms`.
char ReadByte(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  char c = 0;
  if (::poll(&p, 1, ms) != 1 || ::read(fd, &c, 1) != 1) return 0;
  return c;
}

void WriteByte(int fd, char c) {
  if (::write(fd, &c, 1) != 1) Die("pipe to the other process: write failed");
}

bool Landed(const uint64_t* w, int i, std::chrono::steady_clock::duration within) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (__atomic_load_n(&w[i], __ATOMIC_ACQUIRE) < 1) {
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return true;
}

// The other process: holds each of its `streams` streams at a wait on one gate, says 'H',
// opens the gate on 'O', says 'D' once every stream went on. Never returns.
[[noreturn]] void HoldInChild(int streams, int device, int to_parent, int from_parent,
                              pid_t parent) {
  // Gone with the parent, also one that died before this line.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) _exit(2);
  if (cu::DeviceCount() == 0) {
    WriteByte(to_parent, 'N');
    _exit(0);
  }
  Check(cudaSetDevice(device), "cudaSetDevice (holder)");
  std::vector<cudaStream_t> s = MakeStreams(streams);
  uint64_t* gate = MappedWords(1);
  for (cudaStream_t x : s) Check(cu::StreamWait64(x, gate, 1));
  WriteByte(to_parent, 'H');
  (void)ReadByte(from_parent, 60000);  // 'O', or the parent gone: open either way
  __atomic_store_n(gate, uint64_t{1}, __ATOMIC_RELEASE);
  for (cudaStream_t x : s) Check(cudaStreamSynchronize(x), "cudaStreamSynchronize (holder)");
  WriteByte(to_parent, 'D');
  _exit(0);
}

int Across(int streams, int settle_ms, int device, const std::string& label,
           const std::string& json_path) {
  int up[2], down[2];
  if (::pipe(up) != 0 || ::pipe(down) != 0) Die("pipe failed");
  // Before this process touches CUDA: a child of a CUDA process must not use CUDA.
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) Die("fork failed");
  if (child == 0) {
    ::close(up[0]);
    ::close(down[1]);
    HoldInChild(streams, device, up[1], down[0], parent);
  }
  // Only the child's ends stay open there: a child that dies gives end-of-file at once.
  ::close(up[1]);
  ::close(down[0]);
  const char first = ReadByte(up[0], 60000);
  if (first == 'N') {
    ::waitpid(child, nullptr, 0);
    std::printf("no CUDA device; nothing to measure\n");
    return 0;
  }
  if (first != 'H') Die("the holding process did not hold its streams");
  Check(cudaSetDevice(device), "cudaSetDevice");
  std::vector<cudaStream_t> s = MakeStreams(streams);
  uint64_t* words = MappedWords(streams);
  std::vector<int> written(streams);
  for (int i = 0; i < streams; ++i) {
    Check(cu::StreamWrite64(s[i], &words[i], 1));
    written[i] = i;
  }
  // The other process's gate is shut all along: a write still out after two settle times is
  // held (a stream's first operation may start slowly).
  const ulysses::ipc::SettledWrites settled = ulysses::ipc::SettleWrites(
      [&](int i) { return __atomic_load_n(&words[i], __ATOMIC_ACQUIRE); }, written,
      std::vector<uint64_t>(streams, 1), std::chrono::milliseconds(settle_ms));
  WriteByte(down[1], 'O');
  const bool other_went_on = ReadByte(up[0], 20000) == 'D';
  bool all_landed = true;
  for (int i = 0; i < streams; ++i)
    all_landed = Landed(words, i, std::chrono::seconds(10)) && all_landed;
  // A child that did not go on is stuck on the GPU: it goes now, so this wait ends.
  if (!other_went_on) ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  nlohmann::json j = {{"bench", "queue_probe"},
                      {"mode", "across"},
                      {"label", label},
                      {"pid", static_cast<int>(parent)},
                      {"max_connections_env", conn ? conn : ""},
                      {"streams", streams},
                      {"settle_ms", settle_ms},
                      {"held_by_the_other_process", settled.held},
                      {"slow_writes", settled.slow},
                      {"every_write_landed_once_opened", all_landed},
                      {"the_other_process_went_on", other_went_on}};
  Emit(j, json_path);
  for (cudaStream_t x : s) cudaStreamDestroy(x);
  return all_landed && other_went_on ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  ulysses::bench::ProgramName() = "ulysses-queue-probe";
  CLI::App app{"ulysses-queue-probe: which streams of this process share a hardware queue"};
  int streams = 12, settle_ms = 20, hold_ms = 0, device = 0;
  std::vector<int> greatest;
  std::string json_path, label;
  bool across = false;
  app.add_option("--streams", streams, "streams to make and probe")->check(CLI::Range(2, 64));
  app.add_flag("--across", across,
               "whether another process's waiting streams hold back this process's streams");
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

  // Before anything here touches CUDA (DeviceCount does): its child must not inherit CUDA.
  if (across) return Across(streams, settle_ms, device, label, json_path);
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
  Emit(j, json_path);
  if (hold_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
  for (int i = 0; i < streams; ++i) cudaStreamDestroy(s[i]);
  return 0;
}
