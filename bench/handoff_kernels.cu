#include "handoff_kernels.h"

#include <cuda/atomic>

namespace ulysses::bench {
namespace {

__global__ void EmptyKernel() {}

__global__ void Store(uint64_t* word, uint64_t value) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*word).store(value,
                                                                     cuda::memory_order_release);
}

__global__ void Poll(const uint64_t* word, uint64_t value) {
  cuda::atomic_ref<const uint64_t, cuda::thread_scope_system> w(*word);
  while (w.load(cuda::memory_order_acquire) < value) {
  }
}

__global__ void SpinSide(uint64_t* words, uint64_t base, int rounds, bool ping) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system> a(words[kWordA]), b(words[kWordB]);
  for (int i = 1; i <= rounds; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (ping) {
      b.store(v, cuda::memory_order_release);
      while (a.load(cuda::memory_order_acquire) < v) {
      }
    } else {
      while (b.load(cuda::memory_order_acquire) < v) {
      }
      a.store(v, cuda::memory_order_release);
    }
  }
}

}  // namespace

cudaError_t LaunchEmpty(cudaStream_t stream) {
  EmptyKernel<<<1, 32, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchStore(uint64_t* word, uint64_t value, cudaStream_t stream) {
  Store<<<1, 1, 0, stream>>>(word, value);
  return cudaGetLastError();
}

cudaError_t LaunchPoll(const uint64_t* word, uint64_t value, cudaStream_t stream) {
  Poll<<<1, 1, 0, stream>>>(word, value);
  return cudaGetLastError();
}

cudaError_t LaunchSpinSide(uint64_t* words, uint64_t base, int rounds, bool ping,
                           cudaStream_t stream) {
  SpinSide<<<1, 1, 0, stream>>>(words, base, rounds, ping);
  return cudaGetLastError();
}

}  // namespace ulysses::bench
