// ulysses-gpu-bench: the GPU backend's head exchanges on ONE GPU shared by W ranks, against the
// same kernels launched in-process and against a plain device-to-device copy (DESIGN.md
// section 8).
//
// W ulyssesd processes (--backend nvlink) all serve the one GPU. The ring path's clients are W
// processes, one per rank (--ranks processes, the default: how frameworks run; each makes its
// rank's input with the same bits and checks its result against the CPU's), or W threads of
// this process (--ranks threads: the test mode whose ranks can hold each other on a shared
// hardware queue, docs/architecture.md section 8). The other variants' clients are threads of
// this process; their inputs are cudaMalloc'd tensors here, registered with the daemons
// (RegisterDeviceBuffer):
//   inprocess    the W*W LaunchScatterHeadsBlock / LaunchGatherHeadsBlock launches on one
//                stream into W slots of this process (CUDA events around them)
//   daemon_ring  the call through the daemons, rings on (default ConnectOptions)
//   daemon_grpc  the call through the daemons with every call a Call RPC (use_rings = false)
//   copy         W cudaMemcpyAsync device-to-device of bytes_per_rank each (CUDA events)
// A daemon sample is one iteration of all W ranks calling at once; its time is the slowest
// rank's wall time of the call (and the release of its result).
//
// Part "exchange" (scatter_heads and gather_heads, W in --world, --sizes per rank) reports GB/s =
// W * bytes_per_rank / time for daemon_ring, inprocess and copy. Part "overhead" (scatter_heads,
// W in --overhead-world, --overhead-sizes) reports the per-call times of inprocess, daemon_ring
// and daemon_grpc.
//
// Part "overhead" also times each call with the host ahead of the device (inprocess_ahead,
// daemon_ring_ahead): the stream is held at a gate while the host enqueues everything (the
// in-process launches, or the daemon call and its release), the host waits --ahead-us so the
// daemons' hosts have enqueued their side too, then opens the gate; CUDA events after the gate
// and after the work time the device's part alone. That is a framework's case, whose host runs
// ahead of its stream: what the daemon adds on the stream, without the enqueue latency.
//
// Method: outputs checked bit for bit before timing (in-process against the CPU reference up to
// --reference-max-bytes, every daemon path against the in-process output); warm-up; the L2
// flushed (a 256 MiB cudaMemsetAsync) before every sample, outside its time; rounds visit the
// variants forward then reversed (in-process, daemon, ..., daemon, in-process); the median of
// all samples per variant; the A/A control is in-process's second visits against its first.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench_util.h"
#include "demo_lib.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "ulysses/client/client.h"
#include "ulysses/common/config.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/protocol_words.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/kernels/exchange.h"
#include "ulysses/kernels/exchange_cuda.h"
#include "ulysses/kernels/reference.h"
#include "ulysses/v1/admin.grpc.pb.h"

#include "ulysses_git_commit.h"  // ULYSSES_GIT_COMMIT, written at build time

namespace ulysses::bench {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kTool = "ulysses-gpu-bench";
constexpr uint64_t kFlushBytes = uint64_t{256} << 20;  // over four times the H200's L2
constexpr int32_t kSlots = 2;                          // receive slots per daemon session
constexpr int64_t kInt32Max = 2147483647;

void Say(const std::string& line) { Log(kTool, line); }

absl::Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(StrCat(what, ": ", cudaGetErrorString(err)));
}

// ---------------------------------------------------------------------------------------
// Device resources (freed on every path)
// ---------------------------------------------------------------------------------------

struct CudaFree {
  void operator()(void* p) const { (void)cudaFree(p); }
};
using DeviceMem = std::unique_ptr<void, CudaFree>;

absl::StatusOr<DeviceMem> DeviceAlloc(uint64_t bytes) {
  void* p = nullptr;
  ULY_RETURN_IF_ERROR(Cuda(cudaMalloc(&p, bytes), StrCat("cudaMalloc of ", bytes, " bytes").c_str()));
  return DeviceMem(p);
}

