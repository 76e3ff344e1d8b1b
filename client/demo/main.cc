// ulysses-demo: starts one daemon per rank and one client process per rank, runs a layer's
// exchanges (scatter -> identity attention -> gather, and the head-chunk path), verifies every
// result against the reference, and prints a summary ending with one JSON line.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <limits>
#include <optional>
#include <fstream>
#include <iostream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "demo_lib.h"
#include "ulysses/common/cli.h"
#include "ulysses/common/config.h"
#include "ulysses/common/strings.h"

using ulysses::demo::Workload;

namespace {

constexpr const char* kProgram = "ulysses-demo";

int Fail(const std::string& why) {
  nlohmann::json j = {{"error", why}};
  std::cout << "{\"ok\": false, " << j.dump().substr(1) << std::endl;
  return 1;
}

// "1,4,1" -> {1, 4, 1}: positive head counts, nothing else.
std::optional<std::vector<int32_t>> ParseSchedule(const std::string& text) {
  std::vector<int32_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int32_t v = 0;
    const char* end = item.data() + item.size();
    const auto [ptr, ec] = std::from_chars(item.data(), end, v);
    if (item.empty() || ec != std::errc() || ptr != end || v <= 0) return std::nullopt;
    out.push_back(v);
  }
  if (out.empty() || text.back() == ',') return std::nullopt;
  return out;
}

