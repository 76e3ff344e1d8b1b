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

/// A bf16 pair's two values (the low half first) as floats: a bf16 is the high half of its
/// float, so each is one bit operation (the intrinsic's conversion takes two for the high
/// half).
__device__ __forceinline__ float2 UnpackPair(uint32_t pair) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}

__device__ __forceinline__ void Unpack(const uint4& raw, float (&v)[kHeadVec]) {
  const uint32_t pairs[kHeadVec / 2] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < kHeadVec / 2; ++i) {
    const float2 f = UnpackPair(pairs[i]);
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

/// Sum of y^2 over a lane's 8 elements by fused multiply-adds in order: one partial of the
/// reference's sum (HeadSumSquares).
__device__ __forceinline__ float SumSquares(const float (&y)[kHeadVec]) {
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kHeadVec; ++i) sum_sq = __fmaf_rn(y[i], y[i], sum_sq);
  return sum_sq;
}

/// 1 / sqrt(mean + eps) of a head's sum of squares, both steps correctly rounded, as the
/// reference computes it.
__device__ __forceinline__ float InvRms(float sum_sq) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(sum_sq * (1.0f / kHeadDim), kFusedRmsEps)));
}

/// This lane's 8 norm weights as they are stored: 4 bf16 pairs.
__device__ __forceinline__ uint4 LoadNormWeightPairs(const uint16_t* norm_w, int lane) {
  return *reinterpret_cast<const uint4*>(norm_w + lane * kHeadVec);
}

/// The norm and RoPE of 8 elements of a head, `y` (Unpack of them), into `raw` (4 pairs),
/// with its weights (pair i from `weight_pair(i)`) and the cos/sin `cs` of its pairs.
template <class WeightPair>
__device__ __forceinline__ void NormRopeVecWith(uint4& raw, const float (&y)[kHeadVec],
                                                float inv_rms, WeightPair weight_pair,
                                                const CosSin& cs) {
  const float cv[4] = {cs.c.x, cs.c.y, cs.c.z, cs.c.w}, sv[4] = {cs.s.x, cs.s.y, cs.s.z, cs.s.w};
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kHeadVec / 2; ++i) {
    // The reference rounds y * inv_rms to bf16, then that times the bf16 weight to bf16. The
    // second product, of two bf16 values, has at most 16 significant bits, so one bf16x2
    // multiply rounding it once gives the same bits: an fp32 rounding first (below 2^-126,
    // where fp32 keeps fewer bits) could change the bf16 result only by landing on a bf16
    // midpoint from beside it, which takes a 17th bit.
    const __nv_bfloat162 normed =
        __floats2bfloat162_rn(__fmul_rn(y[2 * i], inv_rms), __fmul_rn(y[2 * i + 1], inv_rms));
    const __nv_bfloat162 product = __hmul2_rn(normed, weight_pair(i));
    const float2 ab = UnpackPair(*reinterpret_cast<const uint32_t*>(&product));
    // Separate roundings (no FMA contraction), as the reference.
    const float o0 = __fsub_rn(__fmul_rn(cv[i], ab.x), __fmul_rn(sv[i], ab.y));
    const float o1 = __fadd_rn(__fmul_rn(sv[i], ab.x), __fmul_rn(cv[i], ab.y));
    pairs[i] = __floats2bfloat162_rn(o0, o1);
  }
}

/// NormRopeVecWith, the weights as floats (LoadNormWeights; their conversion back to bf16 is
/// exact, and the same for every row), as NormRopeHead's callers load them ...
__device__ __forceinline__ void NormRopeVec(uint4& raw, const float (&y)[kHeadVec],
                                            float inv_rms, const float (&w)[kHeadVec],
                                            const CosSin& cs) {
  NormRopeVecWith(
      raw, y, inv_rms, [&](int i) { return __floats2bfloat162_rn(w[2 * i], w[2 * i + 1]); },
      cs);
}

/// ... or as they are stored (LoadNormWeightPairs).
__device__ __forceinline__ void NormRopeVec(uint4& raw, const float (&y)[kHeadVec],
                                            float inv_rms, const uint4& w, const CosSin& cs) {
  NormRopeVecWith(
      raw, y, inv_rms,
      [&](int i) {
        const uint32_t bits = i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
        return *reinterpret_cast<const __nv_bfloat162*>(&bits);
      },
      cs);
}

/// RMSNorm + interleaved RoPE of one head in registers (NormRopeRef's steps 2 and 3). Lane
/// `lane` (0..15) of a half-warp holds elements [8*lane, 8*lane + 8) of the head in `raw`,
/// `w` its norm weights (LoadNormWeights as floats, or LoadNormWeightPairs as stored) and
/// `cs` the cos/sin of its pairs for the token's position (LoadCosSin). Every lane of the
/// warp must call this together (the sum of squares is a half-warp xor butterfly); a lane
/// with `apply` false takes part in the sum and leaves `raw` as it is (a lane without an
/// item, or a V head); its `w` and `cs` are not read.
template <class Weights>
__device__ __forceinline__ void NormRopeHead(uint4& raw, bool apply, const Weights& w,
                                             const CosSin& cs) {
  float y[kHeadVec];
  Unpack(raw, y);
  // sum(y^2) in the order HeadSumSquares (the reference) adds it: each lane's 8 elements,
  // then the half-warp's xor butterfly (offsets 8, 4, 2, 1).
  float sum_sq = SumSquares(y);
#pragma unroll
  for (int offset = kHeadLanes / 2; offset > 0; offset /= 2) {
    sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
  }
  if (!apply) return;
  NormRopeVec(raw, y, InvRms(sum_sq), w, cs);
}

/// The cos/sin row of position `pos`, clamped into [0, max_pos).
__device__ __forceinline__ const float* CosSinRow(const float* cos_sin, int32_t pos,
                                                  int32_t max_pos) {
  return cos_sin + int64_t{min(max(pos, 0), max_pos - 1)} * kHeadDim;
}

}  // namespace ulysses::kernels::internal