class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  absl::Status Create() { return Cuda(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class EventPair {
 public:
  EventPair() = default;
  ~EventPair() {
    if (start_ != nullptr) (void)cudaEventDestroy(start_);
    if (stop_ != nullptr) (void)cudaEventDestroy(stop_);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  absl::Status Create() {
    ULY_RETURN_IF_ERROR(Cuda(cudaEventCreate(&start_), "cudaEventCreate"));
    return Cuda(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  cudaEvent_t start() const { return start_; }
  cudaEvent_t stop() const { return stop_; }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// A word that holds streams until the host opens it: Hold enqueues a wait for the value of the
// next opening; Open stores it from the host into mapped pinned memory. No stream opens it: a
// stream of this process could share a hardware queue with a held one and sit behind its wait
// (under MPS a process has few queues; docs/benchmarks.md, "The hand-off floor").
class Gate {
 public:
  absl::Status Create() {
    void* host = nullptr;
    ULY_RETURN_IF_ERROR(Cuda(cudaHostAlloc(&host, sizeof(uint64_t), cudaHostAllocMapped), "gate"));
    host_.reset(static_cast<uint64_t*>(host));
    *host_ = 0;
    void* device = nullptr;
    ULY_RETURN_IF_ERROR(Cuda(cudaHostGetDevicePointer(&device, host, 0), "gate mapping"));
    device_ = static_cast<uint64_t*>(device);
    return absl::OkStatus();
  }
  /// The value the next Hold waits for and the next Open writes.
  uint64_t Next() { return ++value_; }
  absl::Status Hold(cudaStream_t s, uint64_t v) const { return ipc::cuda::StreamWait64(s, device_, v); }
  absl::Status Open(uint64_t v) const {
    __atomic_store_n(host_.get(), v, __ATOMIC_RELEASE);
    return absl::OkStatus();
  }

 private:
  struct FreeHost {
    void operator()(uint64_t* p) const { (void)cudaFreeHost(p); }
  };
  std::unique_ptr<uint64_t, FreeHost> host_;
  uint64_t* device_ = nullptr;
  uint64_t value_ = 0;
};

void SleepUs(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// ---------------------------------------------------------------------------------------
// A case
// ---------------------------------------------------------------------------------------

// kDaemonRingStream is not run by itself: it is kDaemonRing's samples timed on the stream.
// The two *Ahead variants hold the stream at a gate until the host has enqueued the call.
enum class Variant {
  kInProcess,
  kDaemonRing,
  kDaemonGrpc,
  kCopy,
  kDaemonRingStream,
  kInProcessAhead,
  kDaemonRingAhead
};

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kInProcess: return "inprocess";
    case Variant::kDaemonRing: return "daemon_ring";
    case Variant::kDaemonGrpc: return "daemon_grpc";
    case Variant::kCopy: return "copy";
    case Variant::kDaemonRingStream: return "daemon_ring_stream";
    case Variant::kInProcessAhead: return "inprocess_ahead";
    case Variant::kDaemonRingAhead: return "daemon_ring_ahead";
  }
  return "?";
}

struct Case {
  OpKind op = OpKind::kScatterHeads;
  int32_t world = 1;
  uint64_t bytes = 0;  ///< per rank: input and output of both ops hold B*S_l*H*D elements
  int32_t heads_per_rank = 8;
  int32_t head_dim = 128;
  bool exchange = false;  ///< a row of part "exchange"
  bool overhead = false;  ///< a row of part "overhead"
  int64_t ahead_us = 0;   ///< part overhead: > 0 adds the *Ahead variants, the host this far ahead
  bool rank_processes = true;  ///< the ring's ranks in processes of their own (else threads here)
  bool grpc = true;  ///< part overhead: also time the gRPC path (a second session per daemon)

  static constexpr int32_t kItem = 2;  // bf16
  int32_t heads() const { return heads_per_rank * world; }
  uint64_t token_bytes() const { return static_cast<uint64_t>(heads()) * head_dim * kItem; }
  int64_t seq_local() const { return static_cast<int64_t>(bytes / token_bytes()); }
  kernels::ExchangeShape shape() const {
    return {world, 1, seq_local(), heads(), head_dim, kItem};
  }
  kernels::ConstView input_view(const void* data) const {
    return op == OpKind::kScatterHeads
               ? kernels::ContiguousConstView(data, seq_local(), heads(), head_dim)
               : kernels::ContiguousConstView(data, world * seq_local(), heads_per_rank, head_dim);
  }
  std::vector<Variant> variants() const {
    std::vector<Variant> v{Variant::kInProcess, Variant::kDaemonRing};
    if (overhead && grpc) v.push_back(Variant::kDaemonGrpc);
    if (overhead && ahead_us > 0) {
      v.push_back(Variant::kInProcessAhead);
      v.push_back(Variant::kDaemonRingAhead);
    }
    if (exchange) v.push_back(Variant::kCopy);
    return v;
  }
  std::string name() const { return StrCat("W=", world, " ", OpName(op), " ", bytes, " B/rank"); }
};

/// Checks the geometry of bytes_per_rank at world W; the error names `flag`.
absl::Status CheckSize(const std::string& flag, uint64_t bytes, int32_t world, int32_t heads_per_rank,
                       int32_t head_dim) {
  Case c;
  c.world = world;
  c.bytes = bytes;
  c.heads_per_rank = heads_per_rank;
  c.head_dim = head_dim;
  if (bytes == 0 || bytes % c.token_bytes() != 0)
    return absl::InvalidArgumentError(
        StrCat(flag, ": ", bytes, " bytes per rank is not a positive multiple of a token's H*D*2 = ",
               c.token_bytes(), " bytes at W=", world, " (H = --heads-per-rank * W)"));
  if (3 * c.seq_local() > kInt32Max / (static_cast<int64_t>(c.heads()) * head_dim))
    return absl::InvalidArgumentError(
        StrCat(flag, ": ", bytes, " bytes per rank at W=", world,
               " makes a receive slot over the int32 element limit (at most about 1.3 GiB per rank)"));
  return absl::OkStatus();
}

// Deterministic input bits of rank r: a multiplicative hash of (op, rank, index), never 0xFFFF
// (the poison value).
void FillInput(uint16_t* data, uint64_t elems, int rank, OpKind op) {
  const uint64_t salt = (static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(op) << 52);
  for (uint64_t i = 0; i < elems; ++i) {
    const uint64_t x = (i + 1 + salt) * 0x9E3779B97F4A7C15ull;
    data[i] = static_cast<uint16_t>((x >> 40) % 0xFFFF);
  }
}

// The session every rank of a case opens: its geometry, bf16, kSlots slots.
client::SessionSpec SpecOf(const Case& c) {
  client::SessionSpec spec;
  spec.num_heads = c.heads();
  spec.head_dim = c.head_dim;
  spec.dtype = DType::kBFloat16;
  spec.max_tokens = c.seq_local();
  spec.num_slots = kSlots;
  return spec;
}

std::unique_ptr<uint8_t[]> HostBytes(uint64_t bytes) {
  return std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[bytes]);
}

int64_t FirstDifference(const uint8_t* a, const uint8_t* b, uint64_t bytes) {
  if (std::memcmp(a, b, bytes) == 0) return -1;
  for (uint64_t i = 0; i < bytes; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i / Case::kItem);
  return -1;
}

// ---------------------------------------------------------------------------------------
// The in-process side: the inputs (shared with the daemon path), W slots, a stream, events
// ---------------------------------------------------------------------------------------

class InProcess {
 public:
  explicit InProcess(const Case& c) : c_(c) {}

  /// Allocates and fills the inputs and slots; keeps host copies of the inputs when `keep_host`.
  absl::Status Open(bool keep_host) {
    ULY_RETURN_IF_ERROR(stream_.Create());
    ULY_RETURN_IF_ERROR(events_.Create());
    ULY_ASSIGN_OR_RETURN(flush_, DeviceAlloc(kFlushBytes));
    std::unique_ptr<uint8_t[]> host = HostBytes(c_.bytes);
    if (!host) return absl::ResourceExhaustedError(StrCat("host memory: ", c_.bytes, " bytes"));
    for (int r = 0; r < c_.world; ++r) {
      ULY_ASSIGN_OR_RETURN(DeviceMem in, DeviceAlloc(c_.bytes));
      ULY_ASSIGN_OR_RETURN(DeviceMem slot, DeviceAlloc(c_.bytes));
      FillInput(reinterpret_cast<uint16_t*>(host.get()), c_.bytes / Case::kItem, r, c_.op);
      ULY_RETURN_IF_ERROR(Cuda(cudaMemcpy(in.get(), host.get(), c_.bytes, cudaMemcpyHostToDevice),
                               "upload input"));
      in_.push_back(std::move(in));
      slot_.push_back(std::move(slot));
      if (keep_host) {
        host_in_.push_back(std::move(host));
        if (r + 1 < c_.world) {
          host = HostBytes(c_.bytes);
          if (!host) return absl::ResourceExhaustedError(StrCat("host memory: ", c_.bytes, " bytes"));
        }
      }
    }
    // A pageable upload may return before its DMA lands; the launches on the non-blocking
    // stream and the daemons' reads must see the inputs complete.
    return Cuda(cudaDeviceSynchronize(), "upload inputs");
  }

  void* input(int r) const { return in_[r].get(); }
  void* slot(int r) const { return slot_[r].get(); }
  cudaStream_t stream() const { return stream_.get(); }

  /// The L2 flush: a memset of the scratch buffer, waited for.
  absl::Status Flush() {
    ULY_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(flush_.get(), ++flush_value_ & 0x7F, kFlushBytes,
                                             stream_.get()), "flush"));
    return Cuda(cudaStreamSynchronize(stream_.get()), "flush sync");
  }

  /// Enqueues the W*W blocks as the daemons do: one launch per source for all its destinations.
  absl::Status EnqueueExchange() {
    const kernels::ExchangeShape shape = c_.shape();
    const int W = c_.world;
    void* outs[kMaxWorldSize] = {};
    for (int dst = 0; dst < W; ++dst) outs[dst] = slot_[dst].get();
    const kernels::BlockKind kind = c_.op == OpKind::kScatterHeads ? kernels::BlockKind::kScatterHeads
                                                                   : kernels::BlockKind::kGatherHeads;
    for (int src = 0; src < W; ++src) {
      const kernels::ConstView x = c_.input_view(in_[src].get());
      ULY_RETURN_IF_ERROR(
          kernels::LaunchBlocks(shape, kernels::BlockOperands{kind, {x, x, x}, 0, 0}, src, outs,
                                stream_.get()));
    }
    return absl::OkStatus();
  }

  absl::Status EnqueueCopy() {
    for (int r = 0; r < c_.world; ++r)
      ULY_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(slot_[r].get(), in_[r].get(), c_.bytes,
                                               cudaMemcpyDeviceToDevice, stream_.get()), "copy"));
    return absl::OkStatus();
  }

  /// `n` samples of `v` (kInProcess, kInProcessAhead or kCopy) in microseconds, the L2 flushed
  /// before each. kInProcessAhead holds the stream at `gate` until the launches are enqueued
  /// and `ahead_us` more have passed.
  absl::StatusOr<std::vector<double>> Time(Variant v, int n, Gate* gate = nullptr, int64_t ahead_us = 0) {
    std::vector<double> us;
    const bool held = v == Variant::kInProcessAhead;
    if (held && gate == nullptr) return absl::InternalError("inprocess_ahead without a gate");
    for (int i = 0; i < n; ++i) {
      ULY_RETURN_IF_ERROR(Flush());
      const uint64_t g = held ? gate->Next() : 0;
      if (held) ULY_RETURN_IF_ERROR(gate->Hold(stream_.get(), g));
      ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events_.start(), stream_.get()), "event"));
      ULY_RETURN_IF_ERROR(v == Variant::kCopy ? EnqueueCopy() : EnqueueExchange());
      ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events_.stop(), stream_.get()), "event"));
      if (held) {
        SleepUs(ahead_us);
        ULY_RETURN_IF_ERROR(gate->Open(g));
      }
      ULY_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(events_.stop()), "event sync"));
      float ms = 0;
      ULY_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, events_.start(), events_.stop()), "elapsed"));
      us.push_back(static_cast<double>(ms) * 1e3);
    }
    return us;
  }

  /// Runs the exchange once into NaN-filled slots; checks it against the CPU reference when
  /// the host inputs were kept. Returns whether the reference was compared.
  absl::StatusOr<bool> RunAndCheck() {
    for (int r = 0; r < c_.world; ++r)
      ULY_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(slot_[r].get(), 0xFF, c_.bytes, stream_.get()), "poison"));
    ULY_RETURN_IF_ERROR(EnqueueExchange());
    ULY_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_.get()), "exchange"));
    if (host_in_.empty()) return false;
    std::vector<kernels::ConstView> views;
    for (int r = 0; r < c_.world; ++r) views.push_back(c_.input_view(host_in_[r].get()));
    ULY_ASSIGN_OR_RETURN(std::vector<kernels::HostBuffer> ref,
                         c_.op == OpKind::kScatterHeads ? kernels::ScatterHeadsRef(c_.shape(), views)
                                                        : kernels::GatherHeadsRef(c_.shape(), views));
    std::unique_ptr<uint8_t[]> got = HostBytes(c_.bytes);
    if (!got) return absl::ResourceExhaustedError("host memory for the check");
    for (int r = 0; r < c_.world; ++r) {
      if (ref[r].size() != c_.bytes)
        return absl::InternalError(StrCat("reference output of rank ", r, " has ", ref[r].size(), " bytes"));
      ULY_RETURN_IF_ERROR(Cuda(cudaMemcpy(got.get(), slot_[r].get(), c_.bytes, cudaMemcpyDeviceToHost), "read slot"));
      const int64_t e = FirstDifference(got.get(), ref[r].data(), c_.bytes);
      if (e >= 0)
        return absl::DataLossError(StrCat("in-process output of rank ", r,
                                          " differs from the CPU reference at element ", e));
    }
    return true;
  }

 private:
  Case c_;
  Stream stream_;
  EventPair events_;
  DeviceMem flush_;
  int flush_value_ = 0;
  std::vector<DeviceMem> in_, slot_;
  std::vector<std::unique_ptr<uint8_t[]>> host_in_;
};

