// The fused QKV op's CUDA kernels against the CPU reference (qkv_norm_rope.h), at
// atol = rtol = 1e-2 with one-ulp bf16 flips counted and printed:
//  - the cuBLASLt projection against the fp32 reference GEMM;
//  - the norm+RoPE kernel on the reference projection against the reference step;
//  - the per-operator and the chunked path, W source ranks sharing this GPU and writing into W
//    destination slots on it, for both layouts: against the reference chain run on the GPU's
//    own projection (what the kernels after the GEMM must reproduce), and against the pure
//    reference head by head, where a head beyond the tolerance must come from a projection
//    that differs from the reference's in that head (GEMM rounding carried through the norm;
//    counted and printed);
//  - the chunked path against the per-operator path in the same way, and the readiness words.
// Shapes: B = 2, S_l = 200 (chunks of 128 rows leave a tail), hidden in {3072, 4096, 6144,
// 8192} (D = 128), W in {1, 2, 4}.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "qkv_test_util.h"
#include "ulysses/common/status.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/queue_probe.h"
#include "ulysses/kernels/exchange_cuda.h"
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/gemm.h"
#include "ulysses/kernels/qkv_norm_rope.h"
#include "ulysses/kernels/qkv_norm_rope_cuda.h"

namespace ulysses::kernels {
namespace {

using testing::Bf16Diff;
using testing::CompareBf16;
using testing::QkvProblem;

#define ASSERT_CUDA_OK(call)                                          \
  do {                                                                \
    const cudaError_t uly_err_ = (call);                              \
    ASSERT_EQ(uly_err_, cudaSuccess) << cudaGetErrorString(uly_err_); \
  } while (0)

// Modules load eagerly, as the daemon has them (daemon.cc): a lazy load of a kernel waits for
// the context to go idle, so a first launch beside a waiting stream would wait for that wait.
// Set before main, so before this program's first CUDA call.
[[maybe_unused]] const bool kEagerModules =
    ::setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0) == 0;

constexpr int64_t kBatch = 2, kSeqLocal = 200;
constexpr int32_t kMaxPos = 4096;
constexpr uint16_t kPoison = 0x7fc1;  // NaN: an element never written fails every comparison
constexpr uint64_t kEpoch = 0x1234567890ull;

// A row count no other case of the process asks cuBLASLt for (its picks are kept per process).
int64_t FreshRowCount() {
  static int64_t next = int64_t{1} << 20;
  return ++next;
}

// Device memory freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&data_, bytes_), cudaSuccess);
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    Upload(host);
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  template <typename T>
  void Upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  template <typename T>
  std::vector<T> Download(size_t count) const {
    std::vector<T> host(count);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  size_t bytes_;
  void* data_ = nullptr;
};

// Runs fn(begin, end) over [0, n) split across the machine's cores.
template <typename Fn>
void ParallelRanges(int64_t n, Fn fn) {
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] { fn(n * t / threads, n * (t + 1) / threads); });
  }
  for (auto& th : pool) th.join();
}

// Device copies of a problem's inputs, and both paths of every rank run on them into W
// poisoned destination slots on this GPU, with the checks that need no reference GEMM.
template <typename P>
class FusedGpuBase : public ::testing::TestWithParam<P> {
 protected:
  // Uploads the problem of `shape`; skips the test without a device. With `keep`, the host
  // problem is made once per shape and seed in the process and kept: gtest runs a suite test by
  // test, each over every shape, and making w_qkv of hidden 8192 takes seconds (the shape grid
  // keeps about 2.4 GB).
  void Init(const QkvNormRopeShape& shape, uint64_t seed, bool keep = false) {
    const absl::StatusOr<int> devices = CudaDeviceCount();
    ASSERT_TRUE(devices.ok()) << devices.status();
    if (*devices == 0) GTEST_SKIP() << "no CUDA device";
    shape_ = shape;
    if (keep) {
      using Key = std::tuple<int32_t, int32_t, int32_t, int32_t, int64_t, int64_t, uint64_t>;
      static std::map<Key, std::shared_ptr<const QkvProblem>> kept;
      const Key key{shape.world, shape.heads, shape.head_dim, shape.max_pos,
                    shape.batch, shape.seq_local, seed};
      std::shared_ptr<const QkvProblem>& slot = kept[key];
      if (slot == nullptr) {
        slot = std::make_shared<const QkvProblem>(testing::MakeQkvProblem(shape_, seed));
      }
      problem_ = slot;
    } else {
      problem_ = std::make_shared<const QkvProblem>(testing::MakeQkvProblem(shape_, seed));
    }
    ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    w_qkv_ = std::make_unique<DeviceBuffer>(problem_->w_qkv);
    q_norm_ = std::make_unique<DeviceBuffer>(problem_->q_norm);
    k_norm_ = std::make_unique<DeviceBuffer>(problem_->k_norm);
    cos_sin_ = std::make_unique<DeviceBuffer>(problem_->cos_sin);
    for (int r = 0; r < shape_.world; ++r) {
      x_.push_back(std::make_unique<DeviceBuffer>(problem_->x[r]));
      positions_.push_back(std::make_unique<DeviceBuffer>(problem_->positions[r]));
    }
    // Pageable uploads may still be in flight on the legacy stream; the tests use stream_.
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int64_t Rows() const { return QkvRows(shape_); }
  int64_t Elems() const { return Rows() * QkvFeatures(shape_); }
  int64_t SlotElems() const { return 3 * QkvPlaneElems(shape_); }
  QkvWeights DeviceWeights() const {
    return {w_qkv_->as<void>(), q_norm_->as<void>(), k_norm_->as<void>(), cos_sin_->as<float>()};
  }

  // Reference steps 2 and 3 on a projection of rank r.
  std::vector<uint16_t> NormRope(std::vector<uint16_t> proj, int r) const {
    ParallelRanges(Rows(), [&](int64_t begin, int64_t end) {
      NormRopeRef(shape_, problem_->weights(), problem_->positions[r].data(), begin, end,
                  proj.data());
    });
    return proj;
  }

  // Destination slots as the reference exchange fills them from every rank's result.
  std::vector<std::vector<uint16_t>> Scatter(const std::vector<std::vector<uint16_t>>& results,
                                             QkvLayout layout) const {
    std::vector<std::vector<uint16_t>> slots;
    for (int dst = 0; dst < shape_.world; ++dst) {
      slots.emplace_back(static_cast<size_t>(SlotElems()), kPoison);
      for (int src = 0; src < shape_.world; ++src) {
        ScatterQkvBlockRef(shape_, layout, results[src].data(), src, dst, slots[dst].data());
      }
    }
    return slots;
  }

  std::unique_ptr<FusedQkvPlan> MakePlan(int rank, QkvLayout layout, int64_t chunk_rows,
                                         bool keep_projection = false,
                                         void* second_stream = nullptr) const {
    FusedQkvConfig c;
    c.second_stream = second_stream;
    c.world = shape_.world;
    c.rank = rank;
    c.heads = shape_.heads;
    c.max_pos = shape_.max_pos;
    c.layout = layout;
    c.max_tokens = Rows();
    c.weights = DeviceWeights();
    c.chunk_rows = chunk_rows;
    c.keep_projection = keep_projection;
    c.cutlass_projection = cutlass_projection_;
    c.epilogue_schedule = schedule_;
    absl::StatusOr<std::unique_ptr<FusedQkvPlan>> plan = FusedQkvPlan::Create(c);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? std::move(*plan) : nullptr;
  }

  enum class Path { kPerOperator, kChunked, kEpilogue };

  // Whether this build and device run the epilogue path; where the build has it, it must run.
  bool EpilogueRuns() {
    std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0);
    if (plan == nullptr) return false;
    const std::string why = plan->EpilogueUnavailable();
#ifdef ULYSSES_HAVE_EPILOGUE_GEMM
    EXPECT_EQ(why, "") << "the build has the epilogue GEMM";
#endif
    if (!why.empty()) std::cout << "epilogue path unavailable: " << why << "\n";
    return why.empty();
  }

