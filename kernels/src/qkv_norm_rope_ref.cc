// CPU reference of the fused QKV op: fp32 math, bf16 rounding exactly where DESIGN.md section 4
// puts it (projection output, normalized value, weighted value, rotated value).
#include <algorithm>
#include <cmath>
#include <vector>

#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::kernels {
namespace {

// fp32 dot product of two bf16 rows of `n` elements: eight partial sums (lane i takes the
// elements k with k % 8 == i), added pairwise at the end.
float DotBf16(const uint16_t* a, const uint16_t* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int i = 0; i < 8; ++i) part[i] += Bf16ToFloat(a[k + i]) * Bf16ToFloat(b[k + i]);
  }
  for (; k < n; ++k) part[k % 8] += Bf16ToFloat(a[k]) * Bf16ToFloat(b[k]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Projects token row `xrow` onto the `count` features starting at `feature`: out[i] =
// bf16(dot(xrow, w[feature + i])).
void ProjectFeatures(const uint16_t* xrow, const uint16_t* w, int64_t hidden, int64_t feature,
                     int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = FloatToBf16(DotBf16(xrow, w + (feature + i) * hidden, hidden));
  }
}

// Steps 2 and 3 on one head vector `v` of D bf16 values, in place. `cs` is the cos/sin row of
// the token's position.
void NormRopeHead(uint16_t* v, const uint16_t* norm_w, const float* cs, int32_t dim) {
  const float sum_sq = HeadSumSquares(v, dim);
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + kFusedRmsEps);
  const int32_t half = dim / 2;
  for (int32_t i = 0; i < half; ++i) {
    const float t0 = Bf16ToFloat(FloatToBf16(Bf16ToFloat(v[2 * i]) * inv_rms));
    const float t1 = Bf16ToFloat(FloatToBf16(Bf16ToFloat(v[2 * i + 1]) * inv_rms));
    const float a = Bf16ToFloat(FloatToBf16(t0 * Bf16ToFloat(norm_w[2 * i])));
    const float b = Bf16ToFloat(FloatToBf16(t1 * Bf16ToFloat(norm_w[2 * i + 1])));
    const float c = cs[i], s = cs[half + i];
    v[2 * i] = FloatToBf16(c * a - s * b);
    v[2 * i + 1] = FloatToBf16(s * a + c * b);
  }
}

const uint16_t* Bf16(const void* p) { return static_cast<const uint16_t*>(p); }

constexpr int32_t kMaxSumPartials = 16;  // lanes of the kernel's half-warp

// Bytes of bf16 rows in a block of QkvProjectRef's rows, and in a block of its features.
constexpr int64_t kProjectBlockBytes = 128 << 10;

}  // namespace

float HeadSumSquares(const uint16_t* v, int32_t dim) {
  int32_t partials = 1;
  while (partials < kMaxSumPartials && dim % (2 * partials) == 0) partials *= 2;
  const int32_t run = dim / partials;
  float part[kMaxSumPartials] = {};
  for (int32_t l = 0; l < partials; ++l) {
    for (int32_t i = 0; i < run; ++i) {
      const float y = Bf16ToFloat(v[l * run + i]);
      part[l] = std::fma(y, y, part[l]);
    }
  }
  for (int32_t stride = partials / 2; stride > 0; stride /= 2) {
    for (int32_t l = 0; l < stride; ++l) part[l] += part[l + stride];
  }
  return part[0];
}

void QkvProjectRef(const void* x, const void* w_qkv, int64_t hidden, int64_t features,
                   int64_t row_begin, int64_t row_end, void* qkv) {
  auto* out = static_cast<uint16_t*>(qkv);
  // In blocks of rows and features of kProjectBlockBytes each, so that a block's weight rows
  // are read from cache by all of its token rows (row by row, each token row streamed the
  // whole of w_qkv from memory). Each output is still one DotBf16: the same bits.
  const int64_t block = std::max<int64_t>(1, kProjectBlockBytes / (hidden * 2));
  for (int64_t t0 = row_begin; t0 < row_end; t0 += block) {
    const int64_t t1 = std::min(row_end, t0 + block);
    for (int64_t f = 0; f < features; f += block) {
      const int64_t count = std::min(block, features - f);
      for (int64_t t = t0; t < t1; ++t) {
        ProjectFeatures(Bf16(x) + t * hidden, Bf16(w_qkv), hidden, f, count,
                        out + t * features + f);
      }
    }
  }
}

