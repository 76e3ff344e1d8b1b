#include "bench_util.h"

#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::bench {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

}  // namespace

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return v[lo] + (v[hi] - v[lo]) * frac;
}

double Median(const std::vector<double>& v) { return Quantile(v, 0.5); }

double RoundTo(double v, double scale) { return std::round(v * scale) / scale; }

void Append(std::vector<double>* to, const std::vector<double>& from) {
  to->insert(to->end(), from.begin(), from.end());
}

void Log(std::string_view tool, const std::string& line) {
  std::cerr << "[" << tool << "] " << line << std::endl;
}

bool MpsPipePresent() {
  const char* pipe = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = pipe != nullptr && *pipe != '\0' ? pipe : "/tmp/nvidia-mps";
  std::ifstream control(dir + "/control");
  return control.good();
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text << "\n";
  f.close();
  if (!f) return absl::InternalError(StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string UtcNowIso() {
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

absl::StatusOr<BlockTimes> RunBlock(int world, int iterations,
                                    const std::function<absl::Status(int)>& work,
                                    const std::function<absl::Status()>& before_each) {
  BlockTimes out;
  out.iter_us.assign(iterations, 0);
  std::vector<std::vector<double>> work_us(world, std::vector<double>(iterations, 0));
  std::barrier sync(world);
  std::atomic<bool> failed{false};
  std::mutex mu;
  absl::Status first_error;
  auto record = [&](int rank, const absl::Status& s) {
    if (s.ok()) return;
    failed.store(true);
    std::lock_guard<std::mutex> lock(mu);
    if (first_error.ok())
      first_error = rank < 0 ? s : absl::Status(s.code(), StrCat("rank ", rank, ": ", s.message()));
  };
  // Thread 0 runs the untimed preparation; everyone waits for it.
  auto prepare = [&](int rank) {
    if (!before_each) return;
    if (rank == 0 && !failed.load(std::memory_order_relaxed)) record(-1, before_each());
    sync.arrive_and_wait();
  };
  auto body = [&](int rank) {
    // One untimed lead-in iteration: the first one on fresh threads runs on cold stacks and
    // caches, and would bias the first sample of every block.
    prepare(rank);
    sync.arrive_and_wait();
    record(rank, work(rank));
    sync.arrive_and_wait();
    Clock::time_point prev = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      if (before_each) {
        prepare(rank);
        if (rank == 0) prev = Clock::now();
      }
      const Clock::time_point t0 = rank == 0 ? prev : Clock::now();
      if (!failed.load(std::memory_order_relaxed)) record(rank, work(rank));
      work_us[rank][i] = MicrosSince(t0, Clock::now());
      sync.arrive_and_wait();
      if (rank == 0) {
        const Clock::time_point t = Clock::now();
        out.iter_us[i] = MicrosSince(prev, t);
        prev = t;
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  if (!first_error.ok()) return first_error;
  out.work_max_us.assign(iterations, 0);
  for (int i = 0; i < iterations; ++i)
    for (int r = 0; r < world; ++r) out.work_max_us[i] = std::max(out.work_max_us[i], work_us[r][i]);
  return out;
}

absl::Status RunCollective(int world, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { status[r] = fn(r); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r)
    if (!status[r].ok())
      return absl::Status(status[r].code(), StrCat("rank ", r, ": ", status[r].message()));
  return absl::OkStatus();
}

absl::Status Cluster::Start(const std::string& ulyssesd, const std::string& dir, int world,
                            const std::string& backend,
                            const std::vector<std::string>& daemon_args,
                            const std::vector<std::string>& daemon_env) {
  world_ = world;
  backend_ = backend;
  for (int r = 0; r < world; ++r) {
    ULY_ASSIGN_OR_RETURN(demo::DaemonProcess d,
                         demo::StartDaemon(ulyssesd, dir, r, backend, daemon_args,
                                           absl::Seconds(30), daemon_env));
    members_.push_back(d.socket());
    daemons_.push_back(std::move(d));
  }
  return AddClients(true).status();
}

absl::StatusOr<int> Cluster::AddClients(bool use_rings) {
  const int index = static_cast<int>(sets_.size());
  sets_.emplace_back();
  ClientSet& set = sets_.back();
  set.clients.resize(world_);
  for (int r = 0; r < world_; ++r) {
    client::ConnectOptions opts;
    opts.socket = members_[r];
    opts.name = StrCat("bench-rank-", r, "-set-", index);
    opts.connect_timeout = absl::Seconds(30);
    opts.use_rings = use_rings;
    ULY_ASSIGN_OR_RETURN(set.clients[r], client::Client::Connect(opts));
    if (set.clients[r]->uses_rings() != use_rings)
      return absl::FailedPreconditionError(
          StrCat("rank ", r, ": asked for rings ", use_rings ? "on" : "off", ", the client has them ",
                 set.clients[r]->uses_rings() ? "on" : "off"));
    if (set.clients[r]->daemon_backend() != backend_)
      return absl::FailedPreconditionError(StrCat("rank ", r, ": daemon backend is '",
                                                  set.clients[r]->daemon_backend(),
                                                  "', expected '", backend_, "'"));
  }
  set.groups.resize(world_);
  ULY_RETURN_IF_ERROR(RunCollective(world_, [&](int r) -> absl::Status {
    client::GroupSpec spec{StrCat("bench-w", world_, "-set-", index), world_, r, members_,
                           backend_, 0};
    ULY_ASSIGN_OR_RETURN(set.groups[r], set.clients[r]->JoinGroup(spec));
    return absl::OkStatus();
  }));
  return index;
}

absl::Status Cluster::Stop() {
  absl::Status status;
  for (ClientSet& set : sets_)
    for (auto& c : set.clients)
      if (c) status.Update(c->Close());
  sets_.clear();
  for (auto& d : daemons_) {
    absl::StatusOr<int> st = d.Stop();
    if (!st.ok()) {
      status.Update(st.status());
    } else if (!WIFEXITED(*st) || WEXITSTATUS(*st) != 0) {
      status.Update(absl::InternalError(
          StrCat("ulyssesd (pid exit status ", *st, ") did not exit cleanly")));
    }
  }
  daemons_.clear();
  members_.clear();
  return status;
}

}  // namespace ulysses::bench
