// The CPU reference of the fused QKV op: hand-checked small cases of each step, and the
// properties that tie the block functions to the plain op (W = 1 is the plain op; the blocks
// of all (src, dst) pairs redistribute it exactly, each block touching only its own region).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "qkv_test_util.h"
#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::kernels {
namespace {

using testing::MakeQkvProblem;
using testing::QkvProblem;

std::vector<uint16_t> Bf16s(std::initializer_list<float> values) {
  std::vector<uint16_t> out;
  for (float v : values) out.push_back(FloatToBf16(v));
  return out;
}

std::vector<float> Floats(const std::vector<uint16_t>& bits) {
  std::vector<float> out;
  for (uint16_t b : bits) out.push_back(Bf16ToFloat(b));
  return out;
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even pattern (1.0).
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3f80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: the even one is 1 + 2^-6.
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3f82);
  EXPECT_EQ(FloatToBf16(1.0f + 1.0f / 128 + 1.0f / 1024), 0x3f81);
  EXPECT_EQ(Bf16ToFloat(0x3f81), 1.0078125f);
  EXPECT_NE(FloatToBf16(NAN) & 0x7f80, 0);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
}

// The exact value `d` (of at most 53 significant bits) rounded once to bf16, to nearest even:
// 8 significant bits, subnormals down to 2^-133, overflow to infinity.
uint16_t RoundOnceToBf16(double d) {
  const uint16_t sign = std::signbit(d) ? 0x8000 : 0;
  const double a = std::fabs(d);
  if (a == 0.0) return sign;
  int e = 0;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  const int ulp = std::max(e - 8, -133);
  const double v = std::ldexp(std::nearbyint(std::ldexp(a, -ulp)), ulp);
  if (v > 0x1.fep127) return static_cast<uint16_t>(sign | 0x7f80);
  return static_cast<uint16_t>(sign | FloatToBf16(static_cast<float>(v)));
}

// The GPU's norm multiplies the bf16-rounded normed value by the bf16 weight in one bf16x2
// multiply, which rounds the exact product once; the reference multiplies in fp32 and rounds
// that to bf16. The two agree: the product of two bf16 values has at most 16 significant
// bits, so the fp32 rounding (which loses bits only below 2^-126) never moves it onto a bf16
// midpoint. Every bf16 value against a spread of others, products in the subnormal range
// included.
TEST(Bf16Test, AProductOfTwoBf16RoundedOnceIsTheReferencesTwoRoundings) {
  // The single rounding itself: a tie goes to even; a 17th bit past the tie is what an fp32
  // rounding first would lose (1 + 2^-8 + 2^-30 is 1 + 2^-8 in fp32, a tie).
  EXPECT_EQ(RoundOnceToBf16(1.0 + 0x1p-8), 0x3f80);
  EXPECT_EQ(RoundOnceToBf16(1.0 + 3 * 0x1p-8), 0x3f82);
  EXPECT_EQ(RoundOnceToBf16(1.0 + 0x1p-8 + 0x1p-30), 0x3f81);
  EXPECT_EQ(FloatToBf16(static_cast<float>(1.0 + 0x1p-8 + 0x1p-30)), 0x3f80);
  EXPECT_EQ(RoundOnceToBf16(0x1p-134), 0x0000);  // half the smallest subnormal: to even
  EXPECT_EQ(RoundOnceToBf16(0x1.8p-133), 0x0002);

  std::vector<uint16_t> others = {0x0001, 0x0003, 0x007f, 0x0080, 0x00ff, 0x3f80, 0x3f81,
                                  0x3fff, 0x4000, 0x7f7f, 0x8001, 0xbf80, 0x2001, 0x1fff};
  std::mt19937 rng(11);
  while (others.size() < 160) others.push_back(static_cast<uint16_t>(rng() & 0xffffu));
  int64_t compared = 0, subnormal = 0;
  for (uint32_t a = 0; a < 0x10000; ++a) {
    const float fa = Bf16ToFloat(static_cast<uint16_t>(a));
    if (std::isnan(fa)) continue;
    for (uint16_t b : others) {
      const float fb = Bf16ToFloat(b);
      if (std::isnan(fb)) continue;
      const float product = fa * fb;
      if (std::isnan(product)) continue;  // 0 x inf
      const double exact = static_cast<double>(fa) * static_cast<double>(fb);
      ASSERT_EQ(FloatToBf16(product), RoundOnceToBf16(exact))
          << std::hex << "0x" << a << " x 0x" << b;
      ++compared;
      if (exact != 0.0 && std::fabs(exact) < 0x1p-126) ++subnormal;
    }
  }
  EXPECT_GT(compared, 10000000);
  EXPECT_GT(subnormal, 100000);  // the range where fp32 rounds first
}

