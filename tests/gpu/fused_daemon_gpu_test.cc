// The qkv_norm_rope_exchange session on the GPU backends end to end: W ulyssesd processes sharing
// this GPU, real clients with device buffers (AllocBuffer), B = 2, S_l = 200, hidden in
// {3072, 4096} (D = 128), W in {1, 2, 4}, and S_l = 1024 (the cooperative epilogue kernel) at
// hidden 3072, W = 2; both layouts; on nvlink the three GPU paths, on nccl
// (each daemon its own NCCL_HOSTID, NCCL's socket transport: a test mode) its per-operator
// path. Every rank's head band is checked
//  (0) on the per-operator path, bit for bit against the same plan's projection and norm + RoPE
//      run in this process, then exchanged by the CPU reference: the transport moves exactly
//      what the kernels computed;
//  (1) against the reference chain (norm + RoPE, then the exchange) run on the GPU's own
//      projection, the same cuBLASLt GEMM run in this process: what the kernels after the GEMM
//      must reproduce, at atol = rtol = 1e-2, nothing beyond it but two-ulp RoPE cancellations;
//  (2) against the fp32 step-by-step reference, head by head: a head beyond the tolerance must
//      come from a projection that differs from the reference's in that head (GEMM rounding
//      carried through the norm).
// One-ulp bf16 flips are counted and printed; repeated calls at a prepared row count leave the
// daemon's device allocation counters as they were. Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>
#include <tuple>

