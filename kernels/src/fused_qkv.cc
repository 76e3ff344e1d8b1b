// FusedQkvPlan: the per-operator and the chunked path of the fused QKV op on one source rank.
#include "ulysses/kernels/fused_qkv.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda_check.h"
#include "device_memory.h"
#include "fused_epilogue.h"
#include "ulysses/common/status.h"
#include "ulysses/kernels/gemm.h"

namespace ulysses::kernels {
namespace {

using internal::DeviceMemory;

// Owners of CUDA runtime objects; each frees on destruction and is neither copied nor moved.
class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (stream_ != nullptr && owned_) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  // Non-blocking, at the device's greatest priority: the store kernel's blocks get SMs as the
  // GEMM's blocks retire, instead of queueing behind the next GEMM.
  absl::Status Create() {
    int least = 0, greatest = 0;
    ULY_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    ULY_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    return absl::OkStatus();
  }
  /// Uses `stream`, owned elsewhere, instead.
  void Borrow(cudaStream_t stream) {
    stream_ = stream;
    owned_ = false;
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  bool owned_ = true;
};

class Event {
 public:
  Event() = default;
  ~Event() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  absl::Status Create() {
    ULY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    return absl::OkStatus();
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The cuBLASLt GEMM's workspace: none where the plan projects on the CUTLASS GEMM (it then has
// no cuBLASLt GEMM at all).
size_t GemmWorkspaceBytes(const FusedQkvConfig& config) {
  return config.cutlass_projection ? 0 : Bf16Gemm::kDefaultWorkspaceBytes;
}

}  // namespace

struct FusedQkvPlan::Impl {
  FusedQkvConfig config;
  // First, so that it goes last: the buffers below are allocated and freed in its order.
  Stream side;
  std::unique_ptr<Bf16Gemm> gemm;  // null with cutlass_projection
  // The epilogue path's GEMMs, one per EpilogueSchedule (index: the schedule - 1); those the
  // config can use are made, all null when epilogue_unavailable says why.
  std::unique_ptr<internal::EpilogueGemm> epilogue[kEpilogueSchedules];
  std::string epilogue_unavailable;
  DeviceMemory chunk_counters;  // [kMaxFusedChunks] of the epilogue path
  DeviceMemory projection;  // [max_tokens, 3*H*D] bf16
  DeviceMemory counters;    // [2] block counters: 0 main stream, 1 second stream
  Event start, done;
  Event chunk_done[kMaxFusedChunks];

  int64_t hidden() const { return int64_t{config.heads} * config.head_dim; }
  int64_t features() const { return 3 * hidden(); }
  unsigned int* counter(int i) const { return static_cast<unsigned int*>(counters.get()) + i; }
  uint16_t* qkv() const { return static_cast<uint16_t*>(projection.get()); }

  int64_t ChunkRows(int64_t rows) const { return FusedChunkRows(rows, config.chunk_rows); }

  absl::Status EpilogueAvailable() const {
    if (epilogue_unavailable.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("no epilogue path: ", epilogue_unavailable));
  }

  // The epilogue GEMM a call of `rows` rows runs on (null: none).
  internal::EpilogueGemm* EpilogueFor(int64_t rows) const {
    if (!epilogue_unavailable.empty()) return nullptr;
    const EpilogueSchedule s = config.epilogue_schedule == EpilogueSchedule::kAuto
                                   ? EpilogueScheduleFor(rows)
                                   : config.epilogue_schedule;
    return epilogue[static_cast<int>(s) - 1].get();
  }

  absl::StatusOr<QkvNormRopeShape> CallShape(const void* x, const int32_t* positions, int64_t batch,
                                             int64_t seq_local) const {
    if (batch <= 0 || seq_local <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat("batch and seq_local must be positive, got ", batch, ", ", seq_local));
    if (batch * seq_local > config.max_tokens)
      return absl::ResourceExhaustedError(
          absl::StrCat("capacity: batch*seq_local = ", batch * seq_local, " exceeds max_tokens ",
                       config.max_tokens));
    if (x == nullptr || !Aligned16(x))
      return absl::InvalidArgumentError("x is null or not 16-byte aligned");
    if (positions == nullptr) return absl::InvalidArgumentError("positions is null");
    return QkvNormRopeShape{config.world,   config.heads, config.head_dim,
                            config.max_pos, batch,        seq_local};
  }