TEST(QkvNormRopeRefTest, ProjectionIsXTimesWTransposedRoundedToBf16) {
  // hidden 2, 3 features, 2 rows: qkv[t, n] = sum_k x[t, k] * w[n, k].
  const std::vector<uint16_t> x = Bf16s({1, 2, -3, 0.5f});
  const std::vector<uint16_t> w = Bf16s({1, 1, 0.25f, -1, 3, 1.0f / 3});
  std::vector<uint16_t> qkv(6, 0xffff);
  QkvProjectRef(x.data(), w.data(), 2, 3, 0, 2, qkv.data());
  const float third = Bf16ToFloat(FloatToBf16(1.0f / 3));
  EXPECT_EQ(Floats(qkv),
            (std::vector<float>{3, -1.75f, Bf16ToFloat(FloatToBf16(3 + 2 * third)), -2.5f, -1.25f,
                                Bf16ToFloat(FloatToBf16(-9 + third / 2))}));
  // A row range writes only its rows.
  std::vector<uint16_t> part(6, 0xffff);
  QkvProjectRef(x.data(), w.data(), 2, 3, 1, 2, part.data());
  EXPECT_EQ(std::vector<uint16_t>(part.begin(), part.begin() + 3),
            std::vector<uint16_t>(3, 0xffff));
  EXPECT_EQ(std::vector<uint16_t>(part.begin() + 3, part.end()),
            std::vector<uint16_t>(qkv.begin() + 3, qkv.end()));
}

// Past the blocks the projection works in (at hidden 4096, blocks of 16 rows and 16 features):
// every output is still its own row's and feature's dot product, added in the documented order
// (eight partial sums, lane i taking the elements k with k % 8 == i, added pairwise), whatever
// block it falls in and wherever a row range starts and ends.
TEST(QkvNormRopeRefTest, EveryBlockOfTheProjectionAddsInTheDocumentedOrder) {
  const int64_t hidden = 4096 + 5, features = 37, rows = 41;  // a tail of 5 past the lanes
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<uint16_t> x(rows * hidden), w(features * hidden);
  for (auto& v : x) v = FloatToBf16(value(rng));
  for (auto& v : w) v = FloatToBf16(value(rng));
  std::vector<uint16_t> whole(rows * features, 0xffff), split(rows * features, 0xffff);
  QkvProjectRef(x.data(), w.data(), hidden, features, 0, rows, whole.data());
  QkvProjectRef(x.data(), w.data(), hidden, features, 0, 19, split.data());
  QkvProjectRef(x.data(), w.data(), hidden, features, 19, rows, split.data());
  EXPECT_EQ(split, whole);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t n = 0; n < features; ++n) {
      float part[8] = {};
      for (int64_t k = 0; k < hidden; ++k) {
        part[k % 8] += Bf16ToFloat(x[t * hidden + k]) * Bf16ToFloat(w[n * hidden + k]);
      }
      const float sum =
          ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      ASSERT_EQ(whole[t * features + n], FloatToBf16(sum)) << "row " << t << ", feature " << n;
    }
  }
}

