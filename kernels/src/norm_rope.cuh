// Device helpers of the fused QKV op shared by its kernels (norm_rope.cu, fused_epilogue.cu):
// bf16 packing, the release store of a readiness word, and the RMSNorm + interleaved RoPE of
// one 128-wide head held by a half-warp. Include only from .cu sources.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::kernels::internal {

inline constexpr int kHeadDim = kFusedGpuHeadDim;
inline constexpr int kHeadLanes = 16;                   // lanes per head
inline constexpr int kHeadVec = kHeadDim / kHeadLanes;  // bf16 elements per lane
static_assert(kHeadVec == 8, "a lane holds one 16-byte vector of its head");

__device__ __forceinline__ float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ void Unpack(const uint4& raw, float (&v)[kHeadVec]) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kHeadVec / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void StoreRelease(uint64_t* word, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

/// This lane's 8 norm weights (bf16 [128] `norm_w`, elements [8*lane, 8*lane + 8)).
__device__ __forceinline__ void LoadNormWeights(const uint16_t* norm_w, int lane,
                                                float (&w)[kHeadVec]) {
  Unpack(*reinterpret_cast<const uint4*>(norm_w + lane * kHeadVec), w);
}

/// This lane's cos and sin values of its 4 pairs from a cos/sin row (fp32 [128]).
struct CosSin {
  float4 c, s;
};
__device__ __forceinline__ CosSin LoadCosSin(const float* cos_sin_row, int lane) {
  return {*reinterpret_cast<const float4*>(cos_sin_row + lane * (kHeadVec / 2)),
          *reinterpret_cast<const float4*>(cos_sin_row + kHeadDim / 2 + lane * (kHeadVec / 2))};
}

/// RMSNorm + interleaved RoPE of one head in registers (NormRopeRef's steps 2 and 3). Lane
/// `lane` (0..15) of a half-warp holds elements [8*lane, 8*lane + 8) of the head in `raw`,
/// `w` its norm weights (LoadNormWeights) and `cs` the cos/sin of its pairs for the token's
/// position (LoadCosSin). Every lane of the warp must call this together (the sum of squares
/// is a half-warp xor butterfly); a lane with `apply` false takes part in the sum and leaves
/// `raw` as it is (a lane without an item, or a V head); its `w` and `cs` are not read.
__device__ __forceinline__ void NormRopeHead(uint4& raw, bool apply, const float (&w)[kHeadVec],
                                             const CosSin& cs) {
  float y[kHeadVec];
  Unpack(raw, y);
  // sum(y^2) in the order HeadSumSquares (the reference) adds it: each lane's 8 elements by
  // fused multiply-adds, then the half-warp's xor butterfly (offsets 8, 4, 2, 1).
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kHeadVec; ++i) sum_sq = __fmaf_rn(y[i], y[i], sum_sq);
#pragma unroll
  for (int offset = kHeadLanes / 2; offset > 0; offset /= 2) {
    sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
  }
  if (!apply) return;
  // 1 / sqrt(x) with both steps correctly rounded, as the reference computes it.
  const float inv_rms =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(sum_sq * (1.0f / kHeadDim), kFusedRmsEps)));
  const float cv[4] = {cs.c.x, cs.c.y, cs.c.z, cs.c.w}, sv[4] = {cs.s.x, cs.s.y, cs.s.z, cs.s.w};
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kHeadVec / 2; ++i) {
    const float a = RoundBf16(__fmul_rn(RoundBf16(__fmul_rn(y[2 * i], inv_rms)), w[2 * i]));
    const float b =
        RoundBf16(__fmul_rn(RoundBf16(__fmul_rn(y[2 * i + 1], inv_rms)), w[2 * i + 1]));
    // Separate roundings (no FMA contraction), as the reference.
    const float o0 = __fsub_rn(__fmul_rn(cv[i], a), __fmul_rn(sv[i], b));
    const float o1 = __fadd_rn(__fmul_rn(sv[i], a), __fmul_rn(cv[i], b));
    pairs[i] = __floats2bfloat162_rn(o0, o1);
  }
}

/// The cos/sin row of position `pos`, clamped into [0, max_pos).
__device__ __forceinline__ const float* CosSinRow(const float* cos_sin, int32_t pos,
                                                  int32_t max_pos) {
  return cos_sin + int64_t{min(max(pos, 0), max_pos - 1)} * kHeadDim;
}

}  // namespace ulysses::kernels::internal