  // out[rows, 3*H*D] = x[rows, hidden] @ w_qkv^T, on cuBLASLt or (cutlass_projection) on the
  // epilogue GEMM storing the raw projection only.
  absl::Status Project(const void* x, int64_t rows, void* out, cudaStream_t stream) {
    if (!config.cutlass_projection) return gemm->Run(x, config.weights.w_qkv, out, rows, stream);
    internal::EpilogueCall call;
    call.shape = QkvNormRopeShape{config.world, config.heads, config.head_dim, config.max_pos, 1,
                                  rows};
    call.x = x;
    call.weights = config.weights;
    call.projection = out;
    call.projection_only = true;
    return EpilogueFor(rows)->Run(call, stream);
  }

  // The projection of a checked call into qkv(), then norm + RoPE in place.
  absl::Status ProjectAndNormRope(const QkvNormRopeShape& shape, const void* x,
                                  const int32_t* positions, cudaStream_t stream) {
    const int64_t rows = QkvRows(shape);
    ULY_RETURN_IF_ERROR(Project(x, rows, qkv(), stream));
    return LaunchNormRope(shape, config.weights, positions, 0, rows, qkv(), stream);
  }
};

FusedQkvPlan::FusedQkvPlan(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FusedQkvPlan::~FusedQkvPlan() = default;

absl::StatusOr<std::unique_ptr<FusedQkvPlan>> FusedQkvPlan::Create(const FusedQkvConfig& config) {
  FusedGeometry g;
  g.world_size = config.world;
  g.rank = config.rank;
  g.hidden = config.heads * config.head_dim;
  g.num_heads = config.heads;
  g.head_dim = config.head_dim;
  g.layout = config.layout;
  g.max_tokens = config.max_tokens;
  g.max_pos = config.max_pos;
  ULY_RETURN_IF_ERROR(ValidateFusedGeometry(g, FusedImpl::kCuda));
  const QkvWeights& w = config.weights;
  for (auto [name, ptr] : {std::pair<const char*, const void*>{"weights.w_qkv", w.w_qkv},
                           {"weights.q_norm", w.q_norm},
                           {"weights.k_norm", w.k_norm},
                           {"weights.cos_sin", w.cos_sin}}) {
    if (ptr == nullptr || !Aligned16(ptr))
      return absl::InvalidArgumentError(absl::StrCat(name, " is null or not 16-byte aligned"));
  }
  if (config.chunk_rows < 0 || config.push_blocks < 0)
    return absl::InvalidArgumentError("chunk_rows and push_blocks must be >= 0");
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  // The plan's memory is allocated and freed in one stream's order (its second stream, or the
  // setup stream given), and its counters are zeroed there, that stream alone then waited
  // for: a device-wide wait (cudaFree's, or a device synchronization) would wait for every
  // other stream of the process too (a daemon's other sessions, whose calls may be waiting
  // for their peers).
  if (config.second_stream != nullptr)
    impl->side.Borrow(static_cast<cudaStream_t>(config.second_stream));
  else
    ULY_RETURN_IF_ERROR(impl->side.Create());
  const cudaStream_t setup = config.setup_stream != nullptr
                                 ? static_cast<cudaStream_t>(config.setup_stream)
                                 : impl->side.get();
  for (int i = 0; i < kEpilogueSchedules; ++i) {
    const auto schedule = static_cast<EpilogueSchedule>(i + 1);
    // kAuto makes every schedule: EpilogueScheduleFor picks from all of them.
    const bool used = config.epilogue_schedule == EpilogueSchedule::kAuto ||
                      config.epilogue_schedule == schedule;
    if (!used) continue;
    absl::StatusOr<std::unique_ptr<internal::EpilogueGemm>> epilogue =
        internal::EpilogueGemm::Create(impl->features(), impl->hidden(), schedule);
    if (!epilogue.ok()) {  // the other paths still serve
      for (std::unique_ptr<internal::EpilogueGemm>& made : impl->epilogue) made.reset();
      impl->epilogue_unavailable = std::string(epilogue.status().message());
      break;
    }
    impl->epilogue[i] = std::move(*epilogue);
  }
  if (config.cutlass_projection && !impl->epilogue_unavailable.empty())
    return absl::FailedPreconditionError(
        absl::StrCat("cutlass_projection: the epilogue GEMM is unavailable: ",
                     impl->epilogue_unavailable));
  // A CUTLASS-projecting plan makes no cuBLASLt GEMM: not even a handle (the process's first
  // one waits for every stream of the device).
  if (!config.cutlass_projection) {
    ULY_ASSIGN_OR_RETURN(impl->gemm, Bf16Gemm::Create(impl->features(), impl->hidden(),
                                                      GemmWorkspaceBytes(config), setup));
  }
  ULY_RETURN_IF_ERROR(impl->projection.Allocate(
      static_cast<size_t>(config.max_tokens * impl->features()) * sizeof(uint16_t),
      setup));
  ULY_RETURN_IF_ERROR(impl->counters.Allocate(2 * sizeof(unsigned int), setup));
  ULY_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(impl->counters.get(), 0, 2 * sizeof(unsigned int), setup));
  if (impl->epilogue_unavailable.empty()) {
    ULY_RETURN_IF_ERROR(
        impl->chunk_counters.Allocate(kMaxFusedChunks * sizeof(unsigned int), setup));
    ULY_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(impl->chunk_counters.get(), 0,
                                             kMaxFusedChunks * sizeof(unsigned int),
                                             setup));
  }
  ULY_RETURN_IF_ERROR(impl->start.Create());
  ULY_RETURN_IF_ERROR(impl->done.Create());
  for (Event& e : impl->chunk_done) ULY_RETURN_IF_ERROR(e.Create());
  // The counters' memsets must be complete before any launch on another stream reads them.
  ULY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(setup));
  return std::unique_ptr<FusedQkvPlan>(new FusedQkvPlan(std::move(impl)));
}

size_t FusedQkvPlan::DeviceBytesFor(const FusedQkvConfig& config) {
  const size_t features = size_t{3} * static_cast<size_t>(config.heads) *
                          static_cast<size_t>(config.head_dim);
  return GemmWorkspaceBytes(config) +
         static_cast<size_t>(std::max<int64_t>(config.max_tokens, 0)) * features * sizeof(uint16_t) +
         2 * sizeof(unsigned int) + kMaxFusedChunks * sizeof(unsigned int);
}

size_t FusedQkvPlan::device_bytes() const {
  return (impl_->gemm ? impl_->gemm->device_bytes() : 0) + impl_->projection.bytes() +
         impl_->counters.bytes() + impl_->chunk_counters.bytes();
}

absl::Status FusedQkvPlan::Prepare(int64_t rows) {
  if (rows <= 0 || rows > impl_->config.max_tokens)
    return absl::InvalidArgumentError(
        absl::StrCat("rows ", rows, " is not in [1, max_tokens=", impl_->config.max_tokens, "]"));
  if (impl_->config.cutlass_projection) return absl::OkStatus();  // nothing to choose
  ULY_RETURN_IF_ERROR(impl_->gemm->Prepare(rows));
  const int64_t chunk = impl_->ChunkRows(rows);
  ULY_RETURN_IF_ERROR(impl_->gemm->Prepare(chunk));
  if (rows % chunk != 0) ULY_RETURN_IF_ERROR(impl_->gemm->Prepare(rows % chunk));
  return absl::OkStatus();
}

absl::Status FusedQkvPlan::LoadKernels(int64_t rows, FusedPath path, cudaStream_t stream) {
  ULY_RETURN_IF_ERROR(Prepare(rows));
  if (impl_->config.cutlass_projection) return absl::OkStatus();  // no cuBLASLt kernel runs
  const std::vector<int64_t> counts = FusedGemmLoadRowCounts(rows, impl_->config.chunk_rows, path);
  if (counts.empty()) return absl::OkStatus();
  // The projection buffer holds max_tokens rows of 3*H*D: the output's rows * 3*H*D, and the
  // input's rows * hidden after an offset of up to 128 bytes; the values are neither read nor
  // kept.
  ULY_RETURN_IF_ERROR(impl_->gemm->Load(
      counts, impl_->config.weights.w_qkv, impl_->qkv(), impl_->projection.bytes(), stream,
      FusedGemmEveryRowLoadRows(rows, path)));
  // Prepare again: the row counts prepared before the load are pinned to loaded algorithms.
  return Prepare(rows);
}

size_t FusedQkvPlan::loaded_gemm_kernels() const {
  return impl_->gemm ? impl_->gemm->loaded_algorithms() : 0;
}
size_t FusedQkvPlan::unloaded_gemm_launches() const {
  return impl_->gemm ? impl_->gemm->unloaded_launches() : 0;
}
size_t FusedQkvPlan::cublaslt_runs() const { return impl_->gemm ? impl_->gemm->runs() : 0; }

absl::Status FusedQkvPlan::RunProjection(const void* x, int64_t rows, cudaStream_t stream) {
  if (rows <= 0 || rows > impl_->config.max_tokens)
    return absl::InvalidArgumentError(
        absl::StrCat("rows ", rows, " is not in [1, max_tokens=", impl_->config.max_tokens, "]"));
  return impl_->Project(x, rows, impl_->qkv(), stream);
}

absl::Status FusedQkvPlan::RunNormRope(const void* x, const int32_t* positions, int64_t batch,
                                       int64_t seq_local, cudaStream_t stream) {
  ULY_ASSIGN_OR_RETURN(const QkvNormRopeShape shape,
                       impl_->CallShape(x, positions, batch, seq_local));
  return impl_->ProjectAndNormRope(shape, x, positions, stream);
}

absl::Status FusedQkvPlan::RunPerOperator(const void* x, const int32_t* positions, int64_t batch,
                                          int64_t seq_local, const QkvDestinations& dests,
                                          cudaStream_t stream) {
  ULY_ASSIGN_OR_RETURN(const QkvNormRopeShape shape,
                       impl_->CallShape(x, positions, batch, seq_local));
  const FusedQkvConfig& c = impl_->config;
  ULY_RETURN_IF_ERROR(impl_->ProjectAndNormRope(shape, x, positions, stream));
  return LaunchQkvScatter(shape, c.layout, impl_->qkv(), c.rank, 0, QkvRows(shape), dests,
                          impl_->counter(0), stream);
}

absl::Status FusedQkvPlan::RunChunked(const void* x, const int32_t* positions, int64_t batch,
                                      int64_t seq_local, const QkvDestinations& dests,
                                      cudaStream_t stream) {
  ULY_ASSIGN_OR_RETURN(const QkvNormRopeShape shape,
                       impl_->CallShape(x, positions, batch, seq_local));
  const FusedQkvConfig& c = impl_->config;
  if (dests.out == nullptr) return absl::InvalidArgumentError("dests.out is null");
  const int64_t rows = QkvRows(shape), chunk = impl_->ChunkRows(rows);
  const int64_t hidden = impl_->hidden(), features = impl_->features();
  cudaStream_t side = impl_->side.get();
  // The second stream's stores must follow whatever the caller's stream did before the call
  // (for instance the wait for the destination slots to be free).
  ULY_CUDA_RETURN_IF_ERROR(cudaEventRecord(impl_->start.get(), stream));
  ULY_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, impl_->start.get(), 0));
  uint64_t* ready[kMaxWorldSize] = {};
  const absl::Status chunks = [&]() -> absl::Status {
    for (int64_t i = 0, row = 0; row < rows; ++i, row += chunk) {
      const int64_t end = std::min(rows, row + chunk);
      const auto* x_rows = static_cast<const uint16_t*>(x) + row * hidden;
      ULY_RETURN_IF_ERROR(impl_->Project(x_rows, end - row, impl_->qkv() + row * features, stream));
      ULY_CUDA_RETURN_IF_ERROR(cudaEventRecord(impl_->chunk_done[i].get(), stream));
      ULY_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, impl_->chunk_done[i].get(), 0));
      QkvDestinations chunk_dests{dests.out, nullptr, dests.epoch, dests.cancel};
      if (dests.ready != nullptr) {
        for (int d = 0; d < shape.world; ++d) {
          ready[d] = dests.ready[d] != nullptr ? dests.ready[d] + i : nullptr;
        }
        chunk_dests.ready = ready;
      }
      ULY_RETURN_IF_ERROR(LaunchNormRopeScatter(shape, c.layout, c.weights, positions, impl_->qkv(),
                                                c.rank, row, end, chunk_dests, impl_->counter(1),
                                                side, QkvLaunchOptions{c.push_blocks}));
    }
    return absl::OkStatus();
  }();
  // The second stream joins the caller's even after a failure part way: what it enqueued
  // must be ordered before the caller's later work (and before the call's buffers can go).
  cudaError_t join = cudaEventRecord(impl_->done.get(), side);
  if (join == cudaSuccess) join = cudaStreamWaitEvent(stream, impl_->done.get(), 0);
  ULY_RETURN_IF_ERROR(chunks);
  ULY_CUDA_RETURN_IF_ERROR(join);
  return absl::OkStatus();
}

