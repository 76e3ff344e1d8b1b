// ulysses-bench: the daemon path against the same kernels run in-process, on the host backend,
// measured side by side in one run (DESIGN.md section 8, "daemon overhead").
//
// A (in-process): W threads in this process. Each owns its input and an output of the op's
// output size; per iteration every thread writes its block into every destination's output
// with the kernels' block reference, then the threads meet at a barrier.
// B (daemon path): W ulyssesd processes (host backend) and W client threads in this process,
// one Client per rank with rings on; per iteration every rank makes the call with out= a
// preallocated buffer, then the ranks meet at a barrier.
//
// One sample is one iteration: the time between two barrier completions, seen from thread 0,
// i.e. the slowest rank's time (per-rank max) plus the barrier. Method: outputs checked bit for
// bit (B against A) before timing, warm-up, rounds in A/B/B/A order, median of all samples per
// side, and an A/A control (A's first half of each round against its second half).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench_util.h"
#include "demo_lib.h"
#include "nlohmann/json.hpp"
#include "ulysses/client/client.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/kernels/exchange.h"
#include "ulysses/kernels/reference.h"

namespace ulysses::bench {
namespace {

using Json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------
// A case of the grid
// ---------------------------------------------------------------------------------------

struct Case {
  int32_t world = 2;
  OpKind op = OpKind::kScatterHeads;
  int64_t batch = 1;
  int64_t seq_local = 64;
  int32_t heads = 16;
  int32_t head_dim = 128;
  DType dtype = DType::kBFloat16;

  int32_t itemsize() const { return ItemSize(dtype); }
  // Input and output of both ops hold B*S_l*H*D elements per rank.
  uint64_t elems() const { return static_cast<uint64_t>(batch * seq_local) * heads * head_dim; }
  uint64_t bytes() const { return elems() * itemsize(); }
  kernels::ExchangeShape shape() const {
    return {world, batch, seq_local, heads, head_dim, itemsize()};
  }
  std::string name() const {
    return StrCat("W=", world, " ", OpName(op), " S_l=", seq_local);
  }
};

// Pattern of rank r's input: tensor 0 for scatter_heads' x, tensor 3 for gather_heads' y.
int PatternTensor(OpKind op) { return op == OpKind::kScatterHeads ? 0 : 3; }

void FillPattern(void* data, const Case& c, int rank) {
  const int es = c.itemsize(), tensor = PatternTensor(c.op);
  for (uint64_t i = 0; i < c.elems(); ++i) {
    const uint32_t bits = demo::PatternBits(rank, tensor, i, es);
    if (es == 2) {
      const uint16_t v = static_cast<uint16_t>(bits);
      std::memcpy(static_cast<uint8_t*>(data) + i * 2, &v, 2);
    } else {
      std::memcpy(static_cast<uint8_t*>(data) + i * 4, &bits, 4);
    }
  }
}

// All bits set: a NaN in every dtype, and never a value of the pattern.
void Poison(void* data, uint64_t bytes) { std::memset(data, 0xFF, bytes); }

// The first differing element of two buffers, or -1.
int64_t FirstDifference(const void* a, const void* b, uint64_t bytes, int itemsize) {
  if (std::memcmp(a, b, bytes) == 0) return -1;
  const auto* pa = static_cast<const uint8_t*>(a);
  const auto* pb = static_cast<const uint8_t*>(b);
  for (uint64_t i = 0; i < bytes; ++i)
    if (pa[i] != pb[i]) return static_cast<int64_t>(i / itemsize);
  return -1;
}

// ---------------------------------------------------------------------------------------
// A: the kernels in-process
// ---------------------------------------------------------------------------------------

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using HostBytes = std::unique_ptr<uint8_t, AlignedFree>;

HostBytes AllocHost(uint64_t bytes) {
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
  if (p) std::memset(p, 0, rounded);  // touch every page before timing
  return HostBytes(p);
}

class InProcess {
 public:
  explicit InProcess(const Case& c) : c_(c) {
    for (int r = 0; r < c.world; ++r) {
      in_.push_back(AllocHost(c.bytes()));
      out_.push_back(AllocHost(c.bytes()));
      FillPattern(in_.back().get(), c, r);
    }
  }
  bool ok() const {
    for (int r = 0; r < c_.world; ++r)
      if (!in_[r] || !out_[r]) return false;
    return true;
  }