TEST(QkvNormRopeRefTest, NormThenWeightThenRotateByHand) {
  // One token, H = 1, D = 2: q = [3, 4], k = [3, 4], v = [5, 6]; position 1.
  const QkvNormRopeShape shape{1, 1, 2, 2, 1, 1};
  std::vector<uint16_t> qkv = Bf16s({3, 4, 3, 4, 5, 6});
  const std::vector<uint16_t> q_norm = Bf16s({1, 2}), k_norm = Bf16s({1, 1});
  // Row 0 would be the identity rotation; row 1 has c = s = 0.5 (cos first, sin second).
  const std::vector<float> cos_sin = {1, 0, 0.5f, 0.5f};
  const int32_t position = 1;
  NormRopeRef(shape, QkvWeights{nullptr, q_norm.data(), k_norm.data(), cos_sin.data()}, &position,
              0, 1, qkv.data());
  // rms: mean(9, 16) = 12.5; 3 / sqrt(12.5) = 0.8485 -> bf16 0.84765625 and 4 / sqrt(12.5) =
  // 1.1314 -> bf16 1.1328125. Q: a = 0.84765625, b = 2.265625 (times w = [1, 2]);
  // o0 = 0.5a - 0.5b = -0.708984375, halfway: even -> -0.7109375; o1 = 0.5(a + b) =
  // 1.556640625 -> 1.5546875. K: b = 1.1328125; o0 = -0.142578125 -> -0.142578125 (exact in
  // bf16), o1 = 0.990234375 -> 0.9921875 (halfway, even).
  EXPECT_EQ(Floats(qkv),
            (std::vector<float>{-0.7109375f, 1.5546875f, -0.142578125f, 0.9921875f, 5, 6}));
}

TEST(QkvNormRopeRefTest, SumOfSquaresAddsInTheKernelsOrder) {
  // D = 128: one 4096 (square 2^24) and 127 ones. Added one by one, every 1 is lost against
  // 2^24 (the fp32 spacing there is 2). The kernel's order keeps lane 0's partial at 2^24
  // (its seven ones are lost) but adds the other 15 lanes' partials of 8 first, so 120 of the
  // ones survive: 2^24 + 120.
  std::vector<uint16_t> head(128, FloatToBf16(1.0f));
  head[0] = FloatToBf16(4096.0f);
  float sequential = 0;
  for (uint16_t v : head) sequential += Bf16ToFloat(v) * Bf16ToFloat(v);
  EXPECT_EQ(sequential, 16777216.0f);
  EXPECT_EQ(HeadSumSquares(head.data(), 128), 16777336.0f);
  // The big square in lane 8 instead: lanes 0 and 8 meet first (2^24 + 8), then the rest.
  std::fill(head.begin(), head.end(), FloatToBf16(1.0f));
  head[64] = FloatToBf16(4096.0f);
  EXPECT_EQ(HeadSumSquares(head.data(), 128), 16777336.0f);
  // Pairwise order by hand for D = 8 (8 partials of one element): ((a+e)+(c+g))+((b+f)+(d+h)).
  const std::vector<uint16_t> small = Bf16s({4096, 1, 1, 1, 1, 1, 1, 1});
  EXPECT_EQ(HeadSumSquares(small.data(), 8), 16777216.0f + 6.0f);
  // D = 6: two partials of three consecutive elements.
  const std::vector<uint16_t> six = Bf16s({1, 2, 3, 4, 5, 6});
  EXPECT_EQ(HeadSumSquares(six.data(), 6), 14.0f + 77.0f);
}

