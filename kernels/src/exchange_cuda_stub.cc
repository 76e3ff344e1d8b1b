// Launchers of a build without CUDA: the host backend never calls them, and callers that probe
// for a GPU see CudaDeviceCount() == 0.
#include "ulysses/kernels/exchange_cuda.h"

namespace ulysses::kernels {
namespace {

absl::Status NoCuda() { return absl::FailedPreconditionError("ulysses was built without CUDA"); }

}  // namespace

absl::Status LaunchScatterHeadsBlock(const ExchangeShape&, ConstView, int, int, void*,
                                     cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchGatherHeadsBlock(const ExchangeShape&, ConstView, int, int, void*,
                                    cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchScatterQkvHeadChunkBlock(const ExchangeShape&, ConstView, ConstView, ConstView,
                                            int32_t, int32_t, int, int, void*, cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchGatherOutputHeadChunkBlock(const ExchangeShape&, ConstView, int32_t, int, int,
                                              void*, cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchGatherOutputHeadChunkMerge(const ExchangeShape&, const void*, int32_t, int32_t,
                                              MutView, cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchBlocks(const ExchangeShape&, const BlockOperands&, int, void* const*,
                          cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchCopyContiguousToView(const void*, const int64_t[4], int32_t, MutView,
                                        cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchCopyViewToContiguous(ConstView, const int64_t[4], int32_t, void*, cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::Status LaunchBlock(const ExchangeShape&, const BlockOperands&, int, int, void*,
                         cudaStream_t) {
  return NoCuda();
}

absl::Status LaunchPackBlock(const ExchangeShape&, const BlockOperands&, int, int, void*,
                             cudaStream_t) {
  return NoCuda();
}

absl::Status LaunchUnpackBlock(const ExchangeShape&, const BlockOperands&, int, int, const void*,
                               void*, cudaStream_t, const uint64_t*) {
  return NoCuda();
}

absl::StatusOr<int> CudaDeviceCount() { return 0; }

}  // namespace ulysses::kernels