// ---------------------------------------------------------------------------------------
// The daemon side: one set of clients, a session per rank, the inputs registered
// ---------------------------------------------------------------------------------------

class DaemonPath {
 public:
  DaemonPath(const Case& c, Cluster& cluster, int set) : c_(c), cluster_(cluster), set_(set) {}
  ~DaemonPath() { (void)Close(); }
  DaemonPath(const DaemonPath&) = delete;
  DaemonPath& operator=(const DaemonPath&) = delete;

  absl::Status Open(const InProcess& a) {
    const int W = c_.world;
    sessions_.resize(W);
    in_.resize(W);
    streams_ = std::vector<Stream>(W);
    events_ = std::vector<EventPair>(W);
    stream_us_.assign(W, {});
    for (int r = 0; r < W; ++r) {
      ULY_RETURN_IF_ERROR(streams_[r].Create());
      ULY_RETURN_IF_ERROR(events_[r].Create());
      ULY_ASSIGN_OR_RETURN(in_[r], cluster_.client(r, set_).RegisterDeviceBuffer(a.input(r), c_.bytes, "bench-in"));
    }
    return RunCollective(W, [&](int r) -> absl::Status {
      ULY_ASSIGN_OR_RETURN(sessions_[r],
                           cluster_.client(r, set_).CreateSession(cluster_.group(r, set_), SpecOf(c_)));
      sessions_[r]->set_stream(streams_[r].get());
      return absl::OkStatus();
    });
  }

  absl::StatusOr<client::Result> Call(int r) {
    client::Session& s = *sessions_[r];
    return c_.op == OpKind::kScatterHeads ? s.ScatterHeads(in_[r].Ref(), 1, c_.seq_local())
                                          : s.GatherHeads(in_[r].Ref(), 1, c_.world * c_.seq_local());
  }

  /// Rank r's part of one timed iteration: the call, and the release of its slot.
  // Calls are stream-ordered: the iteration ends when the rank's stream has the result (and
  // the daemon reported no error).
  // The same span is also timed on the stream (events before the call and after the release):
  // the device's part of the call, without the host's enqueue and wake-up.
  absl::Status Work(int r) {
    ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[r].start(), streams_[r].get()), "event"));
    ULY_ASSIGN_OR_RETURN(client::Result res, Call(r));
    ULY_RETURN_IF_ERROR(res.Release());
    ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[r].stop(), streams_[r].get()), "event"));
    return CollectHeld(r);
  }

  /// Rank r's part of one iteration with the host ahead, in two halves: Enqueue holds the
  /// rank's stream at `gate` (value g), then puts the events, the call and its release behind
  /// it; once the gate is open, CollectHeld waits for the stream and keeps the events' time
  /// (Work's end as well).
  absl::Status EnqueueHeld(int r, const Gate& gate, uint64_t g) {
    ULY_RETURN_IF_ERROR(gate.Hold(streams_[r].get(), g));
    ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[r].start(), streams_[r].get()), "event"));
    ULY_ASSIGN_OR_RETURN(client::Result res, Call(r));
    ULY_RETURN_IF_ERROR(res.Release());
    return Cuda(cudaEventRecord(events_[r].stop(), streams_[r].get()), "event");
  }
  absl::Status CollectHeld(int r) {
    ULY_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(streams_[r].get()), "stream"));
    float ms = 0;
    ULY_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, events_[r].start(), events_[r].stop()), "elapsed"));
    stream_us_[r].push_back(static_cast<double>(ms) * 1e3);
    return absl::OkStatus();
  }

  /// This path's session on each rank (ids on that rank's daemon).
  std::vector<uint64_t> session_ids() const {
    std::vector<uint64_t> ids;
    for (const auto& s : sessions_) ids.push_back(s ? s->id() : 0);
    return ids;
  }

  /// The on-stream times of the last `n` iterations, the slowest rank's per iteration; forgets
  /// every time taken so far.
  std::vector<double> TakeStreamUs(int n) {
    std::vector<double> out(n, 0);
    for (std::vector<double>& t : stream_us_) {
      const int have = static_cast<int>(t.size());
      for (int i = 0; i < n && i < have; ++i) out[n - 1 - i] = std::max(out[n - 1 - i], t[have - 1 - i]);
      t.clear();
    }
    return out;
  }

  /// One collective call into poisoned slots; every rank's result must equal the in-process
  /// output bit for bit.
  absl::Status Check(const InProcess& a) {
    const int W = c_.world;
    std::vector<client::Result> results(W);
    // Every rank's slots poisoned before any rank calls (a peer's call writes into them).
    for (int r = 0; r < W; ++r) ULY_RETURN_IF_ERROR(sessions_[r]->PoisonSlots().status());
    ULY_RETURN_IF_ERROR(RunCollective(W, [&](int r) -> absl::Status {
      ULY_ASSIGN_OR_RETURN(results[r], Call(r));
      return sessions_[r]->Synchronize();
    }));
    std::unique_ptr<uint8_t[]> got = HostBytes(c_.bytes), want = HostBytes(c_.bytes);
    if (!got || !want) return absl::ResourceExhaustedError("host memory for the check");
    for (int r = 0; r < W; ++r) {
      const client::Result& res = results[r];
      if (!res.device) return absl::InternalError(StrCat("rank ", r, ": the result is not device memory"));
      if (res.bytes != c_.bytes)
        return absl::InternalError(StrCat("rank ", r, ": the result has ", res.bytes, " bytes, expected ", c_.bytes));
      ULY_RETURN_IF_ERROR(Cuda(cudaMemcpy(got.get(), res.data, c_.bytes, cudaMemcpyDeviceToHost), "read result"));
      ULY_RETURN_IF_ERROR(Cuda(cudaMemcpy(want.get(), a.slot(r), c_.bytes, cudaMemcpyDeviceToHost), "read slot"));
      const int64_t e = FirstDifference(got.get(), want.get(), c_.bytes);
      if (e >= 0)
        return absl::DataLossError(StrCat("rank ", r, ": the daemon's result differs from the "
                                          "in-process output at element ", e));
    }
    for (client::Result& res : results) ULY_RETURN_IF_ERROR(res.Release());
    return absl::OkStatus();
  }

  absl::Status Close() {
    absl::Status status;
    for (size_t r = 0; r < sessions_.size(); ++r) {
      if (sessions_[r]) status.Update(sessions_[r]->Close());
      sessions_[r].reset();
    }
    for (size_t r = 0; r < in_.size(); ++r) {
      if (in_[r].id) status.Update(cluster_.client(static_cast<int>(r), set_).FreeBuffer(in_[r].id));
      in_[r] = {};
    }
    sessions_.clear();
    in_.clear();
    streams_.clear();
    return status;
  }

 private:
  Case c_;
  Cluster& cluster_;
  int set_;
  std::vector<std::unique_ptr<client::Session>> sessions_;
  std::vector<client::Buffer> in_;
  std::vector<Stream> streams_;
  std::vector<EventPair> events_;
  std::vector<std::vector<double>> stream_us_;  // per rank, one entry per Work
};

// ---------------------------------------------------------------------------------------
// The ring with each rank's client in a process of its own (--rank-processes)
// ---------------------------------------------------------------------------------------

// One process per rank is how frameworks run, and it keeps one rank's waits off another
// rank's hardware queues (docs/architecture.md section 8). The children share one gate: a
// page of a memfd that every child registers with CUDA as mapped host memory, held by each
// child's stream and opened by this process's store. Commands and answers are lines on the
// children's stdin and stdout:
//   (at start)                                                     -> ok <session id>
//   poison          poison this rank's slots                       -> ok
//   check           one call into them, compared with the CPU's    -> ok | error ...
//   arm K           answer, then spin until the start word is K, and time one call: event,
//                   call, release, event, wait for the stream (as the threads' Work)
//                                                                  -> us <wall> <on stream>
//   hold G          stream: wait gate >= G, event, call, release, event -> ok
//   collect         wait for the stream and the session            -> us <device time>
//   quit            close and exit
// The memfd page holds the gate (word 0) and the start word (word 1).
struct RankChildArgs {
  OpKind op = OpKind::kScatterHeads;
  int rank = -1;
  int gate_fd = -1;
  int world = 1;
  uint64_t bytes = 0;
  int heads_per_rank = 8;
  int head_dim = 128;
  std::string group;
  std::vector<std::string> members;
};

