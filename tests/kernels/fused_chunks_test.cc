// Chunk planning of the fused op's chunked path (host arithmetic): chunks of 128-row multiples
// that cover the call exactly, about four by default, never more than kMaxFusedChunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fused_epilogue.h"
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/gemm.h"
#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::kernels {
namespace {

TEST(FusedChunksTest, DefaultIsAboutFourChunksOfAtLeast512Rows) {
  EXPECT_EQ(DefaultChunkRows(16384), 4096);
  EXPECT_EQ(DefaultChunkRows(32768), 8192);
  EXPECT_EQ(DefaultChunkRows(65536), 16384);
  EXPECT_EQ(DefaultChunkRows(1000), 512);   // a quarter (250) is below the floor
  EXPECT_EQ(DefaultChunkRows(4000), 1024);  // 1000 rounded up to 128s
  for (int64_t rows : {1, 100, 512, 2048, 16384, 32768, 65536, 131072}) {
    EXPECT_EQ(FusedChunkRows(rows, 0), std::min(rows, DefaultChunkRows(rows))) << rows;
  }
  EXPECT_EQ(FusedNumChunks(32768, 0), 4);
  EXPECT_EQ(FusedNumChunks(65536, 0), 4);
  EXPECT_EQ(FusedNumChunks(100, 0), 1);
}

// What a fused session loads when it opens: the row counts of the cuBLASLt GEMMs its path runs.
TEST(FusedChunksTest, GemmRowCountsAreThoseThePathRuns) {
  using V = std::vector<int64_t>;
  // 1000 rows: default chunks of 512, so a chunk and a 488-row remainder.
  EXPECT_EQ(FusedGemmRowCounts(1000, 0, FusedPath::kPerOperator), V({1000}));
  EXPECT_EQ(FusedGemmRowCounts(1000, 0, FusedPath::kChunked), V({488, 512}));
  EXPECT_EQ(FusedGemmRowCounts(1000, 0, FusedPath::kAuto), V({488, 512, 1000}));
  EXPECT_EQ(FusedGemmRowCounts(1000, 0, FusedPath::kEpilogue), V{});
  // Chunks that divide the rows: no remainder.
  EXPECT_EQ(FusedGemmRowCounts(32768, 0, FusedPath::kChunked), V({8192}));
  EXPECT_EQ(FusedGemmRowCounts(400, 128, FusedPath::kChunked), V({16, 128}));
  // One chunk of all the rows: one count, whatever the path.
  EXPECT_EQ(FusedGemmRowCounts(16, 0, FusedPath::kChunked), V({16}));
  EXPECT_EQ(FusedGemmRowCounts(16, 0, FusedPath::kAuto), V({16}));
}

// What LoadKernels loads for calls of up to `rows` rows: the counts at `rows` and at eight
// row counts an octave below it, so that a call of any row count has a loaded count at most
// 1.125 times its own.
TEST(FusedChunksTest, LoadRowCountsAreThePathsCountsAtEightStepsAnOctaveBelowTheRows) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(FusedGemmLoadRowCounts(100, 0, FusedPath::kPerOperator),
            V({1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 18, 20,
               22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60, 64, 72, 80, 88, 96, 100}));
  const V per_op = FusedGemmLoadRowCounts(1000, 0, FusedPath::kPerOperator);
  EXPECT_EQ(V(per_op.end() - 5, per_op.end()), V({768, 832, 896, 960, 1000}));
  // Up to 512 rows a chunked call is one chunk of all its rows; above, chunks of 512 and the
  // remainder (1000 rows: 488).
  const V chunked = FusedGemmLoadRowCounts(1000, 0, FusedPath::kChunked);
  EXPECT_EQ(V(chunked.end() - 4, chunked.end()), V({448, 480, 488, 512}));
  EXPECT_EQ(FusedGemmLoadRowCounts(1000, 0, FusedPath::kEpilogue), V{});
  EXPECT_EQ(FusedGemmLoadRowCounts(1, 0, FusedPath::kAuto), V({1}));
  EXPECT_EQ(FusedGemmLoadRowCounts(2048, 0, FusedPath::kPerOperator).back(), 2048);
  // 8 counts an octave: about 8 * log2(rows) of them.
  EXPECT_LE(FusedGemmLoadRowCounts(16384, 0, FusedPath::kPerOperator).size(), 96u);
  for (int64_t rows : {1, 3, 1000, 2047, 4096, 5000, 65536}) {
    for (FusedPath path : {FusedPath::kPerOperator, FusedPath::kChunked, FusedPath::kAuto}) {
      SCOPED_TRACE(rows);
      const V counts = FusedGemmLoadRowCounts(rows, 0, path);
      EXPECT_TRUE(std::is_sorted(counts.begin(), counts.end()));
      EXPECT_EQ(std::adjacent_find(counts.begin(), counts.end()), counts.end());
      // Every count a call of up to `rows` rows runs has a loaded count within 1.125 times it
      // (a whole call's) or 1.5 times it (a chunked call's remainder).
      for (int64_t r = 1; r <= rows; r = r < 256 ? r + 1 : r * 17 / 16) {
        for (int64_t m : FusedGemmRowCounts(r, 0, path)) {
          auto at = std::lower_bound(counts.begin(), counts.end(), m);
          ASSERT_NE(at, counts.end()) << "rows " << r << ", count " << m;
          if (m == r)
            EXPECT_LE(8 * *at, 9 * m) << "rows " << r;
          else
            EXPECT_LE(2 * *at, 3 * m) << "rows " << r << ", count " << m;
        }
      }
      for (int64_t m : FusedGemmRowCounts(rows, 0, path))
        EXPECT_TRUE(std::binary_search(counts.begin(), counts.end(), m)) << m;
    }
  }
}

