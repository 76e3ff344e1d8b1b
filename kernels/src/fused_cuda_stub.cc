// The fused QKV op's GPU entry points in a build without CUDA: every one reports
// FAILED_PRECONDITION (the host backend runs the references of qkv_norm_rope.h instead).
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/gemm.h"
#include "ulysses/kernels/qkv_norm_rope_cuda.h"

namespace ulysses::kernels {
namespace {

absl::Status NoCuda() { return absl::FailedPreconditionError("ulysses was built without CUDA"); }

}  // namespace

absl::Status LaunchNormRope(const QkvNormRopeShape&, const QkvWeights&, const int32_t*, int64_t,
                            int64_t, void*, cudaStream_t, QkvLaunchOptions) {
  return NoCuda();
}

absl::Status LaunchQkvScatter(const QkvNormRopeShape&, QkvLayout, const void*, int, int64_t,
                              int64_t, const QkvDestinations&, unsigned int*, cudaStream_t,
                              QkvLaunchOptions) {
  return NoCuda();
}

absl::Status LaunchNormRopeScatter(const QkvNormRopeShape&, QkvLayout, const QkvWeights&,
                                   const int32_t*, const void*, int, int64_t, int64_t,
                                   const QkvDestinations&, unsigned int*, cudaStream_t,
                                   QkvLaunchOptions) {
  return NoCuda();
}

struct Bf16Gemm::Impl {};
Bf16Gemm::Bf16Gemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Bf16Gemm::~Bf16Gemm() = default;
absl::Status Bf16Gemm::WarmUp(cudaStream_t) { return NoCuda(); }
absl::StatusOr<std::unique_ptr<Bf16Gemm>> Bf16Gemm::Create(int64_t, int64_t, size_t,
                                                           cudaStream_t) {
  return NoCuda();
}
absl::Status Bf16Gemm::Prepare(int64_t) { return NoCuda(); }
absl::Status Bf16Gemm::Run(const void*, const void*, void*, int64_t, cudaStream_t) {
  return NoCuda();
}
absl::Status Bf16Gemm::Load(const std::vector<int64_t>&, const void*, void*, size_t,
                            cudaStream_t, int64_t) {
  return NoCuda();
}
size_t Bf16Gemm::loaded_algorithms() const { return 0; }
size_t Bf16Gemm::unloaded_launches() const { return 0; }
size_t Bf16Gemm::runs() const { return 0; }
size_t Bf16Gemm::algorithm_queries() { return 0; }
void Bf16Gemm::ForgetPicks() {}
int64_t Bf16Gemm::n() const { return 0; }
int64_t Bf16Gemm::k() const { return 0; }
size_t Bf16Gemm::device_bytes() const { return 0; }
std::string Bf16Gemm::AlgoDescription(int64_t) const { return ""; }

struct FusedQkvPlan::Impl {};
FusedQkvPlan::FusedQkvPlan(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FusedQkvPlan::~FusedQkvPlan() = default;
absl::StatusOr<std::unique_ptr<FusedQkvPlan>> FusedQkvPlan::Create(const FusedQkvConfig&) {
  return NoCuda();
}
absl::Status FusedQkvPlan::Prepare(int64_t) { return NoCuda(); }
absl::Status FusedQkvPlan::LoadKernels(int64_t, FusedPath, cudaStream_t) { return NoCuda(); }
size_t FusedQkvPlan::device_bytes() const { return 0; }
size_t FusedQkvPlan::loaded_gemm_kernels() const { return 0; }
size_t FusedQkvPlan::unloaded_gemm_launches() const { return 0; }
size_t FusedQkvPlan::cublaslt_runs() const { return 0; }
size_t FusedQkvPlan::DeviceBytesFor(const FusedQkvConfig&) { return 0; }
absl::Status FusedQkvPlan::RunNormRope(const void*, const int32_t*, int64_t, int64_t,
                                       cudaStream_t) {
  return NoCuda();
}
absl::Status FusedQkvPlan::RunPerOperator(const void*, const int32_t*, int64_t, int64_t,
                                          const QkvDestinations&, cudaStream_t) {
  return NoCuda();
}
absl::Status FusedQkvPlan::RunChunked(const void*, const int32_t*, int64_t, int64_t,
                                      const QkvDestinations&, cudaStream_t) {
  return NoCuda();
}
absl::Status FusedQkvPlan::RunEpilogue(const void*, const int32_t*, int64_t, int64_t,
                                       const QkvDestinations&, cudaStream_t) {
  return NoCuda();
}
absl::Status FusedQkvPlan::RunEpilogueGemmAlone(const void*, int64_t, cudaStream_t) {
  return NoCuda();
}
std::string FusedQkvPlan::EpilogueUnavailable() const { return "built without CUDA"; }
absl::Status FusedQkvPlan::RunProjection(const void*, int64_t, cudaStream_t) { return NoCuda(); }
int64_t FusedQkvPlan::ChunkRows(int64_t rows) const { return rows; }
int64_t FusedQkvPlan::NumChunks(int64_t) const { return 1; }
const void* FusedQkvPlan::projection() const { return nullptr; }
std::string FusedQkvPlan::Describe(int64_t) const { return "built without CUDA"; }

}  // namespace ulysses::kernels
