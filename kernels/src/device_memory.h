// Device memory owned by the kernels target's plans, allocated and freed in one stream's order
// where the device has memory pools: a plain cudaFree waits for every stream of the device,
// so destroying a plan while another stream of the process waits (a daemon's other session,
// whose call waits for its peer) would wait with it. Include only from CUDA-aware sources.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "cuda_check.h"

namespace ulysses::kernels::internal {

/// Whether the current device serves cudaMallocAsync (cudaDevAttrMemoryPoolsSupported).
inline bool MemoryPoolsSupported() {
  int device = 0, pools = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return pools != 0;
}

/// One allocation. With a stream (and memory pools), cudaMallocAsync on it, waited for before
/// Allocate returns, and cudaFreeAsync on it when this goes, ordered after that stream's work:
/// the caller orders every use of the memory before the stream's end (or before this goes).
/// Without, cudaMalloc and cudaFree. Neither copied nor moved.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory() {
    if (ptr_ == nullptr) return;
    if (stream_ != nullptr)
      cudaFreeAsync(ptr_, stream_);
    else
      cudaFree(ptr_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  absl::Status Allocate(size_t bytes, cudaStream_t stream = nullptr) {
    if (stream != nullptr && MemoryPoolsSupported()) {
      ULY_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&ptr_, bytes, stream));
      stream_ = stream;
      bytes_ = bytes;
      ULY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      return absl::OkStatus();
    }
    ULY_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, bytes));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void* get() const { return ptr_; }
  /// What Allocate got (0 before).
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;  // set: the memory is the pool's, freed on this stream
};

}  // namespace ulysses::kernels::internal