void NormRopeRef(const QkvNormRopeShape& shape, const QkvWeights& w, const int32_t* positions,
                 int64_t row_begin, int64_t row_end, void* qkv) {
  const int64_t hd = QkvHidden(shape), features = QkvFeatures(shape);
  auto* rows = static_cast<uint16_t*>(qkv);
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float* cs = w.cos_sin + int64_t{positions[t]} * shape.head_dim;
    for (int plane = 0; plane < 2; ++plane) {
      const uint16_t* norm_w = Bf16(plane == 0 ? w.q_norm : w.k_norm);
      for (int64_t h = 0; h < shape.heads; ++h) {
        NormRopeHead(rows + t * features + plane * hd + h * shape.head_dim, norm_w, cs,
                     shape.head_dim);
      }
    }
  }
}

void QkvNormRopeRef(const QkvNormRopeShape& shape, const QkvWeights& w, const void* x,
                    const int32_t* positions, void* qkv) {
  const int64_t rows = QkvRows(shape);
  QkvProjectRef(x, w.w_qkv, QkvHidden(shape), QkvFeatures(shape), 0, rows, qkv);
  NormRopeRef(shape, w, positions, 0, rows, qkv);
}

void ScatterQkvBlockRef(const QkvNormRopeShape& shape, QkvLayout layout, const void* qkv_src,
                        int src, int dst, void* out_dst) {
  const int64_t hl = QkvLocalHeads(shape), dim = shape.head_dim, hd = QkvHidden(shape);
  const int64_t features = QkvFeatures(shape);
  auto* out = static_cast<uint16_t*>(out_dst);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < shape.seq_local; ++s) {
      const uint16_t* row = Bf16(qkv_src) + (b * shape.seq_local + s) * features;
      const int64_t sg = src * shape.seq_local + s;
      for (int plane = 0; plane < 3; ++plane) {
        for (int64_t h = 0; h < hl; ++h) {
          std::memcpy(out + QkvDestOffset(shape, layout, b, sg, h, plane, 0),
                      row + plane * hd + (dst * hl + h) * dim, dim * sizeof(uint16_t));
        }
      }
    }
  }
}

void QkvNormRopeBlockRef(const QkvNormRopeShape& shape, QkvLayout layout, const QkvWeights& w,
                         const void* x_src, const int32_t* positions_src, int src, int dst,
                         void* out_dst) {
  const int64_t hl = QkvLocalHeads(shape), dim = shape.head_dim, hd = QkvHidden(shape);
  auto* out = static_cast<uint16_t*>(out_dst);
  std::vector<uint16_t> head(static_cast<size_t>(dim));
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < shape.seq_local; ++s) {
      const int64_t t = b * shape.seq_local + s;
      const float* cs = w.cos_sin + int64_t{positions_src[t]} * dim;
      const int64_t sg = src * shape.seq_local + s;
      for (int plane = 0; plane < 3; ++plane) {
        for (int64_t h = 0; h < hl; ++h) {
          ProjectFeatures(Bf16(x_src) + t * hd, Bf16(w.w_qkv), hd,
                          plane * hd + (dst * hl + h) * dim, dim, head.data());
          if (plane < 2) {
            NormRopeHead(head.data(), Bf16(plane == 0 ? w.q_norm : w.k_norm), cs, shape.head_dim);
          }
          std::memcpy(out + QkvDestOffset(shape, layout, b, sg, h, plane, 0), head.data(),
                      dim * sizeof(uint16_t));
        }
      }
    }
  }
}

}  // namespace ulysses::kernels
