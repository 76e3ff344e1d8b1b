// The fused QKV op (QKV projection + QK-RMSNorm + interleaved RoPE + head exchange, DESIGN.md
// section 4): its shape, its weights, and the CPU reference of every step and of every
// exchange block.
//
// Host-visible; compiles as C++17 so that .cu files can include it. Nothing here allocates,
// synchronizes or returns an error: callers validate first (ulysses::common fused.h, or the
// checks of the CUDA launchers), and the functions assume valid arguments.
//
// Element types: bf16 values travel as their 16-bit patterns (uint16_t in memory), cos/sin
// as float32, positions as int32. Buffer index spaces, with F = 3*H*D projection features:
//   x[t, k]          t = b*S_l + s in [0, B*S_l), k in [0, hidden = H*D)
//   w_qkv[n, k]      n = plane*H*D + head*D + d, plane 0 = Q, 1 = K, 2 = V
//   qkv[t, n]        the projection of token t (row-major [B*S_l, F])
//   cos_sin[p, j]    p = position; cos(theta_{p,i}) at j = i, sin at j = D/2 + i, i < D/2
//   positions[t]     position of token t, in [0, max_pos)
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ulysses/common/fused.h"
#include "ulysses/kernels/exchange.h"  // ULY_HOST_DEVICE

