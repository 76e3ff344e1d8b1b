// Test helpers for the fused QKV op: random problems (per-rank inputs and shared weights with
// realistic scales) and a bf16 comparison that separates one-ulp flips from real mismatches.
// Used by tests/kernels and tests/gpu.
#pragma once

#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::kernels::testing {

// Every rank's x and positions, and the session's weights, as host arrays.
struct QkvProblem {
  QkvNormRopeShape shape{};
  std::vector<std::vector<uint16_t>> x;         // [W][B*S_l*hidden] bf16
  std::vector<std::vector<int32_t>> positions;  // [W][B*S_l]
  std::vector<uint16_t> w_qkv;                  // [3*H*D * hidden] bf16
  std::vector<uint16_t> q_norm, k_norm;         // [D] bf16
  std::vector<float> cos_sin;                   // [max_pos * D]

  QkvWeights weights() const {
    return {w_qkv.data(), q_norm.data(), k_norm.data(), cos_sin.data()};
  }
};

inline std::vector<uint16_t> RandomBf16(size_t n, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = FloatToBf16(dist(rng));
  return out;
}

// x ~ U(-1, 1); W_qkv ~ U(-1, 1) * sqrt(3 / hidden) so that projections are O(1); norm
// weights ~ U(0.5, 1.5); cos/sin of theta = pos * 10000^(-2i/D); positions ~ U[0, max_pos).
inline QkvProblem MakeQkvProblem(const QkvNormRopeShape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  QkvProblem p;
  p.shape = shape;
  const int64_t hidden = QkvHidden(shape), rows = QkvRows(shape), dim = shape.head_dim;
  const float w_scale = std::sqrt(3.0f / static_cast<float>(hidden));
  p.w_qkv = RandomBf16(static_cast<size_t>(QkvFeatures(shape) * hidden), -w_scale, w_scale, rng);
  p.q_norm = RandomBf16(static_cast<size_t>(dim), 0.5f, 1.5f, rng);
  p.k_norm = RandomBf16(static_cast<size_t>(dim), 0.5f, 1.5f, rng);
  p.cos_sin.resize(static_cast<size_t>(shape.max_pos * dim));
  for (int64_t pos = 0; pos < shape.max_pos; ++pos) {
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double theta =
          static_cast<double>(pos) * std::pow(10000.0, -2.0 * static_cast<double>(i) / dim);
      p.cos_sin[pos * dim + i] = static_cast<float>(std::cos(theta));
      p.cos_sin[pos * dim + dim / 2 + i] = static_cast<float>(std::sin(theta));
    }
  }
  std::uniform_int_distribution<int32_t> pos_dist(0, shape.max_pos - 1);
  for (int r = 0; r < shape.world; ++r) {
    p.x.push_back(RandomBf16(static_cast<size_t>(rows * hidden), -1.0f, 1.0f, rng));
    std::vector<int32_t> pos(static_cast<size_t>(rows));
    for (auto& v : pos) v = pos_dist(rng);
    p.positions.push_back(std::move(pos));
  }
  return p;
}

// Outcome of comparing bf16 results with a reference at |got - want| <= atol + rtol * |want|.
struct Bf16Diff {
  int64_t elements = 0;
  int64_t equal = 0;       // identical bits
  int64_t flips = 0;       // adjacent bf16 values (one ulp apart), whether within tol or not
  int64_t mismatches = 0;  // outside the tolerance and not a one-ulp flip (or NaN)
  int64_t first_mismatch = -1;
  float max_abs_err = 0.0f;
};

inline std::ostream& operator<<(std::ostream& os, const Bf16Diff& d) {
  return os << d.elements << " elements: " << d.equal << " equal, " << d.flips << " one-ulp flips, "
            << d.mismatches << " mismatches (first at " << d.first_mismatch << "), max abs error "
            << d.max_abs_err;
}

inline bool OneUlpApart(uint16_t a, uint16_t b) {
  if ((a & 0x8000u) != (b & 0x8000u)) return (a & 0x7fffu) == 0 && (b & 0x7fffu) == 0;
  const int ma = a & 0x7fff, mb = b & 0x7fff;
  return ma - mb == 1 || mb - ma == 1;
}

inline Bf16Diff CompareBf16(const uint16_t* got, const uint16_t* want, int64_t n,
                            float atol = 1e-2f, float rtol = 1e-2f) {
  Bf16Diff d;
  d.elements = n;
  for (int64_t i = 0; i < n; ++i) {
    if (got[i] == want[i]) {
      ++d.equal;
      continue;
    }
    const float g = Bf16ToFloat(got[i]), w = Bf16ToFloat(want[i]);
    const float err = std::fabs(g - w);
    if (std::isnan(err)) {
      if (d.mismatches++ == 0) d.first_mismatch = i;
      continue;
    }
    d.max_abs_err = std::fmax(d.max_abs_err, err);
    if (OneUlpApart(got[i], want[i])) {
      ++d.flips;
    } else if (!(err <= atol + rtol * std::fabs(w))) {
      if (d.mismatches++ == 0) d.first_mismatch = i;
    }
  }
  return d;
}

}  // namespace ulysses::kernels::testing