// Every row count is loaded up to 2048 rows (below the epilogue path's), on every path that runs
// cuBLASLt GEMMs, and up to the session's rows where it has fewer; none on the epilogue path.
TEST(FusedChunksTest, EveryRowCountIsLoadedUpTo2048RowsWhereCublasLtRuns) {
  EXPECT_EQ(kFusedEveryRowLoadRows, 2048);
  for (FusedPath path : {FusedPath::kPerOperator, FusedPath::kChunked, FusedPath::kAuto}) {
    SCOPED_TRACE(FusedPathName(path));
    EXPECT_EQ(FusedGemmEveryRowLoadRows(1, path), 1);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(100, path), 100);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(2047, path), 2047);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(2048, path), 2048);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(2049, path), 2048);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(65536, path), 2048);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(0, path), 0);
    EXPECT_EQ(FusedGemmEveryRowLoadRows(-5, path), 0);
  }
  EXPECT_EQ(FusedGemmEveryRowLoadRows(100, FusedPath::kEpilogue), 0);
  EXPECT_EQ(FusedGemmEveryRowLoadRows(16384, FusedPath::kEpilogue), 0);
}

// A pinned GEMM's call whose own algorithm was not loaded tries the loaded ones chosen for the
// nearest row counts not below its own first, then the nearest below.
TEST(FusedChunksTest, APinnedGemmTriesTheNearestLoadedRowCountsNotBelowFirst) {
  using I = std::vector<size_t>;
  const std::vector<int64_t> loaded = {1, 1000, 16, 512, 256, 512};
  EXPECT_EQ(PinnedTryOrder(loaded, 300), I({3, 5, 1, 4, 2, 0}));  // 512, 512, 1000, 256, 16, 1
  EXPECT_EQ(PinnedTryOrder(loaded, 512), I({3, 5, 1, 4, 2, 0}));
  EXPECT_EQ(PinnedTryOrder(loaded, 1), I({0, 2, 4, 3, 5, 1}));
  EXPECT_EQ(PinnedTryOrder(loaded, 2000), I({1, 3, 5, 4, 2, 0}));  // all below: most first
  EXPECT_EQ(PinnedTryOrder({}, 7), I{});
}

