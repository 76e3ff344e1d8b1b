// Chunk planning of FusedQkvPlan's chunked path: host arithmetic, built with and without CUDA.
#include <algorithm>

#include "ulysses/kernels/fused_qkv.h"

namespace ulysses::kernels {
namespace {

constexpr int64_t kChunkAlignRows = 128;  // GEMM tile height: chunk boundaries fall on tiles
constexpr int64_t kMinDefaultChunkRows = 512;

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

EpilogueSchedule EpilogueScheduleFor(int64_t rows) {
  return rows >= 2048 ? EpilogueSchedule::kPingpongCluster2 : EpilogueSchedule::kPingpong;
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
  // Every power of two below `rows`, and half-way (in ratio) between each and the next: 1, 2,
  // 3, 4, 6, 8, 12, ... A kernel cuBLASLt picks for twice the rows can be much slower (61% at
  // 300 rows, running 512's on H100), so a call's loaded count is within 1.5 times its own.
  for (int64_t r = 1; r < rows; r *= 2) {
    add(r);
    if (r >= 2 && r / 2 * 3 < rows) add(r / 2 * 3);
  }
  add(rows);
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

int64_t FusedNumChunks(int64_t rows, int64_t chunk_rows) {
  const int64_t chunk = FusedChunkRows(rows, chunk_rows);
  return (rows + chunk - 1) / chunk;
}

}  // namespace ulysses::kernels
