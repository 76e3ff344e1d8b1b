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

/// The driver's current-context calls, through its entry points (resolved once): the kernels
/// target links the runtime only.
struct ContextCalls {
  CUresult (*get)(CUcontext*) = nullptr;
  CUresult (*set)(CUcontext) = nullptr;

  static const ContextCalls& Get() {
    static const ContextCalls calls = [] {
      ContextCalls c;
      auto resolve = [](const char* name) -> void* {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
          return nullptr;
        return p;
      };
      c.get = reinterpret_cast<CUresult (*)(CUcontext*)>(resolve("cuCtxGetCurrent"));
      c.set = reinterpret_cast<CUresult (*)(CUcontext)>(resolve("cuCtxSetCurrent"));
      return c;
    }();
    return calls;
  }
};

/// Makes `device` current for a scope, with its primary context where the thread's current
/// context is not on `device`. A thread that never called the runtime has no current context,
/// and the driver calls some launches make fail there (CUTLASS encodes its TMA descriptors with
/// cuTensorMapEncodeTiled, and does not report that failure: the kernel then runs with an unset
/// descriptor and ends the context with an illegal instruction). A thread whose context was on
/// `device` keeps it untouched; one whose context was on another device gets that context back
/// at the scope's end; one that had none keeps `device`'s primary context.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    const ContextCalls& calls = ContextCalls::Get();
    CUcontext current = nullptr;
    if (calls.get != nullptr && calls.set != nullptr && calls.get(&current) == CUDA_SUCCESS &&
        current != nullptr) {
      int on = -1;
      if (cudaGetDevice(&on) == cudaSuccess && on == device) return;  // already there
      saved_ = current;
    }
    status_ = cudaSetDevice(device);
    if (status_ != cudaSuccess) saved_ = nullptr;
  }
  ~ScopedDevice() {
    if (saved_ != nullptr) ContextCalls::Get().set(saved_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  /// cudaSetDevice's result (cudaSuccess where nothing was to be done).
  cudaError_t status() const { return status_; }

 private:
  CUcontext saved_ = nullptr;  // the context to put back, or null
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
