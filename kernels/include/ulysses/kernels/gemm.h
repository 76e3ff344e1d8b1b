// A prepared bf16 GEMM on cuBLASLt for the QKV projection: out[m, n] = x[m, k] @ w[n, k]^T,
// all row-major, fp32 accumulation, bf16 output. Usable from host C++ without CUDA headers.
// Without CUDA, Create returns FAILED_PRECONDITION.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;  // same declaration as the CUDA runtime's

namespace ulysses::kernels {

/// The order in which a loaded Bf16Gemm (Bf16Gemm::Load) tries, for a call of `m` rows whose
/// own algorithm was not loaded, the algorithms loaded at its alignment, given the row counts
/// they were chosen for: indices into `loaded_rows`, those not below `m` first, fewest rows
/// first, then those below `m`, most rows first; equal row counts in load order. Host code;
/// the same with or without CUDA.
std::vector<size_t> PinnedTryOrder(const std::vector<int64_t>& loaded_rows, int64_t m);

/// One (n, k) projection. Owns its cuBLASLt handle, descriptors and a device workspace, all
/// made by Create and Prepare; Run allocates nothing once the row count and the pointer
/// alignment class have been prepared. Not thread-safe: one caller (and one stream at a time).
/// Destroy only after the work it enqueued has completed (the workspace is freed).
class Bf16Gemm {
 public:
  /// Default device workspace of cuBLASLt (Hopper kernels use up to 32 MiB).
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;
  /// The most rows Load's every_row_up_to takes.
  static constexpr int64_t kMaxEveryRowLoad = 4096;

  /// Does cuBLASLt's one-time work on the current device ahead of the first plan, once per
  /// device (later calls return at once): makes one handle (plans take theirs from a
  /// per-device pool and give it back, never destroying it: destruction synchronizes the
  /// device), asks for algorithms and runs a GEMM at a small and a large row count on `stream`
  /// (null: a stream of its own), and waits for it. A process's first plan (which made its
  /// first handle) and its first algorithm query were measured to wait for every stream of the
  /// device, one held at a stream memory operation included (docs/architecture.md, section
  /// 8); the first GEMM is warmed too, lest it do the same. Done at start, none of it happens
  /// while another session's call waits on the GPU for its peer.
  static absl::Status WarmUp(cudaStream_t stream = nullptr);
  /// A GEMM with `n` output features and `k` input features (both positive, k a multiple of 8)
  /// on the current device. With `alloc_stream`, the workspace is allocated and freed in that
  /// stream's order (the stream-ordered allocator, where the device has memory pools), so that
  /// destroying the GEMM waits for no other stream of the device as cudaFree does; the stream
  /// must outlive the GEMM.
  static absl::StatusOr<std::unique_ptr<Bf16Gemm>> Create(
      int64_t n, int64_t k, size_t workspace_bytes = kDefaultWorkspaceBytes,
      cudaStream_t alloc_stream = nullptr);
  ~Bf16Gemm();
  Bf16Gemm(const Bf16Gemm&) = delete;
  Bf16Gemm& operator=(const Bf16Gemm&) = delete;

  /// Builds the descriptors and picks the algorithm for `m` rows with pointers aligned to
  /// 256 bytes (host work only; allocates host memory; the pick is the process's, see
  /// algorithm_queries). Idempotent.
  absl::Status Prepare(int64_t m);

  /// Launches once on `stream` the kernel of each algorithm cuBLASLt picks for the row counts
  /// `ms` at every pointer alignment class `w` allows (256, or w's own alignment, down to 16
  /// bytes; an algorithm must exist at the first, a class below it with none is skipped), each
  /// distinct algorithm once per class (on pointers of that class), reading and writing `scratch`
  /// (device memory of `scratch_bytes`, at least max(ms) * n * 2 and 128 + max(ms) * k * 2
  /// bytes, 256-byte aligned; what is computed is discarded). The first launch of a cuBLASLt
  /// kernel in a process holds the launching thread until every stream of the device is idle
  /// (docs/architecture.md, section 8): this is where it happens. From then on the GEMM is
  /// pinned to what it loaded: a Run whose own algorithm (cuBLASLt's choice for its row count
  /// and alignment) was not launched runs instead the first loaded algorithm of its alignment,
  /// in PinnedTryOrder of the row counts they were chosen for, that cuBLASLt accepts for the
  /// call (cublasLtMatmulAlgoCheck), and its own only when none is (unloaded_launches counts
  /// those). With `every_row_up_to` in (0, kMaxEveryRowLoad], also the pick of every row count
  /// from 1 to it at the most aligned class (256, or w's own alignment), where calls of those
  /// row counts then run cuBLASLt's own pick (scratch must hold that many rows too; a row count
  /// cuBLASLt has no algorithm for is skipped). Nothing waits for the launches to end. May be
  /// called again (more row counts); an error leaves what earlier calls loaded. Allocates host
  /// memory only.
  absl::Status Load(const std::vector<int64_t>& ms, const void* w, void* scratch,
                    size_t scratch_bytes, cudaStream_t stream, int64_t every_row_up_to = 0);

  /// Distinct algorithms (kernels), per alignment class, Load launched. Safe to read from
  /// another thread.
  size_t loaded_algorithms() const;
  /// Distinct algorithms Runs launched since the first Load that no earlier launch had run
  /// (each a possible first launch in the process, where no loaded algorithm was accepted).
  /// Safe to read from another thread.
  size_t unloaded_launches() const;
  /// GEMMs Run enqueued (each a cuBLASLt launch). Safe to read from another thread.
  size_t runs() const;
  /// Algorithm queries (cublasLtMatmulAlgoGetHeuristic) the process's GEMMs made. cuBLASLt's
  /// pick for a row count and alignment class is kept per device, shape (n, k) and workspace
  /// size in the process and shared by every GEMM of that shape (a fused session per layer of
  /// one model asks once); a row count with no algorithm is asked again, and the picks kept
  /// are bounded (all dropped when full, then asked again as they come). Safe to read from any
  /// thread.
  static size_t algorithm_queries();
  /// Drops the process's kept picks (the next Prepare or Load of each row count asks cuBLASLt
  /// again; GEMMs keep what they prepared). Safe to call from any thread.
  static void ForgetPicks();

  /// Enqueues out = x @ w^T for `m` rows on `stream`. x [m, k], w [n, k], out [m, n], device
  /// pointers, 16-byte aligned at least. A row count (or a pointer alignment below 256 bytes)
  /// seen for the first time is prepared here first. INVALID_ARGUMENT for bad arguments,
  /// INTERNAL for a cuBLASLt failure.
  absl::Status Run(const void* x, const void* w, void* out, int64_t m, cudaStream_t stream);

  int64_t n() const;
  int64_t k() const;
  /// Device memory the plan holds (its workspace).
  size_t device_bytes() const;
  /// Name of the algorithm a Run of `m` rows at 256-byte alignment launches (after Prepare;
  /// once loaded, the loaded algorithm it is pinned to), for describe(); empty when not
  /// prepared.
  std::string AlgoDescription(int64_t m) const;

 private:
  struct Impl;
  explicit Bf16Gemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ulysses::kernels
