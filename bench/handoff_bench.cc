// ulysses-handoff-bench: how long one hand-off between two streams takes on one GPU, the unit
// the daemon's per-call overhead is made of (docs/benchmarks.md, "The hand-off floor").
//
// Two sides play ping-pong on two device words for --rounds round trips. The ping side stores
// word B = i and waits for word A >= i; the pong side waits for B >= i and stores A = i. Both
// sides enqueue all their rounds before the ping side's stream is let go at a gate, so the
// host never paces the GPU: CUDA events on the ping stream time the device alone, and half a
// round trip is one hand-off. Modes:
//   memop:        both sides stream memory operations (cuStreamWriteValue64 / WaitValue64),
//                 as the client's ready and done words.
//   call:         ping as the client (write ready, wait done); pong as the daemon at W = 1
//                 (wait ready, one empty kernel, write done): the W = 1 call's protocol with a
//                 kernel that moves nothing.
//   call_store:   as call, but the pong side's kernel stores the done word itself (release
//                 store) instead of a memory operation after it.
//   call_poll:    as call, but the ping side waits for done in a one-thread polling kernel
//                 instead of a memory-operation wait.
//   spin:         one resident kernel per side polls with acquire loads and answers with
//                 release stores: the memory system's floor, no stream scheduling at all.
// Sides: `process` (two streams of this process) and `processes` (the pong side in a child
// process, through a CUDA IPC handle: two CUDA contexts, as a client and its daemon).
// First, what one operation costs the device on one stream, enqueued ahead behind the gate:
// an empty kernel, a word write, a wait that is already satisfied, both, an event record.
// The child's process can be shaped (--pong-streams, --pong-steps, ...) to find what in a
// waiting process slows its hand-offs (docs/benchmarks.md, "what slows a context's hand-offs").
#include <cuda_runtime.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "handoff_kernels.h"
#include "ulysses/ipc/cuda_memory.h"
#include "die.h"
#include "ulysses_git_commit.h"  // ULYSSES_GIT_COMMIT, written at build time

extern char** environ;