TEST(QkvNormRopeRefTest, PositionZeroIsPureNormAndVIsTheProjection) {
  const QkvNormRopeShape shape{1, 2, 8, 1, 1, 3};
  QkvProblem p = MakeQkvProblem(shape, 7);
  std::fill(p.positions[0].begin(), p.positions[0].end(), 0);
  std::vector<uint16_t> qkv(static_cast<size_t>(QkvRows(shape) * QkvFeatures(shape)));
  std::vector<uint16_t> proj(qkv.size());
  QkvNormRopeRef(shape, p.weights(), p.x[0].data(), p.positions[0].data(), qkv.data());
  QkvProjectRef(p.x[0].data(), p.w_qkv.data(), QkvHidden(shape), QkvFeatures(shape), 0,
                QkvRows(shape), proj.data());
  const int64_t hd = QkvHidden(shape);
  for (int64_t t = 0; t < QkvRows(shape); ++t) {
    const uint16_t* got = qkv.data() + t * QkvFeatures(shape);
    const uint16_t* y = proj.data() + t * QkvFeatures(shape);
    for (int plane = 0; plane < 2; ++plane) {
      const std::vector<uint16_t>& w = plane == 0 ? p.q_norm : p.k_norm;
      for (int64_t h = 0; h < shape.heads; ++h) {
        const uint16_t* head = y + plane * hd + h * shape.head_dim;
        const float sum_sq = HeadSumSquares(head, shape.head_dim);
        const float inv = 1.0f / std::sqrt(sum_sq / shape.head_dim + 1e-6f);
        for (int d = 0; d < shape.head_dim; ++d) {
          const float t_val = Bf16ToFloat(FloatToBf16(Bf16ToFloat(head[d]) * inv));
          EXPECT_EQ(got[plane * hd + h * shape.head_dim + d],
                    FloatToBf16(t_val * Bf16ToFloat(w[d])))
              << "t " << t << " plane " << plane << " head " << h << " d " << d;
        }
      }
    }
    EXPECT_EQ(0, std::memcmp(got + 2 * hd, y + 2 * hd, hd * sizeof(uint16_t))) << "V of row " << t;
  }
}

struct Case {
  int32_t world, heads, head_dim;
  int64_t batch, seq_local;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "W" << c.world << " H" << c.heads << " D" << c.head_dim << " B" << c.batch << " S_l"
      << c.seq_local;
}
using Param = std::tuple<Case, QkvLayout>;

class QkvBlockRefTest : public ::testing::TestWithParam<Param> {
 protected:
  QkvNormRopeShape Shape() const {
    const Case& c = std::get<0>(GetParam());
    return QkvNormRopeShape{c.world, c.heads, c.head_dim, 37, c.batch, c.seq_local};
  }
  QkvLayout Layout() const { return std::get<1>(GetParam()); }
  // Every rank's plain (pre-exchange) result.
  std::vector<std::vector<uint16_t>> Plain(const QkvProblem& p) const {
    const QkvNormRopeShape sh = p.shape;
    std::vector<std::vector<uint16_t>> out;
    for (int r = 0; r < sh.world; ++r) {
      out.emplace_back(static_cast<size_t>(QkvRows(sh) * QkvFeatures(sh)));
      QkvNormRopeRef(sh, p.weights(), p.x[r].data(), p.positions[r].data(), out.back().data());
    }
    return out;
  }
  static constexpr uint16_t kPoison = 0x7fc1;  // a NaN pattern
};

TEST_P(QkvBlockRefTest, WorldOneBlockIsThePlainOp) {
  QkvNormRopeShape sh = Shape();
  sh.world = 1;
  const QkvProblem p = MakeQkvProblem(sh, 11);
  const std::vector<uint16_t> plain = Plain(p)[0];
  std::vector<uint16_t> out(static_cast<size_t>(3 * QkvPlaneElems(sh)), kPoison);
  QkvNormRopeBlockRef(sh, Layout(), p.weights(), p.x[0].data(), p.positions[0].data(), 0, 0,
                      out.data());
  const int64_t hd = QkvHidden(sh), dim = sh.head_dim;
  for (int64_t t = 0; t < QkvRows(sh); ++t) {
    for (int plane = 0; plane < 3; ++plane) {
      for (int64_t h = 0; h < sh.heads; ++h) {
        // bshd: plane-major [3][B*S][H][D]; fused: [B*S][H][3][D].
        const int64_t at = Layout() == QkvLayout::kBshd
                               ? plane * QkvRows(sh) * hd + t * hd + h * dim
                               : (t * sh.heads + h) * 3 * dim + plane * dim;
        ASSERT_EQ(0, std::memcmp(out.data() + at, plain.data() + t * 3 * hd + plane * hd + h * dim,
                                 dim * sizeof(uint16_t)))
            << "t " << t << " plane " << plane << " head " << h;
      }
    }
  }
}

