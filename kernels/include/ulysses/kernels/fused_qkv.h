// A prepared fused QKV call on one source rank (DESIGN.md section 4): the projection, QK-RMSNorm
// + RoPE and the stores into the W destinations' receive buffers, on two paths:
//   per-operator  GEMM (cuBLASLt) -> norm+RoPE in place -> scatter, all on the caller's stream;
//   chunked       the GEMM split by token block on the caller's stream, and for each block, as
//                 soon as its GEMM is done, the fused norm+RoPE+store on a second stream (so it
//                 runs while the GEMM of the next block does), each block publishing its
//                 readiness words;
//   epilogue      one Hopper GEMM (CUTLASS, sm_90a) whose epilogue does the norm+RoPE and the
//                 stores of each output tile, the projection never written to memory; the
//                 tiles of a chunk publish its readiness words. Only where the build has it
//                 and the device is sm_90 (EpilogueUnavailable says why not).
// Usable from host C++ without CUDA headers. Without CUDA, Create returns FAILED_PRECONDITION.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/kernels/qkv_norm_rope.h"
#include "ulysses/kernels/qkv_norm_rope_cuda.h"

namespace ulysses::kernels {

/// Most chunks a chunked call is split into.
inline constexpr int32_t kMaxFusedChunks = 32;

/// The epilogue path's GEMM: kPingpong and kPingpongCluster2 are CUTLASS's warp-specialized
/// ping-pong kernel (a 128-row tile per consumer warpgroup, one's epilogue beside the other's
/// mainloop), in single CTAs or in clusters of 2 CTAs along the rows that share each w_qkv
/// tile through TMA multicast; kCooperativeCluster2TwoHeads is CUTLASS's cooperative kernel
/// (both consumer warpgroups on one 128 x 256 tile of two heads, then on its epilogue, which
/// works from the accumulators in registers and reads a row's cos/sin once for both heads) in
/// clusters of 2; kCooperativeEpilogueWarps is the same mainloop on the same tiles in a
/// kernel of our own whose producer warpgroup's three idle warps run each tile's epilogue from
/// a shared staging tile beside the next tile's mainloop; kAuto picks per call
/// (EpilogueScheduleFor).
enum class EpilogueSchedule {
  kAuto,
  kPingpong,
  kPingpongCluster2,
  kCooperativeCluster2TwoHeads,
  kCooperativeEpilogueWarps
};
/// The schedules a plan can be made with (kAuto excluded), in the enum's order.
inline constexpr int kEpilogueSchedules = 4;
static_assert(static_cast<int>(EpilogueSchedule::kCooperativeEpilogueWarps) ==
              kEpilogueSchedules);
/// The schedule's name as the benchmark spells it: "pingpong", "pingpong2", "cooperative2h2",
/// "cooperative2ew" ("auto" for kAuto).
const char* EpilogueScheduleName(EpilogueSchedule schedule);

/// kAuto's rule, from the measurements of docs/benchmarks.md (one H100, 2026-12-07): the
/// cooperative kernel with epilogue warps from 2048 rows a call (faster than the cooperative
/// kernel with its epilogue between mainloops on all 14 rows measured there, which was the
/// fastest of the others); below, clusters of 2 of the ping-pong kernel (faster than single
/// CTAs at 512 and 1024 rows), except on an odd count of up to 7 row tiles, which clusters of
/// 2 would pad by a tile.
EpilogueSchedule EpilogueScheduleFor(int64_t rows);

/// What a plan is made for. The weights are device pointers the caller keeps alive and
/// unchanged for the plan's lifetime.
struct FusedQkvConfig {
  int32_t world = 0;  ///< W
  int32_t rank = 0;   ///< this (source) rank
  int32_t heads = 0;  ///< H
  int32_t head_dim = kFusedGpuHeadDim;
  int32_t max_pos = 0;  ///< rows of the cos/sin table
  QkvLayout layout = QkvLayout::kUnspecified;
  int64_t max_tokens = 0;  ///< largest B * S_l of a call
  QkvWeights weights{};
  /// Rows per chunk of the chunked path (rounded up to a multiple of 128); 0: chosen per call
  /// by DefaultChunkRows.
  int64_t chunk_rows = 0;
  /// Grid cap of the chunked path's norm+RoPE+store kernel (0: no cap).
  int32_t push_blocks = 0;
  /// The epilogue path also stores its raw projection into projection() (for tests: it
  /// costs a write of the whole projection).
  bool keep_projection = false;
  EpilogueSchedule epilogue_schedule = EpilogueSchedule::kAuto;
  /// The per-operator and chunked paths (and RunProjection, RunNormRope) project on the
  /// epilogue path's CUTLASS GEMM, its epilogue storing the raw projection only, instead of
  /// cuBLASLt: the plan's calls then launch no cuBLASLt kernel (this library's kernels load
  /// with its module where modules load eagerly, as the daemon has them), LoadKernels has
  /// nothing to load, and the plan makes no cuBLASLt GEMM (no handle, no workspace). Create
  /// fails with FAILED_PRECONDITION, before it allocates, where the epilogue GEMM is
  /// unavailable (not built, not sm_90).
  bool cutlass_projection = false;
  /// The second stream (a cudaStream_t, borrowed: it must outlive the plan, and is idle when
  /// the plan is made): its owner picks its hardware queue (a daemon gives each plan one that
  /// no other session's stream uses). Null: the plan makes its own, non-blocking, at the
  /// device's greatest priority.
  void* second_stream = nullptr;
  /// Where Create allocates, zeroes and waits (a cudaStream_t, borrowed, idle, outliving the
  /// plan). The plan's memory is freed on it too when the plan goes, ordered after nothing on
  /// the plan's other streams: the caller must have seen those idle first. Null: the second
  /// stream. A daemon passes a stream no session's wait holds back when the second
  /// stream shares its hardware queue with another session's.
  void* setup_stream = nullptr;
};

/// The chunked path's default: about four chunks of at least 512 rows, multiples of 128 rows.
int64_t DefaultChunkRows(int64_t rows);

/// Rows per chunk of a chunked call of `rows` (> 0) rows with FusedQkvConfig::chunk_rows =
/// `chunk_rows` (0: DefaultChunkRows): a multiple of 128 rows (or all rows), large enough for
/// at most kMaxFusedChunks chunks. Host code; the same with or without CUDA.
int64_t FusedChunkRows(int64_t rows, int64_t chunk_rows);

/// Chunks of that call: ceil(rows / FusedChunkRows(rows, chunk_rows)).
int64_t FusedNumChunks(int64_t rows, int64_t chunk_rows);

/// The row counts of the cuBLASLt GEMMs a call of `rows` (> 0) rows on `path` runs, ascending
/// and distinct: the whole rows for kPerOperator, the chunk and any remainder for kChunked,
/// none for kEpilogue (its GEMM is this library's own), all of them for kAuto. What
/// FusedQkvPlan::LoadKernels launches. Host code; the same with or without CUDA.
std::vector<int64_t> FusedGemmRowCounts(int64_t rows, int64_t chunk_rows, FusedPath path);

/// The row counts FusedQkvPlan::LoadKernels loads for calls of up to `rows` (> 0) rows on
/// `path`: FusedGemmRowCounts of `rows` and of eight row counts an octave below it (1 to 15,
/// then 16, 18, ..., 30, 32, 36, ..., 60, 64, 72, ...), ascending and distinct (the GEMM then
/// runs, at any row count up to `rows`, cuBLASLt's own pick where a load had it, else an
/// algorithm chosen for a row count at most 1.125 times it, or 1.5 times a chunked call's
/// chunk or remainder). Host code; the same with or without CUDA.
std::vector<int64_t> FusedGemmLoadRowCounts(int64_t rows, int64_t chunk_rows, FusedPath path);

/// The most rows FusedGemmEveryRowLoadRows gives. It covers the rows below the daemon's
/// epilogue path (its rule runs per_operator below 512 rows; daemon/src/fused_runner.cc asserts
/// they agree), and up to 2048 rows the per-operator path where it runs at every row count (no
/// epilogue GEMM, the nccl backend, or a session asking for it).
inline constexpr int64_t kFusedEveryRowLoadRows = 2048;

/// The row count up to which FusedQkvPlan::LoadKernels also loads cuBLASLt's pick of every row
/// count (at the most aligned class, Bf16Gemm::Load's every_row_up_to), so that calls of up to
/// that many rows run their own pick: min(rows, kFusedEveryRowLoadRows) where `path` runs
/// cuBLASLt GEMMs, 0 for kEpilogue and for rows <= 0. Host code; the same with or without CUDA.
int64_t FusedGemmEveryRowLoadRows(int64_t rows, FusedPath path);

/// The epilogue path's readiness chunks: FusedChunkRows rounded up to whole 128-row tiles, so
/// that a tile belongs to one chunk; the same number of chunks as FusedNumChunks.
int64_t EpilogueChunkRows(int64_t rows, int64_t chunk_rows);

/// Owns everything a call needs: the GEMM (descriptors, workspace), the [max_tokens, 3*H*D]
/// projection buffer, the second stream, the events and the block counters.
/// Create allocates; a call of a prepared row count allocates nothing. Not thread-safe: calls
/// are issued by one thread, and a plan's calls must be ordered on one caller stream (each
/// call waits for its own second-stream work before it returns control to the stream).
/// Destroy only after the enqueued work has completed.
class FusedQkvPlan {
 public:
  /// Validates the config (the rules of ValidateFusedGeometry for FusedImpl::kCuda, weights
  /// non-null and 16-byte aligned) and allocates on the current device.
  static absl::StatusOr<std::unique_ptr<FusedQkvPlan>> Create(const FusedQkvConfig& config);
  ~FusedQkvPlan();
  FusedQkvPlan(const FusedQkvPlan&) = delete;
  FusedQkvPlan& operator=(const FusedQkvPlan&) = delete;