namespace {

namespace cu = ulysses::ipc::cuda;

using ulysses::bench::kWordA;
using ulysses::bench::kWordB;
using ulysses::bench::kWordCount;

using ulysses::bench::Check;
using ulysses::bench::Die;

// Today's UTC date, "2026-12-04".
std::string UtcDate() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

enum class Mode { kMemop, kCall, kCallStore, kCallPoll, kSpin };
Mode ModeOf(const std::string& name) {
  if (name == "memop") return Mode::kMemop;
  if (name == "call") return Mode::kCall;
  if (name == "call_store") return Mode::kCallStore;
  if (name == "call_poll") return Mode::kCallPoll;
  if (name == "spin") return Mode::kSpin;
  Die("--modes: " + name + " is none of memop, call, call_store, call_poll, spin");
  return Mode::kMemop;
}

// Enqueues the pong side's `rounds` answers on `stream`.
void EnqueuePong(Mode mode, uint64_t* words, uint64_t base, int rounds, cudaStream_t stream) {
  if (mode == Mode::kSpin) {
    Check(ulysses::bench::LaunchSpinSide(words, base, rounds, false, stream), "spin kernel launch");
    return;
  }
  for (int i = 1; i <= rounds; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    Check(cu::StreamWait64(stream, &words[kWordB], v));
    if (mode == Mode::kCallStore) {
      Check(ulysses::bench::LaunchStore(&words[kWordA], v, stream), "store kernel launch");
      continue;
    }
    if (mode == Mode::kCall || mode == Mode::kCallPoll)
      Check(ulysses::bench::LaunchEmpty(stream), "empty kernel launch");
    Check(cu::StreamWrite64(stream, &words[kWordA], v));
  }
}

// Enqueues the ping side behind the gate (a word of mapped host memory that this process's
// host opens: no stream of its own, which could share a hardware queue with the waiting one),
// between two timing events.
void EnqueuePing(Mode mode, uint64_t* words, const uint64_t* gate_word, uint64_t base, int rounds,
                 cudaStream_t stream, cudaEvent_t start, cudaEvent_t end, uint64_t gate) {
  Check(cu::StreamWait64(stream, gate_word, gate));
  Check(cudaEventRecord(start, stream), "cudaEventRecord");
  if (mode == Mode::kSpin) {
    Check(ulysses::bench::LaunchSpinSide(words, base, rounds, true, stream), "spin kernel launch");
  } else {
    for (int i = 1; i <= rounds; ++i) {
      const uint64_t v = base + static_cast<uint64_t>(i);
      Check(cu::StreamWrite64(stream, &words[kWordB], v));
      if (mode == Mode::kCallPoll)
        Check(ulysses::bench::LaunchPoll(&words[kWordA], v, stream), "poll kernel launch");
      else
        Check(cu::StreamWait64(stream, &words[kWordA], v));
    }
  }
  Check(cudaEventRecord(end, stream), "cudaEventRecord");
}

// Waits for `event` at most `limit`; false when it did not pass.
bool WaitBounded(cudaEvent_t event, std::chrono::seconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  cudaError_t q;
  while ((q = cudaEventQuery(event)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  Check(q, "cudaEventQuery");
  return true;
}

// The pong process's shape, to compare with the daemon's context: how many streams it makes
// (the rounds run on the last; the others stay idle, or ran one empty kernel each when
// `touch`), and its hardware-queue count (CUDA_DEVICE_MAX_CONNECTIONS; 0: the environment's).
struct PongShape {
  int streams = 1;
  bool touch = false;
  int queues = 0;
  bool copy = false;      // the idle streams each write a word and copy from pageable memory
  bool legacy = false;    // a device memset on the legacy default stream first
  bool destroy = false;   // the idle streams are destroyed before the rounds
  int idle_ms = 0;        // the process sleeps this long between the above and the rounds
  // Setup steps in order, run after the above (comma-separated): make:NAME, kernel:NAME,
  // copy:NAME, destroy:NAME, legacy, sleep:MS. The rounds run on the stream named "work"
  // (made last when no step made it).
  std::string steps;
};

// The pong process's setup steps, as the flags and the --pong-steps script name them.
// One empty kernel on `s`, waited for.
void PongKernel(cudaStream_t s) {
  Check(ulysses::bench::LaunchEmpty(s), "empty kernel launch");
  Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}
// A word write and an 8-byte copy from pageable memory on `s` (what the daemon's cancel
// does), no kernel, waited for.
void PongCopy(cudaStream_t s, uint64_t* words) {
  const std::vector<uint64_t> host(4, 0);
  Check(cu::StreamWrite64(s, &words[ulysses::bench::kWordScratch], 0));
  Check(cudaMemcpyAsync(&words[ulysses::bench::kWordScratch], host.data(), sizeof(uint64_t),
                        cudaMemcpyHostToDevice, s),
        "cudaMemcpyAsync");
  Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}
// A device memset on the legacy default stream.
void PongLegacyMemset() {
  void* scratch = nullptr;
  Check(cudaMalloc(&scratch, 4096), "cudaMalloc");
  Check(cudaMemset(scratch, 0, 4096), "cudaMemset");
  Check(cudaFree(scratch), "cudaFree");
}

// Runs the --pong-steps script; returns the stream named "work" (null when none was made).
cudaStream_t RunPongSteps(const std::string& script, uint64_t* words) {
  std::map<std::string, cudaStream_t> streams;
  auto named = [&](const std::string& name) {
    auto it = streams.find(name);
    if (it == streams.end()) Die("--pong-steps: no stream '" + name + "' was made before its use");
    return it->second;
  };
  for (absl::string_view step : absl::StrSplit(script, ',', absl::SkipEmpty())) {
    const std::vector<std::string> kv = absl::StrSplit(step, absl::MaxSplits(':', 1));
    const std::string& verb = kv[0];
    const std::string arg = kv.size() > 1 ? kv[1] : "";
    if (verb == "make") {
      cudaStream_t st = nullptr;
      Check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
      streams[arg] = st;
    } else if (verb == "kernel") {
      PongKernel(named(arg));
    } else if (verb == "copy") {
      PongCopy(named(arg), words);
    } else if (verb == "destroy") {
      Check(cudaStreamDestroy(named(arg)), "cudaStreamDestroy");
      streams.erase(arg);
    } else if (verb == "legacy") {
      PongLegacyMemset();
    } else if (verb == "sleep") {
      int ms = 0;
      if (!absl::SimpleAtoi(arg, &ms) || ms < 0) Die("--pong-steps: sleep:" + arg + " is no duration");
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    } else {
      Die("--pong-steps: '" + std::string(step) +
          "' is none of make:NAME, kernel:NAME, copy:NAME, destroy:NAME, legacy, sleep:MS");
    }
  }
  auto it = streams.find("work");
  return it == streams.end() ? nullptr : it->second;
}

// The child process: maps the words, enqueues its answers, says so on stdout, and waits.
int RunPong(const std::string& handle_hex, Mode mode, uint64_t base, int rounds,
            const PongShape& shape) {
  auto mapping = cu::IpcMapping::Open(absl::HexStringToBytes(handle_hex));
  Check(mapping.status());
  auto* words = static_cast<uint64_t*>(mapping->data());
  std::vector<cudaStream_t> idle(static_cast<size_t>(shape.streams - 1));
  for (cudaStream_t& s : idle) {
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    if (shape.touch) PongKernel(s);
    if (shape.copy) PongCopy(s, words);
  }
  if (shape.legacy) PongLegacyMemset();
  if (shape.destroy)
    for (cudaStream_t s : idle) Check(cudaStreamDestroy(s), "cudaStreamDestroy");
  if (shape.idle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(shape.idle_ms));
  cudaStream_t stream = RunPongSteps(shape.steps, words);
  if (stream == nullptr)
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t done;
  Check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  EnqueuePong(mode, words, base, rounds, stream);
  Check(cudaEventRecord(done, stream), "cudaEventRecord");
  std::printf("enqueued\n");
  std::fflush(stdout);
  if (!WaitBounded(done, std::chrono::seconds(10))) Die("pong side: the rounds did not finish");
  return 0;
}

struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;
};

Child SpawnPong(const std::string& handle_hex, const std::string& mode, uint64_t base, int rounds,
                const PongShape& shape) {
  int fds[2];
  if (pipe(fds) != 0) Die("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  const std::string base_s = std::to_string(base), rounds_s = std::to_string(rounds);
  const std::string streams_s = std::to_string(shape.streams);
  std::vector<char*> argv = {const_cast<char*>("ulysses-handoff-bench"),
                             const_cast<char*>("--pong-handle"), const_cast<char*>(handle_hex.c_str()),
                             const_cast<char*>("--modes"), const_cast<char*>(mode.c_str()),
                             const_cast<char*>("--pong-base"), const_cast<char*>(base_s.c_str()),
                             const_cast<char*>("--rounds"), const_cast<char*>(rounds_s.c_str()),
                             const_cast<char*>("--pong-streams"), const_cast<char*>(streams_s.c_str())};
  const std::string idle_s = std::to_string(shape.idle_ms);
  if (shape.touch) argv.push_back(const_cast<char*>("--pong-touch"));
  if (shape.legacy) argv.push_back(const_cast<char*>("--pong-legacy"));
  if (shape.copy) argv.push_back(const_cast<char*>("--pong-copy"));
  if (shape.destroy) argv.push_back(const_cast<char*>("--pong-destroy"));
  argv.push_back(const_cast<char*>("--pong-idle-ms"));
  argv.push_back(const_cast<char*>(idle_s.c_str()));
  if (!shape.steps.empty()) {
    argv.push_back(const_cast<char*>("--pong-steps"));
    argv.push_back(const_cast<char*>(shape.steps.c_str()));
  }
  argv.push_back(nullptr);
  // The child's environment: this one's, with its own queue count when one is asked for.
  std::vector<std::string> env_store;
  for (char** e = environ; *e != nullptr; ++e)
    if (shape.queues == 0 || std::string(*e).rfind("CUDA_DEVICE_MAX_CONNECTIONS=", 0) != 0)
      env_store.emplace_back(*e);
  if (shape.queues > 0)
    env_store.push_back("CUDA_DEVICE_MAX_CONNECTIONS=" + std::to_string(shape.queues));
  std::vector<char*> envp;
  for (std::string& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  Child child;
  if (posix_spawn(&child.pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data()) != 0)
    Die("posix_spawn of the pong side failed");
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  child.out = fdopen(fds[0], "r");
  return child;
}

}  // namespace

int main(int argc, char** argv) {
  ulysses::bench::ProgramName() = "ulysses-handoff-bench";
  CLI::App app{"ulysses-handoff-bench: the latency of one stream hand-off on one GPU"};
  std::vector<std::string> modes = {"memop", "call", "call_store", "call_poll", "spin"};
  std::vector<std::string> sides = {"process", "processes"};
  int rounds = 50, reps = 21;
  std::string pong_handle, json_path, label;
  uint64_t pong_base = 0;
  app.add_option("--modes", modes, "memop, call, call_store, call_poll, spin");
  app.add_option("--sides", sides, "process (two streams here), processes (a child process)");
  // Everything of a sample is enqueued before the gate opens, so the rounds must fit the
  // driver's command queue: an enqueue that waits for room would wait for the gate.
  app.add_option("--rounds", rounds, "round trips per sample")->check(CLI::Range(1, 200));
  app.add_option("--reps", reps, "samples per case (the median is reported)")
      ->check(CLI::Range(1, 100));
  app.add_option("--json", json_path, "also write the JSON here");
  app.add_option("--label", label, "recorded in the JSON as is (e.g. how MPS was run)");
  app.add_option("--pong-handle", pong_handle, "(internal) run as the child's pong side");
  app.add_option("--pong-base", pong_base, "(internal) the child's first value - 1");
  PongShape shape;
  app.add_option("--pong-streams", shape.streams,
                 "streams the child process makes; its rounds run on the last (processes only)")
      ->check(CLI::Range(1, 64));
  app.add_flag("--pong-touch", shape.touch,
               "the child's idle streams each run one empty kernel first");
  app.add_option("--pong-queues", shape.queues,
                 "CUDA_DEVICE_MAX_CONNECTIONS of the child process only (0: this environment's)")
      ->check(CLI::Range(0, 32));
  app.add_flag("--pong-copy", shape.copy,
               "the child's idle streams each write a word and copy 8 bytes from pageable memory");
  app.add_flag("--pong-legacy", shape.legacy,
               "the child first runs a device memset on the legacy default stream");
  app.add_flag("--pong-destroy", shape.destroy,
               "the child destroys its idle streams before its rounds");
  app.add_option("--pong-steps", shape.steps,
                 "the child's setup, in order, after the flags above: make:NAME, kernel:NAME, "
                 "copy:NAME, destroy:NAME, legacy, sleep:MS; its rounds run on stream 'work'");
  app.add_option("--pong-idle-ms", shape.idle_ms,
                 "the child sleeps this long before its rounds")
      ->check(CLI::Range(0, 10000));
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  for (const std::string& m : modes) ModeOf(m);
  for (const std::string& side : sides)
    if (side != "process" && side != "processes")
      Die("--sides: " + side + " is neither process nor processes");

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("ulysses-handoff-bench: no CUDA device; nothing to measure\n");
    return 0;
  }
  if (!pong_handle.empty())
    return RunPong(pong_handle, ModeOf(modes.at(0)), pong_base, rounds, shape);

  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  uint64_t* words = nullptr;
  Check(cudaMalloc(&words, kWordCount * sizeof(uint64_t)), "cudaMalloc");
  Check(cudaMemset(words, 0, kWordCount * sizeof(uint64_t)), "cudaMemset");
  auto handle = cu::IpcHandle(words);
  Check(handle.status());
  const std::string handle_hex = absl::BytesToHexString(*handle);
  uint64_t* gate_host = nullptr;
  uint64_t* gate_device = nullptr;
  Check(cudaHostAlloc(reinterpret_cast<void**>(&gate_host), sizeof(uint64_t), cudaHostAllocMapped),
        "cudaHostAlloc");
  *gate_host = 0;
  Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_device), gate_host, 0),
        "cudaHostGetDevicePointer");
  cudaStream_t ping, pong;
  for (cudaStream_t* s : {&ping, &pong})
    Check(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t start, end, pong_done;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&end), "cudaEventCreate");
  Check(cudaEventCreateWithFlags(&pong_done, cudaEventDisableTiming), "cudaEventCreate");

  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };

  nlohmann::json rows = nlohmann::json::array();
  uint64_t base = 0, gate = 0;
  // What one operation of each kind costs the device on one stream: `rounds` of them behind
  // the gate, nothing to wait for (the waited word is already past).
  cudaEvent_t marker;
  Check(cudaEventCreateWithFlags(&marker, cudaEventDisableTiming), "cudaEventCreate");
  std::printf("%-10s %-12s %12s\n", "one stream", "operation", "us each");
  for (const char* op : {"kernel", "write", "wait", "write_wait", "event"}) {
    const std::string kind = op;
    std::vector<double> op_us;
    for (int rep = 0; rep < reps; ++rep) {
      Check(cu::StreamWait64(ping, gate_device, ++gate));
      Check(cudaEventRecord(start, ping), "cudaEventRecord");
      for (int i = 0; i < rounds; ++i) {
        if (kind == "kernel") Check(ulysses::bench::LaunchEmpty(ping), "empty kernel launch");
        if (kind == "write" || kind == "write_wait") Check(cu::StreamWrite64(ping, &words[kWordA], 0));
        if (kind == "wait" || kind == "write_wait") Check(cu::StreamWait64(ping, &words[kWordB], 0));
        if (kind == "event") Check(cudaEventRecord(marker, ping), "cudaEventRecord");
      }
      Check(cudaEventRecord(end, ping), "cudaEventRecord");
      __atomic_store_n(gate_host, gate, __ATOMIC_RELEASE);
      if (!WaitBounded(end, std::chrono::seconds(10))) Die("the one-stream operations did not finish");
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, start, end), "cudaEventElapsedTime");
      op_us.push_back(ms * 1e3 / rounds);
    }
    std::printf("%-10s %-12s %12.2f\n", "", op, median(op_us));
    rows.push_back({{"sides", "one stream"}, {"mode", kind}, {"per_operation_us", median(op_us)}});
  }
  std::printf("%-10s %-12s %12s %12s\n", "sides", "mode", "round trip us", "hand-off us");
  bool any_stall = false;
  for (const std::string& side : sides) {
    if (any_stall) break;
    for (const std::string& mode_name : modes) {
      const Mode mode = ModeOf(mode_name);
      std::vector<double> rt_us;
      bool stalled = false;
      for (int rep = 0; rep < reps && !stalled; ++rep) {
        Child child;
        if (side == "process") {
          EnqueuePong(mode, words, base, rounds, pong);
          Check(cudaEventRecord(pong_done, pong), "cudaEventRecord");
        } else {
          child = SpawnPong(handle_hex, mode_name, base, rounds, shape);
        }
        EnqueuePing(mode, words, gate_device, base, rounds, ping, start, end, ++gate);
        if (child.out != nullptr) {
          char line[64] = {};
          if (std::fgets(line, sizeof line, child.out) == nullptr) Die("the pong side ended early");
        }
        // Both sides enqueued: let the ping side go.
        __atomic_store_n(gate_host, gate, __ATOMIC_RELEASE);
        stalled = !WaitBounded(end, std::chrono::seconds(10));
        if (child.pid > 0) {
          int status = 0;
          waitpid(child.pid, &status, 0);
          std::fclose(child.out);
          if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) stalled = true;
        } else if (!stalled) {
          stalled = !WaitBounded(pong_done, std::chrono::seconds(10));
        }
        if (stalled) break;
        float ms = 0;
        Check(cudaEventElapsedTime(&ms, start, end), "cudaEventElapsedTime");
        rt_us.push_back(ms * 1e3 / rounds);
        base += static_cast<uint64_t>(rounds);
      }
      if (stalled) {
        std::printf("%-10s %-12s %12s %12s\n", side.c_str(), mode_name.c_str(), "stalled", "-");
        rows.push_back({{"sides", side}, {"mode", mode_name}, {"stalled", true}});
        // A stalled stream cannot be reused safely: stop here with what was measured.
        any_stall = true;
        break;
      }
      const double rt = median(rt_us);
      std::printf("%-10s %-12s %12.2f %12.2f\n", side.c_str(), mode_name.c_str(), rt, rt / 2);
      rows.push_back({{"sides", side},
                      {"mode", mode_name},
                      {"round_trip_us", rt},
                      {"handoff_us", rt / 2},
                      {"samples_us", rt_us}});
    }
  }
  const char* mps = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  nlohmann::json out = {{"bench", "handoff"},
                        {"gpu", prop.name},
                        {"commit", ULYSSES_GIT_COMMIT},
                        {"mps_pipe_set", mps != nullptr},
                        {"label", label},
                        {"date", UtcDate()},
                        {"rounds", rounds},
                        {"reps", reps},
                        {"pong_streams", shape.streams},
                        {"pong_touch", shape.touch},
                        {"pong_queues", shape.queues},
                        {"pong_legacy", shape.legacy},
                        {"pong_copy", shape.copy},
                        {"pong_destroy", shape.destroy},
                        {"pong_idle_ms", shape.idle_ms},
                        {"pong_steps", shape.steps},
                        {"rows", rows}};
  std::printf("%s\n", out.dump().c_str());
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) Die("--json: cannot write " + json_path);
    std::fprintf(f, "%s\n", out.dump(1).c_str());
    std::fclose(f);
  }
  return any_stall ? 2 : 0;
}