TEST(FusedChunksTest, ConfiguredRowsRoundUpToTilesAndLeaveATail) {
  EXPECT_EQ(FusedChunkRows(400, 128), 128);
  EXPECT_EQ(FusedNumChunks(400, 128), 4);  // 128, 128, 128, 16
  EXPECT_EQ(FusedChunkRows(400, 100), 128);
  EXPECT_EQ(FusedChunkRows(400, 129), 256);
  EXPECT_EQ(FusedChunkRows(100, 128), 100);  // one chunk of all rows
  EXPECT_EQ(FusedNumChunks(100, 128), 1);
}

TEST(FusedChunksTest, NeverMoreThanTheReadinessWordsPerDestination) {
  for (int64_t rows : {int64_t{4095}, int64_t{4096}, int64_t{4097}, int64_t{32768},
                       int64_t{65536}, int64_t{1} << 20}) {
    for (int64_t configured : {0, 1, 128, 1000}) {
      const int64_t chunk = FusedChunkRows(rows, configured);
      const int64_t chunks = FusedNumChunks(rows, configured);
      EXPECT_LE(chunks, kMaxFusedChunks) << rows << " " << configured;
      EXPECT_GE(chunks, 1);
      EXPECT_TRUE(chunk == rows || chunk % 128 == 0) << rows << " " << configured;
      // The chunks cover [0, rows) exactly: the last one is non-empty.
      EXPECT_GT(rows - (chunks - 1) * chunk, 0) << rows << " " << configured;
      EXPECT_LE(rows - (chunks - 1) * chunk, chunk);
    }
  }
  EXPECT_EQ(FusedNumChunks(int64_t{1} << 20, 128), kMaxFusedChunks);
  EXPECT_EQ(FusedChunkRows(int64_t{1} << 20, 128), (int64_t{1} << 20) / kMaxFusedChunks);
}

// The epilogue path publishes the chunked path's readiness words: its chunks, whole tiles
// each, are as many.
TEST(FusedChunksTest, EpilogueChunksAreWholeTilesAndAsManyAsTheChunkedPaths) {
  for (int64_t rows : {1, 100, 127, 128, 129, 400, 511, 2048, 4000, 16384, 65536, 1 << 20}) {
    for (int64_t configured : {0, 1, 128, 200, 512, 4096}) {
      const int64_t chunk = EpilogueChunkRows(rows, configured);
      EXPECT_EQ(chunk % 128, 0) << rows << " " << configured;
      EXPECT_GE(chunk, FusedChunkRows(rows, configured));
      EXPECT_EQ((rows + chunk - 1) / chunk, FusedNumChunks(rows, configured))
          << rows << " " << configured;
    }
  }
}

TEST(FusedChunksTest, EpilogueScheduleIsCooperativeFrom2048RowsAndClustersBelow) {
  EXPECT_EQ(EpilogueScheduleFor(2048), EpilogueSchedule::kCooperativeEpilogueWarps);
  EXPECT_EQ(EpilogueScheduleFor(65536), EpilogueSchedule::kCooperativeEpilogueWarps);
  // Below: clusters of 2 on an even count of 128-row tiles, or on more than 8 ...
  for (int64_t rows : {129, 256, 512, 1000, 1024, 1025, 1152, 2047})
    EXPECT_EQ(EpilogueScheduleFor(rows), EpilogueSchedule::kPingpongCluster2) << rows;
  // ... single CTAs on an odd count of up to 7, which a cluster would pad by a tile.
  for (int64_t rows : {1, 128, 257, 384, 640, 896})
    EXPECT_EQ(EpilogueScheduleFor(rows), EpilogueSchedule::kPingpong) << rows;
}