absl::Status FusedQkvPlan::RunEpilogue(const void* x, const int32_t* positions, int64_t batch,
                                       int64_t seq_local, const QkvDestinations& dests,
                                       cudaStream_t stream) {
  ULY_RETURN_IF_ERROR(impl_->EpilogueAvailable());
  ULY_ASSIGN_OR_RETURN(const QkvNormRopeShape shape,
                       impl_->CallShape(x, positions, batch, seq_local));
  const FusedQkvConfig& c = impl_->config;
  internal::EpilogueCall call;
  call.shape = shape;
  call.layout = c.layout;
  call.src = c.rank;
  call.x = x;
  call.positions = positions;
  call.weights = c.weights;
  call.dests = dests;
  static_assert(internal::kEpilogueTileRows == 128, "EpilogueChunkRows rounds to 128 rows");
  call.chunk_rows = EpilogueChunkRows(QkvRows(shape), c.chunk_rows);
  call.chunk_counters = static_cast<unsigned int*>(impl_->chunk_counters.get());
  call.projection = c.keep_projection ? impl_->qkv() : nullptr;
  return impl_->EpilogueFor(QkvRows(shape))->Run(call, stream);
}

absl::Status FusedQkvPlan::RunEpilogueGemmAlone(const void* x, int64_t rows,
                                                cudaStream_t stream) {
  ULY_RETURN_IF_ERROR(impl_->EpilogueAvailable());
  if (rows <= 0 || rows > impl_->config.max_tokens)
    return absl::InvalidArgumentError(
        absl::StrCat("rows ", rows, " is not in [1, max_tokens=", impl_->config.max_tokens, "]"));
  const FusedQkvConfig& c = impl_->config;
  internal::EpilogueCall call;
  call.shape = QkvNormRopeShape{c.world, c.heads, c.head_dim, c.max_pos, 1, rows};
  call.x = x;
  call.weights = c.weights;
  call.gemm_alone = true;
  return impl_->EpilogueFor(rows)->Run(call, stream);
}

