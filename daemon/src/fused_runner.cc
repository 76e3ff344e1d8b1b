#include "fused_runner.h"

#include <algorithm>

#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

// The path rule (FusedPath::kAuto) where the plan stores into the slots, from the measurements
// of docs/benchmarks.md (1x H100 under MPS, 2026-12-07, W = 2, 4, 8, hidden 3072 and 4096, 64
// to 32768 rows a call): from 512 rows the epilogue path is the faster (0.83-0.94 of the
// per-operator path from 512 to 2048 rows); at 256 rows it is 0.94-1.09 of it and at 64 and
// 128 rows 0.96-1.01, so below 512 rows the per-operator path runs. Auto never takes the
// chunked path: under MPS its calls (two streams, ordered by events) were seen to wait on the
// GPU for another session's call blocked on its peer (H100 2026-12-05, H100 2026-12-06), which
// the per-operator and epilogue paths never did; below 512 rows it is at most 8% faster than
// the per-operator path, and 0.99-1.11 of it without the epilogue GEMM from 4096 rows
// (2026-12-01). A session may still ask for it.
constexpr int64_t kEpilogueMinRows = 512;
// A plan loads cuBLASLt's pick of every row count the per-operator path runs under the rule.
static_assert(kernels::kFusedEveryRowLoadRows >= kEpilogueMinRows - 1);
// Where the rule can change path (PathsUpTo looks on either side of each).
constexpr int64_t kRuleThresholds[] = {kEpilogueMinRows};

// Line `name` of FusedQkvPlan::Describe (one line per path, each starting with its name).
std::string PlanLine(const std::string& lines, std::string_view name) {
  for (size_t at = 0; at < lines.size();) {
    const size_t end = std::min(lines.find('\n', at), lines.size());
    if (lines.compare(at, name.size(), name) == 0) return lines.substr(at, end - at);
    at = end + 1;
  }
  return {};
}

}  // namespace

kernels::FusedQkvConfig FusedRunner::ConfigOf(const FusedSetup& setup) {
  kernels::FusedQkvConfig c;
  c.world = setup.geometry.world_size;
  c.rank = setup.geometry.rank;
  c.heads = setup.geometry.num_heads;
  c.head_dim = setup.geometry.head_dim;
  c.max_pos = setup.geometry.max_pos;
  c.layout = setup.geometry.layout;
  c.max_tokens = setup.geometry.max_tokens;
  c.weights = setup.weights;
  c.cutlass_projection = setup.cutlass_projection;
  return c;
}

uint64_t FusedRunner::DeviceBytesFor(const FusedSetup& setup) {
  // The most the plan can hold: with cutlass_projection it may still fall back to cuBLASLt
  // (and its workspace) where the epilogue GEMM is unavailable.
  kernels::FusedQkvConfig c = ConfigOf(setup);
  c.cutlass_projection = false;
  return kernels::FusedQkvPlan::DeviceBytesFor(c);
}

absl::StatusOr<std::unique_ptr<FusedRunner>> FusedRunner::Create(const FusedSetup& setup,
                                                                  FusedExchange exchange,
                                                                  void* second_stream,
                                                                  void* setup_stream) {
  if (exchange == FusedExchange::kTransportMoves && setup.path != FusedPath::kAuto &&
      setup.path != FusedPath::kPerOperator)
    return absl::FailedPreconditionError(StrCat(
        "path: ", FusedPathName(setup.path),
        " stores straight into the destinations' slots, which this backend's ranks cannot map; "
        "it runs per_operator (or auto) only"));
  std::unique_ptr<FusedRunner> runner(new FusedRunner(setup, exchange));
  kernels::FusedQkvConfig config = ConfigOf(setup);
  config.second_stream = second_stream;
  config.setup_stream = setup_stream;
  absl::StatusOr<std::unique_ptr<kernels::FusedQkvPlan>> plan =
      kernels::FusedQkvPlan::Create(config);
  if (config.cutlass_projection && plan.status().code() == absl::StatusCode::kFailedPrecondition) {
    // No epilogue GEMM here (not built, not sm_90): the projection stays on cuBLASLt.
    runner->projection_ = StrCat("cublaslt (fused.projection cutlass: ", plan.status().message(), ")");
    config.cutlass_projection = false;
    plan = kernels::FusedQkvPlan::Create(config);
  } else {
    runner->projection_ = config.cutlass_projection ? "cutlass" : "cublaslt";
  }
  ULY_RETURN_IF_ERROR(plan.status());
  runner->plan_ = std::move(*plan);
  const std::string no_epilogue = runner->plan_->EpilogueUnavailable();
  if (setup.path == FusedPath::kEpilogue && !no_epilogue.empty())
    return absl::FailedPreconditionError(
        StrCat("path: the epilogue path cannot run here: ", no_epilogue));
  return runner;
}