// Rank `dst`'s result from every rank's FillInput bits, as the CPU computes it: scatter_heads
// [1, W*S_l, H/W, D] (source src's band of dst's heads at positions src*S_l + s), gather_heads
// [1, S_l, H, D] (source src's heads at src*H/W + h, from its positions dst*S_l + s).
std::vector<uint16_t> ExpectedResult(const Case& c, int dst) {
  const int64_t S = c.seq_local(), H = c.heads(), Hl = c.heads_per_rank, D = c.head_dim;
  const uint64_t elems = c.bytes / Case::kItem;
  const size_t row = static_cast<size_t>(D) * Case::kItem;
  std::vector<uint16_t> out(elems), x(elems);
  for (int src = 0; src < c.world; ++src) {
    FillInput(x.data(), elems, src, c.op);
    for (int64_t t = 0; t < S; ++t)
      for (int64_t h = 0; h < Hl; ++h) {
        if (c.op == OpKind::kScatterHeads)
          std::memcpy(&out[((src * S + t) * Hl + h) * D], &x[(t * H + dst * Hl + h) * D], row);
        else
          std::memcpy(&out[(t * H + src * Hl + h) * D], &x[((dst * S + t) * Hl + h) * D], row);
      }
  }
  return out;
}

int RunRankChild(const RankChildArgs& a) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  auto reply = [](const std::string& line) {
    std::string one = line;
    for (char& ch : one)
      if (ch == '\n') ch = ' ';
    std::printf("%s\n", one.c_str());
    std::fflush(stdout);
  };
  auto run = [&]() -> absl::Status {
    Case c;
    c.op = a.op;
    c.world = a.world;
    c.bytes = a.bytes;
    c.heads_per_rank = a.heads_per_rank;
    c.head_dim = a.head_dim;
    void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, a.gate_fd, 0);
    if (page == MAP_FAILED) return ErrnoError("mmap of the gate", errno);
    ULY_RETURN_IF_ERROR(Cuda(cudaHostRegister(page, 4096, cudaHostRegisterMapped), "gate register"));
    void* gate = nullptr;
    ULY_RETURN_IF_ERROR(Cuda(cudaHostGetDevicePointer(&gate, page, 0), "gate mapping"));
    const uint64_t elems = c.bytes / Case::kItem;
    std::vector<uint16_t> host(elems);
    FillInput(host.data(), elems, a.rank, c.op);
    ULY_ASSIGN_OR_RETURN(DeviceMem input, DeviceAlloc(c.bytes));
    ULY_RETURN_IF_ERROR(Cuda(cudaMemcpy(input.get(), host.data(), c.bytes, cudaMemcpyHostToDevice), "input"));
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> cl,
                         client::Client::Connect({a.members[a.rank], StrCat("bench-rank-", a.rank)}));
    ULY_ASSIGN_OR_RETURN(client::Group group,
                         cl->JoinGroup({a.group, a.world, a.rank, a.members, "nvlink", 0}));
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<client::Session> session, cl->CreateSession(group, SpecOf(c)));
    ULY_ASSIGN_OR_RETURN(client::Buffer in, cl->RegisterDeviceBuffer(input.get(), c.bytes, "bench-in"));
    Stream stream;
    EventPair events;
    ULY_RETURN_IF_ERROR(stream.Create());
    ULY_RETURN_IF_ERROR(events.Create());
    session->set_stream(stream.get());
    auto call = [&]() {
      return c.op == OpKind::kScatterHeads ? session->ScatterHeads(in.Ref(), 1, c.seq_local())
                                           : session->GatherHeads(in.Ref(), 1, c.world * c.seq_local());
    };
    reply(StrCat("ok ", session->id()));  // ready for commands
    const auto* start_word = static_cast<const uint64_t*>(page) + 1;
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line == "poison") {
        ULY_RETURN_IF_ERROR(session->PoisonSlots().status());
        reply("ok");
      } else if (line == "check") {
        ULY_ASSIGN_OR_RETURN(client::Result res, call());
        ULY_RETURN_IF_ERROR(session->Synchronize());
        std::vector<uint16_t> got(elems);
        ULY_RETURN_IF_ERROR(Cuda(cudaMemcpy(got.data(), res.data, c.bytes, cudaMemcpyDeviceToHost), "result"));
        ULY_RETURN_IF_ERROR(res.Release());
        const std::vector<uint16_t> want = ExpectedResult(c, a.rank);
        const int64_t e = FirstDifference(reinterpret_cast<const uint8_t*>(got.data()),
                                          reinterpret_cast<const uint8_t*>(want.data()), c.bytes);
        if (e >= 0) return absl::InternalError(StrCat("rank ", a.rank, ": element ", e, " differs from the CPU's"));
        reply("ok");
      } else if (line.rfind("arm ", 0) == 0) {
        const uint64_t k = std::stoull(line.substr(4));
        reply("ok");
        while (__atomic_load_n(start_word, __ATOMIC_ACQUIRE) < k) {
        }
        const auto t0 = std::chrono::steady_clock::now();
        ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events.start(), stream.get()), "event"));
        ULY_ASSIGN_OR_RETURN(client::Result res, call());
        ULY_RETURN_IF_ERROR(res.Release());
        ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events.stop(), stream.get()), "event"));
        ULY_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream.get()), "stream"));
        const double wall = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        ULY_RETURN_IF_ERROR(session->Synchronize());  // a failed call's error, outside the time
        float ms = 0;
        ULY_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, events.start(), events.stop()), "elapsed"));
        reply(StrCat("us ", wall, " ", static_cast<double>(ms) * 1e3));
      } else if (line.rfind("hold ", 0) == 0) {
        const uint64_t g = std::stoull(line.substr(5));
        ULY_RETURN_IF_ERROR(ipc::cuda::StreamWait64(stream.get(), static_cast<const uint64_t*>(gate), g));
        ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events.start(), stream.get()), "event"));
        ULY_ASSIGN_OR_RETURN(client::Result res, call());
        ULY_RETURN_IF_ERROR(res.Release());
        ULY_RETURN_IF_ERROR(Cuda(cudaEventRecord(events.stop(), stream.get()), "event"));
        reply("ok");
      } else if (line == "collect") {
        ULY_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream.get()), "stream"));
        ULY_RETURN_IF_ERROR(session->Synchronize());
        float ms = 0;
        ULY_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, events.start(), events.stop()), "elapsed"));
        reply(StrCat("us ", static_cast<double>(ms) * 1e3));
      } else {
        return absl::InvalidArgumentError(StrCat("unknown command '", line, "'"));
      }
    }
    return absl::OkStatus();
  };
  absl::Status st = run();
  if (!st.ok()) {
    reply(StrCat("error ", st.message()));
    return 1;
  }
  return 0;
}

// This process's side: W children, the gate, and the commands in lockstep.
class RankProcesses {
 public:
  /// How long a rank process may take to answer a command (its CPU check at 1 GiB per rank
  /// takes seconds; a stuck call ends in an error at the daemons' call timeout before this).
  static constexpr absl::Duration kAnswer = absl::Seconds(300);

  ~RankProcesses() { Stop(); }