std::string FusedQkvPlan::EpilogueUnavailable() const { return impl_->epilogue_unavailable; }

int64_t FusedQkvPlan::ChunkRows(int64_t rows) const { return impl_->ChunkRows(rows); }

int64_t FusedQkvPlan::NumChunks(int64_t rows) const {
  return FusedNumChunks(rows, impl_->config.chunk_rows);
}

const void* FusedQkvPlan::projection() const { return impl_->projection.get(); }

std::string FusedQkvPlan::Describe(int64_t rows) const {
  const int64_t chunk = ChunkRows(rows);
  // The projection's GEMM at m rows.
  auto gemm = [&](int64_t m) {
    return impl_->config.cutlass_projection
               ? absl::StrCat(impl_->EpilogueFor(m)->Description(), ", projection only")
               : impl_->gemm->AlgoDescription(m);
  };
  return absl::StrCat(
      "per_operator: gemm[", rows, "] (", gemm(rows),
      ") -> norm_rope -> scatter x", impl_->config.world, "\n", "chunked: ", NumChunks(rows),
      " x gemm[", chunk, "] (", gemm(chunk),
      ") on the caller's stream, each followed on a second stream by norm_rope_scatter",
      impl_->config.push_blocks > 0 ? absl::StrCat(" (", impl_->config.push_blocks, " blocks)")
                                    : std::string(),
      " and its readiness words\n", "epilogue: ",
      impl_->epilogue_unavailable.empty()
          ? absl::StrCat("gemm[", rows, "] (", impl_->EpilogueFor(rows)->Description(),
                         ") storing into ",
                         impl_->config.world, " destinations, readiness words per ",
                         NumChunks(rows), " chunk(s)")
          : absl::StrCat("unavailable (", impl_->epilogue_unavailable, ")"));
}

}  // namespace ulysses::kernels