  // Runs every rank's call (chunked or epilogue, with `chunk_rows`, or per-operator) into W
  // poisoned slots; returns the slots, each rank's raw projection as the path computed it, and
  // checks the readiness words (one per chunk, or one for the per-operator call).
  struct PathResult {
    std::vector<std::vector<uint16_t>> slots;
    std::vector<std::vector<uint16_t>> proj;
  };
  PathResult RunPath(QkvLayout layout, Path path, int64_t chunk_rows = 128) {
    const bool chunked = path != Path::kPerOperator;
    const int world = shape_.world;
    PathResult out;
    std::vector<std::unique_ptr<DeviceBuffer>> slots;
    std::vector<void*> slot_ptrs;
    for (int d = 0; d < world; ++d) {
      slots.push_back(std::make_unique<DeviceBuffer>(
          std::vector<uint16_t>(static_cast<size_t>(SlotElems()), kPoison)));
      slot_ptrs.push_back(slots.back()->as<void>());
    }
    // words[dst][src][chunk]
    DeviceBuffer words(std::vector<uint64_t>(world * world * kMaxFusedChunks, 0));
    // The pageable uploads (poison, words, inputs) may still be in flight on the legacy stream
    // when cudaMemcpy returns; the calls run on a non-blocking stream.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    int64_t chunks = 1;
    for (int r = 0; r < world; ++r) {
      std::unique_ptr<FusedQkvPlan> plan =
          MakePlan(r, layout, chunked ? chunk_rows : 0, path == Path::kEpilogue);
      if (plan == nullptr) return out;
      // Poisoned: a stream-ordered pool may hand back the previous plan's buffer, whose rows
      // (another path's projection of the same x) would hide a GEMM that stored nothing.
      EXPECT_EQ(cudaMemsetAsync(const_cast<void*>(plan->projection()), 0xff,
                                static_cast<size_t>(Elems()) * sizeof(uint16_t), stream_),
                cudaSuccess);
      std::vector<uint64_t*> ready;
      for (int d = 0; d < world; ++d) {
        ready.push_back(words.as<uint64_t>() + (d * world + r) * kMaxFusedChunks);
      }
      const QkvDestinations dests{slot_ptrs.data(), ready.data(), kEpoch};
      EXPECT_TRUE(plan->Prepare(Rows()).ok());
      std::vector<uint16_t> proj;
      if (chunked) {
        chunks = plan->NumChunks(Rows());
        EXPECT_EQ(chunks, FusedNumChunks(Rows(), chunk_rows));
        const absl::Status s =
            path == Path::kChunked
                ? plan->RunChunked(x_[r]->as<void>(), positions_[r]->as<int32_t>(), shape_.batch,
                                   shape_.seq_local, dests, stream_)
                : plan->RunEpilogue(x_[r]->as<void>(), positions_[r]->as<int32_t>(),
                                    shape_.batch, shape_.seq_local, dests, stream_);
        EXPECT_TRUE(s.ok()) << s;
        EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      } else {
        // The same GEMM (same rows, same algorithm) as the call makes, for the chain check.
        EXPECT_TRUE(plan->RunProjection(x_[r]->as<void>(), Rows(), stream_).ok());
        EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        proj = DownloadProjection(*plan);
        const absl::Status s =
            plan->RunPerOperator(x_[r]->as<void>(), positions_[r]->as<int32_t>(), shape_.batch,
                                 shape_.seq_local, dests, stream_);
        EXPECT_TRUE(s.ok()) << s;
        EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      }
      // The chunked path leaves it raw; the epilogue path keeps it raw on request.
      if (chunked) proj = DownloadProjection(*plan);
      out.proj.push_back(std::move(proj));
      if (r == 0) std::cout << plan->Describe(Rows()) << "\n";
    }
    for (int d = 0; d < world; ++d) out.slots.push_back(slots[d]->Download<uint16_t>(SlotElems()));
    const std::vector<uint64_t> w = words.Download<uint64_t>(world * world * kMaxFusedChunks);
    for (int d = 0; d < world; ++d)
      for (int s = 0; s < world; ++s)
        for (int64_t c = 0; c < kMaxFusedChunks; ++c)
          EXPECT_EQ(w[(d * world + s) * kMaxFusedChunks + c], c < chunks ? kEpoch : 0)
              << "ready word dst " << d << " src " << s << " chunk " << c;
    return out;
  }

  // Rank 0's x again, 16 bytes past a 256-byte boundary (the lowest alignment class); the
  // x itself is at ShiftedX(buffer).
  std::unique_ptr<DeviceBuffer> MakeShiftedX() const {
    const size_t elems = static_cast<size_t>(Rows() * QkvHidden(shape_));
    auto buffer = std::make_unique<DeviceBuffer>((elems + 8) * sizeof(uint16_t));
    EXPECT_EQ(cudaMemcpy(buffer->as<uint16_t>() + 8, x_[0]->as<void>(), elems * sizeof(uint16_t),
                         cudaMemcpyDeviceToDevice),
              cudaSuccess);
    return buffer;
  }
  static const void* ShiftedX(const DeviceBuffer& buffer) { return buffer.as<uint16_t>() + 8; }

  // `elems` elements of a GEMM's output against the reference projection: within the GEMM's
  // tolerance (no mismatch beyond it, at most 1% one-ulp flips). Returns the comparison.
  static Bf16Diff ExpectWithinGemmTolerance(const uint16_t* got, const uint16_t* want,
                                            int64_t elems) {
    const Bf16Diff d = CompareBf16(got, want, elems);
    EXPECT_EQ(d.mismatches, 0) << d;
    EXPECT_LE(d.flips, d.elements / 100) << d;
    return d;
  }
  // The first `m` rows of the plan's projection against `want`, the same way.
  void CheckProjectionRows(const FusedQkvPlan& plan, const std::vector<uint16_t>& want,
                           int64_t m) const {
    ExpectWithinGemmTolerance(DownloadProjection(plan).data(), want.data(),
                              m * QkvFeatures(shape_));
  }