TEST_P(QkvBlockRefTest, BlocksRedistributeThePlainOp) {
  const QkvNormRopeShape sh = Shape();
  const QkvProblem p = MakeQkvProblem(sh, 23 + sh.world);
  const std::vector<std::vector<uint16_t>> plain = Plain(p);
  const int64_t hl = QkvLocalHeads(sh), dim = sh.head_dim, hd = QkvHidden(sh);
  const int64_t sg = QkvGlobalSeq(sh);
  for (int dst = 0; dst < sh.world; ++dst) {
    std::vector<uint16_t> fused(static_cast<size_t>(3 * QkvPlaneElems(sh)), kPoison);
    std::vector<uint16_t> copied = fused;
    for (int src = sh.world - 1; src >= 0; --src) {  // any order
      QkvNormRopeBlockRef(sh, Layout(), p.weights(), p.x[src].data(), p.positions[src].data(), src,
                          dst, fused.data());
      ScatterQkvBlockRef(sh, Layout(), plain[src].data(), src, dst, copied.data());
    }
    EXPECT_EQ(fused, copied) << "dst " << dst;
    // The formula of DESIGN.md section 4, element by element: rank dst holds heads
    // [dst*H_l, (dst+1)*H_l) of every token, sequence blocks in source-rank order.
    for (int64_t b = 0; b < sh.batch; ++b) {
      for (int64_t g = 0; g < sg; ++g) {
        const int64_t src = g / sh.seq_local, s = g % sh.seq_local;
        const uint16_t* row = plain[src].data() + (b * sh.seq_local + s) * 3 * hd;
        for (int plane = 0; plane < 3; ++plane) {
          for (int64_t h = 0; h < hl; ++h) {
            const int64_t at =
                Layout() == QkvLayout::kBshd
                    ? plane * (sh.batch * sg * hl * dim) + ((b * sg + g) * hl + h) * dim
                    : ((b * sg + g) * hl + h) * 3 * dim + plane * dim;
            ASSERT_EQ(0, std::memcmp(fused.data() + at, row + plane * hd + (dst * hl + h) * dim,
                                     dim * sizeof(uint16_t)))
                << "dst " << dst << " b " << b << " g " << g << " plane " << plane << " h " << h;
          }
        }
      }
    }
  }
}

TEST_P(QkvBlockRefTest, BlockWritesOnlyItsRegion) {
  const QkvNormRopeShape sh = Shape();
  const QkvProblem p = MakeQkvProblem(sh, 5);
  const int src = sh.world > 1 ? 1 : 0, dst = sh.world - 1;
  std::vector<uint16_t> out(static_cast<size_t>(3 * QkvPlaneElems(sh)), kPoison);
  QkvNormRopeBlockRef(sh, Layout(), p.weights(), p.x[src].data(), p.positions[src].data(), src, dst,
                      out.data());
  const int64_t hl = QkvLocalHeads(sh), dim = sh.head_dim;
  int64_t written = 0;
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t g = 0; g < QkvGlobalSeq(sh); ++g)
      for (int plane = 0; plane < 3; ++plane)
        for (int64_t h = 0; h < hl; ++h)
          for (int64_t d = 0; d < dim; ++d) {
            const bool mine = g / sh.seq_local == src;
            const uint16_t v = out[QkvDestOffset(sh, Layout(), b, g, h, plane, d)];
            if (mine) {
              ++written;
            } else {
              ASSERT_EQ(v, kPoison) << "wrote outside its block at b " << b << " g " << g;
            }
          }
  EXPECT_EQ(written, QkvPlaneElems(sh) * 3 / sh.world);
}

const Case kCases[] = {
    {1, 3, 4, 2, 3}, {2, 2, 8, 1, 5},  {2, 4, 6, 2, 3},
    {3, 6, 4, 1, 4}, {4, 8, 16, 2, 7}, {4, 4, 2, 1, 2},
};
INSTANTIATE_TEST_SUITE_P(Cases, QkvBlockRefTest,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(QkvLayout::kBshd,
                                                              QkvLayout::kFused)));

}  // namespace
}  // namespace ulysses::kernels
