// ulysses-fused-bench: one rank's fused QKV call (projection + QK-RMSNorm + RoPE + stores into
// the W destinations' slots) on one GPU, with the W-rank geometry and all W destination slots
// on this GPU, against the per-operator path and the cuBLASLt GEMM alone (DESIGN.md section 8).
//
// Per grid row (W, hidden, S_global; B = 1, bf16, D = 128) the rank projects
// [S_global / W, hidden] x [hidden, 3 * hidden]. Variants, all on the same inputs and slots:
//   fused_chunked   FusedQkvPlan::RunChunked (path 4a)
//   fused_epilogue  FusedQkvPlan::RunEpilogue (path 4b; where the build and device have it)
//   per_operator    FusedQkvPlan::RunPerOperator (GEMM, norm+RoPE, scatter)
//   gemm            the same cuBLASLt GEMM alone (the floor)
//   epilogue_gemm   the epilogue path's CUTLASS GEMM with its epilogue skipped (its own floor)
//   control         fused_chunked again, as an A/A control
//   chunked_cutlass, per_operator_cutlass (--cutlass-projection) the two paths projecting on
//                   the epilogue path's CUTLASS GEMM (FusedQkvConfig::cutlass_projection)
// --readiness none (the default) runs the paths as the daemon does, without per-chunk readiness
// words; --readiness words makes every chunk publish them too (the runs before 2026-12-04).
// Method: outputs of both paths checked against the CPU reference on sampled tokens before
// timing; warm-up; CUDA events around each sample, the L2 flushed before it (a 256 MiB memset);
// rounds visit the variants in A/B/B/A order (forward, then reversed); the median of all samples
// per variant. The A/A ratio control / fused_chunked should be 1 within about 1%.
//
// --pinning-rows R,... measures instead what a fused session's pinned GEMM costs: per hidden, a
// GEMM loaded as a session of --pinning-max-rows rows loads it (Bf16Gemm::Load of the
// per-operator path's FusedGemmLoadRowCounts and FusedGemmEveryRowLoadRows, the latter
// replaced by --pinning-every-row-rows where given), which at a row count whose own algorithm
// it did not load runs a loaded one, against a GEMM of cuBLASLt's own pick, at each R; the same
// method, an A/A control of the own pick twice, both outputs checked on sampled rows. Its
// "loads" time the load (with its algorithm queries) and a second GEMM's load of the same
// shape, which finds cuBLASLt's picks kept by the process.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/fused.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/kernels/exchange_cuda.h"
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/gemm.h"
#include "ulysses/kernels/qkv_norm_rope.h"

#include "ulysses_git_commit.h"  // ULYSSES_GIT_COMMIT, written at build time

