// A qkv_norm_rope_exchange session's plan on a GPU backend (nvlink, nccl): the FusedQkvPlan
// made once from the session's setup, and for each row count a call has brought the path its
// calls run, why, and the launches. Built only with CUDA.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "transport.h"
#include "ulysses/kernels/fused_qkv.h"

namespace ulysses::daemon {

/// Who stores a call's result into the destinations' slots.
enum class FusedExchange {
  /// The plan's kernels store straight into every destination's mapped slot, so every path
  /// can run (nvlink).
  kPlanStores,
  /// The plan only computes this rank's normalized projection (FusedQkvPlan::RunNormRope);
  /// the transport moves it (nccl, whose ranks cannot map each other's memory). Only the
  /// per-operator path exists then.
  kTransportMoves,
};

class FusedRunner {
 public:
  /// Makes the plan on the current device (GEMM workspace, projection buffer, second stream,
  /// events): every allocation a call needs. FAILED_PRECONDITION, naming `path`, when the
  /// session asks for a path this runner cannot run. `second_stream` (a cudaStream_t, idle,
  /// outliving the runner): the plan's second stream; null: the plan makes its own.
  /// `setup_stream` (likewise; null: the second stream): where the plan allocates and waits
  /// (kernels::FusedQkvConfig::setup_stream).
  static absl::StatusOr<std::unique_ptr<FusedRunner>> Create(const FusedSetup& setup,
                                                             FusedExchange exchange,
                                                             void* second_stream = nullptr,
                                                             void* setup_stream = nullptr);

  /// The device memory a runner of `setup` holds (its plan's), before it is made.
  static uint64_t DeviceBytesFor(const FusedSetup& setup);

  kernels::FusedQkvPlan& plan() { return *plan_; }
  const kernels::FusedQkvPlan& plan() const { return *plan_; }

  /// The path of a call of `rows` rows. The first call of a row count prepares the plan's
  /// GEMMs for it (host work only: descriptors and algorithm choice, no device allocation) and
  /// records the choice. Called from one thread at a time (the session's call thread, or
  /// its open before any call); Describe may run beside it.
  absl::StatusOr<FusedPath> PreparedPath(int64_t rows);

  /// Loads, on `stream` (a cudaStream_t), the cuBLASLt kernels of every path the session's
  /// calls of 1 to max_tokens rows take (PathsUpTo; FusedQkvPlan::LoadKernels), so that the
  /// first launch of each, which holds the launching thread until every stream of the device
  /// is idle, happens while the session opens and not in a call; then prepares max_tokens.
  /// Called once, before the session serves a call.
  absl::Status LoadKernels(void* stream);

  /// A call's path, why, and the plan's launches for it.
  struct Prepared {
    FusedPath path = FusedPath::kPerOperator;
    std::string why;
    std::string launches;  ///< empty from Rule
  };
  /// The path rule: the path of a call of `rows` rows of a session asking for `asked`, on a
  /// transport where `exchange`, with the epilogue GEMM unavailable for `no_epilogue` (empty:
  /// available), and why.
  static Prepared Rule(FusedPath asked, FusedExchange exchange, const std::string& no_epilogue,
                       int64_t rows);
  /// Whether Rule gives any call of a session asking for `asked` the chunked path, the one
  /// path that runs work on the plan's second stream: only where the session asks for it and
  /// the plan stores (auto never takes it).
  static bool RunsChunked(FusedPath asked, FusedExchange exchange);
  /// Every path Rule gives for 1 to `max_tokens` rows, each with the most rows it is given,
  /// in FusedPath order.
  static std::vector<std::pair<FusedPath, int64_t>> PathsUpTo(FusedPath asked,
                                                              FusedExchange exchange,
                                                              const std::string& no_epilogue,
                                                              int64_t max_tokens);

  /// "path <name>" and, for auto, the rule; then one line per prepared row count: its path,
  /// why, and its launches. Thread-safe.
  std::string Describe() const;

 private:
  FusedRunner(const FusedSetup& setup, FusedExchange exchange) : setup_(setup), exchange_(exchange) {}

  Prepared Choose(int64_t rows) const;
  static kernels::FusedQkvConfig ConfigOf(const FusedSetup& setup);

  const FusedSetup setup_;
  const FusedExchange exchange_;
  // "cublaslt", "cutlass", or cuBLASLt and why the CUTLASS GEMM asked for is not used.
  std::string projection_;
  std::unique_ptr<kernels::FusedQkvPlan> plan_;
  // Calls run on the session's call thread; describe() reads the table from other threads.
  mutable std::mutex mu_;
  std::map<int64_t, Prepared> prepared_;  // at most kMaxPreparedRowCounts
  static constexpr size_t kMaxPreparedRowCounts = 4096;
};

}  // namespace ulysses::daemon