  /// Rank `src`'s part of one iteration: its block into every destination's output, in the
  /// daemon's rotated order (src+1, ..., src).
  absl::Status Work(int src) {
    const kernels::ExchangeShape shape = c_.shape();
    const int W = c_.world;
    for (int k = 1; k <= W; ++k) {
      const int dst = (src + k) % W;
      if (c_.op == OpKind::kScatterHeads) {
        kernels::ScatterHeadsBlockRef(
            shape, kernels::ContiguousConstView(in_[src].get(), c_.seq_local, c_.heads, c_.head_dim),
            src, dst, out_[dst].get());
      } else {
        kernels::GatherHeadsBlockRef(
            shape,
            kernels::ContiguousConstView(in_[src].get(), W * c_.seq_local, c_.heads / W, c_.head_dim),
            src, dst, out_[dst].get());
      }
    }
    return absl::OkStatus();
  }

  const uint8_t* in(int r) const { return in_[r].get(); }
  uint8_t* out(int r) { return out_[r].get(); }

 private:
  Case c_;
  std::vector<HostBytes> in_, out_;
};

/// Checks A's outputs against the whole-collective reference of the kernels.
absl::Status CheckAgainstReference(const Case& c, InProcess& a) {
  const int W = c.world;
  std::vector<kernels::ConstView> views;
  for (int r = 0; r < W; ++r) {
    views.push_back(c.op == OpKind::kScatterHeads
                        ? kernels::ContiguousConstView(a.in(r), c.seq_local, c.heads, c.head_dim)
                        : kernels::ContiguousConstView(a.in(r), W * c.seq_local, c.heads / W,
                                                       c.head_dim));
  }
  ULY_ASSIGN_OR_RETURN(std::vector<kernels::HostBuffer> ref,
                       c.op == OpKind::kScatterHeads ? kernels::ScatterHeadsRef(c.shape(), views)
                                                     : kernels::GatherHeadsRef(c.shape(), views));
  for (int r = 0; r < W; ++r) {
    if (ref[r].size() != c.bytes())
      return absl::InternalError(StrCat("reference output of rank ", r, " has ", ref[r].size(),
                                        " bytes, expected ", c.bytes()));
    const int64_t e = FirstDifference(a.out(r), ref[r].data(), c.bytes(), c.itemsize());
    if (e >= 0)
      return absl::DataLossError(StrCat("in-process output of rank ", r, " differs from the "
                                        "kernels' reference at element ", e));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// B: the daemon path
// ---------------------------------------------------------------------------------------

/// One case on the daemon path: a session per rank and its input and out= buffers.
class DaemonPath {
 public:
  DaemonPath(const Case& c, Cluster& cluster) : c_(c), cluster_(cluster) {}
  ~DaemonPath() { (void)Close(); }

  absl::Status Open() {
    const int W = c_.world;
    sessions_.resize(W);
    in_.resize(W);
    out_.resize(W);
    ULY_RETURN_IF_ERROR(RunCollective(W, [&](int r) -> absl::Status {
      client::SessionSpec spec;
      spec.num_heads = c_.heads;
      spec.head_dim = c_.head_dim;
      spec.dtype = c_.dtype;
      spec.max_tokens = c_.batch * c_.seq_local;
      spec.num_slots = 2;
      ULY_ASSIGN_OR_RETURN(sessions_[r], cluster_.client(r).CreateSession(cluster_.group(r), spec));
      return absl::OkStatus();
    }));
    for (int r = 0; r < W; ++r) {
      ULY_ASSIGN_OR_RETURN(in_[r], cluster_.client(r).AllocBuffer(c_.bytes(), "bench-in"));
      ULY_ASSIGN_OR_RETURN(out_[r], cluster_.client(r).AllocBuffer(c_.bytes(), "bench-out"));
      FillPattern(in_[r].data, c_, r);
    }
    return absl::OkStatus();
  }

  /// Rank r's call of one iteration, into its preallocated out= buffer (no slot is held).
  absl::Status Work(int r) {
    client::Session& s = *sessions_[r];
    absl::StatusOr<client::Result> res =
        c_.op == OpKind::kScatterHeads
            ? s.ScatterHeads(in_[r].Ref(), c_.batch, c_.seq_local, out_[r].Ref())
            : s.GatherHeads(in_[r].Ref(), c_.batch, c_.world * c_.seq_local, out_[r].Ref());
    if (!res.ok()) return res.status();
    if (res->held()) return absl::InternalError("a call with out= holds a slot");
    return absl::OkStatus();
  }

  uint8_t* out(int r) { return static_cast<uint8_t*>(out_[r].data); }

  absl::Status Close() {
    absl::Status status;
    for (size_t r = 0; r < sessions_.size(); ++r) {
      if (sessions_[r]) status.Update(sessions_[r]->Close());
      sessions_[r].reset();
      if (in_[r].id) status.Update(cluster_.client(r).FreeBuffer(in_[r].id));
      if (out_[r].id) status.Update(cluster_.client(r).FreeBuffer(out_[r].id));
      in_[r] = {};
      out_[r] = {};
    }
    sessions_.clear();
    return status;
  }

 private:
  Case c_;
  Cluster& cluster_;
  std::vector<std::unique_ptr<client::Session>> sessions_;
  std::vector<client::Buffer> in_, out_;
};

// ---------------------------------------------------------------------------------------
// One case: check, warm up, A/B/B/A rounds
// ---------------------------------------------------------------------------------------

struct Method {
  int warmup = 5;
  int rounds = 5;
  int samples = 20;  ///< per side per round, split over the side's two blocks
};

struct SideResult {
  std::vector<double> iter_us, work_max_us;
  Json ToJson() const {
    Json j;
    j["median_us"] = Us(Median(iter_us));
    j["min_us"] = Us(iter_us.empty() ? 0 : *std::min_element(iter_us.begin(), iter_us.end()));
    j["p90_us"] = Us(Quantile(iter_us, 0.9));
    j["samples"] = iter_us.size();
    j["work_max_median_us"] = Us(Median(work_max_us));
    return j;
  }
};

struct CaseResult {
  Case c;
  SideResult a, b;
  std::vector<double> a_first, a_second, b_first, b_second;  // per block position in the round
  std::vector<double> aa_per_round;
  double ratio = 0, aa = 0, bb = 0;
};

void Log(const std::string& line) { bench::Log("ulysses-bench", line); }

absl::StatusOr<CaseResult> RunCase(const Case& c, Cluster& cluster, const Method& m) {
  CaseResult res;
  res.c = c;
  const int W = c.world;
  InProcess a(c);
  if (!a.ok()) return absl::ResourceExhaustedError(StrCat("cannot allocate ", c.bytes(), " bytes"));
  DaemonPath b(c, cluster);
  ULY_RETURN_IF_ERROR(b.Open());
  auto a_work = [&](int r) { return a.Work(r); };
  auto b_work = [&](int r) { return b.Work(r); };

  // Outputs first: B's out= must equal A's output bit for bit, on the same inputs.
  for (int r = 0; r < W; ++r) {
    Poison(a.out(r), c.bytes());
    Poison(b.out(r), c.bytes());
  }
  ULY_RETURN_IF_ERROR(RunBlock(W, 1, a_work).status());
  ULY_RETURN_IF_ERROR(CheckAgainstReference(c, a));
  ULY_RETURN_IF_ERROR(RunBlock(W, 1, b_work).status());
  for (int r = 0; r < W; ++r) {
    const int64_t e = FirstDifference(b.out(r), a.out(r), c.bytes(), c.itemsize());
    if (e >= 0)
      return absl::DataLossError(StrCat("daemon path output of rank ", r,
                                        " differs from the in-process output at element ", e));
  }
  Log(StrCat(c.name(), ": check passed (daemon out= equals in-process output bit for bit, ",
             W, " ranks x ", c.bytes(), " bytes)"));

  if (m.warmup > 0) {
    ULY_RETURN_IF_ERROR(RunBlock(W, m.warmup, a_work).status());
    ULY_RETURN_IF_ERROR(RunBlock(W, m.warmup, b_work).status());
  }
  const int n1 = (m.samples + 1) / 2, n2 = m.samples / 2;
  for (int round = 0; round < m.rounds; ++round) {
    ULY_ASSIGN_OR_RETURN(BlockTimes a1, RunBlock(W, n1, a_work));
    ULY_ASSIGN_OR_RETURN(BlockTimes b1, RunBlock(W, n1, b_work));
    BlockTimes b2, a2;
    if (n2 > 0) {
      ULY_ASSIGN_OR_RETURN(b2, RunBlock(W, n2, b_work));
      ULY_ASSIGN_OR_RETURN(a2, RunBlock(W, n2, a_work));
    }
    for (const BlockTimes* t : {&a1, &a2}) {
      Append(&res.a.iter_us, t->iter_us);
      Append(&res.a.work_max_us, t->work_max_us);
    }
    for (const BlockTimes* t : {&b1, &b2}) {
      Append(&res.b.iter_us, t->iter_us);
      Append(&res.b.work_max_us, t->work_max_us);
    }
    Append(&res.a_first, a1.iter_us);
    Append(&res.a_second, a2.iter_us);
    Append(&res.b_first, b1.iter_us);
    Append(&res.b_second, b2.iter_us);
    if (!a2.iter_us.empty())
      res.aa_per_round.push_back(Median(a2.iter_us) / Median(a1.iter_us));
    Log(StrCat(c.name(), ": round ", round + 1, "/", m.rounds, "  A median ",
               static_cast<int64_t>(Median(a1.iter_us)), "|",
               static_cast<int64_t>(Median(a2.iter_us)), " us  B median ",
               static_cast<int64_t>(Median(b1.iter_us)), "|",
               static_cast<int64_t>(Median(b2.iter_us)), " us"));
  }
  res.ratio = Median(res.b.iter_us) / Median(res.a.iter_us);
  res.aa = res.a_second.empty() ? 0 : Median(res.a_second) / Median(res.a_first);
  res.bb = res.b_second.empty() ? 0 : Median(res.b_second) / Median(res.b_first);
  ULY_RETURN_IF_ERROR(b.Close());
  return res;
}

Json CaseJson(const CaseResult& r, const Method& m) {
  Json j;
  j["world"] = r.c.world;
  j["op"] = std::string(OpName(r.c.op));
  j["dtype"] = std::string(DTypeName(r.c.dtype));
  j["batch"] = r.c.batch;
  j["heads"] = r.c.heads;
  j["head_dim"] = r.c.head_dim;
  j["seq_local"] = r.c.seq_local;
  j["bytes_per_rank"] = r.c.bytes();
  j["check"] = "pass";
  j["warmup"] = m.warmup;
  j["rounds"] = m.rounds;
  j["samples_per_side_per_round"] = m.samples;
  j["a_inprocess"] = r.a.ToJson();
  j["b_daemon"] = r.b.ToJson();
  j["b_over_a"] = Ratio(r.ratio);
  j["a_a_control"] = Ratio(r.aa);
  Json per_round = Json::array();
  for (double v : r.aa_per_round) per_round.push_back(Ratio(v));
  j["a_a_per_round"] = per_round;
  j["b_b_control"] = Ratio(r.bb);
  return j;
}

absl::StatusOr<OpKind> ParseOp(const std::string& s) {
  if (s == "scatter_heads") return OpKind::kScatterHeads;
  if (s == "gather_heads") return OpKind::kGatherHeads;
  return absl::InvalidArgumentError(StrCat("unknown op '", s, "' (scatter_heads | gather_heads)"));
}

int Fail(const absl::Status& s) {
  std::cerr << "[ulysses-bench] FAILED: " << s << std::endl;
  return 1;
}

int Main(int argc, char** argv) {
  CLI::App app{"ulysses-bench: the daemon path against the same kernels in-process (host backend)"};
  std::vector<int> ranks = {2, 4};
  std::vector<std::string> ops = {"scatter_heads", "gather_heads"};
  std::vector<int64_t> seq_locals = {64, 512, 2048};
  int64_t batch = 1;
  int heads_per_rank = 8, head_dim = 128;
  std::string dtype_name = "bf16", json_file, ulyssesd;
  Method m;
  app.add_option("--ranks", ranks, "World sizes W (one daemon per rank)")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  app.add_option("--ops", ops, "scatter_heads and/or gather_heads")->delimiter(',');
  app.add_option("--seq-local", seq_locals, "S_l values: tokens per rank")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "B")->check(CLI::PositiveNumber);
  app.add_option("--heads-per-rank", heads_per_rank, "H/W (H = this times W)")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim, "D")->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype_name, "bf16 | fp16 | fp32");
  app.add_option("--warmup", m.warmup, "Untimed iterations per side before the rounds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", m.rounds, "A/B/B/A rounds")->check(CLI::PositiveNumber);
  app.add_option("--samples", m.samples, "Samples per side per round (split over its two blocks)")
      ->check(CLI::Range(2, 1000000));
  app.add_option("--json", json_file, "Also write the JSON line to this file");
  app.add_option("--ulyssesd", ulyssesd, "Path of ulyssesd (default: from this build)");
  CLI11_PARSE(app, argc, argv);