// The epilogue GEMM's readiness count, played on the host: every tile (128 rows of one head
// on the ping-pong kernel, of two on the cooperative one, so 3 or 2 tiles across 3 heads)
// counts itself on its rows' chunk, as every tile across the features does; each chunk the
// receivers wait for must reach its arrival count exactly once, after all of its rows'
// tiles, and no other chunk is counted.
TEST(FusedChunksTest, EveryChunkIsPublishedOnceAfterEveryTileOfItsRows) {
  for (int32_t head_tiles : {3, 2}) {
    for (int64_t rows : {1, 100, 128, 129, 255, 256, 257, 400, 640, 1000, 2560, 5000, 40000}) {
      for (int64_t configured : {0, 128, 256, 384, 640}) {
        SCOPED_TRACE(testing::Message() << head_tiles << " tiles across, rows " << rows
                                        << ", chunk_rows " << configured);
        const int64_t chunk_rows = EpilogueChunkRows(rows, configured);
        const int64_t chunks = FusedNumChunks(rows, configured);
        const auto units = static_cast<int32_t>((rows + 127) / 128);
        const auto chunk_units = static_cast<int32_t>(chunk_rows / internal::kEpilogueTileRows);
        std::vector<uint32_t> count(static_cast<size_t>(chunks) + 1, 0);
        std::vector<int> published(static_cast<size_t>(chunks) + 1, 0);
        for (int32_t n = 0; n < head_tiles; ++n) {
          for (int32_t unit = 0; unit < units; ++unit) {
            const internal::UnitArrival a =
                internal::ArrivalOf(unit, units, chunk_units, head_tiles);
            ASSERT_LT(a.chunk, chunks);
            // The chunk holds this unit's rows.
            EXPECT_LE(a.chunk * chunk_rows, int64_t{unit} * 128);
            EXPECT_LT(int64_t{unit} * 128, (a.chunk + 1) * chunk_rows);
            if (++count[a.chunk] == a.arrivals) ++published[a.chunk];
          }
        }
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t chunk_first = c * chunk_rows;
          const int64_t chunk_end = std::min(rows, chunk_first + chunk_rows);
          EXPECT_EQ(published[c], 1) << "chunk " << c;
          EXPECT_EQ(count[c], static_cast<uint32_t>((chunk_end - chunk_first + 127) / 128 *
                                                    head_tiles))
              << "chunk " << c;
        }
        EXPECT_EQ(count[chunks], 0u);
      }
    }
  }
}

// The register epilogue's quad transpose, played on the host for the 4 lanes of a quad: each
// step's sends are all taken before any lane receives (as a shuffle exchanges), and lane q
// ends with column q of the matrix the quad started with, whatever its values.
TEST(FusedChunksTest, TheQuadTransposeGivesEachLaneItsColumn) {
  uint32_t a[4][4];
  for (int q = 0; q < 4; ++q) {
    for (int j = 0; j < 4; ++j) a[q][j] = static_cast<uint32_t>(0x1000 * (q + 1) + j);
  }
  for (int step : {1, 2}) {
    uint32_t sent[4][2];
    for (int q = 0; q < 4; ++q) internal::QuadSend(a[q], q, step, sent[q]);
    for (int q = 0; q < 4; ++q) internal::QuadReceive(a[q], q, step, sent[q ^ step]);
  }
  for (int q = 0; q < 4; ++q) {
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(a[q][j], static_cast<uint32_t>(0x1000 * (j + 1) + q)) << "lane " << q << ", " << j;
    }
  }
}

