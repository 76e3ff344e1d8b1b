// The two kernels of ulysses-handoff-bench, compiled as CUDA; the bench itself is C++20.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ulysses::bench {

/// The shared words of a ping-pong: A (pong -> ping), B (ping -> pong), and one the pong
/// process may write before its rounds (--pong-copy).
inline constexpr int kWordA = 0, kWordB = 1, kWordScratch = 2, kWordCount = 3;

/// An empty kernel of one warp on `stream`.
cudaError_t LaunchEmpty(cudaStream_t stream);
/// One thread stores `value` into `word` with a system-scope release store.
cudaError_t LaunchStore(uint64_t* word, uint64_t value, cudaStream_t stream);
/// One thread polls `word` with acquire loads until it is at least `value`.
cudaError_t LaunchPoll(const uint64_t* word, uint64_t value, cudaStream_t stream);
/// One side of the spin mode on `stream`: one resident thread doing `rounds` hand-offs each
/// way with acquire loads and release stores of system scope (values base + 1 ... base + rounds).
cudaError_t LaunchSpinSide(uint64_t* words, uint64_t base, int rounds, bool ping,
                           cudaStream_t stream);

}  // namespace ulysses::bench