  absl::StatusOr<DType> dtype = ParseDType(dtype_name);
  if (!dtype.ok()) return Fail(dtype.status());
  std::vector<OpKind> op_kinds;
  for (const std::string& s : ops) {
    absl::StatusOr<OpKind> op = ParseOp(s);
    if (!op.ok()) return Fail(op.status());
    op_kinds.push_back(*op);
  }
  if (ulyssesd.empty()) ulyssesd = demo::SiblingProgram("ulyssesd");

  absl::StatusOr<std::string> run_dir = demo::MakeRunDir();
  if (!run_dir.ok()) return Fail(run_dir.status());
  std::vector<CaseResult> results;
  absl::Status status;
  for (int W : ranks) {
    const std::string dir = StrCat(*run_dir, "/w", W);
    if (::mkdir(dir.c_str(), 0700) != 0) {
      status = ErrnoError(StrCat("mkdir ", dir), errno);
      break;
    }
    Log(StrCat("W=", W, ": starting ", W, " ulyssesd (host backend)"));
    Cluster cluster;
    status = cluster.Start(ulyssesd, dir, W, "host");
    for (OpKind op : op_kinds) {
      for (int64_t sl : seq_locals) {
        if (!status.ok()) break;
        Case c;
        c.world = W;
        c.op = op;
        c.batch = batch;
        c.seq_local = sl;
        c.heads = heads_per_rank * W;
        c.head_dim = head_dim;
        c.dtype = *dtype;
        Log(StrCat(c.name(), ": ", c.bytes(), " bytes per rank"));
        absl::StatusOr<CaseResult> r = RunCase(c, cluster, m);
        if (!r.ok()) {
          status = absl::Status(r.status().code(), StrCat(c.name(), ": ", r.status().message()));
          break;
        }
        Log(StrCat(c.name(), ": A ", Median(r->a.iter_us), " us, B ", Median(r->b.iter_us),
                   " us, B/A ", r->ratio, ", A/A ", r->aa));
        results.push_back(std::move(*r));
      }
    }
    status.Update(cluster.Stop());
    if (!status.ok()) break;
  }
  demo::RemoveRunDir(*run_dir);
  if (!status.ok()) return Fail(status);