// The register epilogue's sum of squares: quad lane q's fused multiply-add chains over blocks
// 4g + q, QuadPartialSum, then the xor exchanges with lanes q ^ 2 and q ^ 1, give every lane
// the reference's bits (HeadSumSquares) for heads of values of very different magnitudes,
// where another order of the additions would round differently.
TEST(FusedChunksTest, TheQuadSumOfSquaresHasTheReferencesBits) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  int differs_from_a_plain_sum = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    uint16_t head[128];
    float y[128];
    for (int i = 0; i < 128; ++i) {
      const float v = std::ldexp(mantissa(rng), exponent(rng));
      uint32_t bits = 0;
      std::memcpy(&bits, &v, sizeof(bits));
      head[i] = static_cast<uint16_t>(bits >> 16);  // truncated to bf16: any bf16 value will do
      bits = static_cast<uint32_t>(head[i]) << 16;
      std::memcpy(&y[i], &bits, sizeof(bits));
    }
    const float want = HeadSumSquares(head, 128);
    float r[4];
    for (int q = 0; q < 4; ++q) {
      float p[4];
      for (int g = 0; g < 4; ++g) {
        p[g] = 0.0f;
        for (int e = 0; e < 8; ++e) {
          const float v = y[(4 * g + q) * 8 + e];
          p[g] = std::fma(v, v, p[g]);
        }
      }
      r[q] = internal::QuadPartialSum(p);
    }
    float s[4], t[4];
    for (int q = 0; q < 4; ++q) s[q] = r[q] + r[q ^ 2];
    for (int q = 0; q < 4; ++q) t[q] = s[q] + s[q ^ 1];
    for (int q = 0; q < 4; ++q) {
      ASSERT_EQ(t[q], want) << "trial " << trial << ", lane " << q;
    }
    float plain = 0.0f;
    for (float v : y) plain = std::fma(v, v, plain);
    if (plain != want) ++differs_from_a_plain_sum;
  }
  // The order is what is checked: a plain running sum rounds differently on many heads.
  EXPECT_GT(differs_from_a_plain_sum, 100);
}

TEST(FusedChunksTest, EverySchedulesNameIsItsOwn) {
  EXPECT_STREQ(EpilogueScheduleName(EpilogueSchedule::kAuto), "auto");
  EXPECT_STREQ(EpilogueScheduleName(EpilogueSchedule::kPingpong), "pingpong");
  EXPECT_STREQ(EpilogueScheduleName(EpilogueSchedule::kPingpongCluster2), "pingpong2");
  EXPECT_STREQ(EpilogueScheduleName(EpilogueSchedule::kCooperativeCluster2TwoHeads),
               "cooperative2h2");
  EXPECT_STREQ(EpilogueScheduleName(EpilogueSchedule::kCooperativeEpilogueWarps),
               "cooperative2ew");
  std::set<std::string> names;
  for (int i = 0; i < kEpilogueSchedules; ++i) {
    names.insert(EpilogueScheduleName(static_cast<EpilogueSchedule>(i + 1)));
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kEpilogueSchedules));
}

// The scheduler rounds the tile grid up to whole swizzle groups and runs every tile of it:
// the swizzle is the largest one that pads the grid least.
TEST(FusedChunksTest, TheSwizzleIsTheLargestThatDoesNotPadTheTileGrid) {
  using internal::EpilogueSwizzle;
  // 8 row tiles in clusters of 2: 8 rounds them to 16, 4 keeps 8.
  EXPECT_EQ(EpilogueSwizzle(8, 72, 2), 4);
  EXPECT_EQ(EpilogueSwizzle(16, 72, 2), 8);
  // 2048 rows of the cooperative kernel's 128 x 256 tiles at hidden 3072 (16 x 36): 8 would
  // round the 36 tiles across to 40; 4 pads nothing.
  EXPECT_EQ(EpilogueSwizzle(16, 36, 2), 4);
  // 4 tiles of 128 rows in clusters of 2 (512 rows): 8 and 4 round them to 8.
  EXPECT_EQ(EpilogueSwizzle(4, 72, 2), 2);
  // Single CTAs: the scheduler takes 4 for the short side itself, which pads nothing.
  EXPECT_EQ(EpilogueSwizzle(4, 72, 1), 8);
  // 12 row tiles in clusters of 2: only 2 keeps 12.
  EXPECT_EQ(EpilogueSwizzle(12, 72, 2), 2);
  // Along the features too: 12 tiles across (hidden 512) round to 16 under 8.
  EXPECT_EQ(EpilogueSwizzle(16, 12, 1), 4);
  // An odd number of clusters: every swizzle above 1 pads.
  EXPECT_EQ(EpilogueSwizzle(1, 72, 2), 1);
  EXPECT_EQ(EpilogueSwizzle(5, 96, 2), 1);
  // The tail of a cluster is no swizzle's padding: 7 tiles in clusters of 2 are 8 anyway.
  EXPECT_EQ(EpilogueSwizzle(7, 72, 2), 4);
}

}  // namespace
}  // namespace ulysses::kernels