#include "cluster_util.h"
#include "gtest/gtest.h"
#include "qkv_test_util.h"
#include "ulysses/client/client.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses {
namespace {

using kernels::QkvNormRopeShape;
using kernels::testing::Bf16Diff;
using kernels::testing::CompareBf16;
using kernels::testing::QkvProblem;

constexpr int64_t kBatch = 2;
constexpr int32_t kMaxPos = 4096;

// Runs fn(begin, end) over [0, n) split across the machine's cores.
template <typename Fn>
void ParallelRanges(int64_t n, Fn fn) {
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back([&, t] { fn(n * t / threads, n * (t + 1) / threads); });
  for (auto& th : pool) th.join();
}

// Elements more than one ulp apart but at most two (same sign), beyond the tolerance: the
// norm + RoPE kernel's sum of squares runs in another order than the reference's, which RoPE
// cancellation can lift past 1e-2 (docs/benchmarks.md).
int64_t TwoUlp(uint16_t a, uint16_t b) {
  if ((a & 0x8000u) != (b & 0x8000u)) return 3;
  return std::abs((a & 0x7fff) - (b & 0x7fff));
}

// Elements of got[0, n) beyond atol = rtol = 1e-2 of want: within two ulps (`near`) or further.
void CountBeyond(const uint16_t* got, const uint16_t* want, int64_t n, int64_t* near, int64_t* far) {
  for (int64_t i = 0; i < n; ++i) {
    if (got[i] == want[i]) continue;
    const float g = kernels::Bf16ToFloat(got[i]), w = kernels::Bf16ToFloat(want[i]);
    if (std::fabs(g - w) <= 1e-2f + 1e-2f * std::fabs(w)) continue;
    (TwoUlp(got[i], want[i]) <= 2 ? *near : *far) += 1;
  }
}

using Param = std::tuple<int32_t, int32_t, std::string, int64_t>;  // hidden, world, backend, S_l

// The GPU's own results for every rank, from the session's plan run in this process on the
// same device operands: the raw projection and the per-operator path's norm + RoPE of it.
struct GpuResults {
  std::vector<std::vector<uint16_t>> projection, normalized;
};

class GpuFusedSession : public testing_util::ClusterTest,
                        public ::testing::WithParamInterface<Param> {
 protected:
  void SetUp() override {
    if (ipc::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    const auto& [hidden, world, backend, seq_local] = GetParam();
    backend_ = backend;
    seq_local_ = seq_local;
    rows_ = kBatch * seq_local_;
    // NCCL refuses two ranks on one GPU: each daemon its own host.
    if (backend_ == "nccl")
      env_ = [](int r) { return std::vector<std::string>{StrCat("NCCL_HOSTID=ulysses-fused-", r)}; };
    shape_ = QkvNormRopeShape{world, hidden / kFusedGpuHeadDim, kFusedGpuHeadDim, kMaxPos, kBatch,
                              seq_local_};
    problem_ = kernels::testing::MakeQkvProblem(shape_, 4000 + hidden + world);
    const int64_t features = kernels::QkvFeatures(shape_);
    for (int r = 0; r < world; ++r) {
      proj_ref_.emplace_back(static_cast<size_t>(rows_ * features));
      ParallelRanges(rows_, [&](int64_t b, int64_t e) {
        kernels::QkvProjectRef(problem_.x[r].data(), problem_.w_qkv.data(), hidden, features, b, e,
                               proj_ref_[r].data());
      });
      plain_ref_.push_back(NormRope(proj_ref_[r], r));
    }
  }

  int64_t Features() const { return kernels::QkvFeatures(shape_); }
  int64_t SlotElems() const { return 3 * kernels::QkvPlaneElems(shape_); }

  std::vector<uint16_t> NormRope(std::vector<uint16_t> proj, int r) const {
    ParallelRanges(rows_, [&](int64_t b, int64_t e) {
      kernels::NormRopeRef(shape_, problem_.weights(), problem_.positions[r].data(), b, e,
                           proj.data());
    });
    return proj;
  }

  // Rank src's [rows, 3*H*D] result as the destination slots hold it.
  std::vector<uint16_t> Gather(const std::vector<std::vector<uint16_t>>& slots, QkvLayout layout,
                               int src) const {
    const int64_t hd = kernels::QkvHidden(shape_), hl = kernels::QkvLocalHeads(shape_);
    const int64_t dim = shape_.head_dim;
    std::vector<uint16_t> out(static_cast<size_t>(rows_ * Features()));
    for (int64_t t = 0; t < rows_; ++t) {
      const int64_t b = t / seq_local_, sg = src * seq_local_ + t % seq_local_;
      for (int plane = 0; plane < 3; ++plane)
        for (int64_t g = 0; g < shape_.heads; ++g)
          std::memcpy(out.data() + t * 3 * hd + plane * hd + g * dim,
                      slots[g / hl].data() +
                          kernels::QkvDestOffset(shape_, layout, b, sg, g % hl, plane, 0),
                      dim * sizeof(uint16_t));
    }
    return out;
  }

  // The session's GEMM at m = B*S_l and the per-operator path's norm + RoPE, run in this
  // process. The chunked path makes one chunk of 400 rows and four of 512 from 2048 rows, each
  // a GEMM of its own, which (1) and (2) below hold to the same tolerance.
  GpuResults GpuOwn(const client::Buffer& weights, const std::vector<client::Buffer>& xs,
                    const std::vector<client::Buffer>& positions) {
    GpuResults out;
    kernels::FusedQkvConfig c;
    c.world = shape_.world;
    c.heads = shape_.heads;
    c.max_pos = kMaxPos;
    c.layout = QkvLayout::kBshd;
    c.max_tokens = rows_;
    auto* w = static_cast<uint8_t*>(weights.data);
    c.weights = {w + offsets_[0], w + offsets_[1], w + offsets_[2],
                 reinterpret_cast<const float*>(w + offsets_[3])};
    auto plan = kernels::FusedQkvPlan::Create(c);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return out;
    EXPECT_TRUE((*plan)->Prepare(rows_).ok());
    auto read = [&](std::vector<std::vector<uint16_t>>& to) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      to.emplace_back(static_cast<size_t>(rows_ * Features()));
      EXPECT_TRUE(ipc::cuda::Copy(to.back().data(), (*plan)->projection(), to.back().size() * 2).ok());
    };
    for (size_t r = 0; r < xs.size(); ++r) {
      EXPECT_TRUE((*plan)->RunProjection(xs[r].data, rows_, nullptr).ok());
      read(out.projection);
      EXPECT_TRUE((*plan)->RunNormRope(xs[r].data, static_cast<const int32_t*>(positions[r].data),
                                       kBatch, seq_local_, nullptr).ok());
      read(out.normalized);
    }
    return out;
  }

  // The paths this backend runs.
  std::vector<FusedPath> Paths() const {
    if (backend_ == "nccl") return {FusedPath::kPerOperator};
    return {FusedPath::kPerOperator, FusedPath::kChunked, FusedPath::kEpilogue};
  }

  int64_t seq_local_ = 0, rows_ = 0;
  QkvNormRopeShape shape_{};
  QkvProblem problem_;
  std::vector<std::vector<uint16_t>> proj_ref_, plain_ref_;
  std::array<uint64_t, 4> offsets_{};  // w_qkv, q_norm, k_norm, cos_sin in the weight buffer
};

TEST_P(GpuFusedSession, BothLayoutsAndPathsMatchTheReference) {
  const int world = shape_.world;
  const int64_t hidden = kernels::QkvHidden(shape_), dim = shape_.head_dim;
  Start(world);
  offsets_[0] = 0;
  offsets_[1] = AlignUp(problem_.w_qkv.size() * 2, 256);
  offsets_[2] = offsets_[1] + 256;
  offsets_[3] = offsets_[2] + 256;
  const uint64_t weight_bytes = offsets_[3] + problem_.cos_sin.size() * 4;
  GpuResults gpu;
  int combo = 0;
  for (QkvLayout layout : {QkvLayout::kBshd, QkvLayout::kFused}) {
    for (FusedPath path : Paths()) {
      SCOPED_TRACE(StrCat(QkvLayoutName(layout), " ", FusedPathName(path)));
      std::vector<std::vector<uint16_t>> slots(world);
      std::vector<std::string> errors(world);
      std::vector<std::unique_ptr<client::Client>> clients(world);
      std::vector<client::Buffer> weights(world), xs(world), poss(world);
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          auto fail = [&](const std::string& e) { errors[r] = e; };
          auto c = client::Client::Connect({Members(world)[r], "fused-gpu"});
          if (!c.ok()) return fail(c.status().ToString());
          clients[r] = std::move(*c);
          client::Client& cl = *clients[r];
          auto group = cl.JoinGroup({StrCat("fg", combo), world, r, Members(world), backend_, 60000});
          if (!group.ok()) return fail(group.status().ToString());
          auto w = cl.AllocBuffer(weight_bytes, "weights");
          auto x = cl.AllocBuffer(problem_.x[r].size() * 2, "x");
          auto pos = cl.AllocBuffer(problem_.positions[r].size() * 4, "positions");
          auto out = cl.AllocBuffer(SlotElems() * 2, "out");
          if (!w.ok() || !x.ok() || !pos.ok() || !out.ok()) return fail("alloc");
          if (!w->device) return fail("AllocBuffer gave host memory on the GPU backend");
          auto* wd = static_cast<uint8_t*>(w->data);
          bool up = ipc::cuda::Copy(wd + offsets_[0], problem_.w_qkv.data(), problem_.w_qkv.size() * 2).ok() &&
                    ipc::cuda::Copy(wd + offsets_[1], problem_.q_norm.data(), dim * 2).ok() &&
                    ipc::cuda::Copy(wd + offsets_[2], problem_.k_norm.data(), dim * 2).ok() &&
                    ipc::cuda::Copy(wd + offsets_[3], problem_.cos_sin.data(), problem_.cos_sin.size() * 4).ok() &&
                    ipc::cuda::Copy(x->data, problem_.x[r].data(), problem_.x[r].size() * 2).ok() &&
                    ipc::cuda::Copy(pos->data, problem_.positions[r].data(), problem_.positions[r].size() * 4).ok();
          if (!up) return fail("upload");
          weights[r] = *w;
          xs[r] = *x;
          poss[r] = *pos;
          client::FusedSessionSpec spec;
          spec.hidden = static_cast<int32_t>(hidden);
          spec.num_heads = shape_.heads;
          spec.head_dim = shape_.head_dim;
          spec.layout = layout;
          spec.max_tokens = rows_;
          spec.max_pos = kMaxPos;
          spec.path = path;
          spec.weights.w_qkv = w->Tensor(DType::kBFloat16, {3 * hidden, hidden}, offsets_[0]);
          spec.weights.q_norm = w->Tensor(DType::kBFloat16, {dim}, offsets_[1]);
          spec.weights.k_norm = w->Tensor(DType::kBFloat16, {dim}, offsets_[2]);
          spec.weights.cos_sin = w->Tensor(DType::kFloat32, {kMaxPos, dim}, offsets_[3]);
          spec.timeout_ms = 60000;
          auto session = cl.CreateFusedSession(*group, spec);
          if (!session.ok()) return fail(session.status().ToString());
          if (!(*session)->PoisonSlots().ok()) return fail("poison");
          auto views = (*session)->QkvNormRopeExchange(x->Ref(), pos->Ref(), kBatch, seq_local_);
          if (!views.ok()) return fail(views.status().ToString());
          slots[r].resize(static_cast<size_t>(SlotElems()));
          size_t at = 0;
          for (const client::Result& v : *views) {
            if (!v.device) return fail("result is not a device view");
            if (!ipc::cuda::Copy(slots[r].data() + at, v.data, v.bytes).ok()) return fail("read");
            at += v.bytes / 2;
          }
          if (at != slots[r].size()) return fail("result size");
          auto described = (*session)->Describe();
          if (!described.ok() ||
              described->find(StrCat("rows ", rows_, ": ", FusedPathName(path))) == std::string::npos)
            return fail("describe: " + (described.ok() ? *described : described.status().ToString()));
          // From 2048 rows the epilogue path runs the cooperative kernel's tiles of two heads.
          const bool cooperative = described->find("cooperative") != std::string::npos &&
                                   described->find("tile 128x256") != std::string::npos;
          if (path == FusedPath::kEpilogue && cooperative != (rows_ >= 2048))
            return fail("epilogue schedule at " + std::to_string(rows_) + " rows: " + *described);
          if (r == 0) std::cout << *described << "\n";
          // out=: the same bytes in a device buffer of the caller, the slot released at once.
          auto copied = (*session)->QkvNormRopeExchange(x->Ref(), pos->Ref(), kBatch, seq_local_,
                                                        out->Ref());
          if (!copied.ok()) return fail(copied.status().ToString());
          std::vector<uint16_t> outh(slots[r].size());
          if (!ipc::cuda::Copy(outh.data(), out->data, outh.size() * 2).ok()) return fail("read out");
          if (outh != slots[r]) return fail("out= differs from the slot result");
          if ((*copied)[0].held() || (*copied)[0].data != out->data) return fail("out= views");
          // The first result holds its slot; give it back before calls cycle onto that slot.
          if (!(*views)[0].Release().ok()) return fail("release");
          // A prepared row count allocates nothing more (the daemon's VMM and IPC counters;
          // the plan's own buffers were made at session creation), nor host memory on the call
          // path (the GEMM library's own allocations included, where it uses operator new).
          const uint64_t allocations = State(r).device_allocations();
          const uint64_t host = State(r).call_path_host_allocations();
          for (int i = 0; i < 3; ++i) {
            auto again = (*session)->QkvNormRopeExchange(x->Ref(), pos->Ref(), kBatch, seq_local_,
                                                         out->Ref());
            if (!again.ok()) return fail("repeated call: " + again.status().ToString());
          }
          if (State(r).device_allocations() != allocations) return fail("a prepared call allocated");
          if (State(r).call_path_host_allocations() != host)
            return fail(StrCat("prepared calls made ", State(r).call_path_host_allocations() - host,
                               " host allocations on the call path"));
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
      if (gpu.projection.size() != static_cast<size_t>(world)) gpu = GpuOwn(weights[0], xs, poss);
      ASSERT_EQ(gpu.projection.size(), static_cast<size_t>(world));
      const std::vector<std::vector<uint16_t>>& gpu_proj = gpu.projection;
      // (0) The per-operator path moves exactly what its kernels computed.
      if (path == FusedPath::kPerOperator) {
        std::vector<std::vector<uint16_t>> exact(world, std::vector<uint16_t>(SlotElems(), 0xffff));
        for (int src = 0; src < world; ++src)
          for (int dst = 0; dst < world; ++dst)
            kernels::ScatterQkvBlockRef(shape_, layout, gpu.normalized[src].data(), src, dst,
                                        exact[dst].data());
        for (int dst = 0; dst < world; ++dst) {
          const Bf16Diff d = CompareBf16(slots[dst].data(), exact[dst].data(), SlotElems());
          EXPECT_EQ(d.equal, d.elements) << "dst " << dst << ": " << d;
        }
      }
      // (1) Against the reference chain on the GPU's own projection, whole slots (an element
      // never written is NaN and fails).
      std::vector<std::vector<uint16_t>> own(world, std::vector<uint16_t>(SlotElems(), 0xffff));
      for (int src = 0; src < world; ++src) {
        const std::vector<uint16_t> result = NormRope(gpu_proj[src], src);
        for (int dst = 0; dst < world; ++dst)
          kernels::ScatterQkvBlockRef(shape_, layout, result.data(), src, dst, own[dst].data());
      }
      for (int dst = 0; dst < world; ++dst) {
        const Bf16Diff d = CompareBf16(slots[dst].data(), own[dst].data(), SlotElems());
        int64_t far = 0, near = 0;
        CountBeyond(slots[dst].data(), own[dst].data(), SlotElems(), &near, &far);
        std::cout << QkvLayoutName(layout) << " " << FusedPathName(path) << " W=" << world
                  << " hidden=" << hidden << " dst " << dst
                  << " vs the reference on its own projection: " << d << "; beyond tolerance: "
                  << near << " within two ulps, " << far << " further\n";
        EXPECT_EQ(far, 0) << "dst " << dst;
        EXPECT_LE(d.flips, d.elements / 100) << "dst " << dst;
      }
      // (2) Against the pure fp32 reference, per source rank and head.
      for (int src = 0; src < world; ++src) {
        const std::vector<uint16_t> got = Gather(slots, layout, src);
        const Bf16Diff total = CompareBf16(got.data(), plain_ref_[src].data(), rows_ * Features());
        // A head beyond the tolerance is explained when its projection differs from the
        // reference's (GEMM rounding carried through the norm), or when it is a two-ulp RoPE
        // cancellation.
        int64_t propagated = 0, near = 0, unexplained = 0;
        for (int64_t at = 0; at < rows_ * Features(); at += dim) {
          const Bf16Diff head = CompareBf16(got.data() + at, plain_ref_[src].data() + at, dim);
          if (head.mismatches == 0) continue;
          const bool inputs_differ = std::memcmp(gpu_proj[src].data() + at, proj_ref_[src].data() + at,
                                                 dim * sizeof(uint16_t)) != 0;
          if (inputs_differ) propagated += head.mismatches;
          else CountBeyond(got.data() + at, plain_ref_[src].data() + at, dim, &near, &unexplained);
        }
        std::cout << QkvLayoutName(layout) << " " << FusedPathName(path) << " src " << src
                  << " vs the fp32 reference: " << total << "; beyond tolerance: " << propagated
                  << " propagated from GEMM rounding, " << near << " two-ulp, " << unexplained
                  << " unexplained\n";
        EXPECT_EQ(unexplained, 0) << "src " << src;
        EXPECT_LE(total.flips, total.elements / 100) << "src " << src;
      }
      ++combo;
    }
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& i) {
  return StrCat(std::get<2>(i.param), "_hidden", std::get<0>(i.param), "_W", std::get<1>(i.param),
                std::get<3>(i.param) == 200 ? "" : StrCat("_S", std::get<3>(i.param)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuFusedSession,
                         ::testing::Combine(::testing::Values(3072, 4096),
                                            ::testing::Values(1, 2, 4),
#if ULYSSES_TEST_NCCL
                                            ::testing::Values("nvlink", "nccl"),
#else
                                            ::testing::Values("nvlink"),
#endif
                                            ::testing::Values(int64_t{200})),
                         ParamName);

// 2048 rows a call: the epilogue path on the cooperative kernel (128 x 256 tiles, clusters of 2),
// which the plan picks from 2048 rows; below, on clusters of 128-row tiles (above).
INSTANTIATE_TEST_SUITE_P(Rows2048, GpuFusedSession,
                         ::testing::Combine(::testing::Values(3072), ::testing::Values(2),
                                            ::testing::Values("nvlink"),
                                            ::testing::Values(int64_t{1024})),
                         ParamName);

}  // namespace
}  // namespace ulysses