  /// Prepares the GEMMs of a call of B * S_l = `rows` on both paths (host work only).
  absl::Status Prepare(int64_t rows);

  /// Loads the cuBLASLt kernels of calls of up to `rows` rows on `path` (Bf16Gemm::Load): the
  /// algorithms cuBLASLt picks for FusedGemmLoadRowCounts(rows, chunk_rows, path), at every
  /// alignment class of x, and for every row count up to FusedGemmEveryRowLoadRows at the most
  /// aligned class, each distinct algorithm launched once on `stream`, reading and writing the
  /// plan's own projection buffer (what they compute is discarded: a call's GEMM overwrites it in the
  /// stream's order). None for kEpilogue (its GEMM is this library's own kernel, loaded with
  /// its module). The first launch of a cuBLASLt kernel in a process holds the launching
  /// thread until every stream of the device is idle (measured on H100; docs/architecture.md,
  /// section 8), so a daemon does this when a session opens; from then on the plan's GEMMs run
  /// only loaded algorithms wherever cuBLASLt accepts one for the call (unloaded_gemm_launches
  /// counts the exceptions). Nothing waits for the launches to end. May be called once per
  /// path. Not thread-safe against Prepare or the Run calls.
  absl::Status LoadKernels(int64_t rows, FusedPath path, cudaStream_t stream);