  std::printf("daemon path (B) vs in-process kernels (A), host backend; B=%lld D=%d %s, H=%d*W\n",
              static_cast<long long>(batch), head_dim, std::string(DTypeName(*dtype)).c_str(),
              heads_per_rank);
  std::printf("%3s  %-13s %6s %12s %12s %12s %7s %7s\n", "W", "op", "S_l", "bytes/rank",
              "A med us", "B med us", "B/A", "A/A");
  Json cases = Json::array();
  for (const CaseResult& r : results) {
    std::printf("%3d  %-13s %6lld %12llu %12.1f %12.1f %7.2f %7.3f\n", r.c.world,
                std::string(OpName(r.c.op)).c_str(), static_cast<long long>(r.c.seq_local),
                static_cast<unsigned long long>(r.c.bytes()), Median(r.a.iter_us),
                Median(r.b.iter_us), r.ratio, r.aa);
    cases.push_back(CaseJson(r, m));
  }
  Json out;
  out["bench"] = "daemon_vs_inprocess";
  out["backend"] = "host";
  out["cases"] = cases;
  const std::string line = out.dump();
  if (!json_file.empty())
    if (absl::Status s = WriteTextFile(json_file, line); !s.ok()) return Fail(s);
  std::cout << line << std::endl;
  return 0;
}

}  // namespace
}  // namespace ulysses::bench

int main(int argc, char** argv) { return ulysses::bench::Main(argc, argv); }