  std::vector<uint16_t> DownloadProjection(const FusedQkvPlan& plan) const {
    std::vector<uint16_t> host(static_cast<size_t>(Elems()));
    EXPECT_EQ(cudaMemcpy(host.data(), plan.projection(), host.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

  // Rank src's [B*S_l, 3*H*D] result as the destination slots hold it (the inverse of the
  // exchange; the blocks of all sources cover every slot element).
  std::vector<uint16_t> Gather(const std::vector<std::vector<uint16_t>>& slots, QkvLayout layout,
                               int src) const {
    const int64_t hd = QkvHidden(shape_), hl = QkvLocalHeads(shape_), dim = shape_.head_dim;
    std::vector<uint16_t> out(static_cast<size_t>(Elems()));
    for (int64_t t = 0; t < Rows(); ++t) {
      const int64_t b = t / shape_.seq_local, sg = src * shape_.seq_local + t % shape_.seq_local;
      for (int plane = 0; plane < 3; ++plane) {
        for (int64_t g = 0; g < shape_.heads; ++g) {
          std::memcpy(out.data() + t * 3 * hd + plane * hd + g * dim,
                      slots[g / hl].data() + QkvDestOffset(shape_, layout, b, sg, g % hl, plane, 0),
                      dim * sizeof(uint16_t));
        }
      }
    }
    return out;
  }

  // Compares two results head by head. A head outside the tolerance counts as "propagated"
  // when the projections it was computed from differ in that head (GEMM rounding carried
  // through the norm, e.g. into a RoPE cancellation), and as "unexplained" otherwise.
  struct HeadDiff {
    Bf16Diff total;
    int64_t propagated = 0, unexplained = 0;
  };
  HeadDiff CompareHeads(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                        const std::vector<uint16_t>& got_proj,
                        const std::vector<uint16_t>& want_proj) const {
    HeadDiff out;
    out.total = CompareBf16(got.data(), want.data(), Elems());
    const int64_t dim = shape_.head_dim;
    for (int64_t at = 0; at < Elems(); at += dim) {
      const Bf16Diff head = CompareBf16(got.data() + at, want.data() + at, dim);
      if (head.mismatches == 0) continue;
      const bool inputs_differ =
          std::memcmp(got_proj.data() + at, want_proj.data() + at, dim * sizeof(uint16_t)) != 0;
      (inputs_differ ? out.propagated : out.unexplained) += head.mismatches;
    }
    return out;
  }

  // Where rank src's result differs from `want` at all: the count of differing elements per
  // chunk of `chunk_rows` rows and plane, "chunk c [rows a, b): q n, k n, v n", differing
  // chunks only (empty when equal).
  std::string WhereDiffers(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                           int64_t chunk_rows) const {
    const int64_t hd = QkvHidden(shape_), features = QkvFeatures(shape_);
    const int64_t chunk = FusedChunkRows(Rows(), chunk_rows);
    std::string out;
    for (int64_t begin = 0; begin < Rows(); begin += chunk) {
      const int64_t end = std::min(Rows(), begin + chunk);
      int64_t count[3] = {0, 0, 0};
      for (int64_t t = begin; t < end; ++t)
        for (int64_t n = 0; n < features; ++n)
          count[n / hd] += got[t * features + n] != want[t * features + n];
      if (count[0] + count[1] + count[2] == 0) continue;
      out += "chunk " + std::to_string(begin / chunk) + " [rows " + std::to_string(begin) + ", " +
             std::to_string(end) + "): q " + std::to_string(count[0]) + ", k " +
             std::to_string(count[1]) + ", v " + std::to_string(count[2]) + "; ";
    }
    return out;
  }

  // The path's slots against the reference chain (norm+RoPE, exchange) run on the path's own
  // projection, over the whole slots (an element never written is NaN): bit for bit, since the
  // reference adds and rounds as the kernels do.
  void CheckChain(const char* name, QkvLayout layout, const PathResult& got, int64_t chunk_rows) {
    ASSERT_EQ(got.slots.size(), static_cast<size_t>(shape_.world));
    std::vector<std::vector<uint16_t>> own_results;
    for (int r = 0; r < shape_.world; ++r) own_results.push_back(NormRope(got.proj[r], r));
    const auto own = Scatter(own_results, layout);
    bool equal = true;
    for (int d = 0; d < shape_.world; ++d) {
      const Bf16Diff chain = CompareBf16(got.slots[d].data(), own[d].data(), SlotElems());
      std::cout << name << " " << QkvLayoutName(layout) << " dst " << d
                << " vs the reference on its own projection: " << chain << "\n";
      EXPECT_EQ(chain.mismatches, 0) << name << " dst " << d;
      EXPECT_EQ(chain.equal, chain.elements) << name << " dst " << d;
      equal = equal && chain.equal == chain.elements;
    }
    if (equal) return;
    for (int src = 0; src < shape_.world; ++src) {
      const std::string where =
          WhereDiffers(Gather(got.slots, layout, src), own_results[src], chunk_rows);
      if (!where.empty()) std::cout << name << " src " << src << " differs in " << where << "\n";
    }
  }

  // Where both paths' projections agree on a head, the kernels after the GEMM must too.
  void CheckPathsAgree(QkvLayout layout, const PathResult& chunked, const PathResult& per_op,
                       const char* name = "chunked") {
    ASSERT_EQ(per_op.slots.size(), chunked.slots.size());
    ASSERT_EQ(per_op.proj.size(), chunked.proj.size());
    for (int src = 0; src < static_cast<int>(chunked.proj.size()); ++src) {
      const HeadDiff diff =
          CompareHeads(Gather(chunked.slots, layout, src), Gather(per_op.slots, layout, src),
                       chunked.proj[src], per_op.proj[src]);
      std::cout << name << " vs per_operator src " << src << ": " << diff.total
                << "; beyond tolerance: " << diff.propagated << " propagated, " << diff.unexplained
                << " unexplained\n";
      EXPECT_EQ(diff.unexplained, 0) << "src " << src;
    }
  }

  QkvNormRopeShape shape_{};
  std::shared_ptr<const QkvProblem> problem_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceBuffer> w_qkv_, q_norm_, k_norm_, cos_sin_;
  std::vector<std::unique_ptr<DeviceBuffer>> x_, positions_;
  bool cutlass_projection_ = false;  // MakePlan's plans project on the epilogue GEMM
  EpilogueSchedule schedule_ = EpilogueSchedule::kAuto;  // MakePlan's plans' schedule
};

// hidden, world, batch, seq_local
using Param = std::tuple<int32_t, int32_t, int64_t, int64_t>;

class GpuFusedQkvTest : public FusedGpuBase<Param> {
 protected:
  using Refs = std::vector<std::vector<uint16_t>>;

  void SetUp() override {
    const auto [hidden, world, batch, seq_local] = GetParam();
    Init(QkvNormRopeShape{world, hidden / kFusedGpuHeadDim, kFusedGpuHeadDim, kMaxPos, batch,
                          seq_local},
         1000 + hidden + world, /*keep=*/true);
    if (IsSkipped() || HasFatalFailure()) return;
    // The reference, one rank at a time, rows across threads; computed once per shape and
    // process. gtest runs a suite's cases test by test, each over every shape, so a cache of
    // one shape would compute it again for every test. Every shape's is kept instead (about
    // 0.75 GB for the 21 shapes: 2 x 2 bytes x W x rows x 3 x hidden each).
    static std::map<Param, std::pair<Refs, Refs>> cache;
    auto it = cache.find(GetParam());
    if (it == cache.end()) {
      const int64_t rows = Rows(), features = QkvFeatures(shape_);
      Refs proj, plain;
      for (int r = 0; r < world; ++r) {
        proj.emplace_back(static_cast<size_t>(rows * features));
        ParallelRanges(rows, [&](int64_t begin, int64_t end) {
          QkvProjectRef(problem_->x[r].data(), problem_->w_qkv.data(), QkvHidden(shape_), features,
                        begin, end, proj[r].data());
        });
        plain.push_back(NormRope(proj[r], r));
      }
      it = cache.emplace(GetParam(), std::make_pair(std::move(proj), std::move(plain))).first;
    }
    proj_ref_ = it->second.first;
    plain_ref_ = it->second.second;
  }

  // Runs `gemm` on rank 0's first `m` rows into `out`, poisoned first, and checks the result
  // against the reference projection.
  void RunGemmAndCheck(Bf16Gemm& gemm, const DeviceBuffer& out, int64_t m) {
    const int64_t features = QkvFeatures(shape_);
    ASSERT_CUDA_OK(cudaMemsetAsync(out.as<void>(), 0xff, out.bytes(), stream_));
    const absl::Status run = gemm.Run(x_[0]->as<void>(), w_qkv_->as<void>(), out.as<void>(), m,
                                      stream_);
    ASSERT_TRUE(run.ok()) << run;
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    ExpectWithinGemmTolerance(out.Download<uint16_t>(m * features).data(), proj_ref_[0].data(),
                              m * features);
  }

  // Loads `plan`'s kernels, then projects 1, rows/3 + 1, rows - 1 and all rows of rank 0's x,
  // with x 256-byte aligned and 16 bytes off, each into a poisoned buffer, checked against the
  // reference.
  void CheckProjectionAtAnyRowCountAndAlignment(FusedQkvPlan& plan) {
    const absl::Status loaded = plan.LoadKernels(Rows(), FusedPath::kAuto, stream_);
    ASSERT_TRUE(loaded.ok()) << loaded;
    std::cout << "loaded " << plan.loaded_gemm_kernels() << " cuBLASLt kernels\n";
    const std::unique_ptr<DeviceBuffer> shifted = MakeShiftedX();
    const int64_t features = QkvFeatures(shape_);
    for (const void* x : {static_cast<const void*>(x_[0]->as<void>()), ShiftedX(*shifted)}) {
      for (int64_t m : {int64_t{1}, Rows() / 3 + 1, Rows() - 1, Rows()}) {
        if (m < 1) continue;
        SCOPED_TRACE(absl::StrCat(m, " rows, x aligned to ",
                                  reinterpret_cast<uintptr_t>(x) % 256 == 0 ? 256 : 16));
        ASSERT_CUDA_OK(cudaMemsetAsync(const_cast<void*>(plan.projection()), 0xff,
                                       static_cast<size_t>(m * features) * sizeof(uint16_t),
                                       stream_));
        const absl::Status run = plan.RunProjection(x, m, stream_);
        ASSERT_TRUE(run.ok()) << run;
        ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
        CheckProjectionRows(plan, proj_ref_[0], m);
      }
    }
  }

  // The path's slots against (1) the reference chain on the path's own projection (bit for
  // bit); (2) the pure reference, per source rank and head: every mismatch must be propagated
  // GEMM rounding.
  void CheckPath(const char* name, QkvLayout layout, const PathResult& got) {
    CheckChain(name, layout, got, 128);
    for (int src = 0; src < shape_.world; ++src) {
      const HeadDiff whole = CompareHeads(Gather(got.slots, layout, src), plain_ref_[src],
                                          got.proj[src], proj_ref_[src]);
      std::cout << name << " " << QkvLayoutName(layout) << " src " << src
                << " vs the fp32 reference: " << whole.total
                << "; beyond tolerance: " << whole.propagated << " propagated from GEMM rounding, "
                << whole.unexplained << " unexplained\n";
      EXPECT_EQ(whole.unexplained, 0) << name << " src " << src;
      EXPECT_LE(whole.total.flips, whole.total.elements / 100) << name << " src " << src;
    }
  }

  std::vector<std::vector<uint16_t>> proj_ref_, plain_ref_;
};

TEST_P(GpuFusedQkvTest, ProjectionMatchesReferenceGemm) {
  for (int r = 0; r < shape_.world; ++r) {
    std::unique_ptr<FusedQkvPlan> plan = MakePlan(r, QkvLayout::kBshd, 0);
    ASSERT_NE(plan, nullptr);
    ASSERT_TRUE(plan->RunProjection(x_[r]->as<void>(), Rows(), stream_).ok());
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    const Bf16Diff d = CompareBf16(DownloadProjection(*plan).data(), proj_ref_[r].data(), Elems());
    std::cout << "gemm rank " << r << ": " << d << "\n";
    EXPECT_EQ(d.mismatches, 0);
    EXPECT_LE(d.flips, d.elements / 100);
  }
}

// A loaded plan's GEMM runs only the algorithms it loaded (LoadKernels), at any row count up to
// max_tokens and at any alignment of x: each such run is the reference projection within the
// GEMM's tolerance, and none fell back to an algorithm not loaded. The same rows and alignments
// on a plan projecting on the CUTLASS GEMM (where it runs): within tolerance, no cuBLASLt run.
TEST_P(GpuFusedQkvTest, ALoadedPlansProjectionMatchesReferenceAtAnyRowCountAndAlignment) {
  for (bool cutlass : {false, true}) {
    if (cutlass && !EpilogueRuns()) continue;
    SCOPED_TRACE(cutlass ? "cutlass projection" : "cuBLASLt projection");
    cutlass_projection_ = cutlass;
    std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0);
    cutlass_projection_ = false;
    ASSERT_NE(plan, nullptr);
    ASSERT_NO_FATAL_FAILURE(CheckProjectionAtAnyRowCountAndAlignment(*plan));
    EXPECT_EQ(plan->unloaded_gemm_launches(), 0u);
    if (cutlass) {
      EXPECT_EQ(plan->loaded_gemm_kernels(), 0u);
      EXPECT_EQ(plan->cublaslt_runs(), 0u);
    }
  }
}


// A GEMM loaded at one row count alone runs, at fewer rows, only algorithms it loaded (no
// kernel launched for the first time since the load) wherever cuBLASLt would pick another, and
// its results are the reference's within the GEMM's tolerance. How many row counts ran a
// loaded algorithm in place of cuBLASLt's own pick is reported.
TEST_P(GpuFusedQkvTest, AGemmLoadedAtOneRowCountRunsItsAlgorithmAtFewerRows) {
  const int64_t features = QkvFeatures(shape_), hidden = QkvHidden(shape_);
  absl::StatusOr<std::unique_ptr<Bf16Gemm>> gemm = Bf16Gemm::Create(features, hidden);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  DeviceBuffer scratch(static_cast<size_t>(Rows() * features) * sizeof(uint16_t) + 256);
  DeviceBuffer out(static_cast<size_t>(Rows() * features) * sizeof(uint16_t));
  const absl::Status loaded = (*gemm)->Load({Rows()}, w_qkv_->as<void>(), scratch.as<void>(),
                                            scratch.bytes(), stream_);
  ASSERT_TRUE(loaded.ok()) << loaded;
  ASSERT_TRUE((*gemm)->Prepare(Rows()).ok());
  const std::string at_rows = (*gemm)->AlgoDescription(Rows());
  // cuBLASLt's own picks, from a GEMM that is not loaded (same workspace).
  absl::StatusOr<std::unique_ptr<Bf16Gemm>> own = Bf16Gemm::Create(features, hidden);
  ASSERT_TRUE(own.ok()) << own.status();
  int substituted = 0;
  for (int64_t m : {int64_t{1}, int64_t{7}, Rows() / 2 + 1, Rows() - 1}) {
    if (m < 1 || m >= Rows()) continue;
    SCOPED_TRACE(absl::StrCat(m, " rows"));
    ASSERT_TRUE((*gemm)->Prepare(m).ok());
    ASSERT_NO_FATAL_FAILURE(RunGemmAndCheck(**gemm, out, m));
    ASSERT_TRUE((*own)->Prepare(m).ok());
    substituted += (*own)->AlgoDescription(m) != (*gemm)->AlgoDescription(m);
  }
  std::cout << "rows at which a loaded algorithm (" << at_rows
            << " at all rows) replaced cuBLASLt's own pick: " << substituted << "\n";
  EXPECT_GE((*gemm)->loaded_algorithms(), 1u);
  EXPECT_EQ((*gemm)->unloaded_launches(), 0u);
}

// A GEMM loaded with every row count up to N (Bf16Gemm::Load's every_row_up_to, as a plan's
// LoadKernels does below the epilogue path's rows) runs cuBLASLt's own pick at each of them:
// the algorithm a GEMM that is not loaded picks, at every row count from 1 to N; runs at some
// of them launch no kernel for the first time and are the reference's within tolerance.
TEST_P(GpuFusedQkvTest, AGemmLoadedAtEveryRowCountRunsCublasLtsOwnPickAtEachOfThem) {
  const int64_t features = QkvFeatures(shape_), hidden = QkvHidden(shape_);
  const int64_t every = std::min<int64_t>(Rows(), 512);
  absl::StatusOr<std::unique_ptr<Bf16Gemm>> gemm = Bf16Gemm::Create(features, hidden);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  DeviceBuffer scratch(static_cast<size_t>(Rows() * features) * sizeof(uint16_t) + 256);
  DeviceBuffer out(static_cast<size_t>(Rows() * features) * sizeof(uint16_t));
  const absl::Status loaded = (*gemm)->Load({Rows()}, w_qkv_->as<void>(), scratch.as<void>(),
                                            scratch.bytes(), stream_, every);
  ASSERT_TRUE(loaded.ok()) << loaded;
  // cuBLASLt's picks asked afresh, not the ones the load kept for the process.
  Bf16Gemm::ForgetPicks();
  absl::StatusOr<std::unique_ptr<Bf16Gemm>> own = Bf16Gemm::Create(features, hidden);
  ASSERT_TRUE(own.ok()) << own.status();
  int64_t differ = 0;
  for (int64_t m = 1; m <= every; ++m) {
    ASSERT_TRUE((*gemm)->Prepare(m).ok());
    ASSERT_TRUE((*own)->Prepare(m).ok());
    if ((*own)->AlgoDescription(m) != (*gemm)->AlgoDescription(m)) {
      ++differ;
      ADD_FAILURE() << m << " rows: loaded GEMM runs " << (*gemm)->AlgoDescription(m)
                    << ", cuBLASLt picks " << (*own)->AlgoDescription(m);
    }
  }
  EXPECT_EQ(differ, 0);
  for (int64_t m : {int64_t{1}, every / 3 + 1, every}) {
    SCOPED_TRACE(absl::StrCat(m, " rows"));
    ASSERT_NO_FATAL_FAILURE(RunGemmAndCheck(**gemm, out, m));
  }
  std::cout << "every row count up to " << every << ": " << (*gemm)->loaded_algorithms()
            << " cuBLASLt kernels loaded\n";
  EXPECT_EQ((*gemm)->unloaded_launches(), 0u);
  // A bound out of [0, kMaxEveryRowLoad] is refused, and so is one the scratch cannot hold.
  for (int64_t bad : {int64_t{-1}, Bf16Gemm::kMaxEveryRowLoad + 1}) {
    EXPECT_EQ((*gemm)->Load({1}, w_qkv_->as<void>(), scratch.as<void>(), scratch.bytes(), stream_,
                            bad)
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ((*gemm)->Load({1}, w_qkv_->as<void>(), scratch.as<void>(), 256, stream_, every).code(),
            absl::StatusCode::kInvalidArgument);
}

// GEMMs of one shape share cuBLASLt's picks (a daemon's fused sessions, one per layer, ask
// once): a row count new to the process costs one algorithm query for the first GEMM and none
// for a second GEMM of the shape, which picks the same algorithm and computes the reference.
TEST_P(GpuFusedQkvTest, GemmsOfOneShapeAskCublasLtOnceForEachRowCount) {
  const int64_t features = QkvFeatures(shape_), hidden = QkvHidden(shape_);
  absl::StatusOr<std::unique_ptr<Bf16Gemm>> first = Bf16Gemm::Create(features, hidden);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<Bf16Gemm>> second = Bf16Gemm::Create(features, hidden);
  ASSERT_TRUE(second.ok()) << second.status();
  const int64_t unseen = FreshRowCount();
  const size_t before = Bf16Gemm::algorithm_queries();
  ASSERT_TRUE((*first)->Prepare(unseen).ok());
  EXPECT_EQ(Bf16Gemm::algorithm_queries(), before + 1);
  ASSERT_TRUE((*second)->Prepare(unseen).ok());
  EXPECT_EQ(Bf16Gemm::algorithm_queries(), before + 1);
  EXPECT_EQ((*second)->AlgoDescription(unseen), (*first)->AlgoDescription(unseen));
  for (int64_t m : {int64_t{1}, Rows()}) {
    SCOPED_TRACE(absl::StrCat(m, " rows"));
    ASSERT_TRUE((*first)->Prepare(m).ok());
    const size_t asked = Bf16Gemm::algorithm_queries();
    ASSERT_TRUE((*second)->Prepare(m).ok());
    EXPECT_EQ(Bf16Gemm::algorithm_queries(), asked);
    EXPECT_EQ((*second)->AlgoDescription(m), (*first)->AlgoDescription(m));
    DeviceBuffer out(static_cast<size_t>(m * features) * sizeof(uint16_t));
    ASSERT_NO_FATAL_FAILURE(RunGemmAndCheck(**second, out, m));
  }
}

// The per-operator and chunked paths projecting on the epilogue path's CUTLASS GEMM (its
// epilogue storing the projection only): the projection within the GEMM's tolerance of the
// reference, each path bit for bit the reference chain on its own projection and within
// tolerance of the pure reference, and the cuBLASLt per-operator path's result wherever both
// projections agree on a head.
TEST_P(GpuFusedQkvTest, CutlassProjectionPathsMatchReferenceAndTheCublasLtPath) {
  if (!EpilogueRuns()) GTEST_SKIP() << "no epilogue GEMM in this build or on this device";
  for (QkvLayout layout : {QkvLayout::kBshd, QkvLayout::kFused}) {
    SCOPED_TRACE(std::string(QkvLayoutName(layout)));
    const PathResult cublas = RunPath(layout, Path::kPerOperator);
    cutlass_projection_ = true;
    const PathResult per_op = RunPath(layout, Path::kPerOperator);
    const PathResult chunked = RunPath(layout, Path::kChunked);
    cutlass_projection_ = false;
    CheckPath("per_operator (cutlass projection)", layout, per_op);
    CheckPath("chunked (cutlass projection)", layout, chunked);
    for (int r = 0; r < shape_.world; ++r) {
      for (const PathResult* got : {&per_op, &chunked}) {
        const Bf16Diff d =
            ExpectWithinGemmTolerance(got->proj[r].data(), proj_ref_[r].data(), Elems());
        std::cout << (got == &per_op ? "per_operator" : "chunked") << " cutlass projection rank "
                  << r << ": " << d << "\n";
      }
    }
    CheckPathsAgree(layout, per_op, cublas, "per_operator (cutlass projection)");
    CheckPathsAgree(layout, chunked, per_op, "chunked (cutlass projection)");
  }
}

TEST_P(GpuFusedQkvTest, NormRopeKernelMatchesReferenceStep) {
  for (int r = 0; r < shape_.world; ++r) {
    DeviceBuffer qkv(proj_ref_[r]);
    ASSERT_CUDA_OK(cudaDeviceSynchronize());  // the pageable upload, before stream_ reads it
    const absl::Status s = LaunchNormRope(shape_, DeviceWeights(), positions_[r]->as<int32_t>(), 0,
                                          Rows(), qkv.as<void>(), stream_);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    const Bf16Diff d =
        CompareBf16(qkv.Download<uint16_t>(Elems()).data(), plain_ref_[r].data(), Elems());
    std::cout << "norm_rope rank " << r << ": " << d << "\n";
    // The reference adds sum(y^2) in the kernel's order and rounds where it does.
    EXPECT_EQ(d.mismatches, 0);
    EXPECT_EQ(d.equal, d.elements);
  }
}

TEST_P(GpuFusedQkvTest, PathsMatchReferenceAndEachOther) {
  for (QkvLayout layout : {QkvLayout::kBshd, QkvLayout::kFused}) {
    SCOPED_TRACE(std::string(QkvLayoutName(layout)));
    const PathResult per_op = RunPath(layout, Path::kPerOperator);
    CheckPath("per_operator", layout, per_op);
    const PathResult chunked = RunPath(layout, Path::kChunked);
    CheckPath("chunked", layout, chunked);
    EXPECT_EQ(FusedNumChunks(Rows(), 128), (Rows() + 127) / 128);
    CheckPathsAgree(layout, chunked, per_op);
  }
}

// The epilogue-fused GEMM: bit for bit the reference chain on its own (kept) projection, the
// projection within the GEMM tolerance of the fp32 reference, and the per-operator path's
// result wherever both projections agree on a head; readiness words per 128-row chunk.
TEST_P(GpuFusedQkvTest, EpiloguePathMatchesReferenceAndThePerOperatorPath) {
  if (!EpilogueRuns()) GTEST_SKIP() << "no epilogue path in this build or on this device";
  for (QkvLayout layout : {QkvLayout::kBshd, QkvLayout::kFused}) {
    SCOPED_TRACE(std::string(QkvLayoutName(layout)));
    const PathResult epilogue = RunPath(layout, Path::kEpilogue);
    CheckPath("epilogue", layout, epilogue);
    for (int r = 0; r < shape_.world; ++r) {
      const Bf16Diff d = CompareBf16(epilogue.proj[r].data(), proj_ref_[r].data(), Elems());
      std::cout << "epilogue gemm rank " << r << ": " << d << "\n";
      EXPECT_EQ(d.mismatches, 0);
      EXPECT_LE(d.flips, d.elements / 100);
    }
    const PathResult per_op = RunPath(layout, Path::kPerOperator);
    CheckPathsAgree(layout, epilogue, per_op, "epilogue");
  }
}

// Every mainloop schedule of the epilogue GEMM (single CTAs; clusters, which reach past the
// last row tile on shapes that are not whole clusters; the cooperative kernel's tiles of two
// heads, the last one half outside the problem where 3H is odd, as at hidden 384)
// gives the reference chain's bits with the readiness words of every chunk, and its plan says
// which kernel it ran.
TEST_P(GpuFusedQkvTest, EveryEpilogueScheduleMatchesTheReference) {
  if (!EpilogueRuns()) GTEST_SKIP() << "no epilogue path in this build or on this device";
  for (int i = 0; i < kEpilogueSchedules; ++i) {
    schedule_ = static_cast<EpilogueSchedule>(i + 1);
    SCOPED_TRACE(EpilogueScheduleName(schedule_));
    std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0);
    ASSERT_NE(plan, nullptr);
    const std::string cluster =
        schedule_ == EpilogueSchedule::kPingpong
            ? "ping-pong, persistent, tile 128x128x64, cluster 1x1"
        : schedule_ == EpilogueSchedule::kPingpongCluster2
            ? "ping-pong, persistent, tile 128x128x64, cluster 2x1"
            : "cooperative, persistent, tile 128x256x64, cluster 2x1";
    const std::string describe = plan->Describe(Rows());
    EXPECT_NE(describe.find(cluster), std::string::npos) << describe;
    EXPECT_EQ(describe.find("from registers") != std::string::npos,
              schedule_ == EpilogueSchedule::kCooperativeCluster2TwoHeads)
        << describe;
    EXPECT_EQ(describe.find("by warps of its own") != std::string::npos,
              schedule_ == EpilogueSchedule::kCooperativeEpilogueWarps)
        << describe;
    // Readiness chunks of 128 rows (a row tile each) and of 256 rows (two row tiles each);
    // RunPath checks every chunk's word.
    for (QkvLayout layout : {QkvLayout::kBshd, QkvLayout::kFused}) {
      for (int64_t chunk_rows : {128, 256}) {
        SCOPED_TRACE(std::string(QkvLayoutName(layout)) + ", chunks of " +
                     std::to_string(chunk_rows));
        CheckPath("epilogue", layout, RunPath(layout, Path::kEpilogue, chunk_rows));
      }
    }
  }
}

// The slot budget reserves DeviceBytesFor(config) before a fused session's plan is made, and
// charges device_bytes() once it is: the two agree, so nothing is made beyond the reservation.
TEST_P(GpuFusedQkvTest, APlanHoldsTheDeviceBytesReservedForIt) {
  std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0);
  ASSERT_NE(plan, nullptr);
  FusedQkvConfig c;
  c.heads = shape_.heads;
  c.head_dim = shape_.head_dim;
  c.max_tokens = Rows();
  const size_t projection = static_cast<size_t>(Rows()) * 3 * shape_.heads * shape_.head_dim * 2;
  EXPECT_GE(plan->device_bytes(), projection);
  EXPECT_LE(plan->device_bytes(), FusedQkvPlan::DeviceBytesFor(c));
  // The epilogue path's chunk counters are made only where that path can run.
  if (plan->EpilogueUnavailable().empty()) {
    EXPECT_EQ(plan->device_bytes(), FusedQkvPlan::DeviceBytesFor(c));
  }
}

TEST_P(GpuFusedQkvTest, LaunchersRejectBadArgumentsAndEnqueueNothing) {
  DeviceBuffer qkv(static_cast<size_t>(Elems()) * 2);
  QkvNormRopeShape bad = shape_;
  bad.head_dim = 64;
  EXPECT_EQ(LaunchNormRope(bad, DeviceWeights(), positions_[0]->as<int32_t>(), 0, Rows(),
                           qkv.as<void>(), stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchNormRope(shape_, DeviceWeights(), positions_[0]->as<int32_t>(), 0, Rows() + 1,
                           qkv.as<void>(), stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchNormRope(shape_, DeviceWeights(), positions_[0]->as<int32_t>(), 0, Rows(),
                           qkv.as<uint8_t>() + 2, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<void*> outs(shape_.world, qkv.as<void>());
  uint64_t* words[kMaxWorldSize] = {};
  const QkvDestinations no_counter{outs.data(), words, 1};
  EXPECT_EQ(LaunchQkvScatter(shape_, QkvLayout::kFused, qkv.as<void>(), 0, 0, Rows(), no_counter,
                             nullptr, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  const QkvDestinations plain{outs.data(), nullptr, 0};
  EXPECT_EQ(LaunchQkvScatter(shape_, QkvLayout::kFused, qkv.as<void>(), shape_.world, 0, Rows(),
                             plain, nullptr, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0);
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->RunPerOperator(x_[0]->as<void>(), positions_[0]->as<int32_t>(), shape_.batch,
                                 shape_.seq_local + 1, plain, stream_)
                .code(),
            absl::StatusCode::kResourceExhausted);
  if (plan->EpilogueUnavailable().empty()) {
    EXPECT_EQ(plan->RunEpilogue(x_[0]->as<void>(), positions_[0]->as<int32_t>(), shape_.batch,
                                shape_.seq_local + 1, plain, stream_)
                  .code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(plan->RunEpilogue(x_[0]->as<uint8_t>() + 2, positions_[0]->as<int32_t>(),
                                shape_.batch, shape_.seq_local, plain, stream_)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(plan->RunEpilogue(x_[0]->as<void>(), positions_[0]->as<int32_t>(), shape_.batch,
                                shape_.seq_local, QkvDestinations{nullptr, nullptr, 0}, stream_)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  } else {
    EXPECT_EQ(plan->RunEpilogue(x_[0]->as<void>(), positions_[0]->as<int32_t>(), shape_.batch,
                                shape_.seq_local, plain, stream_)
                  .code(),
              absl::StatusCode::kFailedPrecondition);
  }
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
}

// The chunked path at many rows per rank: the default chunks of 8192 and 16384 rows, each
// GEMM running long beside the previous chunk's stores, the chunked call first on a fresh
// plan (as the benchmark makes it). Small in hidden, so that the host checks stay quick:
// against the reference chain on the path's own projection, bit for bit, and against the
// per-operator path (where both projections agree on a head, both results must agree). Where
// the epilogue GEMM runs, also the epilogue path and both other paths projecting on it
// (fused.projection cutlass): from 2048 rows its clusters of two CTAs, here also at row counts
// whose 128-row tiles are odd in number and end in a partial tile (2100, 4097).
using LargeParam = std::tuple<int32_t, int64_t>;  // world, rows per rank

class GpuFusedQkvLargeRowsTest : public FusedGpuBase<LargeParam> {
 protected:
  static constexpr int32_t kHidden = 512;

  void SetUp() override {
    const auto [world, rows] = GetParam();
    Init(QkvNormRopeShape{world, kHidden / kFusedGpuHeadDim, kFusedGpuHeadDim,
                          static_cast<int32_t>(world * rows), 1, rows},
         2000 + world + rows);
  }
};

TEST_P(GpuFusedQkvLargeRowsTest, ChunkedMatchesItsChainAndThePerOperatorPath) {
  if (Rows() >= 32768) {
    EXPECT_GE(FusedChunkRows(Rows(), 0), 8192);
  }
  for (QkvLayout layout : {QkvLayout::kBshd, QkvLayout::kFused}) {
    SCOPED_TRACE(std::string(QkvLayoutName(layout)));
    const PathResult chunked = RunPath(layout, Path::kChunked, /*chunk_rows=*/0);
    CheckChain("chunked", layout, chunked, 0);
    const PathResult per_op = RunPath(layout, Path::kPerOperator);
    CheckChain("per_operator", layout, per_op, 0);
    CheckPathsAgree(layout, chunked, per_op);
    if (EpilogueRuns()) {
      const PathResult epilogue = RunPath(layout, Path::kEpilogue, /*chunk_rows=*/0);
      CheckChain("epilogue", layout, epilogue, 0);
      CheckPathsAgree(layout, epilogue, per_op, "epilogue");
      cutlass_projection_ = true;
      const PathResult cut_per_op = RunPath(layout, Path::kPerOperator);
      const PathResult cut_chunked = RunPath(layout, Path::kChunked, /*chunk_rows=*/0);
      cutlass_projection_ = false;
      CheckChain("per_operator (cutlass projection)", layout, cut_per_op, 0);
      CheckChain("chunked (cutlass projection)", layout, cut_chunked, 0);
      CheckPathsAgree(layout, cut_per_op, per_op, "per_operator (cutlass projection)");
      CheckPathsAgree(layout, cut_chunked, cut_per_op, "chunked (cutlass projection)");
    }
  }
}

std::string LargeParamName(const ::testing::TestParamInfo<LargeParam>& info) {
  return "W" + std::to_string(std::get<0>(info.param)) + "_rows" +
         std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(LargeRows, GpuFusedQkvLargeRowsTest,
                         ::testing::Values(LargeParam{2, 32768}, LargeParam{4, 32768},
                                           LargeParam{2, 65536}, LargeParam{1, 2100},
                                           LargeParam{2, 4097}),
                         LargeParamName);

// What a stream waiting at a stream memory operation holds back: nothing on another hardware
// queue. The daemon relies on it: one session's call waits on the GPU for its peer while other
// sessions' calls run (docs/architecture.md, section 8). cuBLASLt's one-time work is done first,
// as the daemon does at start (Bf16Gemm::WarmUp). Then, for each step of a fused call as the
// daemon runs them, a stream waits on a word of mapped host memory, and the step runs on
// streams the queue probe finds on another queue (so a shared queue is ruled out by
// construction: what is tested is whether a step waits for the whole device); the step must end
// while the wait holds, except the first launches of cuBLASLt kernels, which are known to wait
// for the whole device (measured on H100: the launch call itself is held) and are reported. The
// wait is let go after each step, and after 8 s whatever happens, so a step that waits for it
// fails the case (naming it) and the steps after it still run. Modules load eagerly in this
// program (below), as in the daemon.
class GpuFusedBesideAWaitTest : public FusedGpuBase<int64_t> {
 protected:
  struct Step {
    std::string name;
    std::function<absl::Status()> run;
    // The first launch of a cuBLASLt kernel in this process: it holds the launching thread
    // until every stream of the device is idle (which is why a daemon's session loads its
    // kernels when it opens). Reported, not asserted; every other step must end in time.
    bool first_launch = false;
    // An ordering this library does not use, run to show how the platform behaves, or a
    // chunked call under MPS, which may wait (UnderMps): reported, not asserted.
    bool reported_only = false;
  };
  using Steps = std::vector<Step>;

  // Whether this process's context on device 0 is an MPS client.
  static bool UnderMps() {
    const absl::StatusOr<ipc::cuda::DeviceInfo> info = ipc::cuda::Describe(0);
    return info.ok() && info->mps;
  }

  void SetUp() override {
    const int64_t rows = GetParam();
    Init(QkvNormRopeShape{1, 2, kFusedGpuHeadDim, static_cast<int32_t>(rows), 1, rows}, 3000);
  }
  void TearDown() override {
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
    if (gate_ != nullptr) cudaFreeHost(gate_);
    FusedGpuBase<int64_t>::TearDown();
  }

  // Streams, the queues they share, and the gate: `waiting_` is held at the gate, `run_` and
  // `side_` are on other hardware queues. Skips when every stream shares one queue.
  void MakeStreamsAndGate() {
    for (int i = 0; i < 8; ++i) {
      cudaStream_t s = nullptr;
      ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
    }
    std::vector<void*> handles(streams_.begin(), streams_.end());
    absl::StatusOr<ipc::QueueProbeResult> probe = ipc::cuda::ProbeStreamQueues(handles);
    ASSERT_TRUE(probe.ok()) << probe.status();
    std::cout << "hardware queues seen by 8 streams: " << probe->classes.size() << "\n";
    waiting_ = streams_[0];
    class_of_ = probe->class_of;
    for (size_t i = 1; i < streams_.size(); ++i) {
      if (probe->class_of[i] == probe->class_of[0]) continue;
      if (run_ == nullptr) {
        run_ = streams_[i];
        run_class_ = probe->class_of[i];
      } else if (side_ == nullptr) {
        side_ = streams_[i];
      }
    }
    if (run_ == nullptr) GTEST_SKIP() << "every stream of this process shares one hardware queue";
    if (side_ == nullptr) side_ = run_;
    ASSERT_CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&gate_), sizeof(uint64_t),
                                 cudaHostAllocMapped));
    *gate_ = 0;
  }

  // Runs each step against a fresh wait on `waiting_`, let go after the step or after 8 s, so
  // a step that waits for it fails the case (naming it) and the steps after it still run.
  void RunBesideAWait(const Steps& steps) {
    auto idle = [](cudaStream_t st) {
      cudaError_t q;
      while ((q = cudaStreamQuery(st)) == cudaErrorNotReady)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      return q;
    };
    size_t ran = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const uint64_t epoch = ++epoch_;
      ASSERT_TRUE(ipc::cuda::StreamWait64(waiting_, gate_, epoch).ok());
      absl::Status status;
      std::atomic<bool> returned{false}, finished{false};
      std::thread worker([&] {
        status = steps[i].run();
        returned = true;
        // Every stream a step may use (all but the waiting one) must be idle.
        for (cudaStream_t st : streams_) {
          if (st == waiting_) continue;
          const cudaError_t e = idle(st);
          if (status.ok() && e != cudaSuccess) status = absl::InternalError(cudaGetErrorString(e));
        }
        finished = true;
      });
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(8);
      while (!finished && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const bool in_time = finished.load(), host_returned = returned.load();
      __atomic_store_n(gate_, epoch, __ATOMIC_RELEASE);
      worker.join();
      ASSERT_EQ(cudaStreamSynchronize(waiting_), cudaSuccess);
      ran = i + 1;
      // A step that waited either held its host call (a device-wide wait inside a library) or
      // put work on its streams that waited for the other stream.
      std::cout << "step " << steps[i].name << (steps[i].first_launch ? " (first launch)" : "")
                << (steps[i].reported_only ? " (reported only)" : "") << ": "
                << (in_time         ? "in time"
                    : host_returned ? "WAITED (the host call had returned; its GPU work waited)"
                                    : "WAITED (the host call itself was held)")
                << "\n";
      EXPECT_TRUE(in_time || steps[i].first_launch || steps[i].reported_only)
          << steps[i].name << " waited for the other stream's wait";
      EXPECT_TRUE(status.ok()) << steps[i].name << ": " << status;
      if (!status.ok()) break;  // the steps after it need it
    }
    EXPECT_EQ(ran, steps.size()) << "the steps stopped at " << steps[ran - 1].name;
  }

  std::vector<cudaStream_t> streams_;
  std::vector<int> class_of_;  // the probe's queue class of each of streams_
  int run_class_ = -1;
  cudaStream_t waiting_ = nullptr, run_ = nullptr, side_ = nullptr;
  uint64_t* gate_ = nullptr;
  uint64_t epoch_ = 0;
};

TEST_P(GpuFusedBesideAWaitTest, EveryStepOfAFusedCallRunsBesideAStreamWaitingOnAnotherQueue) {
  if (IsSkipped()) return;
  const absl::Status warm = Bf16Gemm::WarmUp();
  ASSERT_TRUE(warm.ok()) << warm;
  ASSERT_NO_FATAL_FAILURE(MakeStreamsAndGate());
  if (IsSkipped()) return;
  const cudaStream_t run = run_, side = side_;

  // What the call writes into, made before any wait (freeing device memory can wait for the
  // whole device, so it is freed after the last wait ended).
  DeviceBuffer slot(static_cast<size_t>(SlotElems()) * sizeof(uint16_t));
  DeviceBuffer cancel(std::vector<uint64_t>{0});
  DeviceBuffer scratch(static_cast<size_t>(Elems()) * sizeof(uint16_t));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::unique_ptr<FusedQkvPlan> plan;
  void* outs[1] = {slot.as<void>()};
  const QkvDestinations dests{outs, nullptr, kEpoch, cancel.as<uint64_t>()};
  const int32_t* pos = positions_[0]->as<int32_t>();
  const void* x = x_[0]->as<void>();
  // Row counts this plan has not seen: each a first GEMM of the plan at that count (cuBLASLt's
  // picks are the process's: another case of the shape may have asked for them before).
  const std::vector<int64_t> more = {1, Rows() / 3 + 1, Rows() - 1};
  const int64_t plan_chunk_rows = FusedChunkRows(Rows(), 0);  // the plans' chunk_rows are 0
  const Steps steps = {
      {"memset (the control)",
       [&] {
         return cudaMemsetAsync(slot.as<void>(), 0, 256, run) == cudaSuccess
                    ? absl::OkStatus()
                    : absl::InternalError("cudaMemsetAsync");
       }},
      {"FusedQkvPlan::Create",
       [&] {
         plan = MakePlan(0, QkvLayout::kBshd, 0, false, side);
         return plan != nullptr ? absl::OkStatus()
                                : absl::InternalError("no plan (the failure is above)");
       }},
      {"Prepare", [&] { return plan->Prepare(Rows()); }},
      {"Prepare at row counts not seen before",
       [&]() -> absl::Status {
         for (int64_t r : more) ULY_RETURN_IF_ERROR(plan->Prepare(r));
         return absl::OkStatus();
       }},
      {"an algorithm query (a row count no GEMM of the process asked for)",
       [&]() -> absl::Status {
         const size_t before = Bf16Gemm::algorithm_queries();
         // No workspace: nothing to free (cudaFree can wait for the whole device).
         std::unique_ptr<Bf16Gemm> gemm;
         ULY_ASSIGN_OR_RETURN(gemm, Bf16Gemm::Create(QkvFeatures(shape_), QkvHidden(shape_), 0));
         ULY_RETURN_IF_ERROR(gemm->Prepare(FreshRowCount()));
         return Bf16Gemm::algorithm_queries() > before
                    ? absl::OkStatus()
                    : absl::InternalError("no cuBLASLt query was made");
       }},
      {"a second plan, made while the first holds the pool's handle (a new cuBLASLt handle)",
       [&] {
         std::unique_ptr<FusedQkvPlan> second = MakePlan(0, QkvLayout::kBshd, 0, false, side);
         return second != nullptr ? absl::OkStatus()
                                  : absl::InternalError("no plan (the failure is above)");
       }},
      {"projection (cuBLASLt GEMM)", [&] { return plan->RunProjection(x, Rows(), run); }, true},
      {"projection again (the same row count)",
       [&] { return plan->RunProjection(x, Rows(), run); }},
      {"projection at 1 row", [&] { return plan->RunProjection(x, more[0], run); }, true},
      {"projection at a third of the rows, plus one",
       [&] { return plan->RunProjection(x, more[1], run); }, true},
      {"projection at one row fewer", [&] { return plan->RunProjection(x, more[2], run); },
       true},
      {"a GEMM object of its own, the plan's shape, first launch",
       [&]() -> absl::Status {
         // Its workspace is allocated, and freed as it goes, on `run`: after its GEMM.
         ULY_ASSIGN_OR_RETURN(std::unique_ptr<Bf16Gemm> gemm,
                              Bf16Gemm::Create(QkvFeatures(shape_), QkvHidden(shape_),
                                               Bf16Gemm::kDefaultWorkspaceBytes, run));
         ULY_RETURN_IF_ERROR(gemm->Prepare(Rows()));
         return gemm->Run(x, w_qkv_->as<void>(), scratch.as<void>(), Rows(), run);
       }},
      {"norm + RoPE", [&] { return plan->RunNormRope(x, pos, 1, Rows(), run); }},
      {"per_operator call",
       [&] { return plan->RunPerOperator(x, pos, 1, Rows(), dests, run); }},
      // Its chunks' GEMMs are first launches at the chunk's row counts (unless one chunk).
      {"chunked call", [&] { return plan->RunChunked(x, pos, 1, Rows(), dests, run); },
       plan_chunk_rows != Rows()},
      {"epilogue call",
       [&] {
         return plan->EpilogueUnavailable().empty()
                    ? plan->RunEpilogue(x, pos, 1, Rows(), dests, run)
                    : absl::OkStatus();
       }},
      {"the plan's end", [&] {
         plan.reset();
         return absl::OkStatus();
       }}};

  RunBesideAWait(steps);
  plan.reset();  // a step that failed left it made
}

// A plan whose GEMMs' kernels were loaded (LoadKernels, as a daemon does when a session opens)
// before any wait: its calls run beside a waiting stream on every path, at the loaded row
// count, at row counts it never ran and with x less aligned. (Cases run before it in the same
// process may have loaded some of the same kernels, which are shared between shapes; what is
// asserted is that after its own load none of its calls waits.)
class GpuFusedLoadedBesideAWaitTest : public GpuFusedBesideAWaitTest {
 protected:
  void SetUp() override {
    Init(QkvNormRopeShape{1, 6, kFusedGpuHeadDim, 1000, 1, 1000}, 3001);
  }

  // What the calls read and write, made (and synchronized) before any wait: the slot, the
  // cancel word, x and x 16 bytes off a 256-byte boundary, the positions.
  struct CallBuffers {
    explicit CallBuffers(GpuFusedLoadedBesideAWaitTest& t)
        : slot(static_cast<size_t>(t.SlotElems()) * sizeof(uint16_t)),
          cancel(std::vector<uint64_t>{0}),
          shifted(t.MakeShiftedX()),
          outs{slot.as<void>()},
          dests{outs, nullptr, kEpoch, cancel.as<uint64_t>()},
          pos(t.positions_[0]->as<int32_t>()),
          x(t.x_[0]->as<void>()),
          x16(ShiftedX(*shifted)) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    DeviceBuffer slot, cancel;
    std::unique_ptr<DeviceBuffer> shifted;
    void* outs[1];
    QkvDestinations dests;
    const int32_t* pos;
    const void* x;
    const void* x16;
  };

  // A plan's calls on every path at its max_tokens, at row counts it never ran, and with x
  // 16 bytes off a 256-byte boundary. Under MPS the chunked calls (two chunks or more, on two
  // streams ordered by events) are reported, not asserted: such calls waited for the other
  // stream's wait now and then (H100, 2026-12-05 and 2026-12-06), which is why the daemon's
  // auto rule never takes that path (docs/architecture.md, section 6.2). Without MPS they
  // never waited, and are asserted.
  Steps PlanCalls(FusedQkvPlan& plan, const CallBuffers& b) {
    // Each step keeps what it calls with (b and the plan outlive the steps).
    const QkvDestinations dests = b.dests;
    const int32_t* pos = b.pos;
    const void* x = b.x;
    const void* x16 = b.x16;
    const cudaStream_t run = run_;
    const int64_t rows = Rows();
    FusedQkvPlan* p = &plan;
    auto per_operator = [=](const void* in, int64_t r) {
      return [=] { return p->RunPerOperator(in, pos, 1, r, dests, run); };
    };
    auto chunked = [=](const void* in, int64_t r) {
      return [=] { return p->RunChunked(in, pos, 1, r, dests, run); };
    };
    const bool mps = UnderMps();
    return Steps{
        {"per_operator call", per_operator(x, rows)},
        {"chunked call", chunked(x, rows), false, mps},
        {"epilogue call",
         [=] {
           return p->EpilogueUnavailable().empty() ? p->RunEpilogue(x, pos, 1, rows, dests, run)
                                                   : absl::OkStatus();
         }},
        // Row counts and an alignment the plan never ran.
        {"per_operator call at 1 row", per_operator(x, 1)},
        {"per_operator call at 333 rows", per_operator(x, 333)},
        {"chunked call at 777 rows", chunked(x, 777), false, mps},
        {"chunked call at 999 rows", chunked(x, 999), false, mps},
        {"per_operator call, x aligned to 16 bytes", per_operator(x16, rows)},
        {"chunked call at 555 rows, x aligned to 16 bytes", chunked(x16, 555), false, mps}};
  }
};

TEST_F(GpuFusedLoadedBesideAWaitTest, ALoadedPlansCallsRunBesideAStreamWaitingOnAnotherQueue) {
  if (IsSkipped()) return;
  ASSERT_NO_FATAL_FAILURE(MakeStreamsAndGate());
  if (IsSkipped()) return;
  std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0, false, side_);
  ASSERT_NE(plan, nullptr);
  const auto load_start = std::chrono::steady_clock::now();
  ASSERT_TRUE(plan->LoadKernels(Rows(), FusedPath::kAuto, run_).ok());
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::cout << "LoadKernels up to " << Rows() << " rows: " << plan->loaded_gemm_kernels()
            << " cuBLASLt kernels, "
            << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                         load_start)
                   .count()
            << " ms with the wait for them\n";
  const CallBuffers b(*this);
  RunBesideAWait(PlanCalls(*plan, b));
  EXPECT_EQ(plan->unloaded_gemm_launches(), 0u);
  plan.reset();
}

// A plan that projects on the epilogue path's CUTLASS GEMM loads nothing: its kernels load with
// this library's module (eagerly in this program, as in the daemon), so its calls run beside a
// waiting stream at any row count and alignment without a LoadKernels.
TEST_F(GpuFusedLoadedBesideAWaitTest, ACutlassProjectingPlansCallsRunBesideAWaitWithoutALoad) {
  if (IsSkipped()) return;
  ASSERT_NO_FATAL_FAILURE(MakeStreamsAndGate());
  if (IsSkipped()) return;
  if (!EpilogueRuns()) GTEST_SKIP() << "no epilogue GEMM in this build or on this device";
  cutlass_projection_ = true;
  std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0, false, side_);
  cutlass_projection_ = false;
  ASSERT_NE(plan, nullptr);
  const CallBuffers b(*this);
  RunBesideAWait(PlanCalls(*plan, b));
  EXPECT_EQ(plan->cublaslt_runs(), 0u) << "a call ran a cuBLASLt GEMM";
  plan.reset();
}

// How work on a second stream is ordered after the caller's stream, beside a stream waiting on
// another hardware queue: by an event, by stream memory operations, each with the second stream
// on the caller's queue and on a third one; then the chunked call with its second stream on
// the caller's queue, on a third queue, and the caller's stream itself. Under MPS the chunked
// call's GPU work was held back by such a wait while the per-operator call's was not (H100,
// 5b97e23). Every single ordering by event must end in time; those by stream memory operations,
// which no path uses for this, are reported, to show what the platform does (under MPS they
// waited, H200 and H100), and so are the chunked calls under MPS, which waited now and then
// on an H100 (2026-12-06), with the second stream on the caller's queue in one run and on a
// third queue in another: the daemon's auto rule never takes that path. Without MPS they are
// asserted.
class GpuSecondStreamBesideAWaitTest : public GpuFusedLoadedBesideAWaitTest {};

TEST_F(GpuSecondStreamBesideAWaitTest, EveryWayOfOrderingASecondStreamRunsBesideAWait) {
  if (IsSkipped()) return;
  ASSERT_NO_FATAL_FAILURE(MakeStreamsAndGate());
  if (IsSkipped()) return;
  cudaStream_t same = nullptr, other = nullptr;
  for (size_t i = 1; i < streams_.size(); ++i) {
    if (streams_[i] == run_ || class_of_[i] == class_of_[0]) continue;
    if (class_of_[i] == run_class_) {
      if (same == nullptr) same = streams_[i];
    } else if (other == nullptr) {
      other = streams_[i];
    }
  }
  // Plans whose second stream is on the caller's queue, on a third queue, and the caller's
  // stream itself: projecting on loaded cuBLASLt kernels, and also on the CUTLASS GEMM where
  // the epilogue GEMM runs (no cuBLASLt kernel to load), so that each ordering is seen after
  // either GEMM.
  struct SidePlan {
    std::string queue;  // where the second stream is
    std::string gemm;   // the projection's
    cudaStream_t side;
    std::unique_ptr<FusedQkvPlan> plan;
    std::string where() const { return queue + " (" + gemm + " projection)"; }
  };
  std::vector<SidePlan> plans;
  std::vector<bool> projections = {false};
  if (EpilogueRuns()) projections.push_back(true);
  for (const bool cutlass : projections) {
    const std::string gemm = cutlass ? "CUTLASS" : "cuBLASLt";
    for (auto [where, side] : {std::pair<const char*, cudaStream_t>{"the caller's queue", same},
                               {"a third queue", other},
                               {"the caller's stream", run_}}) {
      if (side == nullptr) {
        std::cout << "no second stream on " << where << " among the probed streams\n";
        continue;
      }
      cutlass_projection_ = cutlass;
      std::unique_ptr<FusedQkvPlan> plan = MakePlan(0, QkvLayout::kBshd, 0, false, side);
      cutlass_projection_ = false;
      ASSERT_NE(plan, nullptr);
      if (!cutlass) {
        ASSERT_TRUE(plan->LoadKernels(Rows(), FusedPath::kAuto, run_).ok());
      }
      plans.push_back(SidePlan{where, gemm, side, std::move(plan)});
    }
  }
  const CallBuffers b(*this);
  DeviceBuffer a(1 << 20), c(1 << 20);
  DeviceBuffer word(std::vector<uint64_t>{0});
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  auto cuda = [](cudaError_t e, const char* what) {
    return e == cudaSuccess ? absl::OkStatus()
                            : absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  };
  auto memset = [&](const DeviceBuffer& buf, cudaStream_t s) {
    return cuda(cudaMemsetAsync(buf.as<void>(), 0, buf.bytes(), s), "cudaMemsetAsync");
  };
  auto by_event = [&](cudaStream_t from, cudaStream_t to) -> absl::Status {
    ULY_RETURN_IF_ERROR(cuda(cudaEventRecord(event, from), "cudaEventRecord"));
    return cuda(cudaStreamWaitEvent(to, event, 0), "cudaStreamWaitEvent");
  };
  uint64_t mark = 0;
  auto by_memop = [&](cudaStream_t from, cudaStream_t to) -> absl::Status {
    ++mark;
    ULY_RETURN_IF_ERROR(ipc::cuda::StreamWrite64(from, word.as<uint64_t>(), mark));
    return ipc::cuda::StreamWait64(to, word.as<uint64_t>(), mark);
  };
  const cudaStream_t run = run_;
  Steps steps = {{"memset on the caller's stream", [&] { return memset(a, run); }}};
  std::set<cudaStream_t> seen;  // the steps without a plan run once per second stream
  for (const SidePlan& p : plans) {
    const cudaStream_t side = p.side;
    if (side == run) continue;
    if (seen.insert(side).second) {
      steps.push_back({"memset on a stream on " + p.queue, [&, side] { return memset(c, side); }});
      steps.push_back({"memset, event, memset on " + p.queue,
                       [&, side]() -> absl::Status {
                         ULY_RETURN_IF_ERROR(memset(a, run));
                         ULY_RETURN_IF_ERROR(by_event(run, side));
                         return memset(c, side);
                       }});
      steps.push_back({"memset on " + p.queue + ", event back, memset",
                       [&, side]() -> absl::Status {
                         ULY_RETURN_IF_ERROR(memset(c, side));
                         ULY_RETURN_IF_ERROR(by_event(side, run));
                         return memset(a, run);
                       }});
      steps.push_back({"memset, stream memory ops, memset on " + p.queue,
                       [&, side]() -> absl::Status {
                         ULY_RETURN_IF_ERROR(memset(a, run));
                         ULY_RETURN_IF_ERROR(by_memop(run, side));
                         return memset(c, side);
                       },
                       false, true});
    }
    steps.push_back({"projection, event, memset on " + p.where(),
                     [&, side, plan = p.plan.get()]() -> absl::Status {
                       ULY_RETURN_IF_ERROR(plan->RunProjection(b.x, Rows(), run));
                       ULY_RETURN_IF_ERROR(by_event(run, side));
                       return memset(c, side);
                     }});
    steps.push_back({"projection, stream memory ops, memset on " + p.where(),
                     [&, side, plan = p.plan.get()]() -> absl::Status {
                       ULY_RETURN_IF_ERROR(plan->RunProjection(b.x, Rows(), run));
                       ULY_RETURN_IF_ERROR(by_memop(run, side));
                       return memset(c, side);
                     },
                     false, true});
  }
  for (const SidePlan& p : plans) {
    FusedQkvPlan* plan = p.plan.get();
    steps.push_back({"per_operator call, second stream " + p.where(), [&, plan] {
                       return plan->RunPerOperator(b.x, b.pos, 1, Rows(), b.dests, run);
                     }});
    steps.push_back({"chunked call, second stream " + p.where(),
                     [&, plan] { return plan->RunChunked(b.x, b.pos, 1, Rows(), b.dests, run); },
                     false, UnderMps()});
  }
  std::cout << "queue classes of the 8 streams:";
  for (int k : class_of_) std::cout << " " << k;
  std::cout << "\n";
  RunBesideAWait(steps);
  plans.clear();
  cudaEventDestroy(event);
}

INSTANTIATE_TEST_SUITE_P(Rows, GpuFusedBesideAWaitTest, ::testing::Values(16, 2048),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "rows" + std::to_string(info.param);
                         });

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto [hidden, world, batch, seq_local] = info.param;
  std::string name = "hidden" + std::to_string(hidden) + "_W" + std::to_string(world);
  if (batch != kBatch || seq_local != kSeqLocal)
    name += "_B" + std::to_string(batch) + "_Sl" + std::to_string(seq_local);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuFusedQkvTest,
                         ::testing::Combine(::testing::Values(512, 3072, 4096, 6144, 8192),
                                            ::testing::Values(1, 2, 4), ::testing::Values(kBatch),
                                            ::testing::Values(kSeqLocal)),
                         ParamName);

// Shards shorter than the 8 rows between a thread's rows in the epilogue (and than a 128-row
// tile): every tile crosses batch boundaries, many of them, so each row's destination token
// depends on the row's batch being found right.
INSTANTIATE_TEST_SUITE_P(ShortShards, GpuFusedQkvTest,
                         ::testing::Combine(::testing::Values(512), ::testing::Values(1, 2, 4),
                                            ::testing::Values(int64_t{40}),
                                            ::testing::Values(int64_t{5})),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(OddShards, GpuFusedQkvTest,
                         ::testing::Values(Param{512, 2, 3, 67}, Param{1024, 4, 25, 9},
                                           Param{384, 3, 2, 75}),
                         ParamName);

}  // namespace
}  // namespace ulysses::kernels