  /// The per-operator path. `x` is this rank's [batch, seq_local, hidden] bf16 input,
  /// `positions` its int32 [batch, seq_local] positions (device pointers); `dests` as for
  /// LaunchQkvScatter (one readiness word per destination, dests.ready[dst][0]).
  absl::Status RunPerOperator(const void* x, const int32_t* positions, int64_t batch,
                              int64_t seq_local, const QkvDestinations& dests, cudaStream_t stream);

  /// The per-operator path without its stores: the projection of `x`, then norm + RoPE in
  /// place, so that projection() holds this rank's [batch * seq_local, 3*H*D] result for a
  /// transport that moves it itself (the nccl backend). Same arguments as RunPerOperator.
  absl::Status RunNormRope(const void* x, const int32_t* positions, int64_t batch,
                           int64_t seq_local, cudaStream_t stream);

  /// The chunked path; same result as RunPerOperator within the GEMM's rounding. Chunk i
  /// publishes dests.ready[dst][i] for every dst (NumChunks words per destination).
  absl::Status RunChunked(const void* x, const int32_t* positions, int64_t batch, int64_t seq_local,
                          const QkvDestinations& dests, cudaStream_t stream);

  /// The epilogue path; same result as RunChunked within the GEMM's rounding, and the same
  /// readiness words (chunk i publishes dests.ready[dst][i]). FAILED_PRECONDITION when the
  /// plan has no epilogue GEMM (EpilogueUnavailable).
  absl::Status RunEpilogue(const void* x, const int32_t* positions, int64_t batch,
                           int64_t seq_local, const QkvDestinations& dests, cudaStream_t stream);

  /// The epilogue path's GEMM with its epilogue skipped (nothing stored): that kernel's floor,
  /// for the benchmark. FAILED_PRECONDITION without an epilogue GEMM.
  absl::Status RunEpilogueGemmAlone(const void* x, int64_t rows, cudaStream_t stream);

  /// Why this plan cannot run the epilogue path (not built, not an sm_90 device), or empty.
  std::string EpilogueUnavailable() const;

  /// The projection alone, into the plan's projection buffer (the benchmark's floor).
  absl::Status RunProjection(const void* x, int64_t rows, cudaStream_t stream);

  /// Rows per chunk and chunks of a call of `rows` rows on the chunked path.
  int64_t ChunkRows(int64_t rows) const;
  int64_t NumChunks(int64_t rows) const;

  /// The projection buffer [max_tokens, 3*H*D] bf16 (the last call's raw projection on the
  /// chunked path, and on the epilogue path with keep_projection; its normalized one on the
  /// per-operator path and after RunNormRope).
  const void* projection() const;

  /// One line per path: the launch sequence, chunking and GEMM algorithms for `rows` rows.
  std::string Describe(int64_t rows) const;

  /// Device memory the plan holds: GEMM workspace, projection buffer, counters.
  size_t device_bytes() const;
  /// cuBLASLt kernels LoadKernels launched (Bf16Gemm::loaded_algorithms), and the kernels this
  /// plan's calls launched since then that no earlier launch had run
  /// (Bf16Gemm::unloaded_launches); both zero when no LoadKernels ran. Safe to read from
  /// another thread.
  size_t loaded_gemm_kernels() const;
  size_t unloaded_gemm_launches() const;
  /// cuBLASLt GEMMs this plan's calls enqueued (Bf16Gemm::runs; LoadKernels' launches are not
  /// counted): none with cutlass_projection. Safe to read from another thread.
  size_t cublaslt_runs() const;
  /// What device_bytes() will be for a plan of `config`, before it is made.
  static size_t DeviceBytesFor(const FusedQkvConfig& config);

 private:
  struct Impl;
  explicit FusedQkvPlan(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ulysses::kernels