FusedRunner::Prepared FusedRunner::Rule(FusedPath asked, FusedExchange exchange,
                                        const std::string& no_epilogue, int64_t rows) {
  Prepared p;
  if (exchange == FusedExchange::kTransportMoves) {
    p.path = FusedPath::kPerOperator;
    p.why = asked == FusedPath::kAuto
                ? "auto: the only path where the transport moves the result"
                : StrCat("the session asks for ", FusedPathName(asked));
  } else if (asked != FusedPath::kAuto) {
    p.path = asked;
    p.why = StrCat("the session asks for ", FusedPathName(asked));
  } else if (no_epilogue.empty() && rows >= kEpilogueMinRows) {
    p.path = FusedPath::kEpilogue;
    p.why = StrCat("auto: from ", kEpilogueMinRows,
                   " rows the epilogue GEMM measured fastest (no projection in memory)");
  } else if (no_epilogue.empty()) {
    p.path = FusedPath::kPerOperator;
    p.why = StrCat("auto: under ", kEpilogueMinRows,
                   " rows per_operator (chunked is at most 8% faster and can wait for another "
                   "session's blocked call under MPS)");
  } else {
    p.path = FusedPath::kPerOperator;
    p.why = StrCat("auto: no epilogue GEMM (", no_epilogue,
                   "); per_operator (chunked is at most 11% faster and can wait for another "
                   "session's blocked call under MPS)");
  }
  return p;
}

bool FusedRunner::RunsChunked(FusedPath asked, FusedExchange exchange) {
  return exchange == FusedExchange::kPlanStores && asked == FusedPath::kChunked;
}

std::vector<std::pair<FusedPath, int64_t>> FusedRunner::PathsUpTo(FusedPath asked,
                                                                  FusedExchange exchange,
                                                                  const std::string& no_epilogue,
                                                                  int64_t max_tokens) {
  // The rule changes path only at its thresholds, so the row counts on either side of each
  // find every path it takes and the most rows of each.
  std::vector<int64_t> probes = {1, max_tokens};
  for (int64_t t : kRuleThresholds) {
    probes.push_back(t - 1);
    probes.push_back(t);
  }
  std::map<FusedPath, int64_t> most;
  for (int64_t rows : probes) {
    if (rows < 1 || rows > max_tokens) continue;
    int64_t& m = most[Rule(asked, exchange, no_epilogue, rows).path];
    m = std::max(m, rows);
  }
  return {most.begin(), most.end()};
}

FusedRunner::Prepared FusedRunner::Choose(int64_t rows) const {
  Prepared p = Rule(setup_.path, exchange_, plan_->EpilogueUnavailable(), rows);
  p.launches = PlanLine(plan_->Describe(rows), FusedPathName(p.path));
  if (exchange_ == FusedExchange::kTransportMoves) {
    // The plan's line ends in its own stores; here the transport's exchange follows instead.
    const size_t stores = p.launches.find(" -> scatter");
    if (stores != std::string::npos) p.launches.resize(stores);
    p.launches += " in place, then the transport's exchange";
  }
  return p;
}

absl::StatusOr<FusedPath> FusedRunner::PreparedPath(int64_t rows) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = prepared_.find(rows);
    if (it != prepared_.end()) return it->second.path;
  }
  ULY_RETURN_IF_ERROR(plan_->Prepare(rows));
  Prepared p = Choose(rows);
  const FusedPath path = p.path;
  std::lock_guard<std::mutex> lock(mu_);
  // Bounded: a client calling at every row count up to a large max_tokens would otherwise grow
  // this without end. Another row count than max_tokens makes room (it is prepared again, with
  // host work only, if it comes back).
  if (prepared_.size() >= kMaxPreparedRowCounts && prepared_.count(rows) == 0) {
    auto victim = prepared_.begin();
    if (victim->first == setup_.geometry.max_tokens) ++victim;
    prepared_.erase(victim);
  }
  prepared_[rows] = std::move(p);
  return path;
}

absl::Status FusedRunner::LoadKernels(void* stream) {
  for (const auto& [path, rows] : PathsUpTo(setup_.path, exchange_, plan_->EpilogueUnavailable(),
                                            setup_.geometry.max_tokens)) {
    ULY_RETURN_IF_ERROR(plan_->LoadKernels(rows, path, static_cast<cudaStream_t>(stream)));
  }
  // max_tokens, prepared after the loads: its line in describe() names the loaded algorithm.
  return PreparedPath(setup_.geometry.max_tokens).status();
}

std::string FusedRunner::Describe() const {
  const std::string no_epilogue = plan_->EpilogueUnavailable();
  std::string out = StrCat("path ", FusedPathName(setup_.path));
  if (setup_.path == FusedPath::kAuto) {
    if (exchange_ == FusedExchange::kTransportMoves)
      out += " (rule: per_operator, the only path where the transport moves the result)";
    else if (no_epilogue.empty())
      out += StrCat(" (rule: epilogue from ", kEpilogueMinRows, " rows, per_operator below)");
    else
      out += " (rule: per_operator; no epilogue GEMM)";
  }
  out += StrCat("\nprojection GEMM: ", projection_, "; cuBLASLt kernels loaded at open: ",
                plan_->loaded_gemm_kernels(),
                "; cuBLASLt kernels first launched by calls since: ",
                plan_->unloaded_gemm_launches(), "; cuBLASLt GEMMs run by calls: ",
                plan_->cublaslt_runs());
  std::lock_guard<std::mutex> lock(mu_);
  if (prepared_.empty()) out += "\nno row count prepared yet";
  for (const auto& [rows, p] : prepared_)
    out += StrCat("\nrows ", rows, ": ", FusedPathName(p.path), " (", p.why, "): ", p.launches);
  return out;
}

}  // namespace ulysses::daemon
