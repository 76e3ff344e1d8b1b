// The fused QKV op's per-head kernels: RMSNorm + interleaved RoPE of Q and K heads, the copy of
// q, k, v heads into W destination buffers, and both in one pass. One kernel template, three
// modes; a half-warp owns one 128-wide head, a lane 8 consecutive elements (16 bytes).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cancel.cuh"
#include "cuda_check.h"
#include "norm_rope.cuh"
#include "qkv_checks.h"
#include "ulysses/common/status.h"
#include "ulysses/kernels/qkv_norm_rope_cuda.h"

namespace ulysses::kernels {
namespace {

constexpr int kDim = internal::kHeadDim;
constexpr int kLanes = internal::kHeadLanes;
constexpr int kVec = internal::kHeadVec;
constexpr int kThreads = 256;
constexpr int kHeadsPerBlock = kThreads / kLanes;

enum class Mode { kInPlace, kScatter, kNormRopeScatter };

// Everything a launch needs; passed by value (about 1.1 KiB of kernel parameters).
struct QkvKernelParams {
  QkvNormRopeShape shape;
  QkvLayout layout;
  int32_t src;
  int32_t rows;  // row_end - row_begin
  int64_t row_begin;
  const uint16_t* qkv;  // [B*S_l, 3*H*D] bf16, absolute rows
  uint16_t* qkv_out;    // kInPlace: same as qkv
  const uint16_t* q_norm;
  const uint16_t* k_norm;
  const float* cos_sin;
  const int32_t* positions;
  uint16_t* out[kMaxWorldSize];    // out[dst]: dst's 3P-element result
  uint64_t* ready[kMaxWorldSize];  // ready[dst]: readiness word, or null
  uint64_t epoch;
  unsigned int* counter;  // blocks finished; null: no readiness words
  const uint64_t* cancel;  // nonzero word: store nothing; null: always store
};

// Grid-stride over items (row, plane, head). The two half-warps of a warp take consecutive
// items and run the loop the same number of times, so the half-warp shuffles of the norm always
// have all 32 lanes present (a half without an item computes on zeros and stores nothing).
template <Mode kMode>
__global__ void __launch_bounds__(kThreads) QkvHeadKernel(const QkvKernelParams p) {
  const int32_t heads = p.shape.heads;
  const int32_t planes = kMode == Mode::kInPlace ? 2 : 3;
  const int32_t per_row = planes * heads;
  const int32_t items = p.rows * per_row;  // < 2^31: rows * 3H * D fits the int32 slot limit
  const int32_t lane = threadIdx.x % kLanes;
  const int32_t half = (threadIdx.x / kLanes) % 2;
  const int64_t hd = int64_t{heads} * kDim, features = 3 * hd;
  const int32_t hl = heads / p.shape.world;
  const int32_t warps = gridDim.x * (kThreads / 32);
  // A cancelled session's launch computes nothing and stores nothing; its readiness protocol
  // below still runs so the counter is left as it was found.
  const bool cancelled = kMode != Mode::kInPlace && internal::BlockCancelled(p.cancel);
  for (int32_t wi = (blockIdx.x * kThreads + threadIdx.x) / 32; !cancelled && wi * 2 < items;
       wi += warps) {
    const int32_t item = wi * 2 + half;
    const bool valid = item < items;
    const int32_t local_row = valid ? item / per_row : 0;
    const int32_t rem = valid ? item % per_row : 0;
    const int32_t plane = rem / heads, head = rem % heads;
    const int64_t row = p.row_begin + local_row;
    const int64_t at = row * features + plane * hd + int64_t{head} * kDim + lane * kVec;
    uint4 raw = valid ? *reinterpret_cast<const uint4*>(p.qkv + at) : make_uint4(0, 0, 0, 0);
    if constexpr (kMode != Mode::kScatter) {
      const bool apply = valid && plane < 2;
      float w[kVec] = {};
      internal::CosSin cs{};
      if (apply) {
        internal::LoadNormWeights(plane == 0 ? p.q_norm : p.k_norm, lane, w);
        cs = internal::LoadCosSin(
            internal::CosSinRow(p.cos_sin, p.positions[row], p.shape.max_pos), lane);
      }
      internal::NormRopeHead(raw, apply, w, cs);
    }
    if (!valid) continue;
    if constexpr (kMode == Mode::kInPlace) {
      *reinterpret_cast<uint4*>(p.qkv_out + at) = raw;
    } else {
      const int32_t dst = head / hl, h = head % hl;
      const int64_t b = row / p.shape.seq_local, s = row % p.shape.seq_local;
      const int64_t out_at =
          QkvDestOffset(p.shape, p.layout, b, p.src * p.shape.seq_local + s, h, plane, lane * kVec);
      *reinterpret_cast<uint4*>(p.out[dst] + out_at) = raw;
    }
  }
  if constexpr (kMode != Mode::kInPlace) {
    if (p.counter == nullptr) return;
    // Every thread orders its stores before the block's arrival; the last block to arrive has
    // seen all arrivals (fence after the atomic), so its release stores of the ready words
    // follow every store of the grid.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned int arrived = atomicAdd(p.counter, 1u);
      if (arrived == gridDim.x - 1) {
        __threadfence_system();
        for (int d = 0; d < p.shape.world; ++d) {
          if (p.ready[d] != nullptr) internal::StoreRelease(p.ready[d], p.epoch);
        }
        atomicExch(p.counter, 0u);
      }
    }
  }
}

using internal::CheckAligned;
using internal::CheckShapeAndRows;
using internal::CheckWeights;

absl::Status FillDestinations(const QkvNormRopeShape& s, QkvLayout layout, int src,
                              const QkvDestinations& dests, unsigned int* counter,
                              QkvKernelParams& p) {
  ULY_RETURN_IF_ERROR(internal::CheckDestinations(s, layout, src, dests, counter));
  p.layout = layout;
  p.src = src;
  for (int d = 0; d < s.world; ++d) {
    p.out[d] = static_cast<uint16_t*>(dests.out[d]);
    p.ready[d] = dests.ready != nullptr ? dests.ready[d] : nullptr;
  }
  p.epoch = dests.epoch;
  p.cancel = dests.cancel;
  p.counter = dests.ready != nullptr ? counter : nullptr;
  return absl::OkStatus();
}

template <Mode kMode>
absl::Status Launch(const QkvKernelParams& p, cudaStream_t stream, QkvLaunchOptions options) {
  const int32_t planes = kMode == Mode::kInPlace ? 2 : 3;
  const int64_t items = int64_t{p.rows} * planes * p.shape.heads;
  int device = 0, sms = 0;
  ULY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ULY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int64_t blocks = std::min<int64_t>((items + kHeadsPerBlock - 1) / kHeadsPerBlock, 8 * sms);
  if (options.max_blocks > 0) blocks = std::min<int64_t>(blocks, options.max_blocks);
  QkvHeadKernel<kMode><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  ULY_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

QkvKernelParams BaseParams(const QkvNormRopeShape& shape, const void* qkv, int64_t row_begin,
                           int64_t row_end) {
  QkvKernelParams p{};
  p.shape = shape;
  p.rows = static_cast<int32_t>(row_end - row_begin);
  p.row_begin = row_begin;
  p.qkv = static_cast<const uint16_t*>(qkv);
  return p;
}

void SetWeights(const QkvWeights& w, const int32_t* positions, QkvKernelParams& p) {
  p.q_norm = static_cast<const uint16_t*>(w.q_norm);
  p.k_norm = static_cast<const uint16_t*>(w.k_norm);
  p.cos_sin = w.cos_sin;
  p.positions = positions;
}

}  // namespace

absl::Status LaunchNormRope(const QkvNormRopeShape& shape, const QkvWeights& w,
                            const int32_t* positions, int64_t row_begin, int64_t row_end, void* qkv,
                            cudaStream_t stream, QkvLaunchOptions options) {
  ULY_RETURN_IF_ERROR(CheckShapeAndRows(shape, row_begin, row_end));
  ULY_RETURN_IF_ERROR(CheckAligned("qkv", qkv));
  ULY_RETURN_IF_ERROR(CheckWeights(w, positions));
  QkvKernelParams p = BaseParams(shape, qkv, row_begin, row_end);
  p.qkv_out = static_cast<uint16_t*>(qkv);
  SetWeights(w, positions, p);
  return Launch<Mode::kInPlace>(p, stream, options);
}

absl::Status LaunchQkvScatter(const QkvNormRopeShape& shape, QkvLayout layout, const void* qkv,
                              int src, int64_t row_begin, int64_t row_end,
                              const QkvDestinations& dests, unsigned int* counter,
                              cudaStream_t stream, QkvLaunchOptions options) {
  ULY_RETURN_IF_ERROR(CheckShapeAndRows(shape, row_begin, row_end));
  ULY_RETURN_IF_ERROR(CheckAligned("qkv", qkv));
  QkvKernelParams p = BaseParams(shape, qkv, row_begin, row_end);
  ULY_RETURN_IF_ERROR(FillDestinations(shape, layout, src, dests, counter, p));
  return Launch<Mode::kScatter>(p, stream, options);
}

absl::Status LaunchNormRopeScatter(const QkvNormRopeShape& shape, QkvLayout layout,
                                   const QkvWeights& w, const int32_t* positions, const void* qkv,
                                   int src, int64_t row_begin, int64_t row_end,
                                   const QkvDestinations& dests, unsigned int* counter,
                                   cudaStream_t stream, QkvLaunchOptions options) {
  ULY_RETURN_IF_ERROR(CheckShapeAndRows(shape, row_begin, row_end));
  ULY_RETURN_IF_ERROR(CheckAligned("qkv", qkv));
  ULY_RETURN_IF_ERROR(CheckWeights(w, positions));
  QkvKernelParams p = BaseParams(shape, qkv, row_begin, row_end);
  SetWeights(w, positions, p);
  ULY_RETURN_IF_ERROR(FillDestinations(shape, layout, src, dests, counter, p));
  return Launch<Mode::kNormRopeScatter>(p, stream, options);
}

}  // namespace ulysses::kernels