namespace ulysses::bench {
namespace {

using Json = nlohmann::ordered_json;
using kernels::QkvNormRopeShape;

constexpr int32_t kDim = kFusedGpuHeadDim;
constexpr size_t kFlushBytes = size_t{256} << 20;  // > the H200's 60 MiB L2

#define BENCH_CUDA(call)                                                               \
  do {                                                                                 \
    const cudaError_t bench_err_ = (call);                                             \
    if (bench_err_ != cudaSuccess)                                                     \
      return absl::InternalError(StrCat(#call, ": ", cudaGetErrorString(bench_err_))); \
  } while (0)

// Device memory freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(size_t bytes) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    BENCH_CUDA(cudaMalloc(&ptr_, bytes));
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status Upload(const std::vector<T>& host) {
    ULY_RETURN_IF_ERROR(Allocate(host.size() * sizeof(T)));
    BENCH_CUDA(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  template <typename T = void>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

class Events {
 public:
  Events() {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~Events() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t start() const { return start_; }
  cudaEvent_t stop() const { return stop_; }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Fast deterministic bf16 fill: U(-scale, scale) from a 64-bit xorshift.
std::vector<uint16_t> RandomBf16(size_t n, float scale, uint64_t seed) {
  std::vector<uint16_t> out(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : out) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    v = kernels::FloatToBf16((2.0f * u - 1.0f) * scale);
  }
  return out;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Options {
  std::vector<int32_t> worlds{2, 4, 8};
  std::vector<int32_t> hiddens{3072, 4096, 6144, 8192};
  std::vector<int64_t> s_globals{4096, 8192, 16384, 32768, 65536, 131072};
  std::string layout = "bshd";
  int rounds = 5, samples = 10, warmup = 3;
  int64_t chunk_rows = 0;
  int32_t push_blocks = 0;
  std::string epilogue_schedule = "auto";
  // "none": the paths store without readiness words, as the daemon runs them (its stream
  // protocol announces the whole call); "words": every chunk also publishes its readiness word
  // per destination, for a consumer that reads chunk by chunk (the runs before 2026-12-04).
  std::string readiness = "none";
  bool cutlass_projection = false;
  std::vector<int64_t> pinning_rows;
  int64_t pinning_max_rows = 16384;
  int64_t pinning_every_row_rows = -1;  // -1: FusedGemmEveryRowLoadRows
  std::string json_path;
  std::string mps = "auto";
  std::string commit = ULYSSES_GIT_COMMIT;
};

// The session-wide data of one hidden size: host copies (for the check) and device copies.
struct HiddenData {
  int32_t hidden = 0;
  int64_t max_rows = 0;
  int64_t max_pos = 0;
  std::vector<uint16_t> x, w_qkv, q_norm, k_norm;
  std::vector<float> cos_sin;
  DeviceBuffer d_x, d_w, d_qn, d_kn, d_cs, slots, flush;

  absl::Status Make(int32_t h, int64_t rows, int64_t positions) {
    hidden = h;
    max_rows = rows;
    max_pos = positions;
    x = RandomBf16(static_cast<size_t>(rows * h), 1.0f, 1 + h);
    w_qkv = RandomBf16(static_cast<size_t>(3 * int64_t{h} * h), std::sqrt(3.0f / h), 2 + h);
    q_norm = RandomBf16(kDim, 0.5f, 3);
    k_norm = RandomBf16(kDim, 0.5f, 4);
    for (auto* w : {&q_norm, &k_norm})
      for (auto& v : *w) v = kernels::FloatToBf16(1.0f + kernels::Bf16ToFloat(v));
    cos_sin.resize(static_cast<size_t>(positions * kDim));
    for (int64_t p = 0; p < positions; ++p) {
      for (int i = 0; i < kDim / 2; ++i) {
        const double theta = static_cast<double>(p) * std::pow(10000.0, -2.0 * i / kDim);
        cos_sin[p * kDim + i] = static_cast<float>(std::cos(theta));
        cos_sin[p * kDim + kDim / 2 + i] = static_cast<float>(std::sin(theta));
      }
    }
    ULY_RETURN_IF_ERROR(d_x.Upload(x));
    ULY_RETURN_IF_ERROR(d_w.Upload(w_qkv));
    ULY_RETURN_IF_ERROR(d_qn.Upload(q_norm));
    ULY_RETURN_IF_ERROR(d_kn.Upload(k_norm));
    ULY_RETURN_IF_ERROR(d_cs.Upload(cos_sin));
    // All W destination slots of any row of the grid: W * 3 * (S_g / W) * hidden elements.
    ULY_RETURN_IF_ERROR(slots.Allocate(static_cast<size_t>(3 * positions * h) * 2));
    return flush.Allocate(kFlushBytes);
  }
  kernels::QkvWeights weights() const { return {d_w.as(), d_qn.as(), d_kn.as(), d_cs.as<float>()}; }
};

// Sampled tokens of the call against the CPU reference; returns the worst verdict as text and
// fills the counts. Reads the W slots through small device-to-host copies.
absl::StatusOr<std::string> CheckCall(const HiddenData& data, const QkvNormRopeShape& shape,
                                      QkvLayout layout, int rank, const std::vector<void*>& slots,
                                      const std::vector<int32_t>& positions) {
  const int64_t rows = kernels::QkvRows(shape), hd = kernels::QkvHidden(shape);
  const int64_t features = kernels::QkvFeatures(shape), hl = kernels::QkvLocalHeads(shape);
  int64_t flips = 0, mismatches = 0, elements = 0;
  std::string where;  // "t=<token>: q n k n v n" for each sampled token beyond tolerance
  std::vector<uint16_t> want(static_cast<size_t>(features)), got(kDim);
  const kernels::QkvWeights host_w{data.w_qkv.data(), data.q_norm.data(), data.k_norm.data(),
                                   data.cos_sin.data()};
  for (int i = 0; i < 8; ++i) {
    const int64_t t = i == 7 ? rows - 1 : rows * i / 7;
    kernels::QkvProjectRef(data.x.data() + t * hd, data.w_qkv.data(), hd, features, 0, 1,
                           want.data());
    QkvNormRopeShape one = shape;
    one.batch = 1, one.seq_local = 1;
    kernels::NormRopeRef(one, host_w, positions.data() + t, 0, 1, want.data());
    int64_t by_plane[3] = {0, 0, 0};
    for (int plane = 0; plane < 3; ++plane) {
      for (int64_t g = 0; g < shape.heads; ++g) {
        const int64_t dst = g / hl, h = g % hl;
        const int64_t at =
            kernels::QkvDestOffset(shape, layout, 0, rank * shape.seq_local + t, h, plane, 0);
        BENCH_CUDA(cudaMemcpy(got.data(), static_cast<const uint16_t*>(slots[dst]) + at, kDim * 2,
                              cudaMemcpyDeviceToHost));
        for (int d = 0; d < kDim; ++d) {
          const uint16_t a = got[d], b = want[plane * hd + g * kDim + d];
          ++elements;
          if (a == b) continue;
          const float fa = kernels::Bf16ToFloat(a), fb = kernels::Bf16ToFloat(b);
          const bool one_ulp =
              (a & 0x8000) == (b & 0x8000) && std::abs((a & 0x7fff) - (b & 0x7fff)) == 1;
          if (one_ulp) {
            ++flips;
          } else if (!(std::fabs(fa - fb) <= 1e-2f + 1e-2f * std::fabs(fb))) {
            ++mismatches;
            ++by_plane[plane];
          }
        }
      }
    }
    if (by_plane[0] + by_plane[1] + by_plane[2] > 0) {
      where += StrCat(where.empty() ? "" : "; ", "t=", t, ": q ", by_plane[0], " k ", by_plane[1],
                      " v ", by_plane[2]);
    }
  }
  // A mismatch allowed per 10^4 checked elements: GEMM rounding carried through a cancellation.
  const bool pass = mismatches * 10000 <= elements;
  return StrCat(pass ? "pass" : "FAIL", " (", elements, " elements, ", flips, " one-ulp flips, ",
                mismatches, " beyond tolerance", where.empty() ? "" : StrCat(" at ", where), ")");
}

struct Variant {
  std::string name;
  std::function<absl::Status(cudaStream_t)> run;
  std::vector<double> ms;
};

absl::Status Sample(Variant& v, const HiddenData& data, const Events& ev, cudaStream_t stream) {
  BENCH_CUDA(cudaMemsetAsync(data.flush.as(), 0, kFlushBytes, stream));
  BENCH_CUDA(cudaEventRecord(ev.start(), stream));
  ULY_RETURN_IF_ERROR(v.run(stream));
  BENCH_CUDA(cudaEventRecord(ev.stop(), stream));
  BENCH_CUDA(cudaEventSynchronize(ev.stop()));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, ev.start(), ev.stop()));
  v.ms.push_back(ms);
  return absl::OkStatus();
}

// Warm-up, then opt.rounds rounds visiting the variants in A/B/B/A order, opt.samples each.
absl::Status SampleAll(const Options& opt, const HiddenData& data, std::vector<Variant>& variants,
                       cudaStream_t stream) {
  Events ev;
  for (Variant& v : variants) {
    for (int i = 0; i < opt.warmup; ++i) ULY_RETURN_IF_ERROR(v.run(stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  for (int round = 0; round < opt.rounds; ++round) {
    for (size_t i = 0; i < variants.size(); ++i) {
      Variant& v = variants[round % 2 == 0 ? i : variants.size() - 1 - i];
      for (int s = 0; s < opt.samples; ++s) ULY_RETURN_IF_ERROR(Sample(v, data, ev, stream));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Json> RunRow(const Options& opt, HiddenData& data, int32_t world, int64_t s_global,
                            QkvLayout layout, cudaStream_t stream) {
  const int32_t heads = data.hidden / kDim;
  const int64_t rows = s_global / world;
  const int rank = 0;
  const QkvNormRopeShape shape{world, heads, kDim, static_cast<int32_t>(data.max_pos), 1, rows};
  kernels::FusedQkvConfig c;
  c.world = world;
  c.rank = rank;
  c.heads = heads;
  c.max_pos = static_cast<int32_t>(data.max_pos);
  c.layout = layout;
  c.max_tokens = rows;
  c.weights = data.weights();
  c.chunk_rows = opt.chunk_rows;
  c.push_blocks = opt.push_blocks;
  using kernels::EpilogueSchedule;
  c.epilogue_schedule = EpilogueSchedule::kAuto;
  for (int i = 0; i < kernels::kEpilogueSchedules; ++i) {
    const auto schedule = static_cast<EpilogueSchedule>(i + 1);
    if (opt.epilogue_schedule == kernels::EpilogueScheduleName(schedule))
      c.epilogue_schedule = schedule;
  }
  ULY_ASSIGN_OR_RETURN(std::unique_ptr<kernels::FusedQkvPlan> plan,
                       kernels::FusedQkvPlan::Create(c));
  ULY_RETURN_IF_ERROR(plan->Prepare(rows));
  const bool have_epilogue = plan->EpilogueUnavailable().empty();
  // The same paths projecting on the epilogue path's CUTLASS GEMM (--cutlass-projection).
  std::unique_ptr<kernels::FusedQkvPlan> cutlass;
  if (opt.cutlass_projection && have_epilogue) {
    c.cutlass_projection = true;
    ULY_ASSIGN_OR_RETURN(cutlass, kernels::FusedQkvPlan::Create(c));
  }
  // Positions of a contiguous sequence shard: rank * S_l + s.
  std::vector<int32_t> positions(static_cast<size_t>(rows));
  for (int64_t s = 0; s < rows; ++s) positions[s] = static_cast<int32_t>(rank * rows + s);
  DeviceBuffer d_pos, words;
  ULY_RETURN_IF_ERROR(d_pos.Upload(positions));
  ULY_RETURN_IF_ERROR(words.Allocate(size_t{8} * world * kernels::kMaxFusedChunks));
  BENCH_CUDA(cudaMemset(words.as(), 0, size_t{8} * world * kernels::kMaxFusedChunks));
  // The pageable uploads above may still be in flight on the legacy stream when cudaMemcpy
  // returns; the calls run on non-blocking streams.
  BENCH_CUDA(cudaDeviceSynchronize());
  const int64_t slot_elems = 3 * kernels::QkvPlaneElems(shape);
  std::vector<void*> slots;
  std::vector<uint64_t*> ready;
  for (int d = 0; d < world; ++d) {
    slots.push_back(data.slots.as<uint16_t>() + d * slot_elems);
    ready.push_back(words.as<uint64_t>() + d * kernels::kMaxFusedChunks);
  }
  uint64_t epoch = 0;
  uint64_t* const* words_or_none = opt.readiness == "words" ? ready.data() : nullptr;
  const void* x = data.d_x.as();
  const int32_t* pos = d_pos.as<int32_t>();
  auto chunked = [&](cudaStream_t s) {
    return plan->RunChunked(x, pos, 1, rows, {slots.data(), words_or_none, ++epoch}, s);
  };
  auto per_operator = [&](cudaStream_t s) {
    return plan->RunPerOperator(x, pos, 1, rows, {slots.data(), words_or_none, ++epoch}, s);
  };
  auto epilogue = [&](cudaStream_t s) {
    return plan->RunEpilogue(x, pos, 1, rows, {slots.data(), words_or_none, ++epoch}, s);
  };
  auto gemm = [&](cudaStream_t s) { return plan->RunProjection(x, rows, s); };
  auto epilogue_gemm = [&](cudaStream_t s) { return plan->RunEpilogueGemmAlone(x, rows, s); };
  auto chunked_cutlass = [&](cudaStream_t s) {
    return cutlass->RunChunked(x, pos, 1, rows, {slots.data(), words_or_none, ++epoch}, s);
  };
  auto per_operator_cutlass = [&](cudaStream_t s) {
    return cutlass->RunPerOperator(x, pos, 1, rows, {slots.data(), words_or_none, ++epoch}, s);
  };

  // Outputs before timing: each path into freshly poisoned slots, then the sampled check. The
  // poison goes on the call's stream: a memset on the legacy stream would not be ordered
  // before the call's work on these non-blocking streams.
  // chunked, per-operator, epilogue, then the CUTLASS-projected chunked and per-operator.
  const std::vector<std::function<absl::Status(cudaStream_t)>> checked = {
      chunked, per_operator, epilogue, chunked_cutlass, per_operator_cutlass};
  std::string checks[5];
  for (int path = 0; path < 5; ++path) {
    if ((path == 2 && !have_epilogue) || (path >= 3 && cutlass == nullptr)) continue;
    BENCH_CUDA(cudaMemsetAsync(data.slots.as(), 0xff, size_t(slot_elems) * world * 2, stream));
    ULY_RETURN_IF_ERROR(checked[path](stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    ULY_ASSIGN_OR_RETURN(checks[path], CheckCall(data, shape, layout, rank, slots, positions));
  }

  std::vector<Variant> variants = {
      {"fused_chunked", chunked, {}},
      {"per_operator", per_operator, {}},
      {"gemm", gemm, {}},
      {"control", chunked, {}},
  };
  if (have_epilogue) {
    variants.insert(variants.begin() + 1, {"fused_epilogue", epilogue, {}});
    variants.insert(variants.begin() + 4, {"epilogue_gemm", epilogue_gemm, {}});
  }
  if (cutlass != nullptr) {
    variants.insert(variants.end() - 1, {"chunked_cutlass", chunked_cutlass, {}});
    variants.insert(variants.end() - 1, {"per_operator_cutlass", per_operator_cutlass, {}});
  }
  auto median_of = [&](const char* name) {
    for (const Variant& v : variants)
      if (v.name == name) return Median(v.ms);
    return 0.0;
  };
  ULY_RETURN_IF_ERROR(SampleAll(opt, data, variants, stream));
  const double chunked_ms = median_of("fused_chunked"), per_op_ms = median_of("per_operator");
  const double gemm_ms = median_of("gemm"), control_ms = median_of("control");
  const double epilogue_ms = median_of("fused_epilogue");
  const double flops = 2.0 * rows * 3.0 * data.hidden * data.hidden;
  auto r4 = [](double v) { return std::round(v * 1e4) / 1e4; };
  Json row;
  row["world_size"] = world;
  row["hidden"] = data.hidden;
  row["s_global"] = s_global;
  row["rows"] = rows;
  row["fused_chunked_ms"] = r4(chunked_ms);
  if (have_epilogue) {
    row["fused_epilogue_ms"] = r4(epilogue_ms);
    row["epilogue_over_gemm"] = r4(epilogue_ms / gemm_ms);
    row["epilogue_over_per_operator"] = r4(epilogue_ms / per_op_ms);
    row["epilogue_gemm_ms"] = r4(median_of("epilogue_gemm"));
    row["check_epilogue"] = checks[2];
  } else {
    row["fused_epilogue_ms"] = nullptr;
    row["epilogue_unavailable"] = plan->EpilogueUnavailable();
  }
  row["per_operator_ms"] = r4(per_op_ms);
  row["gemm_ms"] = r4(gemm_ms);
  row["gemm_tflops"] = std::round(flops / (gemm_ms * 1e-3) / 1e12 * 10) / 10;
  row["chunked_over_gemm"] = r4(chunked_ms / gemm_ms);
  row["chunked_over_per_operator"] = r4(chunked_ms / per_op_ms);
  row["aa_control"] = r4(control_ms / chunked_ms);
  row["chunks"] = plan->NumChunks(rows);
  row["chunk_rows"] = plan->ChunkRows(rows);
  row["check_chunked"] = checks[0];
  row["check_per_operator"] = checks[1];
  if (opt.cutlass_projection && cutlass == nullptr)
    row["cutlass_projection_unavailable"] = plan->EpilogueUnavailable();
  if (cutlass != nullptr) {
    row["plan_cutlass"] = cutlass->Describe(rows);
    row["chunked_cutlass_ms"] = r4(median_of("chunked_cutlass"));
    row["per_operator_cutlass_ms"] = r4(median_of("per_operator_cutlass"));
    row["per_operator_cutlass_over_per_operator"] =
        r4(median_of("per_operator_cutlass") / per_op_ms);
    row["chunked_cutlass_over_chunked"] = r4(median_of("chunked_cutlass") / chunked_ms);
    row["check_chunked_cutlass"] = checks[3];
    row["check_per_operator_cutlass"] = checks[4];
  }
  row["plan"] = plan->Describe(rows);
  return row;
}

// Sampled rows of a GEMM's output (`out`, `rows` x 3*hidden) against the CPU reference.
absl::StatusOr<std::string> CheckProjection(const HiddenData& data, const void* out,
                                            int64_t rows) {
  const int64_t hd = data.hidden, features = 3 * hd;
  std::vector<uint16_t> want(static_cast<size_t>(features)), got(static_cast<size_t>(features));
  int64_t flips = 0, mismatches = 0, elements = 0;
  for (int i = 0; i < 8; ++i) {
    const int64_t t = i == 7 ? rows - 1 : rows * i / 7;
    kernels::QkvProjectRef(data.x.data() + t * hd, data.w_qkv.data(), hd, features, 0, 1,
                           want.data());
    BENCH_CUDA(cudaMemcpy(got.data(), static_cast<const uint16_t*>(out) + t * features,
                          features * 2, cudaMemcpyDeviceToHost));
    for (int64_t n = 0; n < features; ++n) {
      const uint16_t a = got[n], b = want[n];
      ++elements;
      if (a == b) continue;
      const float fa = kernels::Bf16ToFloat(a), fb = kernels::Bf16ToFloat(b);
      if ((a & 0x8000) == (b & 0x8000) && std::abs((a & 0x7fff) - (b & 0x7fff)) == 1)
        ++flips;
      else if (!(std::fabs(fa - fb) <= 1e-2f + 1e-2f * std::fabs(fb)))
        ++mismatches;
    }
  }
  return StrCat(mismatches == 0 ? "pass" : "FAIL", " (", elements, " elements, ", flips,
                " one-ulp flips, ", mismatches, " beyond tolerance)");
}

// One row of --pinning-rows: the loaded GEMM against cuBLASLt's own pick at `rows` rows.
absl::StatusOr<Json> RunPinningRow(const Options& opt, HiddenData& data, int64_t rows,
                                   kernels::Bf16Gemm& own, kernels::Bf16Gemm& pinned,
                                   const DeviceBuffer& out, cudaStream_t stream) {
  ULY_RETURN_IF_ERROR(own.Prepare(rows));
  ULY_RETURN_IF_ERROR(pinned.Prepare(rows));
  const void* x = data.d_x.as();
  const void* w = data.d_w.as();
  auto run_own = [&](cudaStream_t s) { return own.Run(x, w, out.as(), rows, s); };
  auto run_pinned = [&](cudaStream_t s) { return pinned.Run(x, w, out.as(), rows, s); };
  std::string checks[2];
  for (int i = 0; i < 2; ++i) {
    BENCH_CUDA(cudaMemsetAsync(out.as(), 0xff, static_cast<size_t>(rows * 3 * data.hidden) * 2,
                               stream));
    ULY_RETURN_IF_ERROR(i == 0 ? run_own(stream) : run_pinned(stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    ULY_ASSIGN_OR_RETURN(checks[i], CheckProjection(data, out.as(), rows));
  }
  std::vector<Variant> variants = {
      {"own", run_own, {}}, {"pinned", run_pinned, {}}, {"control", run_own, {}}};
  ULY_RETURN_IF_ERROR(SampleAll(opt, data, variants, stream));
  auto r4 = [](double v) { return std::round(v * 1e4) / 1e4; };
  const double own_ms = Median(variants[0].ms), pinned_ms = Median(variants[1].ms);
  Json row;
  row["hidden"] = data.hidden;
  row["rows"] = rows;
  row["max_rows"] = data.max_rows;
  row["own_ms"] = r4(own_ms);
  row["pinned_ms"] = r4(pinned_ms);
  row["pinned_over_own"] = r4(pinned_ms / own_ms);
  row["aa_control"] = r4(Median(variants[2].ms) / own_ms);
  row["own_algo"] = own.AlgoDescription(rows);
  row["pinned_algo"] = pinned.AlgoDescription(rows);
  row["check_own"] = checks[0];
  row["check_pinned"] = checks[1];
  return row;
}

// --pinning-rows: every hidden size, every row count; returns the failures.
int RunPinning(const Options& opt, cudaStream_t stream, Json& report) {
  std::printf("%-6s %-7s %10s %10s %9s %7s  %-6s %s\n", "hidden", "rows", "own_ms", "pinned_ms",
              "pin/own", "A/A", "check", "algorithms (own | pinned)");
  int failures = 0;
  const int64_t every_row =
      opt.pinning_every_row_rows >= 0
          ? std::min(opt.pinning_every_row_rows, opt.pinning_max_rows)
          : kernels::FusedGemmEveryRowLoadRows(opt.pinning_max_rows, FusedPath::kPerOperator);
  const std::vector<int64_t> load_counts =
      kernels::FusedGemmLoadRowCounts(opt.pinning_max_rows, 0, FusedPath::kPerOperator);
  for (int32_t hidden : opt.hiddens) {
    HiddenData data;
    absl::Status made = data.Make(hidden, opt.pinning_max_rows, opt.pinning_max_rows);
    const int64_t features = 3 * int64_t{hidden};
    absl::StatusOr<std::unique_ptr<kernels::Bf16Gemm>> own, pinned;
    DeviceBuffer scratch, out;
    if (made.ok()) {
      own = kernels::Bf16Gemm::Create(features, hidden);
      pinned = kernels::Bf16Gemm::Create(features, hidden);
      made = !own.ok() ? own.status() : pinned.status();
    }
    const size_t out_bytes = static_cast<size_t>(opt.pinning_max_rows * features) * 2;
    if (made.ok()) made = scratch.Allocate(out_bytes + 256);
    if (made.ok()) made = out.Allocate(out_bytes);
    // What a per_operator session of that many rows pays when it opens (host queries,
    // launches, wait): the first GEMM of the shape in the process, then a second one (another
    // session of the shape, as a daemon opens one per layer), which finds cuBLASLt's picks kept.
    struct Loaded {
      double ms = 0;
      size_t queries = 0;
    };
    auto load = [&](kernels::Bf16Gemm& gemm) -> absl::StatusOr<Loaded> {
      const size_t queries = kernels::Bf16Gemm::algorithm_queries();
      const auto start = std::chrono::steady_clock::now();
      ULY_RETURN_IF_ERROR(gemm.Load(load_counts, data.d_w.as(), scratch.as(), out_bytes + 256,
                                    stream, every_row));
      if (cudaStreamSynchronize(stream) != cudaSuccess)
        return absl::InternalError("the load failed on the device");
      return Loaded{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                              start)
                        .count(),
                    kernels::Bf16Gemm::algorithm_queries() - queries};
    };
    absl::StatusOr<Loaded> first, second;
    if (made.ok()) {
      first = load(**pinned);
      made = first.status();
    }
    if (made.ok()) {
      absl::StatusOr<std::unique_ptr<kernels::Bf16Gemm>> again =
          kernels::Bf16Gemm::Create(features, hidden);
      second = again.ok() ? load(**again) : absl::StatusOr<Loaded>(again.status());
      made = second.status();
    }
    if (made.ok()) {
      std::printf("hidden %d: load up to %ld rows (every row up to %ld): %zu kernels, %.1f ms, "
                  "%zu algorithm queries; a second GEMM of the shape: %.1f ms, %zu queries\n",
                  hidden, static_cast<long>(opt.pinning_max_rows), static_cast<long>(every_row),
                  (*pinned)->loaded_algorithms(), first->ms, first->queries, second->ms,
                  second->queries);
      Json load_row;
      load_row["hidden"] = hidden;
      load_row["max_rows"] = opt.pinning_max_rows;
      load_row["every_row_up_to"] = every_row;
      load_row["kernels"] = (*pinned)->loaded_algorithms();
      load_row["load_ms"] = std::round(first->ms * 10) / 10;
      load_row["queries"] = first->queries;
      load_row["second_load_ms"] = std::round(second->ms * 10) / 10;
      load_row["second_queries"] = second->queries;
      report["loads"].push_back(load_row);
    }
    if (!made.ok()) {
      std::cerr << "hidden " << hidden << ": " << made.message() << "\n";
      ++failures;
      continue;
    }
    for (int64_t rows : opt.pinning_rows) {
      if (rows < 1 || rows > opt.pinning_max_rows) continue;
      absl::StatusOr<Json> row = RunPinningRow(opt, data, rows, **own, **pinned, out, stream);
      if (!row.ok()) {
        std::printf("%-6d %-7ld error: %s\n", hidden, static_cast<long>(rows),
                    std::string(row.status().message()).c_str());
        ++failures;
        continue;
      }
      const Json& r = *row;
      const bool pass = r["check_own"].get<std::string>().rfind("pass", 0) == 0 &&
                        r["check_pinned"].get<std::string>().rfind("pass", 0) == 0;
      if (!pass) ++failures;
      std::printf("%-6d %-7ld %10.4f %10.4f %9.4f %7.4f  %-6s %s | %s\n", hidden,
                  static_cast<long>(rows), r["own_ms"].get<double>(), r["pinned_ms"].get<double>(),
                  r["pinned_over_own"].get<double>(), r["aa_control"].get<double>(),
                  pass ? "pass" : "FAIL", r["own_algo"].get<std::string>().c_str(),
                  r["pinned_algo"].get<std::string>().c_str());
      std::fflush(stdout);
      report["rows"].push_back(r);
    }
  }
  return failures;
}

// The grid of fused calls: every hidden size, W and S_global; returns the failures.
int RunGrid(const Options& opt, QkvLayout layout, cudaStream_t stream, Json& report) {
  int failures = 0;
  std::printf("%-3s %-6s %-7s %-6s %10s %10s %10s %10s %10s %8s %9s %9s %9s %9s %7s  %s\n", "W",
              "hidden", "S_glob", "rows", "gemm_ms", "per_op_ms", "chunk_ms", "epi_ms",
              "epigemm_ms", "TFLOP/s", "chunk/gem", "chunk/per", "epi/gemm", "epi/per", "A/A",
              "check");
  for (int32_t hidden : opt.hiddens) {
    int64_t max_s = 0, max_rows = 0;
    for (int32_t w : opt.worlds)
      for (int64_t s : opt.s_globals) {
        max_s = std::max(max_s, s);
        max_rows = std::max(max_rows, s / w);
      }
    HiddenData data;
    absl::Status made = data.Make(hidden, max_rows, max_s);
    if (!made.ok()) {
      std::cerr << "hidden " << hidden << ": " << made.message() << "\n";
      ++failures;
      continue;
    }
    for (int32_t world : opt.worlds) {
      for (int64_t s_global : opt.s_globals) {
        if (s_global % world != 0 || (hidden / kDim) % world != 0) continue;
        absl::StatusOr<Json> row = RunRow(opt, data, world, s_global, layout, stream);
        if (!row.ok()) {
          std::printf("%-3d %-6d %-7ld error: %s\n", world, hidden, static_cast<long>(s_global),
                      std::string(row.status().message()).c_str());
          ++failures;
          continue;
        }
        const Json& r = *row;
        const bool epi = !r["fused_epilogue_ms"].is_null();
        auto passed = [&](const char* key) {
          return r[key].get<std::string>().rfind("pass", 0) == 0;
        };
        const bool cut = r.contains("check_chunked_cutlass");
        const bool pass = passed("check_chunked") && passed("check_per_operator") &&
                          (!epi || passed("check_epilogue")) &&
                          (!cut || (passed("check_chunked_cutlass") &&
                                    passed("check_per_operator_cutlass")));
        if (!pass) ++failures;
        auto value = [&](const char* key) { return epi ? r[key].get<double>() : NAN; };
        std::printf(
            "%-3d %-6d %-7ld %-6ld %10.4f %10.4f %10.4f %10.4f %10.4f %8.1f %9.4f %9.4f %9.4f "
            "%9.4f %7.4f  %s\n",
            world, hidden, static_cast<long>(s_global), static_cast<long>(s_global / world),
            r["gemm_ms"].get<double>(), r["per_operator_ms"].get<double>(),
            r["fused_chunked_ms"].get<double>(), value("fused_epilogue_ms"),
            value("epilogue_gemm_ms"), r["gemm_tflops"].get<double>(), r["chunked_over_gemm"].get<double>(),
            r["chunked_over_per_operator"].get<double>(), value("epilogue_over_gemm"),
            value("epilogue_over_per_operator"), r["aa_control"].get<double>(),
            pass ? "pass" : "FAIL");
        std::fflush(stdout);
        report["rows"].push_back(r);
      }
    }
  }
  return failures;
}

// Whether this process's context on device 0 is an MPS client (the attribute the daemon reads).
bool MpsDetected() {
  int on = 0;
  return cudaDeviceGetAttribute(&on, cudaDevAttrMpsEnabled, 0) == cudaSuccess && on != 0;
}

int Main(int argc, char** argv) {
  Options opt;
  bool quick = false;
  CLI::App app{
      "ulysses-fused-bench: the fused QKV call vs the per-operator path and the GEMM "
      "alone, on one GPU"};
  app.add_option("--world", opt.worlds, "world sizes W")->delimiter(',');
  app.add_option("--hidden", opt.hiddens, "hidden sizes (D = 128)")->delimiter(',');
  app.add_option("--s-global", opt.s_globals, "global sequence lengths")->delimiter(',');
  app.add_option("--layout", opt.layout, "bshd or fused");
  app.add_option("--rounds", opt.rounds, "A/B/B/A rounds");
  app.add_option("--samples", opt.samples, "samples per variant and round");
  app.add_option("--warmup", opt.warmup, "warm-up calls per variant");
  app.add_option("--chunk-rows", opt.chunk_rows, "rows per chunk of the chunked path (0: auto)");
  app.add_option("--push-blocks", opt.push_blocks,
                 "grid cap of the chunked store kernel (0: none)");
  app.add_option("--epilogue-schedule", opt.epilogue_schedule,
                 "the epilogue path's GEMM: auto, pingpong (single CTAs), pingpong2 (clusters of "
                 "2), cooperative2h2 (128 x 256 tiles of two heads, clusters of 2, the "
                 "epilogue from registers) or cooperative2ew (the same tiles, the epilogue on "
                 "warps of its own beside the next tile's mainloop)")
      ->check(
          CLI::IsMember({"auto", "pingpong", "pingpong2", "cooperative2h2", "cooperative2ew"}));
  app.add_option("--readiness", opt.readiness,
                 "none: the paths as the daemon runs them; words: each chunk also publishes its "
                 "readiness word per destination")
      ->check(CLI::IsMember({"none", "words"}));
  app.add_option("--json", opt.json_path, "write the JSON report here");
  app.add_option("--mps", opt.mps, "auto, yes or no: whether this runs under MPS");
  app.add_option("--commit", opt.commit, "commit recorded in the JSON");
  app.add_flag("--quick", quick, "a small grid: W 2,8, hidden 4096, S_global 4096,32768");
  app.add_flag("--cutlass-projection", opt.cutlass_projection,
               "also the per-operator and chunked paths projecting on the epilogue path's "
               "CUTLASS GEMM (JSON: *_cutlass_ms and their ratios)");
  app.add_option("--pinning-rows", opt.pinning_rows,
                 "instead of the grid: the pinned GEMM against cuBLASLt's own pick at these "
                 "row counts")
      ->delimiter(',');
  app.add_option("--pinning-max-rows", opt.pinning_max_rows,
                 "the rows the pinned GEMM is loaded for (a session's max_tokens)")
      ->check(CLI::PositiveNumber);
  app.add_option("--pinning-every-row-rows", opt.pinning_every_row_rows,
                 "load cuBLASLt's pick of every row count up to this (0: none; default: as a "
                 "session loads, FusedGemmEveryRowLoadRows)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    opt.worlds = {2, 8};
    opt.hiddens = {4096};
    opt.s_globals = {4096, 32768};
  }
  absl::StatusOr<QkvLayout> layout = ParseQkvLayout(opt.layout);
  if (!layout.ok()) {
    std::cerr << "ulysses-fused-bench: " << layout.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<int> devices = kernels::CudaDeviceCount();
  if (!devices.ok() || *devices == 0) {
    std::cout << "ulysses-fused-bench: no CUDA device"
              << (devices.ok() ? "" : StrCat(" (", devices.status().message(), ")"))
              << "; nothing to measure\n";
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const bool mps = opt.mps == "auto" ? MpsDetected() : opt.mps == "yes";
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));

  Json report;
  report["gpu"] = prop.name;
  report["commit"] = opt.commit;
  report["date"] = date;
  report["mps"] = mps;
  report["layout"] = opt.layout;
  report["readiness"] = opt.readiness;
  report["epilogue_schedule"] = opt.epilogue_schedule;
  report["method"] = StrCat("CUDA events, L2 flushed (256 MiB memset) before each sample, ",
                            opt.rounds, " A/B/B/A rounds x ", opt.samples,
                            " samples, median; A/A control = fused_chunked twice");
  report["rows"] = Json::array();
  if (!opt.pinning_rows.empty()) {
    report["what"] = StrCat("pinned GEMM (loaded for ", opt.pinning_max_rows,
                            " rows) against cuBLASLt's own pick");
    report["method"] = StrCat("CUDA events, L2 flushed (256 MiB memset) before each sample, ",
                              opt.rounds, " A/B/B/A rounds x ", opt.samples,
                              " samples, median; A/A control = own twice");
  }
  const int failures = opt.pinning_rows.empty() ? RunGrid(opt, *layout, stream, report)
                                                : RunPinning(opt, stream, report);
  cudaStreamDestroy(stream);
  if (!opt.json_path.empty()) {
    std::ofstream out(opt.json_path);
    out << report.dump(2) << "\n";
    if (!out) {
      std::cerr << "ulysses-fused-bench: cannot write " << opt.json_path << "\n";
      return 1;
    }
  }
  std::cout << report.dump() << "\n";
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace ulysses::bench

int main(int argc, char** argv) { return ulysses::bench::Main(argc, argv); }
