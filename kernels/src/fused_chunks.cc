// Chunk planning of FusedQkvPlan's chunked path: host arithmetic, built with and without CUDA.
#include <algorithm>
#include <bit>

#include "fused_epilogue.h"
#include "ulysses/kernels/fused_qkv.h"
#include "ulysses/kernels/gemm.h"

namespace ulysses::kernels {
namespace {

constexpr int64_t kChunkAlignRows = 128;  // GEMM tile height: chunk boundaries fall on tiles
constexpr int64_t kMinDefaultChunkRows = 512;
constexpr int64_t kLoadStepsPerOctave = 8;  // FusedGemmLoadRowCounts
static_assert(kFusedEveryRowLoadRows <= Bf16Gemm::kMaxEveryRowLoad);

int64_t AlignUp(int64_t rows) {
  return (rows + kChunkAlignRows - 1) / kChunkAlignRows * kChunkAlignRows;
}

}  // namespace

int64_t DefaultChunkRows(int64_t rows) {
  return std::max(kMinDefaultChunkRows, AlignUp((rows + 3) / 4));
}

int64_t FusedChunkRows(int64_t rows, int64_t chunk_rows) {
  int64_t chunk = chunk_rows > 0 ? AlignUp(chunk_rows) : DefaultChunkRows(rows);
  // Never more than kMaxFusedChunks chunks.
  chunk = std::max(chunk, AlignUp((rows + kMaxFusedChunks - 1) / kMaxFusedChunks));
  return std::min(chunk, rows);
}

const char* EpilogueScheduleName(EpilogueSchedule schedule) {
  switch (schedule) {
    case EpilogueSchedule::kAuto:
      return "auto";
    case EpilogueSchedule::kPingpong:
      return "pingpong";
    case EpilogueSchedule::kPingpongCluster2:
      return "pingpong2";
    case EpilogueSchedule::kCooperativeCluster2TwoHeads:
      return "cooperative2h2";
    case EpilogueSchedule::kCooperativeEpilogueWarps:
      return "cooperative2ew";
  }
  return "unknown";
}

EpilogueSchedule EpilogueScheduleFor(int64_t rows) {
  if (rows >= 2048) return EpilogueSchedule::kCooperativeEpilogueWarps;
  // Clusters of 2 round an odd count of 128-row tiles up by one: single CTAs where that tile
  // would be more than an eighth of the call's.
  const int64_t tiles = (rows + kChunkAlignRows - 1) / kChunkAlignRows;
  return tiles % 2 == 0 || tiles > 8 ? EpilogueSchedule::kPingpongCluster2
                                     : EpilogueSchedule::kPingpong;
}

int64_t EpilogueChunkRows(int64_t rows, int64_t chunk_rows) {
  return AlignUp(FusedChunkRows(rows, chunk_rows));
}

std::vector<int64_t> FusedGemmRowCounts(int64_t rows, int64_t chunk_rows, FusedPath path) {
  std::vector<int64_t> counts;
  if (path == FusedPath::kPerOperator || path == FusedPath::kAuto) counts.push_back(rows);
  if (path == FusedPath::kChunked || path == FusedPath::kAuto) {
    const int64_t chunk = FusedChunkRows(rows, chunk_rows);
    counts.push_back(chunk);
    if (rows % chunk != 0) counts.push_back(rows % chunk);
  }
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

std::vector<int64_t> FusedGemmLoadRowCounts(int64_t rows, int64_t chunk_rows, FusedPath path) {
  std::vector<int64_t> counts;
  auto add = [&](int64_t at) {
    for (int64_t m : FusedGemmRowCounts(at, chunk_rows, path)) counts.push_back(m);
  };
  // Eight row counts an octave below `rows`: every count up to 8, then steps of an eighth of
  // the power of two below (8, 9, ..., 16, 18, ..., 32, 36, ...). cuBLASLt's pick moves with
  // the row count: running the kernel picked for a count twice a call's, or even 1.5 times,
  // was 7-61% slower at 300, 700 and 1100 rows (H100), so a call's loaded count is within
  // 1.125 times its own, and more calls find cuBLASLt's own pick for their count loaded.
  for (int64_t r = 1; r < rows;) {
    add(r);
    const auto octave = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(r)));
    r += std::max<int64_t>(1, octave / kLoadStepsPerOctave);
  }
  add(rows);
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

int64_t FusedGemmEveryRowLoadRows(int64_t rows, FusedPath path) {
  // Below the epilogue path's rows every call's GEMM runs on cuBLASLt (per_operator, or a
  // chunked call's pieces), where a neighbouring count's kernel ran up to 1.37 times the
  // count's own pick (H100, eight loads an octave). The epilogue path runs no cuBLASLt GEMM.
  if (rows <= 0 || path == FusedPath::kEpilogue) return 0;
  return std::min(rows, kFusedEveryRowLoadRows);
}

int64_t FusedNumChunks(int64_t rows, int64_t chunk_rows) {
  const int64_t chunk = FusedChunkRows(rows, chunk_rows);
  return (rows + chunk - 1) / chunk;
}

namespace internal {

int EpilogueSwizzle(int64_t m_tiles, int64_t n_tiles, int cluster_m) {
  const auto round_up = [](int64_t x, int64_t to) { return (x + to - 1) / to * to; };
  const int64_t m = round_up(m_tiles, cluster_m), shorter = std::min(m, n_tiles);
  int best = 1;
  int64_t best_tiles = m * n_tiles;
  for (int largest : {2, 4, 8}) {
    // The swizzle the scheduler takes when allowed `largest`.
    const int taken = largest >= 8 && shorter >= 6   ? 8
                      : largest >= 4 && shorter >= 3 ? 4
                      : shorter >= 2                 ? 2
                                                     : 1;
    const int64_t tiles = round_up(m, int64_t{taken} * cluster_m) * round_up(n_tiles, taken);
    if (tiles <= best_tiles) best = largest, best_tiles = tiles;
  }
  return best;
}

}  // namespace internal
}  // namespace ulysses::kernels