// The option of ulysses-demo that sets the geometry field a validation message starts with.
std::string OptionOf(std::string_view message) {
  static constexpr std::pair<std::string_view, std::string_view> kFields[] = {
      {"world_size", "--ranks"},   {"num_heads", "--heads"},    {"head_dim", "--head-dim"},
      {"dtype", "--dtype"},        {"schedule", "--schedule"},
      {"max_tokens", "--batch/--seq-local"}};
  for (const auto& [field, option] : kFields)
    if (message.rfind(field, 0) == 0) return std::string(option);
  return "geometry";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ulysses-demo: W daemons and W clients doing a layer's head exchanges"};
  ulysses::cli::Setup(app);
  int ranks = 4;
  std::string backend = "auto", dtype = "bfloat16", ulyssesd, run_dir, schedule_text;
  int64_t batch = 2, seq_local = 64;
  int heads = 0, head_dim = 64, iterations = 3, client_rank = -1;
  double hold = 0;
  std::string backends;
  for (std::string_view b : ulysses::kRunnableBackends)
    backends += (backends.empty() ? "" : " | ") + std::string(b);
  app.add_option("--ranks", ranks, "Sequence-parallel degree W (one daemon per rank)")
      ->check(ulysses::cli::IntIn(1, ulysses::kMaxWorldSize));
  app.add_option("--backend", backend, backends + " (auto picks the best this build runs)")
      ->check(CLI::Validator(
          [](std::string& b) -> std::string {
            for (std::string_view r : ulysses::kRunnableBackends)
              if (b == r) return {};
            return "'" + b + "' is not a backend this build runs";
          },
          ""));
  app.add_option("--batch", batch, "B")->check(ulysses::cli::IntIn(1));
  app.add_option("--seq-local", seq_local, "S_l: tokens per rank")->check(ulysses::cli::IntIn(1));
  app.add_option("--heads", heads, "H, a multiple of W")
      ->check(ulysses::cli::IntIn(1, std::numeric_limits<int32_t>::max()))
      ->default_str("6*W");
  app.add_option("--head-dim", head_dim, "D")
      ->check(ulysses::cli::IntIn(1, std::numeric_limits<int32_t>::max()));
  app.add_option("--dtype", dtype, "bfloat16 | float16 | float32 (bf16, fp16, fp32 also read)")
      ->check(CLI::Validator(
          [](std::string& d) -> std::string {
            return ulysses::ParseDType(d).ok() ? std::string()
                                               : "'" + d + "' is not bfloat16, float16 or float32";
          },
          ""));
  app.add_option("--iterations", iterations, "Layers to run")
      ->check(ulysses::cli::IntIn(1, std::numeric_limits<int32_t>::max()));
  app.add_option("--hold-seconds", hold,
                 "Keep the sessions open this long (to inspect with ulyssesctl)")
      ->check(ulysses::cli::NumberAtLeast(0));
  app.add_option("--ulyssesd", ulyssesd, "Path of ulyssesd")->default_str("next to this program");
  app.add_option("--run-dir", run_dir, "Socket folder")->default_str("a fresh temporary one");
  app.add_option("--schedule", schedule_text,
                 "Head-chunk schedule: positive head counts summing to H/W, e.g. 1,4,1")
      ->default_str("(l, H/W-2l, l)");
  app.add_option("--client-rank", client_rank, "(internal) run one rank's client")->group("");
  if (std::optional<int> rc = ulysses::cli::Parse(app, argc, argv, kProgram)) return *rc;
  if (heads == 0) heads = 6 * ranks;
  const ulysses::DType dt = *ulysses::ParseDType(dtype);  // checked by the option's validator
  std::vector<int32_t> schedule;
  if (!schedule_text.empty()) {
    std::optional<std::vector<int32_t>> parsed = ParseSchedule(schedule_text);
    if (!parsed)
      return ulysses::cli::UsageError(
          kProgram, "--schedule: must be positive head counts separated by commas, got '" +
                        schedule_text + "'");
    schedule = std::move(*parsed);
  }
  // The whole geometry, once, before any daemon starts: the verdict every rank would get.
  {
    ulysses::SessionGeometry g;
    g.world_size = ranks;
    g.num_heads = heads;
    g.head_dim = head_dim;
    g.dtype = dt;
    g.max_tokens = batch * seq_local;
    g.schedule = schedule.empty() ? ulysses::demo::DefaultSchedule(heads / ranks) : schedule;
    if (batch > std::numeric_limits<int64_t>::max() / seq_local) g.max_tokens = -1;
    if (absl::Status s = ulysses::ValidateSessionGeometry(g); !s.ok())
      return ulysses::cli::UsageError(kProgram,
                                      OptionOf(ulysses::StdView(s.message())) + ": " +
                                          std::string(s.message()));
  }

  Workload w;
  w.world_size = ranks;
  w.batch = batch;
  w.seq_local = seq_local;
  w.num_heads = heads;
  w.head_dim = head_dim;
  w.dtype = dt;
  w.schedule = schedule;
  w.iterations = iterations;
  w.hold_seconds = hold;
  w.backend = backend;

  if (client_rank >= 0) {  // one rank's client process
    for (int r = 0; r < ranks; ++r) w.members.push_back(ulysses::StrCat(run_dir, "/gpu", r, ".sock"));
    w.rank = client_rank;
    w.socket = w.members[client_rank];
    ulysses::demo::RankReport rep = ulysses::demo::RunRank(w);
    std::ofstream(ulysses::StrCat(run_dir, "/rank", client_rank, ".json")) << rep.ToJson().dump();
    return rep.ok ? 0 : 1;
  }

  if (ulyssesd.empty()) ulyssesd = ulysses::demo::SiblingProgram("ulyssesd");
  bool own_dir = run_dir.empty();
  if (own_dir) {
    auto d = ulysses::demo::MakeRunDir();
    if (!d.ok()) return Fail(std::string(d.status().message()));
    run_dir = *d;
  }
  std::cout << "ulysses-demo: W=" << ranks << " B=" << batch << " S_l=" << seq_local << " H=" << heads
            << " D=" << head_dim << " dtype=" << ulysses::DTypeName(dt) << " backend=" << backend
            << "\n  sockets in " << run_dir << std::endl;
  const std::string daemon_backend = backend == "auto" ? "auto" : backend;
  // A failed run keeps its folder (daemon logs gpuN.log, rank reports rankN.json) and says so.
  const std::string kept = ulysses::StrCat("logs kept in ", run_dir);
  std::vector<ulysses::demo::DaemonProcess> daemons;
  for (int r = 0; r < ranks; ++r) {
    auto d = ulysses::demo::StartDaemon(ulyssesd, run_dir, r, daemon_backend);
    if (!d.ok()) {
      daemons.clear();
      std::cout << "  " << kept << std::endl;
      return Fail(std::string(d.status().message()));
    }
    daemons.push_back(std::move(*d));
  }
  std::cout << "  " << ranks << " daemons serving" << std::endl;
  std::vector<pid_t> clients;
  std::string self = ulysses::demo::SiblingProgram("ulysses-demo");
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> args = {self, "--client-rank", std::to_string(r), "--run-dir", run_dir};
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--run-dir") { ++i; continue; }
      args.push_back(a);
    }
    const pid_t launcher = getpid();
    pid_t pid = fork();
    if (pid == 0) {
      // A client goes with the demo, as its daemons do (demo::StartDaemon).
      if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher) _exit(127);
      std::vector<char*> av;
      for (auto& a : args) av.push_back(a.data());
      av.push_back(nullptr);
      execv(av[0], av.data());
      _exit(127);
    }
    clients.push_back(pid);
  }
  int failed_clients = 0;
  std::vector<std::string> client_exit(ranks);
  for (int r = 0; r < ranks; ++r) {
    int st = 0;
    waitpid(clients[r], &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    ++failed_clients;
    client_exit[r] = WIFSIGNALED(st) ? ulysses::StrCat("killed by signal ", WTERMSIG(st))
                                     : ulysses::StrCat("exited with status ", WEXITSTATUS(st));
  }
  nlohmann::json ranks_json = nlohmann::json::array();
  bool ok = failed_clients == 0;
  int64_t checks = 0, calls = 0;
  double worst_p50 = 0;
  std::string error;
  std::printf("  %-5s %-4s %-12s %-7s %-10s %-10s %s\n", "rank", "ok", "checks", "calls", "p50_us",
              "max_us", "error");
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(ulysses::StrCat(run_dir, "/rank", r, ".json"));
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) {
      ok = false;
      const std::string why = ulysses::StrCat(
          "rank ", r, ": its client ", client_exit[r].empty() ? "exited" : client_exit[r],
          " without a report");
      if (error.empty()) error = why;
      std::printf("  %-5d %-4s %s\n", r, "NO", why.c_str());
      continue;
    }
    ranks_json.push_back(j);
    ok = ok && j["ok"].get<bool>();
    if (!j["ok"].get<bool>() && error.empty()) error = ulysses::StrCat("rank ", r, ": ", j["error"].get<std::string>());
    checks += j["checks"].get<int64_t>();
    calls += j["calls"].get<int64_t>();
    worst_p50 = std::max(worst_p50, j["p50_us"].get<double>());
    std::printf("  %-5d %-4s %-12lld %-7lld %-10.1f %-10.1f %s\n", r, j["ok"].get<bool>() ? "yes" : "NO",
                static_cast<long long>(j["checks"].get<int64_t>()),
                static_cast<long long>(j["calls"].get<int64_t>()), j["p50_us"].get<double>(),
                j["max_us"].get<double>(), j["error"].get<std::string>().c_str());
  }
  int daemon_failures = 0;
  for (auto& d : daemons) {
    auto st = d.Stop();
    if (!st.ok() || !WIFEXITED(*st) || WEXITSTATUS(*st) != 0) ++daemon_failures;
  }
  if (daemon_failures) {
    ok = false;
    if (error.empty()) error = ulysses::StrCat(daemon_failures, " daemon(s) did not exit cleanly on SIGTERM");
  }
  std::string resolved = ranks_json.empty() ? "" : ranks_json[0].value("backend", "");
  std::string mps = ranks_json.empty() ? "" : ranks_json[0].value("mps", "");
  nlohmann::json summary = {{"ranks", ranks},     {"backend", resolved}, {"mps", mps},
                            {"checks", checks},  {"calls", calls},     {"p50_us_worst_rank", worst_p50},
                            {"batch", batch},    {"seq_local", seq_local}, {"heads", heads},
                            {"head_dim", head_dim}, {"dtype", std::string(ulysses::DTypeName(dt))}};
  if (!ok) summary["error"] = error;
  if (own_dir && ok) ulysses::demo::RemoveRunDir(run_dir);
  std::cout << (ok ? "  all results bit-exact against the reference" : "  FAILED; " + kept)
            << "\n";
  // "ok" first, in the spelling scripts grep for: {"ok": true, ...}
  std::cout << "{\"ok\": " << (ok ? "true" : "false") << ", " << summary.dump().substr(1) << std::endl;
  return ok ? 0 : 1;
}