  absl::Status Start(const Case& c, const Cluster& cluster) {
    gate_fd_ = ::memfd_create("ulysses-bench-gate", 0);  // inherited by the children
    if (gate_fd_ < 0) return ErrnoError("memfd_create", errno);
    if (::ftruncate(gate_fd_, 4096) != 0) return ErrnoError("ftruncate", errno);
    void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, gate_fd_, 0);
    if (page == MAP_FAILED) return ErrnoError("mmap", errno);
    gate_ = static_cast<uint64_t*>(page);
    std::string members;
    for (const std::string& m : cluster.members()) members += (members.empty() ? "" : ",") + m;
    static int groups = 0;
    const std::string group = StrCat("bench-procs-", c.world, "-", c.bytes, "-", ++groups);
    for (int r = 0; r < c.world; ++r) {
      children_.push_back(std::make_unique<LineProcess>());
      ULY_RETURN_IF_ERROR(children_.back()->Start(
          {"/proc/self/exe", "--rank-child", std::to_string(r), "--child-gate-fd",
           std::to_string(gate_fd_), "--child-op", std::string(OpName(c.op)), "--child-world",
           std::to_string(c.world), "--child-bytes", std::to_string(c.bytes), "--heads-per-rank",
           std::to_string(c.heads_per_rank), "--head-dim", std::to_string(c.head_dim),
           "--child-group", group, "--child-members", members}));
    }
    for (int r = 0; r < c.world; ++r) {  // each has its session
      ULY_ASSIGN_OR_RETURN(std::string line, Answer(r));
      if (line.rfind("ok ", 0) != 0) return Unexpected(r, line);
      session_ids_.push_back(std::stoull(line.substr(3)));
    }
    ULY_RETURN_IF_ERROR(Command("poison", "ok"));
    return Command("check", "ok");
  }

  /// Each rank's session id on its daemon.
  const std::vector<uint64_t>& session_ids() const { return session_ids_; }

  /// One isolated call per rank, started at once through the start word: the slowest rank's
  /// wall time of call, release and synchronize (its on-stream time kept for TakeStreamUs).
  absl::StatusOr<double> Work() {
    const uint64_t k = ++start_value_;
    ULY_RETURN_IF_ERROR(Command(StrCat("arm ", k), "ok"));
    __atomic_store_n(gate_ + 1, k, __ATOMIC_RELEASE);
    double wall = 0, on_stream = 0;
    for (int r = 0; r < static_cast<int>(children_.size()); ++r) {
      ULY_ASSIGN_OR_RETURN(std::string line, Answer(r));
      double w = 0, st = 0;
      if (std::sscanf(line.c_str(), "us %lf %lf", &w, &st) != 2) return Unexpected(r, line);
      wall = std::max(wall, w);
      on_stream = std::max(on_stream, st);
    }
    stream_us_.push_back(on_stream);
    return wall;
  }
  /// The on-stream times of the Work calls so far; forgets them.
  std::vector<double> TakeStreamUs() { return std::exchange(stream_us_, {}); }

  /// One sample: every rank's call enqueued behind the gate, the gate opened `ahead_us` later;
  /// the slowest rank's device time.
  absl::StatusOr<double> Sample(int64_t ahead_us) {
    const uint64_t g = ++gate_value_;
    ULY_RETURN_IF_ERROR(Command(StrCat("hold ", g), "ok"));
    SleepUs(ahead_us);
    __atomic_store_n(gate_, g, __ATOMIC_RELEASE);
    ULY_RETURN_IF_ERROR(SendAll("collect"));
    double slowest = 0;
    for (int r = 0; r < static_cast<int>(children_.size()); ++r) {
      ULY_ASSIGN_OR_RETURN(std::string line, Answer(r));
      if (line.rfind("us ", 0) != 0) return Unexpected(r, line);
      slowest = std::max(slowest, std::stod(line.substr(3)));
    }
    return slowest;
  }

  /// Lets any held stream and spinning child go, asks every child to quit (at most 10 s each,
  /// then SIGKILL), and releases the gate. Idempotent.
  void Stop() {
    if (gate_ != nullptr) {
      __atomic_store_n(gate_, ~uint64_t{0} >> 1, __ATOMIC_RELEASE);
      __atomic_store_n(gate_ + 1, ~uint64_t{0} >> 1, __ATOMIC_RELEASE);
    }
    for (auto& child : children_) child->Stop("quit");
    children_.clear();
    if (gate_ != nullptr) ::munmap(gate_, 4096);
    gate_ = nullptr;
    if (gate_fd_ >= 0) ::close(gate_fd_);
    gate_fd_ = -1;
  }

 private:
  static absl::Status Unexpected(int rank, const std::string& line) {
    return absl::InternalError(StrCat("rank process ", rank, " answered '", line, "'"));
  }
  // Rank r's next answer; its "error ..." becomes the error.
  absl::StatusOr<std::string> Answer(int r) {
    absl::StatusOr<std::string> line = children_[r]->ReadLine(kAnswer);
    if (!line.ok())
      return absl::Status(line.status().code(), StrCat("rank process ", r, ": ", line.status().message()));
    if (line->rfind("error ", 0) == 0)
      return absl::InternalError(StrCat("rank process ", r, ": ", line->substr(6)));
    return line;
  }
  absl::Status SendAll(const std::string& cmd) {
    for (auto& child : children_) ULY_RETURN_IF_ERROR(child->Send(cmd));
    return absl::OkStatus();
  }
  absl::Status Command(const std::string& cmd, const std::string& want) {
    ULY_RETURN_IF_ERROR(SendAll(cmd));
    for (int r = 0; r < static_cast<int>(children_.size()); ++r) {
      ULY_ASSIGN_OR_RETURN(std::string line, Answer(r));
      if (line != want) return Unexpected(r, line);
    }
    return absl::OkStatus();
  }

  std::vector<std::unique_ptr<LineProcess>> children_;
  std::vector<uint64_t> session_ids_;
  std::vector<double> stream_us_;
  int gate_fd_ = -1;
  uint64_t* gate_ = nullptr;  // word 0: the gate; word 1: the start word
  uint64_t gate_value_ = 0, start_value_ = 0;
};

// ---------------------------------------------------------------------------------------
// One case: check, warm up, rounds
// ---------------------------------------------------------------------------------------

struct Method {
  int warmup = 3;
  int rounds = 3;
  int samples = 10;  ///< per variant per round, split over its two visits
  uint64_t reference_max_bytes = uint64_t{64} << 20;
};

/// The daemons' own account of the ring's calls (their flight recorders), medians over every
/// rank's stream-ordered calls of the case, in microseconds: planning (queued to started),
/// enqueueing on the stream (started to enqueued) and until the daemon's host found the call
/// finished (enqueued to done).
struct DaemonPhases {
  double plan_us = 0, enqueue_us = 0, finish_us = 0;
  int calls = 0;
};

