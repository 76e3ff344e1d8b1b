// CUDA error discipline for the kernels target: every runtime call and every launch is checked
// and turned into an absl::Status. Include only from .cu / CUDA-aware sources.
#pragma once

#include <cuda.h>
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

/// Whether the calling thread has a current CUDA context (cuCtxGetCurrent, through the driver's
/// entry point, resolved once).
inline bool HasCurrentContext() {
  using GetCurrent = CUresult (*)(CUcontext*);
  static const GetCurrent get_current = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return GetCurrent{nullptr};
    return reinterpret_cast<GetCurrent>(p);
  }();
  CUcontext ctx = nullptr;
  return get_current != nullptr && get_current(&ctx) == CUDA_SUCCESS && ctx != nullptr;
}

/// Makes `device` (and so its primary context) current for a scope. A thread that never called
/// the runtime has no current context, and the driver calls some launches make fail there
/// (CUTLASS encodes its TMA descriptors with cuTensorMapEncodeTiled, and does not report that
/// failure: the kernel then runs with an unset descriptor and ends the context with an illegal
/// instruction). A thread that had a context gets its device back at the scope's end; one that
/// had none keeps `device`'s (putting back "device 0" would make a context there).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (!HasCurrentContext() || cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
    if (status_ != cudaSuccess || previous_ == device) previous_ = -1;
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  /// cudaSetDevice's result.
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace ulysses::kernels::internal

/// Returns an INTERNAL status from the enclosing function when the CUDA call fails.
#define ULY_CUDA_RETURN_IF_ERROR(call)                                                          \
  do {                                                                                          \
    const cudaError_t uly_cuda_err_ = (call);                                                   \
    if (uly_cuda_err_ != cudaSuccess)                                                           \
      return ::ulysses::kernels::internal::CudaError(#call, uly_cuda_err_, __FILE__, __LINE__); \
  } while (0)
