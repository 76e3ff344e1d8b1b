// CUDA error discipline for the kernels target: every runtime call and every launch is checked
// and turned into an absl::Status. Include only from .cu / CUDA-aware sources.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ulysses::kernels::internal {

/// INTERNAL "call: cudaErrorName (description) at file:line", file without its directory.
inline absl::Status CudaError(absl::string_view call, cudaError_t err, absl::string_view file,
                              int line) {
  const size_t slash = file.find_last_of('/');
  if (slash != absl::string_view::npos) file.remove_prefix(slash + 1);
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ") at ", file, ":", line));
}

}  // namespace ulysses::kernels::internal

/// Returns an INTERNAL status from the enclosing function when the CUDA call fails.
#define ULY_CUDA_RETURN_IF_ERROR(call)                                                          \
  do {                                                                                          \
    const cudaError_t uly_cuda_err_ = (call);                                                   \
    if (uly_cuda_err_ != cudaSuccess)                                                           \
      return ::ulysses::kernels::internal::CudaError(#call, uly_cuda_err_, __FILE__, __LINE__); \
  } while (0)