absl::StatusOr<DaemonPhases> RingPhases(const Cluster& cluster, const std::vector<uint64_t>& sessions) {
  std::vector<double> plan, enqueue, finish;
  for (int r = 0; r < cluster.world(); ++r) {
    auto stub = v1::Admin::NewStub(
        grpc::CreateChannel("unix://" + cluster.members()[r], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListRecentCallsResponse resp;
    if (grpc::Status s = stub->ListRecentCalls(&ctx, {}, &resp); !s.ok())
      return absl::UnavailableError(StrCat("rank ", r, ": ListRecentCalls: ", s.error_message()));
    for (const v1::CallRecord& c : resp.calls()) {
      if (c.session_id() != sessions[r] || c.enqueued_unix_us() == 0 || c.status() != "OK") continue;
      plan.push_back(static_cast<double>(c.started_unix_us() - c.queued_unix_us()));
      enqueue.push_back(static_cast<double>(c.enqueued_unix_us() - c.started_unix_us()));
      finish.push_back(static_cast<double>(c.done_unix_us() - c.enqueued_unix_us()));
    }
  }
  DaemonPhases p;
  p.calls = static_cast<int>(plan.size());
  if (p.calls == 0) return p;
  p.plan_us = Median(plan);
  p.enqueue_us = Median(enqueue);
  p.finish_us = Median(finish);
  return p;
}

struct CaseResult {
  Case c;
  DaemonPhases phases;  ///< the ring's calls, as its daemons saw them (part overhead)
  std::map<Variant, std::vector<double>> us;  // all samples per variant
  std::vector<double> a_first, a_second;      // in-process, first and second visits
  bool reference_checked = false;
  double median(Variant v) const {
    auto it = us.find(v);
    return it == us.end() ? 0 : Median(it->second);
  }
  double aa() const { return a_first.empty() || a_second.empty() ? 0 : Median(a_second) / Median(a_first); }
};

absl::StatusOr<CaseResult> RunCase(const Case& c, Cluster& cluster, int grpc_set, const Method& m) {
  CaseResult res;
  res.c = c;
  // Declared first, destroyed last: the daemons' registrations of its inputs go before them.
  InProcess a(c);
  ULY_RETURN_IF_ERROR(a.Open(c.bytes <= m.reference_max_bytes));
  // The ring path: each rank's client in a process of its own, or a thread of this one.
  RankProcesses procs;
  std::optional<DaemonPath> ring;
  std::optional<DaemonPath> grpc;
  if (c.rank_processes) {
    ULY_RETURN_IF_ERROR(procs.Start(c, cluster));
  } else {
    ring.emplace(c, cluster, 0);
    ULY_RETURN_IF_ERROR(ring->Open(a));
  }
  if (c.overhead && c.grpc) {
    grpc.emplace(c, cluster, grpc_set);
    ULY_RETURN_IF_ERROR(grpc->Open(a));
  }

  ULY_ASSIGN_OR_RETURN(res.reference_checked, a.RunAndCheck());
  if (ring) ULY_RETURN_IF_ERROR(ring->Check(a));
  if (grpc) ULY_RETURN_IF_ERROR(grpc->Check(a));
  Say(StrCat(c.name(), ": check passed (", res.reference_checked ? "in-process equals the CPU reference; " : "",
             c.rank_processes ? "the rank processes' results equal the CPU reference bit for bit"
                              : "daemon results equal the in-process output bit for bit",
             grpc ? (c.rank_processes ? "; the RPC path's equal the in-process output" : "") : "", ")"));

  auto flush = [&]() { return a.Flush(); };
  Gate gate;
  if (c.ahead_us > 0) ULY_RETURN_IF_ERROR(gate.Create());
  auto sample = [&](Variant v, int n) -> absl::StatusOr<std::vector<double>> {
    if (v == Variant::kInProcess || v == Variant::kCopy) return a.Time(v, n);
    if (v == Variant::kInProcessAhead) return a.Time(v, n, &gate, c.ahead_us);
    if (c.rank_processes && (v == Variant::kDaemonRing || v == Variant::kDaemonRingAhead)) {
      std::vector<double> t;
      for (int i = 0; i < n; ++i) {
        ULY_RETURN_IF_ERROR(flush());
        ULY_ASSIGN_OR_RETURN(double us, v == Variant::kDaemonRing ? procs.Work() : procs.Sample(c.ahead_us));
        t.push_back(us);
      }
      return t;
    }
    if (v == Variant::kDaemonRingAhead) {
      for (int i = 0; i < n; ++i) {
        ULY_RETURN_IF_ERROR(flush());
        const uint64_t g = gate.Next();
        ULY_RETURN_IF_ERROR(RunCollective(c.world, [&](int r) { return ring->EnqueueHeld(r, gate, g); }));
        SleepUs(c.ahead_us);
        ULY_RETURN_IF_ERROR(gate.Open(g));
        ULY_RETURN_IF_ERROR(RunCollective(c.world, [&](int r) { return ring->CollectHeld(r); }));
      }
      return ring->TakeStreamUs(n);
    }
    DaemonPath& d = v == Variant::kDaemonRing ? *ring : *grpc;
    ULY_ASSIGN_OR_RETURN(BlockTimes t, RunBlock(c.world, n, [&](int r) { return d.Work(r); }, flush));
    if (v != Variant::kDaemonRing) (void)d.TakeStreamUs(0);  // only the ring's are reported
    return t.work_max_us;
  };
  // Every sample of `v` goes to the results; the ring's also gives its on-stream times.
  auto keep = [&](Variant v, int n) -> absl::StatusOr<std::vector<double>> {
    ULY_ASSIGN_OR_RETURN(std::vector<double> t, sample(v, n));
    Append(&res.us[v], t);
    if (v == Variant::kDaemonRing)
      Append(&res.us[Variant::kDaemonRingStream], ring ? ring->TakeStreamUs(n) : procs.TakeStreamUs());
    return t;
  };
  const std::vector<Variant> order = c.variants();
  if (m.warmup > 0) {
    for (Variant v : order) ULY_RETURN_IF_ERROR(sample(v, m.warmup).status());
    if (!ring) (void)procs.TakeStreamUs();
  }
  const int n1 = (m.samples + 1) / 2, n2 = m.samples / 2;
  for (int round = 0; round < m.rounds; ++round) {
    for (Variant v : order) {
      ULY_ASSIGN_OR_RETURN(std::vector<double> t, keep(v, n1));
      if (v == Variant::kInProcess) Append(&res.a_first, t);
    }
    if (n2 > 0) {
      for (auto it = order.rbegin(); it != order.rend(); ++it) {
        ULY_ASSIGN_OR_RETURN(std::vector<double> t, keep(*it, n2));
        if (*it == Variant::kInProcess) Append(&res.a_second, t);
      }
    }
  }
  if (c.overhead) {
    ULY_ASSIGN_OR_RETURN(res.phases, RingPhases(cluster, ring ? ring->session_ids() : procs.session_ids()));
  }
  std::string line = StrCat(c.name(), ":");
  for (Variant v : order) line += StrCat(" ", VariantName(v), " ", res.median(v), " us");
  Say(StrCat(line, ", A/A ", res.aa()));
  procs.Stop();
  if (grpc) ULY_RETURN_IF_ERROR(grpc->Close());
  if (ring) ULY_RETURN_IF_ERROR(ring->Close());
  return res;
}

// GB/s of W * bytes_per_rank moved in `us` microseconds.
double Gbps(const Case& c, double us) {
  return us > 0 ? RoundTo(static_cast<double>(c.world) * static_cast<double>(c.bytes) / (us * 1e3), 1e3) : 0;
}

// ---------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------

/// "1048576", "64K", "1M", "1G", "16MiB": bytes.
absl::StatusOr<uint64_t> ParseSize(const std::string& flag, const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit = text.substr(i);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (unit.size() == 3 && unit.substr(1) == "IB") unit = unit.substr(0, 1);
  int shift = -1;
  if (unit.empty() || unit == "B") shift = 0;
  if (unit == "K") shift = 10;
  if (unit == "M") shift = 20;
  if (unit == "G") shift = 30;
  if (i == 0 || i > 12 || shift < 0)
    return absl::InvalidArgumentError(
        StrCat(flag, ": '", text, "' is not a size (bytes, or a number with K, M or G: 64K, 1M, 1G)"));
  return std::stoull(text.substr(0, i)) << shift;
}

absl::StatusOr<std::vector<uint64_t>> ParseSizes(const std::string& flag, const std::vector<std::string>& items) {
  std::vector<uint64_t> out;
  for (const std::string& s : items) {
    ULY_ASSIGN_OR_RETURN(uint64_t v, ParseSize(flag, s));
    out.push_back(v);
  }
  return out;
}

// Restricts this process and the daemons it starts to one GPU, before CUDA is initialized.
void SelectOneGpu(int device) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::string pick = std::to_string(device);
  if (visible != nullptr && *visible != '\0') {
    std::vector<std::string> ids;
    std::string cur;
    for (const char* p = visible;; ++p) {
      if (*p == ',' || *p == '\0') {
        ids.push_back(cur);
        cur.clear();
        if (*p == '\0') break;
      } else {
        cur += *p;
      }
    }
    pick = device < static_cast<int>(ids.size()) ? ids[device] : "-1";
  }
  ::setenv("CUDA_VISIBLE_DEVICES", pick.c_str(), 1);
}

int Fail(const absl::Status& s) {
  std::cerr << "[" << kTool << "] FAILED: " << s << std::endl;
  return 1;
}

// What CUDA_DEVICE_MAX_CONNECTIONS the daemons run with: the environment's, as this process got
// it (CUDA's default, 8, when unset).
std::string g_daemon_connections;

// This process drives W ranks, one stream each, and a stream waiting for its call blocks the
// hardware queue it maps to. A process's streams share CUDA_DEVICE_MAX_CONNECTIONS queues (8 by
// default) round-robin: W + 1 streams over 8 queues put two ranks on one queue, where one
// rank's wait holds back the other's ready word, and the call deadlocks until its timeout. So
// this process takes 16 queues (unless the variable is set); the daemons keep the environment's
// setting (under MPS, many queues in every process exhaust the server). Before any CUDA call.
void OwnHardwareQueuePerRank() {
  const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  g_daemon_connections = set != nullptr ? set : "8";
  if (set == nullptr) ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16", 0);
}

int Main(int argc, char** argv) {
  CLI::App app{"ulysses-gpu-bench: head exchanges through the GPU daemons vs in-process kernels "
               "vs a device copy, W ranks on one GPU"};
  std::vector<int> worlds = {1, 2, 4}, overhead_worlds = {1, 2};
  std::vector<std::string> size_items = {"1M", "4M", "16M", "64M", "256M", "1G"};
  std::vector<std::string> overhead_items = {"64K", "256K", "1M", "4M", "16M", "64M", "256M", "1G"};
  std::vector<std::string> ops = {"scatter_heads", "gather_heads"}, parts = {"exchange", "overhead"};
  int heads_per_rank = 8, head_dim = 128, device = 0;
  std::string json_file, ulyssesd, mps_flag = "auto", commit = ULYSSES_GIT_COMMIT;
  std::string reference_max = "64M";
  bool quick = false;
  Method m;
  app.add_option("--world", worlds, "World sizes W of part exchange")->delimiter(',')->check(CLI::Range(1, kMaxWorldSize));
  app.add_option("--sizes", size_items, "Bytes per rank of part exchange (64K, 1M, 1G, ...)")->delimiter(',');
  app.add_option("--overhead-world", overhead_worlds, "World sizes W of part overhead")
      ->delimiter(',')
      ->check(CLI::Range(1, kMaxWorldSize));
  app.add_option("--overhead-sizes", overhead_items, "Bytes per rank of part overhead")->delimiter(',');
  app.add_option("--ops", ops, "Ops of part exchange: scatter_heads and/or gather_heads")->delimiter(',');
  app.add_option("--parts", parts, "exchange and/or overhead")->delimiter(',');
  app.add_option("--heads-per-rank", heads_per_rank, "H/W (H = this times W); bf16")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim, "D")->check(CLI::PositiveNumber);
  int64_t ring_spin_us = -1, ahead_us = 300;
  app.add_option("--ahead-us", ahead_us,
                 "Part overhead: how far the host runs ahead of a held stream in the *_ahead variants "
                 "(0: not run)")
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}));
  app.add_option("--ring-spin-us", ring_spin_us,
                 "The daemons' rings.worker_spin_us (default: the daemon's own, 50)")
      ->check(CLI::Range(int64_t{-1}, ulysses::kMaxRingSpinUs));
  int daemon_queues = 0, queue_probe_streams = -1;
  bool no_grpc = false;
  app.add_option("--queue-probe-streams", queue_probe_streams,
                 "The daemons' queues.probe_streams (0: no probe, the streams made as sessions "
                 "come; default: the daemon's own, 16)")
      ->check(CLI::Range(0, ulysses::kMaxQueueProbeStreams));
  app.add_flag("--no-grpc", no_grpc,
               "Part overhead: leave out the gRPC path, so each daemon serves the ring path's "
               "session alone");
  app.add_option("--daemon-queues", daemon_queues,
                 "CUDA_DEVICE_MAX_CONNECTIONS of the daemons only (default: this environment's, "
                 "else CUDA's 8); docs/benchmarks.md measures 1 to 16")
      ->check(CLI::Range(1, 32));
  app.add_option("--warmup", m.warmup, "Untimed samples per variant before the rounds")->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", m.rounds, "Rounds (variants forward, then reversed)")->check(CLI::PositiveNumber);
  app.add_option("--samples", m.samples, "Samples per variant per round (split over its two visits)")
      ->check(CLI::Range(2, 100000));
  app.add_option("--reference-max", reference_max, "Largest bytes per rank checked against the CPU reference");
  app.add_option("--device", device, "The GPU (index among those visible) every rank shares")->check(CLI::NonNegativeNumber);
  app.add_option("--mps", mps_flag, "auto (what the daemon reports), yes or no")
      ->check(CLI::IsMember({"auto", "yes", "no"}));
  app.add_option("--json", json_file, "Also write the JSON to this file");
  app.add_option("--ulyssesd", ulyssesd, "Path of ulyssesd (default: from this build)");
  app.add_option("--commit", commit, "Commit recorded in the JSON");
  app.add_flag("--quick", quick, "A small grid (W 1,2; 1M,16M; overhead 64K,1M,16M; 2 rounds x 6 samples)");
  std::string ranks_as = "processes";
  app.add_option("--ranks", ranks_as,
                 "The ring path's clients: processes (one per rank, as frameworks run) or threads "
                 "(all in this process: the hazard of docs/architecture.md section 8)")
      ->check(CLI::IsMember({"processes", "threads"}));
  RankChildArgs child;
  std::string child_members, child_op = "scatter_heads";
  app.add_option("--rank-child", child.rank, "(internal) run as rank R's client process")->group("");
  app.add_option("--child-gate-fd", child.gate_fd, "(internal)")->group("");
  app.add_option("--child-world", child.world, "(internal)")->group("");
  app.add_option("--child-bytes", child.bytes, "(internal)")->group("");
  app.add_option("--child-group", child.group, "(internal)")->group("");
  app.add_option("--child-members", child_members, "(internal)")->group("");
  app.add_option("--child-op", child_op, "(internal)")->group("");
  CLI11_PARSE(app, argc, argv);
  if (child.rank >= 0) {
    child.op = child_op == "gather_heads" ? OpKind::kGatherHeads : OpKind::kScatterHeads;
    child.heads_per_rank = heads_per_rank;
    child.head_dim = head_dim;
    child.members = absl::StrSplit(child_members, ',');
    if (child.rank >= static_cast<int>(child.members.size()) || child.gate_fd < 0)
      return Fail(absl::InvalidArgumentError("--rank-child: needs --child-members with that rank and --child-gate-fd"));
    return RunRankChild(child);
  }
  if (quick) {
    worlds = {1, 2};
    overhead_worlds = {1, 2};
    size_items = {"1M", "16M"};
    overhead_items = {"64K", "1M", "16M"};
    m.warmup = 2;
    m.rounds = 2;
    m.samples = 6;
  }

  if (daemon_queues > 0) g_daemon_connections = std::to_string(daemon_queues);

  std::set<std::string> part_set;
  for (const std::string& p : parts) {
    if (p != "exchange" && p != "overhead")
      return Fail(absl::InvalidArgumentError(StrCat("--parts: unknown part '", p, "' (exchange | overhead)")));
    part_set.insert(p);
  }
  std::vector<OpKind> op_kinds;
  for (const std::string& s : ops) {
    if (s == "scatter_heads") op_kinds.push_back(OpKind::kScatterHeads);
    else if (s == "gather_heads") op_kinds.push_back(OpKind::kGatherHeads);
    else return Fail(absl::InvalidArgumentError(StrCat("--ops: unknown op '", s, "' (scatter_heads | gather_heads)")));
  }
  absl::StatusOr<std::vector<uint64_t>> sizes = ParseSizes("--sizes", size_items);
  if (!sizes.ok()) return Fail(sizes.status());
  absl::StatusOr<std::vector<uint64_t>> overhead_sizes = ParseSizes("--overhead-sizes", overhead_items);
  if (!overhead_sizes.ok()) return Fail(overhead_sizes.status());
  absl::StatusOr<uint64_t> ref_max = ParseSize("--reference-max", reference_max);
  if (!ref_max.ok()) return Fail(ref_max.status());
  m.reference_max_bytes = *ref_max;

  // The grid: (op, W, bytes) -> which parts it is a row of.
  std::map<std::tuple<int32_t, int, uint64_t>, Case> grid;  // (W, op, bytes)
  auto add = [&](const std::string& flag, OpKind op, int32_t w, uint64_t bytes, bool exchange) -> absl::Status {
    ULY_RETURN_IF_ERROR(CheckSize(flag, bytes, w, heads_per_rank, head_dim));
    Case& c = grid[{w, static_cast<int>(op), bytes}];
    c.op = op;
    c.world = w;
    c.bytes = bytes;
    c.heads_per_rank = heads_per_rank;
    c.head_dim = head_dim;
    (exchange ? c.exchange : c.overhead) = true;
    if (!exchange) c.ahead_us = ahead_us;
    c.rank_processes = ranks_as == "processes";
    c.grpc = !no_grpc;
    return absl::OkStatus();
  };
  absl::Status grid_status;
  if (part_set.count("exchange"))
    for (OpKind op : op_kinds)
      for (int w : worlds)
        for (uint64_t b : *sizes) grid_status.Update(add("--sizes", op, w, b, true));
  if (part_set.count("overhead"))
    for (int w : overhead_worlds)
      for (uint64_t b : *overhead_sizes) grid_status.Update(add("--overhead-sizes", OpKind::kScatterHeads, w, b, false));
  if (!grid_status.ok()) return Fail(grid_status);

  SelectOneGpu(device);
  absl::StatusOr<int> gpus = kernels::CudaDeviceCount();
  if (!gpus.ok()) return Fail(gpus.status());
  if (*gpus == 0 && device > 0)
    return Fail(absl::InvalidArgumentError(StrCat("--device ", device, ": no such GPU")));
  if (*gpus == 0) {
    std::cout << "no CUDA device; nothing to measure" << std::endl;
    return 0;
  }
  if (ulyssesd.empty()) ulyssesd = demo::SiblingProgram("ulyssesd");
  cudaDeviceProp prop{};
  if (absl::Status s = Cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties"); !s.ok()) return Fail(s);

  absl::StatusOr<std::string> run_dir = demo::MakeRunDir();
  if (!run_dir.ok()) return Fail(run_dir.status());
  std::vector<CaseResult> results;
  std::set<int> world_list;
  std::string mps_mode;
  absl::Status status;
  for (auto it = grid.begin(); it != grid.end() && status.ok();) {
    const int W = std::get<0>(it->first);
    world_list.insert(W);
    std::vector<Case> cases;
    for (; it != grid.end() && std::get<0>(it->first) == W; ++it) cases.push_back(it->second);
    // Slot memory for the largest case: a session per client set, kSlots slots of 3*S_l*H*D.
    uint64_t budget = uint64_t{1} << 30;
    bool need_grpc = false;
    for (const Case& c : cases) {
      need_grpc = need_grpc || (c.overhead && c.grpc);
      budget = std::max(budget, (c.overhead && c.grpc ? 2 : 1) * kSlots * 3 * c.bytes + (uint64_t{1} << 30));
    }
    const std::string dir = StrCat(*run_dir, "/w", W), config = StrCat(dir, "/daemon.json");
    if (::mkdir(dir.c_str(), 0700) != 0) {
      status = ErrnoError(StrCat("mkdir ", dir), errno);
      break;
    }
    Json cfg;
    cfg["slots"]["memory_budget_bytes"] = budget;
    if (ring_spin_us >= 0) cfg["rings"]["worker_spin_us"] = ring_spin_us;
    if (queue_probe_streams >= 0) cfg["queues"]["probe_streams"] = queue_probe_streams;
    status = WriteTextFile(config, cfg.dump());
    if (!status.ok()) break;
    Say(StrCat("W=", W, ": starting ", W, " ulyssesd (nvlink backend) on ", prop.name));
    Cluster cluster;
    // The daemons get the environment's queue count back.
    status = cluster.Start(ulyssesd, dir, W, "nvlink", {"--config", config},
                           {StrCat("CUDA_DEVICE_MAX_CONNECTIONS=", g_daemon_connections)});
    int grpc_set = -1;
    if (status.ok() && need_grpc) {
      absl::StatusOr<int> set = cluster.AddClients(false);
      if (set.ok()) grpc_set = *set;
      status = set.status();
    }
    if (status.ok() && mps_mode.empty()) {
      // The daemon's report at attach (as Admin GetState's mps_mode); the pipe if it has none.
      mps_mode = cluster.client(0).daemon_mps_mode();
      if (mps_mode.empty()) {
        Say("the daemon reports no MPS mode; MPS from the pipe directory");
        mps_mode = MpsPipePresent() ? "mps" : "no-mps";
      }
    }
    for (const Case& c : cases) {
      if (!status.ok()) break;
      absl::StatusOr<CaseResult> r = RunCase(c, cluster, grpc_set, m);
      if (!r.ok()) {
        status = absl::Status(r.status().code(), StrCat(c.name(), ": ", r.status().message()));
        break;
      }
      results.push_back(std::move(*r));
    }
    status.Update(cluster.Stop());
  }
  if (!status.ok()) {
    // The daemons' logs say why a call failed: kept, and their warnings shown.
    Say(StrCat("daemon logs kept in ", *run_dir, " (w<W>/gpu<rank>.log); their warnings:"));
    bool ready_never_written = false;
    for (int w : world_list)
      for (int r = 0; r < w; ++r) {
        std::ifstream log(StrCat(*run_dir, "/w", w, "/gpu", r, ".log"));
        // The level letter follows the time: "... W [exec] ...", "... E [...] ...".
        for (std::string line; std::getline(log, line);)
          if (line.find(" W [") != std::string::npos || line.find(" E [") != std::string::npos) {
            std::cerr << "  w" << w << "/gpu" << r << ": " << line << "\n";
            if (ReportsReadyNotWritten(line)) ready_never_written = true;
          }
      }
    if (ready_never_written && ranks_as == "threads")
      Say("a client's ready word was never written: --ranks threads drives every rank from one "
          "process, and one rank's wait for its result can hold another rank's ready write "
          "on a hardware queue their streams share (docs/architecture.md section 8; "
          "docs/benchmarks.md, 2026-12-03 evening); --ranks processes does not");
    // The cases that finished are still reported (tables and JSON), with the failure.
  } else {
    demo::RemoveRunDir(*run_dir);
  }

  bool mps = mps_mode == "mps";
  if (mps_flag != "auto") {
    const bool flag = mps_flag == "yes";
    if (flag != mps)
      Say(StrCat("--mps ", mps_flag, " overrides the daemon's report '", mps_mode, "'"));
    mps = flag;
  }

  Json rows = Json::array();
  std::printf("GPU %s, %s, bf16, D=%d, H=%d*W; mps %s\n", prop.name,
              "W ranks on one GPU", head_dim, heads_per_rank, mps ? "on" : "off");
  if (part_set.count("exchange")) {
    std::printf("\nexchange throughput, GB/s = W * bytes_per_rank / time\n");
    std::printf("%-13s %3s %12s %12s %12s %12s %8s %7s\n", "op", "W", "bytes/rank", "daemon", "inprocess",
                "copy", "dmn/inp", "A/A");
    for (const CaseResult& r : results) {
      if (!r.c.exchange) continue;
      const double d = Gbps(r.c, r.median(Variant::kDaemonRing)), a = Gbps(r.c, r.median(Variant::kInProcess));
      const double cp = Gbps(r.c, r.median(Variant::kCopy));
      std::printf("%-13s %3d %12llu %12.1f %12.1f %12.1f %8.3f %7.3f\n", std::string(OpName(r.c.op)).c_str(),
                  r.c.world, static_cast<unsigned long long>(r.c.bytes), d, a, cp, a > 0 ? d / a : 0, r.aa());
      Json j;
      j["part"] = "exchange";
      j["op"] = std::string(OpName(r.c.op));
      j["world_size"] = r.c.world;
      j["bytes_per_rank"] = r.c.bytes;
      j["daemon_gbps"] = d;
      j["inprocess_gbps"] = a;
      j["copy_gbps"] = cp;
      j["daemon_us"] = Us(r.median(Variant::kDaemonRing));
      j["inprocess_us"] = Us(r.median(Variant::kInProcess));
      j["copy_us"] = Us(r.median(Variant::kCopy));
      j["a_a_control"] = Ratio(r.aa());
      j["check"] = "pass";
      j["reference_checked"] = r.reference_checked;
      rows.push_back(j);
    }
  }
  if (part_set.count("overhead")) {
    std::printf("\ndaemon overhead, scatter_heads, per-call time (us)\n");
    std::printf("%3s %12s %12s %12s %12s %12s %9s %9s %9s %9s %9s %9s %9s %9s %7s\n", "W", "bytes/rank",
                "inprocess", "ring", "ring-stream", "grpc", "ring-inp", "grpc-inp", "inp-ahead", "ring-ahead",
                "ahead-add", "dmn-plan", "dmn-enq", "dmn-fin", "A/A");
    for (const CaseResult& r : results) {
      if (!r.c.overhead) continue;
      const double a = r.median(Variant::kInProcess), ring = r.median(Variant::kDaemonRing);
      const double grpc = r.median(Variant::kDaemonGrpc);
      const double ring_stream = r.median(Variant::kDaemonRingStream);
      const double a_ahead = r.median(Variant::kInProcessAhead), ring_ahead = r.median(Variant::kDaemonRingAhead);
      std::printf("%3d %12llu %12.1f %12.1f %12.1f %12.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7.3f\n",
                  r.c.world, static_cast<unsigned long long>(r.c.bytes), a, ring, ring_stream, grpc, ring - a,
                  grpc - a, a_ahead, ring_ahead, ring_ahead - a_ahead, r.phases.plan_us, r.phases.enqueue_us,
                  r.phases.finish_us, r.aa());
      Json j;
      j["part"] = "overhead";
      j["op"] = "scatter_heads";
      j["world_size"] = r.c.world;
      j["bytes_per_rank"] = r.c.bytes;
      j["mps"] = mps;
      j["inprocess_us"] = Us(a);
      j["daemon_ring_us"] = Us(ring);
      j["daemon_ring_stream_us"] = Us(ring_stream);
      j["daemon_plan_us"] = Us(r.phases.plan_us);
      j["daemon_enqueue_us"] = Us(r.phases.enqueue_us);
      j["daemon_finish_us"] = Us(r.phases.finish_us);
      j["daemon_phase_calls"] = r.phases.calls;
      j["daemon_grpc_us"] = r.c.grpc ? Json(Us(grpc)) : Json(nullptr);
      if (r.c.ahead_us > 0) {
        j["ahead_us"] = r.c.ahead_us;
        j["inprocess_ahead_us"] = Us(a_ahead);
        j["daemon_ring_ahead_us"] = Us(ring_ahead);
      }
      j["a_a_control"] = Ratio(r.aa());
      j["check"] = "pass";
      j["reference_checked"] = r.reference_checked;
      rows.push_back(j);
    }
  }
  Json out;
  out["bench"] = "gpu_exchange";
  out["gpu"] = prop.name;
  out["commit"] = commit;
  out["date"] = UtcNowIso();
  out["world_size"] = Json(std::vector<int>(world_list.begin(), world_list.end()));
  out["mps"] = mps;
  out["mps_mode"] = mps_mode;
  out["ranks"] = ranks_as;  // the ring path's clients: a process per rank, or threads here
  out["ring_spin_us"] = ring_spin_us >= 0 ? ring_spin_us : ulysses::DaemonConfig{}.ring_spin_us;
  // The daemons' CUDA_DEVICE_MAX_CONNECTIONS, as they got it.
  if (int queues = 0; absl::SimpleAtoi(g_daemon_connections, &queues))
    out["daemon_queues"] = queues;
  else
    out["daemon_queues"] = g_daemon_connections;
  out["queue_probe_streams"] = queue_probe_streams >= 0 ? queue_probe_streams
                                                        : ulysses::DaemonConfig{}.queue_probe_streams;
  out["grpc_path"] = !no_grpc;  // false: each daemon served the ring path's session alone
  out["dtype"] = "bf16";
  out["heads_per_rank"] = heads_per_rank;
  out["head_dim"] = head_dim;
  out["method"] = StrCat("L2 flushed (256 MiB memset) before each sample; ", m.warmup, " warm-up, ", m.rounds,
                         " rounds (variants forward then reversed) x ", m.samples,
                         " samples per variant; median; A/A = in-process second visits / first",
                         ahead_us > 0 ? StrCat("; *_ahead: the stream held at a gate while the host enqueues, "
                                               "opened ", ahead_us, " us later, timed by events after the gate")
                                      : std::string());
  out["rows"] = rows;
  if (!status.ok()) out["failed"] = std::string(status.message());
  const std::string text = out.dump();
  if (!json_file.empty())
    if (absl::Status s = WriteTextFile(json_file, out.dump(2)); !s.ok()) return Fail(s);
  std::cout << text << std::endl;
  if (!status.ok()) return Fail(status);
  return 0;
}

}  // namespace
}  // namespace ulysses::bench

int main(int argc, char** argv) {
  ulysses::bench::OwnHardwareQueuePerRank();
  return ulysses::bench::Main(argc, argv);
}