namespace ulysses::kernels {

using ::ulysses::QkvLayout;

/// Geometry of one fused call, seen from the calling (source) rank. Trivially copyable;
/// shared by host and device code. hidden = heads * head_dim; H_l = heads / world;
/// S_g = world * seq_local. Valid when every field is positive, heads % world == 0 and
/// head_dim is even.
struct QkvNormRopeShape {
  int32_t world;      ///< W: ranks in the group.
  int32_t heads;      ///< H: global heads.
  int32_t head_dim;   ///< D.
  int32_t max_pos;    ///< rows of the cos/sin table.
  int64_t batch;      ///< B.
  int64_t seq_local;  ///< S_l: tokens per rank.
};
static_assert(std::is_trivially_copyable_v<QkvNormRopeShape>);
static_assert(sizeof(QkvNormRopeShape) == 32);

/// The session's weights (not owned). On the GPU paths these are device pointers.
struct QkvWeights {
  const void* w_qkv;     ///< bf16 [3*H*D, hidden]
  const void* q_norm;    ///< bf16 [D]: RMSNorm weight of every Q head
  const void* k_norm;    ///< bf16 [D]: RMSNorm weight of every K head
  const float* cos_sin;  ///< fp32 [max_pos, D]
};

ULY_HOST_DEVICE constexpr int64_t QkvHidden(const QkvNormRopeShape& s) {
  return int64_t{s.heads} * s.head_dim;
}
ULY_HOST_DEVICE constexpr int64_t QkvFeatures(const QkvNormRopeShape& s) {
  return 3 * QkvHidden(s);
}
ULY_HOST_DEVICE constexpr int64_t QkvRows(const QkvNormRopeShape& s) {
  return s.batch * s.seq_local;
}
ULY_HOST_DEVICE constexpr int64_t QkvLocalHeads(const QkvNormRopeShape& s) {
  return s.heads / s.world;
}
ULY_HOST_DEVICE constexpr int64_t QkvGlobalSeq(const QkvNormRopeShape& s) {
  return s.world * s.seq_local;
}
/// P = B * S_g * H_l * D: elements of each of q, k, v in a destination's result. The bshd
/// result stores q at [0, P), k at [P, 2P), v at [2P, 3P); both layouts take 3P elements.
ULY_HOST_DEVICE constexpr int64_t QkvPlaneElems(const QkvNormRopeShape& s) {
  return s.batch * QkvGlobalSeq(s) * QkvLocalHeads(s) * s.head_dim;
}

/// Element offset in destination `dst`'s result of element d of local head h of `plane`
/// (0 q, 1 k, 2 v) for global sequence index sg of batch b.
ULY_HOST_DEVICE constexpr int64_t QkvDestOffset(const QkvNormRopeShape& s, QkvLayout layout,
                                                int64_t b, int64_t sg, int64_t h, int plane,
                                                int64_t d) {
  const int64_t hl = QkvLocalHeads(s), dim = s.head_dim;
  const int64_t token = b * QkvGlobalSeq(s) + sg;
  return layout == QkvLayout::kFused ? (token * hl + h) * 3 * dim + plane * dim + d
                                     : plane * QkvPlaneElems(s) + (token * hl + h) * dim + d;
}

/// bf16 bit pattern -> float (exact).
inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float -> bf16 bit pattern, round to nearest even (NaN stays a quiet NaN).
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// Step 1, projection: qkv[t, n] = bf16(sum_k x[t, k] * w_qkv[n, k]) for t in
/// [row_begin, row_end) and every n in [0, features), in fp32 (eight partial sums over k, then
/// their sum). `x` is [rows, hidden] and `qkv` [rows, features], both indexed by absolute t.
void QkvProjectRef(const void* x, const void* w_qkv, int64_t hidden, int64_t features,
                   int64_t row_begin, int64_t row_end, void* qkv);

/// sum(y^2) over one head of `dim` bf16 values, added in the order of the CUDA kernel (so that
/// the reference and the kernel agree bit for bit): L = min(16, the largest power of two that
/// divides dim) partial sums, partial l over the dim/L consecutive elements starting at
/// l*dim/L, each accumulated from 0 with fused multiply-adds (p = fma(y, y, p)); then the L
/// partials are combined pairwise: p_l += p_(l+L/2) for l < L/2, then L/4, ..., 1; p_0 is the
/// sum. For D = 128: 16 partials of 8 elements (one 16-byte vector per lane of a half-warp),
/// combined as the half-warp's xor butterfly does (offsets 8, 4, 2, 1).
float HeadSumSquares(const uint16_t* v, int32_t dim);

/// Steps 2 and 3 in place on rows [row_begin, row_end) of `qkv` [B*S_l, 3*H*D]: per head of
/// the Q and K planes, t = bf16(y * rsqrt(mean(y^2) + 1e-6)) (the sum as HeadSumSquares adds
/// it; 1/sqrt with both steps correctly rounded), u = bf16(t * w) (w = q_norm or
/// k_norm), then for each pair (2i, 2i+1) with c = cos_sin[pos, i], s = cos_sin[pos, D/2+i]:
/// o0 = bf16(c*a - s*b), o1 = bf16(s*a + c*b). V is left as it is. Reads w.q_norm, w.k_norm,
/// w.cos_sin (not w.w_qkv).
void NormRopeRef(const QkvNormRopeShape& shape, const QkvWeights& w, const int32_t* positions,
                 int64_t row_begin, int64_t row_end, void* qkv);

/// The whole local op (what one rank computes before the exchange): QkvProjectRef then
/// NormRopeRef over all B*S_l rows into `qkv` [B*S_l, 3*H*D]. With W = 1 this is the fused op.
void QkvNormRopeRef(const QkvNormRopeShape& shape, const QkvWeights& w, const void* x,
                    const int32_t* positions, void* qkv);

// ---------------------------------------------------------------------------------------
// Block references. The block (src, dst) is what source rank `src` contributes to destination
// rank `dst`: src's B*S_l tokens (global sequence indices src*S_l + s) of dst's head band
// [dst*H_l, (dst+1)*H_l), for q, k and v. `out_dst` is dst's result buffer of 3P elements
// (see QkvPlaneElems / QkvDestOffset); each function writes ONLY that block, so the blocks of
// all pairs can land in one buffer in any order. Requires 0 <= src, dst < world.
// ---------------------------------------------------------------------------------------

/// Exchange half: copies the band from `qkv_src` (src's QkvNormRopeRef result,
/// [B*S_l, 3*H*D]):  out_dst[QkvDestOffset(b, src*S_l + s, h, plane, d)] =
/// qkv_src[b*S_l + s, plane*H*D + (dst*H_l + h)*D + d].
void ScatterQkvBlockRef(const QkvNormRopeShape& shape, QkvLayout layout, const void* qkv_src,
                        int src, int dst, void* out_dst);

/// The fused block: computes, from src's input x_src [B*S_l, hidden] and positions_src
/// [B*S_l], only dst's band of the projection (a 1/W share of the GEMM), applies steps 2 and 3
/// to its Q and K heads and stores the block. Equal to QkvNormRopeRef followed by
/// ScatterQkvBlockRef, bit for bit.
void QkvNormRopeBlockRef(const QkvNormRopeShape& shape, QkvLayout layout, const QkvWeights& w,
                         const void* x_src, const int32_t* positions_src, int src, int dst,
                         void* out_dst);

}  // namespace ulysses::kernels
