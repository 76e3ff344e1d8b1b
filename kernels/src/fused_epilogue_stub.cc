// The epilogue-fused GEMM in a build without it (no CUTLASS headers, or no sm_90a among the
// CUDA architectures): Create says why.
#include "fused_epilogue.h"

#ifndef ULYSSES_EPILOGUE_UNAVAILABLE
#define ULYSSES_EPILOGUE_UNAVAILABLE "not built"
#endif

namespace ulysses::kernels::internal {

std::string EpilogueGemm::Unavailable() { return ULYSSES_EPILOGUE_UNAVAILABLE; }

absl::StatusOr<std::unique_ptr<EpilogueGemm>> EpilogueGemm::Create(int64_t, int64_t,
                                                                   EpilogueSchedule) {
  return absl::FailedPreconditionError(
      "the epilogue-fused GEMM is not in this build: " + Unavailable());
}

}  // namespace ulysses::kernels::internal
